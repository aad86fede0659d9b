"""Decode paged-attention experiments on the GPU: (BLOCK_N, warps, stages) and split counts per bench shape.

    python bench/lab/paged_lab.py [--kv bf16,fp8] [--pages 1,16,64] [--budget SECONDS]

Each candidate config is checked once against the float64 reference (a small batch with ragged lengths), then timed
by CUDA-graph replay at the decode suite's shapes (GQA 32/8, D=128) with the split count the planner picks, and
with a few fixed split counts. Prints effective TB/s (K/V + q + o bytes) and percent of the measured read bandwidth.

Why stages matter here: the K/V loads' addresses come from a page-table load in the same loop, and Triton 3.6's
pipeliner gives that chain two stages, so a loop gets (num_stages - 1) // 2 K/V buffers (seen in the TTGIR).
"""
import argparse
import time

import torch

from llmkernels.attention import paged_attention, plan_paged_attention
from llmkernels.bench.harness import copies_for, measure_read_bandwidth, time_graph_ms
from llmkernels.testing.attention import paged_attention_ref
from llmkernels.tuning import OVERRIDES

HQ, HKV, D = 32, 8, 128
SHAPES = [(1, 32768), (16, 4096), (64, 1024), (64, 8192), (128, 2048)]
KV = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
CONFIGS = [(16, 4, 5), (16, 4, 7), (16, 4, 9), (32, 4, 5), (32, 4, 7), (32, 4, 9), (64, 4, 5), (64, 4, 7),
           (64, 8, 7), (128, 4, 5), (128, 8, 5), (128, 8, 7)]


def _key(kv, ps):
    page_class = "p1" if ps == 1 else ("small" if ps < 64 else "large")
    return ("paged", f"short/{str(kv)[6:]}/{D}/{page_class}/g<=8")


def _override(kv, ps, cfg):
    """Make the plan use ``cfg`` (None: the table again) for every batch, the few-programs key included."""
    table, key = _key(kv, ps)
    for k in (key, key + "/few"):
        if cfg is None:
            OVERRIDES.pop((table, k), None)
        else:
            OVERRIDES[(table, k)] = cfg


