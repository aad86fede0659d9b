"""megakernel_stream.py's chain (32 llama-8B-shaped layers of batch-1 GEMVs, a counter per op, a TMA loader running
across op boundaries) on q4_k weights with int8 activations, the arithmetic of the engine's act_int8 path: what the
one-kernel step's weight streaming reaches on the format its batch-1 target is set on.

Weights: the GGUF q4_k blocks as stored (``--layouts gguf``: each matrix seen by TMA as [N, blocks, 144] bytes, a
ring slot one [16, 2, 128] box of two super-blocks' code bytes of 16 rows and the [16, 2, 16] box of their headers:
d, dmin, the 12 bytes of 6-bit scales and mins), or split into two planes (``planes``: codes [N, K / 2], headers [N,
K / 16], slots of [16, 256] and [16, 32] boxes), the same bytes in all. Activations:
every program rounds the op's whole input to int8 per block of 32 (d = absmax / 127, s = d * sum q, as
qgemv.int8.quantize_act) into shared memory once per op, GLU applied first for the down products. Products: a
thread takes one 64-weight chunk (sub-blocks 2c and 2c + 1) of one row and super-block: its 8 code words masked to
low and high nibbles, 16 dp4a against the chunk's int8 words, then d * sc * dx * dot - dmin * mn * s per sub-block.

Every op's output is checked against dequantize(W) @ x' in float64, x' the int8 rounding of the kernel's own
input, and the same arithmetic is checked on the CPU (``--emulate``: the planes, the scale decoding and the
integer dots in torch, against gguf_codec's dequantization).

    PYTHONPATH=. python bench/lab/megakernel_stream_q4k.py [--layers 32] [--stages 16,24] [--warps 4,8] [--modes 0,1,2]
                                                           [--layouts gguf,planes]
    PYTHONPATH=. python bench/lab/megakernel_stream_q4k.py --emulate       # CPU
"""
import argparse
import itertools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from megakernel_stream import FFN, HIDDEN, QKV, UP, _entry, _release, _wait_op, llama_ops, measure, tile_lists

ROWS_PER_WARP = 4  # a tile has 4 rows per compute warp (the thread layout L4 below)
CB = 256  # code bytes per row and slot: 2 super-blocks
HB = 32  # header bytes per row and slot
XBLK = gl.constexpr(128)  # blocks of 32 activations rounded per staging piece
LO = gl.constexpr(0x0F0F0F0F)
HI = gl.constexpr(-0x0F0F0F10)  # 0xF0F0F0F0 as int32


@gluon.jit
def _q4k_copy(dc, dh, row, j, bar, c_slot, h_slot, GGUF: gl.constexpr):
    """Slot j of a q4_k tile (super-blocks 2 j, 2 j + 1 of its rows): codes at byte 256 j and headers at byte 32 j
    of the planes, or with GGUF the blocks as stored ([rows, blocks, 144] boxes: bytes 16-143, then 0-15)."""
    if GGUF:
        tma.async_copy_global_to_shared(dc, [row, 2 * j, 16], bar, c_slot)
        tma.async_copy_global_to_shared(dh, [row, 2 * j, 0], bar, h_slot)
    else:
        tma.async_copy_global_to_shared(dc, [row, j * 256], bar, c_slot)
        tma.async_copy_global_to_shared(dh, [row, j * 32], bar, h_slot)


@gluon.jit
def _loader(dc_a, dc_b, dh_a, dh_b, c_smem, h_smem, ready, empty, LIST, n_my, STAGES: gl.constexpr,
            GGUF: gl.constexpr):
    """Each tile's slots in order (_q4k_copy)."""
    c = 0
    _, row, K, _ = _entry(LIST, 0, n_my)
    for i in range(n_my):
        _, nrow, nK, _ = _entry(LIST, i + 1, n_my)
        for j in range(K // 512):
            s = c % STAGES
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), dc_a.block_type.nbytes + dh_a.block_type.nbytes)
            if K == UP:  # the down products' matrix
                _q4k_copy(dc_b, dh_b, row, j, ready.index(s), c_smem.index(s), h_smem.index(s), GGUF)
            else:
                _q4k_copy(dc_a, dh_a, row, j, ready.index(s), c_smem.index(s), h_smem.index(s), GGUF)
            c += 1
        row, K = nrow, nK


