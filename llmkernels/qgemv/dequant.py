"""Dequantize a tile of GGUF / MLX weights in registers (Triton), one branch per format.

A tile is [BLOCK_N rows, NB blocks, NSUB sub-blocks, SUB weights], so a sub-block's scale and min are loaded once as
[BLOCK_N, NB, NSUB, 1] and broadcast; the caller reshapes the result to [BLOCK_N, NB * NSUB * SUB]. Byte positions
follow llmkernels/quant/formats.py. ``W8`` is the row-major block bytes (uint8), ``W16`` the same memory viewed as
fp16 (GGUF block sizes are even, so every fp16 field sits at an even byte offset), ``WI8`` as int8.
"""
import triton
import triton.language as tl

from ..quant.formats import IQ4_VALUES, MXFP4_VALUES

# format ids (FMT constexpr), shared with the host through ``FORMAT_IDS``
F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MLX, IQ4_NL, IQ4_XS, MXFP4 = range(17)
FORMAT_IDS = {"f32": 0, "f16": 1, "bf16": 2, "q4_0": 3, "q4_1": 4, "q5_0": 5, "q5_1": 6, "q8_0": 7, "q2_k": 8,
              "q3_k": 9, "q4_k": 10, "q5_k": 11, "q6_k": 12, "mlx": 13, "iq4_nl": 14, "iq4_xs": 15, "mxfp4": 16}


def _words(levels):
    """16 int8 levels as 4 int32 words, level 4 j + i in byte i of word j (signed, as Triton takes constants)."""
    ws = [sum((levels[4 * j + i] & 0xFF) << (8 * i) for i in range(4)) for j in range(4)]
    return [tl.constexpr(w - (1 << 32) if w >= 1 << 31 else w) for w in ws]


IQ4_W0, IQ4_W1, IQ4_W2, IQ4_W3 = _words(IQ4_VALUES)
MX_W0, MX_W1, MX_W2, MX_W3 = _words(MXFP4_VALUES)


@triton.jit
def lookup16(q, W0, W1, W2, W3):
    """Level q (int32 codes 0..15) of a 16-level int8 codebook packed in words W0-W3, as float32: a lookup in
    registers (selects and a shift), no table in memory."""
    w = tl.where(q < 8, tl.where(q < 4, W0, W1), tl.where(q < 12, W2, W3))
    b = (w >> ((q & 3) * 8)) & 0xFF
    return ((b ^ 0x80) - 0x80).to(tl.float32)


