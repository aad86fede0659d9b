"""Suite ``engine``: end-to-end decode and prefill of a synthetic Llama-3-8B-shaped model (random weights built on the
GPU).

Prefill throughput (prompt tokens / time to first token of one 512- or 4096-token request), batch-1 decode tokens/s
after a 512-token prompt, and decode throughput with 16 and 64 such requests, for q4_k,
q8_0 and bf16 weights, and q4_k_m / q5_k_m: the mixes of llama.cpp's Q4_K_M / Q5_K_M files (q6_k for the output
matrix and for attn_v and ffn_down in half of the layers, q4_k / q5_k elsewhere), what users of published files run.
The bound is the measured read bandwidth divided by the weight bytes one decode step must read (every matrix once
plus one embedding row); ``roofline_pct`` is the percent of it. KV-cache reads are left out of the bound (about
0.2% of the weight bytes per sequence at these lengths with q4_k).
"""
from __future__ import annotations

import time

import torch

from ...engine import LLM, Model, ModelConfig, SamplingParams
from ...engine.convert import mix_format
from ...testing.random_weights import random_qtensor
from ..harness import Row

PROMPT, GEN = 512, 128
PREFILL_LENGTHS = (512, 4096)


def llama3_8b_config(layers: int = 32) -> ModelConfig:
    return ModelConfig(arch="llama", n_layers=layers, hidden=4096, ffn=14336, n_heads=32, n_kv_heads=8, head_dim=128,
                       vocab_size=128256, rms_eps=1e-5, rope_theta=500000.0, rope_style="interleaved",
                       context_length=8192, eos_ids=())


def llama3_70b_config() -> ModelConfig:
    return ModelConfig(arch="llama", n_layers=80, hidden=8192, ffn=28672, n_heads=64, n_kv_heads=8, head_dim=128,
                       vocab_size=128256, rms_eps=1e-5, rope_theta=500000.0, rope_style="interleaved",
                       context_length=8192, eos_ids=())


SHAPES = {"8b": llama3_8b_config, "70b": llama3_70b_config}


def synthetic_tensors(fmt: str, cfg: ModelConfig, device="cuda") -> dict:
    """Random weights in ``fmt`` (or a mix such as q4_k_m) under the GGUF names of a llama model."""
    H, D = cfg.hidden, cfg.head_dim
    shapes = {"attn_q": (cfg.n_heads * D, H), "attn_k": (cfg.n_kv_heads * D, H), "attn_v": (cfg.n_kv_heads * D, H),
              "attn_output": (H, cfg.n_heads * D), "ffn_gate": (cfg.ffn, H), "ffn_up": (cfg.ffn, H),
              "ffn_down": (H, cfg.ffn)}
    ones = torch.ones(H, device=device)

    def rand(name, n, k):
        return random_qtensor(mix_format(fmt, name, cfg.n_layers), n, k, device, scale=0.02)

    t = {"token_embd.weight": rand("token_embd.weight", cfg.vocab_size, H),
         "output.weight": rand("output.weight", cfg.vocab_size, H), "output_norm.weight": ones}
    for i in range(cfg.n_layers):
        for name, (n, k) in shapes.items():
            t[f"blk.{i}.{name}.weight"] = rand(f"blk.{i}.{name}.weight", n, k)
        t[f"blk.{i}.attn_norm.weight"] = ones
        t[f"blk.{i}.ffn_norm.weight"] = ones
    return t


def synthetic_model(fmt: str, cfg: ModelConfig) -> Model:
    """The model of ``synthetic_tensors``, built on the GPU."""
    return Model(cfg, synthetic_tensors(fmt, cfg), "cuda", torch.bfloat16)


def _decode_rate(llm: LLM, batch: int, prompt: int = PROMPT, cached: bool = False) -> tuple[float, float, int]:
    """(decode tokens/s over the steps after every prompt is done, wall seconds of the whole run, steps).

    ``cached``: the prompts are prefilled once beforehand (one token each), so that the timed requests find them in
    the prefix cache and all start decoding together. Long prompts need it: prefilled a chunk per step, the first
    sequences would finish their GEN tokens before the last one's prompt is done, and the decode steps would never
    run the whole batch."""
    g = torch.Generator().manual_seed(batch + prompt)
    prompts = [torch.randint(0, llm.cfg.vocab_size, (prompt,), generator=g).tolist() for _ in range(batch)]
    if cached:
        once = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        for ids in prompts:
            llm.add_request(ids, once)
        while llm.scheduler.has_work():
            llm.step()
    params = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)
    for ids in prompts:
        llm.add_request(ids, params)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    # prefill (in chunks) until every sequence has its first token
    while any(len(s.out_ids) == 0 for s in llm.scheduler.running) or llm.scheduler.waiting:
        llm.step()
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    before = sum(len(s.out_ids) for s in llm.scheduler.running)
    seqs = list(llm.scheduler.running)
    if len(seqs) < batch:
        raise RuntimeError(f"only {len(seqs)} of {batch} sequences were decoding once every prompt was done: "
                           f"the rate would not be batch {batch}'s")
    steps = 0
    while llm.scheduler.has_work():
        llm.step()
        steps += 1
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    made = sum(len(s.out_ids) for s in seqs) - before
    return made / (t2 - t1), t2 - t0, steps