@gluon.jit
def _inv_rms(X, K, eps):
    """1 / sqrt(mean(X[:K]^2) + eps) of a float32 row, read in pieces of 4096."""
    LP: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
    r = gl.arange(0, 16, layout=gl.SliceLayout(1, LP))
    k = gl.arange(0, 256, layout=gl.SliceLayout(0, LP))
    nk = K // 256
    acc = gl.zeros([16, 256], gl.float32, LP)
    for p in range(0, nk, 16):
        offs = (p + r)[:, None] * 256 + k[None, :]
        x = gl.load(X + offs, mask=(p + r < nk)[:, None] & (k < 256)[None, :], other=0.0)
        acc += x * x
    return 1.0 / gl.sqrt(gl.sum(gl.sum(acc, axis=1), axis=0) / K + eps)


@gluon.jit
def _stage_q(xq_smem, xd_smem, X, NW, K, eps, glu, NORM: gl.constexpr):
    """An input row X[:K] (or SiLU(X[:K]) * X[UP:UP + K] where glu != 0; with NORM its RMSNorm times NW) rounded
    to int8 per block of 32 into xq_smem, (d, s) per block into xd_smem: pieces of 128 blocks, each piece's loads
    issued together."""
    LQ: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [gl.num_warps(), 1], [1, 0])  # [128 blocks, 32]
    Q3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    xq = xq_smem._reinterpret(gl.int8, [4, XBLK, 32], Q3)
    xd = xd_smem._reinterpret(gl.float32, [4, XBLK, 2], Q3)
    b = gl.arange(0, XBLK, layout=gl.SliceLayout(1, LQ))
    e = gl.arange(0, 32, layout=gl.SliceLayout(0, LQ))
    nb = K // 32
    inv = 1.0
    if NORM:
        inv = _inv_rms(X, K, eps)
    gl.thread_barrier()  # every warp is past its reads of the op before
    for p in range(0, nb, XBLK):
        offs = (p + b)[:, None] * 32 + e[None, :]
        m = (p + b < nb)[:, None] & (e < 32)[None, :]
        a = gl.load(X + offs, mask=m, other=0.0).to(gl.float32)
        if glu != 0:
            u = gl.load(X + UP + offs, mask=m, other=0.0).to(gl.float32)
            a = a / (1.0 + gl.exp(-a)) * u
        if NORM:
            a = a * inv * gl.load(NW + offs, mask=m, other=0.0)
        _round_store(xq, xd, a, p // XBLK)
    gl.thread_barrier()  # the whole input is in shared memory before any warp reads it


@gluon.jit
def _round_store(xq, xd, a, piece):
    """Piece ``piece`` ([128 blocks, 32] float32) rounded as qgemv.int8.quantize_act: int8 q into xq [4, 128, 32],
    (d, s) per block into xd [4, 128, 2]."""
    amax = gl.max(gl.abs(a), axis=1)
    c127 = gl.full(amax.shape, 127.0, gl.float32, amax.type.layout)
    d = gl.div_rn(amax, c127)  # rounded divisions, as quantize_act (the default '/' is approximate)
    inv = gl.where(amax > 0, gl.div_rn(c127, gl.where(amax > 0, amax, 1.0)), 0.0)
    v = a * inv[:, None]
    q = gl.where(v >= 0, gl.floor(v + 0.5), -gl.floor(0.5 - v))
    s = d * gl.sum(q, axis=1)
    xq.index(piece).store(q.to(gl.int8))
    xd.index(piece).slice(0, 1, dim=1).store(d[:, None])
    xd.index(piece).slice(1, 1, dim=1).store(s[:, None])


@gluon.jit
def _dp4a(a, b):
    """sum over the 4 bytes k of a_k * b_k (a's bytes unsigned nibbles, b's signed int8)."""
    return gl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, gl.zeros_like(a)],
                                     dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _f16_lo(w):
    """The low 16 bits of int32 words as float16 -> float32."""
    return (w & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)


