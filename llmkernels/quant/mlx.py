"""MLX affine quantization: w = scale * q + bias per group of ``group_size`` weights along K.

q has ``bits`` bits; a row's values form one LSB-first bit stream cut into uint32 words, so 3-, 5- and 6-bit values
can straddle two words. scale and bias are stored in fp16 or bf16, one per group.
"""
from __future__ import annotations

import torch


def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int [N, K] values < 2**bits -> uint32 [N, K * bits / 32], value i at bits [i*bits, (i+1)*bits) of the row."""
    N, K = q.shape
    nwords = K * bits // 32
    q = q.to(torch.int64)
    pos = torch.arange(K, device=q.device) * bits
    word, shift = pos // 32, pos % 32
    out = torch.zeros(N, nwords + 1, dtype=torch.int64, device=q.device)
    # fields never overlap, so adding them is the same as or-ing them
    out.scatter_add_(1, word.expand(N, K), (q << shift) & 0xFFFFFFFF)
    out.scatter_add_(1, (word + 1).expand(N, K), q >> (32 - shift))
    return out[:, :nwords].to(torch.uint32)


def unpack_bits(words: torch.Tensor, bits: int, K: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: uint32 [N, K*bits/32] -> int64 [N, K]."""
    w = words.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    w = torch.cat([w, torch.zeros_like(w[:, :1])], dim=1)
    pos = torch.arange(K, device=w.device) * bits
    word, shift = pos // 32, pos % 32
    lo = w[:, word] >> shift
    hi = (w[:, word + 1] << (32 - shift)) & 0xFFFFFFFF
    return (lo | hi) & ((1 << bits) - 1)


def quantize_mlx(w: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype):
    """w [N, K] -> (words uint32 [N, K*bits/32], scales [N, K/g], biases [N, K/g]).

    Per group the edge of larger magnitude becomes the bias (q = 0 maps to it exactly) and the scale is nudged so
    that 0.0 also falls on the grid; scale and bias are rounded to ``scale_dtype`` before q is chosen, so q is the
    best code for the stored scale and bias.
    """
    N, K = w.shape
    n_bins = (1 << bits) - 1
    wg = w.float().reshape(N, K // group_size, group_size)
    w_max = wg.amax(dim=-1)
    w_min = wg.amin(dim=-1)
    min_is_edge = w_min.abs() > w_max.abs()
    scale = ((w_max - w_min) / n_bins).clamp(min=1e-7)
    scale = torch.where(min_is_edge, scale, -scale)
    edge = torch.where(min_is_edge, w_min, w_max)
    q0 = torch.round(edge / scale)
    scale = torch.where(q0 != 0, edge / torch.where(q0 != 0, q0, torch.ones_like(q0)), scale)
    scales = scale.to(scale_dtype)
    biases = edge.to(scale_dtype)
    s, b = scales.float()[..., None], biases.float()[..., None]
    q = torch.round((wg - b) / s).clamp(0, n_bins).to(torch.int64).reshape(N, K)
    return pack_bits(q, bits), scales, biases


def dequantize_mlx(words, scales, biases, bits: int, group_size: int, K: int) -> torch.Tensor:
    """-> float32 [N, K]."""
    N = words.shape[0]
    q = unpack_bits(words, bits, K).float().reshape(N, K // group_size, group_size)
    return (scales.float()[..., None] * q + biases.float()[..., None]).reshape(N, K)
