"""GEMV with the activations rounded to int8: integer dot products (dp4a) on the stored codes, for q4_0, q8_0, q4_k,
q5_k and q6_k at small M. The result is x' @ dequantize(W).T with x' = x rounded to int8 per block of 32 (scale =
absmax / 127, round half away from zero), like llama.cpp's q8_1 activations; it is opt-in (``gemv(...,
act_int8=True)``) because it is not x @ dequantize(W).T to fp16 rounding (the activation rounding adds about 1/254 of
each block's absmax).

Why: exact batch-1 kernels turn each code into a float and multiply it with x, 4 to 5 instructions per weight, which
keeps them near the SMs' issue limit before the memory limit. With int8 activations one ``dp4a`` multiplies 4 codes by
4 activations and sums them into an int32: q4_0's 8 nibbles of a word take two LOP3 (mask the low nibbles, mask the
high ones in place: bytes 16 q) and two dp4a, under 1 instruction per weight in all.

Layout of the quantized activations (``quantize_act``): q int8 [M, K] (read as int32 words, 8 per block) and
ds float32 [M, K / 32, 2] with (d, s) per block: d = absmax / 127 and s = d * sum(q), so that
sum_j (c_j - z) x'_j = d * sum_j c_j q_j - z * s for codes c and a zero point z.

Weights are read as aligned words (words.py's helpers): a group is G blocks (q4_0, q8_0) or one super-block (q4_k)
of a row, loaded by one thread as NV + 1 vectors of VW int32 words and split into single words in the registers
(rows past N read row N - 1, never stored). A block of q4_0 or q8_0 that starts in the middle of a word gets its code
words from two neighbours with one byte permute each. GP threads take consecutive groups of one row, so a warp's
loads cover contiguous bytes (see gemv_i8_kernel).

Kernels: gemv_i8_kernel (q4_0, q8_0, q4_k; M up to route.I8_MAX_M); gemv_i8_lanes_kernel for q4_k and q5_k at M = 1 (the
m1 kernel's thread layout, a warp on 8 consecutive super-blocks of one row, with this file's dp4a arithmetic; q5_k's
fifth bits masked in place and summed by two more dp4a per word); gemv_i8_q6_kernel for q6_k at M = 1 (K a multiple
of 2048, so rows and steps of 8 blocks are 16-byte aligned). The lane kernels take activations in "i8 lane order"
(i8_lane_base), so each load of a warp covers 512 contiguous bytes, and one rounding serves a layer's q4_k, q5_k and
q6_k projections. Where each is faster than the exact kernels: bench/NOTES.md (GEMV routing).
"""
import torch
import triton
import triton.language as tl

from .._pdl import pdl_options, pdl_supported, pdl_trigger, pdl_wait
from .common import split_k, split_outputs
from .m1 import _load, _q4k_scales, _split_words, _store_rows, lanes_width
from .words import _block_codes, _scalars

# format -> (FMT id, bytes per block or super-block, blocks per step)
I8_FORMATS = {"q4_0": (3, 18, 8), "q8_0": (7, 34, 8), "q4_k": (10, 144, 1)}
_LO = tl.constexpr(0x0F0F0F0F)
_HI = tl.constexpr(-0x0F0F0F10)  # 0xF0F0F0F0 as an int32: the high nibbles in place, bytes 16 * q


@triton.jit
def _dp4a(a, b, c, A_UNSIGNED: tl.constexpr, UNPACK: tl.constexpr):
    """c + sum over the 4 bytes k of a_k * b_k, b's bytes signed, a's unsigned or signed (UNPACK = 2: the PTX
    instruction; 1: the same in Triton integer ops, for the interpreter)."""
    if UNPACK == 2:
        if A_UNSIGNED:
            return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                             is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                             is_pure=True, pack=1)
    else:  # the 4 bytes along a new last axis: a few whole-tile ops, which is what the interpreter's time counts
        shift = 8 * tl.arange(0, 4)
        a4 = tl.expand_dims(a, -1)
        if A_UNSIGNED:
            ak = (a4 >> shift) & 0xFF
        else:
            ak = (a4 << (24 - shift)) >> 24
        return c + tl.sum(ak * ((tl.expand_dims(b, -1) << (24 - shift)) >> 24), axis=-1)


@triton.jit
def _xblock(xw_ptrs, xs_ptrs, ROWS_T: tl.constexpr):
    """One activation block: its 8 int8 words [ROWS_T, 1] (8 pointers [ROWS_T, 1, 2, 4]) and its (d, s)."""
    xw = _scalars(tl.load(xw_ptrs), ROWS_T, 1, 8, 3)
    d, s = _scalars(tl.load(xs_ptrs), ROWS_T, 1, 2, 1)
    return xw, d, s


@triton.jit
def _legacy_update(lo, hi, dw, xw_ptrs, xs_ptrs, FMT: tl.constexpr, ROWS_T: tl.constexpr, UNPACK: tl.constexpr):
    """One activation row's increment for a q4_0 or q8_0 block with code words lo (q4_0: low nibbles; q8_0: the 8
    code words) and hi (q4_0: high nibbles in place)."""
    xw, dx, sx = _xblock(xw_ptrs, xs_ptrs, ROWS_T)
    if FMT == 3:  # byte 4t + k of the codes: low nibble with x[4t + k], high nibble with x[16 + 4t + k]
        zero = lo[0] * 0
        a_lo = _dp4a(lo[0], xw[0], zero, False, UNPACK)
        a_hi = _dp4a(hi[0], xw[4], zero, True, UNPACK)
        for t in tl.static_range(1, 4):
            a_lo = _dp4a(lo[t], xw[t], a_lo, False, UNPACK)
            a_hi = _dp4a(hi[t], xw[4 + t], a_hi, True, UNPACK)
        # sum (q - 8) x' = dx * sum q qx - 8 s, with a_hi = 16 * (sum over the high nibbles)
        return dw * (((a_lo << 4) + a_hi).to(tl.float32) * (dx * 0.0625) - 8.0 * sx)
    else:
        a = _dp4a(lo[0], xw[0], lo[0] * 0, False, UNPACK)
        for t in tl.static_range(1, 8):
            a = _dp4a(lo[t], xw[t], a, False, UNPACK)
        return dw * (a.to(tl.float32) * dx)