def time_to_first_token(llm: LLM, n: int, seed: int = 0) -> float:
    """Seconds from adding one ``n``-token request to its first sampled token (prefill chunks included)."""
    g = torch.Generator().manual_seed(seed)
    seq = llm.add_request(torch.randint(0, llm.cfg.vocab_size, (n,), generator=g).tolist(),
                          SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while not seq.out_ids:
        llm.step()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    while llm.scheduler.has_work():
        llm.step()
    return dt


def prefill_rows(llm: LLM, label: str, suite: str = "engine", anchors: dict | None = None) -> list:
    """Prompt tokens/s of one request of each PREFILL_LENGTHS (the median of 3 after a warm-up)."""
    rows = []
    for n in PREFILL_LENGTHS:
        # prompts no earlier request had (the decode cases' prompts are seeded batch + length): no prefix-cache hits
        time_to_first_token(llm, n, seed=1000)
        dt = sorted(time_to_first_token(llm, n, seed=1001 + i) for i in range(3))[1]
        row = Row(suite, f"llama3-8b {label} prefill {n} (time to first token)", "tokens/s", n / dt, None,
                  dict((anchors or {}).get(n, {})))
        row.note = f"time to first token {dt * 1e3:.1f} ms, budget {llm.scheduler.max_tokens} tokens/step"
        rows.append(row)
    return rows


def _format_case(ctx, fmt: str, act_int8: bool = False):
    def run():
        cfg = llama3_8b_config()
        model = synthetic_model(fmt, cfg)
        llm = LLM.from_model(model, max_num_seqs=64, max_model_len=max(PREFILL_LENGTHS) + 16, act_int8=act_int8)
        llm.capture_graphs([1, 16, 64] if not ctx.quick else [1])
        bytes_per_token = model.decode_bytes_per_token()
        bound = ctx.read_bw_TBps * 1e12 / bytes_per_token
        rows = []
        for batch in ([1, 16, 64] if not ctx.quick else [1]):
            # warm-up at every batch size: the first run at a new batch size decodes at 22.3 ms/step instead of
            # 9.0 (q4_k, batch 16, H100) even with every decode step replayed from a captured graph; what costs the
            # ~1.7 s outside the graphs is not identified (bench/NOTES.md, bench/lab/engine_batches.py)
            _decode_rate(llm, batch)
            rate, wall, steps = _decode_rate(llm, batch)
            per_seq = rate / batch
            pct = 100.0 * rate / bound if batch == 1 else None
            label = f"{fmt} act_int8" if act_int8 else fmt
            anchors = {"bound_batch1": bound}
            one = llm.runner.one_kernel
            if batch == 1 and one is not None:  # the same engine's kernel-per-op step beside its one-kernel step
                llm.runner.one_kernel = None
                _decode_rate(llm, batch)
                anchors["kernel per op"] = _decode_rate(llm, batch)[0]
                llm.runner.one_kernel = one
            row = Row("engine", f"llama3-8b {label} batch{batch} decode (prompt {PROMPT}, {GEN} new)", "tokens/s",
                      rate, pct, anchors)
            path = ("one-kernel step; " if one is not None else "kernel per op; ") if batch == 1 else ""
            row.note = (f"{path}{bytes_per_token / 1e9:.2f} GB/token stored weights; bound {bound:.0f} tok/s; "
                        f"{per_seq:.1f} tok/s per sequence; {1e3 / per_seq:.2f} ms/step; whole run {wall:.1f} s "
                        f"(prefill included), {steps} decode steps, graph replays {llm.stats.graph_steps}, preemptions "
                        f"{llm.scheduler.num_preemptions}")
            rows.append(row)
        if not act_int8:
            rows += prefill_rows(llm, fmt)
        del llm, model
        return rows
    return run


def _budget_case(ctx, fmt: str = "q4_k_m"):
    """Prefill throughput of one 512- and one 4096-token prompt under several per-step token budgets: the
    measurement behind LLM's default max_num_batched_tokens."""
    def run():
        model = synthetic_model(fmt, llama3_8b_config())
        rows = []
        for budget in (512, 1024, 2048, 4096):
            llm = LLM.from_model(model, max_num_seqs=4, max_model_len=max(PREFILL_LENGTHS) + 16,
                                 max_num_batched_tokens=budget, cuda_graphs=False)
            for row in prefill_rows(llm, f"{fmt} budget{budget}"):
                rows.append(row)
            del llm
        return rows
    return run


def _kv_cache_case(ctx, fmt: str = "q4_k_m", batch: int = 64, context: int = 8192):
    """Batch-64 decode of 8k-token contexts (prompt 8064, 128 new) on a bf16 and an fp8 e4m3 KV cache, and how
    many 8k-token sequences each cache holds in the memory the engine gives it (gpu_memory_utilization 0.9; the
    sequence cap is set high so that memory, not max_num_seqs, sizes the cache). At this length the cache reads
    (about 34 GB per step in bf16) outweigh the weights (4.9 GB)."""
    def run():
        model = synthetic_model(fmt, llama3_8b_config())
        rows, base = [], None
        for kv in ("auto", "fp8_e4m3"):
            llm = LLM.from_model(model, max_num_seqs=1024, max_model_len=context, kv_cache_dtype=kv)
            llm.capture_graphs([batch])
            _decode_rate(llm, batch, prompt=64)  # warm-up at this batch size (see _format_case)
            rate, wall, steps = _decode_rate(llm, batch, prompt=context - GEN, cached=True)
            fits = llm.num_pages * llm.page_size // context
            name = "bf16" if kv == "auto" else kv
            base = base or rate
            row = Row("engine", f"llama3-8b {fmt} batch{batch} decode, {context}-token contexts, {name} KV cache",
                      "tokens/s", rate, None, {"bf16_cache": base} if kv != "auto" else {})
            row.note = (f"{1e3 * batch / rate:.2f} ms/step; {fits} sequences of {context} tokens fit "
                        f"({llm.num_pages} pages of {llm.page_size}); prompts prefilled beforehand, found in the "
                        f"prefix cache; whole run {wall:.1f} s, "
                        f"{steps} decode steps, graph replays {llm.stats.graph_steps}, preemptions "
                        f"{llm.scheduler.num_preemptions}")
            rows.append(row)
            del llm
            torch.cuda.empty_cache()
        del model
        return rows
    return run


def _small_batch_case(ctx, fmt: str = "bf16", batches=(2, 3, 4, 5, 6, 7, 8)):
    """Decode at 2-8 sequences through the one-kernel step (LLM(megakernel=True), which takes every size it runs)
    beside the same engine's kernel-per-op step; no rows where the one-kernel step cannot run (not sm_90)."""
    def run():
        from ...megakernel.engine import why_not

        model = synthetic_model(fmt, llama3_8b_config())
        spec = dict(megakernel=True, cuda_graphs=True)
        if why_not(model, torch.device("cuda"), spec) is not None:
            return []
        llm = LLM.from_model(model, max_num_seqs=max(batches), max_model_len=PROMPT + GEN + 16, megakernel=True)
        one, rows = llm.runner.one_kernel, []
        for batch in batches:
            rates = {}
            for path, steps in (("kernel per op", None), ("one-kernel step", one)):
                llm.runner.one_kernel = steps
                _decode_rate(llm, batch)  # warm-up: graphs built and captured (see _format_case)
                rates[path] = _decode_rate(llm, batch)
            rate, wall, n = rates["one-kernel step"]
            row = Row("engine", f"llama3-8b {fmt} batch{batch} decode, one-kernel step (prompt {PROMPT}, {GEN} new)",
                      "tokens/s", rate, None, {"kernel per op": rates["kernel per op"][0]})
            row.note = (f"{1e3 * batch / rate:.2f} ms/step one-kernel, {1e3 * batch / rates['kernel per op'][0]:.2f} "
                        f"kernel per op; {n} decode steps")
            rows.append(row)
        del llm, model
        return rows
    return run


def cases(ctx):
    fmts = ["q4_k", "q8_0", "bf16", "q4_k_m", "q5_k_m"] if not ctx.quick else ["q4_k"]
    out = [(f"engine {f}", _format_case(ctx, f)) for f in fmts]
    if not ctx.quick:
        out.append(("engine q4_k_m token budgets", _budget_case(ctx)))
    if not ctx.quick:  # activations rounded to int8 at batch 1 (LLM(act_int8=True))
        for f in ("q4_k", "q8_0", "q4_k_m", "q5_k_m"):
            out.append((f"engine {f} act_int8", _format_case(ctx, f, True)))
        out.append(("engine q4_k_m kv cache fp8", _kv_cache_case(ctx)))
        out.append(("engine bf16 one-kernel batches", _small_batch_case(ctx)))
    return out
