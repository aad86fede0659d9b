"""GEMV references: products with the dequantized weights, computed in float64."""
from __future__ import annotations

import torch


def _dense(qt, dtype):
    from ..quant import dequantize

    return dequantize(qt, dtype=torch.float32).to(dtype)


def gemv_ref(x, qt, dtype=torch.float64):
    """x [M, K] @ dequantize(qt).T -> [M, N] in ``dtype``."""
    w = _dense(qt, dtype).to(x.device)
    return x.to(dtype) @ w.T


def silu_mul_gemv_ref(gate, up, qt, dtype=torch.float64):
    """(silu(gate) * up) @ dequantize(qt).T, the activation formed in ``dtype``."""
    g = gate.to(dtype)
    a = g * torch.sigmoid(g) * up.to(dtype)
    return a @ _dense(qt, dtype).to(a.device).T


def embedding_ref(ids, qt, dtype=torch.float64):
    """Rows of dequantize(qt) picked by ids -> [*ids.shape, K]."""
    return _dense(qt, dtype).to(ids.device)[ids.long()]