@gluon.jit
def _scale_min(w1, w2, w3, j):
    """(6-bit scale, 6-bit min) of sub-block j (a tensor, 0..7) from the 12 scale bytes as int32 words."""
    sh = 8 * (j % 4)
    first = j < 4
    sc = gl.where(first, (w1 >> sh) & 63, ((w3 >> sh) & 0xF) | ((w1 >> (sh + 2)) & 0x30))
    mn = gl.where(first, (w2 >> sh) & 63, ((w3 >> (sh + 4)) & 0xF) | ((w2 >> (sh + 2)) & 0x30))
    return sc.to(gl.float32), mn.to(gl.float32)


@gluon.jit
def _slot_dot(c_slot, h_slot, xq_smem, xd_smem, kp, L4: gl.constexpr, DOT: gl.constexpr = 0):
    """One slot's increments [rows, 2 blocks, 4 chunks, 1]: super-blocks 2 kp and 2 kp + 1 of the tile's rows
    (every factor in L4, its missing dims of size 1, so they broadcast without layout conversions). DOT 1: fewer
    instructions: the high nibbles kept in place (dp4a on codes & 0xF0F0F0F0 is 16 times the dot), both
    sub-blocks' 6-bit scales and mins cut from one shift of the words chosen once per thread's chunk."""
    W4: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0])
    W3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    R: gl.constexpr = c_slot.shape[0]
    codes = c_slot._reinterpret(gl.int32, [R, 2, 4, 8], W4).load(L4)
    # the chunk's 64 int8 activations: words 0-7 with the low nibbles (sub-block 2c), 8-15 with the high
    X3: gl.constexpr = gl.SliceLayout(0, L4)  # [blocks, chunks, words]
    xv = xq_smem._reinterpret(gl.int32, [32, 2, 4, 16], W3).index(kp)
    x_lo = xv.slice(0, 8, dim=2).load(X3)[None, :, :, :]
    x_hi = xv.slice(8, 8, dim=2).load(X3)[None, :, :, :]
    s_lo = gl.sum(_dp4a(codes & LO, x_lo), axis=3, keep_dims=True).to(gl.float32)
    if DOT == 1:
        s_hi = gl.sum(_dp4a(codes & HI, x_hi), axis=3, keep_dims=True).to(gl.float32) * 0.0625
    else:
        s_hi = gl.sum(_dp4a((codes >> 4) & LO, x_hi), axis=3, keep_dims=True).to(gl.float32)
    # per (block, chunk): d0, s0 (sub-block 2c), d1, s1 (2c + 1) of the activations
    xd = xd_smem._reinterpret(gl.float32, [32, 2, 4, 4], W3).index(kp)
    dx0 = xd.slice(0, 1, dim=2).load(X3)[None, :, :, :]
    sx0 = xd.slice(1, 1, dim=2).load(X3)[None, :, :, :]
    dx1 = xd.slice(2, 1, dim=2).load(X3)[None, :, :, :]
    sx1 = xd.slice(3, 1, dim=2).load(X3)[None, :, :, :]
    # per (row, block): the header words, broadcast over the chunks
    H3: gl.constexpr = gl.SliceLayout(3, L4)  # [rows, blocks, chunks]
    hv = h_slot._reinterpret(gl.int32, [R, 2, 4], W3)
    w0 = hv.slice(0, 1, dim=2).load(H3)[:, :, :, None]
    w1 = hv.slice(1, 1, dim=2).load(H3)[:, :, :, None]
    w2 = hv.slice(2, 1, dim=2).load(H3)[:, :, :, None]
    w3 = hv.slice(3, 1, dim=2).load(H3)[:, :, :, None]
    d = _f16_lo(w0)
    dmin = _f16_lo(w0 >> 16)
    C1: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L4)))
    c = gl.arange(0, 4, layout=C1)[None, None, :, None]
    if DOT == 1:
        sc0, mn0, sc1, mn1 = _scale_min_pair(w1, w2, w3, c)
    else:
        sc0, mn0 = _scale_min(w1, w2, w3, 2 * c)
        sc1, mn1 = _scale_min(w1, w2, w3, 2 * c + 1)
    return d * (sc0 * dx0 * s_lo + sc1 * dx1 * s_hi) - dmin * (mn0 * sx0 + mn1 * sx1)


