"""The codebook formats (iq4_nl, iq4_xs, mxfp4) in the GEMV beside q4_0 and q4_k on the same shapes: the route each
takes, microseconds per call (CUDA-graph replay over enough copies to overflow L2) and the fraction of the read
bandwidth measured in the same run (rows of K = 2880 padded to 16 bytes, as the engine pads expert stacks, where
the format's rows are not); and gpt-oss-20b's expert products (32 experts of [2880, 2880], top 4) through
``moe_pairs`` at 1 and 8 tokens, mxfp4 with padded rows, unpadded (the generic kernel) and q8_0.

    PYTHONPATH=. python bench/lab/codebook_gemv.py [--sweep | --moe]   (tensor-core config sweeps)
"""
import torch

from llmkernels.bench.harness import copies_for, measure_read_bandwidth, time_graph_ms
from llmkernels.qgemv import gemv
from llmkernels.qgemv import route
from llmkernels.qgemv.moe import moe_pairs
from llmkernels.qgemv.ops import operands
from llmkernels.qgemv.route import choose
from llmkernels.quant.tensor import pad_rows
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
            make = (lambda: pad_rows(random_qtensor(fmt, N, K, "cuda"))) if fmt in ("iq4_nl", "iq4_xs", "mxfp4") else (
                lambda: random_qtensor(fmt, N, K, "cuda"))
            first = make()
            qts = [first] + [make() for _ in range(copies_for(first.nbytes) - 1)]
            for M in (1, 8):
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                t = time_graph_ms([lambda qt=qt: gemv(x, qt) for qt in qts])
                tbs = (first.nbytes + 2 * M * (K + N)) / (t * 1e-3) / 1e12
                o = operands("gemv", x, None, first.data, None, None, None, fmt, 0, K)
                r = choose("gemv", fmt, M, N, K, x.dtype, operands=o)
                print(f"{fmt:7s} N{N:6d} K{K:6d} M{M}: {t * 1e3:8.1f} us {tbs:5.2f} TB/s ({100 * tbs / bw:4.1f}%) "
                      f"{r.kernel} {r.config} ({r.rule})")
            del qts, first
    E, F, H, k = 32, 2880, 2880, 4
    for fmt, pad in (("mxfp4", True), ("mxfp4", False), ("q8_0", False)):
        gate = [random_qtensor(fmt, E * F, H, "cuda") for _ in range(4)]
        gate = [pad_rows(g) for g in gate] if pad else gate
        for T in (1, 8):
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            experts = torch.randint(0, E, (T * k,), device="cuda", dtype=torch.int32)
            t = time_graph_ms([lambda g=g: moe_pairs(x, g, E, experts, k) for g in gate])
            used = len(set(experts.tolist()))
            nbytes = gate[0].nbytes * used // E
            if pad:  # gate and up in one launch; the same product without the K split of small grids
                t2 = time_graph_ms([lambda g=g, u=u: moe_pairs(x, g, E, experts, k, up=u)
                                    for g, u in zip(gate, gate[1:] + gate[:1])])
                real, route.moe_tc_split = route.moe_tc_split, lambda *a: 1
                t1 = time_graph_ms([lambda g=g: moe_pairs(x, g, E, experts, k) for g in gate])
                route.moe_tc_split = real
                print(f"  gate and up in one launch {t2 * 1e3:.1f} us; without the K split {t1 * 1e3:.1f} us")
            print(f"moe_pairs {fmt}{' padded' if pad else ''} [{E} x {F}, {H}] {T} token(s) x top {k} ({used} experts): {t * 1e3:.1f} us, "
                  f"{nbytes / (t * 1e-3) / 1e12:.2f} TB/s of the experts read")


def sweep():
    """Tensor-core configs (BLOCK_N, warps, stages, waves) for the codebook formats at M = 1 and 8 (gemv's default
    is q4_0's)."""
    import dataclasses

    configs = [(64, 4, 1, 4), (64, 4, 1, 2), (64, 4, 1, 8), (128, 8, 1, 2), (128, 4, 1, 2), (32, 2, 1, 8),
               (128, 8, 1, 4)]
    for fmt in ("iq4_nl", "mxfp4"):
        for N, K in ((4096, 4096), (5760, 2880), (4096, 14336)):
            first = pad_rows(random_qtensor(fmt, N, K, "cuda"))
            qts = [first] + [pad_rows(random_qtensor(fmt, N, K, "cuda")) for _ in range(copies_for(first.nbytes) - 1)]
            for M in (1, 8):
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                res = []
                for c in configs:
                    with route.override(lambda q, r, c=c: dataclasses.replace(r, config=c) if r.kernel == "tc"
                                        else None):
                        res.append((time_graph_ms([lambda qt=qt: gemv(x, qt) for qt in qts]) * 1e3, c))
                print(f"sweep {fmt} N{N} K{K} M{M}: " + ", ".join(f"{c}: {t:.1f}" for t, c in sorted(res)))
            del qts, first



def moe_sweep():
    """Tensor-core configs for gpt-oss's mxfp4 expert products (moe_pairs, padded rows) at 1 and 4 tokens: at one
    token each chosen expert is a block of its own and the grid is N / BLOCK_N tiles per expert, no K split."""
    from llmkernels.tuning import OVERRIDES

    E, F, H, k = 32, 2880, 2880, 4
    gate = [pad_rows(random_qtensor("mxfp4", E * F, H, "cuda")) for _ in range(4)]
    for T in (1, 4):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        experts = torch.randperm(E, device="cuda")[:T * k].to(torch.int32) if T * k <= E else torch.randint(
            0, E, (T * k,), device="cuda", dtype=torch.int32)
        res = []
        for c in [(64, 4, 1, 4), (32, 2, 1, 4), (16, 1, 1, 4), (32, 1, 1, 4), (64, 2, 1, 4), (16, 4, 1, 4),
                  (128, 8, 1, 4), (32, 4, 1, 4)]:
            OVERRIDES[("gemv", "moe_tc/mxfp4")] = list(c)
            res.append((time_graph_ms([lambda g=g: moe_pairs(x, g, E, experts, k) for g in gate]) * 1e3, c))
        OVERRIDES.pop(("gemv", "moe_tc/mxfp4"))
        print(f"moe sweep mxfp4 {T} token(s): " + ", ".join(f"{c}: {t:.1f}" for t, c in sorted(res)))


if __name__ == "__main__" and "--moe" in __import__("sys").argv:
    moe_sweep()
elif __name__ == "__main__" and "--sweep" in __import__("sys").argv:
    sweep()
elif __name__ == "__main__":
    main()
