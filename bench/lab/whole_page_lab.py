"""The Gluon decode kernel's whole-page loader (paged_ws HKV > 1: units of (sequence, split) over every kv head,
one TMA copy per page or half page) against the shipped per-head units, on the decode suite's shapes (GQA 32/8,
D 128, page 16), timed as the decode suite times them (CUDA-graph replays over L2-overflowing copies); each
variant's output checked against the float64 reference first.

    PYTHONPATH=. python bench/lab/whole_page_lab.py [check] [time] [fp8]

Variants "wBN/stS/spP": BLOCK_N keys of every head per tile, S ring slots, P splits per sequence.
"""
import math
import sys

import torch

from llmkernels.attention import paged_ws as W
from llmkernels.attention.paged_kernel import combine_kernel
from llmkernels.bench.harness import copies_for, measure_read_bandwidth, time_graph_ms
from llmkernels.bench.suites import decode as dec
from llmkernels.testing.attention import paged_attention_ref

D = 128
LOG2E = 1.4426950408889634


def whole(q, k, v, pt, sl, cu, splits, block_n, stages, out, ws, pre=None):
    """One whole-page launch (and the split merge) over caches k, v [pages, page, Hkv, D]; ``pre``: prepare()'s
    descriptors and tile tensors (made outside graph capture)."""
    B, Hq = sl.numel(), q.shape[1]
    descs, tiles, nt = pre or prepare(k, v, B, block_n)
    ws_o, ws_lse = ws
    W.launch_decode_ws(q, descs, ws_o if splits > 1 else out, ws_lse, pt, sl, cu, tiles, nt, k.shape[0], k.shape[1],
                       splits, LOG2E / math.sqrt(D), torch.cuda.get_device_properties(0).multi_processor_count,
                       block_n=block_n, stages=stages, whole_heads=k.shape[2],
                       k_scale=1.0, v_scale=1.0)
    if splits > 1:
        combine_kernel[(q.shape[0], Hq)](
            ws_o, ws_lse, out, out, q, ws_o.stride(0), ws_o.stride(1), ws_o.stride(2), ws_lse.stride(0),
            out.stride(0), out.stride(1), Hq, splits, SPLITS_P2=max(2, 1 << (splits - 1).bit_length()), HEAD_DIM=D,
            BLOCK_D=D, HAS_SINK=False, WRITE_LSE=False, PDL=False, num_warps=4)


def prepare(k, v, B, block_n):
    return (W.page_descriptors(k, v, block_n, whole=True), torch.arange(B, device="cuda", dtype=torch.int32),
            torch.tensor([B], device="cuda", dtype=torch.int32))