@triton.jit
def _q4k_update(lo, hi, a0, a1, b0, b1, xw_ptrs, xs_ptrs, ROWS_T: tl.constexpr, UNPACK: tl.constexpr):
    """One activation row's increment for a q4_k chunk of 64 weights (sub-blocks 2c and 2c + 1): its 8 code words
    masked to low (lo) and high (hi, 16 q) nibbles, per-row factors a = d * sc (a1 with the 1/16 of hi) and
    b = dmin * mn; xw_ptrs / xs_ptrs point at the activation block of sub-block 2c."""
    xw0, dx0, sx0 = _xblock(xw_ptrs, xs_ptrs, ROWS_T)
    xw1, dx1, sx1 = _xblock(xw_ptrs + 8, xs_ptrs + 2, ROWS_T)
    zero = lo[0] * 0
    s_lo = _dp4a(lo[0], xw0[0], zero, False, UNPACK)
    s_hi = _dp4a(hi[0], xw1[0], zero, True, UNPACK)
    for t in tl.static_range(1, 8):
        s_lo = _dp4a(lo[t], xw0[t], s_lo, False, UNPACK)
        s_hi = _dp4a(hi[t], xw1[t], s_hi, True, UNPACK)
    return a0 * (s_lo.to(tl.float32) * dx0) + a1 * (s_hi.to(tl.float32) * dx1) - b0 * sx0 - b1 * sx1


@triton.jit
def _q4k_scale(w1, w2, w3, j: tl.constexpr):
    """(6-bit scale, 6-bit min) of q4_k sub-block j (static) as float32, from the 12 scale bytes as int32 words."""
    sh: tl.constexpr = 8 * (j % 4)
    if j < 4:
        sc = (w1 >> sh) & 63
        mn = (w2 >> sh) & 63
    else:
        sc = ((w3 >> sh) & 0xF) | ((w1 >> (sh + 2)) & 0x30)
        mn = ((w3 >> (sh + 4)) & 0xF) | ((w2 >> (sh + 2)) & 0x30)
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _row_sums(acc, LPR: tl.constexpr, GP: tl.constexpr, R: tl.constexpr):
    """[LPR * GP, R] per-thread sums -> [LPR, R] row sums (threads GP apart hold one row's groups)."""
    if GP == 1:
        return acc
    else:
        return tl.sum(tl.reshape(acc, (LPR, GP, R)), axis=1)


