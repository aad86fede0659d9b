"""The Gluon prefill kernel one program per tile against a persistent grid (one program per SM looping over the
tiles, 1 or 2 Q buffers), bf16 and fp8, on the prefill suite's shapes and a few longer ones.

    PYTHONPATH=.:bench/lab python bench/lab/prefill_persist_lab.py [--dtypes fp8,bf16] [--shapes 0,2]

A variant is (BLOCK_N, STAGES, OVERLAP, PERSIST) as in the table ((0, 0, 0, 0): the Triton kernel). ``--baseline MODULE`` also times a copy of
an earlier prefill_ws.py importable as llmkernels.attention.MODULE (its launch_ws without persist). Each variant
is checked first on a ragged batch against the float64 reference, then timed as the prefill suite times
(``time_ms``: eager, L2 flushed), in TFLOP/s, with SDPA cuDNN on the bf16 inputs beside it. ``--pick DIR``
writes, for each table key run, the variant with the best geometric mean over that key's shapes (among those
that passed the check) to DIR/prefill.json under this GPU's name, a user table (``LLMKERNELS_TUNING_DIR=DIR``)
that a bench run in the same call then uses.
"""
import argparse
import importlib
import json
import math
import os

import torch

import llmkernels as lk
from llmkernels.attention import prefill, prefill_ws
from llmkernels.bench.anchors import sdpa_ms
from llmkernels.bench.harness import time_ms
from llmkernels.bench.suites.prefill import attention_flops, dense_inputs
from llmkernels.testing import flash_attn_varlen_ref
from llmkernels.tuning import OVERRIDES

