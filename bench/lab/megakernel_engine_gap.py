"""Where the engine's one-kernel decode step loses time against the same kernel in the lab, in one process on the
Llama-3-8B shape (random bf16 weights, batch 1, the engine suite's settings: 64 sequences, max_model_len 4112):

- the engine's decode rate (as the engine suite measures it) and its ms per step;
- the engine's captured one-kernel graph replayed back to back (no host, no uploads);
- a FastStep over the engine's weights and caches, launched back to back in a graph of ``--reps`` steps, at each
  of ``--contexts``, for each of ``--variants``: ``new`` (this tree's FastStep) and ``prev`` (the FastStep of
  a module ``llmkernels/megakernel/_fast_prev.py``, an earlier fast.py put there for an A/B in one process);
- with ``--own``, the same over a cache of its own (each layer's K and V apart, pages in order) and with the
  program built for the first context and this machine's measured bandwidth;
- optionally (``--profile``) the engine's steps under torch.profiler: GPU time per kernel and idle time.

    PYTHONPATH=.:bench/lab python bench/lab/megakernel_engine_gap.py [--contexts 512,639] [--holds 1]
                                                                     [--variants new,prev] [--own] [--profile]
"""
import argparse
import functools
import itertools

import torch

from llmkernels.bench.harness import measure_read_bandwidth, time_graph_ms
from llmkernels.bench.suites.engine import _decode_rate, llama3_8b_config, synthetic_tensors
from llmkernels.engine import LLM, Model
from llmkernels.megakernel import build_decode_program
from llmkernels.megakernel.fast import FastStep


def replay_ms(graph, n=50):
    graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="512,639")
    ap.add_argument("--variants", default="new")
    ap.add_argument("--own", action="store_true")
    ap.add_argument("--holds", default="1")
    ap.add_argument("--stages", default="16")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    bw = measure_read_bandwidth() * 1e12
    cfg = llama3_8b_config(32)
    llm = LLM.from_model(Model(cfg, synthetic_tensors("bf16", cfg), "cuda", torch.bfloat16), max_num_seqs=64,
                         max_model_len=4112)
    llm.capture_graphs([1])
    print(llm.describe(), flush=True)
    contexts = [int(x) for x in args.contexts.split(",")]
    rates = [_decode_rate(llm, 1, prompt=contexts[0])[0] for _ in range(2)]
    print(f"engine: {rates[0]:.1f} / {rates[1]:.1f} tokens/s ({1e3 / rates[1]:.3f} ms per step)", flush=True)
    og = llm.runner.one_kernel
    f = og.fast
    print(f"engine graph replayed: {replay_ms(og.graph) * 1e3:.1f} us per step (seq_len {int(og.lens[0])})",
          flush=True)
    ids, lens, table = og.ids.clone(), og.lens.clone(), og.table.clone()
    pages = -(-(max(contexts) + 1) // 16)
    kc = torch.randn(cfg.n_layers, pages, 16, cfg.n_kv_heads, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    own = torch.arange(pages, dtype=torch.int32, device="cuda").view(1, pages)
    lab_prog = build_decode_program(cfg, "bf16", batch=1, context=contexts[0], num_sms=f.prog.num_sms, bandwidth=bw)
    cases = [("engine program, engine caches and pages", f.prog, f.kc, f.vc, table)]
    if args.own:
        cases += [("engine program, own caches", f.prog, kc, vc, own),
                  (f"program for {contexts[0]} at {bw / 1e12:.2f} TB/s, own caches", lab_prog, kc, vc, own)]
    for st, hold, var, ctx in itertools.product([int(x) for x in args.stages.split(",")],
                                                [int(x) for x in args.holds.split(",")], args.variants.split(","),
                                                contexts):
        lens.fill_(ctx)
        if var == "prev":
            from llmkernels.megakernel._fast_prev import FastStep as Step
        else:
            Step = FastStep
        for name, prog, k, v, t in cases:
            fs = Step(prog, cfg, f.stacks, f.emb, f.norms, f.onorm, f.inv_freq, k, v, stages=st, hold=hold)
            fs(ids, lens, t)
            torch.cuda.synchronize()
            ms = time_graph_ms([functools.partial(fs.launch, ids, lens, t)], reps=args.reps)
            print(f"stages {st} hold {hold} {var}, {name}, context {ctx}: {ms * 1e3:.1f} us per step", flush=True)
            del fs
    if args.profile:
        from engine_step_profile import profile_steps

        from llmkernels.engine import SamplingParams

        llm.add_request(list(range(1, contexts[0] + 1)), SamplingParams(temperature=0, max_tokens=96,
                                                                         ignore_eos=True))
        for _ in range(24):
            llm.step()
        torch.cuda.synchronize()
        profile_steps(llm, 24)


if __name__ == "__main__":
    main()
