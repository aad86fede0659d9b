"""GEMV on the tensor cores for M <= 64 (gemv routes q4_0, q8_0, q6_k, iq4_nl and mxfp4 here from M = 1, q4_k and
MLX 4-bit from M = 2, q5_k from M = 3, MLX 4-bit and q5_k one M earlier on long or wide matrices:
route.TC_FIRST_M): weights dequantized to fp16/bf16 in registers and fed to tl.dot.

Each weight is turned into x's dtype with inline PTX that handles a pair of values per instruction (Marlin's trick:
the nibble is masked into the mantissa of a magic float, the magic subtracted exactly, then one fma applies the
sub-block's scale and min), so the per-weight cost does not depend on M: the M rows share every dequantized tile.
The weight is rounded once to fp16 (or bf16) before the product, like dequantizing first and calling cuBLAS.

A step is one super-block (256 weights, 144 bytes) of BLOCK_N rows; the dot's k order is chosen so that the
dequantized tile is already in the wgmma A-operand layout (no shared-memory round trip):
- the code tile is [4 t, 8 g, A, 2 h, 2 half, 16 byte]: row 16 a + 8 h + g, byte b = 16 half + byte of chunk t
  (low nibble = weight 64 t + b, high = 64 t + 32 + b). Triton gives lanes to t and g (lane = t + 4 g, as in the
  mma fragment), warps to a, and keeps h, half and the 16 bytes in the thread (16-byte loads). With the 32 bytes
  as one axis it would spread them over two lanes;
- the dot's column k = 16 lh + 8 p + 2 t + ll holds weight 64 t + 32 p + 2 lh + ll, so lane (t, g) owns exactly
  the fragment elements k = 16 j + 2 t + {0, 1, 8, 9} of rows g and g + 8;
- the 16-byte header comes as one vector per row through pointers [4, 8, A, 2, 4] of the same layout (each lane
  decodes the scales of its chunk), and x is loaded in natural order ([256, M_PAD], 16-byte loads) and permuted to
  the k order on its way into shared memory, where the wgmma reads it as the B operand.
MLX 4-bit uses the same tile: a step is 128 bytes of codes per row, byte b of chunk t holding weights 64 t + 2 b (low
nibble) and 64 t + 2 b + 1 (high), so only x's permutation differs; each 16-byte half chunk takes the scale and bias
of its group (group size 32, 64 or 128) as its fma operands.
q4_0 and q8_0 (18- and 34-byte blocks of 32 weights, fp16 d first) use the same k order with a lane's two blocks in
place of q4_k's two half chunks: a step is 8 blocks (256 weights: 144 or 272 bytes, 16-byte aligned when K is a
multiple of 256), and lane t's blocks 2t and 2t + 1 start at byte 36t (q4_0) or 68t (q8_0), 4t bytes past a 16-byte
boundary. So each lane loads 3 (q4_0) or 5 (q8_0) aligned 16-byte vectors from byte 32t (64t), shifts them down by t
words with two levels of selects, takes block 2t's codes across word halves (one byte permute per word) and block
2t + 1's codes as whole words. q8_0 codes become fp16 exactly through a magic float (1024 + (q ^ 128) - 1152, then
one multiply by d); bf16 cannot hold 8-bit magic values, so there the low 7 bits go through the magic float and the
sign bit selects -128 d as the fma's addend (w = r d - 128 d s, rounded once).
q5_k (176-byte blocks: q4_k's header, 32 bytes of qh, q4_k's codes) reads the same tiles plus qh's 32 bytes at the
codes' byte indices; lane chunk t's fifth bits sit at bits 2t, 2t + 1 of those bytes and join the magic float's byte
once per word (_qh_bits). q6_k (210-byte blocks: 128 bytes of low nibbles, 64 of qh, 16 int8 scales, fp16 d) takes
chunk t = 2 h6 + c as 32 low-nibble bytes at the q4_k codes' offsets (low nibble weight 128 h6 + 32 c + b, high
+ 64) with qh bytes 128 + 32 h6 + b (bits 2c, 2c + 1 and 4 + 2c, 5 + 2c); its blocks start 2 (kb % 8) bytes past a
16-byte boundary, so the lane loads aligned vectors and shifts them into place (_shift_words).
iq4_nl (q4_0's block layout, 16 int8 levels times d) and mxfp4 (17-byte blocks: an E8M0 exponent, then q4_0's
nibbles of E2M1 levels) look up the two bytes of each nibble's fp16 / bf16 level by byte permutes (_asm_codebook).
mxfp4's lane blocks start at an even offset 0..14 past a 16-byte boundary, so each lane loads three aligned vectors
and shifts them per lane (_mx_lane_blocks). Both read any K: the last step's missing blocks weigh zero and x is
masked past K; their rows must be 16-byte aligned (quant.tensor.pad_rows, as the engine pads expert stacks).
From 17 activation rows on (route.TC_XT_MIN_M) gemv hands x over already in this k order (tc_order, one small launch)
and the kernel (XT) reads each step's [M_PAD, 256] x tile through a TMA descriptor straight into shared memory: every
program re-reads x every step, and from 32 rows that traffic, loaded and permuted in registers, outweighed the
weights' (q4_k 28672x4096 at M = 64: 86.4 -> 48.4 us on an H100; bench/NOTES.md).
Loads go straight to registers (num_stages 1): letting Triton's pipeliner stage the codes in shared memory measured
2x slower (bank-conflicted reads of each thread's 64 contiguous bytes; ncu: L1 75% busy, MIO throttle), and loading
the next step's codes and scales one step ahead 20-30% slower (163 registers: 3 programs per SM instead of 4).
"""
import triton
import triton.language as tl

from .._pdl import pdl_options, pdl_supported, pdl_trigger, pdl_wait
from .common import split_k, split_outputs, store_tile
from .m1 import _q4k_scales, _silu_mul, _split_words
from .words import _funnel
from ..quant.formats import IQ4_VALUES, MXFP4_VALUES


def _nibbles(bf16: bool, finish, mag=("m", "m", "m", "m"), offset: int = 0) -> str:
    """PTX for the 4 nibble pairs of a word spread by prmt into t0 (bytes 0, 1) and t1 (bytes 2, 3): pair i (0, 1:
    low nibbles of t0, t1; 2, 3: high nibbles) is masked into the mantissa of a magic float (fp16 1024 + q, bf16 128
    + q; fp16 takes the high nibble in place as 1024 + 16 q and rescales it with one fma) and the magic plus
    ``offset`` (0, or q6_k's 32) subtracted exactly, leaving q - offset in ``a``; ``finish(i)`` applies the scale and
    stores the pair. ``mag[i]`` names the register OR-ed in as pair i's magic: m itself, or (q5_k / q6_k) m with the
    code's high bits already in place (_qh_bits)."""
    # m: the magic float plus offset, subtracted from every pair (with offset 32 the pairs OR in e0 .. e3 instead)
    assert offset == 0 or "m" not in mag
    if bf16:
        code = f"shr.b32 u0, t0, 4; shr.b32 u1, t1, 4; mov.b32 m, {'0x43204320' if offset else '0x43004300'}; "
        for i, src in enumerate(("t0", "t1", "u0", "u1")):
            code += f"lop3.b32 a, {src}, 0x000F000F, {mag[i]}, 0xEA; sub.rn.bf16x2 a, a, m; " + finish(i)
        return code
    # 1024 (+ 32); (1024 + 16 q) / 16 - 64 (- 32)
    code = (f"mov.b32 m, {'0x64206420' if offset else '0x64006400'}; mov.b32 h, 0x2C002C00; "
            f"mov.b32 k, {'0xD600D600' if offset else '0xD400D400'}; ")
    for i, src in enumerate(("t0", "t1", "t0", "t1")):
        if i < 2:
            code += f"lop3.b32 a, {src}, 0x000F000F, {mag[i]}, 0xEA; sub.f16x2 a, a, m; " + finish(i)
        else:
            code += f"lop3.b32 a, {src}, 0x00F000F0, {mag[i]}, 0xEA; fma.rn.f16x2 a, a, h, k; " + finish(i)
    return code


def _asm_q4(bf16: bool) -> str:
    """PTX: 4 packed bytes ($4) and per-element scales -> w = q * s + nz for the low and the high nibbles.

    Outputs $0,$1: low nibbles of bytes (0,1), (2,3); $2,$3: high nibbles. Inputs: $4 bytes, $5,$6 s_lo, $7,$8 nz_lo,
    $9,$10 s_hi, $11,$12 nz_hi (two 16-bit values per register). A byte pair is spread into the two halves of a
    register (prmt) and unpacked by _nibbles; then one fma per pair applies the sub-block's scale and min."""
    t = "bf16x2" if bf16 else "f16x2"
    regs = "t0, t1, u0, u1, m, a" if bf16 else "t0, t1, m, h, k, a"
    return (f"{{ .reg .b32 {regs}; prmt.b32 t0, $4, 0, 0x4140; prmt.b32 t1, $4, 0, 0x4342; "
            + _nibbles(bf16, lambda i: f"fma.rn.{t} ${i}, a, ${(5, 6, 9, 10)[i]}, ${(7, 8, 11, 12)[i]}; ") + "}")