def setup(lens, hq, hkv, page, dtype):
    B = len(lens)
    pps = -(-max(lens) // page)
    k = torch.randn(B * pps, page, hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B * pps, page, hkv, D, device="cuda", dtype=torch.bfloat16)
    if dtype != torch.bfloat16:
        k, v = k.to(dtype), v.to(dtype)
    pt = torch.randperm(B * pps, device="cuda").to(torch.int32).reshape(B, pps)
    sl = torch.tensor(lens, device="cuda", dtype=torch.int32)
    cu = torch.arange(B + 1, device="cuda", dtype=torch.int32)
    q = torch.randn(B, hq, D, device="cuda", dtype=torch.bfloat16)
    return q, k, v, pt, sl, cu


def workspace(splits, B, hq):
    return (torch.empty(splits, B, hq, D, device="cuda", dtype=torch.float32),
            torch.empty(splits, B, hq, device="cuda", dtype=torch.float32))


def check(lens, hq, hkv, page, dtype, splits, block_n, stages):
    q, k, v, pt, sl, cu = setup(lens, hq, hkv, page, dtype)
    out = torch.full_like(q, float("nan"))
    whole(q, k, v, pt, sl, cu, splits, block_n, stages, out, workspace(splits, len(lens), hq))
    torch.cuda.synchronize()
    ref, _ = paged_attention_ref(q, k, v, pt, sl, cu, causal=True)
    err = (out.double() - ref).abs().max().item()
    ok = err < (3e-2 if dtype != torch.bfloat16 else 1.5e-2)
    print(f"check lens {lens[:3]}{'...' if len(lens) > 3 else ''} (B{len(lens)}) {hq}/{hkv} page {page} "
          f"{str(dtype)[6:]} sp{splits} w{block_n}/st{stages}: max err {err:.2e} {'ok' if ok else 'WRONG'}",
          flush=True)
    return ok


def time_whole(B, L, dtype, splits, block_n, stages, bw):
    hq, hkv = dec.HQ, dec.HKV
    elem = 1 if dtype != torch.bfloat16 else 2
    kv_bytes = 2 * B * L * hkv * D * elem
    sets = [setup([L] * B, hq, hkv, 16, dtype) for _ in range(copies_for(kv_bytes, most=4))]
    out = torch.empty(B, hq, D, device="cuda", dtype=torch.bfloat16)
    ws = workspace(splits, B, hq)
    pres = [prepare(s[1], s[2], B, block_n) for s in sets]
    fns = [lambda s=s, p=p: whole(*s, splits, block_n, stages, out, ws, p) for s, p in zip(sets, pres)]
    ms = time_graph_ms(fns)
    tb = (kv_bytes + 4 * B * hq * D) / (ms * 1e-3) / 1e12
    return f"w{block_n}/st{stages}/sp{splits} {ms * 1e3:6.1f}us {100 * tb / bw:5.1f}%"


def main():
    args = set(sys.argv[1:]) or {"check", "time"}
    dtypes = [torch.bfloat16] + ([torch.float8_e4m3fn] if "fp8" in args else [])
    if "check" in args:
        bad = 0
        for dt in dtypes:
            for lens, hq, hkv, page, sp, bn, st in (
                    ([1000], 32, 8, 16, 4, 8, 6), ([1, 17, 300, 4096], 32, 8, 16, 3, 8, 5),
                    ([33, 7, 1024], 32, 8, 16, 1, 8, 6), ([2049] * 3, 32, 8, 16, 5, 8, 3),
                    ([777, 5000], 28, 4, 16, 7, 16, 5), ([999, 64], 16, 8, 8, 2, 8, 6),
                    ([4097], 64, 8, 32, 9, 8, 4), ([1500, 3], 32, 2, 32, 3, 32, 5)):
                try:
                    bad += not check(lens, hq, hkv, page, dt, sp, bn, st)
                except Exception as e:  # noqa: BLE001 (a lab: report and go on)
                    bad += 1
                    print(f"check {lens[:3]} {hq}/{hkv} page {page} {dt}: ERR {type(e).__name__} {str(e)[:300]}",
                          flush=True)
        print(f"checks wrong: {bad}", flush=True)
    if "time" in args:
        bw = measure_read_bandwidth()
        print(f"read bandwidth {bw:.3f} TB/s", flush=True)
        ctx = type("C", (), {"bw_pct": lambda self, t: 100 * t / bw})()
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for dt in dtypes:
            for B, L in ((1, 32768), (16, 4096), (64, 1024), (64, 8192), (128, 2048)):
                row = dec._case(ctx, B, L, 16, dt)()
                res = [f"shipped {row.note} {row.roofline_pct:.1f}%"]
                base = max(1, sms // B)
                for sp in sorted({base, max(1, base // 2)} | ({128, 64} if B == 1 else set())):
                    for bn, st in ((8, 5), (8, 6), (16, 2)):
                        try:
                            res.append(time_whole(B, L, dt, sp, bn, st, bw))
                        except Exception as e:  # noqa: BLE001
                            res.append(f"w{bn}/st{st}/sp{sp} ERR {type(e).__name__} {str(e)[:120]}")
                print(f"{str(dt)[6:]} B{B} L{L}: " + " | ".join(res), flush=True)


if __name__ == "__main__":
    main()
