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


def _group_order(K: int, dims, perm) -> torch.Tensor:
    """Where each activation k < K lies when every group of 2048 is viewed as ``dims`` in natural order and stored
    with its axes permuted by ``perm``."""
    W = -(-K // 2048) * 2048
    natural_at = torch.arange(W).view(W // 2048, *dims).permute(0, *(p + 1 for p in perm)).reshape(-1)
    pos = torch.empty(W, dtype=torch.long)
    pos[natural_at] = torch.arange(W)
    return pos[:K]


def lane_positions(K: int) -> torch.Tensor:
    """Where each activation k < K lies in the q4_k GEMV's lane order (qgemv.m1.lane_pos), built by reshaping: a
    group of 2048 is (block kt, chunk c, plane p, load a, element v) in natural order, (p, a, kt, c, v) in lane
    order."""
    return _group_order(K, (8, 4, 2, 4, 8), (2, 3, 0, 1, 4))


def i8_lane_positions(K: int) -> torch.Tensor:
    """Where each activation k < K lies in the int8 q4_k GEMV's i8 lane order (qgemv.int8.i8_lane_base), built by
    reshaping: a group of 2048 is (block kt, chunk c, plane p, half h, byte b) in natural order, (p, h, kt, c, b) in
    i8 lane order."""
    return _group_order(K, (8, 4, 2, 2, 16), (2, 3, 0, 1, 4))


def moe_gemv_ref(x, qt, num_experts, expert_ids, token_ids=None, dtype=torch.float64):
    """x[token_ids[p]] @ W_{expert_ids[p]}.T per pair, W_e = rows e*N..(e+1)*N of dequantize(qt) -> [P, N]."""
    w = _dense(qt, dtype).to(x.device)
    w = w.reshape(num_experts, -1, w.shape[-1])
    tok = token_ids.long() if token_ids is not None else torch.arange(expert_ids.shape[0], device=x.device)
    xs = x.to(dtype)[tok]
    out = torch.zeros(expert_ids.shape[0], w.shape[1], dtype=dtype, device=x.device)
    for ex in expert_ids.unique().tolist():  # one product per expert: [P, N, K] gathered would not fit
        rows = (expert_ids == ex).nonzero().flatten()
        out[rows] = xs[rows] @ w[ex].T
    return out


def moe_gate_up_silu_ref(x, qt_gate, qt_up, num_experts, expert_ids, token_ids=None, dtype=torch.float64):
    g = moe_gemv_ref(x, qt_gate, num_experts, expert_ids, token_ids, dtype)
    return g * torch.sigmoid(g) * moe_gemv_ref(x, qt_up, num_experts, expert_ids, token_ids, dtype)
