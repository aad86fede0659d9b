"""Batch-1 GEMV for q4_0, q8_0 and q4_k with the block scales factored out of the inner products.

For a block (or q4_k sub-block) of 32 weights w_j = a * q_j + b (a, b per block), the dot product with x is
a * sum_j q_j x_j + b * sum_j x_j. The inner loop therefore only turns each code q into a float and multiplies it
with x: the scales are applied once per block and row, and sum_j x_j does not depend on the row.

Turning a 4-bit code into a float costs two integer instructions: shift the nibble to bits 19-22 and OR the bits of
1.0 into it, which gives the float 1 + q/16 exactly. So the kernel computes s = sum_j (1 + q_j/16) x_j and recovers
sum_j q_j x_j = 16 (s - sum_j x_j). (8-bit codes: 1 + b/256 with b = q + 128, the int8 byte with its sign bit flipped.)
On the GPU the unpacking can also run as inline PTX on four packed bytes at a time (UNPACK=2), which skips the
per-byte extraction that the compiler otherwise emits; the interpreter uses the Triton expression (UNPACK=1).
"""
import triton
import triton.language as tl

from .planes import _scale_min_q4k


def _asm_unpack(shifts, mask: int, magic: int, lut: int) -> str:
    """PTX turning the 4 bytes of $4 into 4 floats: output k = lop3(byte k's field shifted to the mantissa, mask,
    magic). One shift and one LOP3 per value (the magic lives in a register: LOP3 takes one immediate)."""
    body = [f"mov.b32 m, {magic:#x};"]
    for k, sh in enumerate(shifts):
        op = f"shl.b32 t, $4, {sh};" if sh > 0 else (f"shr.b32 t, $4, {-sh};" if sh < 0 else "mov.b32 t, $4;")
        body.append(f"{op} lop3.b32 ${k}, t, {mask:#x}, m, {lut:#x};")
    return "{ .reg .b32 t, m; " + " ".join(body) + " }"


# nibbles to 1 + q/16: the nibble to bits 19-22, OR 1.0f ((a & b) | c = LUT 0xEA)
_ASM_LO = tl.constexpr(_asm_unpack((19, 11, 3, -5), 0x780000, 0x3F800000, 0xEA))
_ASM_HI = tl.constexpr(_asm_unpack((15, 7, -1, -9), 0x780000, 0x3F800000, 0xEA))
# int8 q to 1 + (q + 128)/256: the byte to bits 15-22, flip its sign bit and OR 1.0f in one go: the mask and 1.0f
# do not overlap, so (a & b) ^ (1.0f | 0x400000) (LUT 0x6A) does both
_ASM_Q8 = tl.constexpr(_asm_unpack((15, 7, -1, -9), 0x7F8000, 0x3FC00000, 0x6A))


@triton.jit
def _unpack(units, p: tl.constexpr, FMT: tl.constexpr, UNPACK: tl.constexpr):
    """Codes of plane p of the uint8 tile ``units`` as floats: 1 + q/16 for nibbles, 1 + b/256 for bytes."""
    if UNPACK == 2:  # four bytes per 32-bit register in, four floats out
        if FMT == 7:
            return tl.inline_asm_elementwise(_ASM_Q8, "=r,=r,=r,=r,r", [units], dtype=tl.float32, is_pure=True,
                                             pack=4)
        elif p == 0:
            return tl.inline_asm_elementwise(_ASM_LO, "=r,=r,=r,=r,r", [units], dtype=tl.float32, is_pure=True,
                                             pack=4)
        else:
            return tl.inline_asm_elementwise(_ASM_HI, "=r,=r,=r,=r,r", [units], dtype=tl.float32, is_pure=True,
                                             pack=4)
    else:
        v = units.to(tl.int32)
        if FMT == 7:
            bits = ((v ^ 0x80) << 15) | 0x3F800000  # int8 q as the unsigned byte q + 128
        else:
            bits = ((v << (19 - 4 * p)) & 0x780000) | 0x3F800000
        return bits.to(tl.float32, bitcast=True)


