"""Suite ``serve``: the OpenAI-compatible server under load, beside llama.cpp's ``llama-server`` on the same GGUF.

The engine suite's Llama-3-8B-shaped synthetic model (random weights, llama.cpp's Q4_K_M mix) is written to one GGUF
with a synthetic byte-level BPE vocabulary of 128256 tokens that both servers read, and each server is started on
it as a separate process. The load: a fixed seeded set of requests (prompt 128-2048 tokens, a quarter of them
starting with one of four shared 512-token prefixes as a system prompt would; 64-512 new tokens, EOS ignored) sent
as token ids to ``/v1/completions`` with streaming, arrivals Poisson, at most ``CONCURRENCY`` in flight. Reported per
server: output tokens/s (the row's value; llama-server's is the anchor), requests/s, time to first token and time per
output token (p50/p99), and our prefix-cache hit rate.

Two more rows, ours only: the server's overhead at batch 64 (decode tokens/s of 64 concurrent streams through HTTP
against the same 64 requests run by ``LLM`` in-process), and time to first token of a 2048-token prompt whose first
2000 tokens are cached, against the same prompt cold.

llama.cpp is not part of llmkernels: ``--llama-cpp DIR`` (or ``$LLMK_LLAMA_CPP``) names a build holding
``llama-server``. Without one, only our rows are measured.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time

from ..harness import Row

CONCURRENCY = 64
NUM_REQUESTS = 192
ARRIVAL_RATE = 32.0  # requests per second (Poisson), enough to keep CONCURRENCY in flight
PROMPT_RANGE = (128, 2048)
OUTPUT_RANGE = (64, 512)
SHARED_PREFIX = 512
VOCAB = 128256
LOAD_TIME_LIMIT_S = 240.0  # a server that takes longer is reported with what it finished


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def workload(seed: int = 0, n: int = NUM_REQUESTS) -> list:
    """[(arrival offset s, prompt token ids, max_tokens)], the same for every server."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000, VOCAB - 256) for _ in range(SHARED_PREFIX)] for _ in range(4)]
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(ARRIVAL_RATE)
        length = rng.randint(*PROMPT_RANGE)
        ids = [rng.randrange(1000, VOCAB - 256) for _ in range(length)]
        if rng.random() < 0.25 and length > SHARED_PREFIX:
            ids[:SHARED_PREFIX] = rng.choice(prefixes)
        out.append((t, ids, rng.randint(*OUTPUT_RANGE)))
    return out


async def _one(client, url, model, ids, max_tokens, t0, arrival, sem, rec):
    import httpx

    await asyncio.sleep(max(0.0, t0 + arrival - time.perf_counter()))
    async with sem:
        body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        first, last, n, cached = None, None, 0, 0
        try:
            async with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
                if r.status_code != 200:
                    rec.append({"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"})
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    c = json.loads(line[6:])
                    if any(ch.get("text") for ch in c.get("choices") or ()):  # a finish-only chunk adds no token
                        now = time.perf_counter()
                        first = first or now
                        last = now
                        n += 1
                    u = c.get("usage")
                    if u:
                        n = u.get("completion_tokens") or n
                        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            rec.append({"error": repr(e)})
            return
        rec.append({"start": start, "first": first, "last": last, "tokens": n, "prompt": len(ids), "cached": cached,
                    "want": max_tokens})


