"""Where a decode step's time goes: kernel times of CUDA-graph decode steps.

    python tools/profile_decode.py [fmt] [batch] [layers]     # synthetic Llama-3-8B shape, e.g. q4_k 1 32
    python tools/profile_decode.py FAMILY [batch]             # a families-suite model, e.g. qwen3-30b-a3b 1
    python tools/profile_decode.py tpN [batch] [70b]          # the tp suite's q4_k_m file on N GPUs (rank 0's kernels)
"""
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from llmkernels.bench.suites.engine import llama3_8b_config, synthetic_model
from llmkernels.bench.suites.families import FAMILIES, _load, family_gguf
from llmkernels.engine import LLM, SamplingParams


def _engine(what: str, batch: int, layers: int, tmp: str):
    if what in FAMILIES:
        return _load(family_gguf(tmp, what), (batch,))
    if what.startswith("tp"):  # rank 0's kernels; an all-reduce's time includes its wait for the other ranks
        from llmkernels.bench.suites.llamacpp import synthetic_gguf

        path = synthetic_gguf(tmp, vocab=True, shape="70b" if layers == 80 else "8b")
        llm = LLM(path, tensor_parallel_size=int(what[2:]), max_num_seqs=max(batch, 1), max_model_len=1024,
                  progress=False)
        llm.capture_graphs([min(1 << (batch - 1).bit_length(), llm.runner.max_graph_batch)], [])
        return llm
    model = synthetic_model(what, llama3_8b_config(layers))
    return LLM.from_model(model, max_num_seqs=max(batch, 1), max_model_len=1024)


def main():
    what = sys.argv[1] if len(sys.argv) > 1 else "q4_k"
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    layers = int(sys.argv[3]) if len(sys.argv) > 3 else 32
    with tempfile.TemporaryDirectory() as tmp:
        llm = _engine(what, batch, layers, tmp)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
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
    launches = sum(n for _, n in rows.values())
    print(f"{what} batch {batch}: {total / 1e3:.3f} ms of kernels per step, {launches} launches")
    for k, (t, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:20]:
        print(f"  {t / 1e3:8.3f} ms  {100 * t / total:5.1f}%  x{n:<4d} {k[:90]}")
    # Wall time per step against kernel time: the difference is launch gaps and host work.
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        llm.step()
    end.record()
    torch.cuda.synchronize()
    print(f"wall {start.elapsed_time(end) / steps:.3f} ms per step")
    llm.close()


if __name__ == "__main__":
    main()
