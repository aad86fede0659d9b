"""Host time of one eager ``flash_attn_varlen`` call taken apart: each step the public call makes (checks, descales,
config lookup, descriptors, the V^T copy, the launch) timed alone over many calls while the GPU runs behind, for
bf16 and fp8 inputs at one shape; then the whole call, and cProfile's top entries for the fp8 call.

    PYTHONPATH=.:bench/lab python bench/lab/prefill_host_parts.py [--s 4096] [--causal] [--n 200]
"""
import argparse
import cProfile
import io
import pstats

import torch
from prefill_host import host_us

from llmkernels._checks import check_cu_seqlens
from llmkernels.attention import flash_attn_varlen, prefill, prefill_ws


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--s", type=int, default=4096)
    ap.add_argument("--h", type=int, default=32)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--n", type=int, default=200)
    a = ap.parse_args()
    S, H, D, n = a.s, a.h, a.d, a.n
    cu = torch.tensor([0, S], dtype=torch.int32, device="cuda")
    base = torch.randn(S, H, D, device="cuda", dtype=torch.bfloat16)
    print(f"S{S} H{H} D{D} {'causal' if a.causal else 'full'}, host us per call over {n} calls ({torch.cuda.get_device_name()})")
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        fp8 = dtype == torch.float8_e4m3fn
        q, k, v = (base.to(dtype) for _ in range(3))
        ds_t = dict(q_descale=torch.ones(1, device="cuda"), k_descale=torch.ones(1, device="cuda"),
                    v_descale=torch.ones(1, device="cuda")) if fp8 else {}
        ds_f = dict(q_descale=1.0, k_descale=1.0, v_descale=1.0) if fp8 else {}
        out = torch.empty(S, H, D, device="cuda", dtype=torch.bfloat16)
        ws = prefill.ws_config(dtype, D, a.causal)
        descales = prefill._descales(q, k, fp8, **(ds_t or dict(q_descale=None, k_descale=None, v_descale=None)))
        descs = prefill_ws.ws_descriptors(q, k, v, ws[0], cu, S, perm=ws[4])
        scale = D ** -0.5 * 1.4426950408889634
        parts = {
            "check_attention_inputs": lambda: prefill.check_attention_inputs(
                q, k, v, q_dtypes=(*prefill._DTYPES, prefill.FP8), kv_dtypes=(prefill.FP8,) if fp8 else prefill._DTYPES),
            "check_cu_seqlens x2": lambda: (check_cu_seqlens("cu_seqlens_q", cu, total=S, max_len=("m", S)),
                                            check_cu_seqlens("cu_seqlens_k", cu, batch=1, total=S, max_len=("m", S))),
            "output_buffers": lambda: prefill.output_buffers(q, None, False, torch.bfloat16 if fp8 else None),
            "ws_config": lambda: prefill.ws_config(dtype, D, a.causal),
            "_ws_eligible": lambda: prefill._ws_eligible(q, D, -1, 0, a.causal, 0.0, None, S * S * H),
            "ws_descriptors": lambda: prefill_ws.ws_descriptors(q, k, v, ws[0], cu, S, perm=ws[4]),
            "launch_ws": lambda: prefill_ws.launch_ws(descs, out, None, cu, cu, S, H, 1, scale, a.causal, *ws,
                                                      descales=descales),
        }
        if fp8:
            parts["_descales (tensors)"] = lambda: prefill._descales(q, k, True, **ds_t)
            parts["_descales (floats)"] = lambda: prefill._descales(q, k, True, **ds_f)
            parts["transpose_v"] = lambda: prefill_ws.transpose_v(v, cu, S, perm=bool(ws[4]))
        parts["whole call"] = lambda: flash_attn_varlen(q, k, v, cu, cu, S, S, causal=a.causal, **ds_t)
        if fp8:
            parts["whole call (float descales)"] = lambda: flash_attn_varlen(q, k, v, cu, cu, S, S, causal=a.causal,
                                                                             **ds_f)
        print(f"{'fp8' if fp8 else 'bf16'} (ws config {ws}):")
        for name, f in parts.items():
            print(f"  {name:30s} {host_us(f, n):8.1f}", flush=True)
        if fp8:
            pr = cProfile.Profile()
            torch.cuda.synchronize()
            pr.enable()
            for _ in range(n):
                flash_attn_varlen(q, k, v, cu, cu, S, S, causal=a.causal, **ds_f)
            pr.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
            print(s.getvalue())


if __name__ == "__main__":
    main()
