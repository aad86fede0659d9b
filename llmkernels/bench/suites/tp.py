"""Suite ``tp``: the engine split over 1, 2 and 4 GPUs (as many as the machine has) on one GGUF file.

The engine suite's Llama-3-8B-shaped synthetic model (random weights, llama.cpp's Q4_K_M mix, the serve suite's
synthetic vocabulary) is written once; ``LLM(path, tensor_parallel_size=N)`` loads it for each N. Rows: decode
tokens/s at 1, 16 and 64 sequences (512-token prompts, 128 new tokens each) per N, with N = 1's figure as the anchor
of the others; the bound of batch 1 is the read bandwidth over the weight bytes one rank reads per step (its shard).
"""
from __future__ import annotations

import os
import tempfile
import time

import torch

from ..harness import Row

BATCHES = (1, 16, 64)
PROMPT, GEN = 512, 128


def decode_rate(llm, batch: int, seed: int = 0) -> float:
    """Decode tokens/s of ``batch`` sequences once all of them have their first token."""
    from ...engine import SamplingParams

    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)
    seqs = [llm.add_request(torch.randint(1000, 120000, (PROMPT,), generator=g).tolist(), params)
            for _ in range(batch)]
    while any(not s.out_ids for s in seqs):
        llm.step()
    torch.cuda.synchronize()
    t0, before = time.perf_counter(), sum(len(s.out_ids) for s in seqs)
    while llm.scheduler.has_work():
        llm.step()
    torch.cuda.synchronize()
    return (sum(len(s.out_ids) for s in seqs) - before) / (time.perf_counter() - t0)


def _case(ctx):
    def run():
        from ...engine import LLM
        from .llamacpp import write_synthetic_gguf

        sizes = [n for n in (1, 2, 4) if n <= torch.cuda.device_count()]
        rows, base = [], {}
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "synthetic-llama3-8b-q4_k_m.gguf")
            write_synthetic_gguf(path, vocab=True)
            for n in sizes:
                with LLM(path, tensor_parallel_size=n, max_num_seqs=max(BATCHES), max_model_len=PROMPT + GEN + 16,
                         progress=False) as llm:
                    llm.capture_graphs([b for b in BATCHES])
                    # each rank reads its own shard per step: the batch-1 bound is bandwidth / a shard's bytes
                    bound = ctx.read_bw_TBps * 1e12 / llm.model.decode_bytes_per_token()
                    for batch in BATCHES:
                        decode_rate(llm, batch)  # warm-up at this batch size
                        rate = decode_rate(llm, batch, seed=1)
                        anchors = {"TP=1": base[batch]} if n > 1 and batch in base else {}
                        if n == 1:
                            base[batch] = rate
                        row = Row("tp", f"llama3-8b q4_k_m TP={n} batch{batch} decode (prompt 512, 128 new)",
                                  "tokens/s", rate, 100.0 * rate / bound if batch == 1 else None, anchors)
                        if anchors:
                            row.note = f"{rate / anchors['TP=1']:.2f}x TP=1"
                        rows.append(row)
        return rows
    return run


def cases(ctx):
    return [("tp llama3-8b q4_k_m", _case(ctx))]
