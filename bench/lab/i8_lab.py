"""GEMV with int8 activations (qgemv/int8.py) on the GPU: configs of the dp4a kernel against the exact gemv.

    python bench/lab/i8_lab.py [formats] [R/GP/warps/stages/waves[/coal/prefetch],...] [--m-curve]

At the Llama-3-8B shapes, for M = 1: the exact gemv (current routing), gemv(act_int8=True) (activation rounding
plus the kernel), and the kernel alone on pre-rounded activations for each config (R row sets per thread, GP
groups of a row across threads, warps, stages, programs per SM for the K split, and gemv_i8_kernel's COAL and
PREFETCH), each checked against x' @ dequantize(W).T and timed by CUDA-graph replay over enough weight copies to
overflow L2. Effective TB/s counts the stored weight bytes. 28672 x 4096 is the engine's fused gate/up matrix. With
--m-curve: both gemv paths at M = 1, 2, 4, 8, 16.
"""
import sys

import torch

from llmkernels.bench.harness import copies_for, measure_read_bandwidth, time_graph_ms
from llmkernels.qgemv import gemv
from llmkernels.qgemv.int8 import launch_i8, quantize_act
from llmkernels.qgemv.ops import _finish
from llmkernels.quant import dequantize
from llmkernels.testing.random_weights import random_qtensor

SHAPES = [(4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336), (28672, 4096), (128256, 4096)]


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    fmts = args[0].split(",") if args else ["q4_0", "q4_k", "q8_0"]
    cfgs = [tuple(int(v) for v in c.split("/")) for c in args[1].split(",")] if len(args) > 1 else \
        [(2, 1, 4, 3, 4), (1, 8, 4, 3, 4), (2, 8, 4, 3, 4), (1, 16, 4, 3, 4), (2, 16, 4, 3, 4), (1, 4, 4, 3, 4),
         (2, 8, 4, 3, 2), (1, 8, 8, 3, 4), (4, 8, 4, 3, 4), (2, 8, 4, 3, 8)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"read bandwidth {measure_read_bandwidth():.3f} TB/s", flush=True)
    for fmt in fmts:
        for N, K in SHAPES:
            first = random_qtensor(fmt, N, K, "cuda")
            qts = [first] + [random_qtensor(fmt, N, K, "cuda") for _ in range(copies_for(first.nbytes) - 1)]
            w = dequantize(first).float()
            ms = (1, 2, 4, 8, 16) if "--m-curve" in sys.argv else (1,)
            for M in ms:
                x = torch.randn(M, K, device="cuda", dtype=torch.float16)
                q, ds = quantize_act(x)
                xd = (q.float().view(M, K // 32, 32) * ds[..., :1]).view(M, K)
                ref = xd @ w.T
                t_e = time_graph_ms([lambda qt=qt: gemv(x, qt) for qt in qts])
                y = gemv(x, first, act_int8=True)
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                t_i = time_graph_ms([lambda qt=qt: gemv(x, qt, act_int8=True) for qt in qts])
                tb = lambda t: first.nbytes / t / 1e9  # noqa: E731
                line = (f"{fmt} N{N} K{K} M{M}: exact {t_e * 1e3:6.1f} us {tb(t_e):5.2f} | int8 {t_i * 1e3:6.1f} us "
                        f"{tb(t_i):5.2f} TB/s {'WRONG %.1e' % err if err > 4e-3 else ''} |")
                if M == 1:
                    for cfg in cfgs:
                        run = lambda qt: _finish(launch_i8(q, ds, qt.data, fmt, N, K, cfg[:4] + cfg[5:7], sms,  # noqa
                                                           True, x.dtype, waves=cfg[4]), x.dtype)
                        try:
                            y = run(first)
                        except Exception as e:  # noqa: BLE001
                            line += f" {'/'.join(map(str, cfg))} FAIL {type(e).__name__}"
                            continue
                        err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                        t = time_graph_ms([lambda qt=qt: run(qt) for qt in qts])
                        line += f" {'/'.join(map(str, cfg))} {t * 1e3:5.1f} {tb(t):4.2f}" + \
                            (f" WRONG {err:.1e}" if err > 4e-3 else "")
                print(line, flush=True)
            del qts


if __name__ == "__main__":
    main()
