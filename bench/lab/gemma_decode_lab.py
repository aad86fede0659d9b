"""Decode attention at Gemma-2-9B's shape (16 query heads over 8 KV heads of 256, soft cap 50, a 4096-key window on
every second layer), bf16 page-16 caches: the persistent Gluon kernel against the Triton kernel (the plan's choice
forced either way), us per call by CUDA-graph replay and % of the read bandwidth over the K/V bytes read.

    PYTHONPATH=. python bench/lab/gemma_decode_lab.py
    PYTHONPATH=. python bench/lab/gemma_decode_lab.py --sweep 1x640,1x4096   # Triton kernel: configs x splits

--sweep times the Triton kernel at each (BLOCK_N, warps, stages) of CONFIGS and each split count of SPLITS (0: the
plan's), after checking each config once against the float64 reference.
"""
import argparse

import torch

import llmkernels as lk
from llmkernels.attention import plan as plan_mod
from llmkernels.bench.harness import measure_read_bandwidth, time_graph_ms

HQ, HKV, D, PS, CAP, WINDOW = 16, 8, 256, 16, 50.0, 4096
SHAPES = [(1, 640), (16, 640), (64, 640), (16, 4096), (64, 4096), (8, 8192)]


CONFIGS = [(16, 4, 2), (16, 4, 3), (16, 4, 4), (32, 4, 2), (32, 4, 3), (32, 4, 4), (32, 8, 2), (32, 8, 3),
           (64, 4, 2), (64, 8, 2), (64, 8, 3)]
SPLITS = [0, 4, 8, 10, 16, 20, 32]


def case(B, L, ws: bool, left: int, bw: float, num_splits: int = 0, copies: int = 1):
    lens = [L] * B
    pages = -(-L // PS)
    caches = []
    for _ in range(copies):  # copies past L2's size, so the timed reads come from DRAM as in an engine step
        kc = torch.randn(B * pages + 1, PS, HKV, D, device="cuda", dtype=torch.bfloat16)
        caches.append((kc, torch.randn_like(kc), torch.randperm(B * pages, device="cuda").to(torch.int32).view(B, pages)))
    kc, vc, pt = caches[0]
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    cq = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)
    real = plan_mod._ws_decode
    plan_mod._ws_decode = (lambda *a: real(*a)) if ws else (lambda *a: False)
    saved = plan_mod.WS_DECODE_MIN_BYTES
    plan_mod.WS_DECODE_MIN_BYTES = 0
    try:
        p = lk.plan_paged_attention(cq.cpu(), sl.cpu(), PS, HQ, HKV, D, q_dtype=q.dtype, kv_dtype=kc.dtype,
                                    num_splits=num_splits, device="cuda")
    finally:
        plan_mod._ws_decode = real
        plan_mod.WS_DECODE_MIN_BYTES = saved
    assert p.ws_decode == ws, p.describe()
    out = torch.empty_like(q)

    def run(c):
        lk.paged_attention(q, c[0], c[1], c[2], sl, cq, 1, plan=p, out=out, window_size=(left, -1), softcap=CAP,
                           validate=False)

    run(caches[0])
    us = time_graph_ms([lambda c=c: run(c) for c in caches]) * 1e3
    keys = min(L, left + 1) if left >= 0 else L
    nbytes = B * keys * HKV * D * 2 * 2
    return us, 100 * nbytes / bw / (us * 1e-6), out.clone(), p.num_splits


def _check(cfg):
    """Largest error of the Triton kernel under ``cfg`` against float64 (ragged batch, cap, window, 1 and 5 splits)."""
    from llmkernels.testing.attention import paged_attention_ref

    lens = [37, 640, 129]
    pages = [-(-n // PS) for n in lens]
    kc = torch.randn(sum(pages), PS, HKV, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    pt = torch.zeros(len(lens), max(pages), dtype=torch.int32, device="cuda")
    perm, at = torch.randperm(sum(pages), device="cuda").to(torch.int32), 0
    for i, n in enumerate(pages):
        pt[i, :n] = perm[at:at + n]
        at += n
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    cq = torch.arange(len(lens) + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(len(lens), HQ, D, device="cuda", dtype=torch.bfloat16)
    ref, _ = paged_attention_ref(q, kc, vc, pt, sl, cq, window_size=(100, -1), softcap=CAP)
    err = 0.0
    for ns in (1, 5):
        o = torch.full_like(q, float("nan"))
        lk.paged_attention(q, kc, vc, pt, sl, cq, 1, num_splits=ns, out=o, window_size=(100, -1), softcap=CAP)
        err = max(err, (o.double() - ref).abs().max().item())
    return err


def sweep(shapes, bw):
    from llmkernels.tuning import OVERRIDES

    keys = [("paged", f"short/bfloat16/{D}/small/g<=8" + few) for few in ("", "/few")]
    for cfg in CONFIGS:
        for k in keys:
            OVERRIDES[k] = list(cfg)
        try:
            err = _check(cfg)
        except Exception as e:  # a config that does not compile is reported, not fatal
            print(f"{cfg}: {type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        for B, L in shapes:
            line = []
            for ns in SPLITS:
                if ns and L // ns < 16:
                    continue
                us, pct, _, got = case(B, L, False, -1, bw, num_splits=ns, copies=16)
                line.append(f"{'plan ' if not ns else ''}{got}: {us:6.1f}")
            print(f"{cfg} err {err:.1e} B{B} L{L} | " + " | ".join(line), flush=True)
    for k in keys:
        OVERRIDES.pop(k, None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", default="", help="shapes BxL for the config x split sweep, e.g. 1x640,1x4096")
    args = ap.parse_args()
    bw = measure_read_bandwidth() * 1e12
    if args.sweep:
        print(f"{torch.cuda.get_device_name()}, read bandwidth {bw / 1e12:.3f} TB/s", flush=True)
        return sweep([tuple(int(v) for v in c.split("x")) for c in args.sweep.split(",")], bw)
    print(f"{torch.cuda.get_device_name()}, read bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    for B, L in SHAPES:
        for left in (-1, WINDOW - 1):
            t_ws, p_ws, o_ws, _ = case(B, L, True, left, bw)
            torch.manual_seed(0)
            t_tr, p_tr, _, _ = case(B, L, False, left, bw)
            print(f"B{B} L{L} window {left:5d}: Gluon {t_ws:7.1f} us {p_ws:5.1f}% | Triton {t_tr:7.1f} us {p_tr:5.1f}% "
                  f"| {t_tr / t_ws:.2f}x", flush=True)


if __name__ == "__main__":
    main()
