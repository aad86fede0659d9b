"""A first fast one-kernel decode step (Gluon, sm_90, bf16 or q4_k weights, batch 1): the instruction lists of
llmkernels.megakernel.schedule run by one persistent program per SM with two partitions, as in
megakernel_stream.py:

- a loader walks the SM's list and streams the weight boxes of every GEMV instruction (QKV, O, GATEUP, DOWN,
  LOGITS: [16, 256] bf16, TMA) into a ring of shared-memory slots, never waiting on a counter, so the next
  instruction's weights are in flight while the compute warps wait, or run attention, merges and norms; with
  ``--kv-ring 1`` (the default) it streams every ATTN split's cached keys and values the same way, pieces of up to
  16 keys of one KV head within a page, the new token's key and value coming from registers;
- the compute warps walk the same list: wait (acquire polls, a spin limit that records the first stuck instruction
  and stops waiting), stage the instruction's input in shared memory once (float32: the RMSNorm of the residual
  for QKV, GATEUP and LOGITS, the attention output for O, the FFN activation for DOWN), take the products slot by
  slot, write the outputs, then release their counters.

Same buffers, caches, RoPE and instruction semantics as the reference executor (llmkernels/megakernel/kernel.py),
so the two can run the same Program and be compared: ``python bench/lab/megakernel_fast.py`` checks the fast step
against the reference on a tiny bf16 llama GGUF (every step's logits), then times it on the Llama-3-8B shape against
the engine's kernel-per-op step.

    PYTHONPATH=. python bench/lab/megakernel_fast.py [--fmt bf16,q4_k] [--layers 32] [--context 512,...]
                                                     [--stages 16,...] [--warps 4,8] [--qstep 2] [--qdot 1]
                                                     [--kv-ring 1] [--skip-check] [--skip-engine] [--trace]
"""
import argparse
import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from llmkernels.attention.paged_ws import _now
from llmkernels.megakernel.weights import stack_tensors
from megakernel_stream_q4k import _inv_rms, _q4k_copy, _stage_q, q4k_descriptors, q4k_step

NF = gl.constexpr(9)  # schedule.FIELDS: op, layer, lo, hi, split, wait, target, sig_lo, sig_hi
BK = gl.constexpr(256)  # weight columns per ring slot
ROWS = 16  # weight rows per slot (schedule.ROW_GRANULE: every GEMV tile is a multiple)
MTW = gl.constexpr(8)  # int32 fields per row of the matrix table


@gluon.jit
def _gemv_source(MT, op, layer, n_layers, H: gl.constexpr, KO: gl.constexpr, F: gl.constexpr):
    """(first row in its stacked matrix, K, matrix: 0 A [K = H], 1 O [K = Hq * D], 2 down [K = F], rows from
    gate to up) of GEMV op ``op``; K 0 for the other ops."""
    mt = MT + gl.where(layer < 0, n_layers, layer) * MTW
    base = 0
    K = 0
    which = 0
    if op == 2:  # QKV: q, k and v stacked
        base = gl.load(mt)
        K = H
    elif op == 5:
        base = gl.load(mt + 3)
        K = KO
        which = 1
    elif op == 6:  # GATEUP: gate rows, then the same rows of up
        base = gl.load(mt + 1)
        K = H
    elif op == 7:
        base = gl.load(mt + 4)
        K = F
        which = 2
    elif op == 8:  # LOGITS (layer -1: the table's last row)
        base = gl.load(mt)
        K = H
    return base, K, which, gl.load(mt + 2) - gl.load(mt + 1)


