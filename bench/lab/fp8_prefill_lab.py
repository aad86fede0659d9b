"""fp8 prefill: the error of the fp8 tensor-core kernel (P rounded to e4m3) and of the widening Triton kernel against
float64 on the dequantized inputs, then the Gluon kernel's (BLOCK_N, STAGES) candidates and the V^T copy timed on
the bench shapes.

    PYTHONPATH=. python bench/lab/fp8_prefill_lab.py [error] [sweep]
"""
import sys

import torch

import llmkernels as lk
from llmkernels.attention import prefill
from llmkernels.attention.prefill_ws import transpose_v
from llmkernels.bench.harness import time_ms
from llmkernels.bench.suites.prefill import attention_flops, dense_inputs
from llmkernels.testing import flash_attn_varlen_ref
from llmkernels.tuning import OVERRIDES


def _key(D, causal):
    return ("prefill", f"float8_e4m3fn/{D}/{'causal' if causal else 'full'}/ws")


def error():
    torch.manual_seed(0)
    prefill.WS_MIN_WORK = 0
    for S, H, D in ((4096, 4, 128), (1000, 4, 128), (4096, 4, 256), (300, 4, 64)):
        q8, k8, v8 = (torch.randn(S, H, D, device="cuda").to(torch.float8_e4m3fn) for _ in range(3))
        cu = torch.tensor([0, S], dtype=torch.int32, device="cuda")
        for causal in (False, True):
            ref, _ = flash_attn_varlen_ref(q8.float(), k8.float(), v8.float(), cu, cu, causal=causal)
            ref = ref.double().cuda()
            line = []
            for name, cfg in (("fp8 wgmma", None), ("widening", [0, 0])):
                if cfg is not None:
                    OVERRIDES[_key(D, causal)] = cfg
                e = lk.flash_attn_varlen(q8, k8, v8, cu, cu, S, S, causal=causal).double() - ref
                OVERRIDES.pop(_key(D, causal), None)
                line.append(f"{name}: max {e.abs().max().item():.4f} "
                            f"rel rms {(e.pow(2).mean() / ref.pow(2).mean()).sqrt().item():.4f}")
            print(f"S{S} H{H} D{D} causal={causal}  " + "  ".join(line), flush=True)


def sweep():
    for B, H, S, D in ((1, 32, 4096, 128), (1, 32, 16384, 128), (1, 16, 8192, 256), (1, 16, 4096, 256)):
        q, k, v, cu = dense_inputs(B, H, H, S, D)
        q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
        ds = torch.ones(1, device="cuda")
        t = time_ms(lambda: transpose_v(v8, cu, S))
        print(f"S{S} H{H} D{D} transpose_v {t * 1e3:.1f} us ({2 * v8.numel() / t / 1e9:.2f} TB/s)", flush=True)
        cands = [(64, 2), (64, 3), (128, 2)] if D == 256 else [(128, 2), (128, 3), (128, 4), (256, 2)]
        for causal in (False, True):
            flops = attention_flops([S] * B, H, D, causal)
            line = []
            for c in cands:
                OVERRIDES[_key(D, causal)] = list(c)
                ms = time_ms(lambda: lk.flash_attn_varlen(q8, k8, v8, cu, cu, S, S, causal=causal, q_descale=ds,
                                                          k_descale=ds, v_descale=ds))
                line.append(f"{c}: {flops / ms / 1e9:.0f}")
            OVERRIDES.pop(_key(D, causal), None)
            print(f"S{S} H{H} D{D} causal={causal} TFLOP/s  " + "  ".join(line), flush=True)


if __name__ == "__main__":
    parts = sys.argv[1:] or ["error", "sweep"]
    for p in parts:
        {"error": error, "sweep": sweep}[p]()
