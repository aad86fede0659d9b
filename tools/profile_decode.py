"""Where a decode step's time goes: kernel times of CUDA-graph decode steps of a synthetic Llama-3-8B-shaped model.

    python tools/profile_decode.py [fmt] [batch] [layers]     # e.g. q4_k 1 32
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from llmkernels.bench.suites.engine import llama3_8b_config, synthetic_model
from llmkernels.engine import LLM, SamplingParams


def main():
    fmt = sys.argv[1] if len(sys.argv) > 1 else "q4_k"
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    layers = int(sys.argv[3]) if len(sys.argv) > 3 else 32
    model = synthetic_model(fmt, llama3_8b_config(layers))
    llm = LLM.from_model(model, max_num_seqs=max(batch, 1), max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for _ in range(batch):
        llm.add_request(list(range(1, 513)), params)
    for _ in range(20):  # prefill, graph capture, warm-up
        llm.step()
    torch.cuda.synchronize()
    steps = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.step()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.key_averages():
        if e.device_type.name != "CUDA":
            continue
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        rows[e.key] = (t / steps, e.count // steps)
    total = sum(t for t, _ in rows.values())
    print(f"{fmt} batch {batch}, {layers} layers: {total / 1e3:.3f} ms of kernels per step")
    for k, (t, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:14]:
        print(f"  {t / 1e3:8.3f} ms  {100 * t / total:5.1f}%  x{n:<4d} {k[:90]}")


if __name__ == "__main__":
    main()
