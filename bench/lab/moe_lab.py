"""The MoE products of a Qwen3-30B-A3B decode step at batch 1 (128 experts, top 8, hidden 2048, expert FFN 768),
each config of the m1 kernel's MoE build against a dense product of the same bytes:

- gate/up (q4_k, GLU): 8 pairs of [768, 2048] against a dense GLU of [6144, 2048];
- down (q4_k and q6_k): 8 pairs of [2048, 768] against a dense [2048, 6144];
- the whole moe_ffn, and a graph of empty launches (the floor of a launch inside a graph);
- ``ffn``: moe_ffn for 1 to 512 tokens, pairs grouped on the tensor cores (moe_tc) against the per-pair and grouped
  kernels without it, and the tensor cores forced at every token count, q4_k gate/up with q4_k and q6_k downs (q6_k rows padded to 16 bytes, as the engine does);
- ``sweep``: the tensor-core configs (BLOCK_N, warps, stages, waves) of the gate/up and the down products at 16, 64
  and 512 tokens, and where one moe_ffn's time goes (torch profiler).

    PYTHONPATH=. python bench/lab/moe_lab.py [ffn | sweep]

Times by CUDA-graph replay, rotating over six expert sets (and six row slices of the stack for the dense products)
so that the reads overflow L2; us per call, with the bytes read per us in TB/s. Each config is checked against the
float64 reference first (relative max error).
"""
import torch
import triton

from llmkernels.bench.harness import time_graph_ms
from llmkernels.qgemv import moe as moe_mod
from llmkernels.qgemv.m1 import launch_m1
from llmkernels.quant.tensor import pad_rows
from llmkernels.testing import moe_gate_up_silu_ref, moe_gemv_ref
from llmkernels.testing.random_weights import random_qtensor

E, TOPK, H, F = 128, 8, 2048, 768
SETS = 6

GATE_UP = [(2, 1, 4, 3, 8, 1, 1), (4, 1, 4, 3, 8, 1, 1), (8, 1, 4, 3, 8, 1, 1), (2, 1, 2, 3, 8, 1, 1),
           (4, 1, 2, 3, 8, 1, 1), (2, 1, 8, 3, 8, 1, 1), (4, 1, 8, 3, 8, 1, 1), (2, 1, 4, 3, 4, 1, 1),
           (4, 1, 4, 3, 4, 1, 1), (4, 1, 4, 3, 4, 2, 1), (2, 1, 4, 3, 2, 1, 1), (2, 1, 1, 3, 8, 1, 1)]
DOWN = {"q4_k": [(4, 1, 4, 3), (2, 1, 4, 3, 2, 1, 1), (4, 1, 4, 3, 2, 2, 1), (2, 1, 4, 3, 2, 4, 1),
                 (4, 1, 2, 3, 2, 2, 1), (2, 1, 2, 3, 2, 2, 1), (8, 1, 4, 3, 2, 2, 1), (1, 1, 4, 3, 2, 4, 1)],
        "q6_k": [(2, 1, 4, 3, 2, 2, 1), (4, 1, 4, 3, 2, 2, 1), (2, 1, 4, 3, 2, 4, 1), (1, 1, 4, 3, 2, 4, 1),
                 (2, 1, 2, 3, 2, 2, 1), (4, 1, 2, 3, 2, 2, 1), (8, 1, 4, 3, 2, 2, 1), (2, 1, 4, 3, 1, 2, 1)]}


@triton.jit
def _empty_kernel(X):
    pass


def _err(a, b):
    return ((a.double() - b).abs().max() / b.abs().max()).item()


def _us(fns):
    return time_graph_ms(fns) * 1e3


def main():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    ids = [torch.randperm(E, generator=g)[:TOPK].to(torch.int32).cuda() for _ in range(SETS)]
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    gate, up = (random_qtensor("q4_k", E * F, H, "cuda") for _ in range(2))
    nb_gu = 2 * TOPK * F * H * 144 // 256
    ref = moe_gate_up_silu_ref(x, gate, up, E, ids[0], torch.zeros(TOPK, dtype=torch.int32, device="cuda"))
    t = torch.empty(1, device="cuda")
    print(f"empty launch, 1 program: {_us([lambda: _empty_kernel[(1,)](t)] * 8):.2f} us; 768 programs of 4 warps: "
          f"{_us([lambda: _empty_kernel[(768,)](t, num_warps=4)] * 8):.2f} us", flush=True)
    print(f"gate/up q4_k, {TOPK} pairs of [{F}, {H}] ({nb_gu / 1e6:.1f} MB) | dense GLU [{TOPK * F}, {H}]:")
    for cfg in GATE_UP:
        try:
            y = launch_m1(x, gate.data, "q4_k", F, H, cfg, 0, 2, up=up.data, experts=ids[0],
                          top_k=TOPK, n_experts=E)[0]
            err = _err(y, ref)
            t0 = _us([lambda e=e: launch_m1(x, gate.data, "q4_k", F, H, cfg, 0, 2, up=up.data, experts=e,
                                            top_k=TOPK, n_experts=E) for e in ids])
            rows = TOPK * F
            t1 = _us([lambda s=s: launch_m1(x, gate.data[s * rows:(s + 1) * rows], "q4_k", rows, H, cfg, 0, 2,
                                            up=up.data[s * rows:(s + 1) * rows]) for s in range(SETS)])
            print(f"  {cfg}: moe {t0:6.2f} us ({nb_gu / t0 / 1e6:.2f} TB/s, err {err:.1e}) | dense {t1:6.2f} us "
                  f"({nb_gu / t1 / 1e6:.2f} TB/s)", flush=True)
        except Exception as exc:  # a config the layout refuses
            print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
    h = torch.randn(TOPK, F, device="cuda", dtype=torch.bfloat16)
    for fmt, bpb in (("q4_k", 144), ("q6_k", 210)):
        down = random_qtensor(fmt, E * H, F, "cuda")
        dense = random_qtensor(fmt, SETS * H, TOPK * F, "cuda")
        nb = TOPK * H * F * bpb // 256
        ref = moe_gemv_ref(h, down, E, ids[0])
        print(f"down {fmt}, {TOPK} pairs of [{H}, {F}] ({nb / 1e6:.1f} MB) | dense [{H}, {TOPK * F}]:")
        hd = h.reshape(1, TOPK * F)
        for cfg in DOWN[fmt]:
            try:
                y = launch_m1(h, down.data, fmt, H, F, cfg, 0, 2, experts=ids[0], top_k=1, n_experts=E)[0]
                err = _err(y, ref)
                t0 = _us([lambda e=e: launch_m1(h, down.data, fmt, H, F, cfg, 0, 2, experts=e, top_k=1,
                                                n_experts=E) for e in ids])
                t1 = _us([lambda s=s: launch_m1(hd, dense.data[s * H:(s + 1) * H], fmt, H, TOPK * F, cfg, 132, 2)
                          for s in range(SETS)])
                print(f"  {cfg}: moe {t0:6.2f} us ({nb / t0 / 1e6:.2f} TB/s, err {err:.1e}) | dense {t1:6.2f} us "
                      f"({nb / t1 / 1e6:.2f} TB/s)", flush=True)
            except Exception as exc:
                print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
        w = torch.full((1, TOPK), 1.0 / TOPK, device="cuda")
        t2 = _us([lambda e=e: moe_mod.moe_ffn(x, w, e.view(1, TOPK), gate, up, down, E) for e in ids])
        print(f"moe_ffn (q4_k gate/up, {fmt} down), routed configs: {t2:.2f} us", flush=True)


