"""Encoders for the K-quants (q2_k ... q6_k), which the gguf package cannot write.

They follow the search that llama.cpp's reference quantizers do, vectorised over blocks:
- q4_k, q5_k, q2_k: per sub-block an affine (scale, min) fit; a grid of trial inverse scales, each refined by
  weighted least squares (weights: sub-block rms + |x|), keeps the one with the lowest weighted squared
  error; then the sub-block scales and mins are themselves quantized to 6 (4 for q2_k) bits against a
  super-block fp16 scale, and the weights are re-quantized with them.
- q3_k: per sub-block a symmetric fit refined by coordinate descent on the weighted squared error.
- q6_k: per sub-block a symmetric fit over a grid of trial scales around nmax / absmax.
Rounding is to nearest, ties to even (what llama.cpp's nearest_int does). Arithmetic is float32; sums are taken in
torch's order, so a last-bit difference from llama.cpp's sequential sums is possible, never a layout difference.
"""
from __future__ import annotations

import torch

from .scales import pack_scales6, pack_scales_q3k, signed_absmax, unpack_scales6, unpack_scales_q3k


def _fit_affine(x, w, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool):
    """Best (scale, min) so that x ~ scale * L + min with L in 0..nmax, per row of x [n, S].

    Returns (scale [n], minus_min [n] >= 0, L int [n, S]).
    """
    mn = x.min(dim=1).values.clamp(max=0.0)
    mx = x.max(dim=1).values
    rng = mx - mn
    flat = rng == 0
    safe_rng = torch.where(flat, torch.ones_like(rng), rng)
    sum_w = w.sum(dim=1)
    sum_x = (w * x).sum(dim=1)

    def err_of(scale, mn_, L):
        diff = scale[:, None] * L + mn_[:, None] - x
        return (w * (diff.abs() if use_mad else diff * diff)).sum(dim=1)

    iscale = nmax / safe_rng
    L = torch.round(iscale[:, None] * (x - mn[:, None])).clamp(0, nmax)
    scale = 1.0 / iscale
    best_min = mn.clone()
    best_err = err_of(scale, mn, L)
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * step + nmax) / safe_rng
        La = torch.round(iscale[:, None] * (x - mn[:, None])).clamp(0, nmax)
        sum_l = (w * La).sum(dim=1)
        sum_l2 = (w * La * La).sum(dim=1)
        sum_xl = (w * La * x).sum(dim=1)
        D = sum_w * sum_l2 - sum_l * sum_l
        safe_D = torch.where(D > 0, D, torch.ones_like(D))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe_D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe_D
        pos = this_min > 0
        safe_l2 = torch.where(sum_l2 > 0, sum_l2, torch.ones_like(sum_l2))
        this_scale = torch.where(pos, sum_xl / safe_l2, this_scale)
        this_min = torch.where(pos, torch.zeros_like(this_min), this_min)
        cur = err_of(this_scale, this_min, La)
        better = (D > 0) & (cur < best_err)
        L = torch.where(better[:, None], La, L)
        best_err = torch.where(better, cur, best_err)
        scale = torch.where(better, this_scale, scale)
        best_min = torch.where(better, this_min, best_min)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    L = torch.where(flat[:, None], torch.zeros_like(L), L)
    return scale, -best_min, L


def _fit_symmetric_grid(x, nmax: int):
    """q6_k's sub-block fit: x ~ scale * L, L in -nmax..nmax-1, weights x^2, 19 trial scales. -> (scale, L + nmax)."""
    mx = signed_absmax(x).squeeze(1)
    tiny = mx.abs() < 1e-30
    safe = torch.where(tiny, torch.ones_like(mx), mx)
    w = x * x

    def fit(iscale):
        L = torch.round(iscale[:, None] * x).clamp(-nmax, nmax - 1)
        return L, (w * x * L).sum(dim=1), (w * L * L).sum(dim=1)

    L, sumlx, suml2 = fit(-nmax / safe)
    scale = torch.where(suml2 > 0, sumlx / torch.where(suml2 > 0, suml2, torch.ones_like(suml2)), torch.zeros_like(sumlx))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        La, slx, sl2 = fit(-(nmax + 0.1 * step) / safe)
        better = (sl2 > 0) & (slx * slx > best * sl2)
        safe_sl2 = torch.where(sl2 > 0, sl2, torch.ones_like(sl2))
        L = torch.where(better[:, None], La, L)
        scale = torch.where(better, slx / safe_sl2, scale)
        best = torch.where(better, scale * slx, best)
    scale = torch.where(tiny, torch.zeros_like(scale), scale)
    L = torch.where(tiny[:, None], torch.zeros_like(L), L + nmax)
    return scale, L


