"""The one-kernel decode step's fast executor (llmkernels/megakernel/fast.py) in the lab: checked against the
reference executor (llmkernels/megakernel/kernel.py) on a tiny llama GGUF (every step's logits), then timed on the
Llama-3-8B shape against the engine's kernel-per-op step, with ``--trace`` a breakdown of where each SM's time goes.

    PYTHONPATH=. python bench/lab/megakernel_fast.py [--fmt bf16,q4_k] [--layers 32] [--context 512,...] [--batch 1]
                                                     [--stages 16,...] [--warps 4,8] [--splits 0,4,8]
                                                     [--hold 0,1,2]
                                                     [--qstep 2] [--qdot 1] [--diag 0,1,2,3] [--skip-check]
                                                     [--skip-engine] [--trace] [--variants fast,...]
"""
import argparse
import functools
import importlib
import inspect
import itertools
import time

import torch

from llmkernels.megakernel.fast import FastStep


def step_inputs(cfg, batch: int, context: int, page: int = 16):
    """(k_cache, v_cache, page_table, ids, seq_lens) of a step at ``batch`` sequences of ``context`` cached tokens
    each: random bf16 caches [layers, pages, page, kv heads, head dim], each sequence's pages in order."""
    pages = -(-(context + 1) // page)
    kc = torch.randn(cfg.n_layers, batch * pages, page, cfg.n_kv_heads, cfg.head_dim, device="cuda",
                     dtype=torch.bfloat16)
    table = torch.arange(batch * pages, dtype=torch.int32, device="cuda").view(batch, pages)
    ids = torch.ones(batch, dtype=torch.int32, device="cuda")
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return kc, torch.randn_like(kc), table, ids, lens


def trace_summary(prog, tr):
    """Where an SM's time goes in a traced step: per op, the mean over SMs of the time its instructions spent
    waiting for their counters and running (us), which add up to the step's span."""
    tr = tr.cpu()
    sms = prog.num_sms
    t0 = min(int(tr[sm, 0, 0]) for sm in range(sms) if prog.lists[sm])
    end = max(int(tr[sm, len(prog.lists[sm]) - 1, 2]) for sm in range(sms) if prog.lists[sm])
    wait, run, count = {}, {}, {}
    for sm in range(sms):
        for j, ins in enumerate(prog.lists[sm]):
            a, b, c = (int(x) for x in tr[sm, j])
            wait[ins.op] = wait.get(ins.op, 0) + b - a
            run[ins.op] = run.get(ins.op, 0) + c - b
            count[ins.op] = count.get(ins.op, 0) + 1
    lines = [f"traced step: {(end - t0) / 1e3:.1f} us from the first instruction's start to the last one's end; "
             f"per SM (mean over {sms}), us waiting / running:"]
    for op in count:
        lines.append(f"  {op:8s} {count[op]:6d} instructions  wait {wait[op] / sms / 1e3:8.1f}  run "
                     f"{run[op] / sms / 1e3:8.1f}")
    return "\n".join(lines)


def check_tiny(fmt, stages, warps=4, steps=9, **q):
    """Every step's logits of the fast step against the reference executor on a tiny llama GGUF in ``fmt`` (each
    with its own NaN-poisoned cache, the same scattered pages), one program per SM for both. q4_k: the fast step's
    int8 activations make it differ from the reference (float32 activations) by their rounding, so the bound is
    looser and the greedy token is reported, not required."""
    import tempfile

    from llmkernels.engine import ModelConfig, convert_hf_to_gguf
    from llmkernels.engine.config import rope_inv_freq
    from llmkernels.megakernel import build_decode_program
    from llmkernels.megakernel.kernel import DecodeStep
    from llmkernels.quant import read_gguf
    from llmkernels.testing.tiny_models import make_checkpoint

    d = tempfile.mkdtemp()
    make_checkpoint(d, "llama", hidden=512, ffn=1024, heads=8, kv_heads=2, head_dim=64)
    f = read_gguf(convert_hf_to_gguf(d, f"{d}/model-{fmt}.gguf", fmt, progress=False))
    cfg = ModelConfig.from_gguf(f.metadata, f.keys())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bound = 1e-3 if fmt == "bf16" else 5e-2
    worst, same = 0.0, 0
    for splits in (2, 3):
        prog = build_decode_program(cfg, fmt, batch=1, context=16, num_sms=sms, num_splits=splits)
        page, pages = 4, 4
        shape = (cfg.n_layers, pages + 3, page, cfg.n_kv_heads, cfg.head_dim)
        caches = [torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(4)]
        table = torch.randperm(pages + 3)[:pages].view(1, pages).to(torch.int32).cuda()
        inv, _ = rope_inv_freq(cfg)
        ref = DecodeStep(prog, cfg, f, caches[0], caches[1], inv.cuda(), batch=1)
        fast = FastStep.from_tensors(prog, cfg, f, caches[2], caches[3], inv.cuda(), stages=stages, warps=warps,
                                     **q)
        ids = torch.randint(1, cfg.vocab_size, (steps,), dtype=torch.int32)
        for t in range(steps):
            args = (ids[t:t + 1].cuda(), torch.full((1,), t + 1, dtype=torch.int32, device="cuda"), table)
            want = ref(*args).clone()
            got = fast(*args)
            e = ((got - want).abs().max() / want.abs().max()).item()
            worst = max(worst, e)
            same += int(got.argmax() == want.argmax())
            if not e < bound or (fmt == "bf16" and got.argmax() != want.argmax()):
                print(f"{fmt} splits {splits} step {t}: fast step differs from the reference: {e:.2e} of the "
                      f"largest logit, argmax {got.argmax().item()} vs {want.argmax().item()}", flush=True)
                return False
    print(f"tiny {fmt} llama, {warps} compute warps, {steps} steps, 2 and 3 key splits, {sms} SMs: fast step = "
          f"reference executor within "
          f"{worst:.1e} of the largest logit, same argmax at {same} of {2 * steps} steps", flush=True)
    return True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fmt", default="bf16,q4_k")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", default="512", help="comma-separated context lengths")
    ap.add_argument("--stages", default="16", help="ring slots (bf16: 8 KB each; q4_k: 4.5 KB, up to 24)")
    ap.add_argument("--warps", default="4", help="comma-separated: the compute partition's warps (4 or 8)")
    ap.add_argument("--qstep", type=int, default=2, help="q4_k: slots per barrier")
    ap.add_argument("--qdot", type=int, default=1, help="q4_k: _slot_dot's DOT (1: fewer instructions)")
    ap.add_argument("--splits", default="0", help="comma-separated key splits per KV head (0: the schedule's)")
    ap.add_argument("--hold", default="0", help="comma-separated FastStep hold: the loader waits at each ATTN until "
                    "the split is past its wait (1) or done (2)")
    ap.add_argument("--diag", default="0", help="comma-separated FastStep diag builds (timing only: 1 no weight "
                    "reads, 2 no bf16 products, 3 neither)")
    ap.add_argument("--prog-context", type=int, default=0, help="build the program for this context (0: each run's), "
                    "as the engine builds one for its longest")
    ap.add_argument("--dump", default="", help="a directory: each traced step's stamps and program saved there")
    ap.add_argument("--variants", default="fast", help="comma-separated modules of llmkernels.megakernel whose "
                    "FastStep is timed (an A/B of a copy of fast.py)")
    ap.add_argument("--kv-ring", default="", help="comma-separated FastStep kv_ring (ATTN's cp.async ring in blocks; "
                    "empty: the default), for the variants that take it")
    ap.add_argument("--batch", type=int, default=1, help="sequences per step (bf16: 1-8), each of --context "
                    "cached tokens; the engine's kernel-per-op rate at the same batch beside it")
    ap.add_argument("--batch-mma", default="1", help="comma-separated FastStep batch_mma (batch > 1: 1 the tensor "
                    "cores, 0 the CUDA cores)")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--trace", action="store_true", help="then one traced step per context: where the time goes")
    args = ap.parse_args()
    from llmkernels.bench.harness import measure_read_bandwidth, time_graph_ms
    from llmkernels.bench.suites.engine import llama3_8b_config, synthetic_tensors
    from llmkernels.engine.config import rope_inv_freq
    from llmkernels.megakernel import build_decode_program, describe, simulate
    from megakernel_step import engine_rate

    stages = [int(x) for x in args.stages.split(",")]
    warps = [int(x) for x in args.warps.split(",")]
    contexts = [int(x) for x in args.context.split(",")]
    cfg = llama3_8b_config(args.layers)
    bw = measure_read_bandwidth() * 1e12
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    inv, _ = rope_inv_freq(cfg)
    for fmt in args.fmt.split(","):
        q = dict(qstep=args.qstep, qdot=args.qdot)
        if not args.skip_check and not all(check_tiny(fmt, stages[0], w, **q) for w in warps):
            continue
        tensors = synthetic_tensors(fmt, cfg)
        for context, splits in itertools.product(contexts, [int(x) for x in args.splits.split(",")]):
            B = args.batch
            prog = build_decode_program(cfg, fmt, batch=B, context=args.prog_context or context, num_sms=sms,
                                        bandwidth=bw,
                                        num_splits=splits or None)
            print(describe(prog, simulate(prog, bandwidth=bw)), flush=True)
            kc, vc, table, ids, lens = step_inputs(cfg, B, context)
            base = None
            holds = [int(x) for x in args.hold.split(",")]
            diags = [int(x) for x in args.diag.split(",")]
            variants = args.variants.split(",")
            rings = [int(x) for x in args.kv_ring.split(",")] if args.kv_ring else [None]
            mmas = [bool(int(x)) for x in args.batch_mma.split(",")] if B > 1 else [True]
            for w, st, hd, dg, var, ring, mma in itertools.product(warps, stages, holds, diags, variants, rings, mmas):
                kw = dict(stages=st, warps=w, hold=hd, diag=dg, **q)
                if B > 1:
                    kw["batch_mma"] = mma
                step = importlib.import_module("llmkernels.megakernel." + var).FastStep
                if "kv_ring" in inspect.signature(step).parameters:
                    kw["kv_ring"] = ring
                elif ring != rings[0]:
                    continue
                t0 = time.perf_counter()
                if base is None:
                    fast = base = step.from_tensors(prog, cfg, tensors, kc, vc, inv.cuda(), **kw)
                else:
                    fast = step(prog, cfg, base.stacks, base.emb, base.norms, base.onorm, inv, kc, vc, **kw)
                t1 = time.perf_counter()
                fast(ids, lens, table)
                torch.cuda.synchronize()
                # where a slow start goes: building the step (stacks), or its first launch (compilation, a wait)
                print(f"  built in {t1 - t0:.1f} s, first step (compiled and run) in {time.perf_counter() - t1:.1f} s",
                      flush=True)
                ms = time_graph_ms([functools.partial(fast.launch, ids, lens, table)], reps=10)
                print(f"{fmt} {var} step, batch {B}, context {context}, {prog.geometry['splits']} splits, {w} "
                      f"compute warps{', tensor cores' if B > 1 and mma else ''}, "
                      f"{st} slots, hold {hd}, diag {dg}, kv_ring {kw.get('kv_ring', '-')}: "
                      f"{ms * 1e3:.1f} us per step ({B / ms * 1e3:.1f} tokens/s), "
                      f"{100 * prog.weight_bytes / bw / (ms * 1e-3):.1f}% of the "
                      f"weight-bandwidth bound ({prog.weight_bytes / 1e9:.2f} GB at {bw / 1e12:.2f} TB/s)",
                      flush=True)
                if args.trace:  # the same build traced
                    fast = step(prog, cfg, base.stacks, base.emb, base.norms, base.onorm, inv, kc, vc,
                                trace=True, **kw)
                    fast(ids, lens, table)
                    fast(ids, lens, table)
                    torch.cuda.synchronize()
                    print(f"{fmt}, context {context}, diag {dg}: " + trace_summary(prog, fast.trace), flush=True)
                    if args.dump:
                        import os
                        os.makedirs(args.dump, exist_ok=True)
                        name = f"{fmt}-{var}-{context}-w{w}-s{st}-h{hd}-d{dg}.pt"
                        torch.save({"trace": fast.trace.cpu(), "program": torch.from_numpy(prog.encode()),
                                    "opt": kw}, os.path.join(args.dump, name))
            del fast, base
            del kc, vc
            torch.cuda.empty_cache()
        # q4_k: the fast step rounds activations to int8, so the engine's act_int8 path is its like; megakernel:
        # the engine's step with the fast step in its CUDA graph
        paths = ((False, False), (True, False), (True, True)) if fmt == "q4_k" else ((False, False), (False, True))
        if args.batch > 1:  # the engine takes the one-kernel step at batch 1 only
            paths = ((fmt == "q4_k", False),)
        for (a8, mk), context in itertools.product(paths if not args.skip_engine else (), contexts):
            rate = engine_rate(cfg, tensors, context, act_int8=a8, megakernel=mk, batch=args.batch)
            print(f"engine, {'one-kernel step' if mk else 'kernel per op'}, {fmt}{' act_int8' * a8}, batch "
                  f"{args.batch}, context {context}: {rate:.1f} tokens/s, {1e3 * args.batch / rate:.2f} ms per step",
                  flush=True)
        del tensors
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
