"""Where an engine decode step's GPU time goes beyond its main kernel: the kernels of a few batch-1 decode steps
(torch.profiler, CUDA activity) on the Llama-3-8B shape with random weights, per kernel name the count and total
time, and the idle time between consecutive kernels.

    PYTHONPATH=. python bench/lab/engine_step_profile.py [--fmt bf16] [--megakernel 1] [--context 512]
"""
import argparse

import torch

from llmkernels.bench.suites.engine import llama3_8b_config, synthetic_tensors
from llmkernels.engine import LLM, Model, SamplingParams


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fmt", default="bf16")
    ap.add_argument("--megakernel", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()
    cfg = llama3_8b_config(32)
    llm = LLM.from_model(Model(cfg, synthetic_tensors(args.fmt, cfg), "cuda", torch.bfloat16), max_num_seqs=1,
                         max_model_len=args.context + 4 * args.steps + 64, megakernel=bool(args.megakernel))
    llm.capture_graphs([1])
    print(llm.describe(), flush=True)
    ids = torch.randint(0, cfg.vocab_size, (args.context,)).tolist()
    llm.add_request(ids, SamplingParams(temperature=0, max_tokens=3 * args.steps, ignore_eos=True))
    for _ in range(args.steps):  # prefill and warm-up decode steps
        llm.step()
    torch.cuda.synchronize()
    profile_steps(llm, args.steps)


def profile_steps(llm, steps):
    """Print the GPU time per kernel name, the idle time and the largest gaps over ``steps`` of ``llm.step()``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            llm.step()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    by = {}
    for e in ev:
        n, t = by.get(e.name, (0, 0.0))
        by[e.name] = (n + 1, t + e.time_range.elapsed_us())
    span = ev[-1].time_range.end - ev[0].time_range.start
    busy = sum(t for _, t in by.values())
    print(f"{steps} decode steps: GPU span {span:.0f} us ({span / steps:.1f} per step), kernels and "
          f"copies {busy / steps:.1f} us per step, idle {(span - busy) / steps:.1f} us per step")
    for name, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[:15]:
        print(f"  {t / steps:9.1f} us/step  {n / steps:5.1f}x  {name[:90]}")
    gaps = sorted(((b.time_range.start - a.time_range.end), a.name[:40], b.name[:40]) for a, b in zip(ev, ev[1:]))
    print("largest gaps (us, after -> before):")
    for g, a, b in gaps[-8:]:
        print(f"  {g:8.1f}  {a} -> {b}")


if __name__ == "__main__":
    main()
