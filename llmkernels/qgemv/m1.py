"""Small-M GEMV (M <= 4, q5_k up to 8) for q4_0, q8_0, q4_k, q5_k, q6_k and MLX 4/8-bit with the block scales
factored out of the inner products. Up to four activation rows per program share each unpacked weight. q5_k and
q6_k merge their high bits into 5- or 6-bit codes in registers (_unpack_high) and convert them as q4_k's
low nibbles.

For a block (or q4_k sub-block) of 32 weights w_j = a * q_j + b (a, b per block), the dot product with x is
a * sum_j q_j x_j + b * sum_j x_j. The inner loop therefore only turns each code q into a float and multiplies it
with x: the scales are applied once per block and row, and sum_j x_j does not depend on the row.

Turning the two nibbles of a byte into floats costs three integer instructions: one shift moves the byte to bits
15-22, then one LOP3 each masks the low nibble into mantissa bits 15-18 and the high nibble into bits 19-22 and ORs
in the bits of 1.0, which gives the floats 1 + lo/256 and 1 + hi/16 exactly. So the kernel computes
s = sum_j (1 + q_j/256) x_j (or /16) and recovers sum_j q_j x_j = 256 (s - sum_j x_j) (or 16 (...)). 8-bit codes:
1 + b/256 with b = q + 128, the int8 byte with its sign bit flipped (MLX 8-bit: b = q, unsigned). On the GPU the
unpacking runs as inline PTX on four packed bytes at a time (UNPACK=2), which skips the per-byte extraction that the
compiler otherwise emits; the interpreter uses the Triton expression (UNPACK=1).
"""
import triton
import triton.language as tl

from .._pdl import pdl_options, pdl_trigger, pdl_wait
from .common import split_k, split_outputs
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


def _asm_unpack_high(hi_shift: int, hmask: int, vmask: int) -> str:
    """PTX for codes split into a low-nibble byte plane and high-bit bytes (q5_k, q6_k): the 4 nibble bytes of $8,
    their 4 high-bit bytes of $9 and the chunk's bit position s (low byte of $10) -> 8 floats 1 + q/256. With
    h = $9 >> s, the low nibbles take (h << 4) & hmask and the high nibbles (h << hi_shift) & hmask as their bits
    4-5, four bytes at a time; then one shift and one LOP3 (mask vmask, OR 1.0f) per value."""
    hi = f"shl.b32 t, h, {hi_shift}; and.b32 t, t, {hmask:#x};" if hi_shift else f"and.b32 t, h, {hmask:#x};"
    body = ["mov.b32 m, 0x3F800000;", "and.b32 s, $10, 0xFF;", "shr.b32 h, $9, s;",
            f"shl.b32 t, h, 4; and.b32 t, t, {hmask:#x};", "lop3.b32 a, $8, 0x0F0F0F0F, t, 0xEA;",
            hi, "shr.b32 b, $8, 4;", "lop3.b32 b, b, 0x0F0F0F0F, t, 0xEA;"]
    for k, sh in enumerate((15, 7, -1, -9)):
        for src, out in (("a", k), ("b", k + 4)):
            body.append(f"shl.b32 t, {src}, {sh};" if sh > 0 else f"shr.b32 t, {src}, {-sh};")
            body.append(f"lop3.b32 ${out}, t, {vmask:#x}, m, 0xEA;")
    return "{ .reg .b32 t, m, h, a, b, s; " + " ".join(body) + " }"


# q5_k: one high bit per code, bit s for the low nibbles and s + 1 for the high ones (5-bit values, bits 15-19)
_ASM_Q5 = tl.constexpr(_asm_unpack_high(3, 0x10101010, 0xF8000))
# q6_k: two high bits per code, bits s, s + 1 for the low nibbles and s + 4, s + 5 for the high ones (bits 15-20)
_ASM_Q6 = tl.constexpr(_asm_unpack_high(0, 0x30303030, 0x1F8000))
# int8 q to 1 + (q + 128)/256: the byte to bits 15-22, flip its sign bit and OR 1.0f in one go: the mask and 1.0f
# do not overlap, so (a & b) ^ (1.0f | 0x400000) (LUT 0x6A) does both
_ASM_Q8 = tl.constexpr(_asm_unpack((15, 7, -1, -9), 0x7F8000, 0x3FC00000, 0x6A))
# unsigned 8-bit codes (MLX 8-bit) to 1 + b/256: the byte to bits 15-22, masked, OR 1.0f ((a & b) | c = LUT 0xEA)
_ASM_U8 = tl.constexpr(_asm_unpack((15, 7, -1, -9), 0x7F8000, 0x3F800000, 0xEA))
U8_CODES = 14  # _unpack's code for unsigned bytes (FMT ids 0-13 are the formats, see ops.FORMAT_IDS)


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
    elif FMT == 14:  # unsigned bytes: 1 + b/256
        if UNPACK == 2:
            v8 = tl.inline_asm_elementwise(_ASM_U8, "=r,=r,=r,=r,r", [units], dtype=tl.float32, is_pure=True, pack=4)
        else:
            v8 = ((units.to(tl.int32) << 15) | 0x3F800000).to(tl.float32, bitcast=True)
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
def _unpack_high(units, hb, sh, BITS: tl.constexpr, UNPACK: tl.constexpr):
    """q5_k (BITS 5) or q6_k (BITS 6) codes as (1 + q/256) floats for the low-nibble and high-nibble planes of the
    nibble bytes ``units``: ``hb`` the high-bit bytes of the same positions, ``sh`` (uint8) the low plane's bit
    position in them (see _asm_unpack_high)."""
    if UNPACK == 2:
        return tl.inline_asm_elementwise(_ASM_Q5 if BITS == 5 else _ASM_Q6, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r",
                                         [units, hb, sh], dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
    else:
        HS: tl.constexpr = 3 if BITS == 5 else 0
        HM: tl.constexpr = 0x10 if BITS == 5 else 0x30
        q = units.to(tl.int32)
        h = hb.to(tl.int32) >> sh.to(tl.int32)
        lo = ((((q & 0xF) | ((h << 4) & HM)) << 15) | 0x3F800000).to(tl.float32, bitcast=True)
        hi = (((((q >> 4) & 0xF) | ((h << HS) & HM)) << 15) | 0x3F800000).to(tl.float32, bitcast=True)
        return lo, hi


@triton.jit
def _split_words(w, DT: tl.constexpr):
    """int32 words holding two fp16/bf16 values (x pairs, the q4_k header's d and dmin) -> (low half, high half) as
    float32."""
    if DT == tl.bfloat16:  # a bf16 is the top half of its float32
        return (w << 16).to(tl.float32, bitcast=True), (w & -65536).to(tl.float32, bitcast=True)
    else:
        lo = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return lo, hi


@triton.jit
def _load(ptrs, ok, MASK: tl.constexpr):
    """A load that is masked only when a step can pass the end of the K split (MASK)."""
    if not MASK:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=ok, other=0)


