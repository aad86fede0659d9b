"""One decode-suite shape (GQA 32/8, D 128, page 16, bf16) on the Gluon decode kernel, eagerly, for Nsight Compute:
where the loader and the consumer wait. The fourth call is the one to profile.

    PYTHONPATH=. ncu --clock-control none -k regex:paged_decode_ws --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section SourceCounters -o rep \\
        python bench/lab/decode_ncu.py B L [STAGES [LEAD]]
    ncu --import rep.ncu-rep --page source --csv --print-source sass > sass.csv

STAGES: ring slots of 64 keys (paged_ws.STAGES); LEAD: paged_ws.KV_LEAD.
"""
import sys

import torch

import llmkernels.attention.paged_ws as W
from llmkernels.attention import paged_attention, plan_paged_attention
from llmkernels.bench.suites import decode as dec


def main():
    B, L = int(sys.argv[1]), int(sys.argv[2])
    if len(sys.argv) > 3:
        W.STAGES = int(sys.argv[3])
    if len(sys.argv) > 4:
        W.KV_LEAD = int(sys.argv[4])
    k, v, pt = dec._cache(B, L, 16, torch.bfloat16)
    cu = torch.arange(B + 1, dtype=torch.int32)
    sl = torch.full((B,), L, dtype=torch.int32)
    plan = plan_paged_attention(cu, sl, 16, dec.HQ, dec.HKV, dec.D, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
                                device="cuda")
    q = torch.randn(B, dec.HQ, dec.D, device="cuda", dtype=torch.bfloat16)
    cu, sl = cu.cuda(), sl.cuda()
    for _ in range(5):
        paged_attention(q, k, v, pt, sl, cu, 1, plan=plan, validate=False)
    torch.cuda.synchronize()
    print(plan.describe())


if __name__ == "__main__":
    main()
