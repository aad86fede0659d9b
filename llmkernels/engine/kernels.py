"""The engine's own small kernels: fused residual add + RMSNorm, and fused QKV bias / QK-norm / RoPE / KV store.

Each removes passes over memory that separate torch ops would make: the add-norm reads the residual stream once and
writes it once; the RoPE kernel reads the QKV projection once, rotates Q in place and writes K/V straight into their
cache pages (no rotated-K temporary, no separate ``store_kv`` call and its host-side slot check).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._checks import check_tensor
from .._pdl import pdl_options, pdl_supported, pdl_trigger, pdl_wait
from ..kv_cache import FP8_DTYPES
from ..qgemv.int8 import i8_lane_base, quantize_blocks
from ..qgemv.m1 import lane_pos, lanes_width
from .allreduce import FUSED_SPIN_LIMIT, peer_sum
from .config import OSS_ALPHA, OSS_LIMIT


@triton.jit
def _add_rmsnorm_kernel(X, XW, R, W, PW, Y, YL, DS, stride_x, stride_r, stride_y, stride_yl, stride_ds, H, y_width,
                        eps, HAS_RES: tl.constexpr, LANES: tl.constexpr, I8: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr, PRE: tl.constexpr = False, TOPK: tl.constexpr = 0, PTRS=None, CNT=None,
                        peer_rows=0, flag_off=0, rank=0, WORLD: tl.constexpr = 0, SPIN: tl.constexpr = 1, XB=None,
                        XBI=None):
    """One row: y = rmsnorm(r + x) * w (r += x first with HAS_RES; with PRE, x is first replaced by rmsnorm(x) * pw,
    rounded to the activation dtype as a separate call would write it; with TOPK, x is the sum of rows row * TOPK ..
    of X weighted by XW [rows, TOPK] in float32, rounded to X's dtype as moe_combine would write it). XB: a bias added to x first, the sum rounded to X's dtype
    (XB [H]; with TOPK, XB [E, H] whose row XBI[p] joins row p of X: gpt-oss's per-expert down bias). With I8 the row
    is a tile [BLOCK / 32, 2, 16] (blocks of 32 as two halves), the shape the rounding per block and its 16-byte
    stores in i8 lane order need; otherwise a vector (the 3-D tile measured slower there: engine q4_k batch 1 354
    against 364-365 tok/s, H100). Y's row is y_width >= H wide: its columns past H get zeros (every term there is
    0: x and w load as 0). With WORLD > 0, x is one rank's partial, summed over the ranks first (allreduce.peer_sum)."""
    pdl_wait(PDL)  # PDL (see _pdl.py): a short kernel lets the next one launch at once
    pdl_trigger(PDL)
    row = tl.program_id(0).to(tl.int64)
    if I8:
        b3 = tl.arange(0, BLOCK // 32)[:, None, None]
        h3 = tl.arange(0, 2)[None, :, None]
        j3 = tl.arange(0, 16)[None, None, :]
        cols = b3 * 32 + h3 * 16 + j3
    else:
        cols = tl.arange(0, BLOCK)
    mask = cols < H
    if TOPK > 0:  # a mixture-of-experts FFN's pair products, summed here instead of by a launch of their own
        acc = tl.zeros(cols.shape, dtype=tl.float32)
        for j in tl.static_range(TOPK):
            xj = tl.load(X + (row * TOPK + j) * stride_x + cols, mask=mask, other=0.0)
            if XB is not None:
                bj = tl.load(XB + tl.load(XBI + row * TOPK + j).to(tl.int64) * H + cols, mask=mask, other=0.0)
                xj = (xj.to(tl.float32) + bj.to(tl.float32)).to(X.dtype.element_ty)
            acc += tl.load(XW + row * TOPK + j) * xj.to(tl.float32)
        x = acc.to(X.dtype.element_ty)
    else:
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
        if XB is not None:
            x = (x.to(tl.float32) + tl.load(XB + cols, mask=mask, other=0.0).to(tl.float32)).to(X.dtype.element_ty)
    if WORLD > 0:  # a tensor-parallel row-parallel product's partials: the all-reduce happens here
        x = peer_sum(x, row, cols, mask, H, PTRS, CNT, peer_rows, flag_off, rank, WORLD, SPIN)
    if PRE:  # a post-norm (Gemma 2/3) of the block's output before it joins the residual stream
        pf = x.to(tl.float32)
        pr = 1.0 / tl.sqrt(tl.sum(pf * pf) / H + eps)
        pw = tl.load(PW + cols, mask=mask, other=0.0).to(tl.float32)
        x = ((pf * pr).to(X.dtype.element_ty).to(tl.float32) * pw).to(X.dtype.element_ty)
    if HAS_RES:  # residual stream h = r + x, kept in the activation dtype (as the reference models do)
        x = (tl.load(R + row * stride_r + cols, mask=mask, other=0.0) + x).to(R.dtype.element_ty)
        tl.store(R + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf) / H + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    y = (xf * rstd).to(Y.dtype.element_ty).to(tl.float32) * w
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=cols < y_width)
    if LANES:  # a second copy in the q4_k GEMV's lane order (qgemv.m1.lane_pos)
        tl.store(YL + row * stride_yl + lane_pos(cols), y.to(Y.dtype.element_ty), mask=mask)
    if I8:  # y rounded to int8 per block of 32 (as int8.quantize_act rounds it), in i8 lane order
        q, d, s = quantize_blocks(y.to(Y.dtype.element_ty).to(tl.float32))
        tl.store(YL + row * stride_yl + i8_lane_base(b3, h3) + j3, q.to(tl.int8), mask=mask)
        b = tl.arange(0, BLOCK // 32)
        tl.store(DS + row * stride_ds + b * 2, d, mask=b < H // 32)
        tl.store(DS + row * stride_ds + b * 2 + 1, s, mask=b < H // 32)


def add_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                out: torch.Tensor | None = None, lanes: bool = False, i8: bool = False,
                pre_weight: torch.Tensor | None = None, x_weights: torch.Tensor | None = None, peers=None,
                x_bias: torch.Tensor | None = None, x_bias_ids: torch.Tensor | None = None):
    """y = rmsnorm(residual + x) * weight; with ``residual`` given, residual += x in place first. With ``pre_weight``
    ([H], a post-norm such as Gemma's), x stands for rmsnorm(x) * pre_weight in all of that (x is not written).
    With ``x_weights`` (float32 [T, k], contiguous), x is [T * k, H] and row t stands for the weighted sum of its
    rows t * k .. t * k + k - 1, as qgemv.moe.moe_combine computes it (a mixture-of-experts FFN's pair products).
    ``x_bias`` (x's dtype or float32): [H] added to x's rows first, each sum taken in float32 and rounded to x's
    dtype (an output projection's bias); with ``x_weights``, [E, H] with ``x_bias_ids`` (int32/int64 [T * k], values in
    [0, E), not checked: made on the device) giving the row added to each of x's rows (per-expert biases).

    x, residual: [T, H] fp16/bf16/fp32 (last dim contiguous); weight: [H] any float dtype. Returns y [T, H], and with
    ``lanes`` (y, y in lane order [T, lanes_width(H)]) for qgemv.ops.gemv_lanes; with ``i8`` (H a multiple of 32)
    (y, (q, ds)), y rounded to int8 per block of 32 as qgemv.int8.quantize_act(y, lanes=True) rounds it: q int8
    [T, lanes_width(H)] in i8 lane order, ds float32 [T, H / 32, 2], for qgemv.ops.gemv_i8_lanes.

    ``out`` [T, W] (last dim contiguous) receives y; W may exceed H, and its columns past H are then set to zero (x
    for a matrix padded with zero blocks along K, with no padding launch); y is out[:, :H].

    ``peers`` (an ``allreduce.FusedRows`` whose ``fits(x)``, on a tensor-parallel rank): x is this rank's partial of a
    row-parallel product, summed over the ranks inside the kernel before everything else (every rank calls this).
    """
    T, H = x.shape
    k = 0
    if x_weights is not None:
        T, k = x_weights.shape
        if x.shape[0] != T * k or x_weights.dtype != torch.float32 or not x_weights.is_contiguous():
            raise ValueError(f"add_rmsnorm: x_weights must be contiguous float32 [T, k] with x [T * k, H], got "
                             f"{x_weights.dtype} {tuple(x_weights.shape)} for x {tuple(x.shape)}")
    if lanes and i8:
        raise ValueError("add_rmsnorm: lanes and i8 are two layouts of one copy; ask for one")
    if i8 and H % 32:
        raise ValueError(f"add_rmsnorm: i8 needs H a multiple of 32, got {H}")
    if out is not None and (out.dim() != 2 or out.shape[0] != T or out.shape[1] < H or out.stride(1) != 1):
        raise ValueError(f"add_rmsnorm: out must be [T={T}, >= H={H}] with its last dim contiguous, got shape "
                         f"{tuple(out.shape)}, strides {tuple(out.stride())}")
    y = out if out is not None else torch.empty(T, H, dtype=x.dtype, device=x.device)
    y_width = y.shape[1]
    yl, ds = y, y
    if lanes or i8:
        yl = torch.empty(T, lanes_width(H), dtype=torch.int8 if i8 else y.dtype, device=y.device)
    if i8:
        ds = torch.empty(T, H // 32, 2, dtype=torch.float32, device=y.device)
    if x_bias is not None:
        check_tensor("x_bias", x_bias, dtypes=(x.dtype, torch.float32), shape=(None, H) if k else (H,), contiguous=True)
        if k:
            check_tensor("x_bias_ids", x_bias_ids, dtypes=(torch.int32, torch.int64), shape=(T * k,),
                         contiguous=True)
        elif x_bias_ids is not None:
            raise ValueError("add_rmsnorm: x_bias_ids goes with x_weights (per-expert biases)")
    elif x_bias_ids is not None:
        raise ValueError("add_rmsnorm: x_bias_ids given without x_bias")
    if peers is not None and (x_weights is not None or not peers.fits(x)):
        raise ValueError(f"add_rmsnorm: peers sums [<= {peers.rows}, {peers.hidden}] {peers.dtype} rows without "
                         f"x_weights, got x {x.dtype} {tuple(x.shape)}")
    if T:
        r = residual if residual is not None else x
        fused = {} if peers is None else dict(PTRS=peers.ptrs, CNT=peers.counts, peer_rows=peers.rows,
                                               flag_off=peers.flag_off, rank=peers.rank, WORLD=peers.world,
                                               SPIN=FUSED_SPIN_LIMIT)
        pdl = pdl_supported(x.device)
        BLOCK = max(32, triton.next_power_of_2(y_width))
        # 256 elements per warp, 4 to 16 warps: at batch 1 the one program's latency is what the step pays (H100,
        # engine q4_k batch 1, H = 4096, tok/s with 4 / 8 / 16 warps: exact 363.3 / 369.4 / 371.0, act_int8 428.5 /
        # 427.4 / 432.8; bench/NOTES.md)
        pw = pre_weight if pre_weight is not None else weight
        _add_rmsnorm_kernel[(T,)](x, x_weights if k else x, r, weight, pw, y, yl, ds,
                                  x.stride(0), r.stride(0), y.stride(0), yl.stride(0), ds.stride(0), H, y_width,
                                  eps,
                                  HAS_RES=residual is not None, LANES=lanes, I8=i8, BLOCK=BLOCK, PDL=pdl,
                                  PRE=pre_weight is not None, TOPK=k, num_warps=min(16, max(4, BLOCK // 256)),
                                  XB=x_bias, XBI=x_bias_ids if k else None, **fused, **pdl_options(pdl))
    y = y[:, :H] if y_width > H else y
    if i8:
        return y, (yl, ds)
    return (y, yl) if lanes else y


@triton.jit
def _rope_store_kernel(QKV, V, POS, SLOT, INV_FREQ, BIAS, QNW, KNW, KC, VC, stride_t, stride_v, stride_kc_slot,
                       stride_kc_h, k_inv_scale, v_inv_scale, mscale, eps, HQ: tl.constexpr, HKV: tl.constexpr,
                       D: tl.constexpr, NEOX: tl.constexpr, HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr,
                       FP8: tl.constexpr, FP8_MAX: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    pdl_trigger(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)  # 0..HQ-1: query heads; HQ..HQ+HKV-1: key/value heads
    is_q = h < HQ
    col = h * D  # Q heads, then K heads: head h starts at column h * D either way
    d = tl.arange(0, D)
    HALF: tl.constexpr = D // 2
    if NEOX:  # pairs (i, i + D/2)
        partner = tl.where(d < HALF, d + HALF, d - HALF)
        sign = tl.where(d < HALF, -1.0, 1.0)
        fi = d % HALF
    else:  # pairs (2i, 2i + 1)
        partner = d ^ 1
        sign = tl.where(d % 2 == 0, -1.0, 1.0)
        fi = d // 2
    row = QKV + t * stride_t + col
    x = tl.load(row + d).to(tl.float32)
    xp = tl.load(row + partner).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(BIAS + col + d)
        xp += tl.load(BIAS + col + partner)
    if QK_NORM:  # per-head RMSNorm of q and k before the rotation (Qwen3)
        if is_q:
            w = tl.load(QNW + d)
            wp = tl.load(QNW + partner)
        else:
            w = tl.load(KNW + d)
            wp = tl.load(KNW + partner)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        # rounded to the activation dtype between the norm and the weight, as the reference does
        x = (x * rstd).to(QKV.dtype.element_ty).to(tl.float32) * w
        xp = (xp * rstd).to(QKV.dtype.element_ty).to(tl.float32) * wp
        x = x.to(QKV.dtype.element_ty).to(tl.float32)
        xp = xp.to(QKV.dtype.element_ty).to(tl.float32)
    pos = tl.load(POS + t).to(tl.float32)
    ang = pos * tl.load(INV_FREQ + fi)
    out = x * (tl.cos(ang) * mscale) + sign * xp * (tl.sin(ang) * mscale)
    if is_q:
        tl.store(row + d, out.to(QKV.dtype.element_ty))
    else:
        slot = tl.load(SLOT + t)
        if slot >= 0:
            hk = h - HQ
            vrow = V + t * stride_v + hk * D
            v = tl.load(vrow + d).to(tl.float32)
            if HAS_BIAS:
                v += tl.load(BIAS + (HQ + HKV) * D + hk * D + d)
            dst = slot * stride_kc_slot + hk * stride_kc_h + d
            if FP8:
                k_val = tl.minimum(tl.maximum(out * k_inv_scale, -FP8_MAX), FP8_MAX)
                v_val = tl.minimum(tl.maximum(v * v_inv_scale, -FP8_MAX), FP8_MAX)
            else:  # round through the activation dtype first, as the unfused path would
                k_val = out.to(QKV.dtype.element_ty)
                v_val = v.to(QKV.dtype.element_ty)
            tl.store(KC + dst, k_val.to(KC.dtype.element_ty))
            tl.store(VC + dst, v_val.to(VC.dtype.element_ty))


def rope_store(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, inv_freq: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, *, n_heads: int, n_kv_heads: int, neox: bool,
               mscale: float = 1.0, bias: torch.Tensor | None = None, q_norm: torch.Tensor | None = None,
               k_norm: torch.Tensor | None = None, eps: float = 1e-6, k_scale: float = 1.0,
               v_scale: float = 1.0, v: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate Q in place in ``qkv`` [T, (Hq + 2 Hkv) * D] and write rotated K and V to their cache slots.

    Applies the QKV bias (Qwen2) and per-head Q/K RMSNorm (Qwen3) on the way. Slots of -1 skip the K/V write.
    ``v``: V [T, Hkv * D] given apart (then ``qkv`` holds Q and K only, [T, (Hq + Hkv) * D]).
    Returns the query view [T, Hq, D] of ``qkv``.
    """
    T = qkv.shape[0]
    D = k_cache.shape[-1]
    q = qkv[:, :n_heads * D].view(T, n_heads, D)
    if v is None:
        v = qkv[:, (n_heads + n_kv_heads) * D:]
    if T == 0:
        return q
    fp8 = k_cache.dtype in FP8_DTYPES
    fp8_max = torch.finfo(k_cache.dtype).max if fp8 else 0.0
    dummy = inv_freq
    pdl = pdl_supported(qkv.device)
    _rope_store_kernel[(T, n_heads + n_kv_heads)](
        qkv, v, positions, slots, inv_freq, bias if bias is not None else dummy,
        q_norm if q_norm is not None else dummy, k_norm if k_norm is not None else dummy, k_cache, v_cache,
        qkv.stride(0), v.stride(0), k_cache.stride(1), k_cache.stride(2), 1.0 / k_scale, 1.0 / v_scale, mscale, eps,
        HQ=n_heads, HKV=n_kv_heads, D=D, NEOX=neox, HAS_BIAS=bias is not None, QK_NORM=q_norm is not None,
        FP8=fp8, FP8_MAX=fp8_max, PDL=pdl, num_warps=1 if D <= 64 else 2, **pdl_options(pdl))
    return q


@triton.jit
def _silu_mul_kernel(GU, Y, YL, stride_gu, stride_y, stride_yl, F, y_width, LANES: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr, GELU: tl.constexpr = False):
    """Columns [F, y_width) of Y get zeros (g and u load as 0 there, and act(0) * 0 = 0)."""
    pdl_wait(PDL)
    pdl_trigger(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + F + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:  # the tanh approximation: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), tanh(z) = 1 - 2 / (e^2z + 1)
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        y = 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)) * u
    else:
        y = g / (1.0 + tl.exp(-g)) * u
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=cols < y_width)
    if LANES:
        tl.store(YL + row * stride_yl + lane_pos(cols), y.to(Y.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, lanes: bool = False, act: str = "silu", out: torch.Tensor | None = None):
    """act(g) * u for gate_up = [g | u] of shape [T, 2F] (one fused gate/up projection), act = silu or gelu_tanh (GeGLU);
    returns [T, F], and with ``lanes`` (y, y in lane order [T, lanes_width(F)]) for qgemv.ops.gemv_lanes. ``out``
    [T, W >= F] (last dim contiguous) receives y, its columns past F set to zero (x for a matrix padded along K);
    y is then out[:, :F]."""
    if act not in ("silu", "gelu_tanh"):
        raise ValueError(f"act must be 'silu' or 'gelu_tanh', got {act!r}")
    T, F2 = gate_up.shape
    F = F2 // 2
    if out is not None and (out.dim() != 2 or out.shape[0] != T or out.shape[1] < F or out.stride(1) != 1):
        raise ValueError(f"silu_mul: out must be [T={T}, >= F={F}] with its last dim contiguous, got shape "
                         f"{tuple(out.shape)}, strides {tuple(out.stride())}")
    y = out if out is not None else torch.empty(T, F, dtype=gate_up.dtype, device=gate_up.device)
    W = y.shape[1]
    yl = torch.empty(T, lanes_width(F), dtype=y.dtype, device=y.device) if lanes else y
    if T:
        BLOCK = 1024
        pdl = pdl_supported(gate_up.device)
        _silu_mul_kernel[(T, triton.cdiv(W, BLOCK))](gate_up, y, yl, gate_up.stride(0), y.stride(0), yl.stride(0), F,
                                                      W, LANES=lanes, BLOCK=BLOCK, PDL=pdl, GELU=act == "gelu_tanh",
                                                      **pdl_options(pdl))
    y = y[:, :F] if W > F else y
    return (y, yl) if lanes else y


@triton.jit
def _swiglu_oai_kernel(G, U, EX, BG, BU, Y, F, stride_g, stride_u, stride_y, alpha, limit, BLOCK: tl.constexpr):
    """Row p (a token-expert pair): e = EX[p]; g = min(G[p] + BG[e], limit), u = clamp(U[p] + BU[e], +-limit);
    Y[p] = (u + 1) * g * sigmoid(alpha * g), in float32, rounded to Y's dtype."""
    p = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    e = tl.load(EX + p).to(tl.int64)
    g = tl.load(G + p * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + p * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.minimum(g + tl.load(BG + e * F + cols, mask=mask, other=0.0), limit)
    u = tl.minimum(tl.maximum(u + tl.load(BU + e * F + cols, mask=mask, other=0.0), -limit), limit)
    y = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
    tl.store(Y + p * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


def swiglu_oai(g: torch.Tensor, u: torch.Tensor, experts: torch.Tensor, gate_bias: torch.Tensor,
               up_bias: torch.Tensor, alpha: float = OSS_ALPHA, limit: float = OSS_LIMIT) -> torch.Tensor:
    """gpt-oss's expert activation for P token-expert pairs: g, u [P, F] the pairs' gate and up products (last dim
    contiguous), ``experts`` int [P] each pair's expert, gate_bias / up_bias float32 [E, F] -> [P, F] in g's dtype:
    (clamp(u + bu, -limit, limit) + 1) * gc * sigmoid(alpha * gc) with gc = min(g + bg, limit)."""
    P, F = g.shape
    if u.shape != g.shape or g.stride(1) != 1 or u.stride(1) != 1:
        raise ValueError(f"swiglu_oai: g and u must be [P, F] with contiguous rows, got {tuple(g.shape)} and "
                         f"{tuple(u.shape)}")
    if gate_bias.shape != up_bias.shape or gate_bias.dim() != 2 or gate_bias.shape[1] != F:
        raise ValueError(f"swiglu_oai: the biases must be [E, {F}], got {tuple(gate_bias.shape)} and "
                         f"{tuple(up_bias.shape)}")
    y = torch.empty(P, F, dtype=g.dtype, device=g.device)
    if P:
        BLOCK = 1024
        _swiglu_oai_kernel[(P, triton.cdiv(F, BLOCK))](g, u, experts.contiguous(), gate_bias.float().contiguous(),
                                                        up_bias.float().contiguous(), y, F, g.stride(0), u.stride(0),
                                                        y.stride(0), alpha, limit, BLOCK=BLOCK)
    return y