@gluon.jit
def _kv_pieces(n, split, S: gl.constexpr, PR: gl.constexpr):
    """(first key, end key, first piece, end piece) of an ATTN split read from the cache: keys [split n / S,
    (split + 1) n / S) without the new token n - 1 (the last split takes it from registers), in pieces of PR keys
    that never cross a page."""
    klo = split * n // S
    khi = gl.minimum((split + 1) * n // S, n - 1)
    p0 = klo // PR
    p1 = gl.where(khi > klo, (khi - 1) // PR + 1, p0)
    return klo, khi, p0, p1


@gluon.jit
def _kv_view(slot, desc):
    """A ring slot seen as one [PR, D] box of the cache (every slot holds at least 4 KB)."""
    return slot._reinterpret(desc.block_type.element_ty, desc.block_type.shape, desc.layout)


@gluon.jit
def _kv_loads(desc_k, desc_v, w_smem, ready, empty, c, layer, h, split, SEQ_LENS, PT, num_pages,
              S: gl.constexpr, PAGE: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
    """An ATTN split's K and V pieces (batch 1), each into its own slot, K first -> c after them."""
    PR: gl.constexpr = desc_k.block_type.shape[0]
    n = gl.load(SEQ_LENS)
    _, _, p0, p1 = _kv_pieces(n, split, S, PR)
    for pc in range(p0, p1):
        key = pc * PR
        page = gl.load(PT + key // PAGE)
        row = (layer * num_pages + page) * PAGE + key % PAGE
        for m in gl.static_range(2):
            s = c % STAGES
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), desc_k.block_type.nbytes)
            if m == 0:
                tma.async_copy_global_to_shared(desc_k, [row, h * D], ready.index(s), _kv_view(w_smem.index(s), desc_k))
            else:
                tma.async_copy_global_to_shared(desc_v, [row, h * D], ready.index(s), _kv_view(w_smem.index(s), desc_v))
            c += 1
    return c


@gluon.jit
def _loader(desc_a, desc_o, desc_d, hdesc_a, hdesc_o, hdesc_d, desc_k, desc_v, w_smem, h_smem, ready, empty, PROG,
            n_instr, MT, n_layers, SEQ_LENS, PT, num_pages, H: gl.constexpr, KO: gl.constexpr, F: gl.constexpr,
            STAGES: gl.constexpr, FMT: gl.constexpr, S: gl.constexpr, PAGE: gl.constexpr, D: gl.constexpr,
            KVT: gl.constexpr):
    """Every GEMV instruction's slots in the compute warps' order: per 16-row subtile (GATEUP: gate, then up),
    K / 256 boxes of bf16 (FMT 0), or K / 512 slots of q4_k read in the GGUF layout (FMT 1: two super-blocks' code
    bytes and their headers, _q4k_copy); with KVT every ATTN split's K and V pieces too (_kv_loads)."""
    c = 0
    for j in range(n_instr):
        p = PROG + j * NF
        op = gl.load(p)
        layer = gl.load(p + 1)
        lo = gl.load(p + 2)
        hi = gl.load(p + 3)
        if KVT:
            if op == 3:
                c = _kv_loads(desc_k, desc_v, w_smem, ready, empty, c, layer, lo, gl.load(p + 4), SEQ_LENS, PT,
                              num_pages, S, PAGE, D, STAGES)
        base, K, which, up = _gemv_source(MT, op, layer, n_layers, H, KO, F)
        nmat = 1 + (op == 6).to(gl.int32)
        for r in range(lo, gl.where(K > 0, hi, lo), 16):
            for m in range(nmat):
                row = base + r + m * up
                for kc in range(K // (BK * (1 + FMT))):
                    s = c % STAGES
                    mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
                    if FMT == 0:
                        mbarrier.expect(ready.index(s), desc_a.block_type.nbytes)
                        if which == 0:
                            tma.async_copy_global_to_shared(desc_a, [row, kc * BK], ready.index(s), w_smem.index(s))
                        elif which == 1:
                            tma.async_copy_global_to_shared(desc_o, [row, kc * BK], ready.index(s), w_smem.index(s))
                        else:
                            tma.async_copy_global_to_shared(desc_d, [row, kc * BK], ready.index(s), w_smem.index(s))
                    else:
                        mbarrier.expect(ready.index(s), desc_a.block_type.nbytes + hdesc_a.block_type.nbytes)
                        if which == 0:
                            _q4k_copy(desc_a, hdesc_a, row, kc, ready.index(s), w_smem.index(s), h_smem.index(s), True)
                        elif which == 1:
                            _q4k_copy(desc_o, hdesc_o, row, kc, ready.index(s), w_smem.index(s), h_smem.index(s), True)
                        else:
                            _q4k_copy(desc_d, hdesc_d, row, kc, ready.index(s), w_smem.index(s), h_smem.index(s), True)
                    c += 1


@gluon.jit
def _stage_pieces(xs, X, NW, nk, inv, r, k, NORM: gl.constexpr):
    for p in range(0, nk, 16):
        offs = (p + r)[:, None] * BK + k[None, :]
        m = (p + r < nk)[:, None] & (k < BK)[None, :]
        x = gl.load(X + offs, mask=m, other=0.0)
        if NORM:
            x = x * inv * gl.load(NW + offs, mask=m, other=0.0)
        xs.index(p // 16).store(x)


@gluon.jit
def _stage(x_smem, X, NW, K, eps, NORM: gl.constexpr, ONE: gl.constexpr):
    """x_smem ([64, 256] float32, one 256-wide chunk per row) <- X[:K] (float32), or its RMSNorm times NW with
    NORM; pieces of 16 chunks, each piece's loads issued together (ONE: K fits one piece)."""
    LP: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
    X3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    xs = x_smem._reinterpret(gl.float32, [4, 16, BK], X3)
    r = gl.arange(0, 16, layout=gl.SliceLayout(1, LP))
    k = gl.arange(0, BK, layout=gl.SliceLayout(0, LP))
    nk = K // BK
    if NORM and ONE:  # the sum of squares from the same loads: one L2 round trip, not two
        offs = r[:, None] * BK + k[None, :]
        m = (r < nk)[:, None] & (k < BK)[None, :]
        x = gl.load(X + offs, mask=m, other=0.0)
        w = gl.load(NW + offs, mask=m, other=0.0)
        inv = 1.0 / gl.sqrt(gl.sum(gl.sum(x * x, axis=1), axis=0) / K + eps)
        gl.thread_barrier()  # every warp is past its reads of the instruction before
        xs.index(0).store(x * inv * w)
    else:
        inv = 1.0
        if NORM:
            inv = _inv_rms(X, K, eps)
        gl.thread_barrier()
        _stage_pieces(xs, X, NW, nk, inv, r, k, NORM)
    gl.thread_barrier()


@gluon.jit
def _subtile(w_smem, x_smem, ready, empty, c, nk, STAGES: gl.constexpr):
    """One 16-row subtile's products over the staged input: nk slots from the ring -> ([16] float32, c + nk)."""
    L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])  # [16, 256]: warps by rows
    XK: gl.constexpr = gl.SliceLayout(0, L)
    acc = gl.zeros([16, BK], gl.float32, L)
    for kc in range(nk):
        x = x_smem.index(kc).load(XK)
        s = c % STAGES
        mbarrier.wait(ready.index(s), (c // STAGES) & 1)
        w = w_smem.index(s).load(L).to(gl.float32)
        gl.thread_barrier()  # every warp has its piece of the slot in registers
        mbarrier.arrive(empty.index(s), count=1)
        acc += w * x[None, :]
        c += 1
    return gl.sum(acc, axis=1), c


@gluon.jit
def _gemv(w_smem, x_smem, ready, empty, c, lo, hi, K, OUT, ACC: gl.constexpr, GLU: gl.constexpr,
          STAGES: gl.constexpr):
    """Rows [lo, hi) of the instruction's matrix: OUT[rows] = y (ACC: OUT[rows] += y; GLU: y = SiLU(gate) * up,
    gate and up subtiles taken in turn, as the loader streams them) -> c after its slots."""
    L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
    rows = gl.arange(0, 16, layout=gl.SliceLayout(1, L))
    nk = K // BK
    for r in range(lo, hi, 16):
        y, c = _subtile(w_smem, x_smem, ready, empty, c, nk, STAGES)
        if GLU:
            u, c = _subtile(w_smem, x_smem, ready, empty, c, nk, STAGES)
            y = y / (1.0 + gl.exp(-y)) * u
        if ACC:
            y += gl.load(OUT + r + rows)
        gl.store(OUT + r + rows, y)
    return c


@gluon.jit
def _gemv_q4k(c_smem, h_smem, xq_smem, xd_smem, ready, empty, c, lo, hi, K, OUT, ACC: gl.constexpr,
              GLU: gl.constexpr, STAGES: gl.constexpr, QSTEP: gl.constexpr, QDOT: gl.constexpr):
    """_gemv on q4_k slots (megakernel_stream_q4k._slot_dot: dp4a on the int8 input)."""
    # [16 rows, 2 super-blocks, 4 chunks of 64 weights, 8 code words]: a thread per chunk with 4 warps; with 8, two
    # threads per chunk (4 words each), so a 16-row slot still has no replicated work
    if gl.num_warps() == 8:
        L4: gl.constexpr = gl.BlockedLayout([1, 1, 1, 4], [8, 1, 2, 2], [2, 2, 2, 1], [3, 2, 1, 0])
    else:
        L4: gl.constexpr = gl.BlockedLayout([1, 1, 1, 8], [4, 2, 4, 1], [gl.num_warps(), 1, 1, 1], [3, 2, 1, 0])
    rows = gl.arange(0, 16, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L4))))
    for r in range(lo, hi, 16):
        y, c = _subtile_q4k(c_smem, h_smem, xq_smem, xd_smem, ready, empty, c, K, L4, STAGES, QSTEP, QDOT)
        if GLU:
            u, c = _subtile_q4k(c_smem, h_smem, xq_smem, xd_smem, ready, empty, c, K, L4, STAGES, QSTEP, QDOT)
            y = y / (1.0 + gl.exp(-y)) * u
        if ACC:
            y += gl.load(OUT + r + rows)
        gl.store(OUT + r + rows, y)
    return c


@gluon.jit
def _subtile_q4k(c_smem, h_smem, xq_smem, xd_smem, ready, empty, c, K, L4: gl.constexpr, STAGES: gl.constexpr,
                 QSTEP: gl.constexpr, QDOT: gl.constexpr):
    acc = gl.zeros([16, 2, 4, 1], gl.float32, L4)
    n = K // 512
    full = n - n % QSTEP
    for kp in range(0, full, QSTEP):
        acc, c = q4k_step(c_smem, h_smem, xq_smem, xd_smem, ready, empty, c, kp, acc, L4, STAGES, QSTEP, QDOT)
    for kp in range(full, n):
        acc, c = q4k_step(c_smem, h_smem, xq_smem, xd_smem, ready, empty, c, kp, acc, L4, STAGES, 1, QDOT)
    return gl.sum(gl.sum(gl.sum(acc, axis=3), axis=2), axis=1), c


@gluon.jit
def _stage_any(x_smem, xq_smem, xd_smem, X, NW, K, eps, NORM: gl.constexpr, FMT: gl.constexpr, H: gl.constexpr):
    if FMT == 0:
        _stage(x_smem, X, NW, K, eps, NORM, H <= 16 * 256)
    else:
        _stage_q(xq_smem, xd_smem, X, NW, K, eps, 0, NORM)


@gluon.jit
def _gemv_any(w_smem, h_smem, x_smem, xq_smem, xd_smem, ready, empty, c, lo, hi, K, OUT, ACC: gl.constexpr,
              GLU: gl.constexpr, STAGES: gl.constexpr, FMT: gl.constexpr, QSTEP: gl.constexpr, QDOT: gl.constexpr):
    if FMT == 0:
        c = _gemv(w_smem, x_smem, ready, empty, c, lo, hi, K, OUT, ACC, GLU, STAGES)
    else:
        c = _gemv_q4k(w_smem, h_smem, xq_smem, xd_smem, ready, empty, c, lo, hi, K, OUT, ACC, GLU, STAGES, QSTEP,
                      QDOT)
    return c


@gluon.jit
def _embed(EMB, IDS, RESID, H: gl.constexpr, B: gl.constexpr):
    LE: gl.constexpr = gl.BlockedLayout([8], [32], [gl.num_warps()], [0])
    k = gl.arange(0, 1024, layout=LE)
    for b in gl.static_range(B):
        row = EMB + gl.load(IDS + b).to(gl.int64) * H
        for k0 in range(0, H, 1024):
            m = k0 + k < H
            gl.store(RESID + b * H + k0 + k, gl.load(row + k0 + k, mask=m, other=0.0).to(gl.float32), mask=m)


@gluon.jit
def _rope(x, xp, d, ang):
    """Interleaved RoPE of x (pairs 2 i, 2 i + 1; xp the partner of each element) at angles ang [.., D]."""
    sign = gl.where(d % 2 == 0, -1.0, 1.0)
    return x * gl.cos(ang) + sign * xp * gl.sin(ang)


@gluon.jit
def _kv_block(KC, VC, PT_SEQ, cache_off, keys, hi, dk, PAGE: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr):
    """The K and V rows (cache dtype) of ``keys`` (zeros at keys >= hi)."""
    km = keys < hi
    page = gl.load(PT_SEQ + keys // PAGE, mask=km, other=0)
    row = cache_off + (page.to(gl.int64) * PAGE + keys % PAGE) * HKV * D
    kvm = km[:, None] & (dk < D)[None, :]
    return (gl.load(KC + row[:, None] + dk[None, :], mask=kvm, other=0.0),
            gl.load(VC + row[:, None] + dk[None, :], mask=kvm, other=0.0))


@gluon.jit
def _attn(layer, h, split, QKV, KC, VC, PT, SEQ_LENS, INV_FREQ, PART_O, PART_L, num_pages, pages_per_seq, qk_scale,
          B: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr, S: gl.constexpr,
          PAGE: gl.constexpr, GP: gl.constexpr, BLOCK_N: gl.constexpr):
    """One KV head's key split of every sequence, as kernel._attn_split: q of the group rotated, the last split
    first stores the new token's rotated K and its V, then the split's keys -> float32 partial and log-sum-exp."""
    # [GP, N, D]: D across the lanes, keys across the warps, the group's heads in each thread; a block of
    # BLOCK_N keys is one round of loads for all its K and V rows (the splits are short: latency, not bandwidth)
    L3: gl.constexpr = gl.BlockedLayout([GP, BLOCK_N // gl.num_warps(), D // 32], [1, 1, 32], [1, gl.num_warps(), 1],
                                        [2, 1, 0])
    QL: gl.constexpr = gl.SliceLayout(1, L3)  # [GP, D]
    KL: gl.constexpr = gl.SliceLayout(0, L3)  # [N, D]
    SL: gl.constexpr = gl.SliceLayout(2, L3)  # [GP, N]
    G: gl.constexpr = HQ // HKV
    NQKV: gl.constexpr = (HQ + 2 * HKV) * D
    g = gl.arange(0, GP, layout=gl.SliceLayout(1, QL))
    dq = gl.arange(0, D, layout=gl.SliceLayout(0, QL))
    dk = gl.arange(0, D, layout=gl.SliceLayout(0, KL))
    nn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, KL))
    nn_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, SL))
    gm = g < G
    f_q = gl.load(INV_FREQ + dq // 2)
    f_k = gl.load(INV_FREQ + dk // 2)
    cache_off = (layer.to(gl.int64) * num_pages) * PAGE * HKV * D + h * D
    for b in gl.static_range(B):
        n = gl.load(SEQ_LENS + b)
        pos = (n - 1).to(gl.float32)
        qoff = b * NQKV + (h * G + g)[:, None] * D
        qm = gm[:, None] & (dq < D)[None, :]
        q = gl.load(QKV + qoff + dq[None, :], mask=qm, other=0.0)
        qp = gl.load(QKV + qoff + (dq ^ 1)[None, :], mask=qm, other=0.0)
        q = _rope(q, qp, dq[None, :], pos * f_q[None, :]) * qk_scale
        if split == S - 1:  # the new token: K rotated, V as is, into its cache slot
            ko = b * NQKV + HQ * D + h * D
            vo = b * NQKV + (HQ + HKV) * D + h * D
            kn = _rope(gl.load(QKV + ko + dk), gl.load(QKV + ko + (dk ^ 1)), dk, pos * f_k)
            page = gl.load(PT + b * pages_per_seq + (n - 1) // PAGE)
            slot = cache_off + (page.to(gl.int64) * PAGE + (n - 1) % PAGE) * HKV * D
            gl.store(KC + slot + dk, kn.to(KC.dtype.element_ty))
            gl.store(VC + slot + dk, gl.load(QKV + vo + dk).to(VC.dtype.element_ty))
            gl.thread_barrier()  # the new key is in the cache before any warp reads it
        lo = split * n // S
        hi = (split + 1) * n // S
        m_i = gl.full([GP], float("-inf"), gl.float32, gl.SliceLayout(1, SL))
        l_i = gl.zeros([GP], gl.float32, gl.SliceLayout(1, SL))
        acc = gl.zeros([GP, D], gl.float32, QL)
        kt, vt = _kv_block(KC, VC, PT + b * pages_per_seq, cache_off, lo + nn, hi, dk, PAGE, HKV, D)
        for k0 in range(lo, hi, BLOCK_N):
            # the next block's rows in flight while this one is computed
            kn, vn = _kv_block(KC, VC, PT + b * pages_per_seq, cache_off, k0 + BLOCK_N + nn, hi, dk, PAGE, HKV, D)
            s = gl.sum(q[:, None, :] * kt.to(gl.float32)[None, :, :], axis=2)  # [GP, N]
            s = gl.where((k0 + nn_s < hi)[None, :], s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            pr = gl.exp(s - m_safe[:, None])
            alpha = gl.exp(m_i - m_safe)
            pv = gl.sum(pr[:, :, None] * vt.to(gl.float32)[None, :, :], axis=1)  # [GP, D]
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, QL))[:, None] + pv
            l_i = l_i * alpha + gl.sum(pr, axis=1)
            m_i = m_new
            kt, vt = kn, vn
        has = l_i > 0
        den = gl.where(has, l_i, 1.0)
        base = (b * HQ + h * G + g) * S + split
        gl.store(PART_O + base[:, None] * D + dq[None, :], acc / gl.convert_layout(den, gl.SliceLayout(1, QL))[:, None],
                 mask=qm)
        lse = gl.where(has, m_i + gl.log(den), float("-inf"))
        LS: gl.constexpr = gl.SliceLayout(1, SL)
        gl.store(PART_L + gl.convert_layout(base, LS), lse, mask=gl.convert_layout(gm, LS))


@gluon.jit
def _attn_ring(w_smem, ready, empty, c, layer, h, split, QKV, KC, VC, PT, SEQ_LENS, INV_FREQ, PART_O, PART_L,
               num_pages, qk_scale, desc_k, HQ: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr, S: gl.constexpr,
               PAGE: gl.constexpr, GP: gl.constexpr, STAGES: gl.constexpr):
    """_attn (batch 1) with the split's cached keys taken from the ring (_kv_loads, in its order) and the new token's
    key and value from registers; the new token is still written to the cache, for the steps after. -> c."""
    PR: gl.constexpr = desc_k.block_type.shape[0]
    NW: gl.constexpr = gl.num_warps()
    SPT: gl.constexpr = PR // NW if PR >= NW else 1
    L3: gl.constexpr = gl.BlockedLayout([GP, SPT, D // 32], [1, 1, 32], [1, NW, 1], [2, 1, 0])
    QL: gl.constexpr = gl.SliceLayout(1, L3)  # [GP, D]
    KL: gl.constexpr = gl.SliceLayout(0, L3)  # [PR, D]
    SL: gl.constexpr = gl.SliceLayout(2, L3)  # [GP, PR]
    G: gl.constexpr = HQ // HKV
    g = gl.arange(0, GP, layout=gl.SliceLayout(1, QL))
    dq = gl.arange(0, D, layout=gl.SliceLayout(0, QL))
    nn = gl.arange(0, PR, layout=gl.SliceLayout(0, SL))
    nk = gl.arange(0, PR, layout=gl.SliceLayout(1, KL))
    gm = g < G
    n = gl.load(SEQ_LENS)
    pos = (n - 1).to(gl.float32)
    f_q = gl.load(INV_FREQ + dq // 2)
    qoff = (h * G + g)[:, None] * D
    qm = gm[:, None] & (dq < D)[None, :]
    q = gl.load(QKV + qoff + dq[None, :], mask=qm, other=0.0)
    qp = gl.load(QKV + qoff + (dq ^ 1)[None, :], mask=qm, other=0.0)
    q = _rope(q, qp, dq[None, :], pos * f_q[None, :]) * qk_scale
    klo, khi, p0, p1 = _kv_pieces(n, split, S, PR)
    m_i = gl.full([GP], float("-inf"), gl.float32, gl.SliceLayout(1, SL))
    l_i = gl.zeros([GP], gl.float32, gl.SliceLayout(1, SL))
    acc = gl.zeros([GP, D], gl.float32, QL)
    for pc in range(p0, p1):
        sk = c % STAGES
        sv = (c + 1) % STAGES
        mbarrier.wait(ready.index(sk), (c // STAGES) & 1)
        mbarrier.wait(ready.index(sv), ((c + 1) // STAGES) & 1)
        kt = _kv_view(w_smem.index(sk), desc_k).load(KL).to(gl.float32)
        vt = _kv_view(w_smem.index(sv), desc_k).load(KL).to(gl.float32)
        gl.thread_barrier()  # every warp has its piece of both slots in registers
        mbarrier.arrive(empty.index(sk), count=1)
        mbarrier.arrive(empty.index(sv), count=1)
        c += 2
        # keys outside the split (whole pieces are read) are masked, their values zeroed: a stale or unwritten slot
        # may hold anything, NaN included
        vt = gl.where(((pc * PR + nk >= klo) & (pc * PR + nk < khi))[:, None], vt, 0.0)
        s = gl.sum(q[:, None, :] * kt[None, :, :], axis=2)  # [GP, PR]
        s = gl.where(((pc * PR + nn >= klo) & (pc * PR + nn < khi))[None, :], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        pr = gl.exp(s - m_safe[:, None])
        alpha = gl.exp(m_i - m_safe)
        pv = gl.sum(pr[:, :, None] * vt[None, :, :], axis=1)  # [GP, D]
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, QL))[:, None] + pv
        l_i = l_i * alpha + gl.sum(pr, axis=1)
        m_i = m_new
    if split == S - 1:  # the new token: K rotated, V as is, into the softmax from registers and into the cache
        NQ: gl.constexpr = HQ * D
        ko = NQ + h * D
        vo = NQ + HKV * D + h * D
        kn = _rope(gl.load(QKV + ko + dq), gl.load(QKV + ko + (dq ^ 1)), dq, pos * f_q)
        vn = gl.load(QKV + vo + dq)
        page = gl.load(PT + (n - 1) // PAGE)
        slot = (layer.to(gl.int64) * num_pages) * PAGE * HKV * D + h * D + \
            (page.to(gl.int64) * PAGE + (n - 1) % PAGE) * HKV * D
        gl.store(KC + slot + dq, kn.to(KC.dtype.element_ty))
        gl.store(VC + slot + dq, vn.to(VC.dtype.element_ty))
        # the cache's rounding, as the key and value are read in every later step
        kn = kn.to(KC.dtype.element_ty).to(gl.float32)
        vn = vn.to(VC.dtype.element_ty).to(gl.float32)
        s_n = gl.convert_layout(gl.sum(q * kn[None, :], axis=1), gl.SliceLayout(1, SL))
        m_new = gl.maximum(m_i, s_n)
        alpha = gl.exp(m_i - m_new)
        pn = gl.exp(s_n - m_new)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, QL))[:, None] + \
            gl.convert_layout(pn, gl.SliceLayout(1, QL))[:, None] * vn[None, :]
        l_i = l_i * alpha + pn
        m_i = m_new
    has = l_i > 0
    den = gl.where(has, l_i, 1.0)
    base = (h * G + g) * S + split
    gl.store(PART_O + base[:, None] * D + dq[None, :], acc / gl.convert_layout(den, gl.SliceLayout(1, QL))[:, None],
             mask=qm)
    lse = gl.where(has, m_i + gl.log(den), float("-inf"))
    LS: gl.constexpr = gl.SliceLayout(1, SL)
    gl.store(PART_L + gl.convert_layout(base, LS), lse, mask=gl.convert_layout(gm, LS))
    return c


@gluon.jit
def _merge(lo, hi, PART_O, PART_L, ATTN, B: gl.constexpr, HQ: gl.constexpr, D: gl.constexpr, S: gl.constexpr,
           SP: gl.constexpr):
    """Query heads [lo, hi): their splits merged (kernel._merge)."""
    LM: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [gl.num_warps(), 1], [1, 0])  # [SP, D]
    si = gl.arange(0, SP, layout=gl.SliceLayout(1, LM))
    di = gl.arange(0, D, layout=gl.SliceLayout(0, LM))
    for b in gl.static_range(B):
        for gg in range(lo, hi):
            hq = b * HQ + gg
            lse = gl.load(PART_L + hq * S + si, mask=si < S, other=float("-inf"))
            m = gl.max(lse, axis=0)
            w = gl.where(lse == float("-inf"), 0.0, gl.exp(lse - m))
            o = gl.load(PART_O + (hq * S + si[:, None]) * D + di[None, :], mask=(si < S)[:, None] & (di < D)[None, :],
                        other=0.0)
            gl.store(ATTN + hq * D + di, gl.sum(o * w[:, None], axis=0) / gl.sum(w, axis=0))


@gluon.jit
def _compute(w_smem, h_smem, x_smem, xq_smem, xd_smem, ready, empty, desc_k, PROG, n_instr, sm, COUNTERS, ERR, IDS,
             SEQ_LENS, PT, KC, VC, INV_FREQ, EMB, NORMS, ONORM, n_layers, RESID, QKV, PART_O, PART_L, ATTN, ACT,
             LOGITS, num_pages, pages_per_seq, eps, qk_scale, spin_limit, TR, B: gl.constexpr, H: gl.constexpr,
             HQ: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr, F: gl.constexpr, S: gl.constexpr,
             SP: gl.constexpr, PAGE: gl.constexpr, GP: gl.constexpr, STAGES: gl.constexpr, FMT: gl.constexpr,
             TRACE: gl.constexpr, QSTEP: gl.constexpr, QDOT: gl.constexpr, KVT: gl.constexpr):
    ok = 1
    c = 0
    for j in range(n_instr):
        p = PROG + j * NF
        if TRACE:  # (start, waited, done) of every instruction, global nanoseconds
            gl.store(TR + (sm * n_instr + j) * 3, _now())
        op = gl.load(p)
        layer = gl.load(p + 1)
        lo = gl.load(p + 2)
        hi = gl.load(p + 3)
        split = gl.load(p + 4)
        wait = gl.load(p + 5)
        target = gl.load(p + 6)
        if (ok == 1) & (op != 0) & (wait >= 0):
            v = gl.atomic_add(COUNTERS + wait, 0, sem="acquire")
            spins = 0
            while (v < target) & (spins < spin_limit):
                v = gl.atomic_add(COUNTERS + wait, 0, sem="acquire")
                spins += 1
            if v < target:  # the schedule cannot finish: record where, stop waiting (wrong results, no hang)
                if gl.atomic_cas(ERR, 0, 1) == 0:
                    gl.atomic_xchg(ERR + 1, sm * n_instr + j)
                ok = 0
        if TRACE:
            gl.store(TR + (sm * n_instr + j) * 3 + 1, _now())
        # the slots of every GEMV are consumed even after a failed wait, so the loader never blocks
        if op == 1:
            _embed(EMB, IDS, RESID, H, B)
        elif op == 2:
            _stage_any(x_smem, xq_smem, xd_smem, RESID, NORMS + layer * 2 * H, H, eps, True, FMT, H)
            c = _gemv_any(w_smem, h_smem, x_smem, xq_smem, xd_smem, ready, empty, c, lo, hi, H, QKV, False, False,
                          STAGES, FMT, QSTEP, QDOT)
        elif op == 3:
            if KVT:
                c = _attn_ring(w_smem, ready, empty, c, layer, lo, split, QKV, KC, VC, PT, SEQ_LENS, INV_FREQ, PART_O,
                               PART_L, num_pages, qk_scale, desc_k, HQ, HKV, D, S, PAGE, GP, STAGES)
            else:
                _attn(layer, lo, split, QKV, KC, VC, PT, SEQ_LENS, INV_FREQ, PART_O, PART_L, num_pages, pages_per_seq,
                      qk_scale, B, HQ, HKV, D, S, PAGE, GP, 32)
        elif op == 4:
            _merge(lo, hi, PART_O, PART_L, ATTN, B, HQ, D, S, SP)
        elif op == 5:
            _stage_any(x_smem, xq_smem, xd_smem, ATTN, ATTN, HQ * D, eps, False, FMT, H)
            c = _gemv_any(w_smem, h_smem, x_smem, xq_smem, xd_smem, ready, empty, c, lo, hi, HQ * D, RESID, True,
                          False, STAGES, FMT, QSTEP, QDOT)
        elif op == 6:
            _stage_any(x_smem, xq_smem, xd_smem, RESID, NORMS + layer * 2 * H + H, H, eps, True, FMT, H)
            c = _gemv_any(w_smem, h_smem, x_smem, xq_smem, xd_smem, ready, empty, c, lo, hi, H, ACT, False, True,
                          STAGES, FMT, QSTEP, QDOT)
        elif op == 7:
            _stage_any(x_smem, xq_smem, xd_smem, ACT, ACT, F, eps, False, FMT, H)
            c = _gemv_any(w_smem, h_smem, x_smem, xq_smem, xd_smem, ready, empty, c, lo, hi, F, RESID, True, False,
                          STAGES, FMT, QSTEP, QDOT)
        elif op == 8:
            _stage_any(x_smem, xq_smem, xd_smem, RESID, ONORM, H, eps, True, FMT, H)
            c = _gemv_any(w_smem, h_smem, x_smem, xq_smem, xd_smem, ready, empty, c, lo, hi, H, LOGITS, False,
                          False, STAGES, FMT, QSTEP, QDOT)
        if op != 0:
            gl.thread_barrier()  # every warp's stores come before the one-thread releases
            if TRACE:
                gl.store(TR + (sm * n_instr + j) * 3 + 2, _now())
            for cn in range(gl.load(p + 7), gl.load(p + 8)):
                gl.atomic_add(COUNTERS + cn, 1, sem="release")


@gluon.jit
def fast_step_kernel(desc_a, desc_o, desc_d, hdesc_a, hdesc_o, hdesc_d, desc_k, desc_v, PROG, n_instr, COUNTERS, ERR,
                     IDS, SEQ_LENS,
                     PT, KC, VC, INV_FREQ, EMB, MT, NORMS, ONORM, n_layers, RESID, QKV, PART_O, PART_L, ATTN, ACT,
                     LOGITS, num_pages, pages_per_seq, eps, qk_scale, spin_limit, TR, B: gl.constexpr, H: gl.constexpr,
                     HQ: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr, F: gl.constexpr, S: gl.constexpr,
                     SP: gl.constexpr, PAGE: gl.constexpr, GP: gl.constexpr, STAGES: gl.constexpr,
                     FMT: gl.constexpr, CW: gl.constexpr = 4, TRACE: gl.constexpr = False,
                     QSTEP: gl.constexpr = 2, QDOT: gl.constexpr = 1, KVT: gl.constexpr = True):
    """FMT 0: bf16 weights (desc_*: [16, 256] boxes; hdesc_* unused); 1: q4_k blocks as stored (desc_*: code
    bytes, hdesc_*: headers, megakernel_stream_q4k.q4k_descriptors) with int8 activations."""
    sm = gl.program_id(0)
    PROG_SM = PROG + sm * n_instr * NF
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    if FMT == 0:
        w_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 16, BK], desc_a.layout)
        x_smem = gl.allocate_shared_memory(gl.float32, [64, BK], flat)
        h_smem = w_smem
        xq_smem = x_smem
        xd_smem = x_smem
    else:
        w_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, 16, 2, 128], desc_a.layout)
        h_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, 16, 2, 16], hdesc_a.layout)
        xq_smem = gl.allocate_shared_memory(gl.int8, [16384], flat)
        xd_smem = gl.allocate_shared_memory(gl.float32, [1024], flat)
        x_smem = xd_smem
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(ready.index(j), count=1)
        mbarrier.init(empty.index(j), count=1)
    gl.warp_specialize([
        (_loader, (desc_a, desc_o, desc_d, hdesc_a, hdesc_o, hdesc_d, desc_k, desc_v, w_smem, h_smem, ready, empty,
                   PROG_SM, n_instr, MT, n_layers, SEQ_LENS, PT, num_pages, H, HQ * D, F, STAGES, FMT, S, PAGE, D,
                   KVT)),
        (_compute, (w_smem, h_smem, x_smem, xq_smem, xd_smem, ready, empty, desc_k, PROG_SM, n_instr, sm, COUNTERS,
                    ERR, IDS, SEQ_LENS, PT, KC, VC, INV_FREQ, EMB, NORMS, ONORM, n_layers, RESID, QKV, PART_O, PART_L,
                    ATTN, ACT, LOGITS, num_pages, pages_per_seq, eps, qk_scale, spin_limit, TR, B, H, HQ, HKV, D, F,
                    S, SP, PAGE, GP, STAGES, FMT, TRACE, QSTEP, QDOT, KVT)),
    ], [CW], [232 if CW == 4 else 192])