def _asm_words(fmt: str, bf16: bool) -> str:
    """PTX: one int32 word of codes and the scales of its values (16-bit operands) -> the word's weights as 16-bit
    outputs, computed two at a time and split with mov.b32 {lo, hi}.

    "q4" (q4_0): 8 outputs $0 .. $7 = low, high nibble of byte 0, low, high of byte 1, ...; inputs $8 the word, $9 d,
    $10 -8 d: a byte pair spread into the two halves of a register (prmt), unpacked by _nibbles, then one fma per
    pair applies d and -8 d. "q8" (q8_0): 4 outputs (bytes 0 .. 3), $4 the word, $5 d, $6
    -128 d: fp16 masks (q ^ 128) into the mantissa of 1024.0, subtracts 1152 (exact) and multiplies by d; bf16 (8
    significant bits, too few for 1024 + 255) masks the low 7 bits into 128.0, and the sign bits, replicated by prmt
    into a mask, select -128 d as the fma's addend (w = r d - 128 d s, one rounding)."""
    if fmt == "q4":
        w, s, z = "$8", "$9", "$10"
        outs = ("$0, $2", "$4, $6", "$1, $3", "$5, $7")  # pair i's two values: byte 2j's and 2j + 1's nibble p
        t = "bf16x2" if bf16 else "f16x2"
        body = _nibbles(bf16, lambda i: f"fma.rn.{t} a, a, sd, zd; mov.b32 {{{outs[i]}}}, a; ")
    else:
        w, s, z = "$4", "$5", "$6"
        body = _int8_pairs(bf16, "$0, $1", "$2, $3")
    return ("{ .reg .b32 t0, t1, u0, u1, m, h, k, a, sd, zd; "
            f"mov.b32 sd, {{{s}, {s}}}; mov.b32 zd, {{{z}, {z}}}; "
            f"prmt.b32 t0, {w}, 0, 0x4140; prmt.b32 t1, {w}, 0, 0x4342; " + body + "}")


def _int8_pairs(bf16: bool, out0: str, out1: str, word: str = "$4") -> str:
    """PTX: the 4 int8 values of ``word``, already spread by prmt into t0 (bytes 0, 1) and t1 (bytes 2, 3), times
    sd -> out0 (bytes 0, 1) and out1 (bytes 2, 3). fp16 masks (q ^ 128) into the mantissa of 1024.0, subtracts
    1152 (exact) and multiplies by d; bf16 (8 significant bits, too few for 1024 + 255) masks the low 7 bits into
    128.0, and the sign bits, replicated by prmt into a mask, select zd = -128 d as the fma's addend."""
    if bf16:
        return (f"prmt.b32 u0, {word}, 0, 0x9988; prmt.b32 u1, {word}, 0, 0xBBAA; mov.b32 m, 0x43004300; "
                "and.b32 u0, u0, zd; and.b32 u1, u1, zd; "
                "lop3.b32 a, t0, 0x007F007F, m, 0xEA; sub.rn.bf16x2 a, a, m; fma.rn.bf16x2 a, a, sd, u0; "
                f"mov.b32 {{{out0}}}, a; "
                "lop3.b32 a, t1, 0x007F007F, m, 0xEA; sub.rn.bf16x2 a, a, m; fma.rn.bf16x2 a, a, sd, u1; "
                f"mov.b32 {{{out1}}}, a; ")
    return ("mov.b32 m, 0x64006400; mov.b32 k, 0x64806480; "
            "lop3.b32 a, t0, 0x00800080, m, 0xBE; sub.f16x2 a, a, k; mul.rn.f16x2 a, a, sd; "
            f"mov.b32 {{{out0}}}, a; "
            "lop3.b32 a, t1, 0x00800080, m, 0xBE; sub.f16x2 a, a, k; mul.rn.f16x2 a, a, sd; "
            f"mov.b32 {{{out1}}}, a; ")


def codebook_words(levels) -> tuple:
    """The 16 int8 levels of a codebook as 4 little-endian int32 words (signed; the byte-permute lookup table)."""
    b = [v & 0xFF for v in levels]
    u = [b[4 * i] | b[4 * i + 1] << 8 | b[4 * i + 2] << 16 | b[4 * i + 3] << 24 for i in range(4)]
    return tuple(x - (1 << 32) if x >= 1 << 31 else x for x in u)


def _half_bytes(levels, bf16: bool) -> tuple:
    """The fp16 (bf16) bit patterns of 16 levels split into a table of low bytes and one of high bytes, each as 4
    int32 words (codebook_words)."""
    import struct

    def bits(v):
        if bf16:
            return struct.unpack("<I", struct.pack("<f", float(v)))[0] >> 16  # levels are exact in bf16
        return struct.unpack("<H", struct.pack("<e", float(v)))[0]

    h = [bits(v) for v in levels]
    to8 = lambda b: b - 256 if b >= 128 else b  # noqa: E731
    return codebook_words([to8(b & 0xFF) for b in h]), codebook_words([to8(b >> 8) for b in h])


def _asm_codebook(levels, bf16: bool) -> str:
    """PTX for a word of codebook nibbles (iq4_nl, mxfp4: nibbles as q4_0's) -> its 8 weights level[q] * d as
    16-bit outputs in _asm_words' q4 order; inputs $8 the word, $9 d ($10 unused). Each nibble looks up the low and
    the high byte of its level's fp16 (bf16) pattern by byte permutes: its low 3 bits select a byte of entries 0-7
    and of 8-15, its bit 3 (moved to bit 2 of a selector) picks between the two; one more permute interleaves a
    pair's bytes into two 16-bit values, one multiply applies d. 26 instructions per 8 weights; mxfp4's fp16
    levels have zero low bytes, so that table is skipped (20)."""
    lo_w, hi_w = _half_bytes(levels, bf16)
    tables = (("h", hi_w),) if not any(lo_w) else (("l", lo_w), ("h", hi_w))
    consts = "".join(f"mov.b32 {n}{i}, {w[i] & 0xFFFFFFFF:#010x}; " for n, w in tables for i in range(4))
    code = ("and.b32 q, $8, 0x77777777; shr.b32 c, $8, 1; and.b32 c, c, 0x44444444; or.b32 c, c, 0x32103210; "
            + consts + ("" if len(tables) == 2 else "mov.b32 l, 0; "))
    mul = "mul.rn.bf16x2" if bf16 else "mul.rn.f16x2"
    for half in range(2):
        if half:
            code += "shr.b32 q, q, 16; shr.b32 c, c, 16; "
        for n, _ in tables:  # a, b: entries 0-7 and 8-15 of the 4 nibbles; n: the 4 looked-up bytes
            code += f"prmt.b32 a, {n}0, {n}1, q; prmt.b32 b, {n}2, {n}3, q; prmt.b32 {n}, a, b, c; "
        # nibble p of bytes 2 half and 2 half + 1 (nibbles p and 2 + p of this half) in one register, as the
        # dot's operand pairs them (_asm_words' q4 pairs): each value's (low, high) byte
        for p, sel in enumerate(("0x6240", "0x7351")):
            o = 4 * half + p
            code += f"prmt.b32 a, l, h, {sel}; {mul} a, a, sd; mov.b32 {{${o}, ${o + 2}}}, a; "
    regs = "q, c, a, b, l, h, sd, " + ", ".join(f"{n}{i}" for n, _ in tables for i in range(4))
    return f"{{ .reg .b32 {regs}; mov.b32 sd, {{$9, $9}}; " + code + "}"


def _qh_bits(bits: int, bf16: bool, codes: str, qh: str, shift: str) -> str:
    """PTX shared by q5_k and q6_k: spreads the word of codes ``codes`` into t0, t1 (as _nibbles wants) and puts the
    high bits of each weight from the word ``qh`` (qh bytes at the codes' byte indices), shifted right by ``shift``,
    into e0 .. e3: the magic float with pair i's high bits already in place (q5_k: the low nibble's at bit 0 of the
    shifted byte, the high nibble's at bit 1; q6_k: bits 0-1 and 4-5), so each pair's mask-and-OR takes e_i for m and
    the code is nibble + 16 hb at no cost per pair: 9 instructions per word beyond q4_k's."""
    mask = "0x10101010" if bits == 5 else "0x30303030"
    code = (f"prmt.b32 t0, {codes}, 0, 0x4140; prmt.b32 t1, {codes}, 0, 0x4342; shr.b32 hq, {qh}, {shift}; "
            f"shl.b32 hl, hq, 4; and.b32 hl, hl, {mask}; ")  # low nibbles' high bits at bit 4 (and 5) of each byte
    if bf16:  # the high nibbles are shifted down to bits 0..3 too: their high bits at bit 4 (and 5) as well
        code += "shl.b32 hh, hq, 3; and.b32 hh, hh, 0x10101010; " if bits == 5 else "and.b32 hh, hq, 0x30303030; "
        return code + ("prmt.b32 e0, hl, 0x43434343, 0x4140; prmt.b32 e1, hl, 0x43434343, 0x4342; "
                       "prmt.b32 e2, hh, 0x43434343, 0x4140; prmt.b32 e3, hh, 0x43434343, 0x4342; ")
    # fp16 keeps the high nibble in place (1024 + 16 q): its high bits go to bit 8 (and 9), in the magic's byte
    code += ("shr.b32 hh, hq, 1; lop3.b32 hh, hh, 0x01010101, 0x64646464, 0xEA; " if bits == 5
             else "shr.b32 hh, hq, 4; lop3.b32 hh, hh, 0x03030303, 0x64646464, 0xEA; ")
    return code + ("prmt.b32 e0, hl, 0x64646464, 0x4140; prmt.b32 e1, hl, 0x64646464, 0x4342; "
                   "prmt.b32 e2, hh, 0, 0x1404; prmt.b32 e3, hh, 0, 0x3424; ")


_QH_REGS = "hq, hl, hh, e0, e1, e2, e3"
_MAGS = ("e0", "e1", "e2", "e3")