def _fit_symmetric_descent(x, nmax: int):
    """q3_k's sub-block fit: start at nmax / absmax, then coordinate descent on sum x^2 (x - scale L)^2."""
    mx = signed_absmax(x).squeeze(1)
    tiny = mx.abs() < 1e-30
    safe = torch.where(tiny, torch.ones_like(mx), mx)
    w = x * x
    L = torch.round((-nmax / safe)[:, None] * x).clamp(-nmax, nmax - 1)
    sumlx = (w * x * L).sum(dim=1)
    suml2 = (w * L * L).sum(dim=1)
    for _ in range(5):
        for i in range(x.shape[1]):
            wi, xi, li = w[:, i], x[:, i], L[:, i]
            slx = sumlx - wi * xi * li
            sl2 = suml2 - wi * li * li
            ok = slx > 0
            new_l = torch.round(xi * sl2 / torch.where(ok, slx, torch.ones_like(slx))).clamp(-nmax, nmax - 1)
            slx_n = slx + wi * xi * new_l
            sl2_n = sl2 + wi * new_l * new_l
            accept = ok & (new_l != li) & (sl2_n > 0) & (slx_n * slx_n * suml2 > sumlx * sumlx * sl2_n)
            L[:, i] = torch.where(accept, new_l, li)
            sumlx = torch.where(accept, slx_n, sumlx)
            suml2 = torch.where(accept, sl2_n, suml2)
    scale = sumlx / torch.where(suml2 > 0, suml2, torch.ones_like(suml2))
    scale = torch.where(tiny, torch.zeros_like(scale), scale)
    L = torch.where(tiny[:, None], torch.zeros_like(L), L + nmax)
    return scale, L


def _requant(x, d, offset, lo, hi, fallback):
    """L = round((x + offset) / d) clamped, per sub-block d [n, S, 1]; where d == 0 keep ``fallback``."""
    safe = torch.where(d == 0, torch.ones_like(d), d)
    L = torch.round((x + offset) / safe).clamp(lo, hi)
    return torch.where(d == 0, fallback, L).to(torch.int32)


def _pack_2bit_halves(L):
    """int [n, 256] -> uint8 [n, 64]: byte l of half h holds weights h*128 + s*32 + l at bits 2s."""
    L = L.reshape(-1, 2, 4, 32)
    return (L[:, :, 0] | (L[:, :, 1] << 2) | (L[:, :, 2] << 4) | (L[:, :, 3] << 6)).reshape(-1, 64).to(torch.uint8)


