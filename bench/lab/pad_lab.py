"""q6_k matrices whose K is not a multiple of 2048 (rows not 16-byte aligned, so no tensor-core kernel): the routed
gemv as stored against the same matrix padded with zero blocks to the next multiple of 2048 (quant.tensor.pad_k),
x padded to match (torch.nn.functional.pad, timed with it), at several activation rows M. Shapes: a tensor-parallel
rank's row-parallel down product (Llama-3-8B at TP = 2 and 4), Gemma-2-9B's V, Qwen2.5-7B's down.

    PYTHONPATH=. python bench/lab/pad_lab.py

Each shape's padded product is checked against the stored one first; times by CUDA-graph replay over weight copies
that overflow L2 (us).
"""
import torch
import torch.nn.functional as F

from llmkernels.bench.harness import copies_for, time_graph_ms
from llmkernels.qgemv import gemv, route
from llmkernels.qgemv.ops import operands
from llmkernels.quant.tensor import pad_k
from llmkernels.testing.random_weights import random_qtensor

SHAPES = ((4096, 7168), (4096, 3584), (2048, 3584), (3584, 18944))
MS = (1, 2, 8, 16, 64)


def _route(qt, M, K):
    x = torch.empty(M, K, dtype=torch.bfloat16, device="cuda")
    o = operands("gemv", x, None, qt.data, None, None, None, "q6_k", 0, K)
    return route.choose("gemv", "q6_k", M, qt.shape[0], K, torch.bfloat16, operands=o,
                        target=route.Target(torch.cuda.get_device_name())).kernel


def main():
    for N, K in SHAPES:
        Kp = -(-K // 2048) * 2048
        n = copies_for(N * K * 210 // 256, most=8)
        plain = [random_qtensor("q6_k", N, K, "cuda") for _ in range(n)]
        padded = [pad_k(qt, Kp) for qt in plain]
        row = []
        for M in MS:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            a = gemv(x, plain[0]).float()
            b = gemv(F.pad(x, (0, Kp - K)), padded[0]).float()
            err = ((a - b).abs().max() / a.abs().max()).item()
            t0 = time_graph_ms([lambda w=w: gemv(x, w) for w in plain]) * 1e3
            t1 = time_graph_ms([lambda w=w: gemv(F.pad(x, (0, Kp - K)), w) for w in padded]) * 1e3
            row.append(f"M{M}: {_route(plain[0], M, K)} {t0:6.1f} / {_route(padded[0], M, Kp)}+pad {t1:6.1f} "
                       f"({t0 / t1:.2f}x, err {err:.1e})")
        print(f"q6_k {N}x{K} (padded to {Kp}): " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
