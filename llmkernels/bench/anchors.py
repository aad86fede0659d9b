"""The anchors: what our kernels are compared with, run on the same inputs in the same process."""
from __future__ import annotations

import torch

from .harness import time_ms


def sdpa_ms(q, k, v, *, causal: bool, backend: str) -> float | None:
    """PyTorch SDPA through one backend ("cudnn" or "flash"); q [B, Hq, S, D], k/v [B, Hkv, S, D].

    GQA runs through ``enable_gqa`` where the backend takes it, else K/V are expanded first (outside the timing).
    None when the backend refuses the shape.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    gqa = k.shape[1] != q.shape[1]
    attempts = [dict(enable_gqa=True)] if gqa else [{}]
    for kw in attempts + ([{"expand": True}] if gqa else []):
        kk, vv = k, v
        if kw.pop("expand", False):
            g = q.shape[1] // k.shape[1]
            kk, vv = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        try:
            with sdpa_kernel([be]):
                F.scaled_dot_product_attention(q, kk, vv, is_causal=causal, **kw)
                torch.cuda.synchronize()
                return time_ms(lambda: F.scaled_dot_product_attention(q, kk, vv, is_causal=causal, **kw))
        except RuntimeError:
            continue
    return None


def cublas_ms(x, w) -> float:
    """cuBLAS through ``x @ w.T``; x [M, K], w [N, K]."""
    return time_ms(lambda: x @ w.T)


def make_int4pack(w: torch.Tensor, group_size: int = 128, inner_k_tiles: int = 8):
    """Quantize w [N, K] (asymmetric 4-bit, groups along K) into torch's int4 tile layout.

    Returns (packed weight, scales_and_zeros [K/group, N, 2] bf16) for ``torch._weight_int4pack_mm``.
    """
    N, K = w.shape
    wg = w.float().reshape(N, K // group_size, group_size)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-6)
    q = ((wg - lo) / scale).round().clamp(0, 15).to(torch.int32).reshape(N, K)
    # torch's layout: zero point in the float domain, w = (q - 8) * scale + zero
    zero = lo + 8 * scale
    packed_u8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
    wq = torch.ops.aten._convert_weight_to_int4pack(packed_u8.contiguous(), inner_k_tiles)
    sz = torch.cat([scale, zero], dim=-1).reshape(N, K // group_size, 2).transpose(0, 1).contiguous().to(torch.bfloat16)
    return wq, sz


def int4pack_ms(x, wq, sz, group_size: int = 128) -> float | None:
    try:
        torch._weight_int4pack_mm(x, wq, group_size, sz)
        return time_ms(lambda: torch._weight_int4pack_mm(x, wq, group_size, sz))
    except RuntimeError:
        return None
