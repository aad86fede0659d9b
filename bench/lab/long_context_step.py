"""Where a long-context batch decode step's time goes: wall time per step against profiled kernel time.

    python bench/lab/long_context_step.py [--batch 64] [--prompt 8064] [--kv auto,fp8_e4m3] [--seqs 64,1024]

Llama-3-8B-shaped q4_k_m with random weights; for each KV-cache dtype and sequence cap (the cap sizes the cache:
at 64 it holds the batch, at 1024 whatever memory allows), ``--batch`` prompts of ``--prompt`` random tokens are
prefilled, then decode steps are timed by wall clock and profiled (kernel time per step, the largest first).
``--cached`` prefills the prompts once beforehand, so that the timed requests find them in the prefix cache and all
decode together (without it, the first sequences finish their tokens while the last prompts are still prefilled, and
the "decode" steps run a fraction of the batch: the line after the prefill says how many run).
"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from llmkernels.bench.suites.engine import llama3_8b_config, synthetic_model
from llmkernels.engine import LLM, SamplingParams


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=8064)
    p.add_argument("--kv", default="auto")
    p.add_argument("--seqs", default="64,1024")
    p.add_argument("--cached", action="store_true")
    args = p.parse_args()
    model = synthetic_model("q4_k_m", llama3_8b_config())
    for kv in args.kv.split(","):
        for cap in [int(c) for c in args.seqs.split(",")]:
            llm = LLM.from_model(model, max_num_seqs=max(cap, args.batch), max_model_len=args.prompt + 128,
                                 kv_cache_dtype=kv)
            llm.capture_graphs([args.batch])
            g = torch.Generator().manual_seed(cap)
            params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
            prompts = [torch.randint(0, 1000, (args.prompt,), generator=g).tolist() for _ in range(args.batch)]
            if args.cached:
                for ids in prompts:
                    llm.add_request(ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
                while llm.scheduler.has_work():
                    llm.step()
            seqs = [llm.add_request(ids, params) for ids in prompts]
            t0 = time.perf_counter()
            while any(len(s.out_ids) == 0 for s in seqs):
                llm.step()
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            print(f"after the prefill: {len(llm.scheduler.running)} of {args.batch} sequences running", flush=True)
            for _ in range(4):
                llm.step()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    llm.step()
                torch.cuda.synchronize()
            print(f"kv {kv}, cap {cap}: {llm.num_pages} pages, prefill {t1 - t0:.1f} s, decode "
                  f"{1e3 * (t2 - t1) / 4:.1f} ms/step wall, graph replays {llm.stats.graph_steps}", flush=True)
            times = {e.key: e.self_device_time_total for e in prof.key_averages() if e.self_device_time_total > 0}
            for name, us in sorted(times.items(), key=lambda kv_: -kv_[1])[:8]:
                print(f"   {us / 3e3:9.2f} ms/step  {name[:100]}", flush=True)
            while llm.scheduler.has_work():
                llm.step()
            del llm
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
