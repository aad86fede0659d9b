"""bf16 decode-suite shapes (GQA 32/8, D 128, page 16) with the loader's V copies LEAD tiles behind K (paged_ws's
LEAD; -1: a slot refilled once both halves are read), other ring depths and PDL modes (paged.WS_PDL), timed as the
decode suite times them (its _case: CUDA-graph replays over L2-overflowing copies). Each variant runs every shape
twice, with the first variant in between, so drift between variants shows.

    PYTHONPATH=. python bench/lab/decode_lead_lab.py [LEAD/STAGES[/PDL[/BAL]] ...]     # e.g. -1/4 1/3 1/3/2 1/3/1/1

BAL 1 forces the plan's balanced split (plan.BALANCE_MIN_SKEW 0: equal key-tile ranges per SM, cut units merged in
the kernel) where the plan would take the units; 0 (default) leaves the plan's choice.

STAGES sets every 16-bit ring depth (paged_ws's STAGES, STAGES_LEAD, STAGES_D256; the launcher raises fewer than
three to three). ``--d256``: Gemma-2-9B's
attention shape instead (GQA 16/8, D 256).
"""
import sys

import torch

import llmkernels.attention.paged as PG
import llmkernels.attention.plan as PL
import llmkernels.attention.paged_ws as W
from llmkernels.bench.harness import measure_read_bandwidth
from llmkernels.bench.suites import decode as dec

SKEW = PL.BALANCE_MIN_SKEW
SHAPES = [(1, 32768), (16, 4096), (64, 1024), (64, 8192), (128, 2048)]


def run(ctx, B, L, lead, stages, pdl=1, bal=0):
    W.KV_LEAD, PG.WS_PDL = lead, pdl
    PL.BALANCE_MIN_SKEW = 0.0 if bal else SKEW
    W.STAGES = W.STAGES_LEAD = W.STAGES_D256 = stages
    try:
        row = dec._case(ctx, B, L, 16, torch.bfloat16)()
        return row.roofline_pct, row.note.split(",")[0]
    except Exception as e:  # noqa: BLE001 - a lab: print and go on
        return float("nan"), f"ERR {type(e).__name__} {str(e)[:120]}"


def main():
    if "--d256" in sys.argv:
        dec.HQ, dec.HKV, dec.D = 16, 8, 256
    args = [a for a in sys.argv[1:] if a != "--d256"]
    variants = [tuple(int(x) for x in a.split("/")) for a in args] or [(-1, 4), (1, 3), (1, 4)]
    dec._sdpa_graph_ms = lambda q, kvs: None  # the anchors are the decode suite's; here only our variants
    bw = measure_read_bandwidth()
    print(f"read bandwidth {bw:.3f} TB/s", flush=True)
    ctx = type("C", (), {"bw_pct": lambda self, t: 100 * t / bw})()
    base = variants[0]
    table = {}
    for v in variants:
        for B, L in SHAPES:
            got = [run(ctx, B, L, *v)]
            if v != base:
                table.setdefault((base, B, L), []).append(run(ctx, B, L, *base))
            got.append(run(ctx, B, L, *v))
            table.setdefault((v, B, L), []).extend(got)
            print(f"{'/'.join(map(str, v)):10s} B{B} L{L}: " + " / ".join(f"{p:.1f}% ({n})" for p, n in got),
                  flush=True)
    print("\nLEAD/STAGES[/PDL[/BAL]]: % of read bandwidth, median of the runs (B1 L32768 / B16 L4096 / B64 L1024 / "
          "B64 L8192 / B128 L2048)")
    for v in variants:
        meds = []
        for B, L in SHAPES:
            xs = sorted(p for p, _ in table[(v, B, L)])
            meds.append(xs[len(xs) // 2])
        print(f"{'/'.join(map(str, v)):10s}: " + " / ".join(f"{m:.1f}" for m in meds))


if __name__ == "__main__":
    main()
