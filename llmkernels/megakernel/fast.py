"""The one-kernel decode step's fast executor (Gluon, sm_90; bf16 or q4_k weights, batch 1): the instruction lists
of schedule.py run by one persistent program per SM with two partitions.

- A loader walks the SM's list and streams the weight boxes of every GEMV instruction (QKV, O, GATEUP, DOWN,
  LOGITS: [16, 256] bf16 or two q4_k super-blocks of 16 rows, TMA) into a ring of shared-memory slots. It never
  waits on a counter, so the next instruction's weights are in flight while the compute warps wait, or run
  attention, merges and norms.
- The compute warps walk the same list: wait (acquire polls; a spin limit records the first stuck instruction and
  stops waiting, so a bad schedule ends with an error, not a hung GPU), stage the instruction's input in shared
  memory once (float32, or int8 per block of 32 for q4_k: the RMSNorm of the residual for QKV, GATEUP and LOGITS,
  the attention output for O, the FFN activation for DOWN), take the products slot by slot, write the outputs,
  then release their counters.

Buffers, RoPE (interleaved) and instruction semantics are the reference executor's (kernel.py): the two run the
same Program and are compared in tests/megakernel. The weights are the three stacks of weights.py (one copy with
the engine's model where ``share_stacks`` made them). The KV caches are [layers, pages, page, kv heads, head dim]
views with any layer stride (the engine's cache holds K and V of a layer side by side).
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import (DotOperandLayout, NVMMADistributedLayout, async_copy,
                                                               mma_v2)
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from ..attention.paged_ws import _now
from .q4k import int8_input_smem, inv_rms, q4k_copy, q4k_descriptors, q4k_pair_step, q4k_step, stage_q
from .weights import WeightStacks, stack_tensors

NF = gl.constexpr(9)  # schedule.FIELDS: op, layer, lo, hi, split, wait, target, sig_lo, sig_hi
BK = gl.constexpr(256)  # weight columns per ring slot
ROWS = 16  # weight rows per slot (schedule.ROW_GRANULE: every GEMV tile is a multiple)
MTW = gl.constexpr(8)  # int32 fields per row of the matrix table
MAX_BATCH = 8  # sequences per step (bf16); q4_k runs one


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
def _loader(desc_a, desc_o, desc_d, hdesc_a, hdesc_o, hdesc_d, w_smem, h_smem, ready, empty, gate, PROG, n_instr,
            MT, n_layers, H: gl.constexpr, KO: gl.constexpr, F: gl.constexpr, STAGES: gl.constexpr,
            FMT: gl.constexpr, DIAG: gl.constexpr, HOLD: gl.constexpr, PAD: gl.constexpr = 0,
            XPC: gl.constexpr = 65536, BMMA: gl.constexpr = False):
    """Every GEMV instruction's slots in the compute warps' order: per 16-row subtile (GATEUP: gate, then up),
    K / 256 boxes of bf16 (FMT 0), or K / 512 slots of q4_k read in the GGUF layout (FMT 1: two super-blocks' code
    bytes and their headers, q4k_copy). HOLD > 0: at an ATTN instruction it waits on ``gate`` (the compute warps
    open it once past that split's wait, HOLD 1 and 3, or done with it, HOLD 2), and with HOLD 3 at a MERGE until
    it is past its wait, so those loads and signals do not queue behind this SM's weight stream. PAD (16 compute
    warps, q4_k): a row of an odd number of slots gets a filler slot (arrived, never filled), as the products take
    the slots in pairs. XPC (batch > 1): an instruction's slots go in pieces of XPC per row, every subtile's first
    piece, then every subtile's second..., the order in which _gemv_b stages its input; BMMA: a bf16 slot is four
    [16, 64] boxes with the 128-byte swizzle (the mma's A operand), in w_smem rows 4 s .. 4 s + 3."""
    c = 0
    na = 0
    for j in range(n_instr):
        p = PROG + j * NF
        op = gl.load(p)
        layer = gl.load(p + 1)
        lo = gl.load(p + 2)
        hi = gl.load(p + 3)
        if HOLD > 0:
            if (op == 3) | ((HOLD == 3) & (op == 4)):
                mbarrier.wait(gate, na & 1)
                na += 1
        base, K, which, up = _gemv_source(MT, op, layer, n_layers, H, KO, F)
        nmat = 1 + (op == 6).to(gl.int32)
        nk = K // (BK * (1 + FMT))
        for p0 in range(0, nk, XPC):  # batch > 1: pieces of the staged input's width, each piece's subtiles
            for r in range(lo, hi, 16):
                for m in range(nmat):
                    row = base + r + m * up
                    for kc in range(p0, gl.minimum(p0 + XPC, nk) + PAD * (nk % 2)):
                        s = c % STAGES
                        mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
                        if kc == nk:  # PAD: a filler slot after a row of an odd count, so the products take pairs
                            mbarrier.arrive(ready.index(s), count=1)
                        elif (DIAG == 1) | (DIAG == 3):  # timing only: the slot is released unfilled
                            gl.thread_barrier()
                            mbarrier.arrive(ready.index(s), count=1)
                        elif (FMT == 0) & BMMA:  # batch > 1 on the tensor cores: four [16, 64] boxes a slot
                            mbarrier.expect(ready.index(s), 4 * desc_a.block_type.nbytes)
                            for q in gl.static_range(4):
                                if which == 0:
                                    tma.async_copy_global_to_shared(desc_a, [row, kc * BK + 64 * q], ready.index(s),
                                                                    w_smem.index(s * 4 + q))
                                elif which == 1:
                                    tma.async_copy_global_to_shared(desc_o, [row, kc * BK + 64 * q], ready.index(s),
                                                                    w_smem.index(s * 4 + q))
                                else:
                                    tma.async_copy_global_to_shared(desc_d, [row, kc * BK + 64 * q], ready.index(s),
                                                                    w_smem.index(s * 4 + q))
                        elif FMT == 0:
                            mbarrier.expect(ready.index(s), desc_a.block_type.nbytes)
                            if which == 0:
                                tma.async_copy_global_to_shared(desc_a, [row, kc * BK], ready.index(s),
                                                                w_smem.index(s))
                            elif which == 1:
                                tma.async_copy_global_to_shared(desc_o, [row, kc * BK], ready.index(s),
                                                                w_smem.index(s))
                            else:
                                tma.async_copy_global_to_shared(desc_d, [row, kc * BK], ready.index(s),
                                                                w_smem.index(s))
                        else:
                            mbarrier.expect(ready.index(s), desc_a.block_type.nbytes + hdesc_a.block_type.nbytes)
                            if which == 0:
                                q4k_copy(desc_a, hdesc_a, row, kc, ready.index(s), w_smem.index(s), h_smem.index(s),
                                         True)
                            elif which == 1:
                                q4k_copy(desc_o, hdesc_o, row, kc, ready.index(s), w_smem.index(s), h_smem.index(s),
                                         True)
                            else:
                                q4k_copy(desc_d, hdesc_d, row, kc, ready.index(s), w_smem.index(s), h_smem.index(s),
                                         True)
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
            inv = inv_rms(X, K, eps)
        gl.thread_barrier()
        _stage_pieces(xs, X, NW, nk, inv, r, k, NORM)
    gl.thread_barrier()


@gluon.jit
def _subtile(w_smem, x_smem, ready, empty, c, nk, STAGES: gl.constexpr, DIAG: gl.constexpr = 0):
    """One 16-row subtile's products over the staged input: nk slots from the ring -> ([16] float32, c + nk).
    DIAG 2 or 3 (timing only): the slots are taken and released without products."""
    L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])  # [16, 256]: warps by rows
    XK: gl.constexpr = gl.SliceLayout(0, L)
    acc = gl.zeros([16, BK], gl.float32, L)
    for kc in range(nk):
        x = x_smem.index(kc).load(XK)
        s = c % STAGES
        mbarrier.wait(ready.index(s), (c // STAGES) & 1)
        if (DIAG == 2) | (DIAG == 3):
            gl.thread_barrier()
            mbarrier.arrive(empty.index(s), count=1)
        else:
            w = w_smem.index(s).load(L).to(gl.float32)
            gl.thread_barrier()  # every warp has its piece of the slot in registers
            mbarrier.arrive(empty.index(s), count=1)
            acc += w * x[None, :]
        c += 1
    return gl.sum(acc, axis=1), c


@gluon.jit
def _subtile_q4k(c_smem, h_smem, xq_smem, xd_smem, ready, empty, c, K, L4: gl.constexpr, STAGES: gl.constexpr,
                 QSTEP: gl.constexpr, QDOT: gl.constexpr):
    if gl.num_warps() == 16:  # slots in pairs, half the warps on each (_loader pads a row to an even count)
        L5: gl.constexpr = gl.BlockedLayout([1, 1, 1, 1, 4], [1, 4, 1, 4, 2], [2, 4, 2, 1, 1], [4, 3, 2, 1, 0])
        acc5 = gl.zeros([2, 16, 2, 4, 1], gl.float32, L5)
        for kp in range(0, K // 512, 2):
            acc5, c = q4k_pair_step(c_smem, h_smem, xq_smem, xd_smem, ready, empty, c, kp, K // 512, acc5, L5,
                                    STAGES, QDOT)
        y = gl.sum(gl.sum(gl.sum(gl.sum(acc5, axis=4), axis=3), axis=2), axis=0)
        return gl.convert_layout(y, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L4)))), c
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
        stage_q(xq_smem, xd_smem, X, NW, K, eps, 0, NORM)