async def run_load(url: str, model: str, reqs: list, concurrency: int = CONCURRENCY,
                   time_limit: float = LOAD_TIME_LIMIT_S) -> dict:
    """Send ``reqs`` (see ``workload``) with at most ``concurrency`` in flight; returns the summary figures. After
    ``time_limit`` seconds the requests still open are cancelled and counted as errors."""
    import httpx

    sem = asyncio.Semaphore(concurrency)
    rec: list = []
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(_one(client, url, model, ids, mt, t0, at, sem, rec)) for at, ids, mt in reqs]
        _, late = await asyncio.wait(tasks, timeout=time_limit)
        for t in late:
            t.cancel()
        rec += [{"error": f"not done after {time_limit:.0f} s"}] * len(late)
        wall = time.perf_counter() - t0
    errors = [r["error"] for r in rec if "error" in r]
    ok = [r for r in rec if "error" not in r and r["first"] is not None]
    ttft = sorted(r["first"] - r["start"] for r in ok)
    tpot = sorted((r["last"] - r["first"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1)
    pct = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")  # noqa: E731
    out_tokens = sum(r["tokens"] for r in ok)
    return {"wall_s": wall, "output_tok_s": out_tokens / wall, "req_s": len(ok) / wall, "requests": len(ok),
            "errors": errors[:3], "num_errors": len(errors), "short": sum(r["tokens"] < r["want"] for r in ok),
            "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99), "tpot_p50": pct(tpot, 0.5),
            "tpot_p99": pct(tpot, 0.99),
            "cache_hit": sum(r["cached"] for r in ok) / max(1, sum(r["prompt"] for r in ok))}


def decode_window_rate(recs_url: str, model: str, n: int = 64, prompt: int = 512, gen: int = 256, seed: int = 1):
    """Decode tokens/s of ``n`` concurrent streams of equal shape, counted while all of them decode."""
    rng = random.Random(seed)
    reqs = [(0.0, [rng.randrange(1000, VOCAB - 256) for _ in range(prompt)], gen) for _ in range(n)]

    async def go():
        import httpx

        times: list = [[] for _ in range(n)]

        async def one(i, ids):
            body = {"model": model, "prompt": ids, "max_tokens": gen, "temperature": 0, "stream": True,
                    "ignore_eos": True}
            async with client.stream("POST", recs_url + "/v1/completions", json=body, timeout=600) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"choices": []' not in line:
                        times[i].append(time.perf_counter())

        limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
        async with httpx.AsyncClient(limits=limits, timeout=600) as client:
            await asyncio.gather(*[one(i, ids) for i, (_, ids, _) in enumerate(reqs)])
        lo = max(t[0] for t in times)
        hi = min(t[-1] for t in times)
        inside = sum(1 for t in times for x in t if lo < x <= hi)
        return inside / (hi - lo) if hi > lo else float("nan")

    return asyncio.run(go())


def _wait_healthy(url: str, proc, timeout: float = 300) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {_tail(proc.log)}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("server did not become healthy")


def _tail(f, n: int = 2000) -> str:
    f.flush()
    f.seek(0)
    return f.read()[-n:]


class _Proc:
    """A server process whose output goes to a file: a pipe nobody reads fills up and stalls a server that logs."""

    def __init__(self, cmd, env=None):
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env)
        self.proc.log = self.log

    def __enter__(self):
        return self.proc

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def _ttft_of(url, model, ids) -> float:
    async def go():
        import httpx

        async with httpx.AsyncClient(timeout=600) as client:
            t = time.perf_counter()
            body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0, "stream": True,
                    "ignore_eos": True}
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        return time.perf_counter() - t
        return float("nan")
    return asyncio.run(go())


def _ours(path: str, reqs: list) -> tuple[dict, float, tuple[float, float]]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "llmkernels", "serve", path, "--port", str(port), "--served-model-name", "m",
           "--max-num-seqs", str(CONCURRENCY), "--max-model-len", str(PROMPT_RANGE[1] + OUTPUT_RANGE[1] + 64),
           "--log-level", "warning"]
    with _Proc(cmd) as proc:
        _wait_healthy(url, proc)
        idle = _cached_ttft(url, seed=7)
        asyncio.run(run_load(url, "m", reqs[:16], 16))  # warm-up
        load = asyncio.run(run_load(url, "m", reqs))
        window = decode_window_rate(url, "m")
        after = _cached_ttft(url, seed=8)  # other prompts than the idle round's, which may still be cached
    return load, window, idle, after


def _metric(url: str, name: str) -> float:
    import httpx

    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


def _cached_ttft(url: str, seed: int) -> dict:
    """Time to first token of a 2048-token prompt cold, and of one whose first 2000 tokens (125 pages) are cached
    (the second of two rounds), with the engine steps and CUDA-graph steps the cached request took."""
    rng = random.Random(seed)
    rand = lambda n: [rng.randrange(1000, VOCAB - 256) for _ in range(n)]  # noqa: E731
    for _ in range(2):
        cold = _ttft_of(url, "m", rand(2048))
        ids = rand(2048)
        _ttft_of(url, "m", ids)  # puts its first 2000 tokens in the cache
        running = _metric(url, "llmkernels_num_requests_running")
        steps, graphs = _metric(url, "llmkernels_engine_steps_total"), _metric(url, "llmkernels_engine_graph_steps_total")
        warm = _ttft_of(url, "m", ids[:2000] + rand(48))
        steps = _metric(url, "llmkernels_engine_steps_total") - steps
        graphs = _metric(url, "llmkernels_engine_graph_steps_total") - graphs
    return {"cold": cold, "warm": warm, "steps": steps, "graph_steps": graphs, "running_before": running}


def _engine_window(path: str, n: int = 64, prompt: int = 512, gen: int = 256, seed: int = 1) -> float:
    """The same measurement as ``decode_window_rate`` with LLM in-process (no HTTP): decode tokens/s while all n
    sequences decode."""
    import torch

    from ...engine import LLM, SamplingParams

    llm = LLM(path, max_num_seqs=CONCURRENCY, max_model_len=PROMPT_RANGE[1] + OUTPUT_RANGE[1] + 64, progress=False)
    llm.capture_graphs()
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
    for rep in range(2):  # the first run warms up
        seqs = [llm.add_request([rng.randrange(1000, VOCAB - 256) for _ in range(prompt)], params) for _ in range(n)]
        while any(not s.out_ids for s in seqs):
            llm.step()
        torch.cuda.synchronize()
        t0, before = time.perf_counter(), sum(len(s.out_ids) for s in seqs)
        while all(s.finish_reason is None for s in seqs):
            llm.step()
        torch.cuda.synchronize()
        rate = (sum(len(s.out_ids) for s in seqs) - before) / (time.perf_counter() - t0)
        while llm.scheduler.has_work():
            llm.step()
    del llm
    return rate