@triton.jit
def _silu_mul(g, u, XDT: tl.constexpr, SILU: tl.constexpr):
    """silu(g) * u in float32, rounded to the activation dtype as the two-step path (and the generic kernel) do.

    SILU 2 (GPU): sigmoid(g) = 0.5 + 0.5 tanh(g / 2) with tanh.approx.f32, one special-function op per value
    instead of ex2 plus an IEEE division (relative error of tanh.approx about 2^-11, below fp16's rounding)."""
    if SILU == 2:
        hg = 0.5 * g
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [hg], dtype=tl.float32, is_pure=True,
                                      pack=1)
        s = hg * t + hg
    else:
        s = g / (1.0 + tl.exp(-g))
    return (s * u).to(XDT).to(tl.float32)


@triton.jit
def _act(x_ptrs, ok, x2_off, XDT: tl.constexpr, MASK: tl.constexpr, SILU: tl.constexpr):
    """Activations as float32: x, or with SILU silu(x) * x2 where x2 lies x2_off elements after x."""
    xv = _load(x_ptrs, ok, MASK).to(tl.float32)
    if SILU:
        xv = _silu_mul(xv, _load(x_ptrs + x2_off, ok, MASK).to(tl.float32), XDT, SILU)
    return xv


@triton.jit
def _plane_dot(codes, x_ptrs, ok, x2_off, XDT: tl.constexpr, MASK: tl.constexpr, SILU: tl.constexpr):
    """(sum of code' * x, sum of x) over a block's bytes (axes 4 and 5) for one plane of codes'.
    x comes in through pointers of shape [C, ROWS_T, NB, 1, U // V, V]; the sums are [C, ROWS_T, NB, R] and
    [C, ROWS_T, NB, 1]."""
    xv = _act(x_ptrs, ok, x2_off, XDT, MASK, SILU)
    s = tl.sum(tl.sum(codes * xv, axis=5), axis=4)
    return s, tl.sum(tl.sum(xv, axis=5), axis=4)


