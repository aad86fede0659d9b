"""Gluon prefill table entries timed two ways on causal shapes: as the suite times (``time_ms``, eager: where an
eager call's host time exceeds its kernel's, this times the host) and by CUDA-graph replay (the kernels alone),
each twice (the graph timer's eager warm-up on its stream makes the tile counter that PERSIST 2 needs).

    PYTHONPATH=. python bench/lab/prefill_graph_configs.py [--dtype fp8] [--shapes 1x4096x32x32,2x2048x32x32]
        [--configs "256,2,0,0;128,2,0,1,1"] [--tile-groups 0,8]

--tile-groups: prefill_ws.CAUSAL_TILE_GROUP values to time each entry with (the order claimed tiles are handed out
in); --l2-mb: prefill_ws.TILE_GROUP_L2_BYTES in MiB (a large value makes every group CAUSAL_TILE_GROUP wide).
"""
import argparse

import torch

import llmkernels as lk
from llmkernels.attention import prefill, prefill_ws
from llmkernels.bench.harness import time_ms
from llmkernels.bench.suites.prefill import attention_flops, dense_inputs
from llmkernels.tuning import OVERRIDES


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="fp8", choices=["fp8", "bf16"])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--shapes", default="1x4096x32x32,2x2048x32x32,8x1024x32x8,1x16384x32x32,1x8192x32x8",
                   help="BxSxHqxHkv, comma-separated")
    p.add_argument("--configs", default="256,2,0,0;128,2,0,0,1;128,2,0,1,1;128,3,0,1,1;256,2,0,1;256,2,0,0,1",
                   help="table entries, ';'-separated")
    p.add_argument("--rep", type=float, default=40)
    p.add_argument("--tile-groups", default=str(prefill_ws.CAUSAL_TILE_GROUP))
    p.add_argument("--l2-mb", type=int, default=prefill_ws.TILE_GROUP_L2_BYTES >> 20)
    args = p.parse_args()
    prefill.WS_MIN_WORK = 0
    prefill_ws.TILE_GROUP_L2_BYTES = args.l2_mb << 20
    dtype = torch.float8_e4m3fn if args.dtype == "fp8" else torch.bfloat16
    D = args.head_dim
    key = ("prefill", f"{str(dtype).replace('torch.', '')}/{D}/causal/ws")
    configs = [[int(x) for x in c.split(",")] for c in args.configs.split(";")]
    print(torch.cuda.get_device_name(), flush=True)
    for shape in args.shapes.split(","):
        B, S, H, Hkv = map(int, shape.split("x"))
        q, k, v, cu = (t.to(dtype) if t.is_floating_point() else t for t in dense_inputs(B, H, Hkv, S, D))
        ds = torch.ones(1, device="cuda")
        kw = dict(q_descale=ds, k_descale=ds, v_descale=ds) if dtype != torch.bfloat16 else {}
        flops = attention_flops([S] * B, H, D, True)
        for cfg in configs:
            for group in map(int, args.tile_groups.split(",")):
                OVERRIDES[key] = cfg
                prefill_ws.CAUSAL_TILE_GROUP = group
                f = lambda: lk.flash_attn_varlen(q, k, v, cu, cu, S, S, causal=True, **kw)  # noqa: E731
                eager = [flops / time_ms(f, rep_ms=args.rep) / 1e9 for _ in range(2)]
                graph = [flops / time_ms(f, rep_ms=args.rep, cuda_graph=True) / 1e9 for _ in range(2)]
                print(f"B{B} S{S} H{H}/{Hkv} D{D} causal {args.dtype} {cfg} group {group}: eager {eager[0]:.0f} "
                      f"{eager[1]:.0f}, graph {graph[0]:.0f} {graph[1]:.0f} TFLOP/s", flush=True)
        OVERRIDES.pop(key, None)


if __name__ == "__main__":
    main()