def _asm_q5(bf16: bool) -> str:
    """PTX like _asm_q4 for q5_k: code q = nibble + 16 hb, hb from the qh byte at the same index, bit 2t (low nibble)
    or 2t + 1 (high) for lane chunk t. Inputs: $4 code bytes, $5 their qh bytes, $6 .. $9 the shift 2t (pack 4 gives
    an int32 operand 4 registers), $10 .. $17 the scales and addends as _asm_q4's $5 .. $12."""
    t = "bf16x2" if bf16 else "f16x2"
    regs = "t0, t1, u0, u1, m, a" if bf16 else "t0, t1, m, h, k, a"
    return (f"{{ .reg .b32 {regs}, {_QH_REGS}; " + _qh_bits(5, bf16, "$4", "$5", "$6")
            + _nibbles(bf16, lambda i: f"fma.rn.{t} ${i}, a, ${(10, 11, 14, 15)[i]}, ${(12, 13, 16, 17)[i]}; ", _MAGS)
            + "}")


def _asm_q6_words(bf16: bool) -> str:
    """PTX for q6_k code words: $8 a word of low-nibble bytes (ql), $9 the qh word of the same weights, $10 the
    shift 2c (chunk c of the half), $11 / $12 the scale d * sc of the low / high nibbles (16-bit) -> 8 16-bit
    outputs as _asm_words' q4: (q - 32) * scale, q = nibble + 16 hb exact before one rounding."""
    t = "bf16x2" if bf16 else "f16x2"
    regs = "t0, t1, u0, u1, m, a" if bf16 else "t0, t1, m, h, k, a"
    outs = ("$0, $2", "$4, $6", "$1, $3", "$5, $7")
    return (f"{{ .reg .b32 {regs}, {_QH_REGS}, sl, sh; mov.b32 sl, {{$11, $11}}; mov.b32 sh, {{$12, $12}}; "
            + _qh_bits(6, bf16, "$8", "$9", "$10")
            + _nibbles(bf16, lambda i: f"mul.rn.{t} a, a, {'sl' if i < 2 else 'sh'}; mov.b32 {{{outs[i]}}}, a; ",
                       _MAGS, offset=32) + "}")


_ASM_W4_F16 = tl.constexpr(_asm_words("q4", False))
_ASM_W4_BF16 = tl.constexpr(_asm_words("q4", True))
_ASM_W8_F16 = tl.constexpr(_asm_words("q8", False))
_ASM_W8_BF16 = tl.constexpr(_asm_words("q8", True))
_IQ4_WORDS = codebook_words(IQ4_VALUES)
_MX_WORDS = codebook_words(MXFP4_VALUES)
_ASM_IQ4_F16 = tl.constexpr(_asm_codebook(IQ4_VALUES, False))
_ASM_IQ4_BF16 = tl.constexpr(_asm_codebook(IQ4_VALUES, True))
_ASM_MX_F16 = tl.constexpr(_asm_codebook(MXFP4_VALUES, False))
_ASM_MX_BF16 = tl.constexpr(_asm_codebook(MXFP4_VALUES, True))
_CB_WORDS = tl.constexpr(_IQ4_WORDS + _MX_WORDS)  # codebook 1's 4 words, then codebook 2's
_ASM_Q4_F16 = tl.constexpr(_asm_q4(False))
_ASM_Q4_BF16 = tl.constexpr(_asm_q4(True))
_ASM_Q5_F16 = tl.constexpr(_asm_q5(False))
_ASM_Q5_BF16 = tl.constexpr(_asm_q5(True))
_ASM_Q6_F16 = tl.constexpr(_asm_q6_words(False))
_ASM_Q6_BF16 = tl.constexpr(_asm_q6_words(True))
_CONS_Q5 = tl.constexpr("=r,=r,=r,=r" + ",r" * 14)  # pack 4: a register of codes, of qh, 4 of the shift, 2 per scale
_CONS_Q6 = tl.constexpr("=h," * 8 + "r,r,r,h,h")
_ASM_PRMT = tl.constexpr("prmt.b32 $0, $1, $2, $3;")


