"""Small-M GEMV (M <= 4) for q4_0 and q8_0 from aligned word loads, block scales factored out of the products.

A q4_0 block is 18 bytes (fp16 d, 16 code bytes) and a q8_0 block 34 (d, 32 codes), so their codes are only 2-byte
aligned, and a kernel that loads them where they lie gets 2-byte loads. G consecutive blocks are 16-byte (q4_0, G = 8:
144 bytes) or 8-byte (q8_0, G = 4: 136 bytes) aligned when K is a multiple of 256, so this kernel loads a row's G
blocks as NV + 1 vectors of VW int32 words (q4_0: 9 x 16 bytes), splits them into single words in the registers, and
rebuilds each block's code words from them: a block that starts in the middle of a word gets its code words from two
neighbours (one byte permute each), the next block's codes are word-aligned.

One thread holds R rows (ROWS_T = 32 * num_warps rows per rep). The math is the m1 kernel's (m1.py): a code becomes
the float 1 + q/256 (or 1 + q/16 for the high nibble) with one shift and one LOP3, sum_j q_j x_j is recovered from
sum_j (1 + q_j/256) x_j and sum_j x_j, and the block scale is applied once per block. x is read as int32 words (two
fp16/bf16 values each) and split into float32 once per step for the R rows; up to four activation rows per program
share the unpacked codes.
"""
import triton
import triton.language as tl

from .m1 import _ASM_PAIR, _ASM_Q8, _split_words, _store_rows, split_outputs

# bytes 2, 3 of $1 and 0, 1 of $2: the code word of a block that starts at byte 2 of a word
_ASM_FUNNEL = tl.constexpr("prmt.b32 $0, $1, $2, 0x5432;")
WORDS_FORMATS = {"q4_0": (3, 18, 4), "q8_0": (7, 34, 8)}  # format -> (FMT id, block bytes, code words per block)


@triton.jit
def _scalars(t, A: tl.constexpr, B: tl.constexpr, N: tl.constexpr, LOG: tl.constexpr):
    """A [A, B, N] tile whose last axis lies in one thread -> a tuple of its N slices [A, B], in order."""
    parts = (tl.reshape(t, (A, B, N)),)
    for lvl in tl.static_range(LOG):
        nxt = ()
        for i in tl.static_range(1 << lvl):
            even, odd = tl.split(tl.reshape(parts[i], (A, B, N >> (lvl + 1), 2)))
            nxt = nxt + (even, odd)
        parts = nxt
    # each split separated the lowest index bit, so slice i sits at the bit reversal of i
    out = ()
    # (a plain assignment would turn the index into a tensor: it stays an inline constant expression, LOG <= 6)
    tl.static_assert(LOG <= 6)
    for i in tl.static_range(N):
        out = out + (tl.reshape(parts[(((i & 1) << (LOG - 1) % 8) | (((i >> 1) & 1) << (LOG - 2) % 8)
                                       | (((i >> 2) & 1) << (LOG - 3) % 8) | (((i >> 3) & 1) << (LOG - 4) % 8)
                                       | (((i >> 4) & 1) << (LOG - 5) % 8) | (((i >> 5) & 1) << (LOG - 6) % 8))
                                      if LOG > 0 else 0], (A, B)),)
    return out


