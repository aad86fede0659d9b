"""Batch-1 decode at short and long contexts (the engine's case): graph time per fixed split count and the plan's
automatic choice; and an eager call with the counter buffer present and absent (since session 21 both kernels merge
unbalanced splits in combine_kernel, so the two lines should match; the balanced split needs the counters).

    python scripts/decode_short.py            # split sweep (GQA 32/8, D=128, page 16, bf16)
    python scripts/decode_short.py --eager    # eager vs graph, with and without the counter buffer
"""
import sys
import time

import torch

import llmkernels as lk
import llmkernels.attention.paged as paged
from llmkernels.bench.harness import time_graph_ms

HQ, HKV, D, PS = 32, 8, 128, 16


def _inputs(B, L):
    pages = -(-L // PS)
    k = torch.randn(B * pages, PS, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    pt = torch.randperm(B * pages, device="cuda").to(torch.int32).view(B, pages)
    sl = torch.full((B,), L, dtype=torch.int32, device="cuda")
    cu = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)
    return q, k, v, pt, sl, cu


def _plan(sl, cu, ns=0):
    return lk.plan_paged_attention(cu.cpu(), sl.cpu(), PS, HQ, HKV, D, q_dtype=torch.bfloat16,
                                   kv_dtype=torch.bfloat16, num_splits=ns, device="cuda")


def sweep():
    for L in (300, 600, 1024, 2048, 4096, 8192):
        q, k, v, pt, sl, cu = _inputs(1, L)
        out = torch.empty_like(q)
        auto = _plan(sl, cu)
        line = f"L{L}:"
        for ns in (0, 1, 2, 4, 8, 16, 32):
            plan = auto if ns == 0 else _plan(sl, cu, ns)
            t = time_graph_ms([lambda plan=plan: lk.paged_attention(q, k, v, pt, sl, cu, 1, plan=plan, out=out,
                                                                    validate=False)]) * 1e3
            line += f" s{ns if ns else 'auto=' + str(auto.num_splits)} {t:.1f}"
        print(line, flush=True)


def eager():
    real = paged.split_counters
    for B, L in ((1, 32768), (16, 4096), (1, 600)):
        q, k, v, pt, sl, cu = _inputs(B, L)
        plan = _plan(sl, cu)
        out = torch.empty_like(q)

        def f():
            lk.paged_attention(q, k, v, pt, sl, cu, 1, plan=plan, out=out, validate=False)
        for name, counters in (("counters", real), ("no counters", lambda dev: None)):
            paged.split_counters = counters
            for _ in range(20):
                f()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(300):
                f()
            torch.cuda.synchronize()
            us = (time.perf_counter() - t0) / 300 * 1e6
            print(f"B{B} L{L} splits {plan.num_splits}: {name}: eager {us:.1f} us/call, "
                  f"graph {time_graph_ms([f]) * 1e3:.1f} us", flush=True)
        paged.split_counters = real


if __name__ == "__main__":
    eager() if "--eager" in sys.argv else sweep()