@gluon.jit
def _subtile_any(w_smem, h_smem, x_smem, xq_smem, xd_smem, ready, empty, c, K, L4: gl.constexpr,
                 STAGES: gl.constexpr, FMT: gl.constexpr, QSTEP: gl.constexpr, QDOT: gl.constexpr,
                 DIAG: gl.constexpr):
    if FMT == 0:
        y, c = _subtile(w_smem, x_smem, ready, empty, c, K // BK, STAGES, DIAG)
    else:
        y, c = _subtile_q4k(w_smem, h_smem, xq_smem, xd_smem, ready, empty, c, K, L4, STAGES, QSTEP, QDOT)
    return y, c


@gluon.jit
def _gemv_any(w_smem, h_smem, x_smem, xq_smem, xd_smem, ready, empty, c, lo, hi, K, OUT, ACC: gl.constexpr,
              GLU: gl.constexpr, STAGES: gl.constexpr, FMT: gl.constexpr, QSTEP: gl.constexpr, QDOT: gl.constexpr,
              DIAG: gl.constexpr, ARGMAX: gl.constexpr = False):
    """Rows [lo, hi) of the instruction's matrix: OUT[rows] = y (ACC: OUT[rows] += y; GLU: y = SiLU(gate) * up,
    gate and up subtiles taken in turn, as the loader streams them) -> (c after its slots, the largest _argmax_key
    of the rows with ARGMAX, else 0). bf16 (FMT 0): _subtile; q4_k: _subtile_q4k (q4k._slot_dot: dp4a on the int8
    input)."""
    # q4_k: [16 rows, 2 super-blocks, 4 chunks of 64 weights, 8 code words]: a thread per chunk with 4 warps; with
    # 8, two threads per chunk (4 words each), so a 16-row slot still has no replicated work
    if gl.num_warps() == 16:  # four threads per chunk (2 words each)
        L4: gl.constexpr = gl.BlockedLayout([1, 1, 1, 2], [4, 1, 2, 4], [4, 2, 2, 1], [3, 2, 1, 0])
    elif gl.num_warps() == 8:
        L4: gl.constexpr = gl.BlockedLayout([1, 1, 1, 4], [8, 1, 2, 2], [2, 2, 2, 1], [3, 2, 1, 0])
    else:
        L4: gl.constexpr = gl.BlockedLayout([1, 1, 1, 8], [4, 2, 4, 1], [gl.num_warps(), 1, 1, 1], [3, 2, 1, 0])
    if FMT == 0:
        L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
        rows = gl.arange(0, 16, layout=gl.SliceLayout(1, L))
    else:
        rows = gl.arange(0, 16, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L4))))
    best = -9223372036854775807 - 1  # below every _argmax_key
    for r in range(lo, hi, 16):
        y, c = _subtile_any(w_smem, h_smem, x_smem, xq_smem, xd_smem, ready, empty, c, K, L4, STAGES, FMT, QSTEP,
                            QDOT, DIAG)
        if GLU:
            u, c = _subtile_any(w_smem, h_smem, x_smem, xq_smem, xd_smem, ready, empty, c, K, L4, STAGES, FMT, QSTEP,
                                QDOT, DIAG)
            y = y / (1.0 + gl.exp(-y)) * u
        if ACC:
            y += gl.load(OUT + r + rows)
        gl.store(OUT + r + rows, y)
        if ARGMAX:
            best = gl.maximum(best, gl.max(_argmax_key(y, r + rows), axis=0))
    return c, best


@gluon.jit
def _stage_b(x_smem, X, xs, NW, K, k0, eps, NORM: gl.constexpr, B: gl.constexpr, BP: gl.constexpr):
    """Columns [k0, k0 + 32768 / BP) of rows b < B of X (float32, row stride xs; with NORM each row's RMSNorm over
    its K columns times NW), rounded to bf16 (as the kernel-per-op step rounds activations) into the 64 KB staging
    buffer seen as [chunks of 256 columns, BP, 256]; rows B..BP are left as they are (their products are never
    stored)."""
    XP: gl.constexpr = 32768 // BP
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 1, 32], [gl.num_warps(), 1, 1], [2, 1, 0])
    LP: gl.constexpr = gl.SliceLayout(1, L3)  # [16 chunks, 256]
    X3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    xs4 = x_smem._reinterpret(gl.bfloat16, [XP // 4096, 16, BP, BK], X3)  # groups of 16 chunks
    r = gl.arange(0, 16, layout=gl.SliceLayout(1, LP))
    k = gl.arange(0, BK, layout=gl.SliceLayout(0, LP))
    nk = gl.minimum(K - k0, XP) // BK
    gl.thread_barrier()  # every warp is past its reads of the piece before
    for b in gl.static_range(B):
        inv = 1.0
        if NORM:
            inv = inv_rms(X + b * xs, K, eps)
        for g in range(0, nk, 16):
            offs = k0 + (g + r)[:, None] * BK + k[None, :]
            m = (g + r < nk)[:, None] & (k < BK)[None, :]
            x = gl.load(X + b * xs + offs, mask=m, other=0.0).to(gl.float32)
            if NORM:
                x = x * inv * gl.load(NW + offs, mask=m, other=0.0)
            xs4.index(g // 16).slice(b, 1, dim=1).store(x.to(gl.bfloat16)[:, None, :])
    gl.thread_barrier()


@gluon.jit
def _subtile_b(w_smem, x_smem, ready, empty, c, nk, L4: gl.constexpr, STAGES: gl.constexpr, BP: gl.constexpr):
    """One 16-row subtile's products over nk slots against the staged piece's BP rows -> ([BP, 16] float32, c +
    nk). L4 [BP, 16, 32, 8]: a slot's [16, 256] as _subtile reads it (warps by rows, 8 columns per lane), each
    input row's 8 columns of a lane against them, summed in the thread; the lanes' sums are added once, at the
    end."""
    XP: gl.constexpr = 32768 // BP
    S3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    xs = x_smem._reinterpret(gl.bfloat16, [XP // BK, BP, 32, 8], S3)
    acc = gl.zeros([BP, 16, 32], gl.float32, gl.SliceLayout(3, L4))
    for kc in range(nk):
        x = xs.index(kc).load(gl.SliceLayout(1, L4)).to(gl.float32)
        s = c % STAGES
        mbarrier.wait(ready.index(s), (c // STAGES) & 1)
        w = w_smem.index(s)._reinterpret(gl.bfloat16, [16, 32, 8], S3).load(gl.SliceLayout(0, L4)).to(gl.float32)
        gl.thread_barrier()  # every warp has its piece of the slot in registers
        mbarrier.arrive(empty.index(s), count=1)
        acc += gl.sum(w[None, :, :, :] * x[:, None, :, :], axis=3)
        c += 1
    return gl.sum(acc, axis=2), c


@gluon.jit
def _stage_m(x_smem, X, xs, NW, K, k0, eps, NORM: gl.constexpr, B: gl.constexpr):
    """_stage_b for the tensor cores: columns [k0, k0 + 4096) of rows b < B of X, rounded to bf16, into the staging
    buffer seen as [64 chunks of 64 columns, 8 rows, 64] with the 128-byte swizzle (the mma's B operand, n = 8
    sequences); rows B..7 and columns past K are zeros. NORM (K <= 4096, one piece): x * NW is staged and each
    row's 1 / RMS, summed in the same pass, is returned ([8]) for the caller to scale the products by, so the rows
    are read once; else the returned scales are ones."""
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 4, 8], [gl.num_warps(), 1, 1], [2, 1, 0])  # [16, 8, 64]
    SWB: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
    xs4 = x_smem._reinterpret(gl.bfloat16, [4, 16, 8, 64], SWB)  # groups of 16 chunks
    cc = gl.arange(0, 16, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))[:, None, None]
    bb = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))[None, :, None]
    ee = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))[None, None, :]
    ss = gl.zeros([8], gl.float32, gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    nk = gl.minimum(K - k0, 4096) // 64
    gl.thread_barrier()  # every warp is past its reads of the piece before
    for g in range(4):
        col = k0 + (g * 16 + cc) * 64 + ee
        cm = (g * 16 + cc < nk) & (ee < 64)
        x = gl.load(X + bb * xs + col, mask=cm & (bb < B), other=0.0).to(gl.float32)
        if NORM:
            ss += gl.sum(gl.sum(x * x, axis=2), axis=0)
            x = x * gl.load(NW + col, mask=cm, other=0.0)
        xs4.index(g).store(x.to(gl.bfloat16))
    gl.thread_barrier()
    if NORM:
        return 1.0 / gl.sqrt(ss / K + eps)
    return ss + 1.0


@gluon.jit
def _subtile_m(w_smem, x_smem, ready, empty, c, nk, STAGES: gl.constexpr):
    """One 16-row subtile over nk slots on the tensor cores (mma.sync m16n8k16, 4 compute warps): A the slot's
    four [16, 64] boxes, one per warp, B the staged input's matching [64, 8] -> ([16 rows, 8 sequences] float32,
    c + nk); the warps' sums are added once, at the end."""
    MMA: gl.constexpr = NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8])
    SWB: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
    NS: gl.constexpr = w_smem.shape[0] // 4
    wv = w_smem._reinterpret(gl.bfloat16, [NS, 4, 16, 64], SWB)
    xv = x_smem._reinterpret(gl.bfloat16, [16, 4, 8, 64], SWB)
    acc = gl.zeros([4, 16, 8], gl.float32, MMA)
    for kc in range(nk):
        xb = xv.index(kc).permute([0, 2, 1]).load(DotOperandLayout(operand_index=1, parent=MMA, k_width=2))
        s = c % STAGES
        mbarrier.wait(ready.index(s), (c // STAGES) & 1)
        wa = wv.index(s).load(DotOperandLayout(operand_index=0, parent=MMA, k_width=2))
        gl.thread_barrier()  # every warp has its box in registers
        mbarrier.arrive(empty.index(s), count=1)
        acc = mma_v2(wa, xb, acc)
        c += 1
    return gl.sum(acc, axis=0), c


@gluon.jit
def _gemv_b(w_smem, x_smem, ready, empty, c, lo, hi, K, X, xs, NW, OUT, os, eps, NORM: gl.constexpr,
            ACC: gl.constexpr, GLU: gl.constexpr, STAGES: gl.constexpr, B: gl.constexpr, BP: gl.constexpr,
            BMMA: gl.constexpr, OUT16=None, W16: gl.constexpr = False):
    """Batch > 1, bf16 weights: rows [lo, hi) of the instruction's matrix for rows b < B of X (row stride xs; float32,
    or bf16 where the producer rounded it as the staging would): OUT[b, rows] = y (ACC: += y; GLU: y = SiLU(gate)
    * up, stored in bf16, as _gemv_any) at OUT's row stride os -> c after its
    slots. The input is staged in pieces (_stage_b: 32768 / BP columns; BMMA, _stage_m: 4096) and each piece's
    partial products added into OUT, in the order the loader streams them (XPC); GLU's K fits one piece (FastStep
    checks). The products: _subtile_b on the CUDA cores, or with BMMA _subtile_m on the tensor cores. W16: the
    rows' final values (after the last piece) also go to OUT16 in bf16, at OUT's offsets."""
    if BMMA:
        MMA: gl.constexpr = NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8])
        LY: gl.constexpr = gl.SliceLayout(0, MMA)  # [16 rows, 8 sequences]
        ri = gl.arange(0, 16, layout=gl.SliceLayout(1, LY))[:, None]
        bi = gl.arange(0, 8, layout=gl.SliceLayout(0, LY))[None, :]
        XP: gl.constexpr = 4096
    else:
        L4: gl.constexpr = gl.BlockedLayout([1, 1, 1, 8], [1, 1, 32, 1], [1, gl.num_warps(), 1, 1], [3, 2, 1, 0])
        LY: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, L4))  # [BP sequences, 16 rows]
        bi = gl.arange(0, BP, layout=gl.SliceLayout(1, LY))[:, None]
        ri = gl.arange(0, 16, layout=gl.SliceLayout(0, LY))[None, :]
        XP: gl.constexpr = 32768 // BP
    m = (bi < B) & (ri < 16)
    for k0 in range(0, K, XP):
        if BMMA:
            inv = gl.convert_layout(_stage_m(x_smem, X, xs, NW, K, k0, eps, NORM, B), gl.SliceLayout(0, LY))[None, :]
        else:
            _stage_b(x_smem, X, xs, NW, K, k0, eps, NORM, B, BP)
        nk = gl.minimum(K - k0, XP) // BK
        for r in range(lo, hi, 16):
            if BMMA:  # the norm's 1 / RMS per sequence scales the products (_stage_m)
                y, c = _subtile_m(w_smem, x_smem, ready, empty, c, nk, STAGES)
                y = y * inv
                if GLU:
                    u, c = _subtile_m(w_smem, x_smem, ready, empty, c, nk, STAGES)
                    u = u * inv
                    y = y / (1.0 + gl.exp(-y)) * u
            else:
                y, c = _subtile_b(w_smem, x_smem, ready, empty, c, nk, L4, STAGES, BP)
                if GLU:
                    u, c = _subtile_b(w_smem, x_smem, ready, empty, c, nk, L4, STAGES, BP)
                    y = y / (1.0 + gl.exp(-y)) * u
            ptr = OUT + bi * os + r + ri
            if GLU:  # the activation in bf16, as DOWN stages it: the same rounding, half the bytes every SM reads
                gl.store(OUT.to(gl.pointer_type(gl.bfloat16)) + bi * os + r + ri, y.to(gl.bfloat16), mask=m)
            else:
                if ACC:
                    y += gl.load(ptr, mask=m, other=0.0)
                else:  # a later piece adds to the earlier ones
                    y += gl.load(ptr, mask=m & (k0 > 0), other=0.0)
                gl.store(ptr, y, mask=m)
                if W16:
                    gl.store(OUT16 + bi * os + r + ri, y.to(gl.bfloat16), mask=m & (k0 + XP >= K))
    return c