@triton.jit
def _funnel(a, b, UNPACK: tl.constexpr):
    """The word made of the high half of a and the low half of b."""
    if UNPACK == 2:
        return tl.inline_asm_elementwise(_ASM_FUNNEL, "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)
    else:
        return ((a >> 16) & 0xFFFF) | (b << 16)


@triton.jit
def _block_codes(words, j: tl.constexpr, BB: tl.constexpr, NW: tl.constexpr, UNPACK: tl.constexpr):
    """(fp16 scale d as float32, its NW code words) of block j of a group held as single words ``words``: the
    block starts at byte BB * j, in word (BB * j) // 4."""
    if (BB * j) % 4 == 0:  # d in the low half of that word, codes across word boundaries (one permute each)
        d = _split_words(words[(BB * j) // 4], tl.float16)[0]
        cw = ()
        for t in tl.static_range(NW):
            cw = cw + (_funnel(words[(BB * j) // 4 + t], words[(BB * j) // 4 + t + 1], UNPACK), )
    else:  # d in the high half, codes word-aligned from the next word
        d = _split_words(words[(BB * j) // 4], tl.float16)[1]
        cw = ()
        for t in tl.static_range(NW):
            cw = cw + (words[(BB * j) // 4 + 1 + t], )
    return d, cw


@triton.jit
def _unpack_word(w, FMT: tl.constexpr, UNPACK: tl.constexpr):
    """The 4 bytes of int32 codes ``w`` as floats: q4_0 -> 8 values (1 + lo/256 of bytes 0-3, then 1 + hi/16),
    q8_0 -> 4 values 1 + (q + 128)/256."""
    if FMT == 3:
        if UNPACK == 2:
            return tl.inline_asm_elementwise(_ASM_PAIR, "=r,=r,=r,=r,=r,=r,=r,=r,r", [w], dtype=(tl.float32, ) * 8,
                                             is_pure=True, pack=1)
        else:
            lo = ()
            hi = ()
            for k in tl.static_range(4):
                t = ((w >> (8 * k)) & 0xFF) << 15
                lo = lo + (((t & 0x78000) | 0x3F800000).to(tl.float32, bitcast=True), )
                hi = hi + (((t & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True), )
            return lo + hi
    else:
        if UNPACK == 2:
            return tl.inline_asm_elementwise(_ASM_Q8, "=r,=r,=r,=r,r", [w], dtype=(tl.float32, ) * 4, is_pure=True,
                                             pack=1)
        else:
            out = ()
            for k in tl.static_range(4):
                b = (((w >> (8 * k)) & 0xFF) ^ 0x80) << 15
                out = out + ((b | 0x3F800000).to(tl.float32, bitcast=True), )
            return out


@triton.jit
def _block_update(codes, d, x_ptrs, XBF16: tl.constexpr, ROWS_T: tl.constexpr, FMT: tl.constexpr):
    """One activation row's increment for one block: d * (sum_j q_j x_j + zero * sum_j x_j) with the codes as
    floats (``codes``: NW words' values, see _unpack_word) and x through int32 pointers [ROWS_T, 1, 4, 4]."""
    xs = _scalars(tl.load(x_ptrs), ROWS_T, 1, 16, 4)  # 16 words: x[2i], x[2i + 1]
    xf = ()
    for i in tl.static_range(16):
        if XBF16:
            a, b = _split_words(xs[i], tl.bfloat16)
        else:
            a, b = _split_words(xs[i], tl.float16)
        xf = xf + (a, b)
    if FMT == 3:
        # byte 4t + k of the codes: low nibble with x[4t + k], high nibble with x[16 + 4t + k];
        # sum (q - 8) x = 256 (s0 - sx0) + 16 (s1 - sx1) - 8 (sx0 + sx1)
        s0 = codes[0] * xf[0]
        s1 = codes[4] * xf[16]
        sx0 = xf[0]
        sx1 = xf[16]
        for i in tl.static_range(1, 16):
            s0 += codes[(i // 4) * 8 + i % 4] * xf[i]
            s1 += codes[(i // 4) * 8 + 4 + i % 4] * xf[16 + i]
            sx0 += xf[i]
            sx1 += xf[16 + i]
        return d * (256.0 * s0 + 16.0 * s1 - 264.0 * sx0 - 24.0 * sx1)
    else:
        # byte i with x[i]: sum (b - 128) x = 256 (s - sx) - 128 sx
        s0 = codes[0] * xf[0]
        s1 = codes[16] * xf[16]
        sx0 = xf[0]
        sx1 = xf[16]
        for i in tl.static_range(1, 16):
            s0 += codes[i] * xf[i]
            s1 += codes[16 + i] * xf[16 + i]
            sx0 += xf[i]
            sx1 += xf[16 + i]
        return d * (256.0 * (s0 + s1) - 384.0 * (sx0 + sx1))


@triton.jit
def gemv_words_kernel(XW, W32, Y, PART, COUNT, M, N, stride_xm, stride_ys, stride_ym, row_words, ngroups,
                      groups_per_split, split,
                      FMT: tl.constexpr, BB: tl.constexpr, NW: tl.constexpr, G: tl.constexpr, VW: tl.constexpr,
                      NV: tl.constexpr, LOG_MAIN: tl.constexpr, LOG_VW: tl.constexpr, ROWS_T: tl.constexpr,
                      R: tl.constexpr, MR: tl.constexpr, XBF16: tl.constexpr, UNPACK: tl.constexpr,
                      FIXUP: tl.constexpr, KT: tl.constexpr = 1):
    """y[m, n] (+)= sum over this program's K split of x[m] . w[n] for BLOCK_N = ROWS_T * R rows.

    A step is one group of G blocks per row: NV vectors of VW words [ROWS_T, R, NV, VW] and one more vector
    [ROWS_T, R, VW] (Triton's layout keeps both in the thread: threads and warps go over ROWS_T). XW is x as int32
    words (stride_xm counts x elements).

    KT > 1: lane t of the ROWS_T axis takes row t // KT and group t % KT of each KT consecutive groups, so one warp
    load covers KT neighbouring groups of a row; the KT partial sums of a row are added after the loop. The split
    must be a whole number of KT-group steps (launch_words checks)."""
    ROWS_G: tl.constexpr = ROWS_T // KT  # distinct rows per rep
    BLOCK_N: tl.constexpr = ROWS_G * R
    GW: tl.constexpr = G * BB // 4  # words per group, NV * VW + VW
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    m0 = pid_m * MR
    rt = tl.arange(0, ROWS_T)[:, None]
    rr = tl.arange(0, R)[None, :]
    # rows past N read row N - 1 (in bounds, never stored), so the weight loads need no mask
    rows = tl.minimum(pid_n * BLOCK_N + rr * ROWS_G + rt // KT, N - 1).to(tl.int64)  # [ROWS_T, R]
    g_start = pid_k * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, ngroups)
    base = rows * row_words + (g_start + rt % KT) * GW
    w_ptrs = W32 + base[:, :, None, None] + tl.arange(0, NV)[None, None, :, None] * VW \
        + tl.arange(0, VW)[None, None, None, :]
    t_ptrs = W32 + base[:, :, None] + NV * VW + tl.arange(0, VW)[None, None, :]
    # x words of block j of the lane's first group: [ROWS_T, 1, 4, 4] (with KT = 1 the row axis only broadcasts, so
    # x gets the rows' layout)
    xv = tl.arange(0, 4)[None, None, :, None] * 4 + tl.arange(0, 4)[None, None, None, :] \
        + ((rt % KT) * G * 16)[:, :, None, None]
    x_ptrs = XW + m0 * (stride_xm // 2) + g_start * G * 16 + xv
    xo1 = (tl.minimum(m0 + 1, M - 1) - m0) * (stride_xm // 2)
    xo2 = (tl.minimum(m0 + 2, M - 1) - m0) * (stride_xm // 2)
    xo3 = (tl.minimum(m0 + 3, M - 1) - m0) * (stride_xm // 2)
    acc0 = tl.zeros([ROWS_T, R], dtype=tl.float32)
    acc1 = tl.zeros([ROWS_T, R], dtype=tl.float32)
    acc2 = tl.zeros([ROWS_T, R], dtype=tl.float32)
    acc3 = tl.zeros([ROWS_T, R], dtype=tl.float32)
    for g in range(g_start, g_end, KT):
        words = _scalars(tl.load(w_ptrs), ROWS_T, R, NV * VW, LOG_MAIN) + _scalars(tl.load(t_ptrs), ROWS_T, R, VW,
                                                                                  LOG_VW)
        for j in tl.static_range(G):
            d, cw = _block_codes(words, j, BB, NW, UNPACK)
            codes = ()
            for t in tl.static_range(NW):
                codes = codes + _unpack_word(cw[t], FMT, UNPACK)
            xj = x_ptrs + j * 16
            acc0 += _block_update(codes, d, xj, XBF16, ROWS_T, FMT)
            if MR > 1:
                acc1 += _block_update(codes, d, xj + xo1, XBF16, ROWS_T, FMT)
            if MR > 2:
                acc2 += _block_update(codes, d, xj + xo2, XBF16, ROWS_T, FMT)
            if MR > 3:
                acc3 += _block_update(codes, d, xj + xo3, XBF16, ROWS_T, FMT)
        w_ptrs += KT * GW
        t_ptrs += KT * GW
        x_ptrs += KT * G * 16
    rows2 = pid_n * BLOCK_N + rr * ROWS_G + tl.arange(0, ROWS_G)[:, None]
    _store_rows(_lane_sums(acc0, ROWS_G, KT, R), _lane_sums(acc1, ROWS_G, KT, R), _lane_sums(acc2, ROWS_G, KT, R),
                _lane_sums(acc3, ROWS_G, KT, R), rows2, Y, PART, COUNT, M, N, m0, pid_m, pid_k, split, stride_ys,
                stride_ym, ROWS_G, R, MR, FIXUP)


@triton.jit
def _lane_sums(acc, ROWS_G: tl.constexpr, KT: tl.constexpr, R: tl.constexpr):
    """[ROWS_G, R] row sums of an accumulator [ROWS_T, R] whose ROWS_T axis holds KT lanes per row."""
    if KT > 1:
        acc = tl.sum(tl.reshape(acc, [ROWS_G, KT, R]), axis=1)
    return acc


def words_layout(fmt: str, G: int):
    """(FMT id, block bytes, code words per block, VW, NV) for G blocks per step, or None."""
    if fmt not in WORDS_FORMATS:
        return None
    fid, bb, nw = WORDS_FORMATS[fmt]
    gb = G * bb
    vw = 4 if gb % 16 == 0 else (2 if gb % 8 == 0 else 1)
    nv = gb // 4 // vw - 1
    if nv & (nv - 1) or gb % 4:
        return None
    return fid, bb, nw, vw, nv


def words_supports(x, data, fmt: str, K: int) -> bool:
    """Whether gemv_words_kernel can take these operands: q4_0/q8_0, fp16/bf16 x whose rows can be read as int32
    words, 16-byte aligned weights and K a multiple of 256 (so every group of up to 8 blocks is 8- or 16-byte
    aligned)."""
    import torch

    return (fmt in WORDS_FORMATS and K % 256 == 0 and data.data_ptr() % 16 == 0 and data.is_contiguous()
            and x.dtype in (torch.float16, torch.bfloat16) and x.data_ptr() % 4 == 0 and x.stride(0) % 2 == 0
            and x.stride(1) == 1)


def launch_words(x, data, fmt: str, N: int, K: int, config, sms: int, unpack: int, waves: int = 4,
                 fixup: bool = True, rows_per_program: int = 2, return_kernel: bool = False):
    """Run gemv_words_kernel for x [M, K] and q4_0/q8_0 blocks; returns y [split, M, N] like m1.launch_m1.
    ``config`` is (R, G, num_warps, num_stages[, KT]): R rows per thread, G blocks per step, KT lanes along K (see
    gemv_words_kernel; 1 where the group count is not a multiple of KT)."""
    import torch

    from .ops import split_k

    reps, G, warps, stages = config[:4]
    fid, bb, nw, vw, nv = words_layout(fmt, G)
    rows_t = 32 * warps
    row_words = data.shape[-1] * data.element_size() // 4
    ngroups = K // (32 * G)
    kt = config[4] if len(config) > 4 and ngroups % config[4] == 0 else 1
    if 32 % kt:
        raise ValueError(f"config: lanes along K ({kt}) must divide the 32 lanes of a warp")
    block_n = rows_t // kt * reps
    programs_n = triton.cdiv(N, block_n)
    M = x.shape[0]
    # 2 activation rows per program measured best at M = 2..4 (H100, scripts/gemv_lab.py --m-curve wq4_0): with 4
    # and 8 blocks per step the kernel needs 191 registers
    mr = max(1, min(4 if M == 3 else M, rows_per_program, 4))
    grid_m = triton.cdiv(M, mr)
    # up to ``waves`` programs per SM (4 measured best on an H100), but a grid that already has two waves is not
    # split (the vocabulary projection: 1.84 TB/s unsplit, 1.55 split in two)
    split, per_split = split_k(programs_n * grid_m, ngroups, kt, sms, waves if programs_n * grid_m < 2 * sms else 0)
    y, part, counters = split_outputs(M, x.dtype, x.device, N, split, programs_n * grid_m, fixup)
    main = nv * vw
    kernel = gemv_words_kernel[(programs_n, split, grid_m)](
        x.view(torch.int32), data.view(torch.int32), y, part, counters if counters is not None else y, M, N,
        x.stride(0), y.stride(0), y.stride(1), row_words, ngroups, per_split, split,
        FMT=fid, BB=bb, NW=nw, G=G, VW=vw, NV=nv, LOG_MAIN=main.bit_length() - 1, LOG_VW=vw.bit_length() - 1,
        ROWS_T=rows_t, R=reps, MR=mr, XBF16=x.dtype == torch.bfloat16, UNPACK=unpack,
        FIXUP=counters is not None, KT=kt, num_warps=warps, num_stages=stages)
    return (y, kernel) if return_kernel else y