@triton.jit
def _deq_q4(units, s_lo, nz_lo, s_hi, nz_hi, DT: tl.constexpr, UNPACK: tl.constexpr, HB: tl.constexpr = 0,
            qh=None, sh=None):
    """(low, high) nibble weights q * s + nz of a uint8 tile, in DT (fp16 or bf16). HB 5 (q5_k): q also takes a
    high bit from ``qh`` (uint8, like units) shifted right by ``sh`` (int32): _asm_q5."""
    if HB != 0 and UNPACK == 2:
        if DT == tl.float16:
            return tl.inline_asm_elementwise(_ASM_Q5_F16, _CONS_Q5, [units, qh, sh, s_lo, nz_lo, s_hi, nz_hi],
                                             dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(_ASM_Q5_BF16, _CONS_Q5, [units, qh, sh, s_lo, nz_lo, s_hi, nz_hi],
                                             dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    elif HB != 0:
        v = units.to(tl.int32)
        hq = qh.to(tl.int32) >> sh
        lo = ((v & 15) | ((hq & 1) << 4)).to(tl.float32) * s_lo.to(tl.float32) + nz_lo.to(tl.float32)
        hi = ((v >> 4) | ((hq & 2) << 3)).to(tl.float32) * s_hi.to(tl.float32) + nz_hi.to(tl.float32)
        return lo.to(DT), hi.to(DT)
    elif UNPACK == 2:
        if DT == tl.float16:
            return tl.inline_asm_elementwise(_ASM_Q4_F16, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r",
                                             [units, s_lo, nz_lo, s_hi, nz_hi], dtype=(tl.float16, tl.float16),
                                             is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(_ASM_Q4_BF16, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r",
                                             [units, s_lo, nz_lo, s_hi, nz_hi], dtype=(tl.bfloat16, tl.bfloat16),
                                             is_pure=True, pack=4)
    else:
        v = units.to(tl.int32)
        lo = (v & 15).to(tl.float32) * s_lo.to(tl.float32) + nz_lo.to(tl.float32)
        hi = (v >> 4).to(tl.float32) * s_hi.to(tl.float32) + nz_hi.to(tl.float32)
        return lo.to(DT), hi.to(DT)


@triton.jit
def _level(q, CB: tl.constexpr):
    """The int8 level of nibbles q (int32, 0..15) in codebook CB (1: iq4_nl, 2: mxfp4), from its table words."""
    off: tl.constexpr = 4 * (CB - 1)
    w = tl.where(q < 8, tl.where(q < 4, _CB_WORDS[off], _CB_WORDS[off + 1]),
                 tl.where(q < 12, _CB_WORDS[off + 2], _CB_WORDS[off + 3]))
    return ((w >> (8 * (q & 3))) << 24) >> 24


@triton.jit
def _deq_codebook(cw, s, nz, CB: tl.constexpr, DT: tl.constexpr, UNPACK: tl.constexpr):
    """Codebook (CB 1: iq4_nl, 2: mxfp4) code words ``cw`` (int32, nibbles as q4_0's), the blocks' scales d and nz =
    -128 d (DT) -> the weights level[q] * d in DT, [..., 4 bytes, 2 nibbles] as _deq_words' q4_0 (_asm_codebook)."""
    if UNPACK == 2:
        if CB == 1 and DT == tl.float16:
            o = tl.inline_asm_elementwise(_ASM_IQ4_F16, "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h", [cw, s, nz],
                                          dtype=(tl.float16, ) * 8, is_pure=True, pack=1)
        elif CB == 1:
            o = tl.inline_asm_elementwise(_ASM_IQ4_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h", [cw, s, nz],
                                          dtype=(tl.bfloat16, ) * 8, is_pure=True, pack=1)
        elif DT == tl.float16:
            o = tl.inline_asm_elementwise(_ASM_MX_F16, "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h", [cw, s, nz],
                                          dtype=(tl.float16, ) * 8, is_pure=True, pack=1)
        else:
            o = tl.inline_asm_elementwise(_ASM_MX_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h", [cw, s, nz],
                                          dtype=(tl.bfloat16, ) * 8, is_pure=True, pack=1)
    else:
        o = ()
        for j in tl.static_range(4):
            byte = (cw >> (8 * j)) & 255
            o = o + ((_level(byte & 15, CB).to(tl.float32) * s.to(tl.float32)).to(DT),
                     (_level(byte >> 4, CB).to(tl.float32) * s.to(tl.float32)).to(DT))
    return _stack(o, 3)


@triton.jit
def _deq_words(cw, s, nz, Q8: tl.constexpr, DT: tl.constexpr, UNPACK: tl.constexpr):
    """q4_0 / q8_0 (Q8) code words ``cw`` (int32 [4, 8, A, 2, 2, NW]) and their blocks' d and nz = -8 d / -128 d (DT,
    broadcast) -> the weights in DT [..., NW, 2, 2, 2] (q4_0: index 2 j + p = nibble p of byte j) or
    [..., NW, 2, 2] (q8_0: byte j). The asm's 16-bit outputs keep each word's values apart (a uint8 view of the
    words, 4 broadcast elements per register, dropped 3 of 4 words on the GPU: pack groups a thread's registers, not
    one word's copies)."""
    if UNPACK == 2:
        if not Q8 and DT == tl.float16:
            o = tl.inline_asm_elementwise(_ASM_W4_F16, "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h", [cw, s, nz],
                                          dtype=(tl.float16, ) * 8, is_pure=True, pack=1)
        elif not Q8:
            o = tl.inline_asm_elementwise(_ASM_W4_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h", [cw, s, nz],
                                          dtype=(tl.bfloat16, ) * 8, is_pure=True, pack=1)
        elif DT == tl.float16:
            o = tl.inline_asm_elementwise(_ASM_W8_F16, "=h,=h,=h,=h,r,h,h", [cw, s, nz], dtype=(tl.float16, ) * 4,
                                          is_pure=True, pack=1)
        else:
            o = tl.inline_asm_elementwise(_ASM_W8_BF16, "=h,=h,=h,=h,r,h,h", [cw, s, nz], dtype=(tl.bfloat16, ) * 4,
                                          is_pure=True, pack=1)
    else:
        o = ()
        for j in tl.static_range(4):
            byte = (cw >> (8 * j)) & 255
            if not Q8:
                o = o + (((byte & 15).to(tl.float32) * s.to(tl.float32) + nz.to(tl.float32)).to(DT),
                         ((byte >> 4).to(tl.float32) * s.to(tl.float32) + nz.to(tl.float32)).to(DT))
            else:
                o = o + ((((byte ^ 128) - 128).to(tl.float32) * s.to(tl.float32)).to(DT), )
    return _stack(o, 2 if Q8 else 3)


@triton.jit
def _words4(vec):
    """A [4, 8, A, 2, 4] tile of int32 words -> its 4 words as [4, 8, A, 2] tiles, in order."""
    even, odd = tl.split(tl.reshape(vec, (vec.shape[0], vec.shape[1], vec.shape[2], vec.shape[3], 2, 2)))
    w0, w2 = tl.split(even)
    w1, w3 = tl.split(odd)
    return w0, w1, w2, w3


@triton.jit
def _stack(words, LOG: tl.constexpr):
    """A tuple of 2^LOG equal-shaped tiles -> one tile with LOG more axes of 2, words[i] at the index whose bits
    they are (i = 4 a + 2 b + c for [..., a, b, c]): each level joins tile i with tile i + half, so the first join's
    axis is the index's highest bit."""
    parts = words
    for lvl in tl.static_range(LOG):
        nxt = ()
        for i in tl.static_range((1 << (LOG - lvl)) // 2):
            nxt = nxt + (tl.join(parts[i], parts[i + (1 << (LOG - lvl)) // 2]), )
        parts = nxt
    return parts[0]


@triton.jit
def _lane_load(ptrs, ok, NV: tl.constexpr):
    """The NV 16-byte vectors of one step at ``ptrs`` (int32 pointers [4 t, 8, A, 2, 4]), as a tuple; none where
    ``ok`` is false."""
    vecs = ()
    for v in tl.static_range(NV):
        vecs = vecs + (tl.load(ptrs + 4 * v, mask=ok, other=0), )
    return vecs


@triton.jit
def _lane_blocks(vecs, t4, NV: tl.constexpr, NW: tl.constexpr, UNPACK: tl.constexpr):
    """q4_0 / q8_0: lane t's two blocks (2t, 2t + 1 of the step) from its NV 16-byte vectors (_lane_load; 16-byte
    aligned, block 2t starting t words in). Returns (d as float32 [4, 8, A, 2, 2 blocks], the code words [4, 8, A,
    2, 2 blocks, NW])."""
    L = ()
    for v in tl.static_range(NV):
        L = L + _words4(vecs[v])
    odd = (t4 & 1) != 0
    high = t4 >= 2
    NDW: tl.constexpr = 2 * NW + 1  # words holding the two blocks: d0 c0[0:2] | c0 ... | c0[-2:] d1 | c1 ...
    a = ()
    for i in tl.static_range(NDW + 2):
        a = a + (tl.where(odd, L[i + 1], L[i]), )
    dw = ()
    for i in tl.static_range(NDW):
        dw = dw + (tl.where(high, a[i + 2], a[i]), )
    codes = ()
    for k in tl.static_range(NW):  # block 2t: bytes 2 .. 4 NW + 1, across word halves
        codes = codes + (_funnel(dw[k], dw[k + 1], UNPACK), )
    for k in tl.static_range(NW):  # block 2t + 1: whole words after its d
        codes = codes + (dw[NW + 1 + k], )
    d0 = _split_words(dw[0], tl.float16)[0]
    d1 = _split_words(dw[NW], tl.float16)[1]
    c = _stack(codes, 3 if NW == 4 else 4)
    return tl.join(d0, d1), tl.reshape(c, (c.shape[0], c.shape[1], c.shape[2], c.shape[3], 2, NW))


@triton.jit
def _word_shift(vecs, ws):
    """Words ws .. ws + 8 (ws 0..3, per thread or uniform) of three 16-byte vectors (int32 [4, 8, A, 2, 4] each,
    _lane_load), as a tuple of 9 [4, 8, A, 2] tiles: two levels of selects."""
    w = ()
    for v in tl.static_range(3):
        w = w + _words4(vecs[v])
    a = ()
    for j in tl.static_range(10):
        a = a + (tl.where(ws >= 2, w[j + 2], w[j]), )
    b = ()
    for j in tl.static_range(9):
        b = b + (tl.where((ws & 1) != 0, a[j + 1], a[j]), )
    return b


@triton.jit
def _prmt(a, b, sel, UNPACK: tl.constexpr):
    """Bytes of the pair (a, b) (a's bytes 0-3, b's 4-7) picked by the selector nibbles of ``sel`` (each 0..7): here
    only the 4 consecutive bytes from byte o, sel = 0x3210 + 0x1111 o."""
    if UNPACK == 2:
        return tl.inline_asm_elementwise(_ASM_PRMT, "=r,r,r,r", [a, b, sel], dtype=tl.int32, is_pure=True, pack=1)
    else:
        o = sel & 7
        lo = tl.where(o == 0, a, (a >> (8 * o)) & ((1 << (32 - 8 * o)) - 1))
        return tl.where(o == 4, b, lo | tl.where(o == 0, 0, b << (32 - 8 * o)))


@triton.jit
def _mx_lane_blocks(vecs, s, UNPACK: tl.constexpr):
    """mxfp4: lane t's two 17-byte blocks (2t, 2t + 1 of the step: e, 16 code bytes each) from three 16-byte vectors
    (_lane_load) holding them from byte s (even, 0..14: 17-byte blocks keep only 2-byte alignment). Returns (the
    exponent bytes as int32 [4, 8, A, 2, 2 blocks], the code words [4, 8, A, 2, 2 blocks, 4]). The word shift is
    two levels of per-thread selects, the byte shifts one byte permute per word."""
    b = _word_shift(vecs, s // 4)
    hb = s & 2  # the blocks start at byte hb of b[0]: codes at hb + 1 (word 0) and hb + 18 (word 4)
    sel0 = 0x4321 + hb * 0x1111
    sel1 = 0x5432 + hb * 0x1111
    codes = ()
    for k in tl.static_range(4):
        codes = codes + (_prmt(b[k], b[k + 1], sel0, UNPACK), )
    for k in tl.static_range(4):
        codes = codes + (_prmt(b[4 + k], b[5 + k], sel1, UNPACK), )
    e0 = (b[0] >> (8 * hb)) & 255
    e1 = (b[4] >> (8 * hb + 8)) & 255
    c = _stack(codes, 3)
    return tl.join(e0, e1), tl.reshape(c, (c.shape[0], c.shape[1], c.shape[2], c.shape[3], 2, 4))


@triton.jit
def _e8m0_half(e, DT: tl.constexpr):
    """E8M0 exponent bytes (int32) -> 2^(e - 128) as float32 (subnormal below e = 2), the scale of mxfp4's doubled
    levels; for fp16 weights capped at fp16's largest finite value, so that a zero level stays zero."""
    bits = tl.where(e < 2, 0x00200000 << tl.minimum(e, 1), (e - 1) << 23)
    v = bits.to(tl.float32, bitcast=True)
    if DT == tl.float16:
        v = tl.minimum(v, 65504.0)
    return v


@triton.jit
def _shift_words(vecs, s, odd, UNPACK: tl.constexpr):
    """q6_k: the 8 words at byte 4 s + 2 odd of three 16-byte vectors (int32 [4, 8, A, 2, 4] each, _lane_load), as a
    tuple of [4, 8, A, 2] tiles. s (0..3) and odd are the same for the whole program (the block's start modulo 16),
    so the word shift is two levels of uniform selects and the half-word shift one byte permute per word."""
    b = _word_shift(vecs, s)
    out = ()
    for j in tl.static_range(8):
        if UNPACK == 2:  # selector 0x3210 keeps b[j], 0x5432 takes its high half and b[j + 1]'s low half
            sel = tl.full(b[j].shape, 0x3210, tl.int32) + odd * 0x2222
            out = out + (tl.inline_asm_elementwise(_ASM_PRMT, "=r,r,r,r", [b[j], b[j + 1], sel], dtype=tl.int32,
                                                   is_pure=True, pack=1), )
        else:
            out = out + (tl.where(odd != 0, _funnel(b[j], b[j + 1], UNPACK), b[j]), )
    return out


@triton.jit
def _deq_q6(cw, qh, sh, s_lo, s_hi, DT: tl.constexpr, UNPACK: tl.constexpr):
    """q6_k code words ``cw`` (4 ql bytes each), their qh words, the shift 2c and the scales (DT) of the low and the
    high nibbles -> weights (q - 32) * scale in DT, [..., 4 bytes, 2 nibbles] (_asm_q6_words)."""
    if UNPACK == 2:
        if DT == tl.float16:
            o = tl.inline_asm_elementwise(_ASM_Q6_F16, _CONS_Q6, [cw, qh, sh, s_lo, s_hi], dtype=(tl.float16, ) * 8,
                                          is_pure=True, pack=1)
        else:
            o = tl.inline_asm_elementwise(_ASM_Q6_BF16, _CONS_Q6, [cw, qh, sh, s_lo, s_hi],
                                          dtype=(tl.bfloat16, ) * 8, is_pure=True, pack=1)
    else:
        o = ()
        hq = qh >> sh
        for j in tl.static_range(4):
            byte = (cw >> (8 * j)) & 255
            hb = (hq >> (8 * j)) & 255
            lo = (((byte & 15) | ((hb & 3) << 4)) - 32).to(tl.float32) * s_lo.to(tl.float32)
            hi = (((byte >> 4) | (hb & 0x30)) - 32).to(tl.float32) * s_hi.to(tl.float32)
            o = o + (lo.to(DT), hi.to(DT))
    return _stack(o, 3)


@triton.jit
def gemv_tc_kernel(X, X2, W8, WS, WB, Y, PART, COUNT, M, N, K, stride_xm, stride_x2m, stride_ys, stride_ym,
                   row_bytes, scale_stride, nblocks, blocks_per_split, FMT: tl.constexpr, GS: tl.constexpr,
                   BLOCK_N: tl.constexpr, M_PAD: tl.constexpr, UNPACK: tl.constexpr, PREFETCH: tl.constexpr = False,
                   SILU: tl.constexpr = 0, FIXUP: tl.constexpr = False, PDL: tl.constexpr = False, XD=None,
                   XT: tl.constexpr = False, PAIRS=None, BLOCK_EXPERT=None, WU=None, n_experts=1,
                   TOKEN=None, TOPK: tl.constexpr = 0):
    """y[m, n] (+)= sum over this program's K split of x[m] . w[n] for BLOCK_N rows and M_PAD activation rows.

    FMT 10 (q4_k): a step is one super-block; WS and WB are unused. FMT 13 (MLX 4-bit): a step is 128 bytes of
    codes (256 weights) per row, the scale and bias of group g of row n at WS/WB + n * scale_stride + g, GS weights
    per group. FMT 3 / 7 (q4_0 / q8_0): a step is 8 blocks (144 / 272 bytes) per row, lane t taking blocks 2t and
    2t + 1 (_lane_blocks). SILU (silu_mul_gemv): the activations are silu(x) * x2, formed once per program and step
    as x's tile is loaded (m1._silu_mul: 1 exact, 2 through tanh.approx). FIXUP: the K splits of an output tile write
    float32 partials to PART [split, M, N] and count their arrivals in COUNT (zero on entry); the last to arrive sums
    them in split order (what ops._finish's kernel computes) into Y [M, N] and resets its counter, which saves that
    kernel's launch. PDL (launched with launch_pdl, see _pdl.py): programs wait for the previous kernel first and let
    the next one launch after their loop. XT: x comes already in the format's k order (tc_order) through the TMA
    descriptor XD of blocks [M_PAD, 256], straight into shared memory as the dot's B operand (no SILU): no register
    round trip and no permute for the tile that every program re-reads each step.

    TOPK > 0 (mixture of experts, pairs grouped by expert: moe.group_pairs; no K split, FIXUP or XT): W8 stacks
    n_experts matrices of N rows, and the third grid axis runs over blocks of M_PAD slots, block b holding pairs
    PAIRS[b * M_PAD ..] (-1: an empty slot) of expert BLOCK_EXPERT[b] (-1: an unused block, which reads nothing).
    Pair p reads row TOKEN[p] (without TOKEN: p // TOPK) of x (and of x2) and writes row p of Y. With WU (a second
    stack of W8's shape), the first half of the grid's first axis reads W8 and the second WU, writing columns
    N .. 2N - 1 of Y."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    pdl_wait(PDL)
    DT: tl.constexpr = X.dtype.element_ty
    A: tl.constexpr = BLOCK_N // 16
    # bytes of one row per step
    STEP: tl.constexpr = 144 if (FMT == 10 or FMT == 3 or FMT == 14) else (
        272 if FMT == 7 else (176 if FMT == 11 else (210 if FMT == 12 else (136 if (FMT == 16 or FMT == 15)
                                                                          else 128))))
    NV: tl.constexpr = 5 if FMT == 7 else 3  # q4_0 / q8_0 / codebooks: 16-byte vectors per lane and row
    NW: tl.constexpr = 8 if FMT == 7 else 4  # q4_0 / q8_0 / codebooks: code words per block
    # iq4_nl / mxfp4: K any whole number of 32-weight blocks, the last step's missing blocks masked
    TAIL: tl.constexpr = FMT == 14 or FMT == 16
    nb32 = K // 32
    t_ = tl.arange(0, 4)[:, None, None, None, None, None]
    g_ = tl.arange(0, 8)[None, :, None, None, None, None]
    a_ = tl.arange(0, A)[None, None, :, None, None, None]
    h_ = tl.arange(0, 2)[None, None, None, :, None, None]
    half_ = tl.arange(0, 2)[None, None, None, None, :, None]
    b_ = tl.arange(0, 16)[None, None, None, None, None, :]
    kb_start = pid_k * blocks_per_split
    kb_end = tl.minimum(kb_start + blocks_per_split, nblocks)
    if TOPK > 0:
        n_tiles = tl.cdiv(N, BLOCK_N)
        if WU is not None:  # the second half of the grid reads the second stack into Y's second N columns
            if pid_n >= n_tiles:
                W8 = WU
                Y += N
                pid_n -= n_tiles
        e_raw = tl.load(BLOCK_EXPERT + pid_m)
        # ids are made on the device (align_pairs) and never checked on the host: stay inside the stack regardless
        e_off = tl.minimum(tl.maximum(e_raw, 0), n_experts - 1).to(tl.int64) * N
        kb_end = tl.where(e_raw >= 0, kb_end, kb_start)  # an unused block reads nothing
    else:
        e_off = 0
    # rows past N read row N - 1 (in bounds, never stored)
    row = tl.minimum(pid_n * BLOCK_N + 16 * a_ + 8 * h_ + g_, N - 1).to(tl.int64) + e_off
    base = row * row_bytes + kb_start * STEP
    if FMT == 10 or FMT == 11:  # q5_k: q4_k's header, then qh (32 bytes), then the low nibbles as q4_k's codes
        w_ptrs = W8 + base + (16 if FMT == 10 else 48) + t_ * 32 + half_ * 16 + b_
        # the 16-byte header (d, dmin, 12 scale bytes) as one vector per row: words [4 t, 8 g, A, 2 h, 4]
        h_ptrs = (W8.to(tl.pointer_type(tl.int32), bitcast=True)
                  + tl.multiple_of(tl.reshape(base, (1, 8, A, 2, 1)) // 4, [4, 4, 4, 4, 4])
                  + tl.reshape(t_, (4, 1, 1, 1, 1)) * 0 + tl.arange(0, 4)[None, None, None, None, :])
        if FMT == 11:  # qh byte b holds the 5th bit of weight 32 i + b at bit i: chunk t's at bits 2t, 2t + 1
            qh_ptrs = W8 + base + 16 + half_ * 16 + b_ + t_ * 0
            sh = (2 * t_).to(tl.int32)
    elif FMT == 12:  # q6_k: words [4 t, 8 g, A, 2 h, 4] of the 16-byte vectors holding ql (32 t ..) and qh
        # (128 + 32 (t // 2) ..) of a block, which starts 2 (kb % 8) bytes past a 16-byte boundary (rows are 16-byte
        # aligned: tc_supports wants K a multiple of 2048)
        t4 = tl.reshape(t_, (4, 1, 1, 1, 1))
        row_w = tl.multiple_of(tl.reshape(row * row_bytes, (1, 8, A, 2, 1)) // 4, [4, 4, 4, 4, 4])
        w4 = tl.arange(0, 4)[None, None, None, None, :]
        ql_ptrs = W8.to(tl.pointer_type(tl.int32), bitcast=True) + row_w + t4 * 8 + w4
        qh_ptrs = ql_ptrs - t4 * 8 + 32 + (t4 // 2) * 8
        # the scale pairs sc[4 t - 2 c], sc[4 t - 2 c + 1] (low nibbles of halves 0, 1) and 4 bytes on (high
        # nibbles), c = t % 2, and d: 2-byte loads at block offsets 192 + 4 t - 2 c, 196 + ..., 208
        c6 = t_ % 2
        s_ptrs = W8.to(tl.pointer_type(tl.int16), bitcast=True) + (row * row_bytes) // 2 + 96 + 2 * t_ - c6
        sh = tl.reshape(2 * c6, (4, 1, 1, 1, 1, 1)).to(tl.int32)
    elif FMT == 3 or FMT == 7 or FMT == 14:  # [4 t, 8 g, A, 2 h, 4 words] from byte 32 t (q4_0, iq4_nl) or 64 t
        # (q8_0) of the step (row_bytes and STEP are multiples of 16, so every vector starts 16-byte aligned)
        t4 = tl.reshape(t_, (4, 1, 1, 1))
        t5 = tl.reshape(t_, (4, 1, 1, 1, 1))
        v_ptrs = (W8.to(tl.pointer_type(tl.int32), bitcast=True)
                  + tl.multiple_of(tl.reshape(base, (1, 8, A, 2, 1)) // 4, [4, 4, 4, 4, 4])
                  + t5 * (2 * NW) + tl.arange(0, 4)[None, None, None, None, :])
    elif FMT == 15:  # iq4_xs: 136-byte super-blocks (d, scales_h, scales_l[4], 128 code bytes) on 16-byte aligned
        # rows, so 8-byte aligned: lane t's sub-blocks 2t, 2t + 1 are the 32 code bytes from 8 + 32 t
        t5 = tl.reshape(t_, (4, 1, 1, 1, 1))
        t4 = tl.reshape(t_, (4, 1, 1, 1))
        row_w = tl.multiple_of(tl.reshape(row * row_bytes, (1, 8, A, 2, 1)) // 4, [4, 4, 4, 4, 4])
        # words [4 t, 8 g, A, 2 h, 4] of sub-block 2t's codes (sub-block 2t + 1's 4 words on) and of the header
        # (the 8 bytes, each lane its row's)
        xs_ptrs = (W8.to(tl.pointer_type(tl.int32), bitcast=True) + row_w + kb_start * 34 + 2 + 8 * t5
                   + tl.arange(0, 4)[None, None, None, None, :])
        xh_ptrs = (W8.to(tl.pointer_type(tl.int32), bitcast=True) + row_w + kb_start * 34 + 0 * t5
                   + tl.arange(0, 2)[None, None, None, None, :])
    elif FMT == 16:  # mxfp4: lane t's blocks start at byte 136 kb + 34 t of the (16-byte aligned) row
        t4 = tl.reshape(t_, (4, 1, 1, 1))
        t5 = tl.reshape(t_, (4, 1, 1, 1, 1))
        v_ptrs = (W8.to(tl.pointer_type(tl.int32), bitcast=True)
                  + tl.multiple_of(tl.reshape(row * row_bytes, (1, 8, A, 2, 1)) // 4, [4, 4, 4, 4, 4])
                  + tl.arange(0, 4)[None, None, None, None, :])
    else:  # the group of each 32-weight half chunk: (256 kb + 64 t + 32 half) // GS
        w_ptrs = W8 + base + t_ * 32 + half_ * 16 + b_
        s_off = row * scale_stride + kb_start * (256 // GS) + (64 * t_ + 32 * half_) // GS
        s_ptrs = WS + s_off
        z_ptrs = WB + s_off
    if TOPK > 0:  # the block's pairs: slot i holds pair m (row m of Y), which reads row m // TOPK of x
        m = tl.load(PAIRS + pid_m * M_PAD + tl.arange(0, M_PAD)).to(tl.int64)
        m_ok = m >= 0
        if TOKEN is not None:
            xm = tl.load(TOKEN + tl.where(m_ok, m, 0)).to(tl.int64)
        else:
            xm = tl.where(m_ok, m, 0) // TOPK
    else:
        m = pid_m * M_PAD + tl.arange(0, M_PAD)
        m_ok = m < M
        xm = m
    x_ptrs = X + xm[None, :] * stride_xm + kb_start * 256 + tl.arange(0, 256)[:, None]
    x2_ptrs = X2 + xm[None, :] * stride_x2m + kb_start * 256 + tl.arange(0, 256)[:, None]
    x_ok = m_ok[None, :] & (tl.arange(0, 256)[:, None] >= 0)
    acc = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
    if (FMT == 3 or FMT == 7) and PREFETCH:  # q4_0 / q8_0: the next step's vectors load while this one computes
        nxt = _lane_load(v_ptrs, kb_start < kb_end, NV)
    for kb in range(kb_start, kb_end):
        if FMT == 12:
            off = (kb * 210) // 16 * 4  # words to the 16-byte boundary at or before the block
            odd = kb % 2
            s_w = (kb % 8) // 2
            cq = _stack(_shift_words(_lane_load(ql_ptrs + off, True, 3), s_w, odd, UNPACK), 3)
            ch = _stack(_shift_words(_lane_load(qh_ptrs + off, True, 3), s_w, odd, UNPACK), 3)
            s_off = kb * 105
            d = tl.load(s_ptrs + s_off + (104 - 96) - 2 * t_ + c6).to(tl.float16, bitcast=True).to(tl.float32)
            sc_lo = tl.load(s_ptrs + s_off).to(tl.int32)
            sc_hi = tl.load(s_ptrs + s_off + 2).to(tl.int32)
            # int8 scale of half 0 in the low byte, of half 1 in the high byte: [4, 8, A, 2, 1, 1] -> [.., 2 half, 1]
            s_lo = tl.reshape(tl.join(d * ((sc_lo << 24) >> 24).to(tl.float32), d * ((sc_lo << 16) >> 24).to(
                tl.float32)), (4, 8, A, 2, 2, 1)).to(DT)
            s_hi = tl.reshape(tl.join(d * ((sc_hi << 24) >> 24).to(tl.float32), d * ((sc_hi << 16) >> 24).to(
                tl.float32)), (4, 8, A, 2, 2, 1)).to(DT)
            w = _deq_q6(tl.reshape(cq, (4, 8, A, 2, 2, 4)), tl.reshape(ch, (4, 8, A, 2, 2, 4)), sh, s_lo, s_hi, DT,
                        UNPACK)  # [t, g, a, h, half, word, byte, nibble]
            w = tl.reshape(w, (4, 8, A, 2, 2, 8, 2, 2))  # t, g, a, h, half, lhl, ll, p as q4_k's
            w = tl.reshape(tl.permute(w, (2, 3, 1, 4, 5, 7, 0, 6)), (BLOCK_N, 256))
        elif FMT == 15:
            c = _stack(_words4(tl.load(xs_ptrs)) + _words4(tl.load(xs_ptrs + 4)), 3)
            cw = tl.reshape(c, (4, 8, A, 2, 2, 4))
            h0, h1 = tl.split(tl.load(xh_ptrs))
            d = _split_words(h0, tl.float16)[0]  # d in the low half of word 0, scales_h in its high half
            ls0 = ((h1 >> (8 * t4)) & 15) | (((h0 >> (16 + 4 * t4)) & 3) << 4)  # sub-block 2t
            ls1 = ((h1 >> (8 * t4 + 4)) & 15) | (((h0 >> (18 + 4 * t4)) & 3) << 4)  # sub-block 2t + 1
            d = tl.reshape(tl.join(d * (ls0 - 32).to(tl.float32), d * (ls1 - 32).to(tl.float32)), (4, 8, A, 2, 2, 1))
            w = _deq_codebook(cw, d.to(DT), (-128.0 * d).to(DT), 1, DT, UNPACK)
            w = tl.reshape(w, (4, 8, A, 2, 2, 8, 2, 2))  # t, g, a, h, blk, lhl, ll, p as q4_0's
            w = tl.reshape(tl.permute(w, (2, 3, 1, 4, 5, 7, 0, 6)), (BLOCK_N, 256))
            xs_ptrs += 34
            xh_ptrs += 34
        elif FMT == 3 or FMT == 7 or TAIL:
            if FMT == 16:
                # three aligned vectors from the 16-byte boundary at or before the lane's blocks; a vector that
                # starts before the row's end ends within its 16-byte aligned stride
                start = kb * 136 + 34 * t5
                vecs = ()
                for v in tl.static_range(3):
                    vecs = vecs + (tl.load(v_ptrs + start // 16 * 4 + 4 * v, mask=start // 16 * 16 + 16 * v < nb32 * 17,
                                           other=0), )
                e, cw = _mx_lane_blocks(vecs, tl.reshape(start % 16, (4, 1, 1, 1)), UNPACK)
                d = _e8m0_half(e, DT)
            elif FMT == 14:
                vecs = ()
                for v in tl.static_range(3):
                    vecs = vecs + (tl.load(v_ptrs + 4 * v, mask=kb * 144 + 32 * t5 + 16 * v < nb32 * 18, other=0), )
                d, cw = _lane_blocks(vecs, t4, NV, NW, UNPACK)
            elif PREFETCH:
                vecs = nxt
                nxt = _lane_load(v_ptrs + STEP // 4, kb + 1 < kb_end, NV)
                d, cw = _lane_blocks(vecs, t4, NV, NW, UNPACK)
            else:
                d, cw = _lane_blocks(_lane_load(v_ptrs, True, NV), t4, NV, NW, UNPACK)
            if TAIL:  # blocks past the row's end (the last step's) weigh zero
                d = tl.where(kb * 8 + 2 * t5 + tl.arange(0, 2)[None, None, None, None, :] < nb32, d, 0.0)
                d = tl.reshape(d, (4, 8, A, 2, 2, 1))
                w = _deq_codebook(cw, d.to(DT), (-128.0 * d).to(DT), 1 if FMT == 14 else 2, DT, UNPACK)
            else:
                d = tl.reshape(d, (4, 8, A, 2, 2, 1))
                # q4_0: byte b = 4 k + j of the block (word k), weight b + 16 p, b = 2 lhl + ll;
                # q8_0: weight b = 4 bj + 2 p + ll (bj = word k, j = 2 p + ll)
                w = _deq_words(cw, d.to(DT), ((-8.0 if FMT == 3 else -128.0) * d).to(DT), FMT == 7, DT, UNPACK)
            w = tl.reshape(w, (4, 8, A, 2, 2, 8, 2, 2))
            if FMT != 7:  # t, g, a, h, blk, lhl, ll, p -> [a h g] x [blk lhl p t ll]
                w = tl.reshape(tl.permute(w, (2, 3, 1, 4, 5, 7, 0, 6)), (BLOCK_N, 256))
            else:  # t, g, a, h, blk, bj, p, ll -> [a h g] x [blk bj p t ll]
                w = tl.reshape(tl.permute(w, (2, 3, 1, 4, 5, 6, 0, 7)), (BLOCK_N, 256))
            if FMT != 16:
                v_ptrs += STEP // 4
        else:
            if FMT == 10 or FMT == 11:
                h0, h1, h2, h3 = _words4(tl.load(h_ptrs))
                d, dmin = _split_words(tl.reshape(h0, (4, 8, A, 2, 1, 1)), tl.float16)  # fp16 d, fp16 dmin
                sc0, mn0, sc1, mn1 = _q4k_scales(tl.reshape(h1, (4, 8, A, 2, 1, 1)), tl.reshape(h2, (4, 8, A, 2, 1, 1)),
                                                 tl.reshape(h3, (4, 8, A, 2, 1, 1)), t_)
                s_lo, z_lo, s_hi, z_hi = (d * sc0).to(DT), (-dmin * mn0).to(DT), (d * sc1).to(DT), (-dmin * mn1).to(DT)
                h_ptrs += STEP // 4
            else:
                s_lo = tl.load(s_ptrs).to(DT)
                z_lo = tl.load(z_ptrs).to(DT)
                s_hi, z_hi = s_lo, z_lo
                s_ptrs += 256 // GS
                z_ptrs += 256 // GS
            # (the scales load before the codes' and the header as one 16-byte load per row: fewer instructions,
            # measured faster; bench/NOTES.md)
            if FMT == 11:
                w_lo, w_hi = _deq_q4(tl.load(w_ptrs), s_lo, z_lo, s_hi, z_hi, DT, UNPACK, 5, tl.load(qh_ptrs), sh)
                qh_ptrs += STEP
            else:
                w_lo, w_hi = _deq_q4(tl.load(w_ptrs), s_lo, z_lo, s_hi, z_hi, DT, UNPACK)
            w = tl.reshape(tl.join(w_lo, w_hi), (4, 8, A, 2, 2, 8, 2, 2))  # t, g, a, h, half, lhl, ll, p
            w_ptrs += STEP
            w = tl.reshape(tl.permute(w, (2, 3, 1, 4, 5, 7, 0, 6)), (BLOCK_N, 256))  # [a h g] x [half lhl p t ll]
        if XT:  # in k order already: [M_PAD, 256] by TMA (rows past M zero-filled), transposed as a view
            xt = XD.load([pid_m * M_PAD, kb * 256]).T
        else:
            # the natural tile permuted to the k order (TC_PERMS holds the same permutations for tc_order)
            if TAIL:
                x_in = x_ok & (kb * 256 + tl.arange(0, 256)[:, None] < K)
            else:
                x_in = x_ok
            xn = tl.load(x_ptrs, mask=x_in, other=0.0)
            if SILU:
                xn = _silu_mul(xn.to(tl.float32), tl.load(x2_ptrs, mask=x_in, other=0.0).to(tl.float32), DT,
                               SILU).to(DT)
                x2_ptrs += 256
            if FMT == 10 or FMT == 11:
                # byte 16 half + 2 lhl + ll of chunk t, nibble p: weight 64 t + 32 p + 16 half + 2 lhl + ll
                xt = tl.reshape(tl.permute(tl.reshape(xn, (4, 2, 2, 8, 2, M_PAD)), (2, 3, 1, 0, 4, 5)), (256, M_PAD))
            elif FMT == 12:  # chunk t = 2 h6 + c, byte 16 half + 2 lhl + ll, nibble p: weight 128 h6 + 64 p + 32 c
                xt = tl.reshape(tl.permute(tl.reshape(xn, (2, 2, 2, 2, 8, 2, M_PAD)), (3, 4, 1, 0, 2, 5, 6)),
                                (256, M_PAD))
            elif FMT == 3 or FMT == 15 or TAIL:  # byte 2 lhl + ll of block 2t + blk, nibble p: weight 64 t + 32 blk + 16 p + 2 lhl + ll
                xt = tl.reshape(tl.permute(tl.reshape(xn, (4, 2, 2, 8, 2, M_PAD)), (1, 3, 2, 0, 4, 5)), (256, M_PAD))
            elif FMT == 7:  # byte 4 bj + 2 p + ll of block 2t + blk: weight 64 t + 32 blk + 4 bj + 2 p + ll
                xt = tl.reshape(tl.permute(tl.reshape(xn, (4, 2, 8, 2, 2, M_PAD)), (1, 2, 3, 0, 4, 5)), (256, M_PAD))
            else:  # MLX, nibbles LSB-first: weight 64 t + 32 half + 4 lhl + 2 ll + p
                xt = tl.reshape(tl.permute(tl.reshape(xn, (4, 2, 8, 2, 2, M_PAD)), (1, 2, 4, 0, 3, 5)), (256, M_PAD))
        acc = tl.dot(w, xt, acc)
        x_ptrs += 256
    pdl_trigger(PDL)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rows < N)[:, None] & m_ok[None, :]
    store_tile(acc, rows, m, ok, Y, PART, COUNT, M, N, pid_k, tl.num_programs(1), pid_m * tl.num_programs(0) + pid_n,
               stride_ys, stride_ym, FIXUP)


def tc_supports(x, data, fmt: str, bits: int = 0, group_size: int = 0, K: int = 0, scales=None, biases=None) -> bool:
    """Whether gemv_tc_kernel reads these weights: q4_k, q5_k, q4_0 and q8_0 (K a multiple of 256 for the last two),
    q6_k, iq4_nl and mxfp4 (rows 16-byte aligned) or MLX 4-bit (K a multiple of 256, scales and biases with a
    contiguous last dim), fp16/bf16 x, and weight data 16-byte aligned (16-byte code loads)."""
    import torch

    if x.dtype not in (torch.float16, torch.bfloat16) or data.data_ptr() % 16:
        return False
    if fmt in ("q4_k", "q5_k"):
        return True
    if fmt in ROW_STRIDE_FORMATS:  # rows 16-byte aligned (K a multiple of 8 q6_k / 16 mxfp4 blocks, or pad_rows)
        return data.shape[-1] * data.element_size() % 16 == 0 and (fmt != "iq4_xs" or K % 256 == 0)
    if fmt in ("q4_0", "q8_0"):
        return K % 256 == 0
    return (fmt == "mlx" and bits == 4 and group_size in (32, 64, 128) and K % 256 == 0
            and scales.stride(-1) == 1 and biases.stride(-1) == 1 and scales.stride(0) == biases.stride(0))


TC_FORMATS = {"q4_k": 10, "q5_k": 11, "q6_k": 12, "q4_0": 3, "q8_0": 7, "mlx": 13, "iq4_nl": 14, "iq4_xs": 15,
              "mxfp4": 16}  # format -> the kernel's FMT
# formats the kernel reads at any K (whole 32-weight blocks; the last step masked) from 16-byte aligned row strides
TAIL_FORMATS = ("iq4_nl", "mxfp4")
ROW_STRIDE_FORMATS = ("q6_k", "iq4_xs") + TAIL_FORMATS


def tc_steps(fmt: str, K: int) -> int:
    """The kernel's 256-weight steps per row for K (the tail formats' last one may be partial)."""
    return -(-K // 256) if fmt in TAIL_FORMATS else K // 256


def _perm(shape, order):
    import torch

    return torch.arange(256, dtype=torch.int32).reshape(shape).permute(order).reshape(256)


# FMT -> int32 [256]: position r of a step in the kernel's k order holds natural column TC_PERMS[FMT][r] (the
# permutes of gemv_tc_kernel's x tile without their M axis)
TC_PERMS = {10: _perm((4, 2, 2, 8, 2), (2, 3, 1, 0, 4)), 11: _perm((4, 2, 2, 8, 2), (2, 3, 1, 0, 4)),
            12: _perm((2, 2, 2, 2, 8, 2), (3, 4, 1, 0, 2, 5)), 3: _perm((4, 2, 2, 8, 2), (1, 3, 2, 0, 4)),
            7: _perm((4, 2, 8, 2, 2), (1, 2, 3, 0, 4)), 13: _perm((4, 2, 8, 2, 2), (1, 2, 4, 0, 3))}
TC_PERMS[14] = TC_PERMS[15] = TC_PERMS[16] = TC_PERMS[3]  # nibbles as q4_0's


@triton.jit
def tc_order_kernel(X, P, Y, nsteps, stride_x, stride_y, NB: tl.constexpr, PDL: tl.constexpr = False):
    """Y[m, 256 s + r] = X[m, 256 s + P[r]] for row pid(0) and steps pid(1) * NB ..: x in the tensor-core kernel's
    k order (its XT input)."""
    pdl_wait(PDL)
    pdl_trigger(PDL)
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1) * NB + tl.arange(0, NB)[:, None]
    r = tl.arange(0, 256)[None, :]
    ok = (s < nsteps) & (r >= 0)
    v = tl.load(X + row * stride_x + s * 256 + tl.load(P + r), mask=ok)
    tl.store(Y + row * stride_y + s * 256 + r, v, mask=ok)


def tc_rows(M: int) -> int:
    """Activation rows per program of gemv_tc_kernel (M_PAD, the dot's N) for M rows: 16, 32 or 64."""
    return 16 if M <= 16 else (32 if M <= 32 else 64)


def tc_order(x, fmt: str):
    """x [M, K] (K a multiple of 256, last dim contiguous) in the k order of gemv_tc_kernel for ``fmt`` (a key of
    TC_FORMATS): a new contiguous [M, K] tensor, for launch_tc's ``xt``. None during CUDA-graph capture before the
    first call on that device: the permutation table would be copied into the graph's private pool (callers then
    take the register path)."""
    import torch

    from .._runtime import empty

    M, K = x.shape
    key = (TC_FORMATS[fmt], x.device)
    if key not in _PERMS_ON:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        _PERMS_ON[key] = TC_PERMS[key[0]].to(x.device)
    y = empty(M, K, dtype=x.dtype, device=x.device)
    nb = 4
    pdl = pdl_supported(x.device)
    tc_order_kernel[(M, triton.cdiv(K // 256, nb))](x, _PERMS_ON[key], y, K // 256, x.stride(0), y.stride(0), NB=nb,
                                                     PDL=pdl, num_warps=4, **pdl_options(pdl))
    return y


_PERMS_ON = {}  # (FMT, device) -> TC_PERMS[FMT] there


def launch_tc(x, data, N: int, K: int, config, sms: int, unpack: int, scales=None, biases=None, group_size: int = 0,
              fmt: str = "q4_k", x2=None, fixup: bool = True, pdl=None, xt=None):
    """Run gemv_tc_kernel for x [M, K] (fp16/bf16) and GGUF blocks of ``fmt`` (q4_k, q5_k, q6_k, q4_0, q8_0), or
    MLX 4-bit words with ``scales``/``biases`` [N, K / group_size] (``fmt`` is then ignored); returns y [split, M, N]
    (float32 partials when split > 1, for ops._finish to sum), or with ``fixup``, a counter buffer (split_outputs)
    and a grid of at most ``waves`` programs per SM, y [1, M, N], the kernel having summed its own partials.

    ``config`` is (BLOCK_N, num_warps, num_stages, waves[, prefetch[, maxnreg]]); K is split until the grid has
    ``waves`` programs per SM. With ``x2`` (like x) the activations are silu(x) * x2 (silu_mul_gemv), rounded to x's
    dtype as the two-step path rounds them. prefetch (q4_0 / q8_0 only) loads the next step's weights before
    computing this one (157 registers instead of 128 for q4_0: 3 programs per SM instead of 4, which pays at M = 1 on
    some shapes and loses at M = 8; bench/NOTES.md). maxnreg caps the registers per thread (q6_k: 153 ->
    127 with no spill, a fourth program per SM; bench/NOTES.md). ``pdl`` (default: pdl_supported) launches
    it with programmatic dependent launch. ``xt``: x already in the kernel's k order (tc_order(x, fmt)), read through
    a TMA descriptor (the kernel's XT; not with x2); K is then split only as far as the grid stays within ``waves``
    programs per SM, so that the kernel sums its own partials (bench/NOTES.md)."""
    import torch


    block_n, warps, stages, waves = config[:4]
    prefetch = bool(config[4]) if len(config) > 4 else False
    maxnreg = {"maxnreg": int(config[5])} if len(config) > 5 and config[5] else {}
    M = x.shape[0]
    # the activation rows are the dot's N: 16, 32 or 64 of them per program, so up to M = 64 each weight is read once
    m_pad = tc_rows(M)
    row_bytes = data.shape[-1] * data.element_size()
    nblocks = tc_steps("mlx" if scales is not None else fmt, K)
    programs_n = triton.cdiv(N, block_n)
    grid_m = triton.cdiv(M, m_pad)
    split, per_split = split_k(programs_n * grid_m, nblocks, 1, sms, waves, fit=xt is not None)
    # the kernel sums its own partials only when the whole grid fits in the ``waves`` programs per SM: each program
    # then waits for its arrival atomic once, not once per wave (bench/NOTES.md)
    fixup = fixup and programs_n * grid_m * split <= waves * sms
    y, part, counters = split_outputs(M, x.dtype, x.device, N, split, programs_n * grid_m, fixup)
    w8 = data.view(torch.uint8)
    mlx = scales is not None
    pdl = pdl_supported(x.device) if pdl is None else pdl
    xd = None
    if xt is not None:
        from triton.tools.tensor_descriptor import TensorDescriptor

        if x2 is not None or xt.shape != x.shape or xt.dtype != x.dtype or not xt.is_contiguous():
            raise ValueError("launch_tc: xt must be tc_order(x, fmt), and not with x2")
        xd = TensorDescriptor.from_tensor(xt, [m_pad, 256])
    gemv_tc_kernel[(programs_n, split, grid_m)](
        x, x2 if x2 is not None else x, w8, scales if mlx else w8, biases if mlx else w8, y, part,
        counters if counters is not None else y, M, N, K, x.stride(0),
        x2.stride(0) if x2 is not None else 0, y.stride(0), y.stride(1), row_bytes, scales.stride(0) if mlx else 0,
        nblocks, per_split, FMT=TC_FORMATS["mlx" if mlx else fmt], GS=group_size if mlx else 256, BLOCK_N=block_n,
        M_PAD=m_pad, UNPACK=unpack, PREFETCH=prefetch, SILU=0 if x2 is None else (1 if unpack == 1 else 2),
        FIXUP=counters is not None, PDL=pdl, XD=xd, XT=xd is not None, num_warps=warps, num_stages=stages, **maxnreg,
        **pdl_options(pdl))
    return y


def launch_tc_moe(x, data, N: int, K: int, config, P: int, pairs, block_expert, block_m: int, top_k: int,
                  n_experts: int, unpack: int, fmt: str = "q4_k", token_ids=None, y=None, up=None, x2=None,
                  scales=None, biases=None, group_size: int = 0, pdl=None, split: int = 1):
    """The pairs' products on the tensor cores, pairs grouped by expert (moe.group_pairs: ``pairs`` [blocks *
    block_m], ``block_expert`` [blocks]) for P pairs: y[p] = x[t] . W_e, t = token_ids[p] (default p // top_k),
    with e the expert of p's block and W_e rows e * N .. (e + 1) * N of the stack ``data``. ``y`` [P, N] (or
    [P, 2N] with ``up``, whose products fill columns N .. 2N - 1) may be given, e.g. a strided view. With ``x2``
    the activations are silu(x) * x2 (rows as x's). ``config`` as launch_tc's (its waves unused). ``split`` > 1
    (without ``y``): K split that many ways, float32 partials [split, P, N] returned for ops._finish to sum."""
    import torch

    from .._runtime import empty

    block_n, warps, stages = config[:3]
    maxnreg = {"maxnreg": int(config[5])} if len(config) > 5 and config[5] else {}
    prefetch = bool(config[4]) if len(config) > 4 else False
    nblocks = tc_steps("mlx" if scales is not None else fmt, K)
    per_split = -(-nblocks // max(1, split))
    split = -(-nblocks // per_split)
    cols = N * (2 if up is not None else 1)
    if split > 1:
        if y is not None:
            raise ValueError("launch_tc_moe: split > 1 returns its own partials; y must be None")
        y = empty(split, P, cols, dtype=torch.float32, device=x.device)
    elif y is None:
        y = empty(P, cols, dtype=x.dtype, device=x.device)
    w8 = data.view(torch.uint8)
    mlx = scales is not None
    pdl = pdl_supported(x.device) if pdl is None else pdl
    tiles = triton.cdiv(N, block_n) * (2 if up is not None else 1)
    gemv_tc_kernel[(tiles, split, block_expert.shape[0])](
        x, x2 if x2 is not None else x, w8, scales if mlx else w8, biases if mlx else w8, y, y, y, P, N, K,
        x.stride(0), x2.stride(0) if x2 is not None else 0, y.stride(0) if split > 1 else 0, y.stride(-2),
        data.shape[-1] * data.element_size(), scales.stride(-2) if mlx else 0, nblocks, per_split,
        FMT=TC_FORMATS["mlx" if mlx else fmt],
        GS=group_size if mlx else 256, BLOCK_N=block_n, M_PAD=block_m, UNPACK=unpack, PREFETCH=prefetch,
        SILU=0 if x2 is None else (1 if unpack == 1 else 2), FIXUP=False, PDL=pdl, XD=None, XT=False,
        PAIRS=pairs, BLOCK_EXPERT=block_expert, WU=up.view(torch.uint8) if up is not None else None,
        n_experts=n_experts, TOKEN=token_ids, TOPK=top_k, num_warps=warps, num_stages=stages, **maxnreg,
        **pdl_options(pdl))
    return y


def compile_sm90(fmt: str, config: tuple = (64, 4, 1, 4), m_pad: int = 16, top_k: int = 0, dtype: str = "bf16",
                 silu: bool = False):
    """gemv_tc_kernel compiled for sm_90 without a GPU (set TRITON_INTERPRET=0 before importing llmkernels) for a
    GGUF format (a key of TC_FORMATS but mlx): ``config`` as launch_tc takes it, ``top_k`` > 0 the
    mixture-of-experts build, ``silu`` silu_mul_gemv's. For tests and for reading the code the compiler makes."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    block_n, warps, stages = config[:3]
    sig = {"X": f"*{dtype}", "X2": f"*{dtype}", "W8": "*u8", "WS": "*u8", "WB": "*u8", "Y": f"*{dtype}",
           "PART": "*fp32", "COUNT": "*i32"}
    sig.update({name: "i32" for name in ("M", "N", "K", "stride_xm", "stride_x2m", "stride_ys", "stride_ym",
                                          "row_bytes", "scale_stride", "nblocks", "blocks_per_split")})
    consts = dict(FMT=TC_FORMATS[fmt], GS=256, BLOCK_N=block_n, M_PAD=m_pad, UNPACK=2,
                  PREFETCH=bool(config[4]) if len(config) > 4 else False, SILU=2 if silu else 0, FIXUP=not top_k,
                  PDL=False, XD=None, XT=False, WU=None, TOKEN=None, TOPK=top_k)
    if top_k:
        sig.update(PAIRS="*i32", BLOCK_EXPERT="*i32", n_experts="i32")
    else:
        consts.update(PAIRS=None, BLOCK_EXPERT=None, n_experts=1)
    sig.update({name: "constexpr" for name in consts})
    # as a launch specializes them: buffers 16-byte aligned, rows a multiple of 16 bytes (what lets loads vectorize)
    aligned = [n for n, v in sig.items() if v.startswith("*")] + ["K", "row_bytes", "stride_xm", "stride_x2m"]
    attrs = {(gemv_tc_kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton.compile(ASTSource(gemv_tc_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})