@triton.jit
def e8m0_half(e):
    """E8M0 exponent bytes (int32) -> float32 2^(e - 128), subnormal below e = 2 (llama.cpp's decoding)."""
    bits = tl.where(e < 2, 0x00200000 << tl.minimum(e, 1), (e - 1) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _f16(W16, byte_off):
    return tl.load(W16 + byte_off // 2).to(tl.float32)


@triton.jit
def _u8(W8, byte_off, mask):
    return tl.load(W8 + byte_off, mask=mask, other=0).to(tl.int32)


@triton.jit
def dequant_tile(W8, W16, WI8, WS, WB, row_bytes, rows, blk, row_ok, blk_ok, scale_stride, K,
                 FMT: tl.constexpr, NB: tl.constexpr, NSUB: tl.constexpr, SUB: tl.constexpr,
                 BLOCK_BYTES: tl.constexpr, BITS: tl.constexpr):
    """rows: int64 [BLOCK_N]; blk: int32 [NB] block indices along the row. -> float32 [BLOCK_N, NB, NSUB, SUB].

    Dense formats (f32/f16/bf16) use "blocks" of NSUB * SUB consecutive weights and mask the row end at K.
    """
    r = rows[:, None, None, None]
    b = blk[None, :, None, None]
    s = tl.arange(0, NSUB)[None, None, :, None]
    i = tl.arange(0, SUB)[None, None, None, :]
    ok = row_ok[:, None, None, None] & blk_ok[None, :, None, None]
    ok_s = ok & (s >= 0)  # [BLOCK_N, NB, NSUB, 1]
    ok_e = ok_s & (i >= 0)  # full tile
    base = r * row_bytes + b * BLOCK_BYTES  # byte offset of each block
    e = s * SUB + i  # weight index inside the block
    if FMT == 0:  # f32: the "block" is one weight; SUB consecutive weights per (b, s)
        k = (b * NSUB + s) * SUB + i
        w = tl.load(W8.to(tl.pointer_type(tl.float32)) + r * (row_bytes // 4) + k, mask=ok_e & (k < K), other=0.0)
        return w.to(tl.float32)
    elif FMT == 1:
        k = (b * NSUB + s) * SUB + i
        return tl.load(W16 + r * (row_bytes // 2) + k, mask=ok_e & (k < K), other=0.0).to(tl.float32)
    elif FMT == 2:
        k = (b * NSUB + s) * SUB + i
        raw = tl.load(W16.to(tl.pointer_type(tl.int16)) + r * (row_bytes // 2) + k, mask=ok_e & (k < K), other=0)
        return (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    elif FMT == 3:  # q4_0: d, then 16 bytes: weight e in byte e % 16, high nibble for e >= 16
        d = tl.load(W16 + base // 2, mask=ok, other=0.0).to(tl.float32)
        q = (_u8(W8, base + 2 + e % 16, ok_e) >> ((e // 16) * 4)) & 0xF
        return d * (q - 8).to(tl.float32)
    elif FMT == 4:  # q4_1: d, m, 16 bytes
        d = tl.load(W16 + base // 2, mask=ok, other=0.0).to(tl.float32)
        m = tl.load(W16 + base // 2 + 1, mask=ok, other=0.0).to(tl.float32)
        q = (_u8(W8, base + 4 + e % 16, ok_e) >> ((e // 16) * 4)) & 0xF
        return d * q.to(tl.float32) + m
    elif FMT == 5:  # q5_0: d, qh (4 bytes, bit e), qs (16 bytes)
        d = tl.load(W16 + base // 2, mask=ok, other=0.0).to(tl.float32)
        lo = (_u8(W8, base + 6 + e % 16, ok_e) >> ((e // 16) * 4)) & 0xF
        hi = (_u8(W8, base + 2 + e // 8, ok_e) >> (e % 8)) & 1
        return d * ((lo | (hi << 4)) - 16).to(tl.float32)
    elif FMT == 6:  # q5_1: d, m, qh, qs
        d = tl.load(W16 + base // 2, mask=ok, other=0.0).to(tl.float32)
        m = tl.load(W16 + base // 2 + 1, mask=ok, other=0.0).to(tl.float32)
        lo = (_u8(W8, base + 8 + e % 16, ok_e) >> ((e // 16) * 4)) & 0xF
        hi = (_u8(W8, base + 4 + e // 8, ok_e) >> (e % 8)) & 1
        return d * (lo | (hi << 4)).to(tl.float32) + m
    elif FMT == 7:  # q8_0: d, 32 int8
        d = tl.load(W16 + base // 2, mask=ok, other=0.0).to(tl.float32)
        q = tl.load(WI8 + base + 2 + e, mask=ok_e, other=0).to(tl.float32)
        return d * q
    elif FMT == 8:  # q2_k: scales[16] (sc | m << 4), qs[64], d, dmin; 16 sub-blocks of 16
        sm = _u8(W8, base + s, ok_s)
        d = tl.load(W16 + base // 2 + 40, mask=ok, other=0.0).to(tl.float32)
        dmin = tl.load(W16 + base // 2 + 41, mask=ok, other=0.0).to(tl.float32)
        half = e // 128
        r128 = e % 128
        q = (_u8(W8, base + 16 + half * 32 + r128 % 32, ok_e) >> ((r128 // 32) * 2)) & 3
        return (d * (sm & 0xF).to(tl.float32)) * q.to(tl.float32) - dmin * (sm >> 4).to(tl.float32)
    elif FMT == 9:  # q3_k: hmask[32], qs[64], scales[12], d
        d = tl.load(W16 + base // 2 + 54, mask=ok, other=0.0).to(tl.float32)
        low = (_u8(W8, base + 96 + s % 8, ok_s) >> ((s // 8) * 4)) & 0xF
        high = (_u8(W8, base + 104 + s % 4, ok_s) >> ((s // 4) * 2)) & 3
        sc = (low | (high << 4)) - 32
        half = e // 128
        r128 = e % 128
        ql = (_u8(W8, base + 32 + half * 32 + r128 % 32, ok_e) >> ((r128 // 32) * 2)) & 3
        hb = (_u8(W8, base + e % 32, ok_e) >> (e // 32)) & 1
        q = ql - ((1 - hb) << 2)
        return (d * sc.to(tl.float32)) * q.to(tl.float32)
    elif FMT == 10 or FMT == 11:  # q4_k / q5_k: d, dmin, scales[12] (6-bit sc, m), [qh[32]], qs[128]
        d = tl.load(W16 + base // 2, mask=ok, other=0.0).to(tl.float32)
        dmin = tl.load(W16 + base // 2 + 1, mask=ok, other=0.0).to(tl.float32)
        s_lo = s % 4
        b_a = _u8(W8, base + 4 + s_lo, ok_s)  # sc (low 6 bits) of s < 4 / top 2 bits of sc for s >= 4
        b_b = _u8(W8, base + 8 + s_lo, ok_s)  # m likewise
        b_c = _u8(W8, base + 12 + s_lo, ok_s)  # low nibbles of sc / m for s >= 4
        first = s < 4
        sc = tl.where(first, b_a & 63, (b_c & 0xF) | ((b_a >> 6) << 4))
        mn = tl.where(first, b_b & 63, (b_c >> 4) | ((b_b >> 6) << 4))
        if FMT == 10:
            q = (_u8(W8, base + 16 + (s // 2) * 32 + i, ok_e) >> ((s % 2) * 4)) & 0xF
        else:
            lo = (_u8(W8, base + 48 + (s // 2) * 32 + i, ok_e) >> ((s % 2) * 4)) & 0xF
            q = lo | (((_u8(W8, base + 16 + i, ok_e) >> s) & 1) << 4)
        return (d * sc.to(tl.float32)) * q.to(tl.float32) - dmin * mn.to(tl.float32)
    elif FMT == 12:  # q6_k: ql[128], qh[64], scales[16] int8, d; 16 sub-blocks of 16
        d = tl.load(W16 + base // 2 + 104, mask=ok, other=0.0).to(tl.float32)
        sc = tl.load(WI8 + base + 192 + s, mask=ok_s, other=0).to(tl.float32)
        half = e // 128
        r128 = e % 128
        quarter = r128 // 32
        l = r128 % 32
        ql = (_u8(W8, base + half * 64 + (quarter % 2) * 32 + l, ok_e) >> ((quarter // 2) * 4)) & 0xF
        qh = (_u8(W8, base + 128 + half * 32 + l, ok_e) >> (quarter * 2)) & 3
        return (d * sc) * ((ql | (qh << 4)) - 32).to(tl.float32)
    elif FMT == 14 or FMT == 16:  # iq4_nl: d, 16 bytes / mxfp4: e, 16 bytes; nibbles as q4_0, codebook levels
        if FMT == 14:
            d = tl.load(W16 + base // 2, mask=ok, other=0.0).to(tl.float32)
            q = (_u8(W8, base + 2 + e % 16, ok_e) >> ((e // 16) * 4)) & 0xF
            return d * lookup16(q, IQ4_W0, IQ4_W1, IQ4_W2, IQ4_W3)
        d = e8m0_half(_u8(W8, base, ok))
        q = (_u8(W8, base + 1 + e % 16, ok_e) >> ((e // 16) * 4)) & 0xF
        return d * lookup16(q, MX_W0, MX_W1, MX_W2, MX_W3)
    elif FMT == 15:  # iq4_xs: d, scales_h (uint16), scales_l[4], qs[128]; 8 sub-blocks of 32
        d = tl.load(W16 + base // 2, mask=ok, other=0.0).to(tl.float32)
        lo = (_u8(W8, base + 4 + s // 2, ok_s) >> ((s % 2) * 4)) & 0xF
        hi = ((_u8(W8, base + 2 + s // 4, ok_s) >> ((s % 4) * 2)) & 3) << 4
        q = (_u8(W8, base + 8 + s * 16 + i % 16, ok_e) >> ((i // 16) * 4)) & 0xF
        return (d * ((lo | hi) - 32).to(tl.float32)) * lookup16(q, IQ4_W0, IQ4_W1, IQ4_W2, IQ4_W3)
    else:  # MLX affine: LSB-first bit stream of BITS-bit values in uint32 words; one group per block
        k = b * SUB + i  # weight index along the row (NSUB == 1)
        bit = k * BITS
        Wu32 = W8.to(tl.pointer_type(tl.int32))
        words_per_row = row_bytes // 4
        # logical shifts on uint32: an arithmetic shift would smear the sign bit into a value cut by the word end
        w0 = tl.load(Wu32 + r * words_per_row + bit // 32, mask=ok_e, other=0).to(tl.uint32, bitcast=True)
        sh = (bit % 32).to(tl.uint32)
        v = (w0 >> sh) & ((1 << BITS) - 1)
        if 32 % BITS != 0:  # 3, 5, 6 bits: a value can straddle two words
            spill = sh + BITS > 32
            w1 = tl.load(Wu32 + r * words_per_row + bit // 32 + 1, mask=ok_e & spill, other=0)
            w1 = w1.to(tl.uint32, bitcast=True)
            v = tl.where(spill, v | ((w1 << ((32 - sh) % 32)) & ((1 << BITS) - 1)), v)
        sc = tl.load(WS + r * scale_stride + b, mask=ok, other=0.0).to(tl.float32)
        bi = tl.load(WB + r * scale_stride + b, mask=ok, other=0.0).to(tl.float32)
        return sc * v.to(tl.float32) + bi
