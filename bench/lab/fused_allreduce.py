"""The all-reduce fused into add_rmsnorm against the one-shot all-reduce followed by add_rmsnorm, on 2 GPUs.

    python bench/lab/fused_allreduce.py [hidden] [--quick]   # --quick: 4 pairs, 2 replays (for compute-sanitizer)

64 (all-reduce, norm) pairs of [batch, hidden] bf16 per CUDA graph (a decode step of the 8B shape has 64), replayed
20 times; us per pair, rank 0's clock.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PAIRS, REPS = 64, 20


def _rank(rank, world, init, H, pairs=PAIRS, reps=REPS):
    from llmkernels.engine.allreduce import AllReduce
    from llmkernels.engine.kernels import add_rmsnorm
    from llmkernels.engine.parallel import SAFE_ENV

    os.environ.update(SAFE_ENV)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
    dev = torch.device("cuda", rank)
    ar = AllReduce(None, dev, torch.bfloat16, "symm", hidden=H)
    f = ar.fused
    w = torch.randn(H, device=dev, dtype=torch.bfloat16)
    for T in (1, 16, 64):
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        res = torch.randn(T, H, device=dev, dtype=torch.bfloat16) * 0
        times = {}
        for name, one in (("one-shot + add_rmsnorm", lambda: add_rmsnorm(ar(x), w, 1e-6, residual=res)),
                          ("fused", lambda: add_rmsnorm(x, w, 1e-6, residual=res, peers=f))):
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                for _ in range(3):
                    one()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s):
                for _ in range(pairs):
                    one()
            for _ in range(3):
                g.replay()
            torch.cuda.synchronize()
            dist.barrier()
            ts = []
            for _ in range(reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                g.replay()
                b.record()
                torch.cuda.synchronize()
                ts.append(a.elapsed_time(b) * 1e3 / pairs)
            times[name] = sorted(ts)[len(ts) // 2]
            torch.cuda.synchronize()
            dist.barrier()
            g.reset()
        if rank == 0:
            print(f"H {H} batch {T}: " + ", ".join(f"{k} {v:.2f} us" for k, v in times.items()), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from llmkernels.engine.parallel import _free_port

    args = [a for a in sys.argv[1:] if a != "--quick"]
    if "--quick" in sys.argv:
        PAIRS, REPS = 4, 2
    H = int(args[0]) if args else 4096
    mp.spawn(_rank, args=(2, f"tcp://127.0.0.1:{_free_port()}", H, PAIRS, REPS), nprocs=2)