def _layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)


class FastStep:
    """Runs a batch-1 Program over bf16 or q4_k GGUF tensors (``name -> QuantizedTensor``, every matrix in one of
    the two) with the reference executor's buffers and call signature (kernel.DecodeStep). q4_k: the products take
    the activations rounded to int8 per block of 32 (the engine's act_int8 arithmetic)."""

    def __init__(self, prog, cfg, tensors, k_cache, v_cache, inv_freq, *, stages=16, warps=4, spin_limit=1 << 22,
                 trace=False, qstep=2, qdot=1, kv_ring=True, stacks=None):
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        from llmkernels.quant import dequantize

        if prog.geometry["batch"] != 1:
            raise ValueError(f"the fast step runs batch 1, the program has batch {prog.geometry['batch']}")
        L, H, D, F = cfg.n_layers, cfg.hidden, cfg.head_dim, cfg.ffn
        KO = cfg.n_heads * D
        for name, k in (("hidden", H), ("heads * head_dim", KO), ("ffn", F)):
            if k % 512 or k > 16384:
                raise ValueError(f"{name} must be a multiple of 512 up to 16384, got {k}")
        # a subtile stores 16 whole rows: every tile (and so every section) a multiple of 16 rows
        if (cfg.n_heads + 2 * cfg.n_kv_heads) * D % ROWS or cfg.vocab_size % ROWS:
            raise ValueError(f"the QKV rows and the vocabulary must be multiples of {ROWS}")
        dev = k_cache.device
        self.fmt = tensors["blk.0.attn_q.weight"].format
        if self.fmt not in ("bf16", "q4_k"):
            raise ValueError(f"the fast step reads bf16 or q4_k weights, got {self.fmt}")

        # per matrix class (K): its matrices stacked by rows, one TMA descriptor each; ``stacks`` (from
        # megakernel.weights.share_stacks of an engine model) are read in place, else the tensors are copied
        st = stacks if stacks is not None else stack_tensors(cfg, tensors, dev)
        if st.format != self.fmt:
            raise ValueError(f"every matrix must be {self.fmt}, the stacks hold {st.format}")
        self.stacks = {k: getattr(st, k).view(torch.bfloat16) if self.fmt == "bf16" else getattr(st, k)
                       for k in "aod"}
        mt = st.table
        emb = tensors["token_embd.weight"]
        self.emb = (emb.data.reshape(emb.shape[0], -1).view(torch.bfloat16) if self.fmt == "bf16"
                    else dequantize(emb, torch.bfloat16)).to(dev)
        self.mt = mt.to(dev)

        if self.fmt == "bf16":
            self.descs = tuple(TensorDescriptor(t, list(t.shape), [t.shape[1], 1], [ROWS, 256], _layout())
                               for t in (self.stacks[k] for k in "aod")) * 2
        else:
            d = [q4k_descriptors(self.stacks[k], ROWS, True) for k in "aod"]
            self.descs = tuple(x[0] for x in d) + tuple(x[1] for x in d)

        # the caches seen as [rows, kv heads * head dim]: one box is PR keys of one KV head within a page
        page = k_cache.shape[2]
        pr = min(page, 16)
        if page & (page - 1) or cfg.head_dim > 128 or cfg.head_dim % 32:
            raise ValueError(f"the fast step needs a power-of-2 page size and a head_dim in 32..128, a multiple of "
                             f"32; got page {page}, head_dim {cfg.head_dim}")
        kv_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
        if k_cache.element_size() != 2:
            raise ValueError(f"the fast step reads 16-bit caches, got {k_cache.dtype}")
        width = cfg.n_kv_heads * D
        self.kv_descs = tuple(TensorDescriptor(c.view(-1, width), [c[..., 0, 0].numel(), width], [width, 1], [pr, D],
                                               kv_layout) for c in (k_cache, v_cache))

        def vec(name):
            t = tensors[name]
            if not isinstance(t, torch.Tensor):
                from llmkernels.quant import dequantize
                t = dequantize(t, torch.float32)
            return t.float().to(dev)
        self.norms = torch.stack([torch.stack([vec(f"blk.{i}.attn_norm.weight"), vec(f"blk.{i}.ffn_norm.weight")])
                                  for i in range(L)]).contiguous()
        self.onorm = vec("output_norm.weight")
        self.prog, self.cfg, self.kc, self.vc = prog, cfg, k_cache, v_cache
        self.inv_freq = inv_freq.float().contiguous().to(dev)
        self.table = torch.from_numpy(prog.encode()).to(dev)
        self.counters = torch.zeros(prog.num_counters, dtype=torch.int32, device=dev)
        self.err = torch.zeros(2, dtype=torch.int32, device=dev)
        S = prog.geometry["splits"]
        f32 = dict(dtype=torch.float32, device=dev)
        self.resid = torch.empty(1, H, **f32)
        self.qkv = torch.empty(1, (cfg.n_heads + 2 * cfg.n_kv_heads) * D, **f32)
        self.part_o = torch.empty(1, cfg.n_heads, S, D, **f32)
        self.part_l = torch.empty(1, cfg.n_heads, S, **f32)
        self.attn = torch.empty(1, KO, **f32)
        self.act = torch.empty(1, F, **f32)
        self.logits = torch.empty(1, cfg.vocab_size, **f32)
        if warps not in (4, 8):
            raise ValueError(f"warps (the compute partition's) must be 4 or 8, got {warps}")
        self.stages, self.warps, self.spin_limit, self.qstep, self.qdot = stages, warps, spin_limit, qstep, qdot
        self.kv_ring = kv_ring
        self.trace = torch.zeros(prog.num_sms, self.table.shape[1], 3, dtype=torch.int64, device=dev) if trace else None

    def launch(self, ids, seq_lens, page_table):
        import triton

        cfg, S = self.cfg, self.prog.geometry["splits"]
        G = cfg.n_heads // cfg.n_kv_heads
        self.counters.zero_()
        fast_step_kernel[(self.prog.num_sms,)](
            *self.descs, *self.kv_descs, self.table, self.table.shape[1], self.counters, self.err, ids, seq_lens,
            page_table,
            self.kc, self.vc, self.inv_freq, self.emb, self.mt, self.norms, self.onorm, cfg.n_layers, self.resid,
            self.qkv, self.part_o, self.part_l, self.attn, self.act, self.logits, self.kc.shape[1],
            page_table.shape[1], cfg.rms_eps, cfg.attn_scale or cfg.head_dim ** -0.5, self.spin_limit,
            self.err if self.trace is None else self.trace, B=1,
            H=cfg.hidden, HQ=cfg.n_heads, HKV=cfg.n_kv_heads, D=cfg.head_dim, F=cfg.ffn, S=S,
            SP=triton.next_power_of_2(S), PAGE=self.kc.shape[2], GP=triton.next_power_of_2(G), STAGES=self.stages,
            FMT=int(self.fmt == "q4_k"), CW=self.warps, TRACE=self.trace is not None, QSTEP=self.qstep, QDOT=self.qdot,
            KVT=self.kv_ring, num_warps=4)

    def __call__(self, ids, seq_lens, page_table):
        self.launch(ids, seq_lens, page_table)
        if int(self.err[0]):
            sm, j = divmod(int(self.err[1]), self.table.shape[1])
            i = self.prog.lists[sm][j]
            raise RuntimeError(f"fast step: SM {sm} gave up at {i.op} layer {i.layer} [{i.lo}, {i.hi}) waiting for "
                               f"counter {i.wait} ({self.prog.counter_names[i.wait]}) to reach {i.target}")
        return self.logits


