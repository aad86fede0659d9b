"""Batch-1 GEMVs of one model shape, each matrix as the engine stores it (Q4_K_M mix), timed alone: the route
gemv takes, microseconds per call (CUDA-graph replay over enough copies to overflow L2) and the fraction of the
read bandwidth. With ``--sweep``, every m1-kernel matrix is also timed under each of the tuner's m1 candidates.

    PYTHONPATH=. python bench/lab/family_gemv.py [gemma2-9b|llama3-8b|qwen3-30b-a3b ...] [--sweep]

The matrices are those of one layer with q4_k attn_v / ffn_down, one with q6_k ones, and the output matrix; fused
QKV and gate/up as the engine stacks them (one matrix where the pieces share a format).
"""
import argparse

import torch

from llmkernels.bench.harness import copies_for, measure_read_bandwidth, time_graph_ms
from llmkernels.bench.suites.families import FAMILIES
from llmkernels.engine.convert import mix_format
from llmkernels.qgemv import gemv
from llmkernels.qgemv import route as R
from llmkernels.qgemv.route import choose
from llmkernels.testing.random_weights import random_qtensor
from llmkernels.tuning import OVERRIDES
from llmkernels.tuning.tune import LANE_CANDIDATES, M1_CANDIDATES, Q6_M1_CANDIDATES

SHAPES = dict(FAMILIES, **{"llama3-8b": dict(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, head_dim=128,
                                             vocab=128256, meta={})})


def matrices(spec):
    """[(label, N, K, format)] of a dense family's layer 0 (q4_k pieces), a more-bits layer (q6_k attn_v /
    ffn_down) and the output matrix."""
    L, H, D, F = spec["layers"], spec["hidden"], spec["head_dim"], spec["ffn"]
    q, kv = spec["heads"] * D, spec["kv_heads"] * D
    out = []
    for li in (L // 8, 0):  # llama.cpp's more_bits: layer 0 keeps attn_v / ffn_down in q6_k, layer L // 8 does not
        f = {n: mix_format("q4_k_m", f"blk.{li}.{n}.weight", L) for n in ("attn_q", "attn_v", "ffn_down")}
        tag = f"layer {li}"
        if f["attn_v"] == f["attn_q"]:
            out.append((f"{tag} qkv", q + 2 * kv, H, f["attn_q"]))
        else:
            out += [(f"{tag} qk", q + kv, H, f["attn_q"]), (f"{tag} v", kv, H, f["attn_v"])]
        out += [(f"{tag} o", H, q, f["attn_q"]), (f"{tag} gate_up", 2 * F, H, f["attn_q"]),
                (f"{tag} down", H, F, f["ffn_down"])]
    out.append(("output", spec["vocab"], spec["hidden"], mix_format("q4_k_m", "output.weight", L)))
    return out


# beyond the tuner's lists: other K splits (waves, the last field) and, for m1, 2 or 4 lanes along K
LANE_MORE = [(2, 1, 4, 3, 8, 1, 3), (2, 1, 4, 3, 8, 1, 4), (4, 1, 4, 3, 8, 1, 2), (1, 1, 4, 3, 8, 1, 2)]
M1_MORE = [(4, 1, 4, 3, 2, 4, 2), (2, 1, 4, 3, 2, 4, 2), (4, 1, 4, 3, 4, 2, 2), (8, 1, 4, 3, 2, 4, 2)]


def _alternatives(x, qts, nbytes, bw, picked):
    """The matrix on every other kernel that reads it: m1 under each M1 candidate (lanes and tc excluded), tc, and
    the lane kernel under each LANE_CANDIDATE."""
    fns = [lambda qt=qt: gemv(x, qt) for qt in qts]
    runs = [("tc", {"lanes", "m1"}, [None])] if picked != "tc" else []
    runs += [("m1", {"lanes", "tc"}, M1_CANDIDATES + M1_MORE), ("lanes", {"tc"}, LANE_CANDIDATES + LANE_MORE)]
    for kernel, exclude, cands in runs:
        for c in cands:
            key = R.m1_key("q4_k", 1) if kernel == "m1" else "lanes/q4_k"
            if c is not None:
                OVERRIDES[("gemv", key)] = list(c)
            try:
                with R.override(exclude=exclude):
                    got = choose("gemv", "q4_k", 1, qts[0].shape[0], qts[0].shape[1], torch.bfloat16).kernel
                    t = time_graph_ms(fns) * 1e3
                print(f"    {got} {c}: {t:7.1f} us {100 * nbytes / bw / (t * 1e-6):5.1f}%", flush=True)
            except Exception as e:  # a config the kernel does not take at this shape
                print(f"    {kernel} {c}: {type(e).__name__}: {str(e)[:80]}", flush=True)
            finally:
                OVERRIDES.pop(("gemv", key), None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=["gemma2-9b", "llama3-8b"])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--alt", action="store_true", help="also time each q4_k matrix on the kernels gemv did not pick "
                    "(m1 under each of its candidates, tc, lanes)")
    args = ap.parse_args()
    bw = measure_read_bandwidth() * 1e12
    print(f"{torch.cuda.get_device_name()}, read bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    for name in args.models:
        spec = SHAPES[name]
        if spec["meta"].get("expert_count"):
            raise SystemExit(f"{name}: MoE shapes are profiled with tools/profile_decode.py")
        total_us = total_bytes = 0.0
        for label, N, K, fmt in matrices(spec):
            first = random_qtensor(fmt, N, K, "cuda", scale=0.02)
            qts = [first] + [random_qtensor(fmt, N, K, "cuda", scale=0.02) for _ in range(copies_for(first.nbytes) - 1)]
            x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
            r = choose("gemv", fmt, 1, N, K, torch.bfloat16)
            us = time_graph_ms([lambda qt=qt: gemv(x, qt) for qt in qts]) * 1e3
            pct = 100 * first.nbytes / bw / (us * 1e-6)
            total_us += us
            total_bytes += first.nbytes
            print(f"{name} {label:15s} [{N:6d} x {K:5d}] {fmt:5s} {first.nbytes / 1e6:7.1f} MB  {us:7.1f} us "
                  f"{pct:5.1f}%  {r.kernel} {r.config}", flush=True)
            if args.sweep and r.kernel in ("m1", "lanes"):
                key = R.m1_key(fmt, 1) if r.kernel == "m1" else "lanes/q4_k"
                cands = (LANE_CANDIDATES if r.kernel == "lanes" else Q6_M1_CANDIDATES if fmt == "q6_k"
                         else M1_CANDIDATES)
                for c in cands:
                    OVERRIDES[("gemv", key)] = list(c)
                    try:
                        t = time_graph_ms([lambda qt=qt: gemv(x, qt) for qt in qts]) * 1e3
                        print(f"    {key} {c}: {t:7.1f} us {100 * first.nbytes / bw / (t * 1e-6):5.1f}%", flush=True)
                    except Exception as e:  # a config the kernel does not take at this shape
                        print(f"    {key} {c}: {type(e).__name__}: {str(e)[:80]}", flush=True)
                    finally:
                        OVERRIDES.pop(("gemv", key), None)
            if args.alt and fmt == "q4_k":
                _alternatives(x, qts, first.nbytes, bw, r.kernel)
            del qts
        print(f"{name}: the listed matrices {total_bytes / 1e6:.0f} MB in {total_us:.0f} us, "
              f"{100 * total_bytes / bw / (total_us * 1e-6):.1f}% of the bandwidth", flush=True)


if __name__ == "__main__":
    main()