@gluon.jit
def _scale_min_pair(w1, w2, w3, c):
    """(scale, min) of sub-blocks 2c and 2c + 1 (bytes sh / 8 and sh / 8 + 1 of the scale words) as float32."""
    first = c < 2
    sh = 16 * (c % 2)
    m_a = gl.where(first, 63, 0xF)
    m_b = gl.where(first, 0, 0x30)
    ta = gl.where(first, w1, w3) >> sh  # scales: 6 bits of w1, or 4 of w3 and 2 of w1
    tc = gl.where(first, w2, w3 >> 4) >> sh  # mins: 6 bits of w2, or 4 of w3 >> 4 and 2 of w2
    t1 = (w1 >> 2) >> sh
    t2 = (w2 >> 2) >> sh
    sc0 = (ta & m_a) | (t1 & m_b)
    mn0 = (tc & m_a) | (t2 & m_b)
    sc1 = ((ta >> 8) & m_a) | ((t1 >> 8) & m_b)
    mn1 = ((tc >> 8) & m_a) | ((t2 >> 8) & m_b)
    return sc0.to(gl.float32), mn0.to(gl.float32), sc1.to(gl.float32), mn1.to(gl.float32)


@gluon.jit
def q4k_step(c_smem, h_smem, xq_smem, xd_smem, ready, empty, c, kp, acc, L4: gl.constexpr, STAGES: gl.constexpr,
             N: gl.constexpr, DOT: gl.constexpr, PRODUCTS: gl.constexpr = True):
    """N slots' products (one barrier for all; PRODUCTS False: the slots freed as they land) -> (acc, c + N)."""
    for u in gl.static_range(N):
        mbarrier.wait(ready.index((c + u) % STAGES), ((c + u) // STAGES) & 1)
    if PRODUCTS:
        for u in gl.static_range(N):
            s = (c + u) % STAGES
            acc += _slot_dot(c_smem.index(s), h_smem.index(s), xq_smem, xd_smem, kp + u, L4, DOT)
        gl.thread_barrier()  # every warp has read the slots
    for u in gl.static_range(N):
        mbarrier.arrive(empty.index((c + u) % STAGES), count=1)
    return acc, c + N


@gluon.jit
def _compute(c_smem, h_smem, xq_smem, xd_smem, ready, empty, LIST, n_my, OPS, ACT, CNT, ERR, act_stride, SPIN,
             STAGES: gl.constexpr, MODE: gl.constexpr, STEP: gl.constexpr, DOT: gl.constexpr):
    """MODE 0: the chain; 1: slots freed as they land (the loader alone); 2: products without the counters.
    STEP: slots per barrier (K / 512 a multiple); DOT: _slot_dot's."""
    L4: gl.constexpr = gl.BlockedLayout([1, 1, 1, 8], [4, 2, 4, 1], [gl.num_warps(), 1, 1, 1], [3, 2, 1, 0])
    R1: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L4)))
    ROWS: gl.constexpr = c_smem.shape[1]
    rows = gl.arange(0, ROWS, layout=R1)
    c = 0
    cur = -1
    done = 0
    op, _, K, out0 = _entry(LIST, 0, n_my)
    for i in range(n_my):
        nop, _, nK, nout0 = _entry(LIST, i + 1, n_my)
        glu = (K == UP).to(gl.int32)
        if op != cur:
            if (op > 0) & (MODE == 0):
                _wait_op(OPS, CNT, ERR, op, SPIN)
            if MODE != 1:
                _stage_q(xq_smem, xd_smem, ACT + op.to(gl.int64) * act_stride, ACT, K, 0.0, glu, False)
            cur = op
        acc = gl.zeros([ROWS, 2, 4, 1], gl.float32, L4)
        for kp in range(0, K // 512, STEP):  # STEP slots per step, one barrier for all
            acc, c = q4k_step(c_smem, h_smem, xq_smem, xd_smem, ready, empty, c, kp, acc, L4, STAGES, STEP, DOT,
                              MODE != 1)
        y = gl.sum(gl.sum(gl.sum(acc, axis=3), axis=2), axis=1)
        gl.store(ACT + (op + 1).to(gl.int64) * act_stride + out0 + rows, y.to(ACT.dtype.element_ty))
        done = _release(CNT, op, nop, done)
        op, K, out0 = nop, nK, nout0


@gluon.jit
def stream_q4k_kernel(dc_a, dc_b, dh_a, dh_b, LISTS, COUNTS, list_stride, OPS, ACT, CNT, ERR, act_stride, SPIN,
                      STAGES: gl.constexpr, CW: gl.constexpr = 4, MODE: gl.constexpr = 0,
                      GGUF: gl.constexpr = False, STEP: gl.constexpr = 2, DOT: gl.constexpr = 0):
    pid = gl.program_id(0)
    LIST = LISTS + pid * list_stride
    n_my = gl.load(COUNTS + pid)
    ROWS: gl.constexpr = dc_a.block_type.shape[0]  # 4 * CW
    if GGUF:
        c_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, ROWS, 2, 128], dc_a.layout)
        h_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, ROWS, 2, 16], dh_a.layout)
    else:
        c_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, ROWS, 256], dc_a.layout)
        h_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, ROWS, 32], dh_a.layout)
    # the op's int8 input (up to 16384) and its (d, s) per block of 32, flat; each user views them as it reads
    xq_smem = gl.allocate_shared_memory(gl.int8, [16384], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    xd_smem = gl.allocate_shared_memory(gl.float32, [1024], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(ready.index(j), count=1)
        mbarrier.init(empty.index(j), count=1)
    gl.warp_specialize([
        (_loader, (dc_a, dc_b, dh_a, dh_b, c_smem, h_smem, ready, empty, LIST, n_my, STAGES, GGUF)),
        (_compute, (c_smem, h_smem, xq_smem, xd_smem, ready, empty, LIST, n_my, OPS, ACT, CNT, ERR, act_stride,
                    SPIN, STAGES, MODE, STEP, DOT)),
    ], [CW], [232 if CW == 4 else 192])


def planes(blocks):
    """GGUF q4_k bytes [N, K / 256 * 144] -> (codes [N, K / 2], headers [N, K / 16]) uint8."""
    N = blocks.shape[0]
    b = blocks.view(N, -1, 144)
    return b[:, :, 16:].reshape(N, -1).contiguous(), b[:, :, :16].reshape(N, -1).contiguous()


def round_int8(x):
    """x [K] float32 -> (q int8 [K], d [K / 32], s [K / 32]) as qgemv.int8.quantize_act rounds it."""
    xb = x.view(-1, 32)
    amax = xb.abs().amax(1)
    d = amax / 127
    inv = torch.where(amax > 0, 127 / torch.where(amax > 0, amax, torch.ones_like(amax)), torch.zeros_like(amax))
    v = xb * inv[:, None]
    q = torch.where(v >= 0, torch.floor(v + 0.5), -torch.floor(0.5 - v))
    return q.to(torch.int8).view(-1), d, d * q.sum(1)


def emulate(codes, hdr, x):
    """The kernel's arithmetic in torch (float64): planes and x [K] -> y [N]. Checks the layout and the scale
    decoding on the CPU."""
    from llmkernels.quant.scales import unpack_scales6

    N = codes.shape[0]
    q, dx, sx = round_int8(x.float())
    nb = codes.shape[1] // 128
    h = hdr.view(N, nb, 16)
    d = h[:, :, 0:2].contiguous().view(torch.float16).double()  # [N, nb, 1]
    dmin = h[:, :, 2:4].contiguous().view(torch.float16).double()
    sc, mn = unpack_scales6(h[:, :, 4:16].reshape(-1, 12))
    sc, mn = sc.view(N, nb, 8).double(), mn.view(N, nb, 8).double()
    cb = codes.view(N, nb, 4, 32).to(torch.int64)
    nib = torch.stack([cb & 0xF, cb >> 4], dim=3).view(N, nb, 8, 32)  # sub-block 2c + p
    dots = (nib * q.view(nb, 8, 32).to(torch.int64)).sum(-1).double()  # the integer dots [N, nb, 8]
    dxv, sxv = dx.view(nb, 8).double(), sx.view(nb, 8).double()
    return (d * sc * dxv * dots - dmin * mn * sxv).sum((1, 2))


def scales_v2(hdr):
    """_slot_dot's DOT 1 scale and min decoding in torch: header bytes [n, 16] -> (sc, mn) [n, 8] int64."""
    w = hdr.contiguous().view(torch.int32).to(torch.int64)  # [n, 4] words, sign-extended as the kernel's int32
    w1, w2, w3 = w[:, 1:2], w[:, 2:3], w[:, 3:4]
    sc, mn = [], []
    for c in range(4):
        first = c < 2
        sh = 16 * (c % 2)
        m_a, m_b = (63, 0) if first else (0xF, 0x30)
        ta = (w1 if first else w3) >> sh
        tc = (w2 if first else w3 >> 4) >> sh
        t1, t2 = (w1 >> 2) >> sh, (w2 >> 2) >> sh
        sc += [(ta & m_a) | (t1 & m_b), ((ta >> 8) & m_a) | ((t1 >> 8) & m_b)]
        mn += [(tc & m_a) | (t2 & m_b), ((tc >> 8) & m_a) | ((t2 >> 8) & m_b)]
    return torch.cat(sc, 1), torch.cat(mn, 1)


def check_emulation():
    from llmkernels.quant import dequantize
    from llmkernels.testing.random_weights import random_qtensor

    torch.manual_seed(0)
    worst = 0.0
    for N, K in ((48, 4096), (40, 14336), (16, 512)):
        qt = random_qtensor("q4_k", N, K, "cpu", scale=1.0 / (324 * K ** 0.5))
        codes, hdr = planes(qt.data)
        x = torch.randn(K)
        q, dx, _ = round_int8(x)
        xr = (q.view(-1, 32).double() * dx.double()[:, None]).view(-1)
        ref = dequantize(qt, dtype=torch.float32).double() @ xr
        got = emulate(codes, hdr, x)
        e = ((got - ref).abs().max() / ref.abs().max()).item()
        worst = max(worst, e)
        print(f"[{N}, {K}]: emulated kernel arithmetic vs dequantize(W) @ x': {e:.1e} of the largest output")
    assert worst < 1e-6, worst
    from llmkernels.quant.scales import unpack_scales6
    hdr = torch.randint(0, 256, (4096, 16), dtype=torch.uint8)
    want = unpack_scales6(hdr[:, 4:16])
    got = scales_v2(hdr)
    same = all(torch.equal(g, w.to(torch.int64).view(g.shape)) for g, w in zip(got, want))
    verdict = "equal to" if same else "DIFFERENT FROM"
    print(f"_slot_dot's DOT 1 scale and min decoding on 4096 random headers: {verdict} "
          f"unpack_scales6")
    assert same
    return worst


def layout8(rank=2):
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=rank)


def q4k_descriptors(t, rows, gguf):
    """(codes, headers) TMA descriptors of the q4_k matrix t: the planes (codes [N, K / 2], headers [N, K / 16])
    or, with ``gguf``, the GGUF bytes [N, K / 256 * 144] seen as [N, blocks, 144]."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if gguf:
        N, rb = t.shape
        v = t.view(N, rb // 144, 144)
        return tuple(TensorDescriptor(v, list(v.shape), [rb, 144, 1], [rows, 2, n], layout8(3)) for n in (128, 16))
    codes, hdr = t
    return tuple(TensorDescriptor(x, list(x.shape), [x.shape[1], 1], [rows, n], layout8())
                 for x, n in ((codes, 256), (hdr, 32)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--stages", default="16,24", help="ring slots of 4.5 KB per 16 rows (8 warps, 24: too much)")
    ap.add_argument("--warps", default="4,8", help="compute warps; a tile has 4 rows per warp")
    ap.add_argument("--modes", default="0,1,2", help="stream_q4k_kernel's MODE (1 and 2 are timed, not checked)")
    ap.add_argument("--layouts", default="gguf,planes", help="gguf: the blocks as stored; planes: codes, headers")
    ap.add_argument("--step", default="2", help="comma-separated: slots per barrier (2 or 4)")
    ap.add_argument("--dot", default="0", help="comma-separated: _slot_dot's DOT (1: fewer instructions)")
    ap.add_argument("--check-ops", type=int, default=8, help="mode 0 checks the chain's first N ops")
    ap.add_argument("--emulate", action="store_true", help="check the arithmetic in torch on the CPU and stop")
    args = ap.parse_args()
    if args.emulate:
        check_emulation()
        return
    from llmkernels._runtime import num_sms
    from llmkernels.bench.harness import measure_read_bandwidth
    from llmkernels.quant import dequantize
    from llmkernels.quant.tensor import QuantizedTensor
    from llmkernels.testing.random_weights import random_qtensor

    bw = measure_read_bandwidth()
    P = num_sms()
    print(f"read bandwidth {bw:.3f} TB/s, {P} SMs", flush=True)
    per_a = QKV + HIDDEN + 2 * FFN
    wa = random_qtensor("q4_k", args.layers * per_a, HIDDEN, "cuda", scale=1.0 / (324 * HIDDEN ** 0.5)).data
    wb = random_qtensor("q4_k", args.layers * HIDDEN, FFN, "cuda", scale=1.0 / (324 * FFN ** 0.5)).data
    nbytes = wa.numel() + wb.numel()
    ops = llama_ops(args.layers, per_a)
    act_stride = 2 * FFN
    act = torch.zeros(len(ops) + 1, act_stride, device="cuda", dtype=torch.bfloat16)
    act[0, :HIDDEN] = torch.randn(HIDDEN, device="cuda")
    cnt = torch.zeros(len(ops), dtype=torch.int32, device="cuda")
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    def product(d, r0, n, x):  # dequantize(W) @ x', x' the int8 rounding of the op's input
        blocks = (wa if d == 0 else wb)[r0:r0 + n]
        w = dequantize(QuantizedTensor("q4_k", (n, x.numel()), blocks), dtype=torch.float32)
        q, dx, _ = round_int8(x)
        return w.double() @ (q.view(-1, 32).double() * dx.double()[:, None]).view(-1)
    for lay in args.layouts.split(","):
        gguf = lay == "gguf"
        ma, mb = (wa, wb) if gguf else (planes(wa), planes(wb))
        for cw in (int(x) for x in args.warps.split(",")):
            rows = ROWS_PER_WARP * cw
            table, lists, counts = tile_lists(ops, rows, P, "cuda")
            (dc_a, dh_a), (dc_b, dh_b) = q4k_descriptors(ma, rows, gguf), q4k_descriptors(mb, rows, gguf)
            for stages in (int(x) for x in args.stages.split(",")):
                for mode, step, dot in itertools.product(*(map(int, a.split(",")) for a in
                                                           (args.modes, args.step, args.dot))):
                    name = f"q4_k {lay} rows {rows} stages {stages} warps {cw} step {step} dot {dot} mode {mode}"

                    def run():
                        cnt.zero_()
                        stream_q4k_kernel[(P,)](dc_a, dc_b, dh_a, dh_b, lists, counts, lists.stride(0), table, act,
                                                cnt, err, act_stride, 1 << 20, STAGES=stages, CW=cw, MODE=mode,
                                                GGUF=gguf, STEP=step, DOT=dot, num_warps=4)
                    if measure(name, run, err, ops, act, nbytes, bw, product,
                               check=args.check_ops if mode == 0 else 0) == "stop":
                        return
        del ma, mb


if __name__ == "__main__":
    main()