def trace_summary(prog, tr):
    """Where an SM's time goes in a traced step: per op, the mean over SMs of the time its instructions spent
    waiting for their counters and running (us), which add up to the step's span."""
    tr = tr.cpu()
    sms = prog.num_sms
    t0 = min(int(tr[sm, 0, 0]) for sm in range(sms) if prog.lists[sm])
    end = max(int(tr[sm, len(prog.lists[sm]) - 1, 2]) for sm in range(sms) if prog.lists[sm])
    wait, run, count = {}, {}, {}
    for sm in range(sms):
        for j, ins in enumerate(prog.lists[sm]):
            a, b, c = (int(x) for x in tr[sm, j])
            wait[ins.op] = wait.get(ins.op, 0) + b - a
            run[ins.op] = run.get(ins.op, 0) + c - b
            count[ins.op] = count.get(ins.op, 0) + 1
    lines = [f"traced step: {(end - t0) / 1e3:.1f} us from the first instruction's start to the last one's end; "
             f"per SM (mean over {sms}), us waiting / running:"]
    for op in count:
        lines.append(f"  {op:8s} {count[op]:6d} instructions  wait {wait[op] / sms / 1e3:8.1f}  run "
                     f"{run[op] / sms / 1e3:8.1f}")
    return "\n".join(lines)


