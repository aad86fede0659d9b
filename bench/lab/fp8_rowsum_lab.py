"""fp8 prefill's two options side by side: the softmax's row sums on the tensor cores
(``prefill_ws.FP8_ROWSUM``) and V^T's and P's keys permuted so that P V's operand needs no shuffles (the table
entry's PERM): off, each alone and both, twice, each run checked against the float64 reference on a ragged batch
with one long row, then timed as the prefill suite times (``time_ms``), TFLOP/s, on the table's config for each
shape with its PERM replaced.

    PYTHONPATH=.:bench/lab python bench/lab/fp8_rowsum_lab.py [--shapes 0,1,3,5,6,7,8] [--rep 60]
"""
import argparse

import torch

import llmkernels as lk
from llmkernels.attention import prefill, prefill_ws
from llmkernels.bench.harness import time_ms
from llmkernels.bench.suites.prefill import attention_flops, dense_inputs
from llmkernels.tuning import OVERRIDES
from prefill_persist_lab import SHAPES, _check


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="0,1,3,5,6,7,8")
    p.add_argument("--rep", type=float, default=60)
    args = p.parse_args()
    prefill.WS_MIN_WORK = 0
    print(torch.cuda.get_device_name(), flush=True)
    for i in map(int, args.shapes.split(",")):
        B, H, Hkv, S, D, causal = SHAPES[i]
        q, k, v, cu = (t.to(torch.float8_e4m3fn) if t.is_floating_point() else t for t in dense_inputs(B, H, Hkv, S, D))
        ds = torch.ones(1, device="cuda")
        flops = attention_flops([S] * B, H, D, causal)
        line = []
        config = list(prefill.ws_config(torch.float8_e4m3fn, D, causal))
        key = ("prefill", f"float8_e4m3fn/{D}/{'causal' if causal else 'full'}/ws")
        for rowsum, perm in ((0, 0), (1, 0), (0, 1), (1, 1)) * 2:
            prefill_ws.FP8_ROWSUM = bool(rowsum)
            OVERRIDES[key] = config[:4] + [perm]
            err = _check(torch.float8_e4m3fn, D, causal)
            ms = time_ms(lambda: lk.flash_attn_varlen(q, k, v, cu, cu, S, S, causal=causal, q_descale=ds,
                                                      k_descale=ds, v_descale=ds), rep_ms=args.rep)
            line.append(f"rowsum {rowsum} perm {perm}: {flops / ms / 1e9:.0f} {err}")
        del OVERRIDES[key]
        print(f"fp8 B{B} H{H}/{Hkv} S{S} D{D} {'causal' if causal else 'full'} config {config[:4]} | "
              + " | ".join(line), flush=True)


if __name__ == "__main__":
    main()
