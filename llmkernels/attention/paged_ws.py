"""Batch decode over a paged KV cache for Hopper (sm_90), in Gluon: persistent, warp-specialized, fed by TMA.

Work units are (decode tile, KV head, split): the GROUP query heads of one KV head for one sequence's next token,
over one split of its keys. A persistent grid of one program per SM walks the units u = pid, pid + P, ...; two
partitions of the program walk the same list:

- the loader (default partition, 4 warps, one thread issuing) reads each tile's page ids one tile ahead and copies
  K and V pages with TMA into a ring of STAGES slots of BLOCK_N keys (``k_ready`` / ``v_ready`` with transaction
  counts). With 16-bit caches a slot's K and V halves are freed apart and each V copy goes one tile after its K
  copy (LEAD), the order the consumer reads them in; fp8 caches free a slot once both readers are done. It runs
  ahead across unit boundaries, so the next unit's first pages are in flight while this one finishes: no per-unit
  pipeline fill;
- the consumer (one warp group): the products transposed, S^T = K Q^T and O^T = V^T P^T with wgmma (keys and head
  dims as M, the GROUP query heads padded to a multiple of 8 as N, so the softmax runs on [64 keys, 8] for GROUP 4
  instead of [64 padded heads, 64 keys]), software-pipelined so that each tile's softmax runs beside the previous
  tile's P V and the next tile's S; then the unit's output: the final O, or with splits a float32 partial and its
  LSE, which ``combine_kernel`` merges (a second launch; the balanced split merges its cut units in the kernel,
  below).

Pages past a sequence's last one read row ``num_pages * page_size``, past the cache: TMA fills them with zeros and
counts their bytes, so every copy of a tile is issued and the barrier's byte count always matches. Keys past the
unit's range are masked out of the scores.

fp8 caches: the consumer's S^T dots read K straight from the fp8 ring (fp8 wgmma, q split into two or three e4m3
terms, see _stage_q); a third partition, the converter (4 warps), widens each V tile to fp16 into a second ring that
the consumer's P V reads (see _converter). An fp8 tile is half a 16-bit tile's bytes for the same consumer work, so
for groups up to 8 two consumer warp groups take alternate key tiles of each unit and merge (see _consumer).

Other page sizes (1, 3, 24, ...; ``schedule.tma_pages``): the loader gathers one cache row per key with cp.async
instead (GATHER), every loader thread copying 16-byte pieces and arriving on the slot's barrier when they land.

Scope (``plan._ws_decode`` and ``paged._ws_decode_call``): decode batches (one query per sequence), caches of q's
dtype or fp8, any page size, head dim 64 or 128 (and 256 with 16-bit caches, in a ring of three 64 KB slots),
GROUP <= 64, contiguous caches (GATHER: rows), soft caps and left windows (the units then start at the window's
first key tile; a windowed call runs the units even where the plan chose the balanced split), no sinks, custom
mask or LSE output, and at least WS_DECODE_MIN_BYTES of K/V per call. The Triton kernel serves the rest.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .._pdl import pdl_options
from ._gluon import _SIG_DTYPES, LN2, row_descriptor, smem_layout, tile_desc_type
from ._gluon import compile_sm90 as _compile_sm90
from . import schedule
from .schedule import FP8_STAGES, FP8_STAGES16, tma_pages


@gluon.jit
def _now():
    """The GPU's global nanosecond timer (for TRACE)."""
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _key_range(k_len, split, num_splits, left, BLOCK_N: gl.constexpr, WINDOW: gl.constexpr):
    """(first key, last key + 1) of split ``split`` of a sequence of k_len keys: whole key tiles, from key 0 or, with
    WINDOW, from the tile holding the window's first key k_len - 1 - left (its earlier keys are masked, _softmax)."""
    w0 = 0
    if WINDOW:
        w0 = gl.maximum(k_len - 1 - left, 0) // BLOCK_N * BLOCK_N
    chunk = ((k_len - w0 + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    lo = gl.minimum(w0 + split * chunk, k_len)
    hi = gl.minimum(lo + chunk, k_len)
    return lo, hi


@gluon.jit
def _unit(u, TILE_SEQ, SEQ_LENS, num_kv_heads, num_splits, left, BLOCK_N: gl.constexpr, WINDOW: gl.constexpr):
    """(sequence, kv head, split, first key, last key + 1) of work unit u."""
    per_tile = num_kv_heads * num_splits
    b = gl.load(TILE_SEQ + u // per_tile)
    hk = (u % per_tile) // num_splits
    split = u % num_splits
    k_len = gl.load(SEQ_LENS + b)
    lo, hi = _key_range(k_len, split, num_splits, left, BLOCK_N, WINDOW)
    return b, hk, split, lo, hi


@gluon.jit
def _unit_seq(u, n_units, TILE_SEQ, per_tile):
    """The sequence of work unit u (0 from the last unit on: a valid index whose results go unused). The consumer
    loads it units ahead (see _consumer), so that the chain TILE_SEQ -> SEQ_LENS, CU_Q -> q of a unit's start is not
    waited on at every unit boundary."""
    return gl.load(TILE_SEQ + u // per_tile, mask=u < n_units, other=0)


@gluon.jit
def _unit_keys(u, k_len, num_kv_heads, num_splits, left, BLOCK_N: gl.constexpr, WINDOW: gl.constexpr):
    """(kv head, split, first key, last key + 1) of work unit u, whose sequence has k_len keys."""
    per_tile = num_kv_heads * num_splits
    hk = (u % per_tile) // num_splits
    split = u % num_splits
    lo, hi = _key_range(k_len, split, num_splits, left, BLOCK_N, WINDOW)
    return hk, split, lo, hi


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
def _balanced_range(TABLES, cap, num_kv_heads):
    """Program pid's range [G0[pid], G0[pid + 1]) of global key tiles (decode tile i's kv head h, key tile j is
    global tile CU_T[i] + h * n_i + j) and the decode tile of its first: the tables of ``balanced_tables``."""
    pid = gl.program_id(0)
    G0 = TABLES + cap + 1
    return gl.load(G0 + pid), gl.load(G0 + pid + 1), gl.load(G0 + gl.num_programs(0) + 1 + pid)


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
def _issue_tile(desc, smem, ready, empty, rows, col, c, sub, STAGES: gl.constexpr, WAIT: gl.constexpr = True):
    """TMA copies of one K or V tile (the sub-tiles of ROWS cache rows from rows[r], head column col) into ring
    slot c % STAGES, once its reader has freed that half of the slot (WAIT; else the caller has waited)."""
    ROWS: gl.constexpr = desc.block_type.shape[0]
    NSUB: gl.constexpr = sub.shape[0]
    s = c % STAGES
    if WAIT:
        mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(s), NSUB * desc.block_type.nbytes)
    for r in gl.static_range(NSUB):
        row = gl.sum(gl.where(sub == r, rows, 0), axis=0)
        tma.async_copy_global_to_shared(desc, [row, col], ready.index(s), smem.index(s).slice(r * ROWS, ROWS))


@gluon.jit
def _load_keys(desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, pt_row, n_pages, col, lo, hi, c,
               num_pages, sub, r1, c1, r2, c2, sub_layout: gl.constexpr, BLOCK_N: gl.constexpr,
               PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr, LEAD: gl.constexpr):
    """Copy the K and V tiles of keys [lo, hi) of one (sequence, kv head) into the ring. LEAD > 0: each V tile is
    copied LEAD tiles after its K tile, the order the consumer reads them in (K one tile ahead of its step, V one
    behind), so that neither copy waits for the other's half of a slot to be freed; (r1, c1) and (r2, c2) are the
    rows and head columns of the last two tiles, whose V copies are still to come (they carry across units).
    -> (ring counter, r1, c1, r2, c2)."""
    ROWS: gl.constexpr = desc_k.block_type.shape[0]
    NSUB: gl.constexpr = BLOCK_N // ROWS
    rows = _page_rows(pt_row, lo, n_pages, num_pages, PAGE_SIZE, NSUB, ROWS, sub_layout)
    for start in range(lo, hi, BLOCK_N):
        # the next tile's page ids load while this tile's copies are issued (used one iteration later)
        nxt = _page_rows(pt_row, start + BLOCK_N, n_pages, num_pages, PAGE_SIZE, NSUB, ROWS, sub_layout)
        _issue_tile(desc_k, k_smem, k_ready, k_empty, rows, col, c, sub, STAGES)
        if LEAD <= 0:  # -1: one barrier frees the whole slot, waited for above
            _issue_tile(desc_v, v_smem, v_ready, v_empty, rows, col, c, sub, STAGES, LEAD == 0)
        elif LEAD == 1:
            if c >= 1:
                _issue_tile(desc_v, v_smem, v_ready, v_empty, r1, c1, c - 1, sub, STAGES)
            r1 = rows
            c1 = col
        else:
            if c >= 2:
                _issue_tile(desc_v, v_smem, v_ready, v_empty, r2, c2, c - 2, sub, STAGES)
            r2 = r1
            c2 = c1
            r1 = rows
            c1 = col
        rows = nxt
        c += 1
    return c, r1, c1, r2, c2


@gluon.jit
def _gather_keys(K, V, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, pt_row, col, lo, hi, c, stride_kp, stride_ks,
                 g_layout: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr,
                 APART: gl.constexpr):
    """GATHER (page sizes TMA cannot copy by pages, e.g. 1 or 3): every loader thread copies its 16-byte pieces of
    each K and V tile of keys [lo, hi) with cp.async, one cache row per key, and arrives on the slot's barrier when
    its copies land (the barriers count every loader thread). Keys from hi on are zero-filled. APART: the slot's
    halves are freed apart (k_empty, v_empty), else k_empty frees both."""
    VEC: gl.constexpr = 128 // k_smem.dtype.primitive_bitwidth
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, g_layout))
    cols = gl.max_contiguous(gl.multiple_of(col + gl.arange(0, k_smem.shape[2], layout=gl.SliceLayout(0, g_layout)),
                                            VEC), VEC)
    key = lo + rows
    ok = key < hi
    page = gl.load(pt_row + key // PAGE_SIZE, mask=ok, other=0)
    for start in range(lo, hi, BLOCK_N):
        # the next tile's page ids load while this tile's copies are issued
        nkey = key + BLOCK_N
        nok = nkey < hi
        npage = gl.load(pt_row + nkey // PAGE_SIZE, mask=nok, other=0)
        # rows start on 16-byte boundaries (gather_caches checks the strides), each thread's piece is contiguous
        row0 = gl.multiple_of(page.to(gl.int64) * stride_kp + (key % PAGE_SIZE) * stride_ks, VEC)
        off = row0[:, None] + cols[None, :]
        m2 = ok[:, None]  # broadcast along the row: constant over each piece
        s = c % STAGES
        mbarrier.wait(k_empty.index(s), ((c // STAGES) & 1) ^ 1)
        async_copy.async_copy_global_to_shared(k_smem.index(s), K + off, mask=m2)
        async_copy.mbarrier_arrive(k_ready.index(s), increment_count=False)
        if APART:
            mbarrier.wait(v_empty.index(s), ((c // STAGES) & 1) ^ 1)
        async_copy.async_copy_global_to_shared(v_smem.index(s), V + off, mask=m2)
        async_copy.mbarrier_arrive(v_ready.index(s), increment_count=False)
        key, ok, page = nkey, nok, npage
        c += 1
    return c


@gluon.jit
def _copy_keys(desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, pt_row, k_len, col, lo, hi, c,
               num_pages, stride_kp, stride_ks, sub, r1, c1, r2, c2, sub_layout: gl.constexpr, BLOCK_N: gl.constexpr,
               PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr, GATHER: gl.constexpr, LEAD: gl.constexpr):
    """Keys [lo, hi) of one (sequence, kv head), k_len keys in all, into the ring: whole pages by TMA (V copies LEAD
    tiles behind K, see _load_keys), or with GATHER (desc_k / desc_v are then the caches' pointers) rows by
    cp.async; -> (ring counter, r1, c1, r2, c2)."""
    if GATHER:  # 16-byte pieces, rows over the threads
        VEC: gl.constexpr = 128 // k_smem.dtype.primitive_bitwidth
        TPR: gl.constexpr = k_smem.shape[2] // VEC
        g_layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // TPR, TPR], [gl.num_warps(), 1], [1, 0])
        c = _gather_keys(desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, pt_row, col, lo, hi, c,
                         stride_kp, stride_ks, g_layout, BLOCK_N, PAGE_SIZE, STAGES, LEAD >= 0)
    else:
        c, r1, c1, r2, c2 = _load_keys(desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, pt_row,
                                       (k_len + PAGE_SIZE - 1) // PAGE_SIZE, col, lo, hi, c, num_pages, sub, r1, c1,
                                       r2, c2, sub_layout, BLOCK_N, PAGE_SIZE, STAGES, LEAD)
    return c, r1, c1, r2, c2


@gluon.jit
def _loader(desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, PAGE_TABLE, SEQ_LENS, TILE_SEQ,
            NUM_TILES, TABLES, cap, stride_pt, num_kv_heads, num_pages, num_splits, stride_kp, stride_ks, left,
            HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr,
            BALANCED: gl.constexpr, GATHER: gl.constexpr, WINDOW: gl.constexpr, LEAD: gl.constexpr, TRACE):
    """K and V copies of this program's units (or balanced range) in ring order; k_empty / v_empty free a slot's K
    and V halves (the same barrier array, counting both readers, where they are not freed apart)."""
    NSUB: gl.constexpr = 1 if GATHER else BLOCK_N // desc_k.block_type.shape[0]
    # every thread holds all NSUB rows of a tile: picking one out is a few selects in registers
    sub_layout: gl.constexpr = gl.BlockedLayout([NSUB], [32], [gl.num_warps()], [0])
    sub = gl.arange(0, NSUB, layout=sub_layout)
    r1 = gl.zeros([NSUB], gl.int32, sub_layout)  # the V copies still to come (LEAD > 0): rows and head columns
    r2 = r1
    c1 = gl.program_id(0) * 0
    c2 = c1
    c = 0
    if BALANCED:
        g, g1, ti = _balanced_range(TABLES, cap, num_kv_heads)
        while g < g1:
            hk, t0, nt, _, n = _piece(g, g1, ti, TABLES, num_kv_heads)
            b = gl.load(TILE_SEQ + ti)
            k_len = gl.load(SEQ_LENS + b)
            c, r1, c1, r2, c2 = _copy_keys(desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                                           PAGE_TABLE + b.to(gl.int64) * stride_pt, k_len, hk * HEAD_DIM,
                                           t0 * BLOCK_N, gl.minimum((t0 + nt) * BLOCK_N, k_len), c, num_pages,
                                           stride_kp, stride_ks, sub, r1, c1, r2, c2, sub_layout, BLOCK_N, PAGE_SIZE,
                                           STAGES, GATHER, LEAD)
            g += nt
            ti += ((t0 + nt == n) & (hk == num_kv_heads - 1)).to(gl.int32)
    else:
        n_units = gl.load(NUM_TILES) * num_kv_heads * num_splits
        for u in range(gl.program_id(0), n_units, gl.num_programs(0)):
            b, hk, _, lo, hi = _unit(u, TILE_SEQ, SEQ_LENS, num_kv_heads, num_splits, left, BLOCK_N, WINDOW)
            c, r1, c1, r2, c2 = _copy_keys(desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                                           PAGE_TABLE + b.to(gl.int64) * stride_pt, gl.load(SEQ_LENS + b),
                                           hk * HEAD_DIM, lo, hi, c, num_pages, stride_kp, stride_ks, sub, r1, c1, r2,
                                           c2, sub_layout, BLOCK_N, PAGE_SIZE, STAGES, GATHER, LEAD)
    # the last tiles' V copies
    if LEAD >= 2:
        if c >= 2:
            _issue_tile(desc_v, v_smem, v_ready, v_empty, r2, c2, c - 2, sub, STAGES)
    if LEAD >= 1:
        if c >= 1:
            _issue_tile(desc_v, v_smem, v_ready, v_empty, r1, c1, c - 1, sub, STAGES)
    if TRACE is not None:  # the last copy issued (see _consumer)
        gl.store(TRACE + 4 * gl.program_id(0) + 3, _now())


@gluon.jit
def _widen(src, dst, HEAD_DIM: gl.constexpr):
    """An fp8 K or V tile in shared memory -> fp16 (exact for e4m3 and e5m2) in ``dst``: 16 bytes per thread and
    load."""
    TD: gl.constexpr = HEAD_DIM // 16
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 // TD, TD], [gl.num_warps(), 1], [1, 0])
    dst.store(src.load(layout).to(gl.float16))


@gluon.jit
def _converter(v8, v_ready, kv_empty, v16, v16_ready, v16_empty, SEQ_LENS, TILE_SEQ, NUM_TILES, TABLES, cap,
               num_kv_heads, num_splits, left, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
               STAGES16: gl.constexpr, BALANCED: gl.constexpr, WINDOW: gl.constexpr):
    """fp8 caches: widens every V tile the loader copies, in ring order, into the fp16 ring the consumer reads (its
    own warps, so the widening runs beside the consumer's dots and softmax). K needs no widening: the consumer's
    fp8 dots read it from the fp8 ring."""
    if BALANCED:
        g, g1, _ = _balanced_range(TABLES, cap, num_kv_heads)
        total = g1 - g
    else:
        total = 0
        n_units = gl.load(NUM_TILES) * num_kv_heads * num_splits
        for u in range(gl.program_id(0), n_units, gl.num_programs(0)):
            _, _, _, lo, hi = _unit(u, TILE_SEQ, SEQ_LENS, num_kv_heads, num_splits, left, BLOCK_N, WINDOW)
            total += (hi - lo + BLOCK_N - 1) // BLOCK_N
    for c in range(total):
        s2 = c % STAGES16
        mbarrier.wait(v16_empty.index(s2), ((c // STAGES16) & 1) ^ 1)
        mbarrier.wait(v_ready.index(c % STAGES), (c // STAGES) & 1)
        _widen(v8.index(c % STAGES), v16.index(s2), HEAD_DIM)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(v16_ready.index(s2), count=1)
        mbarrier.arrive(kv_empty.index(c % STAGES), count=1)


@gluon.jit
def _scores(q_smem, k_smem, k_ready, c, st_layout: gl.constexpr, BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr,
            GP: gl.constexpr, FENCE: gl.constexpr):
    """Issue S^T = K Q^T on ring use c's K tile (asynchronous): keys are wgmma's M, the GP query heads its N. With
    an fp8 cache, q_smem holds three fp8 terms of the scaled q (_stage_q) and their dots add up. FENCE: the tile
    came by cp.async (GATHER), whose writes the async proxy (wgmma) sees only after a proxy fence."""
    s = c % K_STAGES
    mbarrier.wait(k_ready.index(s), (c // K_STAGES) & 1)
    if FENCE:
        fence_async_shared()
    st = warpgroup_mma(k_smem.index(s), q_smem.index(0).permute((1, 0)),
                       gl.zeros([BLOCK_N, GP], gl.float32, st_layout), use_acc=False, is_async=True)
    TERMS: gl.constexpr = q_smem.shape[0]
    for j in gl.static_range(1, TERMS):
        st = warpgroup_mma(k_smem.index(s), q_smem.index(j).permute((1, 0)), st, is_async=True)
    return st


@gluon.jit
def _softmax(st, m_i, l_p, cs, key0, hi, klo, softcap2, st_layout: gl.constexpr, BLOCK_N: gl.constexpr,
             MASKED: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr):
    """Online softmax of one transposed score tile [keys, heads] with per-head score scales cs (log2 units):
    -> (P^T, alpha, row sums, row max). The row sums stay per element (l_p, summed once at the end), so the only
    reduction across warps per tile is the maximum. MASKED: keys from hi on are out, and with WINDOW those before
    klo; otherwise every key counts and the new maximum is finite. SOFTCAP: scores become c tanh(s / c) (softcap2 =
    c log2(e), the cap in log2 units; tanh through exp2 as the Triton kernels take it)."""
    sc = st * cs[None, :]
    if SOFTCAP:
        sc = softcap2 * (1.0 - 2.0 / (gl.exp2(sc * (2.0 / softcap2) * 1.4426950408889634) + 1.0))
    if MASKED:
        k_pos = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
        ok = k_pos < hi
        if WINDOW:
            ok = ok & (k_pos >= klo)
        sc = gl.where(ok[:, None], sc, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, axis=0))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = gl.maximum(m_i, gl.max(sc, axis=0))
        m_safe = m_new
    p = gl.exp2(sc - m_safe[None, :])
    alpha = gl.exp2(m_i - m_safe)
    return p, alpha, l_p * alpha[None, :] + p, m_new


@gluon.jit
def _pv(p_buf, acc, v_smem, v_ready, c, V_STAGES: gl.constexpr, FENCE: gl.constexpr):
    """Issue O^T += V^T P^T on ring use c's V tile (V read transposed from its slot, P^T from p_buf); FENCE as in
    _scores."""
    s = c % V_STAGES
    mbarrier.wait(v_ready.index(s), (c // V_STAGES) & 1)
    if FENCE:
        fence_async_shared()
    return warpgroup_mma(v_smem.index(s).permute((1, 0)), p_buf, acc, is_async=True)


@gluon.jit
def _load_q(Q, t, hk, ok, stride_qt, stride_qh, GROUP: gl.constexpr, GP: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Query token t's GROUP heads of kv head hk as [GP, HEAD_DIM] in q's dtype (rows past GROUP, and all when not
    ok, zero). The consumer loads the next unit's q while this unit runs."""
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    qr = gl.arange(0, GP, layout=gl.SliceLayout(1, q_layout))
    qd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout))
    return gl.load(Q + t * stride_qt + (hk * GROUP + qr)[:, None] * stride_qh + qd[None, :],
                   mask=((qr < GROUP) & ok)[:, None], other=0.0)


@gluon.jit
def _stage_q(q, q_smem, qk_scale, cs_layout: gl.constexpr):
    """q (_load_q) into q_smem [terms, GP, HEAD_DIM] -> the per-head score scale (log2 units) in cs_layout. One
    term: q in the cache's dtype. Two or three terms (fp8 caches): each head row is scaled by a power of two to at
    most 256 and split into e4m3 terms h + m (+ l), each the rounded remainder of the ones before (exact in
    float32), so the sum keeps about 8 (12) significant bits, as many as a bf16 (more than an fp16) q has, and K
    stays fp8: the dots run on the fp8 tensor cores with no widening of K."""
    GP: gl.constexpr = q_smem.shape[1]
    TERMS: gl.constexpr = q_smem.shape[0]
    q = q.to(gl.float32)
    gl.thread_barrier()  # every warp is past the previous unit's last wgmma
    if TERMS == 1:
        q_smem.index(0).store(q.to(q_smem.dtype))
        cs = gl.full([GP], 1.0, gl.float32, cs_layout) * qk_scale
    else:
        amax = gl.max(gl.abs(q), axis=1)
        ex = (amax.to(gl.int32, bitcast=True) >> 23) & 0xFF  # amax < 2 ** (ex - 126)
        sc = (gl.minimum(gl.maximum(261 - ex, 1), 254) << 23).to(gl.float32, bitcast=True)  # 2 ** (134 - ex)
        r = q * sc[:, None]
        for j in gl.static_range(TERMS):
            h = r.to(q_smem.dtype)
            q_smem.index(j).store(h)
            r = r - h.to(gl.float32)
        cs = gl.convert_layout(qk_scale / sc, cs_layout)
    fence_async_shared()
    gl.thread_barrier()
    return cs


@gluon.jit
def _attend(q, lo, hi, c, q_smem, p_smem, k_smem, k_ready, k_empty, v_smem, v_ready, v_empty, qk_scale, klo,
            softcap2, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr, V_STAGES: gl.constexpr,
            o_layout: gl.constexpr, KF: gl.constexpr = False, VF: gl.constexpr = False, STEP: gl.constexpr = 1,
            WINDOW: gl.constexpr = False, SOFTCAP: gl.constexpr = False):
    """The online softmax of one unit's query heads q (_load_q) over keys [lo, hi): K tiles from the
    (k_smem, k_ready, k_empty) ring, V tiles from the (v_smem, ...) ring (the same ring for 16-bit caches; for fp8,
    the fp8 ring and the converter's fp16 ring), counted by c. -> (O [GP, HEAD_DIM] unnormalized in o_layout, row
    max (log2 units) and row sum in its row slice, ring counter).

    The products are transposed: S^T = K Q^T and O^T = V^T P^T, with keys and head dims as wgmma's M and the query
    heads (padded to GP, a multiple of 8) as its N, so the softmax works on [BLOCK_N, GP] (GROUP 4: 8 times fewer
    exponentials than [64, BLOCK_N] with the heads padded to M = 64). P^T goes through p_smem (two buffers).
    Software-pipelined: step i issues tile i - 1's P V and tile i + 1's S, runs tile i's softmax beside them, then
    waits for both, frees what they read and rescales O. No wgmma stays in flight across steps (ptxas answers that
    by serializing every wgmma). lo is a multiple of BLOCK_N, so only the last tile has keys past hi to mask. KF / VF:
    the K / V tiles came by cp.async (proxy fence after each wait, see _scores). STEP: this consumer takes every
    STEP-th tile from lo (ring uses c, c + STEP, ...; see _consumer's CONSUMERS). WINDOW: keys before klo are
    masked too, in every tile (only a unit's first can hold them); SOFTCAP, softcap2: see _softmax."""
    GP: gl.constexpr = q_smem.shape[1]
    KW: gl.constexpr = 256 // k_smem.dtype.primitive_bitwidth  # wgmma's K per instruction
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, GP, KW])
    ot_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, GP, 16])
    col: gl.constexpr = gl.SliceLayout(0, st_layout)
    cs = _stage_q(q, q_smem, qk_scale, col)
    m_i = gl.full([GP], float("-inf"), gl.float32, col)
    l_p = gl.zeros([BLOCK_N, GP], gl.float32, st_layout)
    acc = gl.zeros([HEAD_DIM, GP], gl.float32, ot_layout)
    TS: gl.constexpr = STEP * BLOCK_N  # keys from one of this consumer's tiles to its next
    n = (hi - lo + TS - 1) // TS
    if n > 0:
        st = warpgroup_mma_wait(0, deps=(_scores(q_smem, k_smem, k_ready, c, st_layout, BLOCK_N, K_STAGES, GP, KF),))
        mbarrier.arrive(k_empty.index(c % K_STAGES), count=1)
        if n > 1:
            nxt = _scores(q_smem, k_smem, k_ready, c + STEP, st_layout, BLOCK_N, K_STAGES, GP, KF)
            p, alpha, l_p, m_i = _softmax(st, m_i, l_p, cs, lo, hi, klo, softcap2, st_layout, BLOCK_N, WINDOW,
                                          WINDOW, SOFTCAP)
            st = warpgroup_mma_wait(0, deps=(nxt,))
            mbarrier.arrive(k_empty.index((c + STEP) % K_STAGES), count=1)
        else:
            p, alpha, l_p, m_i = _softmax(st, m_i, l_p, cs, lo, hi, klo, softcap2, st_layout, BLOCK_N, True, WINDOW,
                                          SOFTCAP)
        p_smem.index(0).store(p.to(p_smem.dtype))
        fence_async_shared()
        gl.thread_barrier()
        for i in range(1, n - 1):
            pv = _pv(p_smem.index((i - 1) % 2), acc, v_smem, v_ready, c, V_STAGES, VF)
            nxt = _scores(q_smem, k_smem, k_ready, c + 2 * STEP, st_layout, BLOCK_N, K_STAGES, GP, KF)
            p, alpha, l_p, m_i = _softmax(st, m_i, l_p, cs, lo + i * TS, hi, klo, softcap2, st_layout, BLOCK_N,
                                          WINDOW, WINDOW, SOFTCAP)
            p_smem.index(i % 2).store(p.to(p_smem.dtype))
            acc, st = warpgroup_mma_wait(0, deps=(pv, nxt))
            mbarrier.arrive(v_empty.index(c % V_STAGES), count=1)
            mbarrier.arrive(k_empty.index((c + 2 * STEP) % K_STAGES), count=1)
            fence_async_shared()
            gl.thread_barrier()
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(0, ot_layout))[None, :]
            c += STEP
        if n > 1:
            pv = _pv(p_smem.index((n - 2) % 2), acc, v_smem, v_ready, c, V_STAGES, VF)
            p, alpha, l_p, m_i = _softmax(st, m_i, l_p, cs, lo + (n - 1) * TS, hi, klo, softcap2, st_layout,
                                          BLOCK_N, True, WINDOW, SOFTCAP)
            p_smem.index((n - 1) % 2).store(p.to(p_smem.dtype))
            acc = warpgroup_mma_wait(0, deps=(pv,))
            mbarrier.arrive(v_empty.index(c % V_STAGES), count=1)
            fence_async_shared()
            gl.thread_barrier()
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(0, ot_layout))[None, :]
            c += STEP
        acc = warpgroup_mma_wait(0, deps=(_pv(p_smem.index((n - 1) % 2), acc, v_smem, v_ready, c, V_STAGES, VF),))
        mbarrier.arrive(v_empty.index(c % V_STAGES), count=1)
        c += STEP
    row: gl.constexpr = gl.SliceLayout(1, o_layout)
    return (gl.convert_layout(gl.permute(acc, (1, 0)), o_layout), gl.convert_layout(m_i, row),
            gl.convert_layout(gl.sum(l_p, axis=0), row), c)


@gluon.jit
def _pair(acc, m_i, l_i, x_o, x_ml, x_ready, x_free, k, o_layout: gl.constexpr, WG: gl.constexpr):
    """The second consumer's (O, row max, row sum) of one unit -> the first, through x_o [GP, HEAD_DIM] and x_ml
    [2, GP, 1] (float32): -> for the first, both halves merged (for the second, its own values, unused). k counts the
    hand-offs (x_ready / x_free phases)."""
    if WG == 1:
        mbarrier.wait(x_free, (k & 1) ^ 1)
        x_o.store(acc)
        x_ml.index(0).store(m_i[:, None])
        x_ml.index(1).store(l_i[:, None])
        gl.thread_barrier()
        mbarrier.arrive(x_ready, count=1)
    else:
        mbarrier.wait(x_ready, k & 1)
        acc1 = x_o.load(o_layout)
        m1 = gl.sum(x_ml.index(0).load(o_layout), axis=1)  # [GP, 1] -> [GP] in the rows' slice
        l1 = gl.sum(x_ml.index(1).load(o_layout), axis=1)
        gl.thread_barrier()
        mbarrier.arrive(x_free, count=1)
        m = gl.maximum(m_i, m1)
        m_safe = gl.where(m == float("-inf"), 0.0, m)
        a0 = gl.exp2(m_i - m_safe)
        a1 = gl.exp2(m1 - m_safe)
        acc = acc * a0[:, None] + acc1 * a1[:, None]
        l_i = l_i * a0 + l1 * a1
        m_i = m
    return acc, m_i, l_i


@gluon.jit
def _consumer(Q, O, LSE, OUT, COUNT, k_smem, k_ready, k_empty, v_smem, v_ready, v_empty, SEQ_LENS,
              TILE_SEQ, NUM_TILES, CU_Q, TABLES, K_SCALE, V_SCALE, cap, stride_qt, stride_qh, stride_os, stride_ot,
              stride_oh, stride_ls, stride_fot, stride_foh, num_heads, num_kv_heads, num_splits, qk_scale, k_scale,
              v_scale, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr,
              V_STAGES: gl.constexpr, SPLIT: gl.constexpr, BALANCED: gl.constexpr, GROUP_P2: gl.constexpr,
              MERGE_PB: gl.constexpr, SCALE_PTRS: gl.constexpr, KF: gl.constexpr, VF: gl.constexpr, x_o, x_ml, x_ready,
              x_free, CONSUMERS: gl.constexpr, q_smem, p_smem, WG: gl.constexpr, left, softcap2,
              WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, TRACE):
    """Consumer WG of CONSUMERS (1 or 2): with two, each unit's (or balanced piece's) key tiles alternate between
    them (ring uses of the same parity as WG), each runs its own online softmax, and the second hands its
    (O, max, sum) to the first (_pair), which merges them and writes the output. Two independent chains of wgmma,
    softmax and barriers per SM: one chain's per-tile latency is what bounds an fp8 cache's tiles (half the bytes
    of a 16-bit tile in about the same consumer work)."""
    if SCALE_PTRS:  # fp8: K = k_scale * cache, V = v_scale * cache; k_scale rides in the score scale
        k_scale = gl.load(K_SCALE).to(gl.float32)
        v_scale = gl.load(V_SCALE).to(gl.float32)
    qk_scale = qk_scale * k_scale
    M: gl.constexpr = q_smem.shape[1]
    o_layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])  # [GP, HEAD_DIM], rows = heads
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    orow = gl.arange(0, M, layout=row_o)
    ocol = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    c = 0
    kx = 0  # hand-offs between the two consumers (CONSUMERS = 2)
    if BALANCED:
        g, g1, ti = _balanced_range(TABLES, cap, num_kv_heads)
        g0 = g
        UPIECES = TABLES + cap + 2 * gl.num_programs(0) + 2 + cap * num_kv_heads  # pieces of each unit
        first = -1  # the units of this range's first and last pieces, when cut (merged after the range)
        last = -1
        while g < g1:
            hk, t0, nt, u0, n = _piece(g, g1, ti, TABLES, num_kv_heads)
            b = gl.load(TILE_SEQ + ti)
            t = gl.load(CU_Q + b).to(gl.int64)
            hi = gl.minimum((t0 + nt) * BLOCK_N, gl.load(SEQ_LENS + b))
            q = _load_q(Q, t, hk, True, stride_qt, stride_qh, GROUP, M, HEAD_DIM)
            acc, m_i, l_i, _ = _attend(q, (t0 + WG) * BLOCK_N, hi, c + WG, q_smem, p_smem, k_smem, k_ready, k_empty,
                                       v_smem, v_ready, v_empty, qk_scale, 0, softcap2, HEAD_DIM, BLOCK_N, K_STAGES,
                                       V_STAGES, o_layout, KF, VF, CONSUMERS, False, SOFTCAP)
            c += (hi - t0 * BLOCK_N + BLOCK_N - 1) // BLOCK_N
            if CONSUMERS > 1:
                acc, m_i, l_i = _pair(acc, m_i, l_i, x_o, x_ml, x_ready, x_free, kx, o_layout, WG)
                kx += 1
            if WG == 0:
                o = acc * (v_scale / l_i)[:, None]  # every piece holds a key: l_i > 0
                head_o = hk * GROUP + orow
                idx = ti * num_kv_heads + hk
                if gl.load(UPIECES + idx) == 1:  # a whole unit
                    gl.store(OUT + t * stride_fot + head_o[:, None] * stride_foh + ocol[None, :],
                             o.to(OUT.dtype.element_ty), mask=(orow < GROUP)[:, None])
                else:
                    # slots 2 pid (the range's first unit) and 2 pid + 1 (its last, when that is another unit)
                    slot = 2 * gl.program_id(0) + (g0 < u0).to(gl.int32)
                    gl.store(O + slot * stride_os + head_o[:, None] * stride_oh + ocol[None, :], o,
                             mask=(orow < GROUP)[:, None])
                    gl.store(LSE + slot * stride_ls + head_o, (m_i + gl.log2(l_i)) * LN2, mask=orow < GROUP)
                    first = gl.where(first < 0, idx, first)
                    last = gl.where(first != idx, idx, last)
            g += nt
            ti += ((t0 + nt == n) & (hk == num_kv_heads - 1)).to(gl.int32)
        # arrivals after the range, so that no piece waits on an atomic's round trip while its copies are in flight
        if WG == 0:
            if first >= 0:
                _merge_unit(O, LSE, OUT, COUNT, TABLES, cap, first, TILE_SEQ, CU_Q, num_kv_heads, stride_os,
                            stride_oh, stride_ls, stride_fot, stride_foh, GROUP, GROUP_P2, HEAD_DIM, MERGE_PB)
            if last >= 0:
                _merge_unit(O, LSE, OUT, COUNT, TABLES, cap, last, TILE_SEQ, CU_Q, num_kv_heads, stride_os,
                            stride_oh, stride_ls, stride_fot, stride_foh, GROUP, GROUP_P2, HEAD_DIM, MERGE_PB)
    else:
        n_units = gl.load(NUM_TILES) * num_kv_heads * num_splits
        per_tile = num_kv_heads * num_splits
        P = gl.num_programs(0)
        u0 = gl.program_id(0)
        # loaded ahead: the next unit's q, its length and query token, the sequence id two units ahead. At one unit
        # per program boundary a dependent chain of three loads (unit -> sequence -> length, query token -> q) cost
        # about 2 us per 16-tile unit with an fp8 cache (bench/NOTES.md). The loader and the converter
        # keep their own loads: the same look-ahead measured slightly slower in the loader and no faster in the
        # converter, where it also met a Triton 3.6 miscompile (a loop-carried value used only as an inner loop's
        # bound is dropped: the converter counted every unit's tiles with the first unit's length and hung on
        # ragged batches). Here each carried value has other uses (masks, addresses); a test checks they survive
        b0 = _unit_seq(u0, n_units, TILE_SEQ, per_tile)
        b1 = _unit_seq(u0 + P, n_units, TILE_SEQ, per_tile)
        k0 = gl.load(SEQ_LENS + b0)
        t0 = gl.load(CU_Q + b0).to(gl.int64)  # the sequence's one query token
        k1 = gl.load(SEQ_LENS + b1)
        t1 = gl.load(CU_Q + b1).to(gl.int64)
        b2 = _unit_seq(u0 + 2 * P, n_units, TILE_SEQ, per_tile)
        if TRACE is not None:  # start, first K tile in, end (below)
            if WG == 0:
                gl.store(TRACE + 4 * u0, _now())
                if u0 < n_units:
                    mbarrier.wait(k_ready.index(0), 0)
                gl.store(TRACE + 4 * u0 + 1, _now())
        q0 = _load_q(Q, t0, (u0 % per_tile) // num_splits, u0 < n_units, stride_qt, stride_qh, GROUP, M, HEAD_DIM)
        for u in range(u0, n_units, P):
            un = u + P
            q1 = _load_q(Q, t1, (un % per_tile) // num_splits, un < n_units, stride_qt, stride_qh, GROUP, M, HEAD_DIM)
            k2 = gl.load(SEQ_LENS + b2)
            t2 = gl.load(CU_Q + b2).to(gl.int64)
            b3 = _unit_seq(u + 3 * P, n_units, TILE_SEQ, per_tile)
            hk, split, lo, hi = _unit_keys(u, k0, num_kv_heads, num_splits, left, BLOCK_N, WINDOW)
            t = t0
            acc, m_i, l_i, _ = _attend(q0, lo + WG * BLOCK_N, hi, c + WG, q_smem, p_smem, k_smem, k_ready, k_empty,
                                       v_smem, v_ready, v_empty, qk_scale, k0 - 1 - left, softcap2, HEAD_DIM, BLOCK_N,
                                       K_STAGES, V_STAGES, o_layout, KF, VF, CONSUMERS, WINDOW, SOFTCAP)
            c += (hi - lo + BLOCK_N - 1) // BLOCK_N
            if CONSUMERS > 1:
                acc, m_i, l_i = _pair(acc, m_i, l_i, x_o, x_ml, x_ready, x_free, kx, o_layout, WG)
                kx += 1
            if WG == 0:
                empty = l_i == 0.0
                l_safe = gl.where(empty, 1.0, l_i)
                o = acc * (v_scale / l_safe)[:, None]
                head_o = hk * GROUP + orow
                o_ptrs = O + split * stride_os + t * stride_ot + head_o[:, None] * stride_oh + ocol[None, :]
                gl.store(o_ptrs, o.to(O.dtype.element_ty), mask=(orow < GROUP)[:, None])
                if SPLIT:
                    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * LN2)
                    gl.store(LSE + split * stride_ls + t * num_heads + head_o, lse, mask=orow < GROUP)
            q0, k0, t0, k1, t1, b2 = q1, k1, t1, k2, t2, b3
        if TRACE is not None:
            if WG == 0:
                gl.store(TRACE + 4 * u0 + 2, _now())


@gluon.jit
def _merge_unit(PO, PLSE, OUT, COUNT, TABLES, cap, idx, TILE_SEQ, CU_Q, num_kv_heads, stride_os, stride_oh, stride_ls,
                stride_fot, stride_foh, GROUP: gl.constexpr, GROUP_P2: gl.constexpr, HEAD_DIM: gl.constexpr,
                PB: gl.constexpr):
    """Arrive for the cut unit idx (decode tile * num_kv_heads + kv head) of the balanced split; the last of its
    pieces to be stored merges them all into OUT: an arrival counter with acq_rel semantics, partials read through
    L2 (.cg), the counter set back to zero for the next launch. Piece j is program p_first + j's slot
    2 (p_first + j), but 2 p_first + 1 when p_first's range began in an earlier unit. PB pieces load at once
    ([PB, GROUP_P2, HEAD_DIM] per step), so the merge costs about one L2 round trip per PB pieces."""
    ti = idx // num_kv_heads
    hk = idx - ti * num_kv_heads
    G0 = TABLES + cap + 1
    UFIRST = G0 + 2 * gl.num_programs(0) + 1
    pieces = gl.load(UFIRST + cap * num_kv_heads + idx)
    gl.thread_barrier()  # every warp's partial stores come before the one-thread count
    if gl.atomic_add(COUNT + idx, 1, sem="acq_rel") == pieces - 1:
        p_first = gl.load(UFIRST + idx)
        base = gl.load(TABLES + ti)
        u0 = base + hk * ((gl.load(TABLES + ti + 1) - base) // num_kv_heads)
        tail = (gl.load(G0 + p_first) < u0).to(gl.int32)
        t = gl.load(CU_Q + gl.load(TILE_SEQ + ti)).to(gl.int64)
        L3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 1, 32], [4, 1, 1], [2, 1, 0])
        L2: gl.constexpr = gl.SliceLayout(2, L3)  # [PB, GROUP_P2]
        LO: gl.constexpr = gl.SliceLayout(0, L3)  # [GROUP_P2, HEAD_DIM]
        j = gl.arange(0, PB, layout=gl.SliceLayout(1, L2))
        r = gl.arange(0, GROUP_P2, layout=gl.SliceLayout(0, L2))
        ro = gl.arange(0, GROUP_P2, layout=gl.SliceLayout(1, LO))
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LO))
        head3 = (hk * GROUP + r)[None, :][:, :, None]
        d3 = d[None, :][None, :, :]
        m = gl.full([GROUP_P2], float("-inf"), gl.float32, gl.SliceLayout(0, L2))
        den = gl.zeros([GROUP_P2], gl.float32, gl.SliceLayout(0, L2))
        acc = gl.zeros([GROUP_P2, HEAD_DIM], gl.float32, LO)
        for j0 in range(0, pieces, PB):
            jj = j0 + j
            slot = 2 * (p_first + jj) + tail * (jj == 0).to(gl.int32)
            ok = (jj < pieces)[:, None] & (r < GROUP)[None, :]
            lse = gl.load(PLSE + (hk * GROUP + r)[None, :] + (slot * stride_ls)[:, None], mask=ok,
                          other=float("-inf"), cache_modifier=".cg")
            o = gl.load(PO + (slot * stride_os)[:, None][:, :, None] + head3 * stride_oh + d3,
                        mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
            m_new = gl.maximum(m, gl.max(lse, axis=0))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp(m - m_safe)
            w = gl.exp(lse - m_safe[None, :])
            den = den * alpha + gl.sum(w, axis=0)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, LO))[:, None] + gl.sum(w[:, :, None] * o, axis=0)
            m = m_new
        den = gl.convert_layout(gl.where(den == 0.0, 1.0, den), gl.SliceLayout(1, LO))
        gl.store(OUT + t * stride_fot + (hk * GROUP + ro)[:, None] * stride_foh + d[None, :],
                 (acc / den[:, None]).to(OUT.dtype.element_ty), mask=(ro < GROUP)[:, None])
        gl.atomic_xchg(COUNT + idx, 0)


@gluon.jit
def paged_decode_ws_kernel(Q, desc_k, desc_v, O, LSE, OUT, COUNT, PAGE_TABLE, SEQ_LENS, CU_Q, TILE_SEQ, NUM_TILES,
                           TABLES, K_SCALE, V_SCALE, cap, stride_qt, stride_qh, stride_os, stride_ot, stride_oh,
                           stride_ls, stride_fot, stride_foh, stride_pt, num_heads, num_kv_heads, num_pages,
                           num_splits, qk_scale, k_scale, v_scale, stride_kp, stride_ks, softcap2, left,
                           GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
                           BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr,
                           SPLIT: gl.constexpr, BALANCED: gl.constexpr = False, GROUP_P2: gl.constexpr = 4,
                           MERGE_PB: gl.constexpr = 16, SCALE_PTRS: gl.constexpr = False,
                           F16_LAYOUT: gl.constexpr = None, STAGES16: gl.constexpr = 4, GP: gl.constexpr = 8,
                           Q_LAYOUT: gl.constexpr = None, P_LAYOUT: gl.constexpr = None, GATHER: gl.constexpr = False,
                           KV_LAYOUT: gl.constexpr = None, PDL: gl.constexpr = 0, CONSUMERS: gl.constexpr = 1,
                           Q_TERMS: gl.constexpr = 3, WINDOW: gl.constexpr = False, SOFTCAP: gl.constexpr = False,
                           LEAD: gl.constexpr = -1, TRACE=None):
    """Units mode (BALANCED off): with SPLIT, O / LSE take float32 partials for combine_kernel (OUT and COUNT are
    unused). BALANCED: each program takes its range of key tiles (TABLES: ``balanced_tables`` for
    ``cap`` tiles); O / LSE are [2 * grid, Hq, D] / [2 * grid, Hq] partial slots, OUT the output, COUNT the
    counters. GROUP_P2 / MERGE_PB: see _merge_unit. GP: GROUP padded to a multiple of 8 (at least 8); Q_LAYOUT /
    P_LAYOUT: the shared layouts of a [GP, HEAD_DIM] q tile (e4m3 for fp8 caches) and a [BLOCK_N, GP] P^T tile.
    fp8 caches (the descriptors' dtype): K and V are the cache times k_scale / v_scale (float arguments, or with
    SCALE_PTRS one-element tensors K_SCALE / V_SCALE); the consumer's dots read K from the fp8 ring with q split
    into three e4m3 terms, and a converter partition (4 warps) widens V into a second ring of STAGES16 fp16 slots
    (F16_LAYOUT: the shared layout of a [BLOCK_N, HEAD_DIM] fp16 tile).

    GATHER: desc_k / desc_v are the caches themselves ([pages, page size, Hkv, D] pointers, page and slot strides
    stride_kp / stride_ks in elements, heads D apart) and the loader gathers one row per key with cp.async into
    slots of shared layout KV_LAYOUT (page sizes whose pages TMA cannot copy whole, e.g. 1 or 3).

    PDL (launched with launch_pdl, see _pdl.py): 1, the default warps wait for the previous kernel before the
    partitions start (the partitions' warps begin after them), so the launch and the shared-memory setup overlap
    that kernel's end; 2, the next kernel may also launch then.

    fp8 caches only: CONSUMERS, consumer warp groups (1 or 2), each with its own q and P^T buffers; two take
    alternate key tiles of every unit and merge (see _consumer, _pair). Q_TERMS: e4m3 terms of q (_stage_q).

    16-bit caches: LEAD -1, a slot is refilled once both its K and V are read; LEAD >= 0, its K and V halves are
    freed and refilled apart, and with TMA pages each V copy is issued LEAD tiles after its K copy (_load_keys).

    TRACE (int64 [grid, 4], units mode, for bench/lab): each program's global-timer ns at its consumer's start, its
    first K tile's arrival, its consumer's end and its loader's last copy."""
    dtype: gl.constexpr = desc_k.dtype.element_ty if GATHER else desc_k.dtype
    kv_layout: gl.constexpr = KV_LAYOUT if GATHER else desc_k.layout
    FP8: gl.constexpr = dtype.primitive_bitwidth == 8
    gl.static_assert(FP8 or CONSUMERS == 1, "two consumer warp groups are built for fp8 caches only")
    gl.static_assert(not (BALANCED and WINDOW), "the balanced split's tables cover every key: no window")
    # slots of BLOCK_N rows in the page copies' swizzle (the same for every row count: it depends on the row bytes)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # 16-bit caches with LEAD >= 0: a slot's K and V halves are freed apart (kv_empty frees K, v_free V); else
    # kv_empty counts both readers (fp8: the consumer's K dots and the converter's widening of V)
    SEPARATE: gl.constexpr = LEAD >= 0 and not FP8
    # the loader's LEAD (_load_keys): V copies LEAD tiles behind K; 0 waits for each half apart, -1 once per slot
    LOADER_LEAD: gl.constexpr = (0 if GATHER else LEAD) if SEPARATE else -1
    READY: gl.constexpr = 32 * gl.num_warps() if GATHER else 1  # GATHER: every loader thread arrives
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=READY)
        mbarrier.init(v_ready.index(i), count=READY)
        mbarrier.init(kv_empty.index(i), count=1 if SEPARATE else 2)
    if SEPARATE:
        v_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(v_free.index(i), count=1)
    else:
        v_free = kv_empty
    dtype16: gl.constexpr = gl.float16 if FP8 else dtype
    if PDL > 0:
        gdc_wait()
    if PDL > 1:
        gdc_launch_dependents()
    p_smem = gl.allocate_shared_memory(dtype16, [2, BLOCK_N, GP], P_LAYOUT)
    TERMS: gl.constexpr = Q_TERMS if FP8 else 1
    q_dtype: gl.constexpr = gl.float8e4nv if FP8 else dtype
    q_smem = gl.allocate_shared_memory(q_dtype, [TERMS, GP, HEAD_DIM], Q_LAYOUT)
    # the two consumers' hand-off (_pair); 4 KB at GROUP 8, allocated for one consumer too
    x_o = gl.allocate_shared_memory(gl.float32, [GP, HEAD_DIM], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    x_ml = gl.allocate_shared_memory(gl.float32, [2, GP, 1], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    x_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    x_ready = x_bars.index(0)
    x_free = x_bars.index(1)
    mbarrier.init(x_ready, count=1)
    mbarrier.init(x_free, count=1)
    # the ring the consumers read V from: for fp8 a second ring of widened tiles, filled by the converter partition
    V_STAGES: gl.constexpr = STAGES16 if FP8 else STAGES
    VF: gl.constexpr = GATHER and not FP8
    if FP8:
        v_ring = gl.allocate_shared_memory(gl.float16, [STAGES16, BLOCK_N, HEAD_DIM], F16_LAYOUT)
        v_ring_ready = gl.allocate_shared_memory(gl.int64, [STAGES16, 1], mbarrier.MBarrierLayout())
        v_ring_empty = gl.allocate_shared_memory(gl.int64, [STAGES16, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES16):
            mbarrier.init(v_ring_ready.index(i), count=1)
            mbarrier.init(v_ring_empty.index(i), count=1)
    else:
        v_ring = v_smem
        v_ring_ready = v_ready
        v_ring_empty = v_free
    if FP8 and CONSUMERS == 2:
        q_smem1 = gl.allocate_shared_memory(q_dtype, [TERMS, GP, HEAD_DIM], Q_LAYOUT)
        p_smem1 = gl.allocate_shared_memory(dtype16, [2, BLOCK_N, GP], P_LAYOUT)
    if FP8 and CONSUMERS == 2:
        gl.warp_specialize([
            (_loader, (desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, kv_empty, v_free, PAGE_TABLE, SEQ_LENS,
                       TILE_SEQ, NUM_TILES, TABLES, cap, stride_pt, num_kv_heads, num_pages, num_splits, stride_kp,
                       stride_ks, left, HEAD_DIM, BLOCK_N, PAGE_SIZE, STAGES, BALANCED, GATHER, WINDOW, LOADER_LEAD,
                       TRACE)),
            (_converter, (v_smem, v_ready, kv_empty, v_ring, v_ring_ready, v_ring_empty, SEQ_LENS, TILE_SEQ, NUM_TILES,
                          TABLES, cap, num_kv_heads, num_splits, left, HEAD_DIM, BLOCK_N, STAGES, STAGES16, BALANCED,
                          WINDOW)),
            (_consumer, (Q, O, LSE, OUT, COUNT, k_smem, k_ready, kv_empty, v_ring, v_ring_ready, v_ring_empty, SEQ_LENS,
                         TILE_SEQ, NUM_TILES, CU_Q, TABLES, K_SCALE, V_SCALE, cap, stride_qt, stride_qh, stride_os,
                         stride_ot, stride_oh, stride_ls, stride_fot, stride_foh, num_heads, num_kv_heads, num_splits,
                         qk_scale, k_scale, v_scale, GROUP, HEAD_DIM, BLOCK_N, STAGES, V_STAGES, SPLIT, BALANCED,
                         GROUP_P2, MERGE_PB, SCALE_PTRS, GATHER, VF, x_o, x_ml, x_ready, x_free, CONSUMERS, q_smem,
                         p_smem, 0, left, softcap2, WINDOW, SOFTCAP, TRACE)),
            (_consumer, (Q, O, LSE, OUT, COUNT, k_smem, k_ready, kv_empty, v_ring, v_ring_ready, v_ring_empty, SEQ_LENS,
                         TILE_SEQ, NUM_TILES, CU_Q, TABLES, K_SCALE, V_SCALE, cap, stride_qt, stride_qh, stride_os,
                         stride_ot, stride_oh, stride_ls, stride_fot, stride_foh, num_heads, num_kv_heads, num_splits,
                         qk_scale, k_scale, v_scale, GROUP, HEAD_DIM, BLOCK_N, STAGES, V_STAGES, SPLIT, BALANCED,
                         GROUP_P2, MERGE_PB, SCALE_PTRS, GATHER, VF, x_o, x_ml, x_ready, x_free, CONSUMERS, q_smem1,
                         p_smem1, 1, left, softcap2, WINDOW, SOFTCAP, TRACE)),
        ], [4, 4, 4], [88, 176, 176])
    elif FP8:
        gl.warp_specialize([
            (_loader, (desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, kv_empty, v_free, PAGE_TABLE, SEQ_LENS,
                       TILE_SEQ, NUM_TILES, TABLES, cap, stride_pt, num_kv_heads, num_pages, num_splits, stride_kp,
                       stride_ks, left, HEAD_DIM, BLOCK_N, PAGE_SIZE, STAGES, BALANCED, GATHER, WINDOW, LOADER_LEAD,
                       TRACE)),
            (_converter, (v_smem, v_ready, kv_empty, v_ring, v_ring_ready, v_ring_empty, SEQ_LENS, TILE_SEQ, NUM_TILES,
                          TABLES, cap, num_kv_heads, num_splits, left, HEAD_DIM, BLOCK_N, STAGES, STAGES16, BALANCED,
                          WINDOW)),
            (_consumer, (Q, O, LSE, OUT, COUNT, k_smem, k_ready, kv_empty, v_ring, v_ring_ready, v_ring_empty, SEQ_LENS,
                         TILE_SEQ, NUM_TILES, CU_Q, TABLES, K_SCALE, V_SCALE, cap, stride_qt, stride_qh, stride_os,
                         stride_ot, stride_oh, stride_ls, stride_fot, stride_foh, num_heads, num_kv_heads, num_splits,
                         qk_scale, k_scale, v_scale, GROUP, HEAD_DIM, BLOCK_N, STAGES, V_STAGES, SPLIT, BALANCED,
                         GROUP_P2, MERGE_PB, SCALE_PTRS, GATHER, VF, x_o, x_ml, x_ready, x_free, CONSUMERS, q_smem,
                         p_smem, 0, left, softcap2, WINDOW, SOFTCAP, TRACE)),
        ], [4, 4], [96, 232])
    else:
        gl.warp_specialize([
            (_loader, (desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, kv_empty, v_free, PAGE_TABLE, SEQ_LENS,
                       TILE_SEQ, NUM_TILES, TABLES, cap, stride_pt, num_kv_heads, num_pages, num_splits, stride_kp,
                       stride_ks, left, HEAD_DIM, BLOCK_N, PAGE_SIZE, STAGES, BALANCED, GATHER, WINDOW, LOADER_LEAD,
                       TRACE)),
            (_consumer, (Q, O, LSE, OUT, COUNT, k_smem, k_ready, kv_empty, v_ring, v_ring_ready, v_ring_empty, SEQ_LENS,
                         TILE_SEQ, NUM_TILES, CU_Q, TABLES, K_SCALE, V_SCALE, cap, stride_qt, stride_qh, stride_os,
                         stride_ot, stride_oh, stride_ls, stride_fot, stride_foh, num_heads, num_kv_heads, num_splits,
                         qk_scale, k_scale, v_scale, GROUP, HEAD_DIM, BLOCK_N, STAGES, V_STAGES, SPLIT, BALANCED,
                         GROUP_P2, MERGE_PB, SCALE_PTRS, GATHER, VF, x_o, x_ml, x_ready, x_free, CONSUMERS, q_smem,
                         p_smem, 0, left, softcap2, WINDOW, SOFTCAP, TRACE)),
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


def gather_caches(k_cache, v_cache):
    """(k_cache, v_cache) for the GATHER loader, or None where it cannot read them: both [pages, page size, Hkv, D]
    with the same strides, heads D elements apart with the last dim contiguous (16-byte pieces), 16-byte aligned."""
    if k_cache.stride() != v_cache.stride() or k_cache.numel() == 0:
        return None
    D = k_cache.shape[3]
    if k_cache.stride(3) != 1 or k_cache.stride(2) != D:
        return None
    if any(t.data_ptr() % 16 or (st * t.element_size()) % 16 for t in (k_cache, v_cache) for st in t.stride()[:2]):
        return None
    return k_cache, v_cache


# ring slots of 64 keys, 16-bit caches, each slot refilled once its K and V are both read (LEAD -1; the row
# gather): the step holds up to three (H100, B=16 L=4096: 3 are 8% slower)
STAGES = 4
# 16-bit caches copied by pages with the V copies behind K (LEAD >= 1): on the H200 three slots ran faster than four
# or five (bench/NOTES.md; fewer than three is raised to three, below)
STAGES_LEAD = 3
STAGES_D256 = 3  # head dim 256: four 64 KB slots do not fit in shared memory
# fp8 caches: e4m3 terms of a bf16 q (fp16 q takes 3; see _stage_q). Two carry a bf16 q's 8 bits and spare the
# consumers a third of the S dots (H200, GQA 32/8, page 16, two consumers: B=64 L=8192 285 us against 298, B=128
# L=2048 150 against 158, same error against float64)
FP8_Q_TERMS_BF16 = 2
# 16-bit caches copied by pages: the loader's V copies LEAD tiles behind K, a slot's halves freed apart
# (paged_decode_ws_kernel's LEAD): 1 with three slots ran 1-2% faster than -1 with four at every decode-suite shape
# on the H200, 2 no faster (bench/NOTES.md)
KV_LEAD = 1


def launch_decode_ws(q, descs, out_or_ws, lse_ws, page_table, seq_lens, cu_seqlens_q, tile_seq, num_tiles,
                     num_pages, page_size, num_splits, qk_scale, sms, block_n=64, stages=None, out=None, counters=None,
                     balanced=None, k_scale=1.0, v_scale=1.0, maxnreg=None, gather=False, pdl=0, consumers=None,
                     softcap=0.0, left=-1, lead=None, trace=None):
    """One persistent launch over every (tile, KV head, split) unit; with num_splits > 1 it writes the float32
    partials of ``out_or_ws`` [splits, tokens, Hq, D] and ``lse_ws`` [splits, tokens, Hq], which the caller merges
    with combine_kernel.

    ``balanced`` = (table, capacity): the device copy of ``balanced_tables`` for ``sms`` programs and that tile
    capacity: each program takes its range of key tiles instead (num_splits is ignored); ``out_or_ws`` / ``lse_ws``
    are then float32 slots [2 * sms, Hq, D] / [2 * sms, Hq] for the pieces of cut units, ``counters`` (>= capacity
    * Hkv) is required and ``out`` receives the output.

    fp8 descriptors (page_descriptors over fp8 caches): the cache holds K / k_scale and V / v_scale (floats or
    one-element float tensors on the device).

    ``gather``: ``descs`` are the caches themselves (same strides, last dim contiguous, 16-byte aligned rows), read
    one row per key with cp.async (page sizes TMA cannot copy by pages).

    ``pdl``: the kernel's PDL mode (0, 1 or 2, see paged_decode_ws_kernel); nonzero launches with launch_pdl.
    ``consumers``: consumer warp groups (fp8 caches: 1 or 2, default schedule.FP8_CONSUMERS up to groups of 8;
    16-bit caches: 1). ``softcap`` > 0: scores capped as c tanh(s / c); ``left`` >= 0: each query sees its last
    left + 1 keys (a sliding window; not with ``balanced``). ``lead``: the kernel's LEAD for 16-bit caches copied by
    pages (default KV_LEAD; fp8 caches and the row gather take -1). ``trace``: the kernel's TRACE buffer (units mode)."""
    import torch

    Hq, D = q.shape[1], q.shape[2]
    kv_dtype = descs[0].dtype if gather else descs[0].base.dtype
    Hkv = descs[0].shape[2] if gather else descs[0].shape[1] // D
    fp8 = kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if balanced is not None and left >= 0:
        raise ValueError(f"left must be -1 with balanced (its tables cover every key), got {left}")
    if lead is not None and lead not in (-1, 0, 1, 2):
        raise ValueError(f"lead must be -1, 0, 1 or 2 (V copies that many tiles behind K; -1: slots refilled whole), "
                         f"got {lead!r}")
    lead = -1 if fp8 or gather else KV_LEAD if lead is None else lead
    if stages is None:
        stages = FP8_STAGES if fp8 else STAGES_D256 if D > 128 else STAGES_LEAD if lead >= 1 else STAGES
    if consumers is None:  # two need a padded group of 8: larger q, P^T and hand-off tiles leave no room
        consumers = schedule.FP8_CONSUMERS if fp8 and Hq // Hkv <= 8 else 1
    if consumers not in (1, 2) or (consumers == 2 and not fp8):
        raise ValueError(f"consumers must be 1, or 2 for an fp8 cache; got {consumers} for a {kv_dtype} cache")
    # a consumer holds up to three ring slots at once (the previous tile's V, its tile, the next one's K): with two
    # consumers on alternate tiles a ring of fewer than six slots deadlocks
    stages = max(stages, 3 * consumers)
    ptrs = isinstance(k_scale, torch.Tensor)
    scales = dict(SCALE_PTRS=ptrs, STAGES16=FP8_STAGES16,
                  F16_LAYOUT=smem_layout(block_n, D, torch.float16) if fp8 else None,
                  **_step_consts(Hq // Hkv, D, block_n, kv_dtype),
                  GATHER=gather, KV_LAYOUT=smem_layout(block_n, D, kv_dtype) if gather else None, PDL=pdl,
                  CONSUMERS=consumers, Q_TERMS=FP8_Q_TERMS_BF16 if q.dtype == torch.bfloat16 else 3,
                  LEAD=lead, TRACE=trace, **pdl_options(pdl > 0))
    sargs = (k_scale, v_scale) if ptrs else (q, q)
    sval = (1.0, 1.0) if ptrs else (float(k_scale), float(v_scale))
    sval = sval + ((descs[0].stride(0), descs[0].stride(1)) if gather else (0, 0))
    sval = sval + (float(softcap) * 1.4426950408889634 if softcap > 0 else 1.0, int(left))
    scales.update(WINDOW=left >= 0, SOFTCAP=softcap > 0)
    if balanced is not None:
        paged_decode_ws_kernel[(sms,)](
            q, *descs, out_or_ws, lse_ws, out, counters, page_table, seq_lens, cu_seqlens_q, tile_seq, num_tiles,
            balanced[0], *sargs, balanced[1], q.stride(0), q.stride(1), out_or_ws.stride(0), 0,
            out_or_ws.stride(1), lse_ws.stride(0), out.stride(0), out.stride(1), page_table.stride(0), Hq, Hkv,
            num_pages, 1, qk_scale, *sval, GROUP=Hq // Hkv, HEAD_DIM=D, BLOCK_N=block_n, PAGE_SIZE=page_size,
            STAGES=stages, SPLIT=False, BALANCED=True, GROUP_P2=_p2(Hq // Hkv), MERGE_PB=_merge_pb(Hq // Hkv, D),
            num_warps=4, maxnreg=maxnreg, **scales)
        return
    split = num_splits > 1
    paged_decode_ws_kernel[(sms,)](
        q, *descs, out_or_ws, lse_ws if split else q, out_or_ws, num_tiles, page_table,
        seq_lens, cu_seqlens_q, tile_seq, num_tiles, num_tiles, *sargs, 0, q.stride(0), q.stride(1),
        out_or_ws.stride(0) if split else 0, out_or_ws.stride(-3), out_or_ws.stride(-2),
        lse_ws.stride(0) if split else 0, 0, 0, page_table.stride(0), Hq, Hkv,
        num_pages, num_splits, qk_scale, *sval, GROUP=Hq // Hkv, HEAD_DIM=D, BLOCK_N=block_n, PAGE_SIZE=page_size,
        STAGES=stages, SPLIT=split, GROUP_P2=_p2(Hq // Hkv), MERGE_PB=_merge_pb(Hq // Hkv, D), num_warps=4,
        maxnreg=maxnreg, **scales)


def _step_consts(group: int, head_dim: int, block_n: int, kv_dtype) -> dict:
    """The padded head count GP and the shared layouts of the step's q and P^T tiles (see the kernel)."""
    import torch

    gp = max(8, -(-group // 8) * 8)
    fp8 = kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    return dict(GP=gp, Q_LAYOUT=smem_layout(gp, head_dim, torch.float8_e4m3fn if fp8 else kv_dtype),
                P_LAYOUT=smem_layout(block_n, gp, torch.float16 if fp8 else kv_dtype))


def _p2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _merge_pb(group: int, head_dim: int) -> int:
    """Pieces the split merge loads at once: [PB, group (pow2), D] float32 in at most 64 registers per thread."""
    return max(1, min(16, 8192 // (_p2(group) * head_dim)))


def compile_sm90(page_size=16, head_dim=128, group=4, block_n=64, stages=3, split=False, dtype="bf16",
                 balanced=False, kv="", scale_ptrs=False, gather=None, pdl=0, consumers=1, q_terms=3, window=False,
                 softcap=False, lead=None, trace=False):
    """paged_decode_ws_kernel compiled for sm_90 without a GPU (see _gluon.compile_sm90); ``kv`` "fp8e4nv" or
    "fp8e5" for an fp8 cache (q is ``dtype``); ``gather``: the cp.async loader (GATHER; by default where the page
    size asks for it)."""
    import torch


    if gather is None:
        gather = not tma_pages(page_size)

    desc = f"*{kv or dtype}" if gather else tile_desc_type(kv or dtype, min(page_size, block_n), head_dim)
    sig = {"Q": f"*{dtype}", "desc_k": desc, "desc_v": desc, "O": "*fp32" if split or balanced else f"*{dtype}",
           "LSE": "*fp32", "OUT": f"*{dtype}", "COUNT": "*i32", "PAGE_TABLE": "*i32", "SEQ_LENS": "*i32",
           "CU_Q": "*i32", "TILE_SEQ": "*i32", "NUM_TILES": "*i32", "TABLES": "*i32", "K_SCALE": "*fp32",
           "V_SCALE": "*fp32"}
    for name in ("cap", "stride_qt", "stride_qh", "stride_os", "stride_ot", "stride_oh", "stride_ls", "stride_fot",
                 "stride_foh", "stride_pt", "num_heads", "num_kv_heads", "num_pages", "num_splits"):
        sig[name] = "i32"
    sig.update(qk_scale="fp32", k_scale="fp32", v_scale="fp32", stride_kp="i32", stride_ks="i32", softcap2="fp32",
               left="i32")
    consts = {"GROUP": group, "HEAD_DIM": head_dim, "BLOCK_N": block_n, "PAGE_SIZE": page_size, "STAGES": stages,
              "SPLIT": int(split and not balanced),
              "BALANCED": int(balanced), "GROUP_P2": _p2(group), "MERGE_PB": _merge_pb(group, head_dim),
              "SCALE_PTRS": scale_ptrs, "F16_LAYOUT": smem_layout(block_n, head_dim, torch.float16) if kv else None,
              "STAGES16": FP8_STAGES16,
              **_step_consts(group, head_dim, block_n, _SIG_DTYPES[kv or dtype]), "GATHER": gather,
              "KV_LAYOUT": smem_layout(block_n, head_dim, _SIG_DTYPES[kv or dtype]) if gather else None, "PDL": pdl,
              "CONSUMERS": consumers, "Q_TERMS": q_terms, "WINDOW": window, "SOFTCAP": softcap,
              "LEAD": -1 if kv or gather else KV_LEAD if lead is None else lead}
    if trace:
        sig["TRACE"] = "*i64"
    else:
        consts["TRACE"] = None

    return _compile_sm90(paged_decode_ws_kernel, sig, consts,
                         aligned=("desc_k", "desc_v", "stride_kp", "stride_ks") if gather else ())
