"""Decode attention at Gemma-2-9B's shape (16 query heads over 8 KV heads of 256, soft cap 50, a 4096-key window on
every second layer), bf16 page-16 caches: the persistent Gluon kernel against the Triton kernel (the plan's choice
forced either way), us per call by CUDA-graph replay and % of the read bandwidth over the K/V bytes read.

    PYTHONPATH=. python bench/lab/gemma_decode_lab.py
"""
import torch

import llmkernels as lk
from llmkernels.attention import plan as plan_mod
from llmkernels.bench.harness import measure_read_bandwidth, time_graph_ms

HQ, HKV, D, PS, CAP, WINDOW = 16, 8, 256, 16, 50.0, 4096
SHAPES = [(1, 640), (16, 640), (64, 640), (16, 4096), (64, 4096), (8, 8192)]


def case(B, L, ws: bool, left: int, bw: float):
    lens = [L] * B
    pages = -(-L // PS)
    kc = torch.randn(B * pages + 1, PS, HKV, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    pt = torch.randperm(B * pages, device="cuda").to(torch.int32).view(B, pages)
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    cq = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)
    real = plan_mod._ws_decode
    plan_mod._ws_decode = (lambda *a: real(*a)) if ws else (lambda *a: False)
    saved = plan_mod.WS_DECODE_MIN_BYTES
    plan_mod.WS_DECODE_MIN_BYTES = 0
    try:
        p = lk.plan_paged_attention(cq.cpu(), sl.cpu(), PS, HQ, HKV, D, q_dtype=q.dtype, kv_dtype=kc.dtype,
                                    device="cuda")
    finally:
        plan_mod._ws_decode = real
        plan_mod.WS_DECODE_MIN_BYTES = saved
    assert p.ws_decode == ws, p.describe()
    out = torch.empty_like(q)

    def run():
        lk.paged_attention(q, kc, vc, pt, sl, cq, 1, plan=p, out=out, window_size=(left, -1), softcap=CAP,
                           validate=False)

    run()
    us = time_graph_ms([run]) * 1e3
    keys = min(L, left + 1) if left >= 0 else L
    nbytes = B * keys * HKV * D * 2 * 2
    return us, 100 * nbytes / bw / (us * 1e-6), out.clone()


def main():
    bw = measure_read_bandwidth() * 1e12
    print(f"{torch.cuda.get_device_name()}, read bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    for B, L in SHAPES:
        for left in (-1, WINDOW - 1):
            t_ws, p_ws, o_ws = case(B, L, True, left, bw)
            torch.manual_seed(0)
            t_tr, p_tr, _ = case(B, L, False, left, bw)
            print(f"B{B} L{L} window {left:5d}: Gluon {t_ws:7.1f} us {p_ws:5.1f}% | Triton {t_tr:7.1f} us {p_tr:5.1f}% "
                  f"| {t_tr / t_ws:.2f}x", flush=True)


if __name__ == "__main__":
    main()