def check_tiny(fmt, stages, warps=4, steps=9, **q):
    """Every step's logits of the fast step against the reference executor on a tiny llama GGUF in ``fmt`` (each
    with its own NaN-poisoned cache, the same scattered pages), one program per SM for both. q4_k: the fast step's
    int8 activations make it differ from the reference (float32 activations) by their rounding, so the bound is
    looser and the greedy token is reported, not required."""
    import tempfile

    from llmkernels.engine import ModelConfig, convert_hf_to_gguf
    from llmkernels.engine.config import rope_inv_freq
    from llmkernels.megakernel import build_decode_program
    from llmkernels.megakernel.kernel import DecodeStep
    from llmkernels.quant import read_gguf
    from llmkernels.testing.tiny_models import make_checkpoint

    d = tempfile.mkdtemp()
    make_checkpoint(d, "llama", hidden=512, ffn=1024, heads=8, kv_heads=2, head_dim=64)
    f = read_gguf(convert_hf_to_gguf(d, f"{d}/model-{fmt}.gguf", fmt, progress=False))
    cfg = ModelConfig.from_gguf(f.metadata, f.keys())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bound = 1e-3 if fmt == "bf16" else 5e-2
    worst, same = 0.0, 0
    for splits in (2, 3):
        prog = build_decode_program(cfg, fmt, batch=1, context=16, num_sms=sms, num_splits=splits)
        page, pages = 4, 4
        shape = (cfg.n_layers, pages + 3, page, cfg.n_kv_heads, cfg.head_dim)
        caches = [torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(4)]
        table = torch.randperm(pages + 3)[:pages].view(1, pages).to(torch.int32).cuda()
        inv, _ = rope_inv_freq(cfg)
        ref = DecodeStep(prog, cfg, f, caches[0], caches[1], inv.cuda(), batch=1)
        fast = FastStep(prog, cfg, f, caches[2], caches[3], inv.cuda(), stages=stages, warps=warps, **q)
        ids = torch.randint(1, cfg.vocab_size, (steps,), dtype=torch.int32)
        for t in range(steps):
            args = (ids[t:t + 1].cuda(), torch.full((1,), t + 1, dtype=torch.int32, device="cuda"), table)
            want = ref(*args).clone()
            got = fast(*args)
            e = ((got - want).abs().max() / want.abs().max()).item()
            worst = max(worst, e)
            same += int(got.argmax() == want.argmax())
            if not e < bound or (fmt == "bf16" and got.argmax() != want.argmax()):
                print(f"{fmt} splits {splits} step {t}: fast step differs from the reference: {e:.2e} of the "
                      f"largest logit, argmax {got.argmax().item()} vs {want.argmax().item()}", flush=True)
                return False
    print(f"tiny {fmt} llama, {warps} compute warps, {steps} steps, 2 and 3 key splits, {sms} SMs: fast step = "
          f"reference executor within "
          f"{worst:.1e} of the largest logit, same argmax at {same} of {2 * steps} steps", flush=True)
    return True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fmt", default="bf16,q4_k")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", default="512", help="comma-separated context lengths (the engine runs the first)")
    ap.add_argument("--stages", default="16", help="ring slots (bf16: 8 KB each; q4_k: 4.5 KB, up to 24)")
    ap.add_argument("--warps", default="4", help="comma-separated: the compute partition's warps (4 or 8)")
    ap.add_argument("--qstep", type=int, default=2, help="q4_k: slots per barrier")
    ap.add_argument("--qdot", type=int, default=1, help="q4_k: _slot_dot's DOT (1: fewer instructions)")
    ap.add_argument("--kv-ring", type=int, default=1, help="1: ATTN's keys and values streamed by the loader")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--trace", action="store_true", help="then one traced step per context: where the time goes")
    args = ap.parse_args()
    from llmkernels.bench.harness import measure_read_bandwidth, time_graph_ms
    from llmkernels.bench.suites.engine import llama3_8b_config, synthetic_tensors
    from llmkernels.engine.config import rope_inv_freq
    from llmkernels.megakernel import build_decode_program, describe, simulate
    from megakernel_step import engine_rate

    stages = [int(x) for x in args.stages.split(",")]
    warps = [int(x) for x in args.warps.split(",")]
    contexts = [int(x) for x in args.context.split(",")]
    cfg = llama3_8b_config(args.layers)
    bw = measure_read_bandwidth() * 1e12
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    inv, _ = rope_inv_freq(cfg)
    for fmt in args.fmt.split(","):
        q = dict(qstep=args.qstep, qdot=args.qdot, kv_ring=bool(args.kv_ring))
        if not args.skip_check and not all(check_tiny(fmt, stages[0], w, **q) for w in warps):
            continue
        tensors = synthetic_tensors(fmt, cfg)
        for context in contexts:
            prog = build_decode_program(cfg, fmt, batch=1, context=context, num_sms=sms, bandwidth=bw)
            print(describe(prog, simulate(prog, bandwidth=bw)), flush=True)
            page = 16
            pages = -(-(context + 1) // page)
            kc = torch.randn(cfg.n_layers, pages, page, cfg.n_kv_heads, cfg.head_dim, device="cuda",
                             dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            table = torch.arange(pages, dtype=torch.int32, device="cuda").view(1, pages)
            ids = torch.ones(1, dtype=torch.int32, device="cuda")
            lens = torch.full((1,), context, dtype=torch.int32, device="cuda")
            for w in warps:
                for st in stages:
                    fast = FastStep(prog, cfg, tensors, kc, vc, inv.cuda(), stages=st, warps=w, **q)
                    fast(ids, lens, table)
                    torch.cuda.synchronize()
                    ms = time_graph_ms([functools.partial(fast.launch, ids, lens, table)], reps=10)
                    print(f"{fmt} fast step, context {context}, {w} compute warps, {st} slots: {ms * 1e3:.1f} us "
                          f"per step, {100 * prog.weight_bytes / bw / (ms * 1e-3):.1f}% of the weight-bandwidth "
                          f"bound ({prog.weight_bytes / 1e9:.2f} GB at {bw / 1e12:.2f} TB/s)", flush=True)
                    del fast
                    torch.cuda.empty_cache()
            if args.trace:
                fast = FastStep(prog, cfg, tensors, kc, vc, inv.cuda(), stages=stages[0], warps=warps[0], trace=True,
                                **q)
                fast(ids, lens, table)
                fast(ids, lens, table)
                torch.cuda.synchronize()
                print(f"{fmt}, context {context}: " + trace_summary(prog, fast.trace), flush=True)
                del fast
            del kc, vc
            torch.cuda.empty_cache()
        # q4_k: the fast step rounds activations to int8, so the engine's act_int8 path is its like
        for a8 in ((False, True) if fmt == "q4_k" and not args.skip_engine else (False,) * (not args.skip_engine)):
            rate = engine_rate(cfg, tensors, contexts[0], act_int8=a8)
            print(f"engine, kernel per op, {fmt}{' act_int8' * a8}, context {contexts[0]}: {rate:.1f} tokens/s, "
                  f"{1e3 / rate:.2f} ms per step", flush=True)
        del tensors
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