@triton.jit
def _row_update(lo, hi, x0_ptrs, x1_ptrs, x_ok, x2_off, f0, f1, g0, g1, XDT: tl.constexpr, FMT: tl.constexpr,
                BITS: tl.constexpr, MASK: tl.constexpr, SILU: tl.constexpr):
    """One activation row's increment f0 * s0 + f1 * s1 + g0 * sx0 + g1 * sx1 for a step, where s0 = sum code' x
    and sx0 = sum x over the low-nibble (or only) plane, s1 and sx1 over the high-nibble plane."""
    if FMT == 13 and BITS == 4:
        xe, xo = _split_words(_load(x0_ptrs, x_ok, MASK), XDT)
        if SILU:  # x2_off counts int32 words here
            ue, uo = _split_words(_load(x0_ptrs + x2_off, x_ok, MASK), XDT)
            xe = _silu_mul(xe, ue, XDT, SILU)
            xo = _silu_mul(xo, uo, XDT, SILU)
        s0 = tl.sum(tl.sum(lo * xe, axis=5), axis=4)
        sx0 = tl.sum(tl.sum(xe, axis=5), axis=4)
        s1 = tl.sum(tl.sum(hi * xo, axis=5), axis=4)
        sx1 = tl.sum(tl.sum(xo, axis=5), axis=4)
        return f0 * s0 + f1 * s1 + g0 * sx0 + g1 * sx1
    elif FMT == 7 or FMT == 13:  # one plane
        s0, sx0 = _plane_dot(lo, x0_ptrs, x_ok, x2_off, XDT, MASK, SILU)
        return f0 * s0 + g0 * sx0
    else:
        s0, sx0 = _plane_dot(lo, x0_ptrs, x_ok, x2_off, XDT, MASK, SILU)
        s1, sx1 = _plane_dot(hi, x1_ptrs, x_ok, x2_off, XDT, MASK, SILU)
        return f0 * s0 + f1 * s1 + g0 * sx0 + g1 * sx1


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
def gemv_m1_kernel(X, XW, W8, W16, WS, WB, Y, PART, COUNT, M, N, K, stride_xm, stride_ys, stride_ym, row_bytes,
                   scale_stride, nblocks, blocks_per_split, split, x2_off, WU,
                   FMT: tl.constexpr, NB: tl.constexpr, C: tl.constexpr, U: tl.constexpr, P: tl.constexpr,
                   BS: tl.constexpr, BLOCK_BYTES: tl.constexpr, ROWS_T: tl.constexpr, R: tl.constexpr,
                   BITS: tl.constexpr, MR: tl.constexpr, UNPACK: tl.constexpr, FIXUP: tl.constexpr,
                   SILU: tl.constexpr, KT: tl.constexpr = 1, H: tl.constexpr = 1, EVEN: tl.constexpr = True,
                   PDL: tl.constexpr = False, XP: tl.constexpr = False, GLU: tl.constexpr = False,
                   EXPERT=None, n_experts=1, TOPK: tl.constexpr = 0):
    """y[m, n] (+)= sum over this program's K split of x[m] . w[n] for BLOCK_N = ROWS_T * R rows.

    The bytes of a step form a tile [C, ROWS_T, NB, R, U // V, V] (C chunks of U bytes per block, V = 8). Triton's
    layout for it keeps the innermost V bytes in one thread (one V-byte load) and spreads the threads over C and ROWS_T
    (choose ROWS_T = 32 // C * num_warps); NB, R and U // V stay in the thread. The activations come through
    pointers [C, ROWS_T, NB, 1, U // V, V] (the row axis broadcast), which get the same layout: each thread
    converts its activations once for its R rows, and the sums over a block never leave the thread.

    MLX (FMT 13): a "block" is C groups, chunk c is group c, U = group_size * BITS / 8 bytes. 4-bit bytes hold
    weights 2l (low nibble) and 2l + 1 (high), so the activations come in as int32 words XW (two x values each, the
    same memory as X) and split into their even and odd halves; 8-bit bytes pair with x in natural order.

    SILU (silu_mul_gemv, 1 exact, 2 through tanh.approx): the activations are silu(x) * x2, x2 being x2_off elements
    (MLX 4-bit: int32 words) after x with x's row stride; the product is formed as it loads, rounded to x's dtype,
    never written.

    KT > 1 spreads the ROWS_T axis over KT consecutive blocks of ROWS_T // KT rows (lane t: row t // KT, block
    t % KT), so that a warp's load covers KT consecutive blocks of each row (longer contiguous runs per row, fewer
    rows at once); the KT partial sums of a row are added after the loop. A step then takes NB * KT blocks; EVEN
    says every split is a whole number of steps (no masks).

    H > 1 splits each format chunk (q4_k: 32-byte sub-block pair; MLX: group; q4_0/q8_0: the block's codes) into H
    pieces of U bytes, one per thread: C = H * (chunks per block). Threads then hold fewer bytes per row, so they can
    take more rows (R) for the same registers, and neighbouring threads read neighbouring bytes.

    The sums are stored by _store_rows (FIXUP: split-K partials summed in the kernel).

    XP (q4_k with KT = 8, NB = 1, H = 1): X holds the activations in lane order (see lane_pos), so that the values
    a warp loads at once lie together.

    GLU (q4_k, R even, one K split): y[m, n] = silu(x[m] . g[n]) * (x[m] . u[n]) with g the rows of W8 and u those
    of WU. Row slot r < R // 2 of a thread reads a gate row and slot r + R // 2 the up row of the same output, so
    both sums end in one thread; a program makes BLOCK_N // 2 outputs.

    PDL (launched with launch_pdl, see _pdl.py): programs wait for the previous kernel first and let the next one
    launch after their loop.

    TOPK > 0 (mixture of experts, MR = 1, one K split): W8 (and WU) stack n_experts matrices of N rows; the third
    grid axis runs over (token, expert) pairs, pair p reading the rows of expert EXPERT[p] and activation row
    p // TOPK, and writing output row p."""
    ROWS_G: tl.constexpr = ROWS_T // KT  # distinct rows per rep
    BLOCK_N: tl.constexpr = ROWS_G * R
    STEP: tl.constexpr = NB * KT  # blocks per step
    MASK: tl.constexpr = not EVEN
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)  # MR activation rows per program along the third grid axis
    pdl_wait(PDL)
    if TOPK > 0:
        # ids are checked on the host, but not under CUDA-graph capture: stay inside the stack regardless
        e_off = tl.minimum(tl.maximum(tl.load(EXPERT + pid_m).to(tl.int64), 0), n_experts - 1) * N
        X += (pid_m // TOPK) * stride_xm
        XW += (pid_m // TOPK) * (stride_xm // 2)
    else:
        e_off = 0
        X += pid_m * MR * stride_xm
        XW += pid_m * MR * (stride_xm // 2)
    rt = tl.arange(0, ROWS_T)[None, :, None, None]
    rr = tl.arange(0, R)[None, None, None, :]
    # rows past N read row N - 1 (in bounds, never stored), so the weight loads need no mask
    if GLU:  # slots r and r + R // 2 read the gate and up rows of one output
        tl.static_assert(FMT == 10 and R % 2 == 0, "GLU is built for q4_k with an even R")
        rows4 = tl.minimum(pid_n * (BLOCK_N // 2) + (rr % (R // 2)) * ROWS_G + rt // KT, N - 1).to(tl.int64) + e_off
        wbase = tl.where(rr >= R // 2, WU, W8)  # [1, 1, 1, R] pointers
    else:
        rows4 = tl.minimum(pid_n * BLOCK_N + rr * ROWS_G + rt // KT, N - 1).to(tl.int64) + e_off  # [1, ROWS_T, 1, R]
        wbase = W8
    kb_start = pid_k * blocks_per_split
    kb_end = tl.minimum(kb_start + blocks_per_split, nblocks)
    c4 = tl.arange(0, C)[:, None, None, None]
    c = c4[:, :, :, :, None, None]
    CG: tl.constexpr = C // H  # format chunks per block
    cg4 = c4 // H  # a thread's format chunk
    blk4 = tl.arange(0, NB)[None, None, :, None] * KT + rt % KT  # a thread's blocks within a step [1, ROWS_T, NB, 1]
    zt = (rt * 0)[:, :, :, :, None, None]  # [1, ROWS_T, 1, 1, 1, 1] zeros: gives x the rows' thread layout
    # V bytes per thread and load: 8, or 4 for MLX 4-bit, whose 4 bytes pair with 4 int32 words of x (16 bytes, the
    # widest load, so both tiles get the same layout)
    V: tl.constexpr = 4 if FMT == 13 and BITS == 4 else 8
    u = tl.arange(0, U // V)[None, None, None, None, :, None] * V + tl.arange(0, V)[None, None, None, None, None, :]
    # pointers of the first step, advanced by STEP blocks per step
    base4 = rows4 * row_bytes + (kb_start + blk4) * BLOCK_BYTES + c4 * 0  # [C, ROWS_T, NB, R] byte offsets
    xk = ((kb_start + blk4) * BS)[:, :, :, :, None, None] + zt  # [1, ROWS_T, NB, 1, 1, 1]
    if FMT == 10 or FMT == 11:  # q4_k / q5_k: d, dmin, 12 bytes of scales (4 int32 words), [q5_k: 32 bytes of
        # high bits,] 4 chunks of 32 code bytes (H pieces each)
        CODES: tl.constexpr = 16 if FMT == 10 else 48
        wb4 = wbase + base4 * 0  # the (gate or) weight rows' base, [C, ROWS_T, NB, R]
        w_ptrs = wb4[:, :, :, :, None, None] + base4[:, :, :, :, None, None] + CODES + c * U + u
        h_ptrs = wb4.to(tl.pointer_type(tl.int32), bitcast=True) + base4 // 4
        # q5_k: byte l of every chunk takes its high bits from qh[l] (bit 2 * chunk for the low nibble, the next
        # for the high nibble)
        qh_ptrs = w_ptrs - CODES + 16 - (c // H) * (H * U)
        qh_sh = ((c // H) * 2 + u * 0).to(tl.uint8)
        if XP:  # activations in lane order (lane_pos): a warp's x load is 512 contiguous bytes
            tl.static_assert(KT == 8 and NB == 1 and H == 1, "lane order is laid out for KT = 8, NB = 1, H = 1")
            kt6 = (rt % KT)[:, :, :, :, None, None]
            a6 = tl.arange(0, U // 8)[None, None, None, None, :, None]
            v6 = tl.arange(0, 8)[None, None, None, None, None, :]
            x0_ptrs = X + kb_start * BS + a6 * 256 + (kt6 * 4 + c) * 8 + v6
            x1_ptrs = x0_ptrs + 1024  # the high-nibble plane: p = 1
        else:
            x0_ptrs = X + xk + (c // H) * 64 + (c % H) * U + u
            x1_ptrs = x0_ptrs + 32
    elif FMT == 12:  # q6_k: ql[128], qh[64], 16 int8 scales, fp16 d. Chunk cc = 2n + j of the block: ql bytes
        # 32cc..32cc+31 (low nibbles: weights 128n + 32j + l, high nibbles: + 64), their high bits in qh[32n + l]
        # (bits 2j, 2j + 1 and 2j + 4, 2j + 5). A piece of U <= 16 bytes has one scale per plane. Blocks are only
        # 2-byte aligned (210 bytes), so the loads are narrower than for the other formats.
        cc4 = c4 // H
        pc4 = (c4 % H) * U  # the piece's first byte within its chunk
        w_ptrs = W8 + base4[:, :, :, :, None, None] + c * U + u
        qh_ptrs = W8 + base4[:, :, :, :, None, None] + 128 + ((c // H) // 2) * 32 + (c % H) * U + u
        qh_sh = (((c // H) % 2) * 2 + u * 0).to(tl.uint8)
        s6_ptrs = (W8 + base4 + 192 + (cc4 // 2) * 8 + (cc4 % 2) * 2 + pc4 // 16).to(tl.pointer_type(tl.int8),
                                                                                        bitcast=True)
        d6_ptrs = W16 + (base4 + 208) // 2
        x0_ptrs = X + xk + ((c // H) // 2) * 128 + ((c // H) % 2) * 32 + (c % H) * U + u
        x1_ptrs = x0_ptrs + 64
    elif FMT == 13:  # MLX: codes only; scale and bias per (row, group) in WS, WB
        w_ptrs = W8 + base4[:, :, :, :, None, None] + c * U + u
        s_ptrs = rows4 * scale_stride + (kb_start + blk4) * CG + cg4
        if BITS == 4:  # word u of group c: x[2u] (low nibble of byte u) and x[2u + 1] (high)
            x0_ptrs = XW + xk // 2 + c * (U) + u
        else:
            x0_ptrs = X + xk + c * U + u
        x1_ptrs = x0_ptrs
    else:  # q4_0 / q8_0: d, then the codes
        w_ptrs = W8 + base4[:, :, :, :, None, None] + 2 + c * U + u
        h_ptrs = W16 + base4 // 2
        x0_ptrs = X + xk + u + c * U
        x1_ptrs = x0_ptrs + 16  # q4_0's high nibbles: weights 16-31
    # the other activation rows of this program: offsets from row pid_m * MR, rows past M repeat row M - 1 (never
    # stored); MLX 4-bit reads x in int32 words, so its offsets are in words
    XS: tl.constexpr = 2 if FMT == 13 and BITS == 4 else 1
    m0 = pid_m * MR
    xo1 = (tl.minimum(m0 + 1, M - 1) - m0) * (stride_xm // XS)
    xo2 = (tl.minimum(m0 + 2, M - 1) - m0) * (stride_xm // XS)
    xo3 = (tl.minimum(m0 + 3, M - 1) - m0) * (stride_xm // XS)
    acc0 = tl.zeros([C, ROWS_T, NB, R], dtype=tl.float32)
    acc1 = tl.zeros([C, ROWS_T, NB, R], dtype=tl.float32)
    acc2 = tl.zeros([C, ROWS_T, NB, R], dtype=tl.float32)
    acc3 = tl.zeros([C, ROWS_T, NB, R], dtype=tl.float32)
    for kb in range(kb_start, kb_end, STEP):
        ok4 = (kb + blk4 < kb_end) & (c4 >= 0)  # unless EVEN, the last step may pass the split's end
        units = _load(w_ptrs, ok4[:, :, :, :, None, None], MASK)
        if FMT == 11 or FMT == 12:  # q5_k / q6_k: the high bits merged into 5- or 6-bit codes
            lo, hi = _unpack_high(units, _load(qh_ptrs, ok4[:, :, :, :, None, None], MASK), qh_sh, FMT - 6, UNPACK)
            qh_ptrs += STEP * BLOCK_BYTES
        else:
            lo, hi = _unpack(units, 14 if (FMT == 13 and BITS == 8) else FMT, UNPACK)
        x_ok = ok4[:, :, :, :, None, None] & (zt == 0)
        # per (row, block) factors of the four partial sums, shared by the activation rows: the increment is
        # f0 * s0 + f1 * s1 + g0 * sx0 + g1 * sx1 (see _row_update for s, sx)
        if FMT == 13:  # w = scale * q + bias per group
            sc = _load(WS + s_ptrs, ok4, MASK).to(tl.float32)
            bi = _load(WB + s_ptrs, ok4, MASK).to(tl.float32)
            if BITS == 4:  # sum q x = 256 (s0 - sx0) (low nibbles, even x) + 16 (s1 - sx1) (high, odd x)
                f0, f1, g0, g1 = 256.0 * sc, 16.0 * sc, bi - 256.0 * sc, bi - 16.0 * sc
            else:  # 8-bit: 1 + b/256 with b the code itself
                f0, f1, g0, g1 = 256.0 * sc, sc * 0.0, bi - 256.0 * sc, sc * 0.0
            s_ptrs += STEP * CG
        elif FMT == 10 or FMT == 11:  # w = d*sc*q - dmin*mn per sub-block; sum q x = 256 (s0 - sx0) (low),
            # 16 (s1 - sx1) (q4_k high) or 256 (s1 - sx1) (q5_k high, 5-bit values in bits 15-19)
            # the 16-byte header as one vector of 4 words: fp16 d and dmin, then the 12 scale bytes
            hw = tl.reshape(_load(h_ptrs[:, :, :, :, None] + tl.arange(0, 4)[None, None, None, None, :],
                                  ok4[:, :, :, :, None], MASK), [C, ROWS_T, NB, R, 2, 2])
            w02, w13 = tl.split(hw)
            hd, w2 = tl.split(w02)
            w1, w3 = tl.split(w13)
            d, dmin = _split_words(hd, tl.float16)
            sc0, mn0, sc1, mn1 = _q4k_scales(w1, w2, w3, cg4)
            f0 = 256.0 * d * sc0
            f1 = (16.0 if FMT == 10 else 256.0) * d * sc1
            g0 = -f0 - dmin * mn0
            g1 = -f1 - dmin * mn1
            h_ptrs += STEP * BLOCK_BYTES // 4
        elif FMT == 12:  # w = d * sc * (q - 32): sum q x - 32 sum x = 256 s - 288 sx per plane
            d = _load(d6_ptrs, ok4, MASK).to(tl.float32)
            ds0 = d * _load(s6_ptrs, ok4, MASK).to(tl.float32)
            ds1 = d * _load(s6_ptrs + 4, ok4, MASK).to(tl.float32)
            f0, f1, g0, g1 = 256.0 * ds0, 256.0 * ds1, -288.0 * ds0, -288.0 * ds1
            d6_ptrs += STEP * BLOCK_BYTES // 2
            s6_ptrs += STEP * BLOCK_BYTES
        elif FMT == 3:  # w = d * (q - 8): sum q x - 8 sum x = 256 s0 - 264 sx0 + 16 s1 - 24 sx1
            d = _load(h_ptrs, ok4, MASK).to(tl.float32)
            f0, f1, g0, g1 = 256.0 * d, 16.0 * d, -264.0 * d, -24.0 * d
            h_ptrs += STEP * BLOCK_BYTES // 2
        else:  # w = d * (b - 128):  sum b x - 128 sum x = 256 s - 384 sx
            d = _load(h_ptrs, ok4, MASK).to(tl.float32)
            f0, f1, g0, g1 = 256.0 * d, d * 0.0, -384.0 * d, d * 0.0
            h_ptrs += STEP * BLOCK_BYTES // 2
        acc0 += _row_update(lo, hi, x0_ptrs, x1_ptrs, x_ok, x2_off, f0, f1, g0, g1, X.dtype.element_ty, FMT,
                            BITS, MASK, SILU)
        if MR > 1:
            acc1 += _row_update(lo, hi, x0_ptrs + xo1, x1_ptrs + xo1, x_ok, x2_off, f0, f1, g0, g1,
                                X.dtype.element_ty, FMT, BITS, MASK, SILU)
        if MR > 2:
            acc2 += _row_update(lo, hi, x0_ptrs + xo2, x1_ptrs + xo2, x_ok, x2_off, f0, f1, g0, g1,
                                X.dtype.element_ty, FMT, BITS, MASK, SILU)
        if MR > 3:
            acc3 += _row_update(lo, hi, x0_ptrs + xo3, x1_ptrs + xo3, x_ok, x2_off, f0, f1, g0, g1,
                                X.dtype.element_ty, FMT, BITS, MASK, SILU)
        w_ptrs += STEP * BLOCK_BYTES
        if FMT == 13 and BITS == 4:
            x0_ptrs += STEP * BS // 2
        else:
            x0_ptrs += STEP * BS
            x1_ptrs += STEP * BS
    pdl_trigger(PDL)
    if GLU:
        HR: tl.constexpr = R // 2
        rows2 = pid_n * (BLOCK_N // 2) + tl.arange(0, HR)[None, :] * ROWS_G + tl.arange(0, ROWS_G)[:, None]
        _store_rows(_glu(_row_sums(acc0, ROWS_G, KT, R), ROWS_G, HR), _glu(_row_sums(acc1, ROWS_G, KT, R), ROWS_G, HR),
                    _glu(_row_sums(acc2, ROWS_G, KT, R), ROWS_G, HR), _glu(_row_sums(acc3, ROWS_G, KT, R), ROWS_G, HR),
                    rows2, Y, PART, COUNT, M, N, m0, pid_m, pid_k, split, stride_ys, stride_ym, ROWS_G, HR, MR, False)
    else:
        rows2 = pid_n * BLOCK_N + tl.arange(0, R)[None, :] * ROWS_G + tl.arange(0, ROWS_G)[:, None]
        _store_rows(_row_sums(acc0, ROWS_G, KT, R), _row_sums(acc1, ROWS_G, KT, R), _row_sums(acc2, ROWS_G, KT, R),
                    _row_sums(acc3, ROWS_G, KT, R), rows2, Y, PART, COUNT, M, N, m0, pid_m, pid_k, split, stride_ys,
                    stride_ym, ROWS_G, R, MR, FIXUP)


@triton.jit
def _glu(s, ROWS_G: tl.constexpr, HR: tl.constexpr):
    """silu(gate) * up from row sums [ROWS_G, 2 * HR] whose slots < HR hold gate sums and the others up sums."""
    g, u = tl.split(tl.permute(tl.reshape(s, [ROWS_G, 2, HR]), [0, 2, 1]))
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _row_sums(acc, ROWS_G: tl.constexpr, KT: tl.constexpr, R: tl.constexpr):
    """[ROWS_G, R] row sums of an accumulator [C, ROWS_T, NB, R] whose ROWS_T axis holds KT lanes per row."""
    s = tl.sum(tl.sum(acc, axis=2), axis=0)
    if KT > 1:
        s = tl.sum(tl.reshape(s, [ROWS_G, KT, R]), axis=1)
    return s


@triton.jit
def _store_rows(a0, a1, a2, a3, rows2, Y, PART, COUNT, M, N, m0, pid_m, pid_k, split, stride_ys, stride_ym,
                ROWS_T: tl.constexpr, R: tl.constexpr, MR: tl.constexpr, FIXUP: tl.constexpr):
    """Store a program's sums a0..a3 [ROWS_T, R] (activation rows m0..m0 + MR - 1, output rows ``rows2``).

    With FIXUP, the ``split`` programs of an output tile write float32 partials to PART [split, M, N] and count
    their arrival in COUNT (zero on entry); the last to arrive sums the partials in split order (the same result as
    a separate sum kernel), writes Y and sets the counter back to zero. Without it, Y [split, M, N] gets the
    partials (or, with one split, the result)."""
    n_ok = rows2 < N
    if FIXUP:
        # partials of all MR rows, then one arrival per program; the last of the tile sums each row
        part = PART + m0 * N + rows2
        part_k = part + pid_k * N * M
        tl.store(part_k, a0, mask=n_ok)
        if MR > 1:
            tl.store(part_k + N, a1, mask=n_ok & (m0 + 1 < M))
        if MR > 2:
            tl.store(part_k + 2 * N, a2, mask=n_ok & (m0 + 2 < M))
        if MR > 3:
            tl.store(part_k + 3 * N, a3, mask=n_ok & (m0 + 3 < M))
        # release: the partials are visible before the count; acquire: the last sees every other partial. A scalar
        # atomic runs in one thread only and Triton does not synchronize the warps before it, so without the
        # barrier the count could be released while other warps' partials are still being stored (seen on an
        # H100: wrong sums with one row per thread)
        tile = pid_m * tl.num_programs(0) + tl.program_id(0)
        tl.debug_barrier()
        if tl.atomic_add(COUNT + tile, 1, sem="acq_rel") == split - 1:
            for j in tl.static_range(MR):
                ok = n_ok & (m0 + j < M)
                total = tl.zeros([ROWS_T, R], dtype=tl.float32)
                for s in range(split):
                    total += tl.load(part + j * N + s * N * M, mask=ok, other=0.0, cache_modifier=".cg")
                tl.store(Y + (m0 + j) * stride_ym + rows2, total.to(Y.dtype.element_ty), mask=ok)
            tl.atomic_xchg(COUNT + tile, 0)
    else:
        y_ptrs = Y + pid_k * stride_ys + m0 * stride_ym + rows2
        tl.store(y_ptrs, a0.to(Y.dtype.element_ty), mask=n_ok)
        if MR > 1:
            tl.store(y_ptrs + stride_ym, a1.to(Y.dtype.element_ty), mask=n_ok & (m0 + 1 < M))
        if MR > 2:
            tl.store(y_ptrs + 2 * stride_ym, a2.to(Y.dtype.element_ty), mask=n_ok & (m0 + 2 < M))
        if MR > 3:
            tl.store(y_ptrs + 3 * stride_ym, a3.to(Y.dtype.element_ty), mask=n_ok & (m0 + 3 < M))


LANE_GROUP = 2048  # activations per lane-order group: one step of the q4_k kernel with 8 lanes along K


@triton.jit
def lane_pos(k):
    """Where activation k lies in lane order, the layout the q4_k kernel with KT = 8 (XP) reads.

    In natural order the 32 lanes of a warp (chunk c, block kt: lane c + 4 kt) need 16-byte pieces of x 128 or 512
    bytes apart, 32 lines per load. Lane order keeps each group of 2048 elements (8 blocks) in place as a whole and
    orders it by (plane p, load a, lane, element v), so the piece a lane loads is next to its neighbours': element
    kt * 256 + c * 64 + p * 32 + a * 8 + v of a group goes to ((p * 4 + a) * 8 + kt) * 32 + c * 8 + v."""
    r = k % 2048  # LANE_GROUP
    kt = r // 256
    c = (r // 64) % 4
    p = (r // 32) % 2
    a = (r // 8) % 4
    return k - r + ((p * 4 + a) * 8 + kt) * 32 + c * 8 + r % 8


@triton.jit
def _lane_order_kernel(X, XL, K, stride_x, stride_xl, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    pdl_trigger(PDL)
    row = tl.program_id(1).to(tl.int64)
    k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = k < K
    tl.store(XL + row * stride_xl + lane_pos(k), tl.load(X + row * stride_x + k, mask=ok), mask=ok)


def lanes_width(K: int) -> int:
    """Columns of an activation buffer in lane order for K inputs: whole groups (the tail of the last one is never
    read: its blocks lie past K)."""
    return triton.cdiv(K, LANE_GROUP) * LANE_GROUP


def lane_order(x, pdl: bool = False):
    """x [M, K] (last dim contiguous) copied into lane order: [M, lanes_width(K)], see lane_pos."""
    from .._runtime import empty

    M, K = x.shape
    xl = empty(M, lanes_width(K), dtype=x.dtype, device=x.device)
    BLOCK = 1024
    _lane_order_kernel[(triton.cdiv(K, BLOCK), M)](x, xl, K, x.stride(0), xl.stride(0), BLOCK=BLOCK, PDL=pdl,
                                                   **pdl_options(pdl))
    return xl


M1_LAYOUTS = {  # format -> (FMT id, C, U, P, block size, block bytes)
    "q4_0": (3, 1, 16, 2, 32, 18),
    "q8_0": (7, 1, 32, 1, 32, 34),
    "q4_k": (10, 4, 32, 2, 256, 144),
    "q5_k": (11, 4, 32, 2, 256, 176),
    "q6_k": (12, 4, 32, 2, 256, 210),  # needs H >= 2 (a piece within one 16-weight scale group)
}


def m1_layout(fmt: str, bits: int = 0, group_size: int = 0, K: int = 0):
    """(FMT id, C, U, P, block size, block bytes) of a format the m1 kernel reads, or None. MLX 4- and 8-bit: a
    block is C groups (4, 2 or 1, whichever divides the row's group count), one group per chunk."""
    if fmt in M1_LAYOUTS:
        return M1_LAYOUTS[fmt]
    if fmt != "mlx" or bits not in (4, 8) or not group_size:
        return None
    groups = K // group_size
    C = 4 if groups % 4 == 0 else (2 if groups % 2 == 0 else 1)
    U = group_size * bits // 8
    return 13, C, U, 2 if bits == 4 else 1, C * group_size, C * U


def m1_x_ok(x, x2, fmt: str, bits: int = 0) -> bool:
    """Whether x (and silu_mul_gemv's x2) are laid out as the m1 kernel loads them: for MLX 4-bit, fp16/bf16 rows
    readable as int32 words; an x2 of x's shape, dtype and strides at a whole number of load units from x."""
    unit = x.element_size() * (2 if fmt == "mlx" and bits == 4 else 1)  # int32 words for MLX 4-bit
    if x2 is not None and (x2.dtype != x.dtype or x2.stride() != x.stride() or x2.shape != x.shape
                           or (x2.data_ptr() - x.data_ptr()) % unit):
        return False
    if fmt == "mlx" and bits == 4:
        import torch

        return all(t.dtype in (torch.float16, torch.bfloat16) and t.data_ptr() % 4 == 0 and t.stride(0) % 2 == 0
                   for t in (x, x2 if x2 is not None else x))
    return True


def m1_supports(x, data, fmt: str, bits: int = 0, group_size: int = 0, K: int = 0, x2=None) -> bool:
    """Whether the m1 kernel can take these operands: a layout for the format, 16-byte aligned weights (int32 header
    loads, 8-byte code loads), and x (and x2) as m1_x_ok wants them."""
    if m1_layout(fmt, bits, group_size, K) is None or data.data_ptr() % 16:
        return False
    return m1_x_ok(x, x2, fmt, bits)


def _x2_offset(x, x2, elems_per_unit: int) -> int:
    """x2's distance from x in load units (elements, or int32 words for MLX 4-bit); 0 without x2."""
    if x2 is None:
        return 0
    gap = x2.data_ptr() - x.data_ptr()
    unit = x.element_size() * elems_per_unit
    if gap % unit:
        raise ValueError(f"x2 must lie a whole number of {unit}-byte units from x, got {gap} bytes")
    return gap // unit


def launch_m1(x, data, fmt: str, N: int, K: int, config, sms: int, unpack: int, return_kernel: bool = False,
              waves: int = 2, fixup: bool = True, scales=None, biases=None, bits: int = 0, group_size: int = 0,
              rows_per_program: int = 4, x2=None, pdl: bool = False, x_perm: bool = False, up=None,
              fast_silu: bool = True, experts=None, top_k: int = 1, n_experts: int = 1):
    """Run gemv_m1_kernel for x [M, K] and a weight buffer (GGUF blocks, or MLX words with ``scales``/``biases``);
    returns y [split, M, N] (float32 partials when split > 1, for ops._finish to sum), and with return_kernel the
    compiled kernel too. ``config`` is (R, NB, num_warps, num_stages[, KT[, H[, waves]]]) with R rows per thread
    (KT and H: see gemv_m1_kernel; waves from the config replaces the argument); K is split until the
    grid has ``waves`` programs per SM. Each program takes up to ``rows_per_program`` (1, 2 or 4) activation rows,
    which share its unpacked weights. With ``x2`` (same shape, dtype and row stride as x; see m1_supports) the
    activations are silu(x) * x2 (``fast_silu``: sigmoid through tanh.approx on the GPU). With ``fixup`` (and a
    counter buffer, see _runtime.split_counters) the kernel sums its own split-K partials and y is [1, M, N]. With
    ``pdl`` the launch may overlap the previous kernel (see _pdl.py). With ``x_perm`` x is in lane order ([M,
    lanes_width(K)], see lane_order): q4_k with KT = 8, NB = 1, H = 1 only.

    With ``up`` (q4_k weights of the up projection, [N, K] like ``data``, 16-byte aligned) the kernel computes
    silu(x W^T) * (x up^T) (GLU, one K split, the config's R even) and returns y [1, M, N].

    With ``experts`` (int32 [P], the pairs' experts) ``data`` (and ``up``) stack ``n_experts`` matrices of N rows:
    y [1, P, N] holds pair p's product of x row p // ``top_k`` with its expert's rows (one K split)."""
    import torch


    reps, nb, warps, stages = config[:4]
    kt = config[4] if len(config) > 4 else 1  # lanes along K (consecutive blocks of a row)
    h = config[5] if len(config) > 5 else 1  # threads per format chunk
    if x_perm and (fmt != "q4_k" or (nb, kt, h) != (1, 8, 1) or x.shape[1] != lanes_width(K) or x2 is not None):
        raise ValueError(f"lane-order activations need q4_k with NB=1, KT=8, H=1, x [M, {lanes_width(K)}] and no "
                         f"x2, got {fmt} with config {tuple(config)}, x {tuple(x.shape)}")
    waves = config[6] if len(config) > 6 else waves  # a tuned split rule overrides the argument
    if up is not None:
        if fmt != "q4_k" or reps % 2 or x2 is not None or up.data_ptr() % 16 or up.shape != data.shape:
            raise ValueError(f"GLU needs q4_k weights and up of one shape, 16-byte aligned, an even R and no x2; got "
                             f"{fmt}, config {tuple(config)}, up {tuple(up.shape)} for {tuple(data.shape)}")
        waves = 0  # one K split: silu needs whole sums
    fid, C, U, P, BS, BB = m1_layout(fmt, bits, group_size, K)
    V = 4 if fid == 13 and bits == 4 else 8  # bytes per thread and load
    if h < 1 or U % h or (U // h) % V or (32 // C) % h:
        raise ValueError(f"config: {h} threads per chunk do not divide the format's {U}-byte chunks into "
                         f"{V}-byte loads within a warp")
    if fid == 12 and h < 2:
        raise ValueError(f"config: q6_k needs at least 2 threads per chunk (one 16-weight scale group each), got "
                         f"{tuple(config)}")
    C, U = C * h, U // h
    rows_t = 32 // C * warps  # one row (or with kt, one block of a row) per thread and rep
    if (32 // C) % kt:
        raise ValueError(f"config: lanes along K ({kt}) must divide the {32 // C} lanes per warp on the row axis")
    block_n = rows_t // kt * reps // (2 if up is not None else 1)  # outputs per program
    row_bytes = data.shape[-1] * data.element_size()
    nblocks = K // BS
    programs_n = triton.cdiv(N, block_n)
    M = x.shape[0] if experts is None else experts.shape[0]
    # 3 rows run as 4 (one repeated, not stored): the MR=3 build measured slower than MR=4 on an H100
    mr = 1 if experts is not None else max(1, min(4 if M == 3 else M, rows_per_program, 4))
    if experts is not None:
        waves = 0  # one K split: an expert's rows are few, and pairs fill the grid
    grid_m = triton.cdiv(M, mr)
    split, per_split = split_k(programs_n * grid_m, nblocks, nb * kt, sms, waves)
    even = per_split % (nb * kt) == 0 and nblocks % (nb * kt) == 0
    y, part, counters = split_outputs(M, x.dtype, x.device, N, split, programs_n * grid_m, fixup)
    w8 = data.view(torch.uint8)
    # MLX 4-bit reads x as int32 words (pairs); other formats pass x itself in that slot (unused)
    xw = x.view(torch.int32) if fid == 13 and bits == 4 else x
    ws = scales if scales is not None else w8
    wb = biases if biases is not None else w8
    silu = 0 if x2 is None else (2 if unpack == 2 and fast_silu else 1)  # 2: tanh.approx (inline PTX, GPU only)
    kernel = gemv_m1_kernel[(programs_n, split, grid_m)](
        x, xw, w8, w8.view(torch.float16), ws, wb, y, part, counters if counters is not None else y, M, N, K,
        x.stride(0), y.stride(0), y.stride(1), row_bytes, scales.stride(0) if scales is not None else 0, nblocks,
        per_split, split, _x2_offset(x, x2, 2 if fid == 13 and bits == 4 else 1),
        up.view(torch.uint8) if up is not None else w8,
        FMT=fid, NB=nb, C=C, U=U, P=P, BS=BS, BLOCK_BYTES=BB, ROWS_T=rows_t, R=reps, BITS=bits, MR=mr,
        UNPACK=unpack, FIXUP=counters is not None, SILU=silu, KT=kt, H=h, EVEN=even, PDL=pdl, XP=x_perm,
        GLU=up is not None, EXPERT=experts, n_experts=n_experts, TOPK=top_k if experts is not None else 0,
        num_warps=warps, num_stages=stages, **pdl_options(pdl))
    return (y, kernel) if return_kernel else y


def compile_sm90(fmt: str, config: tuple, top_k: int = 0, glu: bool = False, dtype: str = "bf16"):
    """gemv_m1_kernel compiled for sm_90 without a GPU (ptxas ships with Triton; set TRITON_INTERPRET=0 before
    importing llmkernels): ``config`` as launch_m1 takes it, ``top_k`` > 0 the mixture-of-experts build. For tests
    and for reading the code the compiler makes."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fid, C, U, P, BS, BB = m1_layout(fmt)
    reps, nb, warps, stages = config[:4]
    kt = config[4] if len(config) > 4 else 1
    h = config[5] if len(config) > 5 else 1
    sig = {"X": f"*{dtype}", "XW": f"*{dtype}", "W8": "*u8", "W16": "*fp16", "WS": "*u8", "WB": "*u8",
           "Y": f"*{dtype}", "PART": f"*{dtype}", "COUNT": f"*{dtype}", "WU": "*u8"}
    sig.update({name: "i32" for name in ("M", "N", "K", "stride_xm", "stride_ys", "stride_ym", "row_bytes",
                                          "scale_stride", "nblocks", "blocks_per_split", "split", "x2_off")})
    consts = dict(FMT=fid, NB=nb, C=C * h, U=U // h, P=P, BS=BS, BLOCK_BYTES=BB, ROWS_T=32 // (C * h) * warps, R=reps,
                  BITS=0, MR=1, UNPACK=2, FIXUP=False, SILU=0, KT=kt, H=h, EVEN=False, PDL=False, XP=False, GLU=glu,
                  TOPK=top_k)
    if top_k:
        sig.update(EXPERT="*i32", n_experts="i32")
    else:
        consts.update(EXPERT=None, n_experts=1)
    sig.update({name: "constexpr" for name in consts})
    return triton.compile(ASTSource(gemv_m1_kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})
