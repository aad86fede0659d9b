"""Suite ``prefill``: flash_attn_varlen in TFLOP/s against SDPA (cuDNN and flash backends) on the same inputs."""
from __future__ import annotations

import torch

from ...attention import flash_attn_varlen
from ..anchors import sdpa_ms
from ..harness import Row, time_ms

SHAPES = [(1, 32, 4096, 128), (1, 32, 16384, 128), (4, 16, 4096, 64), (1, 16, 8192, 256)]


def attention_flops(lens, H, D, causal):
    return sum(4 * L * L * D * H / (2 if causal else 1) for L in lens)


def dense_inputs(B, Hq, Hkv, S, D):
    """bf16 q [B*S, Hq, D], k, v [B*S, Hkv, D] and cu_seqlens for B sequences of S tokens (also for the lab and
    the tuner)."""
    q = torch.randn(B * S, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B * S, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B * S, Hkv, D, device="cuda", dtype=torch.bfloat16)
    return q, k, v, torch.arange(0, (B + 1) * S, S, device="cuda", dtype=torch.int32)


def varlen_lengths(seed=0):
    """16 sequence lengths from 100..8000 (seed 0: the suite's batch)."""
    return torch.randint(100, 8001, (16,), generator=torch.Generator().manual_seed(seed)).tolist()


def _dense_case(ctx, B, Hq, Hkv, S, D, causal):
    def run():
        q, k, v, cu = dense_inputs(B, Hq, Hkv, S, D)
        ms = time_ms(lambda: flash_attn_varlen(q, k, v, cu, cu, S, S, causal=causal))
        flops = attention_flops([S] * B, Hq, D, causal)
        ours = flops / (ms * 1e-3) / 1e12
        qd, kd, vd = (t.view(B, S, -1, D).transpose(1, 2) for t in (q, k, v))
        anchors = {}
        for be in ("cudnn", "flash"):
            a = sdpa_ms(qd, kd, vd, causal=causal, backend=be)
            if a is not None:
                anchors[f"sdpa_{be}"] = flops / (a * 1e-3) / 1e12
        return Row("prefill", f"B{B} H{Hq}/{Hkv} S{S} D{D}{' causal' if causal else ''} bf16", "TFLOP/s", ours,
                    100 * ours / ctx.matmul_TFLOPs, anchors)
    return run


def _varlen_case(ctx):
    def run():
        lens = varlen_lengths()
        H, D = 32, 128
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).cuda()
        T = int(cu[-1])
        q, k, v = (torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ms = time_ms(lambda: flash_attn_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True))
        flops = attention_flops(lens, H, D, True)
        anchors = {}
        S = max(lens)
        pad = [torch.randn(16, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        bounds = cu.tolist()
        seqs = [tuple(t[bounds[i]:bounds[i + 1]].transpose(0, 1).unsqueeze(0) for t in (q, k, v)) for i in range(16)]
        for be in ("cudnn", "flash"):
            padded = sdpa_ms(*pad, causal=True, backend=be)

            def per_seq():
                from torch.nn.attention import SDPBackend, sdpa_kernel
                import torch.nn.functional as F
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION if be == "cudnn" else SDPBackend.FLASH_ATTENTION]):
                    for a, b, c in seqs:
                        F.scaled_dot_product_attention(a, b, c, is_causal=True)
            try:
                per = time_ms(per_seq)
            except RuntimeError:
                per = None
            best = min(t for t in (padded, per) if t is not None) if (padded or per) else None
            if best is not None and flops / (best * 1e-3) / 1e12 < 1.2 * ctx.matmul_TFLOPs:
                anchors[f"sdpa_{be}"] = flops / (best * 1e-3) / 1e12  # (a figure above the matmul peak is a bug)
        ours = flops / (ms * 1e-3) / 1e12
        return Row("prefill", "varlen 16 seqs 100..8000 H32 D128 causal bf16", "TFLOP/s", ours,
                   100 * ours / ctx.matmul_TFLOPs, anchors)
    return run


def _fp8_case(ctx, B, H, S, D, causal):
    """fp8 e4m3 q/k/v with per-tensor descales (the V^T copy the sm_90 kernel reads included in the time). Anchors:
    SDPA cuDNN on the bf16 inputs of the same shape (there is no fp8 SDPA to compare with), our own bf16 call, and
    our fp8 call replayed from a CUDA graph (``ours_graph``: its kernels alone; an eager fp8 call's host time
    rivals its kernels' at S = 4096, and eager timing then times the host)."""
    def run():
        q, k, v, cu = dense_inputs(B, H, H, S, D)
        q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
        ds = torch.ones(1, device="cuda")

        def fp8_call():
            return flash_attn_varlen(q8, k8, v8, cu, cu, S, S, causal=causal, q_descale=ds, k_descale=ds,
                                     v_descale=ds)

        ms = time_ms(fp8_call)
        flops = attention_flops([S] * B, H, D, causal)
        ours = flops / (ms * 1e-3) / 1e12
        anchors = {"ours_bf16": flops / (time_ms(lambda: flash_attn_varlen(q, k, v, cu, cu, S, S, causal=causal))
                                         * 1e-3) / 1e12,
                   "ours_graph": flops / (time_ms(fp8_call, cuda_graph=True) * 1e-3) / 1e12}
        qd, kd, vd = (t.view(B, S, -1, D).transpose(1, 2) for t in (q, k, v))
        a = sdpa_ms(qd, kd, vd, causal=causal, backend="cudnn")
        if a is not None:
            anchors["sdpa_cudnn_bf16"] = flops / (a * 1e-3) / 1e12
        return Row("prefill", f"B{B} H{H}/{H} S{S} D{D}{' causal' if causal else ''} fp8", "TFLOP/s", ours,
                   100 * ours / ctx.matmul_TFLOPs, anchors)
    return run


FP8_SHAPES = [(1, 32, 4096, 128, False), (1, 32, 4096, 128, True), (1, 32, 16384, 128, True),
              (1, 16, 8192, 256, False), (1, 16, 8192, 256, True)]


def cases(ctx):
    out = []
    for B, H, S, D in SHAPES:
        for causal in (False, True):
            out.append((f"B{B} H{H} S{S} D{D} causal={causal}", _dense_case(ctx, B, H, H, S, D, causal)))
    out.append(("GQA 32/8 S8192 causal", _dense_case(ctx, 1, 32, 8, 8192, 128, True)))
    out.append(("varlen 16", _varlen_case(ctx)))
    for B, H, S, D, causal in FP8_SHAPES:
        out.append((f"fp8 B{B} H{H} S{S} D{D} causal={causal}", _fp8_case(ctx, B, H, S, D, causal)))
    return out
