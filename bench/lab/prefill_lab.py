"""Prefill attention experiments on the GPU: (BLOCK_M, BLOCK_N, warps, stages, FOLD_SCALE, TMA) per tuning key.

    python bench/lab/prefill_lab.py [--keys 128/full,128/causal] [--configs 128/64/8/3/1,...] [--budget SECONDS]
    ncu --clock-control none -k regex:flash_fwd --launch-skip 2 --launch-count 1 --section SpeedOfLight \
        --section MemoryWorkloadAnalysis python bench/lab/prefill_lab.py --eager --keys 128/full

Each candidate is checked once against the float64 reference (a ragged bf16 batch, causal and not), then timed at
the prefill suite's shapes for its key, next to SDPA cuDNN on the same inputs. Prints TFLOP/s and the ratio to
cuDNN. FOLD_SCALE 1 runs key blocks that every query sees through ``_prefill_full`` (attention/prefill_kernel.py);
TMA 1 loads that loop's K/V tiles through tensor descriptors.
A varlen batch (16 causal sequences, lengths 100..8000, as in the bench suite) is timed with the causal keys.
"""
import argparse
import time

import torch

from llmkernels.attention import flash_attn_varlen
from llmkernels.bench.anchors import sdpa_ms
from llmkernels.bench.harness import time_ms
from llmkernels.bench.suites.prefill import attention_flops, dense_inputs, varlen_lengths
from llmkernels.testing import flash_attn_varlen_ref
from llmkernels.tuning import OVERRIDES

# key -> [(B, Hq, Hkv, S, D)] timed for it
SHAPES = {
    "128/full": [(1, 32, 32, 4096, 128), (1, 32, 32, 16384, 128)],
    "128/causal": [(1, 32, 32, 4096, 128), (1, 32, 32, 16384, 128), (1, 32, 8, 8192, 128)],
    "64/full": [(4, 16, 16, 4096, 64)],
    "64/causal": [(4, 16, 16, 4096, 64)],
    "256/full": [(1, 16, 16, 8192, 256)],
    "256/causal": [(1, 16, 16, 8192, 256)],
}
CONFIGS = {
    128: [(128, 64, 8, 4, 1, 0), (128, 128, 8, 3, 1, 0), (128, 64, 8, 4, 1, 1), (128, 64, 8, 3, 1, 1),
          (128, 128, 8, 3, 1, 1), (128, 128, 8, 2, 1, 1)],
    64: [(128, 64, 8, 3, 1, 0), (128, 64, 8, 3, 1, 1), (128, 128, 8, 3, 1, 1), (128, 64, 8, 4, 1, 1)],
    256: [(128, 64, 8, 2, 0, 0), (128, 64, 8, 2, 1, 1), (64, 64, 4, 2, 1, 1), (64, 64, 4, 3, 1, 1)],
}


def _check(D, causal):
    lens = [1, 63, 64, 65, 300, 1000, 777]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).cuda()
    q = torch.randn(int(cu[-1]), 8, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(int(cu[-1]), 2, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(int(cu[-1]), 2, D, device="cuda", dtype=torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    flash_attn_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=causal, out=out)
    ref, _ = flash_attn_varlen_ref(q, k, v, cu, cu, causal=causal)
    return (out.double() - ref).abs().max().item()


def _time(B, Hq, Hkv, S, D, causal, cudnn_cache):
    q, k, v, cu = dense_inputs(B, Hq, Hkv, S, D)
    ms = time_ms(lambda: flash_attn_varlen(q, k, v, cu, cu, S, S, causal=causal))
    flops = attention_flops([S] * B, Hq, D, causal)
    key = (B, Hq, Hkv, S, D, causal)
    if key not in cudnn_cache:
        qd, kd, vd = (t.view(B, S, -1, D).transpose(1, 2) for t in (q, k, v))
        a = sdpa_ms(qd, kd, vd, causal=causal, backend="cudnn")
        cudnn_cache[key] = flops / (a * 1e-3) / 1e12 if a else None
    return flops / (ms * 1e-3) / 1e12, cudnn_cache[key]


def _varlen():
    lens = varlen_lengths()  # the bench suite's batch
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).cuda()
    q, k, v = (torch.randn(int(cu[-1]), 32, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ms = time_ms(lambda: flash_attn_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True))
    return attention_flops(lens, 32, 128, True) / (ms * 1e-3) / 1e12


def _warm_up(seconds=3.0):
    """Busy the GPU first so clocks have ramped before the first timed config."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t0 = time.time()
    while time.time() - t0 < seconds:
        a @ a
        torch.cuda.synchronize()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--keys", default="128/full,128/causal,64/full,64/causal,256/full,256/causal")
    p.add_argument("--configs", default="",
                   help="only these, e.g. 128/64/8/3/1/1 (BLOCK_M/BLOCK_N/warps/stages/FOLD_SCALE/TMA)")
    p.add_argument("--budget", type=float, default=500.0, help="stop starting new configs after this many seconds")
    p.add_argument("--eager", action="store_true", help="run the keys' shapes 3 times each with the tuned table, "
                   "no timing or checks (for ncu)")
    args = p.parse_args()
    if args.eager:
        for key in args.keys.split(","):
            for B, Hq, Hkv, S, D in SHAPES[key]:
                q, k, v, cu = dense_inputs(B, Hq, Hkv, S, D)
                for _ in range(3):
                    flash_attn_varlen(q, k, v, cu, cu, S, S, causal=key.endswith("causal"))
                torch.cuda.synchronize()
                print(f"ran {key} B{B} H{Hq}/{Hkv} S{S}", flush=True)
        return
    _warm_up()
    t0 = time.time()
    cudnn = {}
    only = [tuple(int(x) for x in c.split("/")) for c in args.configs.split(",") if c]
    for key in args.keys.split(","):
        D = int(key.split("/")[0])
        causal = key.endswith("causal")
        tkey = ("prefill", f"bfloat16/{D}/{'causal' if causal else 'full'}")
        for cfg in only or CONFIGS[D]:
            if time.time() - t0 > args.budget:
                print("budget spent", flush=True)
                return
            OVERRIDES[tkey] = cfg
            try:
                err = _check(D, causal)
            except Exception as e:  # a config that does not fit (shared memory, registers) is reported, not fatal
                print(f"{key} {cfg}: failed {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            cells = []
            for B, Hq, Hkv, S, D_ in SHAPES[key]:
                tf, cd = _time(B, Hq, Hkv, S, D_, causal, cudnn)
                ratio = f" {tf / cd:.2f}x cuDNN" if cd else ""
                cells.append(f"B{B} H{Hq}/{Hkv} S{S}: {tf:.0f}{ratio}")
            if key == "128/causal":
                cells.append(f"varlen 16: {_varlen():.0f}")
            print(f"{key} {cfg} err {err:.1e} | " + " | ".join(cells), flush=True)
        OVERRIDES.pop(tkey, None)
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
