"""Batch-1 q4_k GEMVs whose K is not a multiple of the lane kernel's 8 blocks per step (Gemma-2-9B and Qwen2.5-7B:
K = 3584, 14 blocks), against the same kernel family on K = 4096: the route gemv takes, then the m1 kernel (natural
x order, lanes and tensor cores excluded) under configs whose blocks per step divide K, us per call by CUDA-graph
replay over copies that overflow L2, and % of the read bandwidth.

    PYTHONPATH=. python bench/lab/ktail_lab.py [--shapes NxK,...] [--quick]
"""
import argparse
import itertools

import torch

from llmkernels.bench.harness import copies_for, measure_read_bandwidth, time_graph_ms
from llmkernels.qgemv import gemv
from llmkernels.qgemv import route as R
from llmkernels.qgemv.route import choose
from llmkernels.testing.random_weights import random_qtensor
from llmkernels.tuning import OVERRIDES

SHAPES = [(28672, 3584), (8192, 3584), (3584, 4096), (3584, 14336), (37888, 3584), (28672, 4096), (6144, 4096)]


def candidates(K: int, quick: bool):
    """(R, NB, warps, stages, KT, H, waves) for the m1 kernel: KT lanes along K must divide the 32 // (4 H) lanes of a
    warp's row axis; configs whose NB * KT does not divide K's blocks are kept (masked tail) only at KT = 8."""
    nblocks = K // 256
    out = []
    for kt, h in ((8, 1), (4, 1), (2, 1), (1, 1), (4, 2), (2, 2), (1, 2), (2, 4)):
        if (32 // (4 * h)) % kt:
            continue
        for r, warps, waves in itertools.product((2, 4, 8), (2, 4), (1, 2)):
            if quick and (waves == 2 or warps == 2 and r == 2):
                continue
            if nblocks % kt and kt != 8:
                continue
            out.append((r, 1, warps, 3, kt, h, waves))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    bw = measure_read_bandwidth() * 1e12
    print(f"{torch.cuda.get_device_name()}, read bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    for N, K in shapes:
        first = random_qtensor("q4_k", N, K, "cuda", scale=0.02)
        qts = [first] + [random_qtensor("q4_k", N, K, "cuda", scale=0.02) for _ in range(copies_for(first.nbytes) - 1)]
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        ref = gemv(x, first).float()
        pct = lambda t: 100 * first.nbytes / bw / (t * 1e-6)  # noqa: E731
        r = choose("gemv", "q4_k", 1, N, K, torch.bfloat16)
        t0 = time_graph_ms([lambda qt=qt: gemv(x, qt) for qt in qts]) * 1e3
        print(f"[{N} x {K}] {first.nbytes / 1e6:.1f} MB: route {r.kernel} {r.config} {t0:.1f} us {pct(t0):.1f}%",
              flush=True)
        rows = []
        with R.override(exclude={"lanes", "tc"}):
            for c in candidates(K, args.quick):
                OVERRIDES[("gemv", "m1/q4_k")] = list(c)
                try:
                    err = (gemv(x, first).float() - ref).abs().max().item() / ref.abs().max().item()
                    t = time_graph_ms([lambda qt=qt: gemv(x, qt) for qt in qts]) * 1e3
                    rows.append((t, c, err))
                except Exception as e:  # a config the kernel does not take at this shape
                    print(f"    {c}: {type(e).__name__}: {str(e)[:80]}", flush=True)
                finally:
                    OVERRIDES.pop(("gemv", "m1/q4_k"), None)
        for t, c, err in sorted(rows)[:8]:
            print(f"    m1 {c}: {t:6.1f} us {pct(t):5.1f}%  ({t0 / t:.2f}x the route; rel err {err:.1e})", flush=True)
        del qts


if __name__ == "__main__":
    main()
