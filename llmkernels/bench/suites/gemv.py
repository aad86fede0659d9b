"""Suite ``gemv``: quantized GEMV in effective TB/s (stored weight bytes + activations) at Llama-3-8B shapes,
against cuBLAS f16 (x @ w.T) and torch._weight_int4pack_mm (4-bit, group 128) on the same shapes."""
from __future__ import annotations

import torch

from ...gemv import gemv, silu_mul_gemv
from ...testing.random_weights import random_qtensor
from ..anchors import cublas_ms, int4pack_ms, make_int4pack
from ..harness import Row, time_ms

SHAPES = [(4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]
FORMATS = [("q4_0", {}), ("q4_k", {}), ("q5_k", {}), ("q6_k", {}), ("q8_0", {}), ("mlx", dict(bits=4, group_size=64)),
           ("f16", {})]
MS = [1, 2, 4, 8, 16]


def _shape_case(ctx, N, K, formats, ms):
    def run():
        rows = []
        wf = torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
        anchor_ms = {}
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.float16)
            anchor_ms[("cublas_f16", M)] = (cublas_ms(x, wf), N * K * 2)
        wq, sz = make_int4pack(wf.to(torch.bfloat16))
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            t = int4pack_ms(x, wq, sz)
            if t is not None:
                anchor_ms[("int4pack_mm", M)] = (t, N * K // 2 + sz.numel() * 2)
        del wf, wq
        for fmt, kw in formats:
            qt = random_qtensor(fmt, N, K, "cuda", **kw)
            label = fmt if fmt != "mlx" else f"mlx{kw['bits']}g{kw['group_size']}"
            for M in ms:
                x = torch.randn(M, K, device="cuda", dtype=torch.float16)
                t = time_ms(lambda: gemv(x, qt))
                act = M * K * 2 + M * N * 2
                ours = (qt.nbytes + act) / (t * 1e-3) / 1e12
                anchors, ratio = {}, {}
                for name in ("cublas_f16", "int4pack_mm"):
                    if (name, M) in anchor_ms:
                        ta, wbytes = anchor_ms[(name, M)]
                        anchors[name] = (wbytes + act) / (ta * 1e-3) / 1e12
                        ratio[name] = ta / t
                row = Row("gemv", f"{label} N{N} K{K} M{M}", "TB/s", ours, ctx.bw_pct(ours), anchors)
                row.time_ratio = ratio
                row.note = "time ratio " + ", ".join(f"{k} {v:.2f}x" for k, v in ratio.items())
                rows.append(row)
            del qt
        return rows
    return run


def _silu_case(ctx):
    def run():
        N, K = 4096, 14336
        qt = random_qtensor("q4_k", N, K, "cuda")
        gate = torch.randn(1, K, device="cuda", dtype=torch.float16)
        up = torch.randn(1, K, device="cuda", dtype=torch.float16)
        fused = time_ms(lambda: silu_mul_gemv(gate, up, qt))
        two_step = time_ms(lambda: gemv(torch.nn.functional.silu(gate) * up, qt))
        nbytes = qt.nbytes + 2 * K * 2 + N * 2
        ours = nbytes / (fused * 1e-3) / 1e12
        row = Row("gemv", f"silu_mul q4_k N{N} K{K} M1 (fused vs two-step)", "TB/s", ours, ctx.bw_pct(ours),
                  {"two_step": nbytes / (two_step * 1e-3) / 1e12})
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
    return out