@gluon.jit
def _argmax_key(y, rows):
    """int64 keys ordered as torch.argmax ranks float32 values y at ``rows``: the larger value, at equal values
    the lower row; NaN above every number, -0.0 as 0.0."""
    b = y.to(gl.int32, bitcast=True)
    b = gl.where(y != y, 0x7FFFFFFF, gl.where(y == 0.0, 0, b))
    b = gl.where(b < 0, b ^ 0x7FFFFFFF, b)  # negative floats: larger magnitude, smaller key
    return (b.to(gl.int64) << 32) + (4294967295 - rows.to(gl.int64))


@gluon.jit
def _embed(EMB, IDS, AUX, RESID, H: gl.constexpr, B: gl.constexpr, R16: gl.constexpr = False):
    """The embedding rows of IDS; an id below 0 stands for the previous step's greedy token (AUX[3]), so a
    caller feeding it back needs no copy. R16: also their bf16 copy after RESID's B rows (_compute's R16)."""
    LE: gl.constexpr = gl.BlockedLayout([8], [32], [gl.num_warps()], [0])
    k = gl.arange(0, 1024, layout=LE)
    for b in gl.static_range(B):
        tok = gl.load(IDS + b).to(gl.int64)
        tok = gl.where(tok < 0, gl.load(AUX + 3), tok)
        row = EMB + tok * H
        for k0 in range(0, H, 1024):
            m = k0 + k < H
            x = gl.load(row + k0 + k, mask=m, other=0.0).to(gl.float32)
            gl.store(RESID + b * H + k0 + k, x, mask=m)
            if R16:
                gl.store(RESID.to(gl.pointer_type(gl.bfloat16)) + 2 * B * H + b * H + k0 + k, x.to(gl.bfloat16), mask=m)


@gluon.jit
def _rope(x, xp, d, ang):
    """Interleaved RoPE of x (pairs 2 i, 2 i + 1; xp the partner of each element) at angles ang [.., D]."""
    sign = gl.where(d % 2 == 0, -1.0, 1.0)
    return x * gl.cos(ang) + sign * xp * gl.sin(ang)


@gluon.jit
def _wait(COUNTERS, ERR, wait, target, ok, where, spin_limit):
    """Poll counter ``wait`` until it reaches ``target`` -> ok (0 once a wait ran past spin_limit: ERR then holds
    ``where``, and later waits are skipped: wrong results, no hang)."""
    if (ok == 1) & (wait >= 0):
        v = gl.atomic_add(COUNTERS + wait, 0, sem="acquire")
        spins = 0
        while (v < target) & (spins < spin_limit):
            v = gl.atomic_add(COUNTERS + wait, 0, sem="acquire")
            spins += 1
        if v < target:  # the schedule cannot finish: record where, stop waiting
            if gl.atomic_cas(ERR, 0, 1) == 0:
                gl.atomic_xchg(ERR + 1, where)
            ok = 0
    return ok