@triton.jit
def _plane_dot(units, p: tl.constexpr, X, kx, ok, FMT: tl.constexpr, UNPACK: tl.constexpr):
    """(sum of code' * x, sum of x) over a block's bytes (axes 4 and 5) for plane p; code' = 1 + q/16 (or 1 + b/256).
    x comes in through pointers of shape [C, ROWS_T, NB, 1, U1, 8]; the sums are [C, ROWS_T, NB, R] and
    [C, ROWS_T, NB, 1]."""
    xv = tl.load(X + kx, mask=ok, other=0.0).to(tl.float32)
    s = tl.sum(tl.sum(_unpack(units, p, FMT, UNPACK) * xv, axis=5), axis=4)
    return s, tl.sum(tl.sum(xv, axis=5), axis=4)


@triton.jit
def gemv_m1_kernel(X, W8, W16, Y, N, K, stride_xm, stride_ys, stride_ym, row_bytes, nblocks, blocks_per_split,
                   FMT: tl.constexpr, NB: tl.constexpr, C: tl.constexpr, U: tl.constexpr, P: tl.constexpr,
                   BS: tl.constexpr, BLOCK_BYTES: tl.constexpr, ROWS_T: tl.constexpr, R: tl.constexpr,
                   UNPACK: tl.constexpr):
    """y[m, n] (+)= sum over this program's K split of x[m] . w[n] for BLOCK_N = ROWS_T * R rows.

    The bytes of a step form a tile [C, ROWS_T, NB, R, U // 8, 8] (C chunks of U bytes per block). Triton's layout
    for it keeps the innermost 8 bytes in one thread (one 8-byte load) and spreads the threads over C and ROWS_T
    (choose ROWS_T = 32 // C * num_warps); NB, R and U // 8 stay in the thread. The activations come through
    pointers [C, ROWS_T, NB, 1, U // 8, 8] (the row axis broadcast), which get the same layout: each thread
    converts its activations once for its R rows, and the sums over a block never leave the thread."""
    BLOCK_N: tl.constexpr = ROWS_T * R
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)  # one activation row per program along the third grid axis (M <= a few)
    X += pid_m * stride_xm
    Y += pid_m * stride_ym
    rt = tl.arange(0, ROWS_T)[None, :, None, None]
    rr = tl.arange(0, R)[None, None, None, :]
    rows4 = pid_n * BLOCK_N + rr * ROWS_T + rt  # [1, ROWS_T, 1, R]
    row_ok4 = rows4 < N
    rows4 = rows4.to(tl.int64)
    kb_start = pid_k * blocks_per_split
    kb_end = tl.minimum(kb_start + blocks_per_split, nblocks)
    c4 = tl.arange(0, C)[:, None, None, None]
    c = c4[:, :, :, :, None, None]
    zt = (rt * 0)[:, :, :, :, None, None]  # [1, ROWS_T, 1, 1, 1, 1] zeros: gives x the rows' thread layout
    u = tl.arange(0, U // 8)[None, None, None, None, :, None] * 8 + tl.arange(0, 8)[None, None, None, None, None, :]
    if FMT == 10:  # q4_k: d, dmin, 12 bytes of scales, C = 4 chunks of 32 bytes
        uoff = 16 + c * 32 + u
    else:  # q4_0 / q8_0: d, then the codes
        uoff = 2 + u + c * 0
    acc = tl.zeros([C, ROWS_T, NB, R], dtype=tl.float32)
    for kb in range(kb_start, kb_end, NB):
        blk = kb + tl.arange(0, NB)
        b4 = blk[None, None, :, None]
        blk_ok4 = (b4 < kb_end) & (c4 >= 0)  # blocks below kb_end lie inside K
        ok4 = row_ok4 & blk_ok4
        base4 = rows4 * row_bytes + b4 * BLOCK_BYTES  # [1, ROWS_T, NB, R]
        xk = (b4 * BS)[:, :, :, :, None, None] + zt  # [1, ROWS_T, NB, 1, 1, 1]
        x_ok = blk_ok4[:, :, :, :, None, None] & (zt == 0)
        units = tl.load(W8 + base4[:, :, :, :, None, None] + uoff, mask=ok4[:, :, :, :, None, None], other=0)
        if FMT == 10:
            s0, sx0 = _plane_dot(units, 0, X, xk + c * 64 + u, x_ok, FMT, UNPACK)
            s1, sx1 = _plane_dot(units, 1, X, xk + c * 64 + 32 + u, x_ok, FMT, UNPACK)
        elif FMT == 3:  # q4_0: low nibbles are weights 0-15, high nibbles 16-31
            s0, sx0 = _plane_dot(units, 0, X, xk + u + c * 0, x_ok, FMT, UNPACK)
            s1, sx1 = _plane_dot(units, 1, X, xk + 16 + u + c * 0, x_ok, FMT, UNPACK)
        else:  # q8_0
            s0, sx0 = _plane_dot(units, 0, X, xk + u + c * 0, x_ok, FMT, UNPACK)
        d = tl.load(W16 + base4 // 2, mask=ok4, other=0.0).to(tl.float32)
        if FMT == 10:  # w = d*sc*q - dmin*mn per sub-block; sum q x = 16 (s - sx)
            dmin = tl.load(W16 + base4 // 2 + 1, mask=ok4, other=0.0).to(tl.float32)
            sc, mn = _scale_min_q4k(W8, base4, c4, 0, ok4)
            acc += (16.0 * d * sc) * (s0 - sx0) - (dmin * mn) * sx0
            sc, mn = _scale_min_q4k(W8, base4, c4, 1, ok4)
            acc += (16.0 * d * sc) * (s1 - sx1) - (dmin * mn) * sx1
        elif FMT == 3:  # w = d * (q - 8):  sum q x - 8 sum x = 16 s - 24 sx
            acc += d * (16.0 * (s0 + s1) - 24.0 * (sx0 + sx1))
        else:  # w = d * (b - 128):  sum b x - 128 sum x = 256 s - 384 sx
            acc += d * (256.0 * s0 - 384.0 * sx0)
    out = tl.sum(tl.sum(acc, axis=2), axis=0)  # [ROWS_T, R]
    rows2 = pid_n * BLOCK_N + tl.arange(0, R)[None, :] * ROWS_T + tl.arange(0, ROWS_T)[:, None]
    tl.store(Y + pid_k * stride_ys + rows2, out.to(Y.dtype.element_ty), mask=rows2 < N)


M1_LAYOUTS = {  # format -> (FMT id, C, U, P, block size, block bytes)
    "q4_0": (3, 1, 16, 2, 32, 18),
    "q8_0": (7, 1, 32, 1, 32, 34),
    "q4_k": (10, 4, 32, 2, 256, 144),
}


def launch_m1(x, data, fmt: str, N: int, K: int, config, sms: int, unpack: int, return_kernel: bool = False,
              waves: int = 2):
    """Run gemv_m1_kernel for x [M, K] and a GGUF weight buffer; returns y [split, M, N] (float32 partials when
    split > 1), and with return_kernel the compiled kernel too. ``config`` is (R, NB, num_warps, num_stages) with R
    rows per thread; K is split until the grid has ``waves`` programs per SM."""
    import torch

    fid, C, U, P, BS, BB = M1_LAYOUTS[fmt]
    reps, nb, warps, stages = config
    rows_t = 32 // C * warps  # one row per thread and rep (C threads share a q4_k row)
    block_n = rows_t * reps
    row_bytes = data.shape[-1] * data.element_size()
    nblocks = K // BS
    programs_n = triton.cdiv(N, block_n)
    M = x.shape[0]
    split = 1
    if programs_n * M < waves * sms:
        split = max(1, min(triton.cdiv(waves * sms, programs_n * M), nblocks // nb))
    per_split = triton.cdiv(triton.cdiv(nblocks, split), nb) * nb
    split = triton.cdiv(nblocks, per_split)
    y = torch.empty(split, M, N, dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    w8 = data.view(torch.uint8)
    kernel = gemv_m1_kernel[(programs_n, split, M)](
        x, w8, w8.view(torch.float16), y, N, K, x.stride(0), y.stride(0), y.stride(1), row_bytes, nblocks, per_split,
        FMT=fid, NB=nb, C=C, U=U, P=P, BS=BS, BLOCK_BYTES=BB, ROWS_T=rows_t, R=reps,
        UNPACK=unpack,
        num_warps=warps, num_stages=stages)
    return (y, kernel) if return_kernel else y
