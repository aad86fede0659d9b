"""The one-kernel step at 8 and 16 compute warps on a few Llama-3-8B-shaped q4_k layers: both run to the end (a
short spin limit, so a schedule that cannot finish reports instead of spinning), their logits agree, the time per
step of each, and with ``trace`` where each SM's time goes at each width (megakernel_fast.trace_summary).

    PYTHONPATH=.:bench/lab python bench/lab/fast_warps_check.py [--layers 4] [--context 512] [--hold 1]
                                                                [--warps 8,16] [--trace]
"""
import argparse
import functools

import torch

from llmkernels.bench.harness import time_graph_ms
from llmkernels.bench.suites.engine import llama3_8b_config, synthetic_tensors
from llmkernels.engine.config import rope_inv_freq
from llmkernels.megakernel import build_decode_program
from llmkernels.megakernel.fast import FastStep
from megakernel_fast import step_inputs, trace_summary


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--hold", type=int, default=1, help="FastStep's hold")
    ap.add_argument("--warps", default="8,16", help="comma-separated compute warps; the first is the reference")
    ap.add_argument("--trace", action="store_true")
    args = ap.parse_args()
    layers, context, trace = args.layers, args.context, args.trace
    widths = [int(w) for w in args.warps.split(",")]
    cfg = llama3_8b_config(layers)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tensors = synthetic_tensors("q4_k", cfg)
    prog = build_decode_program(cfg, "q4_k", batch=1, context=context, num_sms=sms)
    kc, vc, table, ids, lens = step_inputs(cfg, 1, context)
    inv, _ = rope_inv_freq(cfg)
    out = {}
    base = None
    for w in widths:
        kw = dict(warps=w, stages=16, spin_limit=1 << 16, hold=args.hold)
        if base is None:
            fast = base = FastStep.from_tensors(prog, cfg, tensors, kc.clone(), vc.clone(), inv.cuda(), **kw)
        else:
            fast = FastStep(prog, cfg, base.stacks, base.emb, base.norms, base.onorm, inv, kc.clone(), vc.clone(), **kw)
        fast.launch(ids, lens, table)
        torch.cuda.synchronize()
        print(f"{w} warps: first step done, error: {fast.error()}", flush=True)
        out[w] = fast.logits.clone()
        ms = time_graph_ms([functools.partial(fast.launch, ids, lens, table)], reps=10)
        print(f"{w} warps, {layers} layers, context {context}: {ms * 1e3:.1f} us per step, error {fast.error()}",
              flush=True)
        if trace:
            traced = FastStep(prog, cfg, base.stacks, base.emb, base.norms, base.onorm, inv, kc.clone(), vc.clone(),
                              trace=True, **kw)
            traced(ids, lens, table)
            traced(ids, lens, table)
            torch.cuda.synchronize()
            print(f"{w} warps: " + trace_summary(prog, traced.trace), flush=True)
    ref = out[widths[0]]
    for w in widths[1:]:
        e = ((out[w] - ref).abs().max() / ref.abs().max()).item()
        print(f"{w} against {widths[0]} warps: {e:.2e} of the largest logit, argmax {out[w].argmax().item()} / "
              f"{ref.argmax().item()}", flush=True)


if __name__ == "__main__":
    main()