@gluon.jit
def _pages(PT, keys, hi, PAGE: gl.constexpr):
    """The page-table entries of ``keys`` (page 0 at keys >= hi)."""
    return gl.load(PT + keys // PAGE, mask=keys < hi, other=0)


@gluon.jit
def _cache_block(C, page, cache_off, keys, hi, PAGE: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr, d):
    """The cached K (or V) rows of ``keys``, in pages ``page``, at elements ``d`` (cache dtype; zeros at keys >=
    hi)."""
    row = cache_off + (page.to(gl.int64) * PAGE + keys % PAGE) * HKV * D
    return gl.load(C + row + d, mask=keys < hi, other=0.0)


@gluon.jit
def _ring_issue(k_ring, v_ring, slot, KC, VC, kpg, vpg, cache_off, k0, kidx5, kidxv, hi, PAGE: gl.constexpr,
                HKV: gl.constexpr, D: gl.constexpr, dk5, dv, NBUF: gl.constexpr):
    """cp.async of the K and V rows of keys k0 + [0, BLOCK_N) (pages kpg, vpg; zeros at keys >= hi) into ring slot
    ``slot``, one commit group (empty when k0 >= hi: no copy is issued). Each thread copies the elements it later
    reads (the blocks' register layouts), so the copy and the read need no barrier between them."""
    if k0 < hi:
        E: gl.constexpr = D // 32
        kk = k0 + kidx5
        kv = k0 + kidxv
        # the rows start 2 E-byte aligned (FastStep checks the caches); the hint goes on the pointers, as the
        # partition's arguments do not carry their alignment
        # _cache_block's addresses, written out here: the alignment hints below do not reach through a call
        kp = KC + cache_off + (kpg.to(gl.int64) * PAGE + kk % PAGE) * HKV * D + dk5
        vp = VC + cache_off + (vpg.to(gl.int64) * PAGE + kv % PAGE) * HKV * D + dv
        kp = gl.max_contiguous(gl.multiple_of(kp, [2 * E, 2 * E, 2 * E, 2 * E]), [1, 1, 1, E])
        vp = gl.max_contiguous(gl.multiple_of(vp, [2 * E, 2 * E, 2 * E]), [1, 1, E])
        async_copy.async_copy_global_to_shared(k_ring.index(slot), kp, mask=kk < hi)
        async_copy.async_copy_global_to_shared(v_ring.index(NBUF + slot), vp, mask=kv < hi)
    async_copy.commit_group()


@gluon.jit
def _attn(layer, h, split, QKV, KC, VC, PT, SEQ_LENS, INV_FREQ, PART_O, PART_L, layer_stride, qk_scale, COUNTERS,
          ERR, wait, target, ok, where, spin_limit, TRW, gate, kv_buf, HQ: gl.constexpr, HKV: gl.constexpr,
          D: gl.constexpr, S: gl.constexpr, PAGE: gl.constexpr, GP: gl.constexpr, BLOCK_N: gl.constexpr,
          TRACE: gl.constexpr, HOLD: gl.constexpr, DIAG: gl.constexpr = 0, NBUF: gl.constexpr = 0):
    """One KV head's key split of one sequence (the caller offsets QKV, PT, SEQ_LENS and the partials to it), as
    kernel._attn_split: q of the group rotated, the last split stores the new token's rotated K and its V, then the
    split's keys -> float32 partial and log-sum-exp.
    What does not depend on this step's QKV (the length, the page table, the first block of BLOCK_N cached keys,
    the rotation's angles) is loaded or computed before the wait on it, so only q's loads follow it -> ok
    (_wait). NBUF 0: later blocks are loaded one block ahead, in registers; NBUF > 0: blocks 1..NBUF are copied
    from before the wait into a ring of NBUF blocks in ``kv_buf`` (shared memory that is free during ATTN) by
    cp.async, and each block taken from it is replaced by the block NBUF further on."""
    # Each warp w runs its own online softmax over keys w * NW + [0, NW) of every block (the warps' partials are
    # merged once, at the end, so a block needs no exchange between warps). q.K: L5 [W, GP, NW, 32, D // 32],
    # D across the lanes, each lane's products summed in-thread, then the [.., 32] partials moved (LT) so that
    # each lane holds whole scores: one exchange per block instead of five shuffle rounds per score, and one
    # exp per lane. P.V: L4 [W, GP, NW, D], D across the lanes, the keys and the group's heads in each thread.
    W: gl.constexpr = gl.num_warps()
    NW: gl.constexpr = BLOCK_N // W
    E: gl.constexpr = D // 32
    LG: gl.constexpr = GP if GP < 32 // NW else 32 // NW  # LT's lanes over the heads, keys and partials
    LD: gl.constexpr = 32 // (NW * LG)
    L5: gl.constexpr = gl.BlockedLayout([1, GP, NW, 1, E], [1, 1, 1, 32, 1], [W, 1, 1, 1, 1], [4, 3, 2, 1, 0])
    LT: gl.constexpr = gl.BlockedLayout([1, GP // LG, 1, 32 // LD], [1, LG, NW, LD], [W, 1, 1, 1], [3, 2, 1, 0])
    L4: gl.constexpr = gl.BlockedLayout([1, GP, NW, E], [1, 1, 1, 32], [W, 1, 1, 1], [3, 2, 1, 0])
    K5: gl.constexpr = gl.SliceLayout(1, L5)  # a block's K rows [W, NW, 32, E]
    Q5: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, L5))  # [GP, 32, E]
    VL: gl.constexpr = gl.SliceLayout(1, L4)  # a block's V rows [W, NW, D]
    ST: gl.constexpr = gl.SliceLayout(3, LT)  # scores [W, GP, NW], one per lane
    P4: gl.constexpr = gl.SliceLayout(3, L4)  # the same in P.V's layout
    G: gl.constexpr = HQ // HKV
    # q's and the new key's elements: d = j * E + e
    g5 = gl.arange(0, GP, layout=gl.SliceLayout(1, gl.SliceLayout(2, Q5)))[:, None, None]
    dq = (gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, Q5)))[None, :, None] * E
          + gl.arange(0, E, layout=gl.SliceLayout(0, gl.SliceLayout(1, Q5)))[None, None, :])
    KW: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, K5)))
    KN: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, K5)))
    kidx5 = (gl.arange(0, W, layout=KW)[:, None, None, None] * NW
             + gl.arange(0, NW, layout=KN)[None, :, None, None])  # [W, NW, 1, 1]: key within a block
    dk5 = (gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, K5))))[None, None, :, None]
           * E + gl.arange(0, E, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, K5))))[None, None,
                                                                                                        None, :])
    wv = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, VL)))[:, None, None]
    nv = gl.arange(0, NW, layout=gl.SliceLayout(0, gl.SliceLayout(2, VL)))[None, :, None]
    dv1 = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, VL)))
    dv = dv1[None, None, :]
    kidxv = wv * NW + nv  # [W, NW, 1]
    kidxt = (gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, ST)))[:, None, None] * NW
             + gl.arange(0, NW, layout=gl.SliceLayout(0, gl.SliceLayout(1, ST)))[None, None, :])  # [W, 1, NW]
    gm = g5 < G
    cache_off = layer.to(gl.int64) * layer_stride + h * D
    n = gl.load(SEQ_LENS)
    pos = (n - 1).to(gl.float32)
    ang_q = pos * gl.load(INV_FREQ + dq // 2)
    cos_q = gl.cos(ang_q) * qk_scale
    sin_q = gl.where(dq % 2 == 0, -1.0, 1.0) * gl.sin(ang_q) * qk_scale
    lo = split * n // S
    hi = (split + 1) * n // S
    rd = hi if DIAG < 4 else lo  # DIAG 4, 5 (timing only): no cached key is read
    kt = _cache_block(KC, _pages(PT, lo + kidx5, rd, PAGE), cache_off, lo + kidx5, rd, PAGE, HKV, D, dk5)
    vt = _cache_block(VC, _pages(PT, lo + kidxv, rd, PAGE), cache_off, lo + kidxv, rd, PAGE, HKV, D, dv)
    # the page-table entries run one block ahead of the rows, so a block's loads wait on one memory trip, not two
    pgk = _pages(PT, lo + (1 + NBUF) * BLOCK_N + kidx5, rd, PAGE)
    pgv = _pages(PT, lo + (1 + NBUF) * BLOCK_N + kidxv, rd, PAGE)
    if NBUF > 0:
        KR: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0])
        VR: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
        k_ring = kv_buf._reinterpret(KC.dtype.element_ty, [NBUF, W, NW, 32, E], KR)
        v_ring = kv_buf._reinterpret(VC.dtype.element_ty, [2 * NBUF, W, NW, D], VR)  # V in slots NBUF..
        gl.thread_barrier()  # every warp is past its reads of the buffer in the instruction before
        for b in gl.static_range(NBUF):
            kb = lo + (1 + b) * BLOCK_N
            _ring_issue(k_ring, v_ring, b, KC, VC, _pages(PT, kb + kidx5, rd, PAGE), _pages(PT, kb + kidxv, rd, PAGE),
                        cache_off, kb, kidx5, kidxv, rd, PAGE, HKV, D, dk5, dv, NBUF)
    new_page = gl.load(PT + (n - 1) // PAGE)
    ok = _wait(COUNTERS, ERR, wait, target, ok, where, spin_limit)
    if TRACE:
        gl.store(TRW, _now())
    if (HOLD == 1) | (HOLD == 3):  # the loader may stream again (_loader)
        gl.thread_barrier()
        mbarrier.arrive(gate, count=1)
    qoff = (h * G + g5) * D
    qm = gm & (dq < D)
    q = (gl.load(QKV + qoff + dq, mask=qm, other=0.0) * cos_q
         + gl.load(QKV + qoff + (dq ^ 1), mask=qm, other=0.0) * sin_q)
    q = q[None, :, None, :, :]
    # the new token: K rotated, V as is, into its cache slot and into the first block (loaded before it was
    # written; with NBUF 0 the later blocks read the cache, else each block from the ring is patched too)
    kn = gl.zeros([1, 1, 32, E], KC.dtype.element_ty, K5)
    vn = gl.zeros([D], VC.dtype.element_ty, gl.SliceLayout(0, gl.SliceLayout(1, VL)))
    if split == S - 1:
        ko = HQ * D + h * D
        vo = (HQ + HKV) * D + h * D
        kn = _rope(gl.load(QKV + ko + dk5), gl.load(QKV + ko + (dk5 ^ 1)), dk5,
                   pos * gl.load(INV_FREQ + dk5 // 2)).to(KC.dtype.element_ty)  # [1, 1, 32, E]
        vn = gl.load(QKV + vo + dv1).to(VC.dtype.element_ty)
        slot = cache_off + (new_page.to(gl.int64) * PAGE + (n - 1) % PAGE) * HKV * D
        gl.store(KC + slot + dk5, kn)
        gl.store(VC + slot + dv1, vn)
        kt = gl.where(lo + kidx5 == n - 1, kn, kt)
        vt = gl.where(lo + kidxv == n - 1, vn[None, None, :], vt)
        gl.thread_barrier()  # the new key is in the cache before any warp reads a later block
    m_i = gl.full([W, GP, 1], float("-inf"), gl.float32, ST)
    l_i = gl.zeros([W, GP, NW], gl.float32, ST)  # each lane's own sum, added up at the end
    acc = gl.zeros([W, GP, 1, D], gl.float32, L4)
    i = 0
    for k0 in range(lo, hi if DIAG < 5 else lo, BLOCK_N):  # DIAG 5: no block is computed either
        if NBUF == 0:  # the next block's rows in flight while this one is computed
            kn2 = _cache_block(KC, pgk, cache_off, k0 + BLOCK_N + kidx5, rd, PAGE, HKV, D, dk5)
            vn2 = _cache_block(VC, pgv, cache_off, k0 + BLOCK_N + kidxv, rd, PAGE, HKV, D, dv)
            pgk = _pages(PT, k0 + 2 * BLOCK_N + kidx5, rd, PAGE)
            pgv = _pages(PT, k0 + 2 * BLOCK_N + kidxv, rd, PAGE)
        part = gl.sum(q * kt.to(gl.float32)[:, None, :, :, :], axis=4)  # [W, GP, NW, 32]
        s = gl.sum(gl.convert_layout(part, LT), axis=3)  # [W, GP, NW]
        s = gl.where(k0 + kidxt < hi, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=2, keep_dims=True))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        pr = gl.exp(s - m_safe)
        alpha = gl.exp(m_i - m_safe)
        l_i = l_i * alpha + pr
        pv = gl.convert_layout(pr, P4)[:, :, :, None] * vt.to(gl.float32)[:, None, :, :]
        acc = acc * gl.convert_layout(alpha, P4)[:, :, :, None] + gl.sum(pv, axis=2, keep_dims=True)
        m_i = m_new
        if NBUF == 0:
            kt, vt = kn2, vn2
        elif k0 + BLOCK_N < hi:  # block i + 1 from slot i % NBUF, block i + 1 + NBUF copied into it
            async_copy.wait_group(NBUF - 1)  # one group per block, in order
            kt = k_ring.index(i % NBUF).load(K5)
            vt = v_ring.index(NBUF + i % NBUF).load(VL)
            kt = gl.where(k0 + BLOCK_N + kidx5 == n - 1, kn, kt)
            vt = gl.where(k0 + BLOCK_N + kidxv == n - 1, vn[None, None, :], vt)
            kb = k0 + (1 + NBUF) * BLOCK_N
            _ring_issue(k_ring, v_ring, i % NBUF, KC, VC, pgk, pgv, cache_off, kb, kidx5, kidxv, rd, PAGE, HKV, D,
                        dk5, dv, NBUF)
            pgk = _pages(PT, kb + BLOCK_N + kidx5, rd, PAGE)
            pgv = _pages(PT, kb + BLOCK_N + kidxv, rd, PAGE)
        i += 1
    if NBUF > 0:
        if lo + BLOCK_N < rd:
            async_copy.wait_group(0)  # no copy into the buffer outlives the instruction
    # the warps' partials merged: weights exp(m_w - max over warps)
    top = gl.max(m_i, axis=0, keep_dims=True)  # [1, GP, 1]
    top_safe = gl.where(top == float("-inf"), 0.0, top)
    wt = gl.where(m_i == float("-inf"), 0.0, gl.exp(m_i - top_safe))
    lsum = gl.sum(gl.sum(l_i, axis=2, keep_dims=True) * wt, axis=0, keep_dims=True)  # [1, GP, 1]
    has = lsum > 0
    den = gl.where(has, lsum, 1.0)
    o = gl.sum(acc * gl.convert_layout(wt, P4)[:, :, :, None], axis=0, keep_dims=True)  # [1, GP, 1, D]
    o = o / gl.convert_layout(den, P4)[:, :, :, None]
    O3: gl.constexpr = gl.SliceLayout(2, L4)
    g4 = gl.arange(0, GP, layout=gl.SliceLayout(0, gl.SliceLayout(2, P4)))[None, :, None, None]
    d4 = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, O3)))[None, None, None, :]
    gl.store(PART_O + ((h * G + g4) * S + split) * D + d4, o, mask=(g4 < G) & (d4 < D))
    gt = gl.arange(0, GP, layout=gl.SliceLayout(0, gl.SliceLayout(2, ST)))[None, :, None]
    gl.store(PART_L + (h * G + gt) * S + split, gl.where(has, top_safe + gl.log(den), float("-inf")), mask=gt < G)
    return ok


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
            y = gl.sum(o * w[:, None], axis=0) / gl.sum(w, axis=0)
            if B > 1:  # bf16, as O stages it (_gemv_b): the same rounding, half the bytes every SM reads
                gl.store(ATTN.to(gl.pointer_type(gl.bfloat16)) + hq * D + di, y.to(gl.bfloat16))
            else:
                gl.store(ATTN + hq * D + di, y)


