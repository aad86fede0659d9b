"""Where a one-kernel step of a given size stops: eager launches one by one (each synchronized, its time and error
flag printed), then launches on a side stream, then a CUDA graph's capture and replays, with Python's stacks
dumped every ``--dump-every`` seconds so a wait that never ends shows where it is.

    PYTHONPATH=.:bench/lab python bench/lab/fast_probe.py [--fmt bf16] [--layers 32] [--batch 1] [--hold 1]
                                                          [--warps 4] [--spin 16] [--context 512]
                                                          [--time] [--engine]
"""
import argparse
import faulthandler
import sys
import time

import torch

from llmkernels.bench.suites.engine import llama3_8b_config, synthetic_tensors
from llmkernels.engine.config import rope_inv_freq
from llmkernels.megakernel import build_decode_program
from llmkernels.megakernel.fast import FastStep
from megakernel_fast import step_inputs, trace_summary


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fmt", default="bf16")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--hold", type=int, default=1)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--spin", type=int, default=16, help="spin limit 2^spin")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--eager", type=int, default=3)
    ap.add_argument("--splits", type=int, default=0, help="key splits per KV head (0: the schedule's)")
    ap.add_argument("--measured-schedule", action="store_true", help="schedule for the measured read bandwidth, as "
                    "megakernel_fast.py does (default: build_decode_program's)")
    ap.add_argument("--trace", action="store_true", help="then a traced step: where each SM's time goes")
    ap.add_argument("--mma", type=int, default=-1, help="batch > 1: FastStep's batch_mma (1 tensor cores, 0 CUDA "
                    "cores, -1 its default)")
    ap.add_argument("--stages", type=int, default=0, help="ring slots (0: FastStep's default)")
    ap.add_argument("--kv-ring", type=int, default=-1, help="FastStep kv_ring: ATTN's cp.async ring in blocks of 32 "
                    "keys (-1: the default)")
    ap.add_argument("--diag", type=int, default=0, help="FastStep diag (timing only, wrong results): 4 no cached key "
                    "read, 5 no block computed either")
    ap.add_argument("--resid16", action="store_true", help="batch > 1: FastStep(resid16=True), the normed products "
                    "staged from the residual's bf16 copy")
    ap.add_argument("--dump-every", type=float, default=20.0)
    ap.add_argument("--time", action="store_true", help="then the step's time per replay and the bound's share")
    ap.add_argument("--engine", action="store_true", help="then the engine's kernel-per-op rate at this batch")
    args = ap.parse_args()
    faulthandler.dump_traceback_later(args.dump_every, repeat=True, file=sys.stdout)
    cfg = llama3_8b_config(args.layers)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    B, context = args.batch, args.context
    tensors = synthetic_tensors(args.fmt, cfg)
    extra = {}
    if args.measured_schedule:
        from llmkernels.bench.harness import measure_read_bandwidth

        extra["bandwidth"] = measure_read_bandwidth() * 1e12
    prog = build_decode_program(cfg, args.fmt, batch=B, context=context, num_sms=sms,
                                num_splits=args.splits or None, **extra)
    kc, vc, table, ids, lens = step_inputs(cfg, B, context)
    inv, _ = rope_inv_freq(cfg)
    mma = dict(batch_mma=None if args.mma < 0 else bool(args.mma), resid16=args.resid16) if B > 1 else {}
    fast = FastStep.from_tensors(prog, cfg, tensors, kc, vc, inv.cuda(), warps=args.warps, hold=args.hold,
                                 spin_limit=1 << args.spin,
                                 stages=args.stages or None, diag=args.diag,
                                 kv_ring=None if args.kv_ring < 0 else args.kv_ring, **mma)
    print(f"{args.fmt} {args.layers} layers batch {B} hold {args.hold} warps {args.warps}"
          f"{', tensor cores' if fast.bmma else ''}: "
          f"{len(prog.counter_names)} counters, {sum(len(x) for x in prog.lists)} instructions", flush=True)

    def step(tag):
        t = time.perf_counter()
        fast.launch(ids, lens, table)
        torch.cuda.synchronize()
        print(f"  {tag}: {1e3 * (time.perf_counter() - t):.1f} ms, error {fast.error()}, counters nonzero after: "
              f"{int((fast.counters != 0).sum())}, aux {fast.aux.tolist()}", flush=True)
        fast.clear_error()

    for i in range(args.eager):
        step(f"eager {i}")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step("side stream")
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        fast.launch(ids, lens, table)
    print("  captured", flush=True)
    for i in range(3):
        t = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        print(f"  replay {i}: {1e3 * (time.perf_counter() - t):.2f} ms, error {fast.error()}", flush=True)
    if args.time:
        from llmkernels.bench.harness import measure_read_bandwidth

        bw = measure_read_bandwidth() * 1e12
        n = 20
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            g.replay()
        end.record()
        end.synchronize()
        us = start.elapsed_time(end) * 1e3 / n
        print(f"  step {us:.1f} us ({B / us * 1e6:.1f} tokens/s), {100 * prog.weight_bytes / bw / (us * 1e-6):.1f}% of "
              f"the weight-bandwidth bound ({prog.weight_bytes / 1e9:.2f} GB at {bw / 1e12:.2f} TB/s), error "
              f"{fast.error()}", flush=True)
    if args.trace:
        traced = FastStep(prog, cfg, fast.stacks, fast.emb, fast.norms, fast.onorm, inv, kc, vc, warps=args.warps,
                          hold=args.hold, spin_limit=1 << args.spin, stages=args.stages or None, trace=True,
                          **mma)
        traced(ids, lens, table)
        traced(ids, lens, table)
        torch.cuda.synchronize()
        print("  " + trace_summary(prog, traced.trace), flush=True)
        del traced
    if args.engine:
        from megakernel_step import engine_rate

        del fast, g
        torch.cuda.empty_cache()
        rate = engine_rate(cfg, tensors, context, act_int8=args.fmt == "q4_k", megakernel=False, batch=B)
        print(f"  engine, kernel per op, batch {B}: {rate:.1f} tokens/s ({B / rate * 1e6:.1f} us per step)",
              flush=True)
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
