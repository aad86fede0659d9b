"""The anchors alone, at a few representative shapes: what the kernel suites will be held against."""
from __future__ import annotations

import torch

from ..anchors import cublas_ms, int4pack_ms, make_int4pack, sdpa_ms
from ..harness import Row


def _prefill_case(ctx, B, H, S, D, causal):
    def run():
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * B * H * S * S * D / (2 if causal else 1)
        rows = []
        for backend in ("cudnn", "flash"):
            ms = sdpa_ms(q, k, v, causal=causal, backend=backend)
            tf = None if ms is None else flops / (ms * 1e-3) / 1e12
            rows.append(Row("anchors", f"sdpa_{backend} B{B} H{H} S{S} D{D}{' causal' if causal else ''}",
                            "TFLOP/s", tf, None if tf is None else 100 * tf / ctx.matmul_TFLOPs))
        return rows
    return run


def _gemv_case(ctx, N, K, M):
    def run():
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        rows = []
        ms = cublas_ms(x.half(), w.half())
        tb = (N * K * 2 + M * K * 2 + M * N * 2) / (ms * 1e-3) / 1e12
        rows.append(Row("anchors", f"cublas_f16 N{N} K{K} M{M}", "TB/s", tb, ctx.bw_pct(tb)))
        wq, sz = make_int4pack(w)
        ms = int4pack_ms(x, wq, sz)
        tb = None if ms is None else (N * K // 2 + sz.numel() * 2 + M * K * 2 + M * N * 2) / (ms * 1e-3) / 1e12
        rows.append(Row("anchors", f"int4pack_g128 N{N} K{K} M{M}", "TB/s", tb, ctx.bw_pct(tb)))
        return rows
    return run


def cases(ctx):
    out = []
    for causal in (False, True):
        out.append((f"sdpa S4096 causal={causal}", _prefill_case(ctx, 1, 32, 4096, 128, causal)))
    if not ctx.quick:
        out.append(("sdpa S16384 causal", _prefill_case(ctx, 1, 32, 16384, 128, True)))
    for N, K in ((4096, 4096), (14336, 4096), (128256, 4096)):
        for M in (1, 16):
            out.append((f"gemv N{N} K{K} M{M}", _gemv_case(ctx, N, K, M)))
    return out