@triton.jit
def gemv_i8_kernel(XQ, XS, W32, Y, PART, COUNT, M, N, stride_xq, stride_xs, stride_ys, stride_ym, row_words,
                   ngroups, groups_per_split, split,
                   FMT: tl.constexpr, BB: tl.constexpr, G: tl.constexpr, VW: tl.constexpr, NV: tl.constexpr,
                   LOG_MAIN: tl.constexpr, LOG_VW: tl.constexpr, ROWS_T: tl.constexpr, R: tl.constexpr,
                   GP: tl.constexpr, MR: tl.constexpr, UNPACK: tl.constexpr, FIXUP: tl.constexpr,
                   COAL: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr = False):
    """y[m, n] (+)= sum over this program's K split of x'[m] . w[n] for BLOCK_N = ROWS_T // GP * R rows, with x'
    given as int8 words XQ (stride_xq words per row) and per-block (d, s) in XS (stride_xs floats per row).

    A group is G blocks (q4_0, q8_0) or one super-block (q4_k) of a row: NV vectors of VW words and one more, all in
    one thread. The ROWS_T threads (lanes and warps) take GP consecutive groups of ROWS_T // GP rows per step, so a
    warp reads GP * 144 (or 272) contiguous bytes of each of its rows at once (GP = 1: one row per thread, 32
    scattered rows per warp, which measured 1.7-1.9 TB/s at most on an H100 even with no arithmetic); R such
    row sets per thread. The GP partial sums of a row are added across threads at the end.

    COAL = 1 loads the first NV * VW words of each group as one contiguous run (the compiler's coalescing then puts
    8 lanes with 16 bytes each along a group's 128 bytes instead of one thread per group) and lets the compiler move
    them to one thread per group through shared memory. PREFETCH = 1 loads the next step's weights before this
    step's arithmetic (twice the weight registers). Both pay off where the grid has many steps per program: on an
    H100 (bench/lab/i8_lab.py, bench/NOTES.md) 128256 x 4096 went from 132-134 to 112-117 us for q4_0 and from 245
    to 197-198 us for q8_0, while the 9-33 MB matrices stayed within +-10%."""
    LPR: tl.constexpr = ROWS_T // GP  # rows per rep
    BLOCK_N: tl.constexpr = LPR * R
    GW: tl.constexpr = G * BB // 4  # words per step and row
    XB: tl.constexpr = 8 if FMT == 10 else G  # activation blocks of 32 per step
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    pdl_wait(PDL)  # PDL: see _pdl.py
    m0 = pid_m * MR
    rt = tl.arange(0, ROWS_T)[:, None]
    rr = tl.arange(0, R)[None, :]
    gl = rt % GP  # this thread's group within the step
    rows = tl.minimum(pid_n * BLOCK_N + rr * LPR + rt // GP, N - 1).to(tl.int64)  # [ROWS_T, R]
    g_start = pid_k * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, ngroups)  # the host keeps both multiples of GP
    base = rows * row_words + (g_start + gl) * GW
    if COAL:
        w_ptrs = W32 + base[:, :, None] + tl.arange(0, NV * VW)[None, None, :]
    else:
        w_ptrs = W32 + base[:, :, None, None] + tl.arange(0, NV)[None, None, :, None] * VW \
            + tl.arange(0, VW)[None, None, None, :]
    t_ptrs = W32 + base[:, :, None] + NV * VW + tl.arange(0, VW)[None, None, :]
    # activation pointers with the row axis broadcast (x gets the rows' layout): 8 words and one (d, s) per block
    xg = (g_start + gl)[:, :, None]  # [ROWS_T, 1, 1]: each thread's group (the same for its R rows)
    xw_ptrs = XQ + m0 * stride_xq + xg[:, :, :, None] * (XB * 8) + tl.arange(0, 2)[None, None, :, None] * 4 \
        + tl.arange(0, 4)[None, None, None, :]
    xs_ptrs = XS + m0 * stride_xs + xg * (XB * 2) + tl.arange(0, 2)[None, None, :]
    xo1 = tl.minimum(m0 + 1, M - 1) - m0
    xo2 = tl.minimum(m0 + 2, M - 1) - m0
    xo3 = tl.minimum(m0 + 3, M - 1) - m0
    acc0 = tl.zeros([ROWS_T, R], dtype=tl.float32)
    acc1 = tl.zeros([ROWS_T, R], dtype=tl.float32)
    acc2 = tl.zeros([ROWS_T, R], dtype=tl.float32)
    acc3 = tl.zeros([ROWS_T, R], dtype=tl.float32)
    if PREFETCH:  # the first step's weights; each step then loads the next one's before its arithmetic
        wa = tl.load(w_ptrs, mask=g_start < g_end)
        wb = tl.load(t_ptrs, mask=g_start < g_end)
    for g in range(g_start, g_end, GP):
        if PREFETCH:
            nstep = tl.where(g + GP < g_end, GP * GW, 0)  # the last step reloads its own words
            na = tl.load(w_ptrs + nstep)
            nb = tl.load(t_ptrs + nstep)
            cur_a = wa
            cur_b = wb
        else:
            cur_a = tl.load(w_ptrs)
            cur_b = tl.load(t_ptrs)
        words = _scalars(cur_a, ROWS_T, R, NV * VW, LOG_MAIN) + _scalars(cur_b, ROWS_T, R, VW, LOG_VW)
        if FMT == 10:
            d, dmin = _split_words(words[0], tl.float16)
            for c in tl.static_range(4):
                sc0, mn0 = _q4k_scale(words[1], words[2], words[3], 2 * c)
                sc1, mn1 = _q4k_scale(words[1], words[2], words[3], 2 * c + 1)
                a0 = d * sc0
                a1 = d * sc1 * 0.0625
                b0 = dmin * mn0
                b1 = dmin * mn1
                lo = ()
                hi = ()
                for t in tl.static_range(8):
                    lo = lo + (words[4 + 8 * c + t] & _LO, )
                    hi = hi + (words[4 + 8 * c + t] & _HI, )
                xj = xw_ptrs + 16 * c
                sj = xs_ptrs + 4 * c
                acc0 += _q4k_update(lo, hi, a0, a1, b0, b1, xj, sj, ROWS_T, UNPACK)
                if MR > 1:
                    acc1 += _q4k_update(lo, hi, a0, a1, b0, b1, xj + xo1 * stride_xq, sj + xo1 * stride_xs, ROWS_T,
                                        UNPACK)
                if MR > 2:
                    acc2 += _q4k_update(lo, hi, a0, a1, b0, b1, xj + xo2 * stride_xq, sj + xo2 * stride_xs, ROWS_T,
                                        UNPACK)
                if MR > 3:
                    acc3 += _q4k_update(lo, hi, a0, a1, b0, b1, xj + xo3 * stride_xq, sj + xo3 * stride_xs, ROWS_T,
                                        UNPACK)
        else:
            NW: tl.constexpr = 4 if FMT == 3 else 8  # code words per block
            for j in tl.static_range(G):
                dw, cw = _block_codes(words, j, BB, NW, UNPACK)
                lo = ()
                hi = ()
                for t in tl.static_range(NW):
                    if FMT == 3:
                        lo = lo + (cw[t] & _LO, )
                        hi = hi + (cw[t] & _HI, )
                    else:
                        lo = lo + (cw[t], )
                xj = xw_ptrs + 8 * j
                sj = xs_ptrs + 2 * j
                acc0 += _legacy_update(lo, hi, dw, xj, sj, FMT, ROWS_T, UNPACK)
                if MR > 1:
                    acc1 += _legacy_update(lo, hi, dw, xj + xo1 * stride_xq, sj + xo1 * stride_xs, FMT, ROWS_T, UNPACK)
                if MR > 2:
                    acc2 += _legacy_update(lo, hi, dw, xj + xo2 * stride_xq, sj + xo2 * stride_xs, FMT, ROWS_T, UNPACK)
                if MR > 3:
                    acc3 += _legacy_update(lo, hi, dw, xj + xo3 * stride_xq, sj + xo3 * stride_xs, FMT, ROWS_T, UNPACK)
        w_ptrs += GP * GW
        t_ptrs += GP * GW
        if PREFETCH:
            wa = na
            wb = nb
        xw_ptrs += GP * XB * 8
        xs_ptrs += GP * XB * 2
    pdl_trigger(PDL)
    rows2 = pid_n * BLOCK_N + rr * LPR + tl.arange(0, LPR)[:, None]
    _store_rows(_row_sums(acc0, LPR, GP, R), _row_sums(acc1, LPR, GP, R), _row_sums(acc2, LPR, GP, R),
                _row_sums(acc3, LPR, GP, R), rows2, Y, PART, COUNT, M, N, m0, pid_m, pid_k, split, stride_ys,
                stride_ym, LPR, R, MR, FIXUP)


@triton.jit
def i8_lane_base(b, h):
    """Where activation 32 b + 16 h (half h of block of 32 b) lies in i8 lane order, the layout
    gemv_i8_lanes_kernel reads; the next 15 follow it. Each group of 2048 activations (one step: 8 blocks of 256)
    stays in place as a whole; within it, element kt * 256 + c * 64 + p * 32 + j (block kt, chunk c, plane p,
    position j) goes to (2 p + j // 16) * 512 + (4 kt + c) * 16 + j % 16. A lane (kt, c) then reads its chunk's 64
    activations as four 16-byte pieces a = 0..3, and the 32 lanes' piece a lies in one 512-byte run."""
    r = b % 64  # block of 32 within its group of 2048: kt = r // 8, c = (r % 8) // 2, p = r % 2
    return (b - r) * 32 + ((r % 2) * 2 + h) * 512 + ((r // 8) * 4 + (r % 8) // 2) * 16


@triton.jit
def quantize_blocks(x):
    """Round x [NB, 2, 16] (float32, NB blocks of 32 as two halves) to int8 per block: (q as float32, d, s) with
    d = absmax / 127, q = round(x / d) half away from zero (0 where the block is all zero) and s = d * sum q. The
    engine's fused RMSNorm uses the same function, so its int8 activations are those of quantize_act."""
    amax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)
    d = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
    inv = tl.where(amax > 0, tl.math.div_rn(tl.full(amax.shape, 127.0, tl.float32), tl.where(amax > 0, amax, 1.0)),
                   0.0)
    v = x * inv[:, None, None]
    q = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v))
    return q, d, d * tl.sum(tl.sum(q, axis=2), axis=1)