def ffn():
    from llmkernels.qgemv import route

    g = torch.Generator().manual_seed(0)
    gate, up = (random_qtensor("q4_k", E * F, H, "cuda") for _ in range(2))
    for fmt in ("q4_k", "q6_k"):
        down = pad_rows(random_qtensor(fmt, E * H, F, "cuda"))
        for T in (1, 2, 4, 8, 16, 64, 512):
            ids = [torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(T)]).to(torch.int32).cuda()
                   for _ in range(SETS if T < 16 else 2)]
            w = torch.softmax(torch.randn(T, TOPK, device="cuda"), -1)
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            ref = moe_mod.moe_ffn(x, w, ids[0], gate, up, down, E).float()
            with route.override(exclude={"moe_tc"}):
                old = moe_mod.moe_ffn(x, w, ids[0], gate, up, down, E).float()
                t0 = _us([lambda e=e: moe_mod.moe_ffn(x, w, e, gate, up, down, E) for e in ids])
            t1 = _us([lambda e=e: moe_mod.moe_ffn(x, w, e, gate, up, down, E) for e in ids])
            with route.override(exclude={"moe_gemv", "moe_grouped"}):  # the tensor cores at every T
                t2 = _us([lambda e=e: moe_mod.moe_ffn(x, w, e, gate, up, down, E) for e in ids])
            err = ((ref - old).abs().max() / old.abs().max()).item()
            print(f"moe_ffn q4_k/{fmt} T={T}: without moe_tc {t0:8.1f} us | default {t1:8.1f} us ({t0 / t1:.2f}x, "
                  f"diff {err:.1e}) | tensor cores {t2:8.1f} us", flush=True)


TC_CONFIGS = [(32, 4, 1, 1), (64, 4, 1, 1), (128, 4, 1, 1), (64, 8, 1, 1), (128, 8, 1, 1), (256, 8, 1, 1),
              (64, 4, 1, 1, 0, 128), (128, 8, 1, 1, 0, 128)]


def sweep():
    from torch.profiler import ProfilerActivity, profile

    from llmkernels.qgemv import route

    g = torch.Generator().manual_seed(0)
    gate, up = (random_qtensor("q4_k", E * F, H, "cuda") for _ in range(2))
    real = route.moe_tc_config
    for fmt in ("q4_k", "q6_k"):
        down = pad_rows(random_qtensor(fmt, E * H, F, "cuda"))
        for T in (16, 64, 512):
            ids = [torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(T)]).to(torch.int32).cuda()
                   for _ in range(2)]
            w = torch.softmax(torch.randn(T, TOPK, device="cuda"), -1)
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            fns = [lambda e=e: moe_mod.moe_ffn(x, w, e, gate, up, down, E) for e in ids]
            base = _us(fns)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    fns[0]()
                torch.cuda.synchronize()
            parts = sorted(((e.device_time_total / 10, e.count // 10, e.key[:24]) for e in prof.key_averages()
                            if e.device_time_total > 0), reverse=True)
            print(f"{fmt} down, T={T}: default {base:.1f} us; " + ", ".join(f"{k} {t:.1f} (x{c})" for t, c, k in parts),
                  flush=True)
            for which in ("gate/up", "down"):
                row = []
                for cfg in TC_CONFIGS:
                    def pick(t, name, M, silu, *a, cfg=cfg, which=which):
                        return cfg if silu == (which == "down") else real(t, name, M, silu, *a)
                    route.moe_tc_config = pick
                    try:
                        row.append(f"{cfg}: {_us(fns):.1f}")
                    except Exception as exc:
                        row.append(f"{cfg}: {type(exc).__name__}")
                    finally:
                        route.moe_tc_config = real
                print(f"  {which}: " + " | ".join(row), flush=True)


if __name__ == "__main__":
    import sys

    {"ffn": ffn, "sweep": sweep}.get(sys.argv[1] if sys.argv[1:] else "", main)()
