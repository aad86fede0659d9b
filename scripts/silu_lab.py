"""silu_mul_gemv on the GPU: the routed path (the tensor-core kernel with silu formed in its loads, or m1) against
the route without the tensor-core kernel (ops.TC_SILU off: the planes kernel) and against silu(g) * u then gemv.

    PYTHONPATH=. python scripts/silu_lab.py

Times are CUDA-graph replays over enough weight copies to overflow L2 (fp16 activations, us); err is the routed
result against the two-step one, relative to its largest value.
"""
import torch

import llmkernels as lk
from llmkernels.bench.harness import copies_for, time_graph_ms
from llmkernels.qgemv import ops
from llmkernels.testing.random_weights import random_qtensor


def main():
    for fmt, kw, ms in [("q4_0", {}, (1, 2, 4, 8)), ("q8_0", {}, (1, 2, 4, 8)), ("q4_k", {}, (5, 8, 16)),
                        ("mlx", dict(bits=4, group_size=64), (3, 8))]:
        for N, K in [(4096, 14336), (14336, 4096)]:
            first = random_qtensor(fmt, N, K, "cuda", **kw)
            qts = [first] + [random_qtensor(fmt, N, K, "cuda", **kw) for _ in range(copies_for(first.nbytes) - 1)]
            for M in ms:
                g = torch.randn(M, K, device="cuda", dtype=torch.float16)
                u = torch.randn(M, K, device="cuda", dtype=torch.float16)
                ref = lk.gemv((torch.nn.functional.silu(g.float()) * u.float()).half(), first).float()
                err = ((lk.silu_mul_gemv(g, u, first).float() - ref).abs().max() / ref.abs().max()).item()
                t_new = time_graph_ms([lambda qt=qt: lk.silu_mul_gemv(g, u, qt) for qt in qts])
                ops.TC_SILU = False
                t_old = time_graph_ms([lambda qt=qt: lk.silu_mul_gemv(g, u, qt) for qt in qts])
                ops.TC_SILU = True
                t_two = time_graph_ms([lambda qt=qt: lk.gemv(torch.nn.functional.silu(g) * u, qt) for qt in qts])
                print(f"{fmt} N{N} K{K} M{M}: routed {t_new * 1e3:6.1f} us  without tc {t_old * 1e3:6.1f}  "
                      f"two-step {t_two * 1e3:6.1f}  err {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
