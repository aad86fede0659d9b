"""Public gemv (q4_k, M = 1) with and without its internal copy into lane order, and gemv_lanes with x already in
lane order, CUDA-graph timed on six Llama-3-8B shapes, fp16 and bf16 activations: where the copy pays.

    python scripts/lanes_lab.py
"""
import torch

from llmkernels.bench.harness import copies_for, time_graph_ms
from llmkernels.qgemv import gemv, ops
from llmkernels.qgemv.m1 import lane_order
from llmkernels.testing.random_weights import random_qtensor

for N, K in [(4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336), (128256, 4096), (28672, 4096)]:
    first = random_qtensor("q4_k", N, K, "cuda")
    qts = [first] + [random_qtensor("q4_k", N, K, "cuda") for _ in range(copies_for(first.nbytes) - 1)]
    line = f"{N}x{K}:"
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(1, K, device="cuda", dtype=dtype)
        xl = lane_order(x)
        res = []
        for min_w in (1 << 62, 0, 1 << 62, 0):  # copy never, always, never, always
            ops.LANES_MIN_WEIGHTS = min_w
            res.append(time_graph_ms([lambda qt=qt: gemv(x, qt) for qt in qts]) * 1e3)
        tl_ = time_graph_ms([lambda qt=qt: ops.gemv_lanes(x, xl, qt) for qt in qts]) * 1e3
        line += (f" {str(dtype).split('.')[1]} natural {res[0]:.1f}/{res[2]:.1f} copy+lanes {res[1]:.1f}/{res[3]:.1f}"
                 f" lanes {tl_:.1f} us |")
    print(line, flush=True)
