"""Prefill at the bench shapes timed three ways, ours and SDPA cuDNN: triton's do_bench (as the suite times), CUDA-graph
replay (no host work) and host time per eager call; then cProfile of 200 eager calls of ours at D128 S4096.

    PYTHONPATH=. python bench/lab/prefill_host.py [fp8]     # fp8: the fp8 e4m3 cases only (ours; no cuDNN)

When the host time per call exceeds the kernel's, do_bench measures the host: its column then differs from the
graph's.
"""
import cProfile
import io
import pstats
import sys
import time

import torch
import triton.testing as tt
from torch.nn.attention import SDPBackend, sdpa_kernel

from llmkernels.attention import flash_attn_varlen

SHAPES = [(1, 32, 4096, 128, False), (1, 32, 4096, 128, True), (4, 16, 4096, 64, False), (1, 32, 16384, 128, False)]


def graphed(f):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        f()
        f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        f()
    return g.replay


def host_us(f, n=50):
    """Host time per call while the GPU runs behind."""
    f()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        f()
    us = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return us


def main():
    fp8 = sys.argv[1:] == ["fp8"]
    for B, H, S, D, causal in SHAPES[:2] if fp8 else SHAPES:
        q = torch.randn(B * S, H, D, device="cuda", dtype=torch.bfloat16)
        k, v = torch.randn_like(q), torch.randn_like(q)
        cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device="cuda")
        qs, ks, vs = (t.view(B, S, H, D).transpose(1, 2) for t in (q, k, v))
        q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
        ds = torch.ones(1, device="cuda")

        def ours():
            if fp8:
                return flash_attn_varlen(q8, k8, v8, cu, cu, S, S, causal=causal, q_descale=ds, k_descale=ds,
                                         v_descale=ds)
            return flash_attn_varlen(q, k, v, cu, cu, S, S, causal=causal)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)

        flops = 4 * B * H * S * S * D / (2 if causal else 1)
        print(f"B{B} H{H} S{S} D{D} {'causal' if causal else 'full'}{' fp8' if fp8 else ''}:", flush=True)
        for name, f in (("ours", ours),) + (() if fp8 else (("cudnn", cudnn),)):
            db = tt.do_bench(f, warmup=25, rep=100, return_mode="median")
            gr = tt.do_bench(graphed(f), warmup=25, rep=100, return_mode="median")
            print(f"  {name:5s} do_bench {db * 1e3:7.1f} us ({flops / db / 1e9:4.0f} TFLOP/s)  graph {gr * 1e3:7.1f} us "
                  f"({flops / gr / 1e9:4.0f})  host {host_us(f):6.1f} us per call", flush=True)
        if (S, D, causal) == (4096, 128, False) or fp8:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(200):
                ours()
            pr.disable()
            torch.cuda.synchronize()
            out = io.StringIO()
            for key in ("tottime", "cumulative"):
                pstats.Stats(pr, stream=out).sort_stats(key).print_stats(25)
            print(out.getvalue())


if __name__ == "__main__":
    main()
