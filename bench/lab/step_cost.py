"""Where the time to first token goes on the synthetic Llama-3-8B-shaped q4_k_m model: a cold 2048-token prompt,
the same prompt with 2000 tokens in the prefix cache, and a 48-token prompt, over three rounds (the first
compiles), with and without CUDA graphs; a per-phase breakdown of the cached case (request, schedule, input packing,
the step's launch and its GPU work, sampling); then the same requests through the HTTP server.

    python bench/lab/step_cost.py
"""
import asyncio
import random
import socket
import threading
import time
from collections import defaultdict

import torch

from llmkernels.bench.suites.engine import llama3_8b_config, synthetic_model
from llmkernels.engine import LLM, SamplingParams
from llmkernels.engine import llm as llm_mod

llm = LLM.from_model(synthetic_model("q4_k_m", llama3_8b_config()), max_num_seqs=64, max_model_len=4096)
rng = random.Random(0)
PARAMS = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
parts = defaultdict(float)


def timed(name, fn, sync=False):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        out = fn(*a, **kw)
        if sync:
            torch.cuda.synchronize()
        parts[name] += time.perf_counter() - t
        return out
    return wrapper


llm.add_request = timed("add_request", llm.add_request)
llm.scheduler.schedule = timed("schedule", llm.scheduler.schedule)
llm.runner.prepare = timed("prepare", llm.runner.prepare)
llm.runner.run = timed("run + GPU", llm.runner.run, sync=True)
llm_mod.sample_tokens = timed("sample", llm_mod.sample_tokens, sync=True)


def rand(n):
    return [rng.randrange(1000, 120000) for _ in range(n)]


def ttft(ids):
    torch.cuda.synchronize()
    parts.clear()
    t = time.perf_counter()
    llm.generate([ids], PARAMS, use_tqdm=False)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def rounds(label):
    for rnd in range(3):
        ids = rand(2048)
        cold = ttft(ids)
        warm = ttft(ids[:2000] + rand(48))
        cached = dict(parts)
        short = ttft(rand(48))
        print(f"{label} round {rnd}: cold 2048 {cold:.1f} ms, cached 2000 + 48 new {warm:.1f} ms, 48-token prompt "
              f"{short:.1f} ms; cached parts: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in cached.items()),
              flush=True)


llm.runner.use_graphs = False
rounds("eager")
llm.runner.use_graphs = True
llm.capture_graphs(sizes=[1], extend_sizes=None)
rounds("graphs")


def http_ttft(url, ids):
    async def go():
        import httpx

        async with httpx.AsyncClient(timeout=600) as client:
            t = time.perf_counter()
            body = {"model": "m", "prompt": ids, "max_tokens": 1, "temperature": 0, "stream": True, "ignore_eos": True}
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        return (time.perf_counter() - t) * 1e3
    return asyncio.run(go())


import uvicorn  # noqa: E402

from llmkernels.server import build_app  # noqa: E402

sock = socket.socket()
sock.bind(("127.0.0.1", 0))
srv = uvicorn.Server(uvicorn.Config(build_app(llm, model_name="m"), log_level="warning"))
threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True).start()
while not srv.started:
    time.sleep(0.05)
url = f"http://127.0.0.1:{sock.getsockname()[1]}"
for rnd in range(3):
    ids = rand(2048)
    cold = http_ttft(url, ids)
    parts.clear()
    warm = http_ttft(url, ids[:2000] + rand(48))
    cached = dict(parts)
    short = http_ttft(url, rand(48))
    print(f"HTTP round {rnd}: cold 2048 {cold:.1f} ms, cached 2000 + 48 new {warm:.1f} ms, 48-token prompt "
          f"{short:.1f} ms; engine parts of the cached one: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in cached.items()),
          flush=True)
srv.should_exit = True
