"""bf16 decode-suite shapes (GQA 32/8, D 128, page 16) under other ring depths, split counts and the balanced
split, timed as the decode suite times them (its _case: CUDA-graph replays over L2-overflowing copies).

    PYTHONPATH=. python bench/lab/decode_ring_lab.py

STAGES: slots of 64 keys (K and V) in paged_ws's ring; "splits N": a fixed num_splits; "balanced": the balanced
split forced (plan.BALANCE_MIN_SKEW = 0).
"""
import torch
from llmkernels.bench.harness import measure_read_bandwidth
from llmkernels.bench.suites import decode as dec
import llmkernels.attention.plan as P
import llmkernels.attention.paged_ws as W
bw = measure_read_bandwidth(); print(f"bw {bw:.3f}", flush=True)
ctx = type("C", (), {"bw_pct": lambda self, t: 100 * t / bw})()
orig = P.plan_paged_attention
def run(B, L, label, splits=None, skew=None, stages=None):
    P.BALANCE_MIN_SKEW = 1.25 if skew is None else skew
    W.STAGES = 4 if stages is None else stages
    if splits is not None:
        dec.plan_paged_attention = lambda *a, **k: orig(*a, **{**k, "num_splits": splits})
    else:
        dec.plan_paged_attention = orig
    try:
        row = dec._case(ctx, B, L, 16, torch.bfloat16)()
        print(f"B{B} L{L} {label}: {row.note} {row.roofline_pct:.1f}%", flush=True)
    except Exception as e:
        print(f"B{B} L{L} {label}: ERR {type(e).__name__} {str(e)[:200]}", flush=True)
for st in (4, 5, 6):
    run(1, 32768, f"st{st} default", stages=st)
    run(16, 4096, f"st{st} default", stages=st)
    run(64, 1024, f"st{st} default", stages=st)
run(1, 32768, "balanced", skew=0.0)
run(16, 4096, "balanced", skew=0.0)
run(64, 1024, "balanced", skew=0.0)
for sp in (8, 12, 15, 17, 24, 32, 33):
    run(1, 32768, f"splits {sp}", splits=sp)
run(16, 4096, "splits 2", splits=2)
run(64, 1024, "splits 2", splits=2)
