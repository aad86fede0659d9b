"""Batch-1 GEMV for q4_0, q8_0 and q4_k with the block scales factored out of the inner products.

For a block (or q4_k sub-block) of 32 weights w_j = a * q_j + b (a, b per block), the dot product with x is
a * sum_j q_j x_j + b * sum_j x_j. The inner loop therefore only turns each code q into a float and multiplies it
with x: the scales are applied once per block and row, and sum_j x_j does not depend on the row.

Turning the two nibbles of a byte into floats costs three integer instructions: one shift moves the byte to bits
15-22, then one LOP3 each masks the low nibble into mantissa bits 15-18 and the high nibble into bits 19-22 and ORs
in the bits of 1.0, which gives the floats 1 + lo/256 and 1 + hi/16 exactly. So the kernel computes
s = sum_j (1 + q_j/256) x_j (or /16) and recovers sum_j q_j x_j = 256 (s - sum_j x_j) (or 16 (...)). 8-bit codes:
1 + b/256 with b = q + 128, the int8 byte with its sign bit flipped. On the GPU the unpacking runs as inline PTX on
four packed bytes at a time (UNPACK=2), which skips the per-byte extraction that the compiler otherwise emits; the
interpreter uses the Triton expression (UNPACK=1).
"""
import triton
import triton.language as tl

from .planes import _small_int_to_f32


def _asm_unpack(shifts, mask: int, magic: int, lut: int) -> str:
    """PTX turning the 4 bytes of $4 into 4 floats: output k = lop3(byte k's field shifted to the mantissa, mask,
    magic). One shift and one LOP3 per value (the magic lives in a register: LOP3 takes one immediate)."""
    body = [f"mov.b32 m, {magic:#x};"]
    for k, sh in enumerate(shifts):
        op = f"shl.b32 t, $4, {sh};" if sh > 0 else (f"shr.b32 t, $4, {-sh};" if sh < 0 else "mov.b32 t, $4;")
        body.append(f"{op} lop3.b32 ${k}, t, {mask:#x}, m, {lut:#x};")
    return "{ .reg .b32 t, m; " + " ".join(body) + " }"


def _asm_unpack_pair() -> str:
    """PTX turning the 4 bytes of $8 into 8 floats with one shift per byte: the byte moves to bits 15-22, so its low
    nibble lands in mantissa bits 15-18 (1 + lo/256, $0-$3) and its high nibble in bits 19-22 (1 + hi/16, $4-$7),
    each picked by one LOP3 that also ORs in 1.0f ((a & b) | c = LUT 0xEA)."""
    body = ["mov.b32 m, 0x3F800000;"]
    for k, sh in enumerate((15, 7, -1, -9)):
        body.append(f"shl.b32 t, $8, {sh};" if sh > 0 else f"shr.b32 t, $8, {-sh};")
        body.append(f"lop3.b32 ${k}, t, 0x78000, m, 0xEA; lop3.b32 ${k + 4}, t, 0x780000, m, 0xEA;")
    return "{ .reg .b32 t, m; " + " ".join(body) + " }"


_ASM_PAIR = tl.constexpr(_asm_unpack_pair())
# int8 q to 1 + (q + 128)/256: the byte to bits 15-22, flip its sign bit and OR 1.0f in one go: the mask and 1.0f
# do not overlap, so (a & b) ^ (1.0f | 0x400000) (LUT 0x6A) does both
_ASM_Q8 = tl.constexpr(_asm_unpack((15, 7, -1, -9), 0x7F8000, 0x3FC00000, 0x6A))


