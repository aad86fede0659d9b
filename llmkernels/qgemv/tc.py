"""GEMV for 3 <= M <= 64 on the tensor cores, q4_k and MLX 4-bit: weights dequantized to fp16/bf16 in registers and
fed to tl.dot.

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
- the header words come through pointers [4, 8, A, 2, 1, 1] of the same layout (each lane decodes the scales of its
  chunk), and x is loaded in natural order ([256, M_PAD], 16-byte loads) and permuted to the k order on its way
  into shared memory, where the wgmma reads it as the B operand.
MLX 4-bit uses the same tile: a step is 128 bytes of codes per row, byte b of chunk t holding weights 64 t + 2 b (low
nibble) and 64 t + 2 b + 1 (high), so only x's permutation differs; each 16-byte half chunk takes the scale and bias
of its group (group size 32, 64 or 128) as its fma operands.
Loads go straight to registers (num_stages 1): letting Triton's pipeliner stage the codes in shared memory measured
2x slower (bank-conflicted reads of each thread's 64 contiguous bytes; ncu: L1 75% busy, MIO throttle), and loading
the next step's codes and scales one step ahead 20-30% slower (163 registers: 3 programs per SM instead of 4).
"""
import triton
import triton.language as tl

from .m1 import _q4k_scales, _split_words


def _asm_q4(bf16: bool) -> str:
    """PTX: 4 packed bytes ($4) and per-element scales -> w = q * s + nz for the low and the high nibbles.

    Outputs $0,$1: low nibbles of bytes (0,1), (2,3); $2,$3: high nibbles. Inputs: $4 bytes, $5,$6 s_lo, $7,$8 nz_lo,
    $9,$10 s_hi, $11,$12 nz_hi (two 16-bit values per register). A byte pair is spread into the two halves of a
    register (prmt), the nibble is masked into the mantissa of a magic float (fp16 1024 + q, bf16 128 + q) and the
    magic is subtracted exactly; then one fma per pair applies the sub-block's scale and min."""
    if bf16:
        return ("{ .reg .b32 t0, t1, u0, u1, m, a; "
                "prmt.b32 t0, $4, 0, 0x4140; prmt.b32 t1, $4, 0, 0x4342; "
                "shr.b32 u0, t0, 4; shr.b32 u1, t1, 4; mov.b32 m, 0x43004300; "
                "lop3.b32 a, t0, 0x000F000F, m, 0xEA; sub.rn.bf16x2 a, a, m; fma.rn.bf16x2 $0, a, $5, $7; "
                "lop3.b32 a, t1, 0x000F000F, m, 0xEA; sub.rn.bf16x2 a, a, m; fma.rn.bf16x2 $1, a, $6, $8; "
                "lop3.b32 a, u0, 0x000F000F, m, 0xEA; sub.rn.bf16x2 a, a, m; fma.rn.bf16x2 $2, a, $9, $11; "
                "lop3.b32 a, u1, 0x000F000F, m, 0xEA; sub.rn.bf16x2 a, a, m; fma.rn.bf16x2 $3, a, $10, $12; }")
    return ("{ .reg .b32 t0, t1, m, h, k, a; "
            "prmt.b32 t0, $4, 0, 0x4140; prmt.b32 t1, $4, 0, 0x4342; "
            "mov.b32 m, 0x64006400; mov.b32 h, 0x2C002C00; mov.b32 k, 0xD400D400; "
            "lop3.b32 a, t0, 0x000F000F, m, 0xEA; sub.f16x2 a, a, m; fma.rn.f16x2 $0, a, $5, $7; "
            "lop3.b32 a, t1, 0x000F000F, m, 0xEA; sub.f16x2 a, a, m; fma.rn.f16x2 $1, a, $6, $8; "
            "lop3.b32 a, t0, 0x00F000F0, m, 0xEA; fma.rn.f16x2 a, a, h, k; fma.rn.f16x2 $2, a, $9, $11; "
            "lop3.b32 a, t1, 0x00F000F0, m, 0xEA; fma.rn.f16x2 a, a, h, k; fma.rn.f16x2 $3, a, $10, $12; }")


