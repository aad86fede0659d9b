"""Fast GEMV for the main formats (q4_0, q8_0, q4_k, MLX 2/4/8-bit): every packed byte or word is loaded once.

A block's packed storage is a tile of "units" (bytes or uint32 words) [BLOCK_N, NB, C, U]; each unit holds P
values ("planes") at fixed shifts. Plane p of unit (c, u) is weight e_p(c, u) of its block, so instead of
gathering a unit once per weight (what the generic kernel does) the kernel loads the unit tile once, and for each
plane shifts, masks, scales and multiplies with the matching activations x[block * BS + e_p(c, u)].

Layouts (quant/formats.py):
- q4_0: 16 bytes after d; plane 0 = low nibble = weight u, plane 1 = high nibble = weight 16 + u.
- q8_0: 32 int8 after d; one plane.
- q4_k: 4 chunks of 32 bytes; chunk c plane p is sub-block 2c + p, weight c*64 + p*32 + u.
- MLX: per group, words of 32/bits values; plane p of word u is weight u * (32/bits) + p of the group.
"""
import triton
import triton.language as tl

from .kernels import _load_x


@triton.jit
def _small_int_to_f32(q):
    """An int in [0, 2**23) to float32 without I2F (quarter rate or less on Hopper): put its bits in the mantissa
    of 2**23 and subtract 2**23. One OR and one FADD, exact."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _scale_min_q4k(W8, base, c, p, ok):
    """q4_k's 6-bit (scale, min) of sub-block s = 2c + p as float32, same shape as ``base + c`` (shared with m1.py)."""
    s = 2 * c + p
    s4 = s % 4
    b_a = tl.load(W8 + base + 4 + s4, mask=ok, other=0).to(tl.int32)
    b_b = tl.load(W8 + base + 8 + s4, mask=ok, other=0).to(tl.int32)
    b_c = tl.load(W8 + base + 12 + s4, mask=ok, other=0).to(tl.int32)
    first = s < 4
    sc = tl.where(first, b_a & 63, (b_c & 0xF) | ((b_a >> 6) << 4))
    mn = tl.where(first, b_b & 63, (b_c >> 4) | ((b_b >> 6) << 4))
    return _small_int_to_f32(sc), _small_int_to_f32(mn)


@triton.jit
def gemv_planes_kernel(X, X2, W8, W16, WI8, WS, WB, Y, M, N, K, stride_xm, stride_x2m, stride_ys, stride_ym,
                       row_bytes, scale_stride, nblocks, blocks_per_split,
                       FMT: tl.constexpr, NB: tl.constexpr, C: tl.constexpr, U: tl.constexpr, P: tl.constexpr,
                       BS: tl.constexpr, BLOCK_BYTES: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                       M_PAD: tl.constexpr, SILU_X: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < N
    m = pid_m * M_PAD + tl.arange(0, M_PAD)
    m_ok = m < M
    kb_start = pid_k * blocks_per_split
    kb_end = tl.minimum(kb_start + blocks_per_split, nblocks)
    r = rows[:, None, None, None]
    c = tl.arange(0, C)[None, None, :, None]
    u = tl.arange(0, U)[None, None, None, :]
    if M_PAD == 1:
        acc = tl.zeros([BLOCK_N, NB, C, U], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
    for kb in range(kb_start, kb_end, NB):
        blk = kb + tl.arange(0, NB)
        b = blk[None, :, None, None]
        ok = row_ok[:, None, None, None] & (blk < kb_end)[None, :, None, None]
        ok_c = ok & (c >= 0)
        ok_u = ok_c & (u >= 0)
        base = r * row_bytes + b * BLOCK_BYTES
        # the packed units, each loaded once
        if FMT == 3:  # q4_0
            units = tl.load(W8 + base + 2 + u, mask=ok_u, other=0).to(tl.int32)
            d = tl.load(W16 + base // 2, mask=ok, other=0.0).to(tl.float32)
        elif FMT == 7:  # q8_0: read as uint8 and flip the sign bit, so q + 128 is a small non-negative int
            units = _small_int_to_f32(tl.load(W8 + base + 2 + u, mask=ok_u, other=0).to(tl.int32) ^ 0x80) - 128.0
            d = tl.load(W16 + base // 2, mask=ok, other=0.0).to(tl.float32)
        elif FMT == 10:  # q4_k
            units = tl.load(W8 + base + 16 + c * 32 + u, mask=ok_u, other=0).to(tl.int32)
            d = tl.load(W16 + base // 2, mask=ok, other=0.0).to(tl.float32)
            dmin = tl.load(W16 + base // 2 + 1, mask=ok, other=0.0).to(tl.float32)
        else:  # MLX: words of the group b
            Wi32 = W8.to(tl.pointer_type(tl.int32))
            units = tl.load(Wi32 + r * (row_bytes // 4) + b * U + u, mask=ok_u, other=0)
            sc = tl.load(WS + r * scale_stride + b, mask=ok, other=0.0).to(tl.float32)
            bi = tl.load(WB + r * scale_stride + b, mask=ok, other=0.0).to(tl.float32)
        for p in tl.static_range(P):
            if FMT == 3:
                w = d * (_small_int_to_f32((units >> (4 * p)) & 0xF) - 8.0)
                e = p * 16 + u + c * 0
            elif FMT == 7:
                w = d * units
                e = u + c * 0
            elif FMT == 10:
                scl, mnv = _scale_min_q4k(W8, base, c, p, ok_c)
                w = (d * scl) * _small_int_to_f32((units >> (4 * p)) & 0xF) - dmin * mnv
                e = c * 64 + p * 32 + u
            else:
                q = (units >> (BITS * p)) & ((1 << BITS) - 1)
                w = sc * _small_int_to_f32(q) + bi
                e = u * P + p + c * 0
            kx = b * BS + e  # [1, NB, C, U] weight index along K
            if M_PAD == 1:
                xv = tl.load(X + kx, mask=kx < K, other=0.0).to(tl.float32)
                if SILU_X:
                    uv = tl.load(X2 + kx, mask=kx < K, other=0.0).to(tl.float32)
                    xv = (xv / (1.0 + tl.exp(-xv)) * uv).to(X.dtype.element_ty).to(tl.float32)
                acc += w * xv
            else:
                kflat = tl.reshape(kx, (NB * C * U,))
                xm = _load_x(X, X2, m, m_ok, kflat, kflat < K, stride_xm, stride_x2m, SILU_X)
                w2 = tl.reshape(w, (BLOCK_N, NB * C * U)).to(xm.dtype)
                acc = tl.dot(w2, tl.trans(xm), acc)
    if M_PAD == 1:
        out = tl.sum(tl.reshape(acc, (BLOCK_N, NB * C * U)), axis=1)[:, None]
    else:
        out = acc
    y_ptrs = Y + pid_k * stride_ys + m[None, :] * stride_ym + rows[:, None]
    tl.store(y_ptrs, out.to(Y.dtype.element_ty), mask=row_ok[:, None] & m_ok[None, :])