@triton.jit
def _unpack(units, FMT: tl.constexpr, UNPACK: tl.constexpr):
    """Codes of the uint8 tile ``units`` as floats. Nibble formats: (1 + lo/256, 1 + hi/16) per byte; q8_0:
    (1 + b/256, unused) with b = q + 128."""
    if FMT == 7:
        if UNPACK == 2:  # four bytes per 32-bit register in, four floats out
            v8 = tl.inline_asm_elementwise(_ASM_Q8, "=r,=r,=r,=r,r", [units], dtype=tl.float32, is_pure=True, pack=4)
        else:
            v8 = (((units.to(tl.int32) ^ 0x80) << 15) | 0x3F800000).to(tl.float32, bitcast=True)
        return v8, v8
    elif UNPACK == 2:
        return tl.inline_asm_elementwise(_ASM_PAIR, "=r,=r,=r,=r,=r,=r,=r,=r,r", [units],
                                         dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
    else:
        t = units.to(tl.int32) << 15
        lo = ((t & 0x78000) | 0x3F800000).to(tl.float32, bitcast=True)
        hi = ((t & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)
        return lo, hi


@triton.jit
def _load(ptrs, ok, NB: tl.constexpr):
    """A load that is masked only when a step can pass the end of the K split (NB > 1 blocks per step)."""
    if NB == 1:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=ok, other=0)


@triton.jit
def _plane_dot(codes, x_ptrs, ok, NB: tl.constexpr):
    """(sum of code' * x, sum of x) over a block's bytes (axes 4 and 5) for one plane of codes'.
    x comes in through pointers of shape [C, ROWS_T, NB, 1, U1, 8]; the sums are [C, ROWS_T, NB, R] and
    [C, ROWS_T, NB, 1]."""
    xv = _load(x_ptrs, ok, NB).to(tl.float32)
    s = tl.sum(tl.sum(codes * xv, axis=5), axis=4)
    return s, tl.sum(tl.sum(xv, axis=5), axis=4)


@triton.jit
def _q4k_scales(w1, w2, w3, c):
    """6-bit (scale, min) of q4_k sub-blocks 2c and 2c+1 as float32, from the block's scale bytes as three
    little-endian int32 words (bytes 0-3, 4-7, 8-11 of the 12). Word loads need 4-byte aligned data; the planes
    kernel, which also serves unaligned data, decodes from bytes (planes._scale_min_q4k)."""
    sh = (c & 1) * 16  # byte (2c) % 4 of each word
    a = w1 >> sh
    b = w2 >> sh
    e = w3 >> sh
    first = c < 2  # sub-blocks 0..3: the low 6 bits; 4..7: 4 bits from e and the top 2 of a (or b)
    sc0 = tl.where(first, a & 63, (e & 0xF) | ((a >> 2) & 0x30))
    mn0 = tl.where(first, b & 63, ((e >> 4) & 0xF) | ((b >> 2) & 0x30))
    sc1 = tl.where(first, (a >> 8) & 63, ((e >> 8) & 0xF) | ((a >> 10) & 0x30))
    mn1 = tl.where(first, (b >> 8) & 63, ((e >> 12) & 0xF) | ((b >> 10) & 0x30))
    return _small_int_to_f32(sc0), _small_int_to_f32(mn0), _small_int_to_f32(sc1), _small_int_to_f32(mn1)


@triton.jit
def gemv_m1_kernel(X, W8, W16, Y, PART, COUNT, N, K, stride_xm, stride_ys, stride_ym, row_bytes, nblocks,
                   blocks_per_split, split,
                   FMT: tl.constexpr, NB: tl.constexpr, C: tl.constexpr, U: tl.constexpr, P: tl.constexpr,
                   BS: tl.constexpr, BLOCK_BYTES: tl.constexpr, ROWS_T: tl.constexpr, R: tl.constexpr,
                   UNPACK: tl.constexpr, FIXUP: tl.constexpr):
    """y[m, n] (+)= sum over this program's K split of x[m] . w[n] for BLOCK_N = ROWS_T * R rows.

    The bytes of a step form a tile [C, ROWS_T, NB, R, U // 8, 8] (C chunks of U bytes per block). Triton's layout
    for it keeps the innermost 8 bytes in one thread (one 8-byte load) and spreads the threads over C and ROWS_T
    (choose ROWS_T = 32 // C * num_warps); NB, R and U // 8 stay in the thread. The activations come through
    pointers [C, ROWS_T, NB, 1, U // 8, 8] (the row axis broadcast), which get the same layout: each thread
    converts its activations once for its R rows, and the sums over a block never leave the thread.

    With FIXUP, the ``split`` programs of an output tile write float32 partials to PART [split, M, N] and count
    their arrival in COUNT (zero on entry); the last to arrive sums the partials in split order (the same result as
    a separate sum kernel), writes Y and sets the counter back to zero. Without it, Y [split, M, N] gets the
    partials (or, with one split, the result)."""
    BLOCK_N: tl.constexpr = ROWS_T * R
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)  # one activation row per program along the third grid axis (M <= a few)
    X += pid_m * stride_xm
    rt = tl.arange(0, ROWS_T)[None, :, None, None]
    rr = tl.arange(0, R)[None, None, None, :]
    # rows past N read row N - 1 (in bounds, never stored), so the weight loads need no mask
    rows4 = tl.minimum(pid_n * BLOCK_N + rr * ROWS_T + rt, N - 1).to(tl.int64)  # [1, ROWS_T, 1, R]
    kb_start = pid_k * blocks_per_split
    kb_end = tl.minimum(kb_start + blocks_per_split, nblocks)
    c4 = tl.arange(0, C)[:, None, None, None]
    c = c4[:, :, :, :, None, None]
    nb4 = tl.arange(0, NB)[None, None, :, None]
    zt = (rt * 0)[:, :, :, :, None, None]  # [1, ROWS_T, 1, 1, 1, 1] zeros: gives x the rows' thread layout
    u = tl.arange(0, U // 8)[None, None, None, None, :, None] * 8 + tl.arange(0, 8)[None, None, None, None, None, :]
    # pointers of the first step, advanced by NB blocks per step
    base4 = rows4 * row_bytes + (kb_start + nb4) * BLOCK_BYTES + c4 * 0  # [C, ROWS_T, NB, R] byte offsets
    xk = ((kb_start + nb4) * BS)[:, :, :, :, None, None] + zt  # [1, ROWS_T, NB, 1, 1, 1]
    if FMT == 10:  # q4_k: d, dmin, 12 bytes of scales (4 int32 words), C = 4 chunks of 32 bytes
        w_ptrs = W8 + base4[:, :, :, :, None, None] + 16 + c * 32 + u
        h_ptrs = W8.to(tl.pointer_type(tl.int32), bitcast=True) + base4 // 4
        x0_ptrs = X + xk + c * 64 + u
        x1_ptrs = x0_ptrs + 32
    else:  # q4_0 / q8_0: d, then the codes
        w_ptrs = W8 + base4[:, :, :, :, None, None] + 2 + u
        h_ptrs = W16 + base4 // 2
        x0_ptrs = X + xk + u + c * 0
        x1_ptrs = x0_ptrs + 16  # q4_0's high nibbles: weights 16-31
    acc = tl.zeros([C, ROWS_T, NB, R], dtype=tl.float32)
    for kb in range(kb_start, kb_end, NB):
        ok4 = (kb + nb4 < kb_end) & (c4 >= 0)  # with NB > 1 the last step may pass the split's end
        units = _load(w_ptrs, ok4[:, :, :, :, None, None], NB)
        lo, hi = _unpack(units, FMT, UNPACK)
        x_ok = ok4[:, :, :, :, None, None] & (zt == 0)
        s0, sx0 = _plane_dot(lo, x0_ptrs, x_ok, NB)
        if FMT != 7:
            s1, sx1 = _plane_dot(hi, x1_ptrs, x_ok, NB)
        if FMT == 10:  # w = d*sc*q - dmin*mn per sub-block; sum q x = 256 (s0 - sx0) (low), 16 (s1 - sx1) (high)
            hd = _load(h_ptrs, ok4, NB)
            d = (hd & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            dmin = (hd >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            sc0, mn0, sc1, mn1 = _q4k_scales(_load(h_ptrs + 1, ok4, NB), _load(h_ptrs + 2, ok4, NB),
                                             _load(h_ptrs + 3, ok4, NB), c4)
            acc += (256.0 * d * sc0) * (s0 - sx0) - (dmin * mn0) * sx0
            acc += (16.0 * d * sc1) * (s1 - sx1) - (dmin * mn1) * sx1
            h_ptrs += NB * BLOCK_BYTES // 4
        elif FMT == 3:  # w = d * (q - 8): sum q x - 8 sum x = 256 s0 - 264 sx0 + 16 s1 - 24 sx1
            d = _load(h_ptrs, ok4, NB).to(tl.float32)
            acc += d * ((256.0 * s0 - 264.0 * sx0) + (16.0 * s1 - 24.0 * sx1))
            h_ptrs += NB * BLOCK_BYTES // 2
        else:  # w = d * (b - 128):  sum b x - 128 sum x = 256 s - 384 sx
            d = _load(h_ptrs, ok4, NB).to(tl.float32)
            acc += d * (256.0 * s0 - 384.0 * sx0)
            h_ptrs += NB * BLOCK_BYTES // 2
        w_ptrs += NB * BLOCK_BYTES
        x0_ptrs += NB * BS
        x1_ptrs += NB * BS
    out = tl.sum(tl.sum(acc, axis=2), axis=0)  # [ROWS_T, R]
    rows2 = pid_n * BLOCK_N + tl.arange(0, R)[None, :] * ROWS_T + tl.arange(0, ROWS_T)[:, None]
    if FIXUP:
        part = PART + pid_m * N + rows2
        tl.store(part + pid_k * N * tl.num_programs(2), out, mask=rows2 < N)
        # release: the partial is visible before the count; acquire: the last sees every other partial
        tile = pid_m * tl.num_programs(0) + pid_n
        if tl.atomic_add(COUNT + tile, 1, sem="acq_rel") == split - 1:
            total = tl.zeros([ROWS_T, R], dtype=tl.float32)
            for s in range(0, split):
                total += tl.load(part + s * N * tl.num_programs(2), mask=rows2 < N, other=0.0, cache_modifier=".cg")
            tl.store(Y + pid_m * stride_ym + rows2, total.to(Y.dtype.element_ty), mask=rows2 < N)
            tl.atomic_xchg(COUNT + tile, 0)
    else:
        tl.store(Y + pid_k * stride_ys + pid_m * stride_ym + rows2, out.to(Y.dtype.element_ty), mask=rows2 < N)


M1_LAYOUTS = {  # format -> (FMT id, C, U, P, block size, block bytes)
    "q4_0": (3, 1, 16, 2, 32, 18),
    "q8_0": (7, 1, 32, 1, 32, 34),
    "q4_k": (10, 4, 32, 2, 256, 144),
}


def launch_m1(x, data, fmt: str, N: int, K: int, config, sms: int, unpack: int, return_kernel: bool = False,
              waves: int = 2, fixup: bool = True):
    """Run gemv_m1_kernel for x [M, K] and a GGUF weight buffer; returns y [split, M, N] (float32 partials when
    split > 1, for ops._finish to sum), and with return_kernel the compiled kernel too. ``config`` is
    (R, NB, num_warps, num_stages) with R rows per thread; K is split until the grid has ``waves`` programs per SM.
    With ``fixup`` (and a counter buffer, see _runtime.split_counters) the kernel sums its own split-K partials and
    y is [1, M, N]."""
    import torch

    from .._runtime import empty, split_counters
    from .ops import split_k

    fid, C, U, P, BS, BB = M1_LAYOUTS[fmt]
    reps, nb, warps, stages = config
    rows_t = 32 // C * warps  # one row per thread and rep (C threads share a q4_k row)
    block_n = rows_t * reps
    row_bytes = data.shape[-1] * data.element_size()
    nblocks = K // BS
    programs_n = triton.cdiv(N, block_n)
    M = x.shape[0]
    split, per_split = split_k(programs_n * M, nblocks, nb, sms, waves)
    counters = split_counters(x.device) if fixup and split > 1 else None
    if counters is not None and programs_n * M <= counters.numel():
        y = empty(1, M, N, dtype=x.dtype, device=x.device)
        part = empty(split, M, N, dtype=torch.float32, device=x.device)
    else:
        counters = None
        y = empty(split, M, N, dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
        part = y
    w8 = data.view(torch.uint8)
    kernel = gemv_m1_kernel[(programs_n, split, M)](
        x, w8, w8.view(torch.float16), y, part, counters if counters is not None else y, N, K, x.stride(0),
        y.stride(0), y.stride(1), row_bytes, nblocks, per_split, split,
        FMT=fid, NB=nb, C=C, U=U, P=P, BS=BS, BLOCK_BYTES=BB, ROWS_T=rows_t, R=reps,
        UNPACK=unpack, FIXUP=counters is not None,
        num_warps=warps, num_stages=stages)
    return (y, kernel) if return_kernel else y