@gluon.jit
def _compute(w_smem, h_smem, x_smem, xq_smem, xd_smem, ready, empty, gate, PROG, n_instr, sm, COUNTERS, ERR, IDS,
             SEQ_LENS, PT, KC, VC, INV_FREQ, EMB, NORMS, ONORM, n_layers, RESID, QKV, PART_O, PART_L, ATTN, ACT,
             LOGITS, AUX, OUT, n_counters, n_logits, layer_stride, eps, qk_scale, spin_limit, TR, pt_stride, n_vocab,
             B: gl.constexpr, H: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr,
             F: gl.constexpr, S: gl.constexpr, SP: gl.constexpr, PAGE: gl.constexpr, GP: gl.constexpr,
             STAGES: gl.constexpr, FMT: gl.constexpr, TRACE: gl.constexpr, QSTEP: gl.constexpr, QDOT: gl.constexpr,
             DIAG: gl.constexpr, HOLD: gl.constexpr, KVRING: gl.constexpr, BP: gl.constexpr, BMMA: gl.constexpr,
             R16: gl.constexpr = False):
    """R16 (batch > 1): the residual rows also kept in bf16 after RESID's B float32 rows (EMBED, O and DOWN write
    them as each row is final), and the normed products (QKV, GATEUP, LOGITS) stage those: half the bytes every SM
    reads from L2 for them, the kernel-per-op step's rounding of the residual.
    AUX (int64): [0] the largest _argmax_key of the logits so far, [1] LOGITS instructions done, [2] programs
    done, [3] the step's greedy token (batch 1; B > 1 leaves the choice to the caller). The last LOGITS
    instruction to finish writes the token, the last program to finish zeroes the counters for the next step (each
    resets the words it used) and copies the token and ERR into OUT (int64 [3]; pinned host memory, so that a host
    reads them without a copy on the stream)."""
    ok = 1
    c = 0
    R16P = RESID.to(gl.pointer_type(gl.bfloat16)) + 2 * B * H  # R16's rows
    XR = RESID
    if R16:
        XR = R16P
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
        where = sm * n_instr + j
        if (op != 0) & (op != 3):  # ATTN waits inside _attn, after its loads that do not depend on the wait
            ok = _wait(COUNTERS, ERR, wait, target, ok, where, spin_limit)
            if TRACE:
                gl.store(TR + where * 3 + 1, _now())
            if HOLD == 3:
                if op == 4:
                    gl.thread_barrier()
                    mbarrier.arrive(gate, count=1)
        # the slots of every GEMV are consumed even after a failed wait, so the loader never blocks
        if op == 1:
            _embed(EMB, IDS, AUX, RESID, H, B, R16)
        elif op == 2:
            if B > 1:  # bf16 products of every sequence
                c = _gemv_b(w_smem, x_smem, ready, empty, c, lo, hi, H, XR, H, NORMS + layer * 2 * H, QKV,
                            (HQ + 2 * HKV) * D, eps, True, False, False, STAGES, B, BP, BMMA)
            else:
                _stage_any(x_smem, xq_smem, xd_smem, RESID, NORMS + layer * 2 * H, H, eps, True, FMT, H)
                c, _ = _gemv_any(w_smem, h_smem, x_smem, xq_smem, xd_smem, ready, empty, c, lo, hi, H, QKV, False,
                                 False, STAGES, FMT, QSTEP, QDOT, DIAG)
        elif op == 3:  # one sequence's key split (schedule: split = sequence * S + key split)
            b = 0
            if B > 1:
                b = split // S
            ok = _attn(layer, lo, split - b * S, QKV + b * ((HQ + 2 * HKV) * D), KC, VC, PT + b * pt_stride,
                       SEQ_LENS + b, INV_FREQ, PART_O + b * (HQ * S * D), PART_L + b * (HQ * S), layer_stride,
                       qk_scale, COUNTERS, ERR, wait, target, ok, where, spin_limit, TR + where * 3 + 1, gate, x_smem,
                       HQ, HKV, D, S, PAGE, GP, 32, TRACE, HOLD, DIAG, KVRING)
            if HOLD == 2:  # the loader may stream again (_loader)
                gl.thread_barrier()
                mbarrier.arrive(gate, count=1)
        elif op == 4:
            _merge(lo, hi, PART_O, PART_L, ATTN, B, HQ, D, S, SP)
        elif op == 5:
            if B > 1:  # bf16 products of every sequence
                a16 = ATTN.to(gl.pointer_type(gl.bfloat16))  # _merge's bf16 rows
                c = _gemv_b(w_smem, x_smem, ready, empty, c, lo, hi, HQ * D, a16, HQ * D, a16, RESID, H, eps,
                            False, True, False, STAGES, B, BP, BMMA, R16P, R16)
            else:
                _stage_any(x_smem, xq_smem, xd_smem, ATTN, ATTN, HQ * D, eps, False, FMT, H)
                c, _ = _gemv_any(w_smem, h_smem, x_smem, xq_smem, xd_smem, ready, empty, c, lo, hi, HQ * D, RESID,
                                 True, False, STAGES, FMT, QSTEP, QDOT, DIAG)
        elif op == 6:
            if B > 1:  # bf16 products of every sequence
                c = _gemv_b(w_smem, x_smem, ready, empty, c, lo, hi, H, XR, H, NORMS + layer * 2 * H + H, ACT,
                            F, eps, True, False, True, STAGES, B, BP, BMMA)
            else:
                _stage_any(x_smem, xq_smem, xd_smem, RESID, NORMS + layer * 2 * H + H, H, eps, True, FMT, H)
                c, _ = _gemv_any(w_smem, h_smem, x_smem, xq_smem, xd_smem, ready, empty, c, lo, hi, H, ACT, False,
                                 True, STAGES, FMT, QSTEP, QDOT, DIAG)
        elif op == 7:
            if B > 1:  # bf16 products of every sequence
                a16 = ACT.to(gl.pointer_type(gl.bfloat16))  # GATEUP's bf16 rows
                c = _gemv_b(w_smem, x_smem, ready, empty, c, lo, hi, F, a16, F, a16, RESID, H, eps, False, True,
                            False, STAGES, B, BP, BMMA, R16P, R16)
            else:
                _stage_any(x_smem, xq_smem, xd_smem, ACT, ACT, F, eps, False, FMT, H)
                c, _ = _gemv_any(w_smem, h_smem, x_smem, xq_smem, xd_smem, ready, empty, c, lo, hi, F, RESID, True,
                                 False, STAGES, FMT, QSTEP, QDOT, DIAG)
        elif op == 8:
            if B > 1:  # bf16 products of every sequence
                c = _gemv_b(w_smem, x_smem, ready, empty, c, lo, hi, H, XR, H, ONORM, LOGITS, n_vocab, eps, True,
                            False, False, STAGES, B, BP, BMMA)
            else:
                _stage_any(x_smem, xq_smem, xd_smem, RESID, ONORM, H, eps, True, FMT, H)
                c, best = _gemv_any(w_smem, h_smem, x_smem, xq_smem, xd_smem, ready, empty, c, lo, hi, H, LOGITS,
                                    False, False, STAGES, FMT, QSTEP, QDOT, DIAG, True)
                gl.atomic_max(AUX, best)
                if gl.atomic_add(AUX + 1, 1, sem="acq_rel") == n_logits - 1:  # the last LOGITS tile: every max is in
                    key = gl.atomic_xchg(AUX, -9223372036854775807 - 1)
                    gl.atomic_xchg(AUX + 3, 4294967295 - (key & 4294967295))
                    gl.atomic_xchg(AUX + 1, 0)
        if op != 0:
            gl.thread_barrier()  # every warp's stores come before the one-thread releases
            if TRACE:
                gl.store(TR + (sm * n_instr + j) * 3 + 2, _now())
            for cn in range(gl.load(p + 7), gl.load(p + 8)):
                gl.atomic_add(COUNTERS + cn, 1, sem="release")
    gl.thread_barrier()
    if gl.atomic_add(AUX + 2, 1, sem="acq_rel") == gl.num_programs(0) - 1:  # every program is past its waits
        LZ: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        z = gl.arange(0, 1024, layout=LZ)
        for k0 in range(0, n_counters, 1024):
            gl.store(COUNTERS + k0 + z, gl.zeros_like(z), mask=k0 + z < n_counters)
        gl.atomic_xchg(AUX + 2, 0)
        gl.store(OUT, gl.atomic_add(AUX + 3, 0))
        gl.store(OUT + 1, gl.atomic_add(ERR, 0).to(gl.int64))
        gl.store(OUT + 2, gl.atomic_add(ERR + 1, 0).to(gl.int64))