_ASM_Q4_F16 = tl.constexpr(_asm_q4(False))
_ASM_Q4_BF16 = tl.constexpr(_asm_q4(True))


@triton.jit
def _deq_q4(units, s_lo, nz_lo, s_hi, nz_hi, DT: tl.constexpr, UNPACK: tl.constexpr):
    """(low, high) nibble weights q * s + nz of a uint8 tile, in DT (fp16 or bf16)."""
    if UNPACK == 2:
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
def gemv_tc_kernel(X, W8, WS, WB, Y, M, N, K, stride_xm, stride_ys, stride_ym, row_bytes, scale_stride, nblocks,
                   blocks_per_split, FMT: tl.constexpr, GS: tl.constexpr, BLOCK_N: tl.constexpr,
                   M_PAD: tl.constexpr, UNPACK: tl.constexpr):
    """y[m, n] (+)= sum over this program's K split of x[m] . w[n] for BLOCK_N rows and M_PAD activation rows.

    FMT 10 (q4_k): a step is one super-block; WS and WB are unused. FMT 13 (MLX 4-bit): a step is 128 bytes of
    codes (256 weights) per row, the scale and bias of group g of row n at WS/WB + n * scale_stride + g, GS weights
    per group."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    DT: tl.constexpr = X.dtype.element_ty
    A: tl.constexpr = BLOCK_N // 16
    STEP: tl.constexpr = 144 if FMT == 10 else 128  # bytes of one row per step
    t_ = tl.arange(0, 4)[:, None, None, None, None, None]
    g_ = tl.arange(0, 8)[None, :, None, None, None, None]
    a_ = tl.arange(0, A)[None, None, :, None, None, None]
    h_ = tl.arange(0, 2)[None, None, None, :, None, None]
    half_ = tl.arange(0, 2)[None, None, None, None, :, None]
    b_ = tl.arange(0, 16)[None, None, None, None, None, :]
    kb_start = pid_k * blocks_per_split
    kb_end = tl.minimum(kb_start + blocks_per_split, nblocks)
    # rows past N read row N - 1 (in bounds, never stored)
    row = tl.minimum(pid_n * BLOCK_N + 16 * a_ + 8 * h_ + g_, N - 1).to(tl.int64)
    base = row * row_bytes + kb_start * STEP
    if FMT == 10:
        w_ptrs = W8 + base + 16 + t_ * 32 + half_ * 16 + b_
        h_ptrs = W8.to(tl.pointer_type(tl.int32), bitcast=True) + base // 4 + t_ * 0
    else:  # the group of each 32-weight half chunk: (256 kb + 64 t + 32 half) // GS
        w_ptrs = W8 + base + t_ * 32 + half_ * 16 + b_
        s_off = row * scale_stride + kb_start * (256 // GS) + (64 * t_ + 32 * half_) // GS
        s_ptrs = WS + s_off
        z_ptrs = WB + s_off
    m = pid_m * M_PAD + tl.arange(0, M_PAD)
    x_ptrs = X + m[None, :] * stride_xm + kb_start * 256 + tl.arange(0, 256)[:, None]
    x_ok = (m[None, :] < M) & (tl.arange(0, 256)[:, None] >= 0)
    acc = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
    for kb in range(kb_start, kb_end):
        units = tl.load(w_ptrs)
        if FMT == 10:
            d, dmin = _split_words(tl.load(h_ptrs), tl.float16)  # the header's first word: fp16 d, fp16 dmin
            sc0, mn0, sc1, mn1 = _q4k_scales(tl.load(h_ptrs + 1), tl.load(h_ptrs + 2), tl.load(h_ptrs + 3), t_)
            w_lo, w_hi = _deq_q4(units, (d * sc0).to(DT), (-dmin * mn0).to(DT), (d * sc1).to(DT),
                                 (-dmin * mn1).to(DT), DT, UNPACK)
            h_ptrs += 36
        else:
            s = tl.load(s_ptrs).to(DT)
            z = tl.load(z_ptrs).to(DT)
            w_lo, w_hi = _deq_q4(units, s, z, s, z, DT, UNPACK)
            s_ptrs += 256 // GS
            z_ptrs += 256 // GS
        w = tl.reshape(tl.join(w_lo, w_hi), (4, 8, A, 2, 2, 8, 2, 2))  # t, g, a, h, half, lhl, ll, p
        w = tl.reshape(tl.permute(w, (2, 3, 1, 4, 5, 7, 0, 6)), (BLOCK_N, 256))  # [a h g] x [half lhl p t ll]
        xn = tl.load(x_ptrs, mask=x_ok, other=0.0)
        if FMT == 10:  # byte 16 half + 2 lhl + ll of chunk t, nibble p: weight 64 t + 32 p + 16 half + 2 lhl + ll
            xt = tl.reshape(tl.permute(tl.reshape(xn, (4, 2, 2, 8, 2, M_PAD)), (2, 3, 1, 0, 4, 5)), (256, M_PAD))
        else:  # MLX, nibbles LSB-first: weight 64 t + 32 half + 4 lhl + 2 ll + p
            xt = tl.reshape(tl.permute(tl.reshape(xn, (4, 2, 8, 2, 2, M_PAD)), (1, 2, 4, 0, 3, 5)), (256, M_PAD))
        acc = tl.dot(w, xt, acc)
        w_ptrs += STEP
        x_ptrs += 256
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    y_ptrs = Y + pid_k * stride_ys + m[None, :] * stride_ym + rows[:, None]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=(rows < N)[:, None] & (m < M)[None, :])


def tc_supports(x, data, fmt: str, bits: int = 0, group_size: int = 0, K: int = 0, scales=None, biases=None) -> bool:
    """Whether gemv_tc_kernel reads these weights: q4_k or MLX 4-bit (K a multiple of 256, scales and biases with
    a contiguous last dim), fp16/bf16 x, and weight data 16-byte aligned (16-byte code loads)."""
    import torch

    if x.dtype not in (torch.float16, torch.bfloat16) or data.data_ptr() % 16:
        return False
    if fmt == "q4_k":
        return True
    return (fmt == "mlx" and bits == 4 and group_size in (32, 64, 128) and K % 256 == 0
            and scales.stride(-1) == 1 and biases.stride(-1) == 1 and scales.stride(0) == biases.stride(0))


def launch_tc(x, data, N: int, K: int, config, sms: int, unpack: int, scales=None, biases=None, group_size: int = 0):
    """Run gemv_tc_kernel for x [M, K] (fp16/bf16) and q4_k blocks, or MLX 4-bit words with ``scales``/``biases``
    [N, K / group_size]; returns y [split, M, N] (float32 partials when split > 1, for ops._finish to sum).
    ``config`` is (BLOCK_N, num_warps, num_stages, waves); K is split until the grid has ``waves`` programs per
    SM."""
    import torch

    from .._runtime import empty
    from .ops import split_k

    block_n, warps, stages, waves = config
    M = x.shape[0]
    # the activation rows are the dot's N: 16, 32 or 64 of them per program, so up to M = 64 each weight is read once
    m_pad = 16 if M <= 16 else (32 if M <= 32 else 64)
    row_bytes = data.shape[-1] * data.element_size()
    nblocks = K // 256
    programs_n = triton.cdiv(N, block_n)
    grid_m = triton.cdiv(M, m_pad)
    split, per_split = split_k(programs_n * grid_m, nblocks, 1, sms, waves)
    y = empty(split, M, N, dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    w8 = data.view(torch.uint8)
    mlx = scales is not None
    gemv_tc_kernel[(programs_n, split, grid_m)](
        x, w8, scales if mlx else w8, biases if mlx else w8, y, M, N, K, x.stride(0), y.stride(0), y.stride(1),
        row_bytes, scales.stride(0) if mlx else 0, nblocks, per_split, FMT=13 if mlx else 10,
        GS=group_size if mlx else 256, BLOCK_N=block_n, M_PAD=m_pad, UNPACK=unpack, num_warps=warps,
        num_stages=stages)
    return y
