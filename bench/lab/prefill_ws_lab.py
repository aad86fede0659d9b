"""The Gluon prefill kernel's (BLOCK_N, STAGES, OVERLAP) candidates, bf16 and fp8, on the prefill suite's shapes.

    PYTHONPATH=. python bench/lab/prefill_ws_lab.py [--dtypes bf16,fp8] [--keys 128/full,...]

Each candidate is first checked on a ragged batch against the float64 reference (max abs error for bf16, relative
RMS for fp8 on the dequantized inputs), then timed next to SDPA cuDNN (bf16) on the same shapes. OVERLAP 1 runs
each block's softmax beside the previous block's PV product (prefill_ws._overlapped_step). ``--graph`` times our
calls by CUDA-graph replay (an eager fp8 call spends about as long on the host as its kernel runs); SDPA cuDNN is
timed eagerly.
"""
import argparse

import torch

import llmkernels as lk
from llmkernels.attention import prefill
from llmkernels.bench.anchors import sdpa_ms
from llmkernels.bench.harness import time_ms
from llmkernels.bench.suites.prefill import attention_flops, dense_inputs, varlen_lengths
from llmkernels.testing import flash_attn_varlen_ref
from llmkernels.tuning import OVERRIDES

SHAPES = {  # key -> [(B, H, S[, kv heads])] (as the prefill suite and prefill_lab.py)
    "128/full": [(1, 32, 4096), (1, 32, 16384)],
    "128/causal": [(1, 32, 4096), (1, 32, 16384), (1, 32, 8192, 8)],
    "64/full": [(4, 16, 4096)],
    "64/causal": [(4, 16, 4096)],
    "256/full": [(1, 16, 8192)],
    "256/causal": [(1, 16, 8192)],
}
CANDIDATES = {
    "bf16": {128: [(128, 2, 0), (128, 2, 1), (128, 3, 1), (64, 4, 1)], 64: [(128, 3, 0), (128, 3, 1), (128, 4, 1)],
             256: [(64, 2, 0), (64, 2, 1)]},
    "fp8": {128: [(256, 2, 0), (128, 2, 0), (128, 2, 1), (128, 3, 1), (128, 4, 1)],
            64: [(128, 2, 0), (128, 3, 1), (128, 4, 1)], 256: [(128, 2, 0), (64, 2, 1), (64, 3, 1)]},
}
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def _check(dtype, D, causal):
    lens = [1, 63, 64, 65, 300, 1000, 777]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).cuda()
    q, k, v = (torch.randn(int(cu[-1]), h, D, device="cuda").to(dtype) for h in (8, 2, 2))
    out = torch.full(q.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    lk.flash_attn_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=causal, out=out)
    ref, _ = flash_attn_varlen_ref(q.float(), k.float(), v.float(), cu, cu, causal=causal)
    e = out.double() - ref.double()
    if dtype == torch.bfloat16:
        return f"max err {e.abs().max().item():.1e}"
    return f"rel rms {(e.pow(2).mean() / ref.double().pow(2).mean()).sqrt().item():.4f}"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtypes", default="bf16,fp8")
    p.add_argument("--keys", default=",".join(SHAPES))
    p.add_argument("--cands", default="", help="replace the candidates, e.g. 128:128/3/1+128/2/1;256:64/2/1")
    p.add_argument("--graph", action="store_true")
    args = p.parse_args()
    prefill.WS_MIN_WORK = 0
    for part in filter(None, args.cands.split(";")):
        d, cs = part.split(":")
        for name in CANDIDATES:
            CANDIDATES[name][int(d)] = [tuple(int(x) for x in c.split("/")) for c in cs.split("+")]
    cudnn = {}
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        for key in args.keys.split(","):
            D, causal = int(key.split("/")[0]), key.endswith("causal")
            tkey = ("prefill", f"{str(dtype).replace('torch.', '')}/{key}/ws")
            for cfg in CANDIDATES[name][D]:
                OVERRIDES[tkey] = list(cfg)
                try:
                    err = _check(dtype, D, causal)
                except Exception as e:  # a candidate that does not fit is reported, not fatal
                    print(f"{name} {key} {cfg}: failed {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                cells = []
                for B, H, S, *kv in SHAPES[key]:
                    Hkv = kv[0] if kv else H
                    q, k, v, cu = dense_inputs(B, H, Hkv, S, D)
                    kw = {}
                    if dtype != torch.bfloat16:
                        ds = torch.ones(1, device="cuda")
                        kw = {"q_descale": ds, "k_descale": ds, "v_descale": ds}
                    qx, kx, vx = (t.to(dtype) for t in (q, k, v))
                    flops = attention_flops([S] * B, H, D, causal)
                    ms = time_ms(lambda: lk.flash_attn_varlen(qx, kx, vx, cu, cu, S, S, causal=causal, **kw),
                                 cuda_graph=args.graph)
                    case = (B, H, Hkv, S, D, causal)
                    if case not in cudnn:
                        qd, kd, vd = (t.view(B, S, -1, D).transpose(1, 2) for t in (q, k, v))
                        cudnn[case] = flops / sdpa_ms(qd, kd, vd, causal=causal, backend="cudnn") / 1e9
                    tf = flops / ms / 1e9
                    cells.append(f"B{B} H{H}/{Hkv} S{S}: {tf:.0f} ({tf / cudnn[case]:.3f}x cuDNN bf16)")
                if key == "128/causal" and dtype == torch.bfloat16:
                    lens = varlen_lengths()
                    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).cuda()
                    q, k, v = (torch.randn(int(cu[-1]), 32, 128, device="cuda", dtype=dtype) for _ in range(3))
                    ms = time_ms(lambda: lk.flash_attn_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True))
                    cells.append(f"varlen 16: {attention_flops(lens, 32, 128, True) / ms / 1e9:.0f}")
                print(f"{name} {key} {cfg} {err} | " + " | ".join(cells), flush=True)
            OVERRIDES.pop(tkey, None)


if __name__ == "__main__":
    main()