def _llama_server(bin_dir: str, path: str, reqs: list) -> dict:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    ctx = CONCURRENCY * (PROMPT_RANGE[1] + OUTPUT_RANGE[1] + 64)
    cmd = [os.path.join(bin_dir, "llama-server"), "-m", path, "-ngl", "99", "-fa", "on", "-c", str(ctx),
           "-np", str(CONCURRENCY), "-b", "2048", "-ub", "512", "--host", "127.0.0.1", "--port", str(port),
           "--alias", "m"]
    with _Proc(cmd) as proc:
        _wait_healthy(url, proc)
        asyncio.run(run_load(url, "m", reqs[:16], 16))  # warm-up
        return asyncio.run(run_load(url, "m", reqs))


def _ttft_note(d: dict) -> str:
    return (f"TTFT {d['warm'] * 1e3:.1f} ms cached vs {d['cold'] * 1e3:.1f} ms cold ({d['cold'] / d['warm']:.1f}x "
            f"sooner; the cached request took {d['steps']:.0f} steps, {d['graph_steps']:.0f} as CUDA graphs, "
            f"{d['running_before']:.0f} sequences running before it)")


def _note(d: dict) -> str:
    return (f"{d['requests']} requests in {d['wall_s']:.1f} s ({d['req_s']:.2f} req/s), TTFT p50/p99 "
            f"{d['ttft_p50'] * 1e3:.0f}/{d['ttft_p99'] * 1e3:.0f} ms, TPOT p50/p99 {d['tpot_p50'] * 1e3:.1f}/"
            f"{d['tpot_p99'] * 1e3:.1f} ms, prefix-cache hit {d['cache_hit'] * 100:.1f}% of prompt tokens"
            + (f", {d['num_errors']} errors: {d['errors']}" if d["num_errors"] else "")
            + (f", {d['short']} short" if d["short"] else ""))


def _case(ctx, bin_dir):
    def run():
        from .llamacpp import synthetic_gguf

        reqs = workload()
        with tempfile.TemporaryDirectory() as tmp:
            path = synthetic_gguf(tmp, vocab=True)
            engine_rate = _engine_window(path)
            print(f"\n[serve] LLM in-process, batch 64: {engine_rate:.0f} tokens/s", flush=True)
            ours, window, idle, after = _ours(path, reqs)
            print(f"[serve] ours: {ours['output_tok_s']:.0f} output tokens/s; {_note(ours)}; batch 64 through HTTP "
                  f"{window:.0f} tokens/s; cached-prefix TTFT idle: {_ttft_note(idle)}; after the load: "
                  f"{_ttft_note(after)}", flush=True)
            peer, peer_error = None, ""
            if bin_dir:
                try:
                    peer = _llama_server(bin_dir, path, reqs)
                    print(f"[serve] llama-server: {peer['output_tok_s']:.0f} output tokens/s; {_note(peer)}",
                          flush=True)
                except (RuntimeError, OSError) as e:
                    peer_error = f"; llama-server failed: {e}"
        label = (f"llama3-8b q4_k_m, {NUM_REQUESTS} requests, {CONCURRENCY} concurrent, prompts {PROMPT_RANGE[0]}-"
                 f"{PROMPT_RANGE[1]}, outputs {OUTPUT_RANGE[0]}-{OUTPUT_RANGE[1]}")
        anchors = {"llama-server": peer["output_tok_s"]} if peer else {}
        r = Row("serve", f"{label}: output tokens/s", "tokens/s", ours["output_tok_s"], None, anchors)
        r.note = "ours: " + _note(ours) + (f"; llama-server: {_note(peer)}; ratio "
                                           f"{ours['output_tok_s'] / peer['output_tok_s']:.2f}x" if peer else "")
        r.note += peer_error
        w = Row("serve", "batch 64 decode through HTTP (prompt 512, 256 new)", "tokens/s", window, None,
                {"LLM in-process": engine_rate})
        w.note = f"server overhead {(1 - window / engine_rate) * 100:.1f}% of the in-process decode rate"
        p = Row("serve", "time to first token, 2048-token prompt, 2000 cached", "tokens/s", 2048 / idle["warm"],
                None, {"same prompt cold": 2048 / idle["cold"]})
        p.note = f"server idle: {_ttft_note(idle)}; right after the load test: {_ttft_note(after)}"
        return [r, w, p]
    return run


def cases(ctx):
    bin_dir = getattr(ctx, "llama_cpp", None) or os.environ.get("LLMK_LLAMA_CPP")
    return [("serve q4_k_m", _case(ctx, bin_dir))]