@triton.jit
def quantize_act_kernel(X, X2, Q, DS, K, stride_x, stride_x2, stride_q, stride_ds, NBLK: tl.constexpr,
                        SILU: tl.constexpr, LANES: tl.constexpr = False, PDL: tl.constexpr = False):
    """Row pid(0), blocks pid(1) * NBLK ..: q = round(x / d) half away from zero with d = absmax / 127, and
    (d, d * sum q) per block of 32. SILU: x is silu(X) * X2, formed in float32. LANES: q in i8 lane order (16
    consecutive codes stay together, so the stores remain 16-byte vectors)."""
    pdl_wait(PDL)
    pdl_trigger(PDL)
    row = tl.program_id(0)
    b = tl.program_id(1) * NBLK + tl.arange(0, NBLK)
    ok = b < K // 32
    b3 = b[:, None, None]
    h3 = tl.arange(0, 2)[None, :, None]
    j3 = tl.arange(0, 16)[None, None, :]
    offs = b3 * 32 + h3 * 16 + j3
    ok3 = ok[:, None, None]
    x = tl.load(X + row * stride_x + offs, mask=ok3, other=0.0).to(tl.float32)
    if SILU:
        u = tl.load(X2 + row * stride_x2 + offs, mask=ok3, other=0.0).to(tl.float32)
        x = x / (1.0 + tl.exp(-x)) * u
    q, d, s = quantize_blocks(x)
    tl.store(Q + row * stride_q + (i8_lane_base(b3, h3) + j3 if LANES else offs), q.to(tl.int8), mask=ok3)
    tl.store(DS + row * stride_ds + b * 2, d, mask=ok)
    tl.store(DS + row * stride_ds + b * 2 + 1, s, mask=ok)


