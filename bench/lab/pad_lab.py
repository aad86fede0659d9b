"""Matrices whose rows the tensor-core kernel cannot read as stored (q6_k with K not a multiple of 2048; q4_0 / q8_0
with K not a multiple of 256, as gpt-oss's K = 2880): the routed gemv as stored against the same matrix padded with
zero blocks along K (quant.tensor.pad_k, to the multiple ops.tc_padding uses), x padded to match, at several
activation rows M. "pad" times x's padding launch with the product; "pre" hands the product x padded already (what
the engine does: the norm before it writes the zeros). Default shapes (q6_k): a tensor-parallel rank's row-parallel
down product (Llama-3-8B at TP = 2 and 4), Gemma-2-9B's V, Qwen2.5-7B's down.

    PYTHONPATH=. python bench/lab/pad_lab.py [--fmt q8_0] [--shapes 5120x2880,201088x2880]

Each shape's padded product is checked against the stored one first; times by CUDA-graph replay over weight copies
that overflow L2 (us).
"""
import argparse

import torch
import torch.nn.functional as F

from llmkernels.bench.harness import copies_for, time_graph_ms
from llmkernels.qgemv import gemv, route
from llmkernels.qgemv.ops import PAD_K_MULTIPLE, operands
from llmkernels.quant.tensor import pad_k
from llmkernels.testing.random_weights import random_qtensor

SHAPES = ((4096, 7168), (4096, 3584), (2048, 3584), (3584, 18944))
MS = (1, 2, 8, 16, 64)


def _route(qt, M, K):
    x = torch.empty(M, K, dtype=torch.bfloat16, device="cuda")
    o = operands("gemv", x, None, qt.data, None, None, None, qt.format, 0, K)
    return route.choose("gemv", qt.format, M, qt.shape[0], K, torch.bfloat16, operands=o,
                        target=route.Target(torch.cuda.get_device_name())).kernel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fmt", default="q6_k")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    a = ap.parse_args()
    fmt = a.fmt
    for N, K in (tuple(map(int, s.split("x"))) for s in a.shapes.split(",")):
        step = PAD_K_MULTIPLE[fmt]
        Kp = -(-K // step) * step
        nbytes = qbytes(fmt, N, K)
        n = copies_for(nbytes, most=8)
        plain = [random_qtensor(fmt, N, K, "cuda") for _ in range(n)]
        padded = [pad_k(qt, Kp) for qt in plain]
        row = []
        for M in map(int, a.ms.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            xp = F.pad(x, (0, Kp - K))
            ref = gemv(x, plain[0]).float()
            b = gemv(xp, padded[0]).float()
            err = ((ref - b).abs().max() / ref.abs().max()).item()
            t0 = time_graph_ms([lambda w=w: gemv(x, w) for w in plain]) * 1e3
            t1 = time_graph_ms([lambda w=w: gemv(F.pad(x, (0, Kp - K)), w) for w in padded]) * 1e3
            t2 = time_graph_ms([lambda w=w: gemv(xp, w) for w in padded]) * 1e3
            row.append(f"M{M}: {_route(plain[0], M, K)} {t0:6.1f} ({nbytes / t0 / 1e3:.2f} TB/s) / "
                       f"{_route(padded[0], M, Kp)} pad {t1:6.1f} pre {t2:6.1f} ({t0 / t2:.2f}x, err {err:.1e})")
        print(f"{fmt} {N}x{K} (padded to {Kp}):\n  " + "\n  ".join(row), flush=True)


def qbytes(fmt: str, N: int, K: int) -> int:
    from llmkernels.quant.formats import GGUF_FORMATS

    return N * GGUF_FORMATS[fmt].bytes_per_row(K)


if __name__ == "__main__":
    main()
