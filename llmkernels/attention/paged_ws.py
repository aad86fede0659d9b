"""Batch decode over a paged KV cache for Hopper (sm_90), in Gluon: persistent, warp-specialized, fed by TMA.

Work units are (decode tile, KV head, split): the GROUP query heads of one KV head for one sequence's next token,
over one split of its keys. A persistent grid of one program per SM walks the units u = pid, pid + P, ...; two
partitions of the program walk the same list:

- the loader (default partition, 4 warps, one thread issuing) reads each tile's page ids one tile ahead and copies
  K and V pages with TMA into a ring of STAGES slots of BLOCK_N keys (``k_ready`` / ``v_ready`` with transaction
  counts, ``kv_empty`` when the consumer is done). It runs ahead across unit boundaries, so the next unit's first
  pages are in flight while this one finishes: no per-unit pipeline fill;
- the consumer (one warp group): S = Q K^T and O += P V with wgmma (the GROUP query rows padded to 64), the online
  softmax, and the unit's output: the final O, or with splits a float32 partial and its LSE, which the last split
  unit of each (tile, KV head) to finish merges (arrival counters; ``combine_kernel`` when there are none).

Pages past a sequence's last one read row ``num_pages * page_size``, past the cache: TMA fills them with zeros and
counts their bytes, so every copy of a tile is issued and the barrier's byte count always matches. Keys past the
unit's range are masked out of the scores.

Scope (``plan._ws_decode`` and ``paged._ws_decode_call``): decode batches (one query per sequence), fp16/bf16 caches,
page size 8, 16, 32 or a multiple of 64, head dim 64 or 128, GROUP <= 64, contiguous caches, no left window, softcap,
sinks, custom mask or LSE output, and at least WS_DECODE_MIN_BYTES of K/V per call. The Triton kernel serves the
rest.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ._gluon import LN2, row_descriptor, tile_desc_type
from ._gluon import compile_sm90 as _compile_sm90


@gluon.jit
def _unit(u, TILE_SEQ, SEQ_LENS, num_kv_heads, num_splits, BLOCK_N: gl.constexpr):
    """(sequence, kv head, split, first key, last key + 1) of work unit u."""
    per_tile = num_kv_heads * num_splits
    b = gl.load(TILE_SEQ + u // per_tile)
    hk = (u % per_tile) // num_splits
    split = u % num_splits
    k_len = gl.load(SEQ_LENS + b)
    chunk = ((k_len + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    lo = gl.minimum(split * chunk, k_len)
    hi = gl.minimum(lo + chunk, k_len)
    return b, hk, split, lo, hi


@gluon.jit
def _page_rows(pt_row, key0, n_pages, num_pages, PAGE_SIZE: gl.constexpr, NSUB: gl.constexpr,
               ROWS: gl.constexpr, layout: gl.constexpr):
    """Cache rows (page * PAGE_SIZE + offset) of the NSUB sub-tiles of ROWS keys from key0; past the sequence's
    pages, the row past the cache (TMA reads zeros there)."""
    sub = gl.arange(0, NSUB, layout=layout)
    key = key0 + sub * ROWS
    pg = key // PAGE_SIZE
    page = gl.load(pt_row + pg, mask=pg < n_pages, other=num_pages)
    return page * PAGE_SIZE + key % PAGE_SIZE


@gluon.jit
def _balanced_range(CU_T, PSTART, NUM_TILES):
    """The balanced (stream-K) split: program pid of P = min(grid, T) takes global tiles [pid * T // P, (pid + 1) *
    T // P) of the T = CU_T[num_tiles] tiles (decode tile i's kv head h, key tile j is global tile CU_T[i] + h *
    n_i + j, n_i key tiles per head). -> (first tile, end, decode tile of the first, P, T)."""
    T = gl.load(CU_T + gl.load(NUM_TILES))
    P = gl.maximum(gl.minimum(gl.num_programs(0), T), 1)
    pid = gl.program_id(0)
    g0 = (pid.to(gl.int64) * T // P).to(gl.int32)
    g1 = gl.where(pid < P, ((pid + 1).to(gl.int64) * T // P).to(gl.int32), g0)
    return g0, g1, gl.load(PSTART + pid), P, T


@gluon.jit
def _piece(g, g1, ti, CU_T, num_kv_heads):
    """The piece of a balanced range from global tile g (end g1) inside decode tile ti: (kv head, first key tile,
    key tiles in the piece, the unit's first global tile, key tiles in the unit)."""
    base = gl.load(CU_T + ti)
    n = (gl.load(CU_T + ti + 1) - base) // num_kv_heads
    hk = (g - base) // n
    t0 = g - base - hk * n
    return hk, t0, gl.minimum(n - t0, g1 - g), base + hk * n, n


@gluon.jit
def _load_keys(desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, kv_empty, pt_row, n_pages, col, lo, hi, c,
               num_pages, sub, sub_layout: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr,
               STAGES: gl.constexpr):
    """Copy the K and V tiles of keys [lo, hi) of one (sequence, kv head) into the ring; -> the ring counter."""
    ROWS: gl.constexpr = desc_k.block_type.shape[0]
    NSUB: gl.constexpr = BLOCK_N // ROWS
    rows = _page_rows(pt_row, lo, n_pages, num_pages, PAGE_SIZE, NSUB, ROWS, sub_layout)
    for start in range(lo, hi, BLOCK_N):
        # the next tile's page ids load while this tile's copies are issued (used one iteration later)
        nxt = _page_rows(pt_row, start + BLOCK_N, n_pages, num_pages, PAGE_SIZE, NSUB, ROWS, sub_layout)
        s = c % STAGES
        mbarrier.wait(kv_empty.index(s), ((c // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(s), NSUB * desc_k.block_type.nbytes)
        for r in gl.static_range(NSUB):
            row = gl.sum(gl.where(sub == r, rows, 0), axis=0)
            tma.async_copy_global_to_shared(desc_k, [row, col], k_ready.index(s),
                                            k_smem.index(s).slice(r * ROWS, ROWS))
        mbarrier.expect(v_ready.index(s), NSUB * desc_v.block_type.nbytes)
        for r in gl.static_range(NSUB):
            row = gl.sum(gl.where(sub == r, rows, 0), axis=0)
            tma.async_copy_global_to_shared(desc_v, [row, col], v_ready.index(s),
                                            v_smem.index(s).slice(r * ROWS, ROWS))
        rows = nxt
        c += 1
    return c


@gluon.jit
def _loader(desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, kv_empty, PAGE_TABLE, SEQ_LENS, TILE_SEQ, NUM_TILES,
            CU_T, PSTART, stride_pt, num_kv_heads, num_pages, num_splits, HEAD_DIM: gl.constexpr,
            BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr, BALANCED: gl.constexpr):
    ROWS: gl.constexpr = desc_k.block_type.shape[0]
    NSUB: gl.constexpr = BLOCK_N // ROWS
    # every thread holds all NSUB rows: picking one out is a few selects in registers, no cross-warp reduction
    sub_layout: gl.constexpr = gl.BlockedLayout([NSUB], [32], [gl.num_warps()], [0])
    sub = gl.arange(0, NSUB, layout=sub_layout)
    c = 0
    if BALANCED:
        g, g1, ti, _, _ = _balanced_range(CU_T, PSTART, NUM_TILES)
        while g < g1:
            hk, t0, nt, _, n = _piece(g, g1, ti, CU_T, num_kv_heads)
            b = gl.load(TILE_SEQ + ti)
            k_len = gl.load(SEQ_LENS + b)
            c = _load_keys(desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, kv_empty,
                           PAGE_TABLE + b.to(gl.int64) * stride_pt, (k_len + PAGE_SIZE - 1) // PAGE_SIZE,
                           hk * HEAD_DIM, t0 * BLOCK_N, gl.minimum((t0 + nt) * BLOCK_N, k_len), c, num_pages, sub,
                           sub_layout, BLOCK_N, PAGE_SIZE, STAGES)
            g += nt
            ti += ((t0 + nt == n) & (hk == num_kv_heads - 1)).to(gl.int32)
    else:
        n_units = gl.load(NUM_TILES) * num_kv_heads * num_splits
        for u in range(gl.program_id(0), n_units, gl.num_programs(0)):
            b, hk, _, lo, hi = _unit(u, TILE_SEQ, SEQ_LENS, num_kv_heads, num_splits, BLOCK_N)
            n_pages = (gl.load(SEQ_LENS + b) + PAGE_SIZE - 1) // PAGE_SIZE
            c = _load_keys(desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, kv_empty,
                           PAGE_TABLE + b.to(gl.int64) * stride_pt, n_pages, hk * HEAD_DIM, lo, hi, c, num_pages,
                           sub, sub_layout, BLOCK_N, PAGE_SIZE, STAGES)


@gluon.jit
def _attend(Q, t, hk, lo, hi, c, k_smem, v_smem, k_ready, v_ready, kv_empty, stride_qt, stride_qh, qk_scale,
            GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
            s_layout: gl.constexpr, o_layout: gl.constexpr):
    """The online softmax of query token t's GROUP heads of kv head hk over keys [lo, hi) from the ring ->
    (O unnormalized, row max (log2 units), row sum, ring counter)."""
    M: gl.constexpr = 64  # wgmma's least M; rows >= GROUP are padding
    q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = k_smem.dtype
    qr = gl.arange(0, M, layout=gl.SliceLayout(1, q_layout))
    qd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout))
    kcol = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    q_ptrs = Q + t * stride_qt + (hk * GROUP + qr)[:, None] * stride_qh + qd[None, :]
    q = gl.load(q_ptrs, mask=(qr < GROUP)[:, None], other=0.0)
    m_i = gl.full([M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([M], gl.float32, row_s)
    acc = gl.zeros([M, HEAD_DIM], gl.float32, o_layout)
    for start in range(lo, hi, BLOCK_N):
        s = c % STAGES
        ph = (c // STAGES) & 1
        mbarrier.wait(k_ready.index(s), ph)
        qk = warpgroup_mma(q, k_smem.index(s).permute((1, 0)), gl.zeros([M, BLOCK_N], gl.float32, s_layout),
                           use_acc=False, is_async=True)
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
        sc = gl.where((start + kcol < hi)[None, :], qk * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(sc - m_safe[:, None])
        alpha = gl.exp2(m_i - m_safe)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        mbarrier.wait(v_ready.index(s), ph)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(s), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(kv_empty.index(s), count=1)
        m_i = m_new
        c += 1
    return acc, m_i, l_i, c


@gluon.jit
def _consumer(Q, O, LSE, OUT, COUNT, k_smem, v_smem, k_ready, v_ready, kv_empty, SEQ_LENS, TILE_SEQ, NUM_TILES,
              CU_Q, CU_T, PSTART, stride_qt, stride_qh, stride_os, stride_ot, stride_oh, stride_ls, stride_fot,
              stride_foh, num_heads, num_kv_heads, num_splits, qk_scale, GROUP: gl.constexpr,
              HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
              COMBINE: gl.constexpr, BALANCED: gl.constexpr):
    M: gl.constexpr = 64
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    orow = gl.arange(0, M, layout=row_o)
    ocol = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    srow = gl.arange(0, M, layout=row_s)
    c = 0
    if BALANCED:
        g, g1, ti, P, T = _balanced_range(CU_T, PSTART, NUM_TILES)
        g0 = g
        while g < g1:
            hk, t0, nt, u0, n = _piece(g, g1, ti, CU_T, num_kv_heads)
            b = gl.load(TILE_SEQ + ti)
            t = gl.load(CU_Q + b).to(gl.int64)
            hi = gl.minimum((t0 + nt) * BLOCK_N, gl.load(SEQ_LENS + b))
            acc, m_i, l_i, c = _attend(Q, t, hk, t0 * BLOCK_N, hi, c, k_smem, v_smem, k_ready, v_ready, kv_empty,
                                       stride_qt, stride_qh, qk_scale, GROUP, HEAD_DIM, BLOCK_N, STAGES, s_layout,
                                       o_layout)
            o = acc / gl.convert_layout(l_i, row_o)[:, None]  # every piece holds a key: l_i > 0 on real rows
            head_o = hk * GROUP + orow
            # the programs whose ranges hold the unit's first and last tiles
            p_first = (((u0 + 1).to(gl.int64) * P - 1) // T).to(gl.int32)
            p_last = (((u0 + n).to(gl.int64) * P - 1) // T).to(gl.int32)
            if p_first == p_last:
                gl.store(OUT + t * stride_fot + head_o[:, None] * stride_foh + ocol[None, :],
                         o.to(OUT.dtype.element_ty), mask=(orow < GROUP)[:, None])
            else:
                # slots 2 pid (the range's first unit) and 2 pid + 1 (its last, when that is another unit)
                slot = 2 * gl.program_id(0) + (g0 < u0).to(gl.int32)
                gl.store(O + slot * stride_os + head_o[:, None] * stride_oh + ocol[None, :], o,
                         mask=(orow < GROUP)[:, None])
                gl.store(LSE + slot * stride_ls + hk * GROUP + srow, (m_i + gl.log2(l_i)) * LN2, mask=srow < GROUP)
                tail = (p_first.to(gl.int64) * T // P < u0).to(gl.int32)  # the first program started in an earlier unit
                _merge_last(O, LSE, OUT, COUNT, ti * num_kv_heads + hk, 0, t, hk, orow, ocol, p_last - p_first + 1,
                            2 * p_first, 2, tail, 0, stride_os, 0, stride_oh, stride_ls, stride_fot, stride_foh,
                            GROUP, o_layout)
            g += nt
            ti += ((t0 + nt == n) & (hk == num_kv_heads - 1)).to(gl.int32)
    else:
        n_units = gl.load(NUM_TILES) * num_kv_heads * num_splits
        for u in range(gl.program_id(0), n_units, gl.num_programs(0)):
            b, hk, split, lo, hi = _unit(u, TILE_SEQ, SEQ_LENS, num_kv_heads, num_splits, BLOCK_N)
            t = gl.load(CU_Q + b).to(gl.int64)  # the sequence's one query token
            acc, m_i, l_i, c = _attend(Q, t, hk, lo, hi, c, k_smem, v_smem, k_ready, v_ready, kv_empty, stride_qt,
                                       stride_qh, qk_scale, GROUP, HEAD_DIM, BLOCK_N, STAGES, s_layout, o_layout)
            empty = l_i == 0.0
            l_safe = gl.where(empty, 1.0, l_i)
            o = acc / gl.convert_layout(l_safe, row_o)[:, None]
            head_o = hk * GROUP + orow
            o_ptrs = O + split * stride_os + t * stride_ot + head_o[:, None] * stride_oh + ocol[None, :]
            gl.store(o_ptrs, o.to(O.dtype.element_ty), mask=(orow < GROUP)[:, None])
            if SPLIT:
                lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * LN2)
                gl.store(LSE + split * stride_ls + t * num_heads + hk * GROUP + srow, lse, mask=srow < GROUP)
                if COMBINE:
                    _merge_last(O, LSE, OUT, COUNT, (u // (num_kv_heads * num_splits)) * num_kv_heads + hk, t, t,
                                hk, orow, ocol, num_splits, 0, 1, 0, num_heads, stride_os, stride_ot, stride_oh,
                                stride_ls, stride_fot, stride_foh, GROUP, o_layout)


@gluon.jit
def _merge_last(PO, PLSE, OUT, COUNT, idx, pt, t, hk, rows, cols, pieces, s0, step, tail, num_heads, stride_os,
                stride_ot, stride_oh, stride_ls, stride_fot, stride_foh, GROUP: gl.constexpr, o_layout: gl.constexpr):
    """The last of the ``pieces`` partials of a (tile, KV head) to be stored merges all of them into OUT row t (as
    paged_kernel._combine_last): an arrival counter with acq_rel semantics, partials read through L2 (.cg), the
    counter set back to zero for the next launch. Piece j is slot s0 + j * step (+ tail for j = 0) of PO / PLSE
    at token pt."""
    gl.thread_barrier()  # every warp's partial stores come before the one-thread count
    if gl.atomic_add(COUNT + idx, 1, sem="acq_rel") == pieces - 1:
        ok = rows < GROUP
        head = hk * GROUP + rows
        lse_ptrs = PLSE + pt * num_heads + head + s0 * stride_ls
        row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
        m = gl.full([rows.shape[0]], float("-inf"), gl.float32, row_layout)
        for j in range(pieces):
            sl = (j * step + tail * (j == 0).to(gl.int32)) * stride_ls
            m = gl.maximum(m, gl.load(lse_ptrs + sl, mask=ok, other=float("-inf"), cache_modifier=".cg"))
        m_safe = gl.where(m == float("-inf"), 0.0, m)
        acc = gl.zeros([rows.shape[0], cols.shape[0]], gl.float32, o_layout)
        den = gl.zeros([rows.shape[0]], gl.float32, row_layout)
        po = PO + pt * stride_ot + s0 * stride_os + head[:, None] * stride_oh + cols[None, :]
        for j in range(pieces):
            sj = j * step + tail * (j == 0).to(gl.int32)
            w = gl.exp(gl.load(lse_ptrs + sj * stride_ls, mask=ok, other=float("-inf"), cache_modifier=".cg")
                       - m_safe)
            den += w
            acc += w[:, None] * gl.load(po + sj * stride_os, mask=ok[:, None], other=0.0, cache_modifier=".cg")
        o = acc / gl.where(den == 0.0, 1.0, den)[:, None]
        gl.store(OUT + t * stride_fot + head[:, None] * stride_foh + cols[None, :], o.to(OUT.dtype.element_ty),
                 mask=ok[:, None])
        gl.atomic_xchg(COUNT + idx, 0)


@gluon.jit
def paged_decode_ws_kernel(Q, desc_k, desc_v, O, LSE, OUT, COUNT, PAGE_TABLE, SEQ_LENS, CU_Q, TILE_SEQ, NUM_TILES,
                           CU_T, PSTART, stride_qt, stride_qh, stride_os, stride_ot, stride_oh, stride_ls,
                           stride_fot, stride_foh, stride_pt, num_heads, num_kv_heads, num_pages, num_splits,
                           qk_scale, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                           PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
                           COMBINE: gl.constexpr = False, BALANCED: gl.constexpr = False):
    """Units mode (BALANCED off): with SPLIT, O / LSE take float32 partials; with COMBINE too, the last split unit
    of each (tile, KV head) merges them into OUT (COUNT: zeroed arrival counters, tile * num_kv_heads + kv head),
    else combine_kernel does. BALANCED: each program takes an equal range of key tiles (CU_T, PSTART from
    ``balanced_tables``); O / LSE are [2 * grid, Hq, D] / [2 * grid, Hq] partial slots, OUT the output, COUNT the
    counters."""
    dtype: gl.constexpr = desc_k.dtype
    # slots of BLOCK_N rows in the page copies' swizzle (the same for every row count: it depends on the row bytes)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], desc_k.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], desc_v.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=1)
    gl.warp_specialize([
        (_loader, (desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, kv_empty, PAGE_TABLE, SEQ_LENS, TILE_SEQ,
                   NUM_TILES, CU_T, PSTART, stride_pt, num_kv_heads, num_pages, num_splits, HEAD_DIM, BLOCK_N,
                   PAGE_SIZE, STAGES, BALANCED)),
        (_consumer, (Q, O, LSE, OUT, COUNT, k_smem, v_smem, k_ready, v_ready, kv_empty, SEQ_LENS, TILE_SEQ,
                     NUM_TILES, CU_Q, CU_T, PSTART, stride_qt, stride_qh, stride_os, stride_ot, stride_oh, stride_ls,
                     stride_fot, stride_foh, num_heads, num_kv_heads, num_splits, qk_scale, GROUP, HEAD_DIM,
                     BLOCK_N, STAGES, SPLIT, COMBINE, BALANCED)),
    ], [4], [232])


def page_descriptors(k_cache, v_cache, block_n):
    """TMA descriptors over contiguous caches viewed as [num_pages * page_size, Hkv * D], one page (or block_n
    rows of it) per copy; None where the cache is not contiguous or not 16-byte aligned."""
    P, ps, H, D = k_cache.shape
    descs = []
    for t in (k_cache, v_cache):
        if not t.is_contiguous() or t.data_ptr() % 16 or t.numel() == 0:
            return None
        descs.append(row_descriptor(t, [P * ps, H * D], H * D, min(ps, block_n)))
    return descs


def balanced_tables(tile_k_lens, num_kv_heads: int, programs: int, block_n: int = 64):
    """Host tables of the balanced split for decode tiles with kv lengths ``tile_k_lens`` (numpy, >= 1 each): CU_T
    (int32 [tiles + 1], global key-tile offset of each decode tile, all its kv heads) and PSTART (int32
    [programs], the decode tile holding each program's first key tile, 0 for programs past P = min(programs, T))."""
    import numpy as np

    n = -(-np.asarray(tile_k_lens, dtype=np.int64) // block_n)
    cu_t = np.zeros(len(n) + 1, dtype=np.int64)
    np.cumsum(n * num_kv_heads, out=cu_t[1:])
    T = int(cu_t[-1])
    P = max(1, min(programs, T))
    g0 = np.arange(programs, dtype=np.int64) * T // P
    pstart = np.where(np.arange(programs) < P, np.searchsorted(cu_t, g0, side="right") - 1, 0)
    return cu_t.astype(np.int32), np.clip(pstart, 0, max(len(n) - 1, 0)).astype(np.int32)


def launch_decode_ws(q, descs, out_or_ws, lse_ws, page_table, seq_lens, cu_seqlens_q, tile_seq, num_tiles,
                     num_pages, page_size, num_splits, qk_scale, sms, block_n=64, stages=3, out=None, counters=None,
                     balanced=None):
    """One persistent launch over every (tile, KV head, split) unit; with num_splits > 1 it writes the float32
    partials of ``out_or_ws`` [splits, tokens, Hq, D] and ``lse_ws`` [splits, tokens, Hq], and with ``counters``
    (zeroed int32, >= tiles * Hkv) the last split of each (tile, KV head) merges them into ``out``; without, the
    caller runs combine_kernel.

    ``balanced`` = (cu_t, pstart) device tables of ``balanced_tables`` for ``sms`` programs: each program takes an
    equal share of the key tiles instead (num_splits is ignored); ``out_or_ws`` / ``lse_ws`` are then float32 slots
    [2 * sms, Hq, D] / [2 * sms, Hq] for the pieces of units that straddle programs, ``counters`` is required and
    ``out`` receives the output."""
    Hq, D = q.shape[1], q.shape[2]
    Hkv = descs[0].shape[1] // D
    if balanced is not None:
        paged_decode_ws_kernel[(sms,)](
            q, *descs, out_or_ws, lse_ws, out, counters, page_table, seq_lens, cu_seqlens_q, tile_seq, num_tiles,
            balanced[0], balanced[1], q.stride(0), q.stride(1), out_or_ws.stride(0), 0, out_or_ws.stride(1),
            lse_ws.stride(0), out.stride(0), out.stride(1), page_table.stride(0), Hq, Hkv, num_pages, 1, qk_scale,
            GROUP=Hq // Hkv, HEAD_DIM=D, BLOCK_N=block_n, PAGE_SIZE=page_size, STAGES=stages, SPLIT=False,
            COMBINE=False, BALANCED=True, num_warps=4)
        return
    split = num_splits > 1
    combine = split and counters is not None
    final = out if combine else out_or_ws
    paged_decode_ws_kernel[(sms,)](
        q, *descs, out_or_ws, lse_ws if split else q, final, counters if combine else num_tiles, page_table,
        seq_lens, cu_seqlens_q, tile_seq, num_tiles, num_tiles, num_tiles, q.stride(0), q.stride(1),
        out_or_ws.stride(0) if split else 0, out_or_ws.stride(-3), out_or_ws.stride(-2),
        lse_ws.stride(0) if split else 0, final.stride(-3), final.stride(-2), page_table.stride(0), Hq, Hkv,
        num_pages, num_splits, qk_scale, GROUP=Hq // Hkv, HEAD_DIM=D, BLOCK_N=block_n, PAGE_SIZE=page_size,
        STAGES=stages, SPLIT=split, COMBINE=combine, num_warps=4)


def compile_sm90(page_size=16, head_dim=128, group=4, block_n=64, stages=3, split=False, dtype="bf16",
                 balanced=False):
    """paged_decode_ws_kernel compiled for sm_90 without a GPU (see _gluon.compile_sm90)."""
    desc = tile_desc_type(dtype, min(page_size, block_n), head_dim)
    sig = {"Q": f"*{dtype}", "desc_k": desc, "desc_v": desc, "O": "*fp32" if split or balanced else f"*{dtype}",
           "LSE": "*fp32", "OUT": f"*{dtype}", "COUNT": "*i32", "PAGE_TABLE": "*i32", "SEQ_LENS": "*i32", "CU_Q": "*i32",
           "TILE_SEQ": "*i32", "NUM_TILES": "*i32", "CU_T": "*i32", "PSTART": "*i32"}
    for name in ("stride_qt", "stride_qh", "stride_os", "stride_ot", "stride_oh", "stride_ls", "stride_fot",
                 "stride_foh", "stride_pt", "num_heads", "num_kv_heads", "num_pages", "num_splits"):
        sig[name] = "i32"
    sig["qk_scale"] = "fp32"
    consts = {"GROUP": group, "HEAD_DIM": head_dim, "BLOCK_N": block_n, "PAGE_SIZE": page_size, "STAGES": stages,
              "SPLIT": int(split and not balanced), "COMBINE": int(split and not balanced),
              "BALANCED": int(balanced)}
    return _compile_sm90(paged_decode_ws_kernel, sig, consts)