def _cache(B, L, ps, kv):
    pages = -(-L // ps)
    k = torch.randn(B * pages, ps, HKV, D, device="cuda", dtype=torch.bfloat16).to(kv)
    v = torch.randn(B * pages, ps, HKV, D, device="cuda", dtype=torch.bfloat16).to(kv)
    pt = torch.randperm(B * pages, device="cuda").to(torch.int32).view(B, pages)
    return k, v, pt


def _check(kv, ps):
    """Max abs error against the float64 reference on a ragged batch, with num_splits 1 and 5."""
    lens = [1, ps + 1, 3 * ps - 1, 1000, 4097]
    B = len(lens)
    maxp = -(-max(lens) // ps)
    k, v, _ = _cache(B, maxp * ps, ps, kv)
    pt = torch.randperm(k.shape[0], device="cuda").to(torch.int32)[:B * maxp].view(B, maxp)
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    cu = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)
    sc = dict(k_scale=0.5, v_scale=2.0) if kv != torch.bfloat16 else {}
    ref, _ = paged_attention_ref(q, k, v, pt, sl, cu, **sc)
    err = 0.0
    for ns in (1, 5):
        o = torch.full_like(q, float("nan"))
        paged_attention(q, k, v, pt, sl, cu, 1, num_splits=ns, out=o, **sc)
        err = max(err, (o.double() - ref).abs().max().item())
    return err


def _time(B, L, ps, kv, num_splits, most=4):
    cu = torch.arange(B + 1, dtype=torch.int32)
    sl = torch.full((B,), L, dtype=torch.int32)
    plan = plan_paged_attention(cu, sl, ps, HQ, HKV, D, q_dtype=torch.bfloat16, kv_dtype=kv, num_splits=num_splits,
                                device="cuda")
    cu, sl = cu.cuda(), sl.cuda()
    q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    kv_bytes = 2 * B * L * HKV * D * (1 if kv != torch.bfloat16 else 2)
    caches = [_cache(B, L, ps, kv) for _ in range(copies_for(kv_bytes, most=most))]
    sc = dict(k_scale=1.0, v_scale=1.0) if kv != torch.bfloat16 else {}
    fns = [lambda c=c: paged_attention(q, c[0], c[1], c[2], sl, cu, 1, plan=plan, out=out, validate=False, **sc)
           for c in caches]
    ms = time_graph_ms(fns)
    return (kv_bytes + 4 * q.numel()) / (ms * 1e-3) / 1e12, ms * 1e3, plan.num_splits


def _eager(args):
    for kvname in args.kv.split(","):
        kv = KV[kvname]
        for ps in [int(s) for s in args.pages.split(",")]:
            for cfg in [tuple(int(v) for v in c.split("/")) for c in args.configs.split(",") if c]:
                _override(kv, ps, cfg)
                for B, L in [tuple(int(v) for v in c.split("x")) for c in args.shapes.split(",") if c]:
                    k, v, pt = _cache(B, L, ps, kv)
                    cu = torch.arange(B + 1, dtype=torch.int32, device="cuda")
                    sl = torch.full((B,), L, dtype=torch.int32, device="cuda")
                    q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)
                    sc = dict(k_scale=1.0, v_scale=1.0) if kv != torch.bfloat16 else {}
                    for _ in range(3):
                        paged_attention(q, k, v, pt, sl, cu, 1, validate=False, **sc)
                    torch.cuda.synchronize()
                    print(f"ran {kvname} p{ps} {cfg} B{B} L{L}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kv", default="bf16,fp8")
    p.add_argument("--pages", default="16,1,64")
    p.add_argument("--budget", type=float, default=500.0, help="stop starting new configs after this many seconds")
    p.add_argument("--splits", default="", help="extra fixed split counts to time for each shape, e.g. 2,4,8 "
                   "(those leaving fewer than --min-keys keys per split are skipped)")
    p.add_argument("--cold", action="store_true", help="rotate over up to 64 cache copies (>= 256 MB) instead of "
                   "4, so that short contexts are read from DRAM as in an engine step, not from L2")
    p.add_argument("--min-keys", type=int, default=256, help="least keys per split of the --splits counts")
    p.add_argument("--configs", default="", help="only these configs, e.g. 32/4/5,64/4/5 (BLOCK_N/warps/stages)")
    p.add_argument("--shapes", default="", help="only these shapes, e.g. 1x32768,16x4096")
    p.add_argument("--eager", action="store_true", help="run each (config, shape) 3 times without graphs or timing "
                   "(for ncu: ncu --kernel-name regex:paged_attn ... python bench/lab/paged_lab.py --eager ...)")
    args = p.parse_args()
    if args.eager:
        return _eager(args)
    t0 = time.time()
    bw = measure_read_bandwidth()
    print(f"read bandwidth {bw:.3f} TB/s", flush=True)
    extra = [int(s) for s in args.splits.split(",") if s]
    configs = [tuple(int(v) for v in c.split("/")) for c in args.configs.split(",") if c] or CONFIGS
    shapes = [tuple(int(v) for v in c.split("x")) for c in args.shapes.split(",") if c] or SHAPES
    for kvname in args.kv.split(","):
        kv = KV[kvname]
        for ps in [int(s) for s in args.pages.split(",")]:
            for cfg in configs:
                if time.time() - t0 > args.budget:
                    print("budget spent", flush=True)
                    return
                _override(kv, ps, cfg)
                try:
                    err = _check(kv, ps)
                except Exception as e:  # a config that does not compile (shared memory) is reported, not fatal
                    print(f"{kvname} p{ps} {cfg}: failed {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                cells = []
                for B, L in shapes:
                    for ns in [0] + [n for n in extra if L // n >= args.min_keys]:
                        tbs, us, used = _time(B, L, ps, kv, ns, most=64 if args.cold else 4)
                        cells.append(f"B{B}xL{L}/s{used}: {tbs:.2f} ({100 * tbs / bw:.0f}%) {us:.1f}us")
                print(f"{kvname} p{ps} {cfg} err {err:.2e} | " + " | ".join(cells), flush=True)
            _override(kv, ps, None)
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
