"""Suite ``tp``: the engine split over 1, 2 and 4 GPUs (as many as the machine has) on one GGUF file.

The engine suite's Llama-3-8B-shaped synthetic model (random weights, llama.cpp's Q4_K_M mix, the serve suite's
synthetic vocabulary) is written once; ``LLM(path, tensor_parallel_size=N)`` loads it for each N. Rows: decode
tokens/s at 1, 16 and 64 sequences (512-token prompts, 128 new tokens each) per N, with N = 1's figure as the anchor
of the others; the bound of batch 1 is the read bandwidth over the weight bytes one rank reads per step (its shard).
``$LLMK_TP_SIZES`` picks the sizes (default ``1,2,4``). Llama-3-70B's shape runs at TP=2 (batch 1 and 64), its
batch-1 bound the two GPUs' combined bandwidth.
"""
from __future__ import annotations

import os
import tempfile
import time

import torch

from ..harness import Row

BATCHES = (1, 16, 64)
PROMPT, GEN = 512, 128


def _sizes() -> list:
    """Tensor-parallel sizes to measure: ``$LLMK_TP_SIZES`` (for example ``1,4``), else 1, 2 and 4."""
    env = os.environ.get("LLMK_TP_SIZES", "1,2,4")
    try:
        return [int(n) for n in env.split(",")]
    except ValueError:
        raise ValueError(f"LLMK_TP_SIZES must be a comma-separated list of integers, got {env!r}") from None


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
        from .llamacpp import synthetic_gguf

        sizes = [n for n in _sizes() if n <= torch.cuda.device_count()]
        rows, base = [], {}
        with tempfile.TemporaryDirectory() as tmp:
            path = synthetic_gguf(tmp, vocab=True)
            for n in sizes:
                # TP > 1 with the engine's default all-reduce, and with $LLMK_TP_NCCL=1 also on NCCL at batch 1 (the
                # all-reduce case compares the two directly)
                for mode in (["auto"] if n == 1 else ["nccl", "auto"] if os.environ.get("LLMK_TP_NCCL") else ["auto"]):
                    os.environ["LLMK_ALLREDUCE"] = mode
                    with LLM(path, tensor_parallel_size=n, max_num_seqs=max(BATCHES),
                             max_model_len=PROMPT + GEN + 16, progress=False) as llm:
                        llm.capture_graphs(list(BATCHES), [])
                        # each rank reads its own shard per step: the batch-1 bound is bandwidth / a shard's bytes
                        bound = ctx.read_bw_TBps * 1e12 / llm.model.decode_bytes_per_token()
                        for batch in (BATCHES if mode != "nccl" else BATCHES[:1]):
                            decode_rate(llm, batch)  # warm-up at this batch size
                            rate = decode_rate(llm, batch, seed=1)
                            anchors = {"TP=1": base[batch]} if n > 1 and batch in base else {}
                            if n == 1:
                                base[batch] = rate
                            ar = "" if n == 1 else ", all-reduce " + (
                                "symmetric memory" if "symmetric" in llm.model._all_reduce.why else "NCCL")
                            row = Row("tp", f"llama3-8b q4_k_m TP={n} batch{batch} decode (prompt 512, 128 new{ar})",
                                      "tokens/s", rate, 100.0 * rate / bound if batch == 1 else None, anchors)
                            if anchors:
                                row.note = f"{rate / anchors['TP=1']:.2f}x TP=1"
                            print(row.case, f"{rate:.1f}", row.note, flush=True)
                            rows.append(row)
            os.environ.pop("LLMK_ALLREDUCE", None)
        return rows
    return run




AR_LAYERS = 32  # all-reduces per step: two per layer of the 8B shape


