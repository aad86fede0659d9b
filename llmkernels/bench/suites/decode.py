"""Suite ``decode``: paged_attention in effective TB/s (K/V read + q + o) against SDPA cuDNN on contiguous K/V."""
from __future__ import annotations

import numpy as np
import torch

from ...attention import paged_attention, plan_paged_attention
from ..harness import Row, copies_for, time_graph_ms

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
    """CUDA-graph replays over enough cache copies to overflow L2; the plan is made once, as an engine would."""
    def run():
        ql = q_lens or [1] * B
        cu = torch.tensor([0] + ql).cumsum(0).to(torch.int32)
        sl = torch.tensor([L] * B, dtype=torch.int32)
        plan = plan_paged_attention(cu, sl, page_size, HQ, HKV, D, q_dtype=torch.bfloat16, kv_dtype=kv_dtype,
                                    device="cuda")
        cu, sl = cu.cuda(), sl.cuda()
        q = torch.randn(int(cu[-1]), HQ, D, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        elem = 1 if kv_dtype != torch.bfloat16 else 2
        kv_bytes = 2 * B * L * HKV * D * elem
        caches = [_cache(B, L, page_size, kv_dtype) for _ in range(copies_for(kv_bytes, most=4))]
        scales = dict(k_scale=1.0, v_scale=1.0) if kv_dtype != torch.bfloat16 else {}
        fns = [lambda c=c: paged_attention(q, c[0], c[1], c[2], sl, cu, max(ql), plan=plan, out=out, validate=False,
                                           **scales) for c in caches]
        ms = time_graph_ms(fns)
        nbytes = kv_bytes + 2 * q.numel() * 2
        ours = nbytes / (ms * 1e-3) / 1e12
        del caches, fns
        anchors = {}
        if q_lens is None and page_size == 16:  # one anchor per shape and dtype: SDPA cuDNN on contiguous bf16 K/V
            n = copies_for(2 * B * L * HKV * D * 2, most=4)
            kvs = [(torch.randn(B, HKV, L, D, device="cuda", dtype=torch.bfloat16),
                    torch.randn(B, HKV, L, D, device="cuda", dtype=torch.bfloat16)) for _ in range(n)]
            qd = q.view(B, 1, HQ, D).transpose(1, 2)
            a = _sdpa_graph_ms(qd, kvs)
            if a is not None:
                anchors["sdpa_cudnn_bf16"] = nbytes / (a * 1e-3) / 1e12
        name = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8e4m3"}[kv_dtype]
        label = f"B{B} L{L} page{page_size} {name}" if q_lens is None else \
            f"mixed 512-chunk + 63 decodes L{L} page{page_size} {name}"
        row = Row("decode", label, "TB/s", ours, ctx.bw_pct(ours), anchors)
        row.note = f"{ms * 1e3:.1f} us, {plan.num_splits} split(s)"
        return row
    return run


def _sdpa_graph_ms(q, kvs):
    """SDPA with the cuDNN backend (GQA through enable_gqa, else expanded K/V), graph-timed over K/V copies."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    for expand in (False, True):
        try:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                if expand:
                    g = q.shape[1] // kvs[0][0].shape[1]
                    pairs = [(k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)) for k, v in kvs]
                    fns = [lambda k=k, v=v: F.scaled_dot_product_attention(q, k, v) for k, v in pairs]
                else:
                    fns = [lambda k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True) for k, v in kvs]
                return time_graph_ms(fns)
        except RuntimeError:
            continue
    return None


RAGGED = {"1x32768+7x1024": [32768] + [1024] * 7, "2x16384+30x512": [16384] * 2 + [512] * 30,
          "48 random 64..8192": [int(x) for x in np.random.default_rng(0).integers(64, 8193, 48)]}


def _ragged_case(ctx, name, lens, page_size=16):
    """A decode batch of unequal lengths (as an engine's running batch), against the same call with the split count
    fixed (num_splits = the plan's, which keeps the Gluon kernel's round-robin units split)."""
    def run():
        B = len(lens)
        cu = torch.arange(B + 1, dtype=torch.int32)
        sl = torch.tensor(lens, dtype=torch.int32)
        kv_bytes = 2 * sum(lens) * HKV * D * 2
        per = -(-max(lens) // page_size)
        caches = []
        for _ in range(copies_for(kv_bytes, most=4)):
            k = torch.randn(B * per, page_size, HKV, D, device="cuda", dtype=torch.bfloat16)
            caches.append((k, torch.randn_like(k), torch.randperm(B * per, device="cuda").to(torch.int32).view(B, per)))
        q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        nbytes = kv_bytes + 2 * q.numel() * 2
        times = []
        plan = plan_paged_attention(cu, sl, page_size, HQ, HKV, D, q_dtype=q.dtype, kv_dtype=q.dtype, device="cuda")
        fixed = plan_paged_attention(cu, sl, page_size, HQ, HKV, D, q_dtype=q.dtype, kv_dtype=q.dtype, device="cuda",
                                     num_splits=plan.num_splits)
        cu_d, sl_d = cu.cuda(), sl.cuda()
        for p in (plan, fixed):
            times.append(time_graph_ms([lambda c=c, p=p: paged_attention(q, c[0], c[1], c[2], sl_d, cu_d, 1, plan=p,
                                                                         out=out, validate=False) for c in caches]))
        row = Row("decode", f"ragged B{B} {name} page{page_size} bf16", "TB/s", nbytes / (times[0] * 1e-3) / 1e12,
                  None, {"fixed_split": nbytes / (times[1] * 1e-3) / 1e12})
        row.roofline_pct = ctx.bw_pct(row.value)
        row.note = (f"{times[0] * 1e3:.1f} us ({'balanced split' if plan.balanced else 'units'}), fixed "
                    f"num_splits={plan.num_splits} {times[1] * 1e3:.1f} us")
        return row
    return run


def cases(ctx):
    out = []
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for B, L in SHAPES:
            for ps in (1, 16, 64):
                out.append((f"B{B} L{L} p{ps} {kv_dtype}", _case(ctx, B, L, ps, kv_dtype)))
    out.append(("mixed", _case(ctx, 64, 4096, 16, torch.bfloat16, q_lens=[512] + [1] * 63)))
    for name, lens in RAGGED.items():
        out.append((f"ragged {name}", _ragged_case(ctx, name, lens)))
    return out
