"""Suite ``gemv``: quantized GEMV in effective TB/s (stored weight bytes + activations) at Llama-3-8B shapes,
against cuBLAS f16 (x @ w.T) and torch._weight_int4pack_mm (4-bit, group 128) on the same shapes."""
from __future__ import annotations

import torch

from ...qgemv import gate_up_silu, gemv, silu_mul_gemv
from ...qgemv.int8 import quantize_act
from ...qgemv.m1 import lane_order
from ...qgemv.ops import gemv_i8_lanes, gemv_lanes
from ...testing.random_weights import random_qtensor
from ..anchors import make_int4pack
from ..harness import Row, copies_for, time_graph_ms

SHAPES = [(4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]
FORMATS = [("q4_0", {}), ("q4_k", {}), ("q5_k", {}), ("q6_k", {}), ("q8_0", {}), ("mlx", dict(bits=4, group_size=64)),
           ("f16", {}), ("iq4_xs", {}), ("mxfp4", {}),  # the codebook formats: the generic kernel
           # gemv(act_int8=True): activations rounded to int8 per block of 32, integer dot products (qgemv/int8.py;
           # M = 1 only, see route.I8_MAX_M: larger M computes exactly)
           ("q4_0", dict(act_int8=True)), ("q8_0", dict(act_int8=True)), ("q4_k", dict(act_int8=True)),
           ("q5_k", dict(act_int8=True)), ("q6_k", dict(act_int8=True)),
           # ops.gemv_lanes at M = 1: x handed over in lane order as well, as the engine's RMSNorm and SiLU kernels
           # write it (the copy into lane order is not timed: there it costs a second store in a kernel that runs
           # anyway)
           ("q4_k", dict(lanes=True)),
           # ops.gemv_i8_lanes at M = 1: x handed over rounded to int8 in i8 lane order, as the engine's RMSNorm
           # writes it with act_int8 (the rounding is not timed)
           ("q4_k", dict(act_int8=True, lanes=True)), ("q5_k", dict(act_int8=True, lanes=True)),
           ("q6_k", dict(act_int8=True, lanes=True))]
MS = [1, 2, 4, 8, 16]


def _shape_case(ctx, N, K, formats, ms):
    """Times are CUDA-graph replays rotating over enough weight copies to overflow L2 (see harness)."""
    def run():
        rows = []
        anchor_ms = {}
        n16 = copies_for(N * K * 2)
        wfs = [torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02 for _ in range(n16)]
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.float16)
            anchor_ms[("cublas_f16", M)] = (time_graph_ms([lambda w=w: x @ w.T for w in wfs]), N * K * 2)
        n4 = copies_for(N * K // 2)
        packs = [make_int4pack(wfs[i % n16].to(torch.bfloat16)) for i in range(n4)]
        del wfs
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            try:
                t = time_graph_ms([lambda p=p: torch._weight_int4pack_mm(x, p[0], 128, p[1]) for p in packs])
                anchor_ms[("int4pack_mm", M)] = (t, N * K // 2 + packs[0][1].numel() * 2)
            except RuntimeError:
                pass
        del packs
        for fmt, kw in formats:
            i8 = kw.get("act_int8", False)
            lanes = kw.get("lanes", False)
            kw = {k: v for k, v in kw.items() if k not in ("act_int8", "lanes")}
            first = random_qtensor(fmt, N, K, "cuda", **kw)
            qts = [first] + [random_qtensor(fmt, N, K, "cuda", **kw) for _ in range(copies_for(first.nbytes) - 1)]
            label = (fmt if fmt != "mlx" else f"mlx{kw['bits']}g{kw['group_size']}") + (" act_int8" if i8 else "") \
                + (" lanes" if lanes else "")
            for M in ms if not lanes else [1]:
                x = torch.randn(M, K, device="cuda", dtype=torch.float16)
                if lanes and i8:
                    xq, ds = quantize_act(x, lanes=True)
                    t = time_graph_ms([lambda qt=qt: gemv_i8_lanes(xq, ds, qt, x.dtype) for qt in qts])
                elif lanes:
                    xl = lane_order(x)
                    t = time_graph_ms([lambda qt=qt: gemv_lanes(x, xl, qt) for qt in qts])
                else:
                    t = time_graph_ms([lambda qt=qt: gemv(x, qt, act_int8=i8) for qt in qts])
                act = M * K * 2 + M * N * 2
                ours = (first.nbytes + act) / (t * 1e-3) / 1e12
                anchors, ratio = {}, {}
                for name in ("cublas_f16", "int4pack_mm"):
                    if (name, M) in anchor_ms:
                        ta, wbytes = anchor_ms[(name, M)]
                        anchors[name] = (wbytes + act) / (ta * 1e-3) / 1e12
                        ratio[name] = ta / t
                row = Row("gemv", f"{label} N{N} K{K} M{M}", "TB/s", ours, ctx.bw_pct(ours), anchors)
                row.time_ratio = ratio
                row.note = f"{t * 1e3:.1f} us; time ratio " + ", ".join(f"{k} {v:.2f}x" for k, v in ratio.items())
                rows.append(row)
            del qts, first
        return rows
    return run


def _silu_case(ctx):
    def run():
        N, K = 4096, 14336
        qts = [random_qtensor("q4_k", N, K, "cuda") for _ in range(8)]
        gate = torch.randn(1, K, device="cuda", dtype=torch.float16)
        up = torch.randn(1, K, device="cuda", dtype=torch.float16)
        fused = time_graph_ms([lambda qt=qt: silu_mul_gemv(gate, up, qt) for qt in qts])
        two_step = time_graph_ms([lambda qt=qt: gemv(torch.nn.functional.silu(gate) * up, qt) for qt in qts])
        nbytes = qts[0].nbytes + 2 * K * 2 + N * 2
        ours = nbytes / (fused * 1e-3) / 1e12
        name = f"silu_mul q4_k N{N} K{K} M1 (fused vs two-step)"
        row = Row("gemv", name, "TB/s", ours, ctx.bw_pct(ours), {"two_step": nbytes / (two_step * 1e-3) / 1e12})
        row.time_ratio = {"two_step": two_step / fused}
        row.note = f"two-step {two_step * 1e3:.1f} us, fused {fused * 1e3:.1f} us"
        return row
    return run


def _gate_up_case(ctx):
    """gate_up_silu (one pass over both matrices) against two gemv calls and torch's silu * up, q4_k, M = 1."""
    def run():
        N, K = 14336, 4096
        pairs = [(random_qtensor("q4_k", N, K, "cuda"), random_qtensor("q4_k", N, K, "cuda")) for _ in range(4)]
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        fused = time_graph_ms([lambda g=g, u=u: gate_up_silu(x, g, u) for g, u in pairs])
        two_step = time_graph_ms([lambda g=g, u=u: torch.nn.functional.silu(gemv(x, g)) * gemv(x, u)
                                  for g, u in pairs])
        nbytes = 2 * pairs[0][0].nbytes + K * 2 + N * 2
        ours = nbytes / (fused * 1e-3) / 1e12
        row = Row("gemv", f"gate_up_silu q4_k N{N} K{K} M1 bf16 (fused vs two gemv + silu*up)", "TB/s", ours,
                  ctx.bw_pct(ours), {"two_step": nbytes / (two_step * 1e-3) / 1e12})
        row.time_ratio = {"two_step": two_step / fused}
        row.note = f"two-step {two_step * 1e3:.1f} us, fused {fused * 1e3:.1f} us"
        return row
    return run


def cases(ctx):
    out = []
    for N, K in SHAPES:
        fmts = FORMATS if not ctx.quick else FORMATS[:2]
        out.append((f"N{N} K{K}", _shape_case(ctx, N, K, fmts, MS if not ctx.quick else [1, 8])))
    out.append(("silu_mul", _silu_case(ctx)))
    out.append(("gate_up_silu", _gate_up_case(ctx)))
    return out