def _ar_rank(rank, world, init_method, hidden, batches, reps, queue):
    import torch.distributed as dist

    from ...engine.allreduce import AllReduce
    from ...engine.parallel import SAFE_ENV, init_group

    os.environ.update(SAFE_ENV)
    torch.cuda.set_device(rank)
    init_group(rank, world, init_method, "nccl")
    out = {}
    try:
        for mode in ("nccl", "symm"):
            ar = AllReduce(None, torch.device("cuda", rank), torch.bfloat16, mode=mode)
            for b in batches:
                x = torch.full((b, hidden), 1.0 + rank, dtype=torch.bfloat16, device="cuda")
                ok = bool((ar(x) == world * (world + 1) / 2).all())  # small integers: exact in bf16
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(3):
                        ar(x)
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=s):
                    for _ in range(2 * AR_LAYERS):
                        ar(x)
                times = []
                for _ in range(reps):
                    dist.barrier()
                    torch.cuda.synchronize()
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    g.replay()
                    e1.record()
                    torch.cuda.synchronize()
                    times.append(e0.elapsed_time(e1) * 1e3)
                out[(mode, b)] = (sorted(times)[len(times) // 2], ok)
        if rank == 0:
            queue.put(out)
    finally:
        dist.destroy_process_group()


def all_reduce_times(world: int, hidden: int = 4096, batches=BATCHES, reps: int = 20) -> dict:
    """{(mode, batch): (median us of a step's 2 x AR_LAYERS all-reduces of [batch, hidden] bf16 replayed in a CUDA
    graph, whether every element came out equal)} on ``world`` GPUs, for NCCL and symmetric memory."""
    import torch.multiprocessing as mp

    from ...engine.parallel import _free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_ar_rank, args=(r, world, init, hidden, batches, reps, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        res = queue.get(timeout=300)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return res


def _ar_case(ctx):
    def run():
        rows = []
        for world in [n for n in (2, 4) if n <= torch.cuda.device_count()]:
            res = all_reduce_times(world)
            for b in BATCHES:
                nccl, symm = res[("nccl", b)], res[("symm", b)]
                row = Row("tp", f"all-reduce TP={world} batch{b} ({2 * AR_LAYERS} x [{b}, 4096] bf16 per step, "
                          f"symmetric memory one-shot)", "us/step", symm[0], None, {"NCCL": nccl[0]})
                row.note = (f"{nccl[0] / symm[0]:.2f}x NCCL's time; per all-reduce {symm[0] / (2 * AR_LAYERS):.1f} / "
                            f"{nccl[0] / (2 * AR_LAYERS):.1f} us" + ("" if nccl[1] and symm[1] else "; SUMS WRONG"))
                print(row.case, f"{symm[0]:.1f} us", row.note, flush=True)
                rows.append(row)
        return rows
    return run


def _case_70b(ctx):
    """Llama-3-70B's shape on 2 GPUs (all-reduce auto): batch 1 against the two GPUs' combined bandwidth bound (the
    read bandwidth over one rank's shard: each rank reads its half in parallel), and batch 64."""
    def run():
        from ...engine import LLM
        from .llamacpp import synthetic_gguf

        if torch.cuda.device_count() < 2:
            return []
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            path = synthetic_gguf(tmp, vocab=True, shape="70b")
            with LLM(path, tensor_parallel_size=2, max_num_seqs=64, max_model_len=PROMPT + GEN + 16,
                     progress=False) as llm:
                llm.capture_graphs([1, 64], [])
                bound = ctx.read_bw_TBps * 1e12 / llm.model.decode_bytes_per_token()
                for batch in (1, 64):
                    decode_rate(llm, batch)
                    rate = decode_rate(llm, batch, seed=1)
                    row = Row("tp", f"llama3-70b q4_k_m TP=2 batch{batch} decode (prompt 512, 128 new)", "tokens/s",
                              rate, 100.0 * rate / bound if batch == 1 else None)
                    # after the 8B case's engines in this process it may run on NCCL (allreduce.engine_mode)
                    row.note = "all-reduce " + ("symmetric memory" if "symmetric" in llm.model._all_reduce.why
                                                else "NCCL")
                    if batch == 1:
                        row.note = f"{100.0 * rate / bound:.1f}% of the 2 GPUs' bound {bound:.0f} tok/s; " + row.note
                    print(row.case, f"{rate:.1f}", row.note, flush=True)
                    rows.append(row)
        return rows
    return run


def cases(ctx):
    return [("tp all-reduce", _ar_case(ctx)), ("tp llama3-8b q4_k_m", _case(ctx)),
            ("tp llama3-70b q4_k_m", _case_70b(ctx))]
