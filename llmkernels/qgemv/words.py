"""q4_0 and q8_0 blocks read as aligned int32 words: helpers for the kernels that load them that way (int8.py's
dp4a kernel; tc.py's lane loads use _funnel).

A q4_0 block is 18 bytes (fp16 d, 16 code bytes) and a q8_0 block 34 (d, 32 codes), so their codes are only 2-byte
aligned, and a kernel that loads them where they lie gets 2-byte loads. G consecutive blocks are 16-byte (q4_0, G = 8:
144 bytes) or 8-byte (q8_0, G = 4: 136 bytes) aligned when K is a multiple of 256, so a kernel can load a row's G
blocks as vectors of int32 words, split them into single words in the registers (_scalars), and rebuild each block's
code words from them (_block_codes): a block that starts in the middle of a word gets its code words from two
neighbours (one byte permute each, _funnel), the next block's codes are word-aligned.
"""
import triton
import triton.language as tl

from .m1 import _split_words

# bytes 2, 3 of $1 and 0, 1 of $2: the code word of a block that starts at byte 2 of a word
_ASM_FUNNEL = tl.constexpr("prmt.b32 $0, $1, $2, 0x5432;")


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