def quantize_act(x: torch.Tensor, x2: torch.Tensor | None = None, lanes: bool = False):
    """(q int8 [M, K], ds float32 [M, K / 32, 2]) for x [M, K] (or silu(x) * x2) with K % 32 == 0 and the last
    dim contiguous (see the module docstring). ``lanes``: q in i8 lane order, [M, m1.lanes_width(K)] (the tail past
    K is never written nor read)."""
    from .._runtime import empty

    M, K = x.shape
    q = empty(M, lanes_width(K) if lanes else K, dtype=torch.int8, device=x.device)
    ds = empty(M, K // 32, 2, dtype=torch.float32, device=x.device)
    nblk = 32
    pdl = pdl_supported(x.device)
    quantize_act_kernel[(M, triton.cdiv(K // 32, nblk))](
        x, x2 if x2 is not None else x, q, ds, K, x.stride(0), x2.stride(0) if x2 is not None else 0, q.stride(0),
        ds.stride(0), NBLK=nblk, SILU=x2 is not None, LANES=lanes, PDL=pdl, num_warps=4, **pdl_options(pdl))
    return q, ds


@triton.jit
def gemv_i8_lanes_kernel(XQ, XS, W32, Y, PART, COUNT, N, stride_ys, row_words, nblocks, blocks_per_split, split,
                         R: tl.constexpr, WARPS: tl.constexpr, UNPACK: tl.constexpr, FIXUP: tl.constexpr,
                         EVEN: tl.constexpr, Q5: tl.constexpr = False, PDL: tl.constexpr = False):
    """y[n] (+)= sum over this program's K split of x' . w[n] for q4_k (or with Q5, q5_k) weights and one activation
    row x', given as int8 words XQ in i8 lane order (i8_lane_base) and per-block (d, s) in XS, for BLOCK_N = WARPS * R
    rows.

    Thread t of the program: warp g = t // 32, lane (kt, c) = ((t // 4) % 8, t % 4). A step covers 8 super-blocks:
    lane (kt, c) takes chunk c (32 code bytes: sub-block 2c in the low nibbles, 2c + 1 in the high ones) of block
    kt of rows g, g + WARPS, ... (R of them), so a warp reads 8 whole consecutive blocks of each of its rows. The
    code words are masked in place (low nibbles q, high nibbles 16 q) and multiplied with the int8 activations by
    dp4a into one int32 sum per sub-block; then, with the block's d, dmin and 6-bit (scale, min),
    sum_j w_j x'_j = d sc0 dx0 S_lo + d sc1 dx1 S_hi / 16 - dmin (mn0 s0 + mn1 s1).

    q5_k (Q5): 176-byte blocks (44 words: header, qh[32] in words 4-11, then q4_k's 128 code bytes), 16-byte aligned
    like q4_k's. The fifth bit of the lane's weights l (low plane) and 32 + l (high) is bit 2c (2c + 1) of qh[l], so
    each lane also loads all 32 qh bytes and masks them in place with 0x01010101 << 2c (0x02020202 << 2c); one more
    dp4a per plane and word sums them with the activations as H_lo 4^c (H_hi 2 4^c), which the float epilogue adds
    as 16 H_lo and 256 H_hi / 16: 8 integer instructions per 8 weights against q4_k's 4.

    Splits are whole steps (blocks_per_split a multiple of 8), so each starts on a lane-order group. Unless EVEN
    (every block of every step exists), blocks past the split's end load as zeros (d = dmin = 0, codes 0). Rows past
    N read row N - 1, never stored. The sums are stored by m1._store_rows (FIXUP: split-K partials summed in the
    kernel). PDL: wait first, let the next kernel launch after the loop."""
    T: tl.constexpr = 32 * WARPS
    BLOCK_N: tl.constexpr = WARPS * R
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pdl_wait(PDL)
    t = tl.arange(0, T)[:, None]  # [T, 1]
    kt = (t // 4) % 8
    c = t % 4
    rows = tl.minimum(pid_n * BLOCK_N + tl.arange(0, R)[None, :] * WARPS + t // 32, N - 1).to(tl.int64)  # [T, R]
    kb_start = pid_k * blocks_per_split
    kb_end = tl.minimum(kb_start + blocks_per_split, nblocks)
    BW: tl.constexpr = 44 if Q5 else 36  # words per block: d|dmin, 3 words of scales, (q5_k: 8 of qh,) 32 of codes
    base = rows * row_words + (kb_start + kt) * BW
    a2 = tl.arange(0, 2)[None, None, :, None]
    w4 = tl.arange(0, 4)[None, None, None, :]
    # 8 code words as two 16-byte vectors [T, R, 2, 4] (q5_k: the 8 qh words too); the header as one [T, R, 4]
    w_ptrs = W32 + (base + BW - 32 + c * 8)[:, :, None, None] + a2 * 4 + w4
    qh_ptrs = W32 + (base + 4)[:, :, None, None] + a2 * 4 + w4
    m_lo = 0x01010101 << (2 * c)  # q5_k: the lane's fifth bits in place, [T, 1]
    m_hi = m_lo << 1
    f_lo = 16.0 / (1 << (2 * c)).to(tl.float32)  # and their weight 16 / 4^c
    h_ptrs = W32 + base[:, :, None] + tl.arange(0, 4)[None, None, :]
    # activations with the row axis of size 1 (shared by the R rows): the low plane's words [T, 1, 2, 4] (pieces
    # a = 0, 1; the high plane's 256 words further), (d, s) of sub-blocks 2c and 2c + 1 [T, 1, 4]
    x_ptrs = XQ + (kb_start // 8) * 512 + a2 * 128 + ((kt * 4 + c) * 4)[:, :, None, None] + w4
    s_ptrs = XS + (((kb_start + kt) * 8 + 2 * c) * 2)[:, :, None] + tl.arange(0, 4)[None, None, :]
    acc = tl.zeros([T, R], dtype=tl.float32)
    for kb in range(kb_start, kb_end, 8):
        ok = kb + kt < kb_end  # [T, 1]; used only unless EVEN
        cw = _scalars(_load(w_ptrs, ok[:, :, None, None], not EVEN), T, R, 8, 3)
        hw = _scalars(_load(h_ptrs, ok[:, :, None], not EVEN), T, R, 4, 2)
        xl = _scalars(_load(x_ptrs, ok[:, :, None, None], not EVEN), T, 1, 8, 3)
        xh = _scalars(_load(x_ptrs + 256, ok[:, :, None, None], not EVEN), T, 1, 8, 3)
        dsv = _scalars(_load(s_ptrs, ok[:, :, None], not EVEN), T, 1, 4, 2)
        zero = cw[0] * 0
        s_lo = _dp4a(cw[0] & _LO, xl[0], zero, True, UNPACK)
        s_hi = _dp4a(cw[0] & _HI, xh[0], zero, True, UNPACK)
        for i in tl.static_range(1, 8):
            s_lo = _dp4a(cw[i] & _LO, xl[i], s_lo, True, UNPACK)
            s_hi = _dp4a(cw[i] & _HI, xh[i], s_hi, True, UNPACK)
        v_lo = s_lo.to(tl.float32)
        v_hi = s_hi.to(tl.float32)
        if Q5:
            qw = _scalars(_load(qh_ptrs, ok[:, :, None, None], not EVEN), T, R, 8, 3)
            h_lo = _dp4a(qw[0] & m_lo, xl[0], zero, True, UNPACK)
            h_hi = _dp4a(qw[0] & m_hi, xh[0], zero, True, UNPACK)
            for i in tl.static_range(1, 8):
                h_lo = _dp4a(qw[i] & m_lo, xl[i], h_lo, True, UNPACK)
                h_hi = _dp4a(qw[i] & m_hi, xh[i], h_hi, True, UNPACK)
            v_lo += f_lo * h_lo.to(tl.float32)
            v_hi += (8.0 * f_lo) * h_hi.to(tl.float32)
        d, dmin = _split_words(hw[0], tl.float16)
        sc0, mn0, sc1, mn1 = _q4k_scales(hw[1], hw[2], hw[3], c)
        acc += d * (sc0 * dsv[0] * v_lo + sc1 * (dsv[2] * 0.0625) * v_hi) - dmin * (mn0 * dsv[1] + mn1 * dsv[3])
        w_ptrs += 8 * BW
        h_ptrs += 8 * BW
        qh_ptrs += 8 * BW
        x_ptrs += 512
        s_ptrs += 128
    pdl_trigger(PDL)
    s = tl.sum(tl.reshape(acc, [WARPS, 32, R]), axis=1)  # [WARPS, R]: row g + r * WARPS
    rows2 = pid_n * BLOCK_N + tl.arange(0, R)[None, :] * WARPS + tl.arange(0, WARPS)[:, None]
    _store_rows(s, s, s, s, rows2, Y, PART, COUNT, 1, N, 0, 0, pid_k, split, stride_ys, 0, WARPS, R, 1, FIXUP)


# q6_k codes of a word of low nibbles ($2) and the qh word pair ($3, $4) shifted right by $5 (bits 2 j of each byte
# down to bit 0, and for an odd block the half-word realignment): q = those bits & 0x33333333, then
# lo = (nibbles & 0x0F0F0F0F) | (q << 4 & 0xF0F0F0F0) and hi = (nibbles >> 4 & 0x0F0F0F0F) | (q & 0xF0F0F0F0), each
# one LOP3 ((a & c) | (b & ~c): LUT 0xE4). Written out because the compiler merges the masks into two per plane.
_ASM_Q6_CODES = tl.constexpr(
    "{ .reg .b32 q, t; shf.r.wrap.b32 q, $3, $4, $5; and.b32 q, q, 0x33333333; shl.b32 t, q, 4; "
    "lop3.b32 $0, $2, t, 0x0F0F0F0F, 0xE4; shr.b32 t, $2, 4; lop3.b32 $1, t, q, 0x0F0F0F0F, 0xE4; }")


@triton.jit
def _q6_codes(ql, h0, h1, sh, UNPACK: tl.constexpr):
    """(low-plane codes, high-plane codes) of q6_k, 4 bytes each (values 0..63), from a word of ql and the qh word
    pair (h0, h1) whose 64 bits shifted right by sh hold the 2-bit fields at bits 0-1 (low plane) and 4-5 (high)."""
    if UNPACK == 2:
        return tl.inline_asm_elementwise(_ASM_Q6_CODES, "=r,=r,r,r,r,r", [ql, h0, h1, sh],
                                         dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        q = _shr64(h0, h1, sh, UNPACK) & 0x33333333
        return (ql & _LO) | ((q << 4) & 0x30303030), ((ql >> 4) & _LO) | (q & 0x30303030)


@triton.jit
def _shr64(lo, hi, s, UNPACK: tl.constexpr):
    """The low word of the 64-bit (hi:lo) shifted right by s (0..31): a funnel shift, one SHF on the GPU."""
    if UNPACK == 2:
        return tl.inline_asm_elementwise("shf.r.wrap.b32 $0, $1, $2, $3;", "=r,r,r,r", [lo, hi, s], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        v = (hi.to(tl.int64) << 32) | (lo.to(tl.int64) & 0xFFFFFFFF)
        return (v >> s.to(tl.int64)).to(tl.int32)


@triton.jit
def _vec_words(ptrs, NV: tl.constexpr, A: tl.constexpr, B: tl.constexpr):
    """NV consecutive 16-byte vectors from 16-byte aligned int32 pointers [A, B, 4], as a tuple of 4 NV words [A, B]."""
    w = ()
    for v in tl.static_range(NV):
        w = w + _scalars(tl.load(ptrs + 4 * v), A, B, 4, 2)
    return w


@triton.jit
def gemv_i8_q6_kernel(XQ, XS, W32, Y, PART, COUNT, N, stride_ys, row_bytes, nblocks, blocks_per_split, split,
                      R: tl.constexpr, WARPS: tl.constexpr, KT: tl.constexpr, UNPACK: tl.constexpr,
                      FIXUP: tl.constexpr, PDL: tl.constexpr = False):
    """y[n] (+)= sum over this program's K split of x' . w[n] for q6_k weights and one activation row x' in i8 lane
    order (i8_lane_base), like gemv_i8_lanes_kernel, for BLOCK_N = WARPS (8 / KT) R rows.

    q6_k blocks are 210 bytes (ql[128] low nibbles, qh[64] two high bits each, 16 int8 scales, fp16 d): with rows
    16-byte aligned (K a multiple of 2048) block b of a step of 8 starts 2 b bytes past a 16-byte boundary. Thread t:
    part (n, j) = ((t // 2) % 2, t % 2), lane along K kt = (t // 4) % KT, row t // (4 KT) (of each of R row sets).
    Part (n, j) is chunk cc = 2 n + j of a block: ql bytes 32 cc .. 32 cc + 31 (low nibbles: weights 128 n + 32 j + l,
    high nibbles + 64) and qh bytes 128 + 32 n + l (bits 2 j, 2 j + 1 for the low nibbles, 2 j + 4, 2 j + 5 for the
    high ones). The thread takes blocks b = KT p + kt of each step, p = 0 .. 8 / KT - 1 unrolled, so the shift of
    block b's bytes within its aligned 16-byte vectors is 4 p + 2 kt bytes (KT 2) or 8 p + 2 kt (KT 4): words p or
    2 p (static), for KT 4 one more word where kt >= 2 (a select per word), then half a word where b is odd (a funnel
    shift; for qh the same shift also brings bits 2 j down). KT 4 means more warps for the same rows (lanes along
    K, as in gemv_i8_lanes_kernel) at the cost of the selects. (KT 1, a thread walking all 8 blocks with static
    shifts, measured slower on every shape: too few warps; bench/NOTES.md.)
    Codes c = nibble + 16 h (0..63) go through dp4a with the int8 activations into one int32 sum per 16-weight scale
    group; with w = d sc (c - 32), sum_g w x' = d dx (sc0 S0 + sc1 S1 - 32 (sc0 - sc1) X0) - 32 d sc1 s per 32-block
    (X0: sum q over its first half, s = dx sum q from ds). The 4 KT threads of a row are summed at the end; rows
    past N read row N - 1, never stored. Splits are whole steps, so every loaded byte exists."""
    T: tl.constexpr = 32 * WARPS
    LPR: tl.constexpr = T // (4 * KT)  # rows per row set
    BLOCK_N: tl.constexpr = LPR * R
    NP: tl.constexpr = 8 // KT
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pdl_wait(PDL)
    t = tl.arange(0, T)[:, None]  # [T, 1]
    n = (t // 2) % 2
    j = t % 2
    kt = (t // 4) % KT
    rows = tl.minimum(pid_n * BLOCK_N + tl.arange(0, R)[None, :] * LPR + t // (4 * KT), N - 1).to(tl.int64)
    kb_start = pid_k * blocks_per_split
    kb_end = tl.minimum(kb_start + blocks_per_split, nblocks)
    first = rows * row_bytes + kb_start * 210  # the split's first byte in each row: 16-byte aligned
    w4 = tl.arange(0, 4)[None, None, :]
    row_w = tl.multiple_of(first // 4 + 52 * kt, [4, 4])
    # 16-byte vectors holding block kt's ql chunk (from word 8 cc) and qh bytes (from word 32 + 8 n); block b's are
    # 13 b vectors (52 words) further
    ql_ptrs = W32 + (row_w + 8 * (2 * n + j))[:, :, None] + w4
    qh_ptrs = W32 + (row_w + 32 + 8 * n)[:, :, None] + w4
    # scale pairs as int16 (2-byte aligned): bytes 192 + 8 n + 2 j (low nibbles' groups), + 4 (high nibbles'); d
    sc_ptrs = W32.to(tl.pointer_type(tl.int16), bitcast=True) + first // 2 + 105 * kt + 96 + 4 * n + j
    d_ptrs = W32.to(tl.pointer_type(tl.int16), bitcast=True) + first // 2 + 105 * kt + 104
    # activations [T, 1, 4] (shared by the R rows): 32-block 4 n + j of block b (its halves 128 words apart), the
    # high nibbles' block 4 n + j + 2 4 words on; (d, s) pairs [T, 1, 2]
    x_ptrs = XQ + (kb_start // 8) * 512 + (2 * j * 128 + 8 * n + 16 * kt)[:, :, None] + w4
    s_ptrs = XS + ((kb_start * 8 + 8 * kt + 4 * n + j) * 2)[:, :, None] + tl.arange(0, 2)[None, None, :]
    half = (kt % 2) * 16  # KT 2 and 4: the half-word shift of an odd block (b and kt have one parity)
    far = (kt // 2) > 0  # KT 4: one more word
    ones = tl.full([T, 1], 0x01010101, tl.int32)
    acc = tl.zeros([T, R], dtype=tl.float32)
    for kb in range(kb_start, kb_end, 8):
        for p in tl.static_range(NP):
            # the block's bytes start at word (KT p) // 2 (+ 1 where far, KT 4) (+ half a word for an odd block) of
            # its 3 aligned vectors
            lw = _vec_words(ql_ptrs + 52 * KT * p, 3, T, R)
            hw = _vec_words(qh_ptrs + 52 * KT * p, 3, T, R)
            la = ()
            ha = ()
            for i in tl.static_range(9):
                if KT == 4:
                    la = la + (tl.where(far, lw[(KT * p) // 2 + i + 1], lw[(KT * p) // 2 + i]), )
                    ha = ha + (tl.where(far, hw[(KT * p) // 2 + i + 1], hw[(KT * p) // 2 + i]), )
                else:
                    la = la + (lw[(KT * p) // 2 + i], )
                    ha = ha + (hw[(KT * p) // 2 + i], )
            xl0 = _scalars(tl.load(x_ptrs + 16 * KT * p), T, 1, 4, 2)
            xl1 = _scalars(tl.load(x_ptrs + 16 * KT * p + 128), T, 1, 4, 2)
            xh0 = _scalars(tl.load(x_ptrs + 16 * KT * p + 4), T, 1, 4, 2)
            xh1 = _scalars(tl.load(x_ptrs + 16 * KT * p + 132), T, 1, 4, 2)
            dl, sl = _scalars(tl.load(s_ptrs + 16 * KT * p), T, 1, 2, 1)
            dh, s_h = _scalars(tl.load(s_ptrs + 16 * KT * p + 4), T, 1, 2, 1)
            scl = tl.load(sc_ptrs + 105 * KT * p).to(tl.int32)  # sign-extended: low byte sc0, (>> 8) sc1
            sch = tl.load(sc_ptrs + 105 * KT * p + 2).to(tl.int32)
            d = tl.load(d_ptrs + 105 * KT * p).to(tl.float16, bitcast=True).to(tl.float32)
            sh = half + 2 * j  # qh: the half-word shift and bits 2 j down to bit 0
            zero = scl * 0
            s_lo0 = zero
            s_lo1 = zero
            s_hi0 = zero
            s_hi1 = zero
            for i in tl.static_range(8):
                ql = _shr64(la[i], la[i + 1], half, UNPACK)
                lo, hi = _q6_codes(ql, ha[i], ha[i + 1], sh, UNPACK)
                if i < 4:
                    s_lo0 = _dp4a(lo, xl0[i], s_lo0, True, UNPACK)
                    s_hi0 = _dp4a(hi, xh0[i], s_hi0, True, UNPACK)
                else:
                    s_lo1 = _dp4a(lo, xl1[i - 4], s_lo1, True, UNPACK)
                    s_hi1 = _dp4a(hi, xh1[i - 4], s_hi1, True, UNPACK)
            x_lo = _dp4a(ones, xl0[0], ones * 0, True, UNPACK)
            x_hi = _dp4a(ones, xh0[0], ones * 0, True, UNPACK)
            for i in tl.static_range(1, 4):
                x_lo = _dp4a(ones, xl0[i], x_lo, True, UNPACK)
                x_hi = _dp4a(ones, xh0[i], x_hi, True, UNPACK)
            a0 = (scl << 24) >> 24
            a1 = scl >> 8
            b0 = (sch << 24) >> 24
            b1 = sch >> 8
            v_lo = a0 * s_lo0 + a1 * s_lo1 - 32 * (a0 - a1) * x_lo
            v_hi = b0 * s_hi0 + b1 * s_hi1 - 32 * (b0 - b1) * x_hi
            acc += d * (dl * v_lo.to(tl.float32) + dh * v_hi.to(tl.float32)
                        - 32.0 * (a1.to(tl.float32) * sl + b1.to(tl.float32) * s_h))
        ql_ptrs += 420  # 8 blocks: 1680 bytes
        qh_ptrs += 420
        sc_ptrs += 840
        d_ptrs += 840
        x_ptrs += 512
        s_ptrs += 128
    pdl_trigger(PDL)
    s = tl.sum(tl.reshape(acc, [LPR, 4 * KT, R]), axis=1)  # [LPR, R]: row rr + r * LPR
    rows2 = pid_n * BLOCK_N + tl.arange(0, R)[None, :] * LPR + tl.arange(0, LPR)[:, None]
    _store_rows(s, s, s, s, rows2, Y, PART, COUNT, 1, N, 0, 0, pid_k, split, stride_ys, 0, LPR, R, 1, FIXUP)


def i8_lanes_supports(data, fmt: str, K: int) -> bool:
    """Whether the int8 lane kernels can read these weights: q4_k or q5_k with K a multiple of 256
    (gemv_i8_lanes_kernel) or q6_k with K a multiple of 2048 (gemv_i8_q6_kernel: rows and steps 16-byte aligned),
    contiguous 16-byte aligned data (their loads are 16-byte vectors)."""
    if fmt not in ("q4_k", "q5_k", "q6_k") or K % (2048 if fmt == "q6_k" else 256):
        return False
    return data.data_ptr() % 16 == 0 and data.is_contiguous()


def launch_i8_lanes(xq, ds, data, N: int, K: int, config, sms: int, asm: bool, out_dtype, fixup: bool = True,
                    pdl: bool = False, fmt: str = "q4_k"):
    """Run gemv_i8_lanes_kernel (``fmt`` q4_k or q5_k) or gemv_i8_q6_kernel (q6_k) for one activation row (xq [1,
    lanes_width(K)] int8 in i8 lane order, ds [1, K / 32, 2]); returns y [split, 1, N] like m1.launch_m1 (y [1, 1, N]
    in out_dtype when the kernel sums its split-K partials). ``config`` is (R, num_warps, waves, num_stages[, KT]): R
    rows per thread (q4_k, q5_k: per warp; q6_k: per 4 KT threads, KT = 2 or 4 lanes along K, default 4), K split
    until the grid has ``waves`` programs per SM."""

    reps, warps, waves, stages = config[:4]
    kt = config[4] if len(config) > 4 else 4  # q6_k: lanes along K
    nblocks = K // 256
    block_n = warps * reps * (8 // kt if fmt == "q6_k" else 1)
    programs_n = triton.cdiv(N, block_n)
    split, per_split = split_k(programs_n, nblocks, 8, sms, waves)
    y, part, counters = split_outputs(1, out_dtype, xq.device, N, split, programs_n, fixup)
    args = (xq.view(torch.int32), ds, data.view(torch.int32), y, part, counters if counters is not None else y, N,
            y.stride(0))
    row_bytes = data.shape[-1] * data.element_size()
    common = dict(R=reps, WARPS=warps, UNPACK=2 if asm else 1, FIXUP=counters is not None, PDL=pdl, num_warps=warps,
                  num_stages=stages, **pdl_options(pdl))
    if fmt == "q6_k":
        if kt not in (2, 4):
            raise ValueError(f"config: q6_k takes 2 or 4 lanes along K, got {tuple(config)}")
        gemv_i8_q6_kernel[(programs_n, split)](*args, row_bytes, nblocks, per_split, split, KT=kt, **common)
    else:
        gemv_i8_lanes_kernel[(programs_n, split)](*args, row_bytes // 4, nblocks, per_split, split,
                                                  EVEN=nblocks % 8 == 0, Q5=fmt == "q5_k", **common)
    return y


def i8_layout(fmt: str):
    """(FMT id, block bytes, G, VW, NV) of a format the int8 kernel reads, or None."""
    if fmt not in I8_FORMATS:
        return None
    fid, bb, G = I8_FORMATS[fmt]
    gb = G * bb  # 144 (q4_0, q4_k) or 272 (q8_0) bytes per step: NV + 1 vectors of 16 bytes
    vw = 4
    nv = gb // 16 - 1
    return fid, bb, G, vw, nv


def i8_supports(data, fmt: str, K: int) -> bool:
    """Whether gemv_i8_kernel can read these weights: q4_0, q8_0 or q4_k, K a multiple of 256 (each step's bytes
    are 16-byte aligned) and contiguous 16-byte aligned data."""
    return fmt in I8_FORMATS and K % 256 == 0 and data.data_ptr() % 16 == 0 and data.is_contiguous()


def launch_i8(xq, ds, data, fmt: str, N: int, K: int, config, sms: int, asm: bool, out_dtype, waves: int = 4,
              fixup: bool = True, rows_per_program: int = 2, return_kernel: bool = False):
    """Run gemv_i8_kernel for quantized activations (xq, ds) and q4_0/q8_0/q4_k weights; returns y [split, M, N]
    like m1.launch_m1 (y [1, M, N] in out_dtype when the kernel sums its split-K partials). ``config`` is
    (R, GP, num_warps, num_stages[, COAL, PREFETCH]): R row sets per thread, up to GP consecutive groups of a row
    across threads (the largest power of two <= GP that divides the row's group count); COAL and PREFETCH (0 or 1,
    default 0) as in gemv_i8_kernel."""

    reps, gp_max, warps, stages = config[:4]
    coal, prefetch = (config[4], config[5]) if len(config) > 4 else (0, 0)
    fid, bb, G, vw, nv = i8_layout(fmt)
    rows_t = 32 * warps
    ngroups = K // (32 * G) if fid != 10 else K // 256
    gp = 1
    while gp * 2 <= min(gp_max, rows_t) and ngroups % (gp * 2) == 0:
        gp *= 2
    block_n = rows_t // gp * reps
    row_words = data.shape[-1] * data.element_size() // 4
    programs_n = triton.cdiv(N, block_n)
    M = xq.shape[0]
    mr = max(1, min(4 if M == 3 else M, rows_per_program, 4))
    grid_m = triton.cdiv(M, mr)
    # splits of whole steps (GP groups), so every program's range is a multiple of GP
    split, per_split = split_k(programs_n * grid_m, ngroups, gp, sms, waves if programs_n * grid_m < 2 * sms else 0)
    y, part, counters = split_outputs(M, out_dtype, xq.device, N, split, programs_n * grid_m, fixup)
    main = nv * vw
    pdl = pdl_supported(xq.device)
    kernel = gemv_i8_kernel[(programs_n, split, grid_m)](
        xq.view(torch.int32), ds, data.view(torch.int32), y, part, counters if counters is not None else y, M, N,
        xq.stride(0) // 4, ds.stride(0), y.stride(0), y.stride(1), row_words, ngroups, per_split, split,
        FMT=fid, BB=bb, G=G, VW=vw, NV=nv, LOG_MAIN=main.bit_length() - 1, LOG_VW=vw.bit_length() - 1,
        ROWS_T=rows_t, R=reps, GP=gp, MR=mr, UNPACK=2 if asm else 1, FIXUP=counters is not None, COAL=coal,
        PREFETCH=prefetch, PDL=pdl, num_warps=warps, num_stages=stages, **pdl_options(pdl))
    return (y, kernel) if return_kernel else y
