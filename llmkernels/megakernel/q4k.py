"""q4_k weights in the one-kernel step (Gluon, sm_90): the GGUF blocks as stored, streamed by TMA into ring slots
of two super-blocks of 16 rows (a [16, 2, 128] box of code bytes, a [16, 2, 16] box of headers: d, dmin and the 12
bytes of 6-bit scales and mins), against the op's input rounded to int8 per block of 32 in shared memory (the
engine's act_int8 arithmetic, qgemv.int8.quantize_act), with dp4a.

A thread takes one 64-weight chunk (sub-blocks 2c and 2c + 1) of one row and super-block: its 8 code words masked
to low and high nibbles, 16 dp4a against the chunk's int8 words, then d * sc * dx * dot - dmin * mn * s per
sub-block.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

XBLK = gl.constexpr(128)  # blocks of 32 activations rounded per staging piece
LO = gl.constexpr(0x0F0F0F0F)
HI = gl.constexpr(-0x0F0F0F10)  # 0xF0F0F0F0 as int32


@gluon.jit
def q4k_copy(dc, dh, row, j, bar, c_slot, h_slot, GGUF: gl.constexpr):
    """Slot j of a q4_k tile (super-blocks 2 j, 2 j + 1 of its rows): codes at byte 256 j and headers at byte 32 j
    of the planes, or with GGUF the blocks as stored ([rows, blocks, 144] boxes: bytes 16-143, then 0-15)."""
    if GGUF:
        tma.async_copy_global_to_shared(dc, [row, 2 * j, 16], bar, c_slot)
        tma.async_copy_global_to_shared(dh, [row, 2 * j, 0], bar, h_slot)
    else:
        tma.async_copy_global_to_shared(dc, [row, j * 256], bar, c_slot)
        tma.async_copy_global_to_shared(dh, [row, j * 32], bar, h_slot)



@gluon.jit
def int8_input_smem():
    """(xq, xd): an op's input rounded to int8 (up to 16384) and its (d, s) per block of 32, flat; each user
    views them as it reads them."""
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    return gl.allocate_shared_memory(gl.int8, [16384], flat), gl.allocate_shared_memory(gl.float32, [1024], flat)


@gluon.jit
def inv_rms(X, K, eps):
    """1 / sqrt(mean(X[:K]^2) + eps) of a float32 (or bf16) row, read in pieces of 4096."""
    LP: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
    r = gl.arange(0, 16, layout=gl.SliceLayout(1, LP))
    k = gl.arange(0, 256, layout=gl.SliceLayout(0, LP))
    nk = K // 256
    acc = gl.zeros([16, 256], gl.float32, LP)
    for p in range(0, nk, 16):
        offs = (p + r)[:, None] * 256 + k[None, :]
        x = gl.load(X + offs, mask=(p + r < nk)[:, None] & (k < 256)[None, :], other=0.0).to(gl.float32)
        acc += x * x
    return 1.0 / gl.sqrt(gl.sum(gl.sum(acc, axis=1), axis=0) / K + eps)


@gluon.jit
def stage_q(xq_smem, xd_smem, X, NW, K, eps, up, NORM: gl.constexpr):
    """An input row X[:K] (or SiLU(X[:K]) * X[up:up + K] where up != 0; with NORM its RMSNorm times NW) rounded
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
        inv = inv_rms(X, K, eps)
    gl.thread_barrier()  # every warp is past its reads of the op before
    for p in range(0, nb, XBLK):
        offs = (p + b)[:, None] * 32 + e[None, :]
        m = (p + b < nb)[:, None] & (e < 32)[None, :]
        a = gl.load(X + offs, mask=m, other=0.0).to(gl.float32)
        if up != 0:
            u = gl.load(X + up + offs, mask=m, other=0.0).to(gl.float32)
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
    C1: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L4)))
    c = gl.arange(0, 4, layout=C1)[None, None, :, None]
    return _scaled(w0, w1, w2, w3, c, s_lo, s_hi, dx0, sx0, dx1, sx1, DOT)