def _pack_4bit_chunks(L):
    """int [n, 256] -> uint8 [n, 128]: byte l of chunk j holds weights j*64 + l (low) and j*64 + 32 + l (high)."""
    L = L.reshape(-1, 4, 2, 32) & 0xF
    return (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(-1, 128).to(torch.uint8)


def _bitplane(L, bit: int):
    """int [n, 256] -> uint8 [n, 32]: bit b of byte l is bit ``bit`` of weight b*32 + l."""
    hb = (L.reshape(-1, 8, 32) >> bit) & 1
    return sum(hb[:, b] << b for b in range(8)).to(torch.uint8)


def _f16_bytes(v):
    return v.to(torch.float16).reshape(-1, 1).view(torch.uint8)


def _encode_min_scale(x, *, sub: int, nmax: int, rmin: float, rdelta: float, nstep: int, mad: bool, scale_bits: int):
    """Shared by q2_k/q4_k/q5_k: fit sub-blocks, quantize their scales/mins, re-quantize weights.

    Returns (d fp16-rounded [n], dmin [n], ls int [n, nsub], lm int [n, nsub], L int [n, 256]).
    """
    n = x.shape[0]
    xs = x.reshape(n * 256 // sub, sub)
    w = torch.sqrt((xs * xs).mean(dim=1, keepdim=True)) + xs.abs()  # rms of the sub-block plus magnitude
    scales, mins, L = _fit_affine(xs, w, nmax, rmin, rdelta, nstep, mad)
    scales, mins, L = scales.reshape(n, -1), mins.reshape(n, -1), L.reshape(n, -1, sub)
    qmax = (1 << scale_bits) - 1
    max_scale = scales.max(dim=1).values
    max_min = mins.max(dim=1).values
    inv_s = torch.where(max_scale > 0, qmax / torch.where(max_scale > 0, max_scale, torch.ones_like(max_scale)),
                        torch.zeros_like(max_scale))
    inv_m = torch.where(max_min > 0, qmax / torch.where(max_min > 0, max_min, torch.ones_like(max_min)),
                        torch.zeros_like(max_min))
    ls = torch.round(inv_s[:, None] * scales).clamp(max=qmax).to(torch.int32)
    lm = torch.round(inv_m[:, None] * mins).clamp(max=qmax).to(torch.int32)
    d = (max_scale / qmax).to(torch.float16).float()
    dmin = (max_min / qmax).to(torch.float16).float()
    dl = (d[:, None] * ls.float())[:, :, None]
    ml = (dmin[:, None] * lm.float())[:, :, None]
    Lq = _requant(x.reshape(n, -1, sub), dl, ml, 0, nmax, L)
    return d, dmin, ls, lm, Lq.reshape(n, 256)


def encode_q4_k(x):
    d, dmin, ls, lm, L = _encode_min_scale(x, sub=32, nmax=15, rmin=-1.0, rdelta=0.1, nstep=20, mad=False,
                                           scale_bits=6)
    return torch.cat([_f16_bytes(d), _f16_bytes(dmin), pack_scales6(ls, lm), _pack_4bit_chunks(L)], dim=1)


def encode_q5_k(x):
    d, dmin, ls, lm, L = _encode_min_scale(x, sub=32, nmax=31, rmin=-0.5, rdelta=0.1, nstep=15, mad=False,
                                           scale_bits=6)
    return torch.cat([_f16_bytes(d), _f16_bytes(dmin), pack_scales6(ls, lm), _bitplane(L, 4),
                      _pack_4bit_chunks(L)], dim=1)


def encode_q2_k(x):
    # llama.cpp fits q2_k sub-blocks to |x|-weighted absolute error; squared error with q4_k's weights gives lower
    # RMS error (256 x 4096 weights: 0.275 vs 0.299 Gaussian, 0.313 vs 0.356 Student-t(3)) and beats absmax.
    d, dmin, ls, lm, L = _encode_min_scale(x, sub=16, nmax=3, rmin=-0.5, rdelta=0.1, nstep=15, mad=False,
                                           scale_bits=4)
    scales = (ls | (lm << 4)).to(torch.uint8)
    return torch.cat([scales, _pack_2bit_halves(L), _f16_bytes(d), _f16_bytes(dmin)], dim=1)


def encode_q3_k(x):
    n = x.shape[0]
    xs = x.reshape(n * 16, 16)
    scales, L = _fit_symmetric_descent(xs, 4)
    scales, L = scales.reshape(n, 16), L.reshape(n, 16, 16)
    max_scale = signed_absmax(scales).squeeze(1)
    nz = max_scale != 0
    iscale = torch.where(nz, -32.0 / torch.where(nz, max_scale, torch.ones_like(max_scale)),
                         torch.zeros_like(max_scale))
    l = (torch.round(iscale[:, None] * scales).clamp(-32, 31) + 32).to(torch.int32)
    l = torch.where(nz[:, None], l, torch.zeros_like(l))
    packed = pack_scales_q3k(l)
    d = torch.where(nz, 1.0 / torch.where(nz, iscale, torch.ones_like(iscale)), torch.zeros_like(iscale))
    d = d.to(torch.float16).float()
    dl = (d[:, None] * unpack_scales_q3k(packed).float())[:, :, None]
    Lq = _requant(x.reshape(n, 16, 16), dl, 0.0, -4, 3, L - 4) + 4
    Lq = Lq.reshape(n, 256)
    hmask = _bitplane(Lq, 2)  # bit 2 set means L > 3, stored as "no -4 offset"
    low = Lq & 3
    return torch.cat([hmask, _pack_2bit_halves(low), packed, _f16_bytes(d)], dim=1)


def encode_q6_k(x):
    n = x.shape[0]
    xs = x.reshape(n * 16, 16)
    scales, L = _fit_symmetric_grid(xs, 32)
    scales, L = scales.reshape(n, 16), L.reshape(n, 16, 16)
    max_scale = signed_absmax(scales).squeeze(1)
    nz = max_scale.abs() >= 1e-15
    iscale = torch.where(nz, -128.0 / torch.where(nz, max_scale, torch.ones_like(max_scale)),
                         torch.zeros_like(max_scale))
    sc = torch.round(iscale[:, None] * scales).clamp(max=127).to(torch.int32)
    d = torch.where(nz, 1.0 / torch.where(nz, iscale, torch.ones_like(iscale)), torch.zeros_like(iscale))
    d = d.to(torch.float16).float()
    dl = (d[:, None] * sc.float())[:, :, None]
    Lq = (_requant(x.reshape(n, 16, 16), dl, 0.0, -32, 31, L - 32) + 32).reshape(n, 256)
    Lq = torch.where(nz[:, None], Lq, torch.zeros_like(Lq))
    sc = torch.where(nz[:, None], sc, torch.zeros_like(sc))
    L4 = Lq.reshape(n, 2, 4, 32)
    low = L4 & 0xF
    ql = torch.cat([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], dim=-1)  # [n, 2, 64]
    hi = L4 >> 4
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)  # [n, 2, 32]
    return torch.cat([ql.reshape(n, 128).to(torch.uint8), qh.reshape(n, 64).to(torch.uint8),
                      sc.to(torch.int8).view(torch.uint8), _f16_bytes(d)], dim=1)


KQUANT_ENCODERS = {"q2_k": encode_q2_k, "q3_k": encode_q3_k, "q4_k": encode_q4_k, "q5_k": encode_q5_k,
                   "q6_k": encode_q6_k}


def absmax_baseline(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """A plain symmetric absmax quantizer (float32 scale per group, round to nearest) -> dequantized x.

    The yardstick the K-quant encoders are measured against: same bits per weight for the values, no search.
    """
    xs = x.reshape(-1, group)
    amax = signed_absmax(xs)
    half = 1 << (bits - 1)
    d = amax / -half
    q = torch.round(xs * torch.where(d == 0, torch.zeros_like(d), 1.0 / d)).clamp(-half, half - 1)
    return (q * d).reshape(x.shape)


__all__ = ["KQUANT_ENCODERS", "absmax_baseline", "unpack_scales6"]
