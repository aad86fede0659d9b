"""Small-M GEMV on the tensor cores (qgemv/tc.py: q4_k, q5_k, q6_k, q4_0, q8_0, MLX 4-bit) against gemv without
it, on the GPU.

    python bench/lab/tc_lab.py [--fmt q4_k|q5_k|q6_k|q4_0|q8_0|mlx4] [--configs BLOCK_N/warps/stages/waves,...]
                             [--m 1,8,16] [--dtypes fp16,bf16] [--shapes NxK,...]

A config may add /prefetch/maxnreg (tc.launch_tc).

Checks each config against x @ dequantize(W).T (float32), then times it by CUDA-graph replay over enough weight
copies to overflow L2 and prints effective TB/s (weight + activation bytes / time) next to the time of gemv with
the tensor-core route excluded (route.override): the m1 or planes kernel.
"""
import argparse
import math

import torch

from llmkernels.bench.harness import copies_for, measure_read_bandwidth, time_graph_ms
from llmkernels.qgemv import gemv, route
from llmkernels.qgemv.ops import _finish
from llmkernels.qgemv.tc import launch_tc
from llmkernels.quant import dequantize
from llmkernels.testing.random_weights import random_qtensor


def _kw(qt):
    """launch_tc's keywords for this tensor: scales, biases and group size for MLX, the format for GGUF blocks."""
    if qt.format == "mlx":
        return dict(scales=qt.scales, biases=qt.biases, group_size=qt.group_size)
    return dict(fmt=qt.format)


SHAPES = [(4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="64/4/1/4,64/4/1/2,128/8/1/2,128/4/1/2")
    ap.add_argument("--m", default="1,8,16")
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--shapes", default="")
    ap.add_argument("--fmt", default="q4_k", choices=["q4_k", "q5_k", "q6_k", "q4_0", "q8_0", "mlx4"])
    args = ap.parse_args()
    cfgs = [tuple(int(v) for v in c.split("/")) for c in args.configs.split(",")]
    ms = [int(v) for v in args.m.split(",")]
    dts = [{"fp16": torch.float16, "bf16": torch.bfloat16}[d] for d in args.dtypes.split(",")]
    shapes = SHAPES if not args.shapes else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"read bandwidth {measure_read_bandwidth():.3f} TB/s", flush=True)
    summary = {}
    for N, K in shapes:
        fmt = "mlx" if args.fmt == "mlx4" else args.fmt
        first = random_qtensor(fmt, N, K, "cuda")
        qts = [first] + [random_qtensor(fmt, N, K, "cuda") for _ in range(copies_for(first.nbytes) - 1)]
        w_ref = dequantize(first).float()
        for dt in dts:
            for M in ms:
                x = torch.randn(M, K, device="cuda", dtype=dt)
                nbytes = first.nbytes + x.numel() * x.element_size()
                ref = x.float() @ w_ref.T
                with route.override(exclude={"tc"}):  # the path without tensor cores
                    t_g = time_graph_ms([lambda qt=qt: gemv(x, qt) for qt in qts], reps=10, trials=3)
                line = f"N{N} K{K} {str(dt)[6:]} M{M}: no-tc {t_g * 1e3:6.1f} us {nbytes / t_g / 1e9:5.2f} TB/s |"
                for cfg in cfgs:
                    try:
                        y = _finish(launch_tc(x, first.data, N, K, cfg, sms, 2, **_kw(first)), dt)
                    except Exception as e:  # noqa: BLE001
                        line += f" {cfg}: {type(e).__name__} {str(e)[:80]}"
                        continue
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    if not err < 2e-2:
                        line += f" {cfg}: WRONG {err:.2e}"
                        continue
                    t = time_graph_ms([lambda qt=qt: _finish(launch_tc(x, qt.data, N, K, cfg, sms, 2, **_kw(qt)), dt)
                                       for qt in qts], reps=10, trials=3)
                    summary.setdefault((cfg, str(dt), M), []).append(t_g / t)
                    line += f" {'/'.join(map(str, cfg))} {t * 1e3:6.1f} us {nbytes / t / 1e9:5.2f} ({err:.0e})"
                print(line, flush=True)
    print("geomean speed-up over gemv:")
    for key, v in sorted(summary.items()):
        print(f"  {key}: {math.exp(sum(map(math.log, v)) / len(v)):.2f}x over {len(v)} shapes")


if __name__ == "__main__":
    main()
