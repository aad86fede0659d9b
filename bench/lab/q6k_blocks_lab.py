"""q6_k's 210-byte blocks against the same blocks padded to 224 bytes (16-byte aligned), for the m1 kernel at M = 1.

A 210-byte block starts 2 bytes past a 16-byte boundary times its index, so the m1 kernel's code loads are 2 bytes
wide; blocks restrided to 224 bytes let them be 8 bytes wide (6.7% more bytes). Cases: the Qwen3-30B-A3B expert down
products (8 pairs of [2048, 768] out of 128 experts) and dense q6_k matrices of Llama-3-8B / Gemma-2-9B shapes,
with the routed kernel (gemv: the tensor-core kernel for q6_k) beside.

    PYTHONPATH=. python bench/lab/q6k_blocks_lab.py [--gemma-v] [--routed]

(--gemma-v: that matrix only; --routed: the routed gemv and the tensor-core kernel's split-K rules only)

us per call by CUDA-graph replay over six weight sets (L2 overflowed), TB/s of the 210-byte bytes; each output
checked against the stock layout's.
"""
import sys

import torch

from llmkernels.bench.harness import time_graph_ms
from llmkernels.qgemv import gemv, m1, route
from llmkernels.qgemv.common import _finish
from llmkernels.qgemv.ops import target, tc_padding
from llmkernels.qgemv.tc import launch_tc
from llmkernels.quant.tensor import pad_k, pad_rows
from llmkernels.testing.random_weights import random_qtensor

SETS = 6
CONFIGS = [(2, 1, 4, 3, 4, 2, 1), (2, 1, 4, 3, 2, 2, 1), (4, 1, 4, 3, 2, 2, 1), (2, 1, 4, 3, 2, 4, 1),
           (1, 1, 4, 3, 2, 4, 1), (2, 1, 8, 3, 2, 2, 1), (4, 1, 8, 3, 4, 2, 1), (4, 1, 4, 3, 4, 2, 1)]


def reblock(data, K, stride=224):
    """[N, row bytes] of 210-byte blocks -> [N, nb * stride] with each block at a 16-byte aligned offset."""
    N, nb = data.shape[0], K // 256
    out = torch.zeros(N, nb, stride, dtype=torch.uint8, device=data.device)
    out[:, :, :210] = data[:, :nb * 210].view(N, nb, 210)
    return out.view(N, nb * stride)


def run(x, data, N, K, cfg, bb, **kw):
    old = m1.M1_LAYOUTS["q6_k"]
    m1.M1_LAYOUTS["q6_k"] = old[:5] + (bb,)
    try:
        return m1.launch_m1(x, data, "q6_k", N, K, cfg, 132, 2, **kw)
    finally:
        m1.M1_LAYOUTS["q6_k"] = old


def us(fns):
    return time_graph_ms(fns) * 1e3


def case(name, x, stock, aligned, N, K, nbytes, kw_sets):
    print(f"{name} ({nbytes / 1e6:.1f} MB of 210-byte blocks):", flush=True)
    for cfg in [] if "--routed" in sys.argv else CONFIGS:
        try:
            y0 = run(x, stock[0], N, K, cfg, 210, **kw_sets[0]).float().sum(0)
            y1 = run(x, aligned[0], N, K, cfg, 224, **kw_sets[0]).float().sum(0)
            diff = ((y0 - y1).abs().max() / y0.abs().max()).item()
            t0 = us([lambda d=d, kw=kw: run(x, d, N, K, cfg, 210, **kw) for d, kw in zip(stock, kw_sets)])
            t1 = us([lambda d=d, kw=kw: run(x, d, N, K, cfg, 224, **kw) for d, kw in zip(aligned, kw_sets)])
            print(f"  {cfg}: 210 {t0:6.2f} us ({nbytes / t0 / 1e6:.2f} TB/s) | 224 {t1:6.2f} us "
                  f"({nbytes / t1 / 1e6:.2f} TB/s) {t0 / t1:.2f}x, diff {diff:.1e}", flush=True)
        except Exception as exc:
            print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)


def main():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    E, TOPK, H, F = 128, 8, 2048, 768
    down = pad_rows(random_qtensor("q6_k", E * H, F, "cuda"))
    al = reblock(down.data, F)
    ids = [torch.randperm(E, generator=g)[:TOPK].to(torch.int32).cuda() for _ in range(SETS)]
    h = torch.randn(TOPK, F, device="cuda", dtype=torch.bfloat16)
    kws = [dict(experts=e, top_k=1, n_experts=E) for e in ids]
    case("MoE down, 8 pairs of [2048, 768]", h, [down.data] * SETS, [al] * SETS, H, F, TOPK * H * F * 210 // 256, kws)
    shapes = ((2048, 3584, "Gemma-2-9B V"), (4096, 14336, "Llama-3-8B down"), (1024, 4096, "Llama-3-8B V"),
              (3584, 14336, "Gemma-2-9B down"))
    for N, K, what in shapes[:1] if "--gemma-v" in sys.argv else shapes:
        qts = [random_qtensor("q6_k", N, K, "cuda") for _ in range(SETS)]
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        # the engine's form of each matrix at batch 1: padded along K for the tensor-core kernel where it pads
        Kp = tc_padding(qts[0], torch.bfloat16) or K
        routed = [pad_k(q, Kp) for q in qts] if Kp != K else qts
        xr = torch.nn.functional.pad(x, (0, Kp - K))
        stock = [pad_rows(q).data for q in qts]
        case(f"dense [{N}, {K}] ({what}; routed gemv on K = {Kp})", x, stock, [reblock(q.data, K) for q in qts], N,
             K, N * K * 210 // 256, [{}] * SETS)
        t2 = us([lambda q=q: gemv(xr, q) for q in routed])
        print(f"  routed gemv: {t2:6.2f} us ({N * K * 210 // 256 / t2 / 1e6:.2f} TB/s of the unpadded bytes)",
              flush=True)
        r = route.choose("gemv", "q6_k", 1, N, Kp, torch.bfloat16, target=target(x.device))
        if r.kernel == "tc":  # the split-K rule: K split within the wave and summed in the kernel, or a second launch
            t3 = us([lambda q=q: _finish(launch_tc(xr, q.data, N, Kp, r.config, 132, 2, fixup=False), xr.dtype)
                     for q in routed])
            print(f"  tc {r.config} with its partials summed by a second launch: {t3:6.2f} us", flush=True)


if __name__ == "__main__":
    main()
