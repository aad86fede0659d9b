"""What one eager (not graph-replayed) engine step costs on the synthetic Llama-3-8B-shaped q4_k_m model: time to the
first token of a cold 2048-token prompt, of the same prompt with 2000 tokens in the prefix cache, and of a 48-token
prompt, over three rounds (the first compiles), then the profiler's CUDA and CPU tables of the cached case.

    python bench/lab/step_cost.py
"""
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from llmkernels.bench.suites.engine import llama3_8b_config, synthetic_model
from llmkernels.engine import LLM, SamplingParams

llm = LLM.from_model(synthetic_model("q4_k_m", llama3_8b_config()), max_num_seqs=64, max_model_len=4096)
rng = random.Random(0)
PARAMS = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def rand(n):
    return [rng.randrange(1000, 120000) for _ in range(n)]


def ttft(ids):
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate([ids], PARAMS)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


for rnd in range(3):
    ids = rand(2048)
    cold = ttft(ids)
    warm = ttft(ids[:2000] + rand(48))
    short = ttft(rand(48))
    print(f"round {rnd}: cold 2048 {cold:.1f} ms, cached 2000 + 48 new {warm:.1f} ms, 48-token prompt {short:.1f} ms")
ids = rand(2048)
ttft(ids)
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    ttft(ids[:2000] + rand(48))
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=8, max_name_column_width=70))
