"""Suite ``decode``: paged_attention in effective TB/s (K/V read + q + o) against SDPA cuDNN on contiguous K/V."""
from __future__ import annotations

import torch

from ...attention import paged_attention, plan_paged_attention
from ..anchors import sdpa_ms
from ..harness import Row, time_ms

HQ, HKV, D = 32, 8, 128
SHAPES = [(1, 32768), (16, 4096), (64, 1024), (64, 8192), (128, 2048)]


def _cache(B, L, page_size, kv_dtype):
    pages_per_seq = -(-L // page_size)
    num_pages = B * pages_per_seq
    k = torch.randn(num_pages, page_size, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(num_pages, page_size, HKV, D, device="cuda", dtype=torch.bfloat16)
    if kv_dtype != torch.bfloat16:
        k, v = k.to(kv_dtype), v.to(kv_dtype)
    page_table = torch.randperm(num_pages, device="cuda").to(torch.int32).reshape(B, pages_per_seq)
    return k, v, page_table


def _case(ctx, B, L, page_size, kv_dtype, q_lens=None):
    def run():
        ql = q_lens or [1] * B
        kv_lens = [L] * B
        k, v, pt = _cache(B, L, page_size, kv_dtype)
        cu = torch.tensor([0] + ql).cumsum(0).to(torch.int32)
        sl = torch.tensor(kv_lens, dtype=torch.int32)
        plan = plan_paged_attention(cu, sl, page_size, HQ, HKV, D, q_dtype=torch.bfloat16, kv_dtype=kv_dtype,
                                    device="cuda")
        cu, sl = cu.cuda(), sl.cuda()
        q = torch.randn(int(cu[-1]), HQ, D, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        scales = dict(k_scale=1.0, v_scale=1.0) if kv_dtype != torch.bfloat16 else {}
        fn = lambda: paged_attention(q, k, v, pt, sl, cu, max(ql), plan=plan, out=out, validate=False,  # noqa: E731
                                     **scales)
        ms = time_ms(fn)
        nbytes = 2 * B * L * HKV * D * k.element_size() + 2 * q.numel() * 2
        ours = nbytes / (ms * 1e-3) / 1e12
        anchors = {}
        if q_lens is None and page_size == 16:  # one anchor per shape and dtype: SDPA on a contiguous copy
            kd = torch.randn(B, HKV, L, D, device="cuda", dtype=torch.bfloat16)
            vd = torch.randn(B, HKV, L, D, device="cuda", dtype=torch.bfloat16)
            del k, v
            qd = q.view(B, 1, HQ, D).transpose(1, 2)
            a = sdpa_ms(qd, kd, vd, causal=False, backend="cudnn")
            if a is not None:
                anchors["sdpa_cudnn_bf16"] = nbytes / (a * 1e-3) / 1e12
        name = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8e4m3"}[kv_dtype]
        label = f"B{B} L{L} page{page_size} {name}" if q_lens is None else \
            f"mixed 512-chunk + 63 decodes L{L} page{page_size} {name}"
        return Row("decode", label, "TB/s", ours, ctx.bw_pct(ours), anchors)
    return run


def cases(ctx):
    out = []
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for B, L in SHAPES:
            for ps in (1, 16, 64):
                out.append((f"B{B} L{L} p{ps} {kv_dtype}", _case(ctx, B, L, ps, kv_dtype)))
    out.append(("mixed", _case(ctx, 64, 4096, 16, torch.bfloat16, q_lens=[512] + [1] * 63)))
    return out