@gluon.jit
def _scaled(w0, w1, w2, w3, c, s_lo, s_hi, dx0, sx0, dx1, sx1, DOT: gl.constexpr):
    """The chunks' increments from their integer dots (s_lo, s_hi: sub-blocks 2c, 2c + 1), the super-blocks'
    header words w0-w3 and the activations' (d, s) per sub-block."""
    d = _f16_lo(w0)
    dmin = _f16_lo(w0 >> 16)
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
def _pair_dot(c_smem, h_smem, xq_smem, xd_smem, s2, kp2, L5: gl.constexpr, DOT: gl.constexpr):
    """Slots 2 s2 and 2 s2 + 1 (super-blocks 4 kp2 .. 4 kp2 + 3 of the tile's rows) as one [2, rows, 2 blocks, 4
    chunks, 1] increment, _slot_dot's arithmetic with the slot as the first axis: half the warps take each slot,
    so a thread keeps _slot_dot's share of a chunk with twice the warps."""
    W5: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [4, 3, 2, 1, 0])  # views indexed on their first axis
    W4: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0])
    NS: gl.constexpr = c_smem.shape[0] // 2
    R: gl.constexpr = c_smem.shape[1]
    codes = c_smem._reinterpret(gl.int32, [NS, 2, R, 2, 4, 8], W5).index(s2).load(L5)
    X4: gl.constexpr = gl.SliceLayout(1, L5)  # [slots, blocks, chunks, words]
    xv = xq_smem._reinterpret(gl.int32, [16, 2, 2, 4, 16], W4).index(kp2)
    x_lo = xv.slice(0, 8, dim=3).load(X4)[:, None, :, :, :]
    x_hi = xv.slice(8, 8, dim=3).load(X4)[:, None, :, :, :]
    s_lo = gl.sum(_dp4a(codes & LO, x_lo), axis=4, keep_dims=True).to(gl.float32)
    if DOT == 1:
        s_hi = gl.sum(_dp4a(codes & HI, x_hi), axis=4, keep_dims=True).to(gl.float32) * 0.0625
    else:
        s_hi = gl.sum(_dp4a((codes >> 4) & LO, x_hi), axis=4, keep_dims=True).to(gl.float32)
    xd = xd_smem._reinterpret(gl.float32, [16, 2, 2, 4, 4], W4).index(kp2)
    dx0 = xd.slice(0, 1, dim=3).load(X4)[:, None, :, :, :]
    sx0 = xd.slice(1, 1, dim=3).load(X4)[:, None, :, :, :]
    dx1 = xd.slice(2, 1, dim=3).load(X4)[:, None, :, :, :]
    sx1 = xd.slice(3, 1, dim=3).load(X4)[:, None, :, :, :]
    H4: gl.constexpr = gl.SliceLayout(4, L5)  # [slots, rows, blocks, chunks]
    hv = h_smem._reinterpret(gl.int32, [NS, 2, R, 2, 4], W4).index(s2)
    w0 = hv.slice(0, 1, dim=3).load(H4)[:, :, :, :, None]
    w1 = hv.slice(1, 1, dim=3).load(H4)[:, :, :, :, None]
    w2 = hv.slice(2, 1, dim=3).load(H4)[:, :, :, :, None]
    w3 = hv.slice(3, 1, dim=3).load(H4)[:, :, :, :, None]
    C1: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, H4)))
    c = gl.arange(0, 4, layout=C1)[None, None, None, :, None]
    return _scaled(w0, w1, w2, w3, c, s_lo, s_hi, dx0, sx0, dx1, sx1, DOT)


@gluon.jit
def q4k_pair_step(c_smem, h_smem, xq_smem, xd_smem, ready, empty, c, kp, n, acc, L5: gl.constexpr,
                  STAGES: gl.constexpr, DOT: gl.constexpr):
    """Slots c and c + 1 (c and STAGES even, so the two are adjacent in the ring) taken at once by _pair_dot ->
    (acc, c + 2). Slot kp + 1 = n (a row of an odd number of slots) is the loader's filler: its products are
    dropped."""
    s = c % STAGES
    mbarrier.wait(ready.index(s), (c // STAGES) & 1)
    mbarrier.wait(ready.index(s + 1), (c // STAGES) & 1)
    inc = _pair_dot(c_smem, h_smem, xq_smem, xd_smem, s // 2, kp // 2, L5, DOT)
    S1: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, L5))))
    half = gl.arange(0, 2, layout=S1)[:, None, None, None, None]
    acc += gl.where(kp + half < n, inc, 0.0)
    gl.thread_barrier()  # every warp has read the slots
    mbarrier.arrive(empty.index(s), count=1)
    mbarrier.arrive(empty.index(s + 1), count=1)
    return acc, c + 2


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

