"""fp8-cache decode on the persistent Gluon kernel: what bounds it on this GPU.

    python bench/lab/fp8_decode_lab.py [--consumers 1,2] [--stages 6,8] [--stages16 2,4] [--terms 2,3]
                                       [--bf16]

Times the decode suite's shapes (GQA 32/8, D 128, page 16, e4m3 cache) by CUDA-graph replay for each count of
consumer warp groups, ring depth (the fp8 TMA ring, the converter's fp16 ring) and e4m3 terms of q, beside the
bf16 cache. B = 16 is also checked against the float64 reference (max abs error).
"""
import argparse
import itertools

import torch

HQ, HKV, D = 32, 8, 128
SHAPES = [(1, 32768), (16, 4096), (64, 1024), (64, 8192), (128, 2048)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--consumers", default="1,2")
    p.add_argument("--stages", default="4,6,8")
    p.add_argument("--stages16", default="2,4")
    p.add_argument("--shapes", default="")
    p.add_argument("--bf16", action="store_true", help="also time the bf16 cache (the ratio's denominator)")
    p.add_argument("--terms", default="3", help="e4m3 terms of the bf16 q (paged_ws.FP8_Q_TERMS_BF16)")
    args = p.parse_args()
    from llmkernels.attention import paged_attention, paged_ws, plan_paged_attention, schedule
    from llmkernels.bench.harness import copies_for, time_graph_ms
    from llmkernels.testing.attention import paged_attention_ref

    shapes = [tuple(int(v) for v in c.split("x")) for c in args.shapes.split(",") if c] or SHAPES

    def cache(B, L, kv):
        pages = -(-L // 16)
        k = torch.randn(B * pages, 16, HKV, D, device="cuda", dtype=torch.bfloat16).to(kv)
        v = torch.randn(B * pages, 16, HKV, D, device="cuda", dtype=torch.bfloat16).to(kv)
        return k, v, torch.randperm(B * pages, device="cuda").to(torch.int32).view(B, pages)

    def run(B, L, kv):
        cu = torch.arange(B + 1, dtype=torch.int32)
        sl = torch.full((B,), L, dtype=torch.int32)
        plan = plan_paged_attention(cu, sl, 16, HQ, HKV, D, q_dtype=torch.bfloat16, kv_dtype=kv, device="cuda")
        cu, sl = cu.cuda(), sl.cuda()
        q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        kv_bytes = 2 * B * L * HKV * D * kv.itemsize
        caches = [cache(B, L, kv) for _ in range(copies_for(kv_bytes, most=4))]
        sc = dict(k_scale=1.0, v_scale=1.0) if kv != torch.bfloat16 else {}
        if B == 16:  # a check per config: the float64 reference on the first cache
            k, v, pt = caches[0]
            paged_attention(q, k, v, pt, sl, cu, 1, plan=plan, out=out, **sc)
            ref, _ = paged_attention_ref(q, k, v, pt, sl, cu, **sc)
            err = (out.double() - ref).abs().max().item()
        else:
            err = float("nan")
        fns = [lambda c=c: paged_attention(q, c[0], c[1], c[2], sl, cu, 1, plan=plan, out=out, validate=False, **sc)
               for c in caches]
        return time_graph_ms(fns) * 1e3, err

    if args.bf16:
        cells = []
        for B, L in shapes:
            us, err = run(B, L, torch.bfloat16)
            cells.append(f"B{B}xL{L} {us:.1f}us" + (f" err {err:.1e}" if err == err else ""))
        print("bf16 | " + " | ".join(cells), flush=True)
    for n, terms, s16, st in itertools.product(*[[int(x) for x in a.split(",")] for a in (
            args.consumers, args.terms, args.stages16, args.stages)]):
        schedule.FP8_CONSUMERS = n
        paged_ws.FP8_Q_TERMS_BF16, paged_ws.FP8_STAGES16 = terms, s16
        schedule.FP8_STAGES = schedule.FP8_STAGES_MULTI = schedule.FP8_STAGES_PAIR = st
        name = f"fp8 consumers={n} terms={terms} stages={st} stages16={s16}"
        try:
            cells = []
            for B, L in shapes:
                us, err = run(B, L, torch.float8_e4m3fn)
                cells.append(f"B{B}xL{L} {us:.1f}us" + (f" err {err:.1e}" if err == err else ""))
            print(f"{name} | " + " | ".join(cells), flush=True)
        except Exception as e:  # shared memory overflow and the like: reported, not fatal
            print(f"{name}: {type(e).__name__} {str(e)[:150]}", flush=True)


if __name__ == "__main__":
    main()
