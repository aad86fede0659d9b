"""Where the Gluon decode kernel's fixed costs go at small batches (GQA 32/8, D=128, page 16, random page table),
graph-timed through ``paged_attention`` with a plan over L2-overflowing cache copies, us, variants alternating in
one process:

- ``combine``: B=1 L=32768 / B=2 L=16384 (split-KV) and B=64 L=1024 (unsplit), bf16 and fp8 e4m3: as planned;
  with combine_kernel not launched (``nocombine``: what the merge costs; the outputs are then wrong); with the
  combine's PDL off; fp8 with 2 / 3 / 6 fp16 V slots (``paged_ws.FP8_STAGES16``, 4 by default);
- ``rings``: fp8 e4m3 at eight shapes, every (TMA ring slots, fp16 V slots) pair of a list, three rounds.

    PYTHONPATH=. python scripts/decode_b1_parts.py [combine] [rings]
"""
import sys

import torch

import llmkernels.attention.paged as pg
import llmkernels.attention.paged_kernel as pk
import llmkernels.attention.paged_ws as pw
from llmkernels.attention import paged_attention, plan_paged_attention
from llmkernels.bench.harness import copies_for, time_graph_ms
from llmkernels.bench.suites.decode import D, HKV, HQ
from llmkernels.bench.suites.decode import _cache as bench_cache  # the bench's caches: random page table



class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *a, **k: None


def calls(B, L, kv_dtype):
    """Callables running one decode step of B sequences of L keys, each over its own cache copy."""
    cu = torch.tensor([0] + [1] * B).cumsum(0).to(torch.int32)
    sl = torch.tensor([L] * B, dtype=torch.int32)
    plan = plan_paged_attention(cu, sl, 16, HQ, HKV, D, q_dtype=torch.bfloat16, kv_dtype=kv_dtype, device="cuda")
    cu, sl = cu.cuda(), sl.cuda()
    q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    elem = 1 if kv_dtype != torch.bfloat16 else 2
    caches = [bench_cache(B, L, 16, kv_dtype) for _ in range(copies_for(2 * B * L * HKV * D * elem, most=4))]
    sc = dict(k_scale=1.0, v_scale=1.0) if kv_dtype != torch.bfloat16 else {}
    return [lambda c=c: paged_attention(q, c[0], c[1], c[2], sl, cu, 1, plan=plan, out=out, validate=False, **sc)
            for c in caches]


def timed(fns, variant):
    saved = (pk.combine_kernel, pw.FP8_STAGES16, pg.COMBINE_PDL, pw.fp8_ring)
    try:
        if variant == "nocombine":
            pk.combine_kernel = _NoLaunch()
        elif variant == "nocombpdl":
            pg.COMBINE_PDL = False
        elif variant.startswith("v16="):
            pw.FP8_STAGES16 = int(variant[4:])
        elif variant.startswith("ring="):
            ring, v16 = (int(x) for x in variant[5:].split("/"))
            pw.fp8_ring = lambda units, programs: ring
            pw.FP8_STAGES16 = v16
        return time_graph_ms(fns) * 1e3
    finally:
        pk.combine_kernel, pw.FP8_STAGES16, pg.COMBINE_PDL, pw.fp8_ring = saved


def combine():
    for B, L in ((1, 32768), (2, 16384), (64, 1024)):
        for dt, name in ((torch.bfloat16, "bf16"), (torch.float8_e4m3fn, "fp8")):
            fns = calls(B, L, dt)
            variants = ["base", "nocombine", "nocombpdl", "base"]
            if name == "fp8":
                variants += ["v16=2", "v16=3", "v16=6", "base"]
            res = [" ".join(f"{v} {timed(fns, v):.1f}" for v in variants) for _ in range(2)]
            print(f"B{B} L{L} {name}: " + " || ".join(res), flush=True)


def rings():
    for B, L in ((1, 32768), (2, 16384), (8, 8192), (16, 4096), (32, 4096), (64, 1024), (128, 2048), (64, 8192)):
        fns = calls(B, L, torch.float8_e4m3fn)
        combos = ["4/4", "6/4", "4/3", "5/3", "6/3", "5/4", "6/2"]
        res = {c: [] for c in combos}
        for _ in range(3):
            for c in combos:
                res[c].append(timed(fns, "ring=" + c))
        print(f"B{B} L{L}: " + " | ".join(f"{c} " + "/".join(f"{t:.1f}" for t in ts) for c, ts in res.items()),
              flush=True)


if __name__ == "__main__":
    parts = sys.argv[1:] or ["combine", "rings"]
    if "combine" in parts:
        combine()
    if "rings" in parts:
        rings()
