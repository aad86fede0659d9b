"""Batch-1 GEMV experiments on the GPU: the m1 kernel (scales factored out) against the planes kernel.

    python bench/lab/gemv_lab.py [out_dir] [formats] [unpack/R/NB/warps/stages/waves[/KT],...]
    python bench/lab/gemv_lab.py --m-curve [formats] [R/NB/warps/stages/rows_per_program[/KT/H/waves],...]

Formats: q4_k, q4_0, q8_0, mlx4g64 (MLX bits and group size). At Llama-3-8B shapes: checks each candidate config
against x @ dequantize(W).T, times it by CUDA-graph replay over enough weight copies to overflow L2, prints effective
TB/s, and writes the SASS of the best config per (format, unpack mode) to out_dir.
"""
import itertools
import math
import os
import sys
import time

import torch

from llmkernels.bench.harness import copies_for, measure_read_bandwidth, time_graph_ms
from llmkernels.qgemv import gemv
from llmkernels.qgemv.m1 import launch_m1
from llmkernels.qgemv.ops import _finish
from llmkernels.quant import dequantize
from llmkernels.testing.random_weights import random_qtensor

SHAPES = [(4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336), (128256, 4096), (28672, 4096)]


def _parse(name: str):
    """'mlx4g64' -> ('mlx', {'bits': 4, 'group_size': 64}); GGUF names -> (name, {})."""
    if name.startswith("mlx"):
        bits, gs = name[3:].split("g")
        return "mlx", dict(bits=int(bits), group_size=int(gs))
    return name, {}


def _m1(x, qt, cfg, sms, unpack, waves=2, **kw):
    return launch_m1(x, qt.data, qt.format, qt.shape[0], qt.shape[1], cfg, sms, unpack, waves=waves,
                     scales=qt.scales, biases=qt.biases, bits=qt.bits or 0, group_size=qt.group_size or 0, **kw)


def m_curve(names, cfgs):
    """M = 1..4 and 8: the m1 kernel with configs (R, NB, warps, stages, activation rows per program) against
    gemv's choice."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name in names:
        fmt, kw = _parse(name)
        for N, K in SHAPES:
            first = random_qtensor(fmt, N, K, "cuda", **kw)
            qts = [first] + [random_qtensor(fmt, N, K, "cuda", **kw) for _ in range(copies_for(first.nbytes) - 1)]
            for M in (1, 2, 3, 4, 8):
                x = torch.randn(M, K, device="cuda", dtype=torch.float16)
                ref = x.float() @ dequantize(first).float().T
                t_g = time_graph_ms([lambda qt=qt: gemv(x, qt) for qt in qts])
                line = f"{name} N{N} K{K} M{M}: gemv {t_g * 1e3:6.1f} us |"
                for cfg in cfgs:
                    if cfg[4] > M and cfg[4] > 1:
                        continue
                    kcfg = cfg[:4] + cfg[5:]  # R/NB/warps/stages/rows_per_program[/KT/H/waves]
                    y = _finish(_m1(x, first, kcfg, sms, 2, rows_per_program=cfg[4]), x.dtype)
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    t = time_graph_ms([lambda qt=qt: _finish(_m1(x, qt, kcfg, sms, 2, rows_per_program=cfg[4]),
                                                             x.dtype) for qt in qts])
                    line += f" {'/'.join(map(str, cfg))} {t * 1e3:6.1f}" + (f" WRONG {err:.1e}" if err > 2e-2 else "")
                print(line, flush=True)


def main():
    if sys.argv[1:2] == ["--m-curve"]:
        cfgs = [tuple(int(v) for v in c.split("/")) for c in sys.argv[3].split(",")] if len(sys.argv) > 3 else \
            [(4, 1, 4, 3, 1), (4, 1, 4, 3, 4), (2, 1, 4, 3, 4)]
        return m_curve(sys.argv[2].split(",") if len(sys.argv) > 2 else ["q4_k"], cfgs)
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    fmts = sys.argv[2].split(",") if len(sys.argv) > 2 else ["q4_k", "q4_0", "q8_0"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = measure_read_bandwidth()
    print(f"read bandwidth {bw:.3f} TB/s", flush=True)
    for name in fmts:
        fmt, kw = _parse(name)
        nbs = [1, 2]
        cands = [(1, 4, 1, 4, 3, 2)] + list(itertools.product([2], [2, 4], nbs, [4, 8], [1, 3], [2, 4]))
        if len(sys.argv) > 3:
            cands = [tuple(int(v) for v in c.split("/")) for c in sys.argv[3].split(",")]
        data = {}
        for N, K in SHAPES:
            first = random_qtensor(fmt, N, K, "cuda", **kw)
            qts = [first] + [random_qtensor(fmt, N, K, "cuda", **kw) for _ in range(copies_for(first.nbytes) - 1)]
            x = torch.randn(1, K, device="cuda", dtype=torch.float16)
            ref = (x.float() @ dequantize(first).float().T)
            data[(N, K)] = (qts, x, ref)
            t = time_graph_ms([lambda qt=qt: gemv(x, qt) for qt in qts])
            print(f"{name} N{N} K{K} gemv (current): {t * 1e3:7.1f} us {first.nbytes / t / 1e9:6.2f} TB/s",
                  flush=True)
        results = []
        for cand in cands:
            unpack, reps, nb, warps, stages, waves = cand[:6]
            cfg = (reps, nb, warps, stages) + tuple(cand[6:])  # a 7th number: lanes along K (m1.py's KT)
            times, bad = [], None
            t0 = time.time()
            for (N, K), (qts, x, ref) in data.items():
                try:
                    y = _finish(_m1(x, qts[0], cfg, sms, unpack, waves), x.dtype)
                except Exception as e:  # noqa: BLE001
                    bad = f"{type(e).__name__}: {str(e)[:200]}"
                    break
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                if not err < 2e-2:
                    bad = f"wrong: err {err:.3g}"
                    break
                times.append(time_graph_ms([lambda qt=qt: _finish(_m1(x, qt, cfg, sms, unpack, waves), x.dtype)
                                            for qt in qts], reps=10, trials=3))
            if bad:
                print(f"  {name} unpack{unpack} {cfg}: {bad}", flush=True)
                continue
            tbs = [qts[0].nbytes / t / 1e9 for t, (qts, _, _) in zip(times, data.values())]
            results.append((math.exp(sum(map(math.log, times)) / len(times)), unpack, cfg, tbs, waves))
            print(f"  {name} unpack{unpack} {cfg} waves {waves}: " + " ".join(f"{v:5.2f}" for v in tbs) + f" TB/s"
                  f"  ({time.time() - t0:.1f}s)", flush=True)
        results.sort(key=lambda r: r[0])
        print(f"BEST {name}:")
        for r in results[:6]:
            print(f"   unpack{r[1]} {r[2]} waves {r[4]}: " + " ".join(f"{v:5.2f}" for v in r[3]) + " TB/s", flush=True)
        for unpack in (1, 2):
            best = [r for r in results if r[1] == unpack]
            if not best:
                continue
            cfg = best[0][2]
            (N, K), (qts, x, _) = next(iter(data.items()))
            _, kernel = _m1(x, qts[0], cfg, sms, unpack, best[0][4], return_kernel=True)
            sass = kernel.asm["sass"]
            with open(os.path.join(out_dir, f"{name}_unpack{unpack}.sass"), "w") as f:
                f.write(f"# {name} unpack {unpack} config {cfg}\n{sass}")
        del data


if __name__ == "__main__":
    main()
