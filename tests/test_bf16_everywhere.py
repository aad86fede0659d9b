"""bfloat16 through every public op, also under Triton's interpreter (CPU), whose own bf16 ``tl.dot`` multiplies bit
patterns as integers: the library's interpreter fix must make these right, never return garbage."""
import pytest
import torch

import llmkernels as lk
from llmkernels.testing.attention import flash_attn_varlen_ref, paged_attention_ref
from llmkernels.testing.gemv import embedding_ref, gemv_ref, silu_mul_gemv_ref
from llmkernels.testing.random_weights import random_qtensor
from llmkernels.testing.tolerances import assert_close, poison

from .attention.paged_helpers import build

BF16 = torch.bfloat16


def rel_close(out, ref, tol=1.6e-2):
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < tol, f"relative error {err:.3g} >= {tol}"


def test_prefill_bf16(device):
    q, k, v = (torch.randn(45, 4, 64, dtype=BF16, device=device) for _ in range(3))
    cu = torch.tensor([0, 19, 45], dtype=torch.int32, device=device)
    for causal in (False, True):
        out = poison(torch.empty_like(q))
        lk.flash_attn_varlen(q, k, v, cu, cu, 26, 26, causal=causal, out=out)
        ref, _ = flash_attn_varlen_ref(q, k, v, cu, cu, causal=causal)
        assert_close(out, ref, BF16)
    qd, kd, vd = (torch.randn(2, 21, 4, 32, dtype=BF16, device=device) for _ in range(3))
    ref, _ = flash_attn_varlen_ref(qd.flatten(0, 1), kd.flatten(0, 1), vd.flatten(0, 1),
                                   torch.tensor([0, 21, 42], dtype=torch.int32), torch.tensor([0, 21, 42],
                                                                                               dtype=torch.int32))
    assert_close(lk.flash_attn(qd, kd, vd).flatten(0, 1), ref, BF16)


def test_paged_bf16(device):
    q_lens, k_lens = [1, 3], [37, 20]
    q, kc, vc, pt, sl, cu = build(q_lens, k_lens, 16, 8, 2, 64, dtype=BF16, device=device)
    out = lk.paged_attention(q, kc, vc, pt, sl, cu, max(q_lens))
    ref, _ = paged_attention_ref(q, kc, vc, pt, sl, cu)
    assert out.dtype == BF16
    assert_close(out, ref, BF16)


@pytest.mark.parametrize("fmt,kw", [("q8_0", {}), ("q4_0", {}), ("q4_k", {}), ("q6_k", {}), ("bf16", {}),
                                    ("mlx", dict(bits=4, group_size=64))])
def test_gemv_bf16(fmt, kw, device):
    qt = random_qtensor(fmt, 29, 512, device, **kw)
    for M in (1, 3, 20):
        x = torch.randn(M, 512, dtype=BF16, device=device)
        y = lk.gemv(x, qt)
        assert y.dtype == BF16 and y.shape == (M, 29)
        rel_close(y, gemv_ref(x, qt))
    g, u = torch.randn(2, 2, 512, dtype=BF16, device=device)
    rel_close(lk.silu_mul_gemv(g, u, qt), silu_mul_gemv_ref(g, u, qt))
    ids = torch.tensor([0, 28, 5], device=device)
    rel_close(lk.embedding(ids, qt, dtype=BF16), embedding_ref(ids, qt))
