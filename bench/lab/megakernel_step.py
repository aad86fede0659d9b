"""The reference one-kernel decode step (llmkernels.megakernel.kernel, Triton) on the GPU against the engine's
kernel-per-op step, both at batch 1 on a Llama-3-8B-shaped model with random weights in one format.

    PYTHONPATH=. python bench/lab/megakernel_step.py [--fmt q4_k_m] [--layers 32] [--context 512]
        [--tiles 16x64x4x1,16x64x4x1x3,16x64x4x1x1x0,...] [--programs-per-sm 1,2]

Prints each tile configuration's step time and fraction of the weight-bandwidth bound, then the engine's
batch-1 decode rate on the same shape (CUDA graphs, as the engine suite measures it). The reference executor
streams weights with plain loads and no prefetch across instructions: its number is a starting point, not the
design's (see bench/lab/megakernel_model.py for what the schedule allows).
"""
import argparse
import time

import torch

from llmkernels.bench.harness import measure_read_bandwidth
from llmkernels.bench.suites.engine import _decode_rate, llama3_8b_config, synthetic_tensors
from llmkernels.engine import LLM, Model
from llmkernels.engine.config import rope_inv_freq
from llmkernels.megakernel import build_decode_program, check, describe, simulate
from llmkernels.megakernel.kernel import DecodeStep


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--fmt", default="q4_k_m")
    ap.add_argument("--tiles", default="16x64x4x1,32x256x8x1",
                    help="rows x norm chunk x warps x 256-weight units per GEMV step [x pipelined stages [x q4_k "
                         "vector loads 1/0]], per configuration, comma-separated (each compiles for ~30 s)")
    ap.add_argument("--programs-per-sm", default="1",
                    help="comma-separated: programs per SM (each its own instruction list; all must be resident: "
                         "the 4-warp build's 241 registers allow 2)")
    args = ap.parse_args()
    cfg = llama3_8b_config(args.layers)
    bw = measure_read_bandwidth() * 1e12
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    progs = {}
    for per_sm in map(int, args.programs_per_sm.split(",")):
        progs[per_sm] = prog = build_decode_program(cfg, args.fmt, batch=1, context=args.context,
                                                    num_sms=per_sm * sms, bandwidth=bw)
        check(prog, hazards=False)
        print(describe(prog, simulate(prog, bandwidth=bw)), flush=True)
    L, D = cfg.n_layers, cfg.head_dim
    tensors = synthetic_tensors(args.fmt, cfg)
    page = 16
    pages = -(-(args.context + 1) // page)
    kc = torch.randn(L, pages, page, cfg.n_kv_heads, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.arange(pages, dtype=torch.int32, device="cuda").view(1, pages)
    ids = torch.ones(1, dtype=torch.int32, device="cuda")
    lens = torch.full((1,), args.context, dtype=torch.int32, device="cuda")
    inv, _ = rope_inv_freq(cfg)
    runs = [(per_sm, (tuple(map(int, t.split("x"))) + (1, 1))[:6]) for per_sm in progs for t in args.tiles.split(",")]
    for per_sm, (block_r, block_k, warps, qnb, stages, vec) in runs:
        prog = progs[per_sm]
        step = DecodeStep(prog, cfg, tensors, kc, vc, inv.cuda(), batch=1, block_r=block_r, block_k=block_k,
                          num_warps=warps, blocks_per_step=qnb, stages=stages, vector_loads=bool(vec),
                          spin_limit=1 << 20)
        try:
            step(ids, lens, table)
        except RuntimeError as e:  # programs that could not all be resident: the spin limit says so
            print(f"{per_sm} programs per SM, tiles {block_r}x{block_k}x{warps}x{qnb}x{stages}x{vec}: {e}", flush=True)
            continue
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = 20
        for _ in range(n):
            step(ids, lens, table)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / n
        print(f"reference step, {per_sm} programs per SM, tiles {block_r}x{block_k}, {warps} warps, {qnb} units per "
              f"step, {stages} stages, q4_k vector loads {vec}: {dt * 1e3:.2f} ms, "
              f"{100 * prog.weight_bytes / bw / dt:.1f}% of the bound", flush=True)
        del step
    del kc, vc
    torch.cuda.empty_cache()
    rate = engine_rate(cfg, tensors, args.context)
    print(f"engine, kernel per op: {rate:.1f} tokens/s, {1e3 / rate:.2f} ms per step", flush=True)


def engine_rate(cfg, tensors, context: int, act_int8: bool = False, megakernel: bool = False, batch: int = 1) -> float:
    """The engine's decode rate at ``batch`` sequences (tokens/s, CUDA graphs, as the engine suite measures it) on
    these weights after ``context``-token prompts; ``act_int8``: the int8-activation GEMVs (LLM's act_int8);
    ``megakernel``: LLM's (False: the kernel-per-op step)."""
    llm = LLM.from_model(Model(cfg, tensors, "cuda", torch.bfloat16), max_num_seqs=batch,
                         max_model_len=context + 160, act_int8=act_int8, megakernel=megakernel)
    llm.capture_graphs([batch])
    _decode_rate(llm, batch, prompt=context)
    return _decode_rate(llm, batch, prompt=context)[0]


if __name__ == "__main__":
    main()
