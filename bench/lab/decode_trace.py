"""Where a short bf16 decode call's time goes, per program: the Gluon decode kernel's TRACE timestamps (consumer
start, first K tile in, consumer end, loader's last copy) in the decode suite's timing (CUDA-graph replays over
L2-overflowing copies; the last call of the last replay is read). GQA 32/8, D 128, page 16.

    PYTHONPATH=. python bench/lab/decode_trace.py [LEAD/STAGES[/PDL] ...]     # e.g. -1/4 1/3 1/3/2
"""
import sys

import numpy as np
import torch

import llmkernels.attention.paged as PG
import llmkernels.attention.paged_ws as W
from llmkernels.bench.harness import measure_read_bandwidth
from llmkernels.bench.suites import decode as dec

SHAPES = [(1, 32768), (16, 4096), (64, 1024)]


def main():
    variants = [tuple(int(x) for x in a.split("/")) for a in sys.argv[1:]] or [(-1, 4), (1, 3)]
    dec._sdpa_graph_ms = lambda q, kvs: None
    bw = measure_read_bandwidth()
    print(f"read bandwidth {bw:.3f} TB/s", flush=True)
    ctx = type("C", (), {"bw_pct": lambda self, t: 100 * t / bw})()
    trace = torch.zeros(4096, 4, dtype=torch.int64, device="cuda")
    launch = W.launch_decode_ws
    W.launch_decode_ws = lambda *a, **k: launch(*a, **k, trace=trace)
    for v in variants:
        lead, stages, pdl = v + (1,)[len(v) - 2:]
        W.KV_LEAD, PG.WS_PDL = lead, pdl
        W.STAGES = W.STAGES_LEAD = W.STAGES_D256 = stages
        for B, L in SHAPES:
            trace.zero_()
            row = dec._case(ctx, B, L, 16, torch.bfloat16)()
            torch.cuda.synchronize()
            t = trace[:132].cpu().numpy().astype(np.float64)
            busy = t[:, 2] - t[:, 1] > 1e3  # programs that had a unit (the others record no wait)
            t0 = t[:, 0].min()
            t = (t - t0) / 1e3  # us from the first program's start
            s, f, e, ld = t[busy, 0], t[busy, 1], t[busy, 2], t[busy, 3]
            q = lambda x: "/".join(f"{v:.1f}" for v in np.percentile(x, [0, 50, 100]))
            print(f"{'/'.join(map(str, v))} B{B} L{L}: {row.note.split(',')[0]} {row.roofline_pct:.1f}%, "
                  f"{busy.sum()} busy programs (min/median/max, us from the first start): start {q(s)}, "
                  f"first K {q(f)}, loader done {q(ld)}, end {q(e)}; mean end {e.mean():.1f}", flush=True)


if __name__ == "__main__":
    main()
