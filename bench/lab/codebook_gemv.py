"""The codebook formats (iq4_nl, iq4_xs, mxfp4) in the GEMV beside q4_0 and q4_k on the same shapes: the route each
takes, microseconds per call (CUDA-graph replay over enough copies to overflow L2) and the fraction of the read
bandwidth measured in the same run; and gpt-oss-20b's expert products (32 experts of [2880, 2880] x 2 and
[2880, 2880], top 4) through ``moe_pairs`` at 1 and 8 tokens.

    PYTHONPATH=. python bench/lab/codebook_gemv.py
"""
import torch

from llmkernels.bench.harness import copies_for, measure_read_bandwidth, time_graph_ms
from llmkernels.qgemv import gemv
from llmkernels.qgemv.moe import moe_pairs
from llmkernels.qgemv.route import choose
from llmkernels.testing.random_weights import random_qtensor

FORMATS = ("q4_0", "q4_k", "iq4_nl", "iq4_xs", "mxfp4")
SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336), (5760, 2880))


def main():
    bw = measure_read_bandwidth()
    print(f"read bandwidth {bw:.3f} TB/s")
    for N, K in SHAPES:
        for fmt in FORMATS:
            if fmt in ("q4_k", "iq4_xs") and K % 256:
                continue
            first = random_qtensor(fmt, N, K, "cuda")
            qts = [first] + [random_qtensor(fmt, N, K, "cuda") for _ in range(copies_for(first.nbytes) - 1)]
            for M in (1, 8):
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                t = time_graph_ms([lambda qt=qt: gemv(x, qt) for qt in qts])
                tbs = (first.nbytes + 2 * M * (K + N)) / (t * 1e-3) / 1e12
                r = choose("gemv", fmt, M, N, K, x.dtype)
                print(f"{fmt:7s} N{N:6d} K{K:6d} M{M}: {t * 1e3:8.1f} us {tbs:5.2f} TB/s ({100 * tbs / bw:4.1f}%) "
                      f"{r.kernel} {r.config} ({r.rule})")
            del qts, first
    E, F, H, k = 32, 2880, 2880, 4
    for fmt in ("mxfp4", "q8_0"):
        gate = [random_qtensor(fmt, E * F, H, "cuda") for _ in range(4)]
        for T in (1, 8):
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            experts = torch.randint(0, E, (T * k,), device="cuda", dtype=torch.int32)
            t = time_graph_ms([lambda g=g: moe_pairs(x, g, E, experts, k) for g in gate])
            used = len(set(experts.tolist()))
            nbytes = gate[0].nbytes * used // E
            print(f"moe_pairs {fmt} [{E} x {F}, {H}] {T} token(s) x top {k} ({used} experts): {t * 1e3:.1f} us, "
                  f"{nbytes / (t * 1e-3) / 1e12:.2f} TB/s of the experts read")


if __name__ == "__main__":
    main()