SHAPES = [  # (B, H, Hkv, S, D, causal)
    (1, 32, 32, 4096, 128, False), (1, 32, 32, 4096, 128, True), (1, 32, 32, 16384, 128, False),
    (1, 32, 32, 16384, 128, True), (1, 32, 8, 8192, 128, True), (4, 16, 16, 4096, 64, False),
    (4, 16, 16, 4096, 64, True), (1, 16, 16, 8192, 256, False), (1, 16, 16, 8192, 256, True),
    (2, 32, 32, 2048, 128, True), (8, 32, 8, 1024, 128, True),
]
VARIANTS = {  # (dtype, D) -> configs (BLOCK_N, STAGES, OVERLAP, PERSIST[, PERM])
    ("fp8", 128): [(256, 2, 0, 0), (256, 2, 0, 0, 1), (256, 2, 0, 2), (128, 2, 0, 0, 1), (128, 2, 0, 2),
                   (128, 2, 0, 2, 1), (128, 3, 0, 2, 1)],
    ("fp8", 64): [(128, 2, 0, 0), (128, 2, 0, 1), (128, 2, 0, 2), (128, 3, 0, 0), (128, 3, 0, 2)],
    ("fp8", 256): [(128, 2, 0, 0), (128, 2, 0, 1), (128, 2, 0, 2)],
    ("bf16", 128): [(128, 2, 0, 0), (128, 2, 1, 0), (128, 3, 1, 0), (128, 3, 1, 1), (128, 2, 1, 2), (128, 3, 1, 2)],
    ("bf16", 64): [(0, 0, 0, 0), (128, 3, 0, 0), (128, 3, 0, 1), (128, 3, 0, 2), (128, 2, 0, 2)],
    ("bf16", 256): [(64, 2, 0, 0), (64, 2, 1, 0), (64, 2, 1, 1), (64, 2, 1, 2)],
}
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def _check(dtype, D, causal):
    lens = [1, 63, 64, 65, 300, 1000, 777, 129, 4000]  # one long row: a sum that drifts shows there
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).cuda()
    q, k, v = (torch.randn(int(cu[-1]), h, D, device="cuda").to(dtype) for h in (8, 2, 2))
    out = torch.full(q.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    lk.flash_attn_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=causal, out=out)
    ref, _ = flash_attn_varlen_ref(q.double(), k.double(), v.double(), cu, cu, causal=causal)
    e = out.double() - ref
    rel = (e.pow(2).mean() / ref.pow(2).mean()).sqrt().item()
    bad = rel > (0.03 if dtype != torch.bfloat16 else 0.01) or not torch.isfinite(out).all()
    return f"rel rms {rel:.4f}{' FAIL' if bad else ''}"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtypes", default="fp8,bf16")
    p.add_argument("--baseline", default="", help="module name of an earlier prefill_ws.py copy")
    p.add_argument("--shapes", default="", help="indices into SHAPES (default all)")
    p.add_argument("--rep", type=float, default=100)
    p.add_argument("--pick", default="", help="folder for a user table of the best variants")
    args = p.parse_args()
    prefill.WS_MIN_WORK = 0
    real_launch = prefill_ws.launch_ws
    base = importlib.import_module(f"llmkernels.attention.{args.baseline}") if args.baseline else None
    shapes = [SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else SHAPES
    print(f"{torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs, "
          f"L2 {torch.cuda.get_device_properties(0).L2_cache_size >> 20} MB", flush=True)
    cudnn = {}
    scores = {}  # table key -> {cfg: [ratios]} (None once a check failed)
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        for B, H, Hkv, S, D, causal in shapes:
            key = ("prefill", f"{str(dtype).replace('torch.', '')}/{D}/{'causal' if causal else 'full'}/ws")
            q, k, v, cu = dense_inputs(B, H, Hkv, S, D)
            flops = attention_flops([S] * B, H, D, causal)
            case = (B, H, Hkv, S, D, causal)
            if case not in cudnn:
                qd, kd, vd = (t.view(B, S, -1, D).transpose(1, 2) for t in (q, k, v))
                a = sdpa_ms(qd, kd, vd, causal=causal, backend="cudnn")
                cudnn[case] = flops / a / 1e9 if a else float("nan")
            kw = {}
            if dtype != torch.bfloat16:
                ds = torch.ones(1, device="cuda")
                kw = {"q_descale": ds, "k_descale": ds, "v_descale": ds}
            qx, kx, vx = (t.to(dtype) for t in (q, k, v))
            runs = []
            cfgs = VARIANTS[(name, D)]
            if base is not None:
                runs.append(("baseline " + str(cfgs[0][:3]), cfgs[0], None))
            runs += [(str(cfg), cfg, 0) for cfg in cfgs]
            line = []
            for label, cfg, g in runs:
                OVERRIDES[key] = list(cfg)
                if g is None:
                    prefill_ws.launch_ws = (lambda *a, descales=None, **kw2:
                                            base.launch_ws(*a[:12], a[12] if len(a) > 12 else 0, descales=descales))
                else:
                    prefill_ws.launch_ws = real_launch
                try:
                    err = _check(dtype, D, causal)
                    ms = time_ms(lambda: lk.flash_attn_varlen(qx, kx, vx, cu, cu, S, S, causal=causal, **kw),
                                 rep_ms=args.rep)
                    tf = flops / ms / 1e9
                    line.append(f"{label}: {tf:.0f} ({tf / cudnn[case]:.2f}x) {err}")
                    if g is not None:
                        got = scores.setdefault(key[1], {}).setdefault(cfg, [])
                        if got is not None:
                            got.append(None if "FAIL" in err else tf / cudnn[case])
                except Exception as e:  # a variant that does not fit is reported, not fatal
                    line.append(f"{label}: failed {type(e).__name__}: {str(e)[:120]}")
                finally:
                    prefill_ws.launch_ws = real_launch
                    OVERRIDES.pop(key, None)
            print(f"{name} B{B} H{H}/{Hkv} S{S} D{D} {'causal' if causal else 'full'} (cuDNN bf16 "
                  f"{cudnn[case]:.0f}) | " + " | ".join(line), flush=True)
    if args.pick:
        table = {}
        for key, by_cfg in scores.items():
            ok = {cfg: math.exp(sum(map(math.log, r)) / len(r)) for cfg, r in by_cfg.items()
                  if r and None not in r and len(r) == max(len(x) for x in by_cfg.values())}
            if ok:
                best = max(ok, key=ok.get)
                table[key] = list(best)
                if key.startswith("bfloat16"):
                    table[key.replace("bfloat16", "float16")] = list(best)
                print(f"pick {key}: {best} (geometric mean {ok[best]:.3f}x cuDNN; " +
                      ", ".join(f"{c} {v:.3f}" for c, v in ok.items()) + ")", flush=True)
        os.makedirs(args.pick, exist_ok=True)
        path = os.path.join(args.pick, "prefill.json")
        doc = json.load(open(path)) if os.path.exists(path) else {}  # earlier picks of the same call stay
        doc.setdefault(torch.cuda.get_device_name(), {}).update(table)
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