@gluon.jit
def ring_barriers(STAGES: gl.constexpr):
    """(ready, empty): one mbarrier per ring slot each, for a loader filling the slots and consumers freeing them."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(ready.index(j), count=1)
        mbarrier.init(empty.index(j), count=1)
    return ready, empty


@gluon.jit
def fast_step_kernel(desc_a, desc_o, desc_d, hdesc_a, hdesc_o, hdesc_d, PROG, n_instr, COUNTERS, ERR, IDS, SEQ_LENS,
                     PT, KC, VC, INV_FREQ, EMB, MT, NORMS, ONORM, n_layers, RESID, QKV, PART_O, PART_L, ATTN, ACT,
                     LOGITS, AUX, OUT, n_counters, n_logits, layer_stride, eps, qk_scale, spin_limit, TR, pt_stride,
                     n_vocab, B: gl.constexpr, H: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr,
                     F: gl.constexpr, S: gl.constexpr, SP: gl.constexpr, PAGE: gl.constexpr, GP: gl.constexpr,
                     STAGES: gl.constexpr, FMT: gl.constexpr, CW: gl.constexpr = 4, TRACE: gl.constexpr = False,
                     QSTEP: gl.constexpr = 2, QDOT: gl.constexpr = 1, DIAG: gl.constexpr = 0, HOLD: gl.constexpr = 0,
                     KVRING: gl.constexpr = 0, BP: gl.constexpr = 1, XPC: gl.constexpr = 65536,
                     BMMA: gl.constexpr = False, R16: gl.constexpr = False):
    """FMT 0: bf16 weights (desc_*: [16, 256] boxes; hdesc_* unused); 1: q4_k blocks as stored (desc_*: code
    bytes, hdesc_*: headers, q4k.q4k_descriptors) with int8 activations. CW: the compute partition's warps.
    DIAG (timing only, wrong results): 1 the loader fills no slot (the step without weight reads), 2 the bf16
    products are skipped (the step without them), 3 both; 4 ATTN reads no cached key, 5 nor computes a block of
    them. HOLD: _loader's. KVRING: _attn's NBUF (bf16: its ring lives in the staging buffer). B > 1 (bf16): B
    sequences (page table rows pt_stride apart, logits rows n_vocab apart), the products by _gemv_b with BP the
    power of two from B, XPC = 128 / BP slots per staged piece; BMMA (4 compute warps): on the tensor cores, desc_*
    with [16, 64] boxes, XPC = 16; R16: _compute's (RESID then holds B float32 rows and B bf16 ones). The counters
    must be zero at the first launch; each step leaves them so (_compute)."""
    sm = gl.program_id(0)
    PROG_SM = PROG + sm * n_instr * NF
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    if FMT == 0:
        if BMMA:  # four [16, 64] boxes a slot (desc_*: 128-byte swizzle)
            w_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES * 4, 16, 64], desc_a.layout)
        else:
            w_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 16, BK], desc_a.layout)
        x_smem = gl.allocate_shared_memory(gl.float32, [64, BK], flat)
        h_smem = w_smem
        xq_smem = x_smem
        xd_smem = x_smem
    else:
        w_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, 16, 2, 128], desc_a.layout)
        h_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, 16, 2, 16], hdesc_a.layout)
        xq_smem, xd_smem = int8_input_smem()
        x_smem = xd_smem
    ready, empty = ring_barriers(STAGES)
    gate = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(gate, count=1)
    if CW == 16:  # the compute warps as the default partition (launched with num_warps=16), the loader a worker
        gl.warp_specialize([
            (_compute, (w_smem, h_smem, x_smem, xq_smem, xd_smem, ready, empty, gate, PROG_SM, n_instr, sm, COUNTERS,
                        ERR, IDS, SEQ_LENS, PT, KC, VC, INV_FREQ, EMB, NORMS, ONORM, n_layers, RESID, QKV, PART_O,
                        PART_L, ATTN, ACT, LOGITS, AUX, OUT, n_counters, n_logits, layer_stride, eps, qk_scale,
                        spin_limit, TR, pt_stride, n_vocab, B, H, HQ, HKV, D, F, S, SP, PAGE, GP, STAGES, FMT, TRACE,
                        QSTEP, QDOT, DIAG, HOLD, KVRING, BP, BMMA, R16)),
            (_loader, (desc_a, desc_o, desc_d, hdesc_a, hdesc_o, hdesc_d, w_smem, h_smem, ready, empty, gate,
                       PROG_SM, n_instr, MT, n_layers, H, HQ * D, F, STAGES, FMT, DIAG, HOLD, FMT, XPC, BMMA)),
        ], [1], [40])
    else:
        gl.warp_specialize([
            (_loader, (desc_a, desc_o, desc_d, hdesc_a, hdesc_o, hdesc_d, w_smem, h_smem, ready, empty, gate,
                       PROG_SM, n_instr, MT, n_layers, H, HQ * D, F, STAGES, FMT, DIAG, HOLD, 0, XPC, BMMA)),
            (_compute, (w_smem, h_smem, x_smem, xq_smem, xd_smem, ready, empty, gate, PROG_SM, n_instr, sm, COUNTERS,
                        ERR, IDS, SEQ_LENS, PT, KC, VC, INV_FREQ, EMB, NORMS, ONORM, n_layers, RESID, QKV, PART_O,
                        PART_L, ATTN, ACT, LOGITS, AUX, OUT, n_counters, n_logits, layer_stride, eps, qk_scale,
                        spin_limit, TR, pt_stride, n_vocab, B, H, HQ, HKV, D, F, S, SP, PAGE, GP, STAGES, FMT, TRACE,
                        QSTEP, QDOT, DIAG, HOLD, KVRING, BP, BMMA, R16)),
        ], [CW], [232 if CW == 4 else 192])


def _layout(swizzle: int = 0):
    return gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=16, rank=2)


def unsupported(cfg) -> list:
    """What the fast step does not run of ``cfg`` (empty: it runs the model), each a short phrase: the reference
    executor's limits (kernel.unsupported) and its own (interleaved RoPE, dense FFNs, no QK-norm, shapes its tiles
    divide)."""
    from .kernel import unsupported as reference_limits

    out = reference_limits(cfg)
    D, KO = cfg.head_dim, cfg.n_heads * cfg.head_dim
    checks = ((cfg.rope_style == "neox", "neox RoPE"), (bool(cfg.n_experts), "experts"), (cfg.qk_norm, "QK-norm"),
              (D not in (32, 64, 128), f"head_dim {D} (32, 64 or 128)"),
              ((cfg.n_heads + 2 * cfg.n_kv_heads) * D % 16 or cfg.vocab_size % 16,
               "QKV rows or a vocabulary not a multiple of 16"))
    out += [what for bad, what in checks if bad]
    for name, k in (("hidden", cfg.hidden), ("heads * head_dim", KO), ("ffn", cfg.ffn)):
        if k % 512 or k > 16384:
            out.append(f"{name} {k} (a multiple of 512 up to 16384)")
    return out


def _describe(t) -> str:
    return f"{t.dtype} {list(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__


def _takes_mma(batch: int, batch_mma: bool | None) -> bool:
    return batch > 1 and (batch > 2 if batch_mma is None else batch_mma)


def batch_reason(cfg, fmt: str, batch: int, batch_mma: bool | None = None) -> str | None:
    """Why the fast step cannot run ``batch`` sequences of ``cfg`` in weight format ``fmt`` (None: it can)."""
    if batch > 1 and fmt != "bf16":
        return f"batch {batch} takes bf16 weights (q4_k runs batch 1), got {fmt}"
    piece = 4096 if _takes_mma(batch, batch_mma) else 32768 // (1 << (batch - 1).bit_length())
    if batch > 1 and cfg.hidden > piece:  # GATEUP's SiLU(gate) * up and the norm's scale need the whole input staged
        return f"batch {batch} stages {piece} columns of a bf16 input, hidden is {cfg.hidden}"
    return None


class FastStep:
    """Runs a Program (schedule.build_decode_program) over bf16 weight stacks at batch 1-8, or q4_k ones at batch 1.

    ``stacks``: weights.WeightStacks; ``embed``: the token embedding, bf16 [vocab, hidden] on the device;
    ``norms``: float32 [layers, 2, hidden] (attention and FFN RMSNorm weights); ``output_norm``: float32
    [hidden]; ``inv_freq``: RoPE inverse frequencies [head_dim / 2]; ``k_cache``, ``v_cache``: 16-bit [layers,
    pages, page, kv heads, head_dim] views, each layer's pages contiguous (any layer stride, the same for both).
    ``from_tensors`` builds one from a GGUF's tensors, ``from_model`` from an engine Model.

    Call it (or ``launch`` it, inside a CUDA graph) with int32 device tensors ``ids`` [B], ``seq_lens`` [B] (the
    new token of sequence b is at position seq_lens[b] - 1 and its K and V are written there) and ``page_table``
    [B, pages], B the program's batch; it returns float32 logits [B, vocab] (a buffer it reuses). At batch 1
    ``token`` (int64 [1], also reused) holds their argmax (torch.argmax's, ties and NaN included), the greedy
    choice made inside the step. q4_k: the products take the activations rounded to int8 per block of 32 (the
    engine's act_int8 arithmetic); bf16 at batch > 1: rounded to bf16, as the kernel-per-op step rounds them.

    ``stages``: ring slots (bf16: 8 KB each, 18 by default, 16 with 16 warps; q4_k: 4.5 KB, 16); ``warps``: the
    compute warps (4 or 8 in a worker partition beside the loader's 4; 16: the default partition, the loader a
    one-warp worker); ``qstep``, ``qdot``: q4_k slots per barrier and dot variant (q4k._slot_dot);
    ``hold``: 0, or the loader holds its weight stream at each ATTN instruction until the split is past its wait
    (1, the default: the faster, bench/NOTES.md) or done (2), and (3) as 1 and at each MERGE until it is past its
    wait; ``kv_ring``: blocks of 32 cached keys an ATTN split copies by cp.async from before its wait into the
    staging buffer (bf16 at head dim 64 or more: 2 by default; 0, and always for q4_k: one block ahead in
    registers); ``diag``: timing-only builds that give wrong results (fast_step_kernel's DIAG); ``spin_limit``:
    polls of a counter before the step gives up (``error`` then names the instruction); ``trace``: record each
    instruction's start, end of wait and end (global ns) in ``self.trace`` [SMs, instructions, 3];
    ``batch_mma``: at batch > 1 the products run on the tensor cores (True: mma.sync, 4 compute warps; hidden up
    to 4096) or on the CUDA cores (False: hidden up to 32768 / B rounded up to a power of two); None (the default)
    takes the CUDA cores at batch 2 and the tensor cores above it, the faster of the two at each size on the
    Llama-3-8B shape (bench/NOTES.md). ``resid16`` (batch > 1): keep a bf16 copy of the residual rows and stage
    the normed products' inputs from it (half the bytes each SM reads per QKV, GATEUP and LOGITS instruction; the
    residual is then rounded to bf16 before each norm, as the kernel-per-op step rounds it).
    """

    def __init__(self, prog, cfg, stacks: WeightStacks, embed, norms, output_norm, inv_freq, k_cache, v_cache, *,
                 stages: int | None = None, warps: int = 4, qstep: int = 2, qdot: int = 1, hold: int = 1,
                 kv_ring: int | None = None, diag: int = 0, spin_limit: int = 1 << 22, trace: bool = False,
                 batch_mma: bool | None = None, resid16: bool = False):
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        B = prog.geometry["batch"]
        if not 1 <= B <= MAX_BATCH:
            raise ValueError(f"prog: the fast step runs batch 1-{MAX_BATCH}, the program has batch {B}")
        bad = unsupported(cfg)
        if bad:
            raise ValueError(f"cfg: the fast step does not run {', '.join(bad)}")
        if not isinstance(stacks, WeightStacks) or stacks.format not in ("bf16", "q4_k"):
            raise ValueError(f"stacks: bf16 or q4_k WeightStacks expected, got "
                             f"{getattr(stacks, 'format', type(stacks).__name__)}")
        self.batch, self.bp = B, 1 << (B - 1).bit_length()
        if batch_mma is not None and not isinstance(batch_mma, bool):
            raise TypeError(f"batch_mma must be None, True or False, got {type(batch_mma).__name__}")
        self.bmma = _takes_mma(B, batch_mma)
        if not isinstance(resid16, bool) or (resid16 and B == 1):
            raise ValueError(f"resid16 (batch > 1) must be True or False, got {resid16!r} at batch {B}")
        self.r16 = resid16
        bad = batch_reason(cfg, stacks.format, B, batch_mma)
        if bad:
            raise ValueError(f"prog: {bad}")
        if self.bmma and warps != 4:
            raise ValueError(f"batch_mma: the tensor-core products at batch {B} take 4 compute warps, got {warps}")
        if warps not in (4, 8, 16):
            raise ValueError(f"warps (the compute partition's) must be 4, 8 or 16, got {warps!r}")
        # bf16: 18 slots, the staged input and ATTN's scratch: 227 KB (16 slots with 16 compute warps, whose
        # layout conversions take more scratch)
        most = (16 if warps == 16 else 18) if stacks.format == "bf16" else 24
        if stages is None:  # the deepest prefetch that fits bf16 (NOTES: more slots, faster steps)
            stages = most if stacks.format == "bf16" else 16
        if not isinstance(stages, int) or not 2 <= stages <= most or (warps == 16 and stages % 2):
            raise ValueError(f"stages must be {'an even number in ' if warps == 16 else ''}2..{most}, got {stages!r}")
        L, H, D, Hkv = cfg.n_layers, cfg.hidden, cfg.head_dim, cfg.n_kv_heads
        shape = (L, k_cache.shape[1], k_cache.shape[2], Hkv, D) if k_cache.dim() == 5 else None
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if c.dim() != 5 or tuple(c.shape) != shape or c.element_size() != 2 or c.stride() != k_cache.stride():
                raise ValueError(f"{name}: a 16-bit [{L}, pages, page, {Hkv}, {D}] view with k_cache's strides "
                                 f"expected, got {c.dtype} {list(c.shape)}")
            if c[0].stride() != c[0].contiguous().stride():
                raise ValueError(f"{name}: each layer's pages must be contiguous, got strides {c.stride()}")
        dev = k_cache.device
        self.fmt = stacks.format
        self.stacks = stacks
        self.bytes = {k: getattr(stacks, k) for k in "aod"}
        if self.fmt == "bf16":
            mats = [self.bytes[k].view(torch.bfloat16) for k in "aod"]
            box, lay = ([16, 64], _layout(128)) if self.bmma else ([16, 256], _layout())
            self.descs = tuple(TensorDescriptor(t, list(t.shape), [t.shape[1], 1], box, lay) for t in mats) * 2
        else:
            d = [q4k_descriptors(self.bytes[k], 16, True) for k in "aod"]
            self.descs = tuple(x[0] for x in d) + tuple(x[1] for x in d)
        self.emb = embed
        self.norms = norms.float().contiguous()
        self.onorm = output_norm.float().contiguous()
        self.prog, self.cfg, self.kc, self.vc = prog, cfg, k_cache, v_cache
        self.inv_freq = inv_freq.float().contiguous().to(dev)
        self.table = torch.from_numpy(prog.encode()).to(dev)
        self.mt = stacks.table.to(dev)
        self.counters = torch.zeros(prog.num_counters, dtype=torch.int32, device=dev)  # each step leaves them zero
        self.n_logits = sum(i.op == "LOGITS" for lst in prog.lists for i in lst)
        self.aux = torch.tensor([-(1 << 63), 0, 0, 0], dtype=torch.int64, device=dev)  # _compute's AUX
        self.token = self.aux[3:]
        self.err = torch.zeros(2, dtype=torch.int32, device=dev)
        self.out = torch.zeros(3, dtype=torch.int64, device=dev)  # launch's out
        S = prog.geometry["splits"]
        f32 = dict(dtype=torch.float32, device=dev)
        # with resid16 the residual's bf16 copy follows its float32 rows in the same buffer (_compute's R16)
        self.resid = torch.empty(B * H * 3 // 2 if resid16 else B * H, **f32)[:B * H].view(B, H)
        self.qkv = torch.empty(B, (cfg.n_heads + 2 * Hkv) * D, **f32)
        self.part_o = torch.empty(B, cfg.n_heads, S, D, **f32)
        self.part_l = torch.empty(B, cfg.n_heads, S, **f32)
        self.attn = torch.empty(B, cfg.n_heads * D, **f32)
        self.act = torch.empty(B, cfg.ffn, **f32)
        self.logits = torch.empty(B, cfg.vocab_size, **f32)
        self.stages, self.warps, self.qstep, self.qdot = stages, warps, qstep, qdot
        if hold not in (0, 1, 2, 3):
            raise ValueError(f"hold must be 0, 1, 2 or 3, got {hold!r}")
        self.hold = hold
        # K and V blocks of 32 keys in the 64 KB staging buffer; cp.async copies 4 bytes or more per row
        most = (64 << 10) // (4 * 32 * D) if self.fmt == "bf16" and D >= 64 else 0
        if kv_ring is None:
            kv_ring = min(2, most)
        if not isinstance(kv_ring, int) or not 0 <= kv_ring <= most:
            raise ValueError(f"kv_ring must be 0..{most} for {self.fmt} weights at head_dim {D}, got {kv_ring!r}")
        vec = 2 * (D // 32)  # bytes per thread and row of a block
        if kv_ring and (k_cache.stride(0) * 2 % vec or k_cache.data_ptr() % vec or v_cache.data_ptr() % vec):
            raise ValueError(f"kv_ring={kv_ring}: the caches' rows must start {vec}-byte aligned, got layer stride "
                             f"{k_cache.stride(0)} and data pointers {k_cache.data_ptr():#x}, {v_cache.data_ptr():#x}; "
                             f"kv_ring=0 takes any")
        self.kv_ring = kv_ring
        if diag not in range(6):
            raise ValueError(f"diag must be 0..5, got {diag!r}")
        self.diag = diag
        self.spin_limit = spin_limit
        self.trace = torch.zeros(prog.num_sms, self.table.shape[1], 3, dtype=torch.int64, device=dev) if trace else None

    @classmethod
    def from_tensors(cls, prog, cfg, tensors, k_cache, v_cache, inv_freq, **kw) -> "FastStep":
        """Over a GGUF's tensors (``name -> QuantizedTensor``, every matrix bf16 or every one q4_k), copied into
        stacks on the caches' device."""
        from ..quant import dequantize

        dev = k_cache.device

        def vec(name):
            t = tensors[name]
            return (t.float() if isinstance(t, torch.Tensor) else dequantize(t, torch.float32)).to(dev)

        norms = torch.stack([torch.stack([vec(f"blk.{i}.attn_norm.weight"), vec(f"blk.{i}.ffn_norm.weight")])
                             for i in range(cfg.n_layers)])
        emb = dequantize(tensors["token_embd.weight"], torch.bfloat16).to(dev)
        return cls(prog, cfg, stack_tensors(cfg, tensors, dev), emb, norms, vec("output_norm.weight"), inv_freq,
                   k_cache, v_cache, **kw)

    @classmethod
    def from_model(cls, model, prog, stacks: WeightStacks, k_cache, v_cache, **kw) -> "FastStep":
        """Over an engine Model whose matrices ``stacks`` holds (weights.share_stacks): its norms, embedding
        (bf16) and RoPE frequencies, no second copy of the matrices."""
        from ..quant import dequantize

        emb = model.tok_embd
        emb = (emb.data.reshape(emb.shape[0], -1).view(torch.bfloat16) if emb.format == "bf16"
               else dequantize(emb, torch.bfloat16).to(model.device))
        norms = torch.stack([torch.stack([L.attn_norm, L.ffn_norm]) for L in model.layers])
        return cls(prog, model.cfg, stacks, emb, norms, model.output_norm, model.inv_freq, k_cache, v_cache, **kw)

    def launch(self, ids, seq_lens, page_table, out=None) -> None:
        """The step's one kernel (it resets its own counters), nothing read back: CUDA-graph safe. ``out``: int64
        [3] (pinned host memory or on the device; default ``self.out``) that the step's end fills with its greedy
        token and its error flag (``error``'s flag: set and where)."""
        import triton

        # attributes only (no CUDA call: a launch may be captured); Triton itself refuses unpinned host memory
        if out is not None and not (isinstance(out, torch.Tensor) and out.dtype == torch.int64 and out.numel() == 3
                                    and out.is_contiguous() and out.device in (self.out.device, torch.device("cpu"))):
            raise ValueError(f"out must be a contiguous int64 tensor of 3 elements on {self.out.device} or in pinned "
                             f"host memory, got {_describe(out)}")
        B = self.batch
        for name, t, want in (("ids", ids, (B,)), ("seq_lens", seq_lens, (B,))):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want or t.dtype != torch.int32:
                raise ValueError(f"{name} must be an int32 tensor of shape [{B}], got {_describe(t)}")
        if (not isinstance(page_table, torch.Tensor) or page_table.dim() != 2 or page_table.shape[0] != B
                or page_table.dtype != torch.int32 or page_table.stride(1) != 1):
            raise ValueError(f"page_table must be an int32 [{B}, pages] tensor with contiguous rows, got "
                             f"{_describe(page_table)}")
        cfg, S = self.cfg, self.prog.geometry["splits"]
        fast_step_kernel[(self.prog.num_sms,)](
            *self.descs, self.table, self.table.shape[1], self.counters, self.err, ids, seq_lens, page_table,
            self.kc, self.vc, self.inv_freq, self.emb, self.mt, self.norms, self.onorm, cfg.n_layers, self.resid,
            self.qkv, self.part_o, self.part_l, self.attn, self.act, self.logits, self.aux,
            self.out if out is None else out, self.counters.numel(),
            self.n_logits, self.kc.stride(0), cfg.rms_eps, cfg.attn_scale or cfg.head_dim ** -0.5,
            self.spin_limit, self.err if self.trace is None else self.trace, page_table.stride(0), cfg.vocab_size,
            B=self.batch, H=cfg.hidden, HQ=cfg.n_heads,
            HKV=cfg.n_kv_heads, D=cfg.head_dim, F=cfg.ffn, S=S, SP=triton.next_power_of_2(S),
            PAGE=self.kc.shape[2], GP=triton.next_power_of_2(cfg.n_heads // cfg.n_kv_heads), STAGES=self.stages,
            FMT=int(self.fmt == "q4_k"), CW=self.warps, TRACE=self.trace is not None, QSTEP=self.qstep,
            QDOT=self.qdot, DIAG=self.diag, HOLD=self.hold, KVRING=self.kv_ring, BP=self.bp,
            XPC=16 if self.bmma else 128 // self.bp if self.batch > 1 else 65536, BMMA=self.bmma, R16=self.r16,
            num_warps=16 if self.warps == 16 else 4)

    def error(self, flag=None) -> str | None:
        """What stopped a step (``flag``: ``self.err`` or a host copy of it), or None: the instruction whose wait
        ran past the spin limit. The flag stays set until ``clear_error``."""
        f = (self.err if flag is None else flag).tolist()
        if not f[0]:
            return None
        sm, j = divmod(int(f[1]), self.table.shape[1])
        i = self.prog.lists[sm][j]
        return (f"one-kernel decode step: SM {sm} gave up at {i.op} layer {i.layer} [{i.lo}, {i.hi}) waiting for "
                f"counter {i.wait} ({self.prog.counter_names[i.wait]}) to reach {i.target}")

    def clear_error(self) -> None:
        self.err.zero_()

    def __call__(self, ids, seq_lens, page_table) -> torch.Tensor:
        self.launch(ids, seq_lens, page_table)
        msg = self.error()
        if msg:
            raise RuntimeError(msg)
        return self.logits


def compile_sm90(fmt: str = "bf16", warps: int = 4, stages: int = 16, hold: int = 1, diag: int = 0, hidden: int = 4096,
                 heads: int = 32, kv_heads: int = 8, head_dim: int = 128, ffn: int = 14336, splits: int = 16,
                 page: int = 16, trace: bool = False, kv_ring: int | None = None, batch: int = 1,
                 batch_mma: bool = True, resid16: bool = False):
    """fast_step_kernel compiled for sm_90 without a GPU (TRITON_INTERPRET=0 set before importing llmkernels), for
    the Llama-3-8B shape by default: for the tests and for reading the code the compiler makes."""
    import triton

    from ..attention._gluon import compile_sm90 as compile_gluon
    from .q4k import layout8

    bmma = batch > 1 and batch_mma
    if bmma and warps != 4:
        raise ValueError(f"batch_mma takes 4 compute warps, got {warps}")
    if fmt == "bf16":
        descs = [f"tensordesc<bf16[16,64],{_layout(128)!r}>" if bmma else f"tensordesc<bf16[16,256],{_layout()!r}>"] * 6
    else:
        descs = [f"tensordesc<u8[16,2,{n}],{layout8(3)!r}>" for n in (128, 128, 128, 16, 16, 16)]
    names = fast_step_kernel.arg_names
    ptrs = dict(PROG="*i32", COUNTERS="*i32", ERR="*i32", IDS="*i32",
                SEQ_LENS="*i32", PT="*i32", KC="*bf16", VC="*bf16", INV_FREQ="*fp32", EMB="*bf16", MT="*i32",
                NORMS="*fp32", ONORM="*fp32", RESID="*fp32", QKV="*fp32", PART_O="*fp32", PART_L="*fp32",
                ATTN="*fp32", ACT="*fp32", LOGITS="*fp32", AUX="*i64", OUT="*i64", TR="*i64" if trace else "*i32")
    bp = 1 << (batch - 1).bit_length()
    consts = dict(B=batch, BP=bp, XPC=16 if bmma else 128 // bp if batch > 1 else 65536, BMMA=bmma, H=hidden,
                  HQ=heads, HKV=kv_heads,
                  D=head_dim, F=ffn, S=splits, SP=triton.next_power_of_2(splits), PAGE=page,
                  GP=triton.next_power_of_2(heads // kv_heads),
                  STAGES=stages, FMT=int(fmt == "q4_k"), CW=warps, TRACE=trace, QSTEP=2, QDOT=1, DIAG=diag,
                  HOLD=hold, R16=resid16,
                  KVRING=(min(2, 512 // head_dim) if fmt == "bf16" and head_dim >= 64 else 0) if kv_ring is None
                  else kv_ring)
    sig = dict(zip(names[:6], descs))
    sig.update({n: ptrs.get(n, "fp32" if n in ("eps", "qk_scale") else "i32") for n in names[6:] if n not in consts})
    return compile_gluon(fast_step_kernel, sig, consts, num_warps=16 if warps == 16 else 4, aligned=tuple(ptrs))
