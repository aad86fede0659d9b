"""The engine's small kernels against torch references, and the pieces that need no model."""
import math

import pytest
import torch

from llmkernels.engine.config import ModelConfig, llama3_rope_factors, rope_inv_freq
from llmkernels.engine.kernels import add_rmsnorm, rope_store, silu_mul
from llmkernels.qgemv.int8 import quantize_act
from llmkernels.testing import i8_lane_positions, lane_positions
from llmkernels.testing.tolerances import assert_close


def rmsnorm_ref(h, w, eps):
    hf = h.double()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype).double() * w.double()


@pytest.mark.parametrize("H", [100, 256])
def test_add_rmsnorm(H, device):
    x = torch.randn(5, H, dtype=torch.float16, device=device)
    r = torch.randn(5, H, dtype=torch.float16, device=device)
    w = torch.randn(H, device=device)
    h_want = r + x
    y = torch.full_like(x, float("nan"))
    add_rmsnorm(x, w, 1e-5, residual=r, out=y)
    assert torch.equal(r, h_want)  # the residual stream is updated in place, in fp16 like the reference
    assert_close(y, rmsnorm_ref(h_want, w, 1e-5), torch.float16)
    assert_close(add_rmsnorm(x, w, 1e-5), rmsnorm_ref(x, w, 1e-5), torch.float16)
    # with lanes: also y in the q4_k GEMV's lane order, the same values
    y, yl = add_rmsnorm(x, w, 1e-5, lanes=True)
    assert yl.shape == (5, 2048) and torch.equal(yl[:, lane_positions(H).to(device)], y)


@pytest.mark.parametrize("H,W", [(100, 160), (96, 512), (256, 256)])
def test_add_rmsnorm_into_wider_out(H, W, device):
    """out wider than H (x for a matrix padded with zero blocks along K): y lands in its first H columns, the rest
    become zeros (out starts as NaN), the same bits as the plain call, with lanes and a post-norm too; the residual
    stream is updated once. A narrower out, or one of other rows, is an error naming out."""
    x = torch.randn(3, H, dtype=torch.float16, device=device)
    r, w, pw = torch.randn_like(x), torch.randn(H, device=device), torch.randn(H, device=device)
    r2 = r.clone()
    want = add_rmsnorm(x, w, 1e-5, residual=r2, pre_weight=pw)
    out = torch.full((3, W), float("nan"), dtype=torch.float16, device=device)
    y, yl = add_rmsnorm(x, w, 1e-5, residual=r, pre_weight=pw, out=out, lanes=True)
    assert y.shape == (3, H) and y.data_ptr() == out.data_ptr() and torch.equal(y, want) and torch.equal(r, r2)
    assert torch.equal(out[:, H:], torch.zeros(3, W - H, dtype=torch.float16, device=device))
    assert torch.equal(yl[:, lane_positions(H).to(device)], want)
    for bad in (torch.empty(3, H - 1, dtype=torch.float16, device=device),
                torch.empty(4, W, dtype=torch.float16, device=device)):
        with pytest.raises(ValueError, match=r"out must be \[T=3, >= H="):
            add_rmsnorm(x, w, 1e-5, out=bad)


def test_add_rmsnorm_peers_are_checked():
    """``peers`` (a tensor-parallel rank's FusedRows) sums rows of its width and dtype, at most its row count, and
    not with x_weights: anything else is a ValueError before any launch (every rank raises alike; none waits)."""
    from llmkernels.engine.allreduce import FusedRows

    f = FusedRows.__new__(FusedRows)
    f.rows, f.hidden, f.dtype = 4, 64, torch.float16
    w = torch.ones(64)
    for x in (torch.zeros(5, 64, dtype=torch.float16), torch.zeros(2, 32, dtype=torch.float16),
              torch.zeros(2, 64, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match=r"peers sums \[<= 4, 64\] torch.float16 rows"):
            add_rmsnorm(x, w, 1e-6, peers=f)
    with pytest.raises(ValueError, match="without x_weights"):
        add_rmsnorm(torch.zeros(4, 64, dtype=torch.float16), w, 1e-6, peers=f,
                    x_weights=torch.ones(2, 2, dtype=torch.float32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_add_rmsnorm_pre_weight(dtype, device):
    """pre_weight (Gemma's post-norms): the same bits as normalizing x in a call of its own first, then adding."""
    H = 200
    x = torch.randn(3, H, dtype=dtype, device=device) * 4
    r = torch.randn(3, H, dtype=dtype, device=device)
    w, pw = torch.randn(H, device=device), torch.randn(H, device=device)
    r0, r2 = r.clone(), r.clone()
    want = add_rmsnorm(add_rmsnorm(x, pw, 1e-6), w, 1e-6, residual=r2)
    x_before = x.clone()
    y = add_rmsnorm(x, w, 1e-6, residual=r, pre_weight=pw)
    assert torch.equal(y, want) and torch.equal(r, r2) and torch.equal(x, x_before)
    # against float64: h = r + rmsnorm(x) * pw (rounded to the activation dtype, as the models keep h), y = rmsnorm(h) * w
    p = rmsnorm_ref(x, pw, 1e-6)
    h_ref = r0 + p.to(dtype)
    # a one-ulp difference in the normalized x (float32 statistics against float64) survives the add absolutely
    assert_close(r, h_ref, dtype, atol=float(p.abs().max()) * (2 ** -7 if dtype == torch.bfloat16 else 2 ** -10))
    assert_close(y, rmsnorm_ref(r, w, 1e-6), dtype)
    y2, yl = add_rmsnorm(x_before, w, 1e-6, pre_weight=pw, lanes=True)
    assert torch.equal(y2, add_rmsnorm(add_rmsnorm(x_before, pw, 1e-6), w, 1e-6))
    assert torch.equal(yl[:, lane_positions(H).to(device)], y2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_add_rmsnorm_sums_expert_pairs(dtype, device):
    """x_weights: x holds a mixture-of-experts FFN's pair products, summed by the kernel exactly as moe_combine
    sums them (same bits), in every output layout; bad weights are refused."""
    from llmkernels.qgemv.moe import moe_combine

    T, k, H = 3, 5, 160
    pairs = torch.randn(T * k, H, dtype=dtype, device=device)
    xw = torch.softmax(torch.randn(T, k, device=device), -1)
    w = torch.randn(H, device=device)
    r = torch.randn(T, H, dtype=dtype, device=device)
    combined = moe_combine(pairs, xw)
    want_sum = (pairs.double().view(T, k, H) * xw.double()[:, :, None]).sum(1)
    assert_close(combined, want_sum, dtype)
    r1, r2 = r.clone(), r.clone()
    y = add_rmsnorm(pairs, w, 1e-6, residual=r1, x_weights=xw)
    assert y.shape == (T, H) and torch.equal(y, add_rmsnorm(combined, w, 1e-6, residual=r2)) and torch.equal(r1, r2)
    y, yl = add_rmsnorm(pairs, w, 1e-6, x_weights=xw, lanes=True)
    assert torch.equal(y, add_rmsnorm(combined, w, 1e-6))
    assert torch.equal(yl[:, lane_positions(H).to(device)], y)
    for bad in (xw.double(), xw.t(), xw[:2]):
        with pytest.raises(ValueError, match="x_weights"):
            add_rmsnorm(pairs, w, 1e-6, x_weights=bad)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_add_rmsnorm_adds_biases(dtype, device):
    """x_bias: an output projection's bias [H] (float32 or x's dtype) joins x, the sum rounded to x's dtype as the
    engine's reference rounds it; with x_weights, per-expert biases [E, H] picked by x_bias_ids join each pair's
    product before the weighted sum. Same bits as the separate adds; bad biases and ids are refused."""
    from llmkernels.qgemv.moe import moe_combine

    # Triton's interpreter rounds float32 -> bf16 toward zero (a GPU to nearest), so there bf16 is compared within
    # its tolerance; fp16 everywhere and bf16 on a GPU bit for bit
    same = torch.equal if dtype == torch.float16 or device.type == "cuda" else (
        lambda a, b: assert_close(a, b.double(), dtype) or True)
    T, k, H, E = 3, 4, 160, 6
    x = torch.randn(T, H, dtype=dtype, device=device)
    w = torch.randn(H, device=device)
    r = torch.randn(T, H, dtype=dtype, device=device)
    for b in (torch.randn(H, device=device), torch.randn(H, device=device).to(dtype)):
        r1, r2 = r.clone(), r.clone()
        y = add_rmsnorm(x, w, 1e-6, residual=r1, x_bias=b)
        want = add_rmsnorm((x.float() + b.float()).to(dtype), w, 1e-6, residual=r2)
        assert same(y, want) and same(r1, r2)
        y, (q, ds) = add_rmsnorm(x, w, 1e-6, x_bias=b, i8=True)
        assert same(y, add_rmsnorm((x.float() + b.float()).to(dtype), w, 1e-6))
    pairs = torch.randn(T * k, H, dtype=dtype, device=device)
    xw = torch.softmax(torch.randn(T, k, device=device), -1)
    bias = torch.randn(E, H, device=device)
    ids = torch.randint(0, E, (T * k,), dtype=torch.int32, device=device)
    y = add_rmsnorm(pairs, w, 1e-6, x_weights=xw, x_bias=bias, x_bias_ids=ids)
    biased = (pairs.float() + bias[ids.long()]).to(dtype)
    assert same(y, add_rmsnorm(moe_combine(biased, xw), w, 1e-6))
    assert (y.float() - add_rmsnorm(moe_combine(pairs, xw), w, 1e-6).float()).abs().max() > 0.1  # biases count
    with pytest.raises(ValueError, match=r"x_bias must have shape \(160,\)"):
        add_rmsnorm(x, w, 1e-6, x_bias=torch.randn(H + 1, device=device))
    with pytest.raises(TypeError, match="x_bias must have dtype"):
        add_rmsnorm(x, w, 1e-6, x_bias=torch.randn(H, device=device).double())
    with pytest.raises(TypeError, match="x_bias must be a torch.Tensor"):
        add_rmsnorm(x, w, 1e-6, x_bias=[0.0] * H)
    with pytest.raises(ValueError, match=r"x_bias must have shape \('\*', 160\)"):
        add_rmsnorm(pairs, w, 1e-6, x_weights=xw, x_bias=bias[0], x_bias_ids=ids)
    with pytest.raises(ValueError, match=r"x_bias_ids must have shape \(12,\)"):
        add_rmsnorm(pairs, w, 1e-6, x_weights=xw, x_bias=bias, x_bias_ids=ids[:5])
    with pytest.raises(TypeError, match="x_bias_ids must have dtype"):
        add_rmsnorm(pairs, w, 1e-6, x_weights=xw, x_bias=bias, x_bias_ids=ids.float())
    with pytest.raises(ValueError, match="x_bias_ids given without x_bias"):
        add_rmsnorm(x, w, 1e-6, x_bias_ids=ids)
    with pytest.raises(ValueError, match="x_bias_ids goes with x_weights"):
        add_rmsnorm(x, w, 1e-6, x_bias=bias[0], x_bias_ids=ids)


@pytest.mark.parametrize("H", [96, 4096])
def test_add_rmsnorm_i8(H, device):
    """i8=True: y as without it (to rounding: the sum of squares runs over another tile shape), and y rounded to
    int8 exactly as qgemv.int8.quantize_act(y, lanes=True) rounds it (codes in i8 lane order, scales per block)."""
    x = torch.randn(1, H, dtype=torch.float16, device=device)
    r = torch.randn(1, H, dtype=torch.float16, device=device)
    w = torch.randn(H, device=device)
    r2 = r.clone()
    y0 = add_rmsnorm(x, w, 1e-5, residual=r2)
    y, (q, ds) = add_rmsnorm(x, w, 1e-5, residual=r, i8=True)
    assert torch.equal(r, r2)
    assert_close(y, y0, torch.float16)
    q_want, ds_want = quantize_act(y, lanes=True)
    assert q.shape == (1, -(-H // 2048) * 2048) and ds.shape == (1, H // 32, 2)
    pos = i8_lane_positions(H).to(device)
    assert torch.equal(q[:, pos], q_want[:, pos]) and torch.equal(ds, ds_want)
    with pytest.raises(ValueError, match="multiple of 32"):
        add_rmsnorm(torch.randn(1, 100, device=device), torch.ones(100, device=device), 1e-5, i8=True)


def test_silu_mul(device):
    gu = torch.randn(3, 2 * 1100, dtype=torch.float16, device=device) * 3
    g, u = gu[:, :1100].double(), gu[:, 1100:].double()
    assert_close(silu_mul(gu), torch.nn.functional.silu(g) * u, torch.float16)
    y, yl = silu_mul(gu, lanes=True)
    assert yl.shape == (3, 2048) and torch.equal(yl[:, lane_positions(1100).to(device)], y)
    assert_close(y, torch.nn.functional.silu(g) * u, torch.float16)
    # GeGLU (Gemma), with the lane-order copy too
    y, yl = silu_mul(gu, lanes=True, act="gelu_tanh")
    assert_close(y, torch.nn.functional.gelu(g, approximate="tanh") * u, torch.float16)
    assert torch.equal(yl[:, lane_positions(1100).to(device)], y)
    # into a wider out (x of a down matrix padded along K): the same bits, zeros past F (out starts as NaN; 2100
    # columns take a second program past F's), both activations
    for act in ("silu", "gelu_tanh"):
        out = torch.full((3, 2100), float("nan"), dtype=torch.float16, device=device)
        y = silu_mul(gu, act=act, out=out)
        assert y.shape == (3, 1100) and y.data_ptr() == out.data_ptr() and torch.equal(y, silu_mul(gu, act=act))
        assert torch.equal(out[:, 1100:], torch.zeros(3, 1000, dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match=r"out must be \[T=3, >= F=1100\]"):
        silu_mul(gu, out=torch.empty(3, 1000, dtype=torch.float16, device=device))


def rope_ref(x, pos, inv_freq, neox, mscale=1.0):
    """x [T, H, D] float64 rotated at positions pos."""
    ang = pos.to(x.device).double()[:, None] * inv_freq.to(x.device).double()[None, :]  # [T, D/2]
    cos, sin = torch.cos(ang)[:, None, :] * mscale, torch.sin(ang)[:, None, :] * mscale
    if neox:
        a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
    return out


def head_norm_ref(x, w, eps, dtype):
    return ((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype).double() * w.double()).to(dtype).double()


@pytest.mark.parametrize("neox,bias,qk_norm,v_apart", [(True, False, False, False), (False, False, False, False),
                                                       (True, True, False, False), (True, False, True, False),
                                                       (False, True, False, True), (True, False, True, True)])
def test_rope_store(neox, bias, qk_norm, v_apart, device):
    """v_apart: V given as a tensor of its own (the engine's q6_k V beside a q/k stack), not the end of qkv."""
    T, Hq, Hkv, D, ps = 7, 6, 2, 64, 4
    dt = torch.float16
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, dtype=dt, device=device)
    pos = torch.tensor([0, 1, 2, 9, 100, 4095, 3], dtype=torch.int32, device=device)
    slots = torch.tensor([0, 5, -1, 6, 11, 2, 7], device=device)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    b = torch.randn(qkv.shape[1], device=device) if bias else None
    qn, kn = (torch.randn(D, device=device), torch.randn(D, device=device)) if qk_norm else (None, None)
    kc = torch.full((3, ps, Hkv, D), float("nan"), dtype=dt, device=device)
    vc = torch.full_like(kc, float("nan"))
    src = qkv.double() + (b.double() if bias else 0)
    if bias:
        src = src.to(dt).double()
    q, k, v = src[:, :Hq * D].view(T, Hq, D), src[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D), src[:, (Hq + Hkv) * D:]
    if qk_norm:
        q, k = head_norm_ref(q, qn, 1e-6, dt), head_norm_ref(k, kn, 1e-6, dt)
    q_want, k_want = rope_ref(q, pos.cpu(), inv, neox), rope_ref(k, pos.cpu(), inv, neox)
    qk, v_in = qkv, None
    if v_apart:  # q and k in a buffer of their own (strided view), V apart
        qk = torch.randn(T, (Hq + Hkv) * D + 64, dtype=dt, device=device)[:, :(Hq + Hkv) * D]
        qk.copy_(qkv[:, :(Hq + Hkv) * D])
        v_in = qkv[:, (Hq + Hkv) * D:].clone()
        qkv[:, (Hq + Hkv) * D:] = float("nan")  # must not be read
    out = rope_store(qk, pos, slots, inv.float().to(device), kc, vc, n_heads=Hq, n_kv_heads=Hkv, neox=neox,
                     bias=b, q_norm=qn, k_norm=kn, eps=1e-6, v=v_in)
    assert out.shape == (T, Hq, D) and out.data_ptr() == qk.data_ptr()
    assert_close(out, q_want, dt)
    flat_k, flat_v = kc.view(-1, Hkv, D), vc.view(-1, Hkv, D)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert_close(flat_k[s], k_want[t], dt)
            assert_close(flat_v[s], v[t].view(Hkv, D), dt)
    written = set(s for s in slots.tolist() if s >= 0)
    untouched = [s for s in range(flat_k.shape[0]) if s not in written]
    assert torch.isnan(flat_k[untouched]).all() and torch.isnan(flat_v[untouched]).all()


def test_rope_frequencies_match_transformers():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    base = dict(arch="llama", n_layers=1, hidden=512, ffn=1, n_heads=4, n_kv_heads=4, head_dim=128, vocab_size=8,
                rms_eps=1e-5, rope_theta=500000.0, rope_style="interleaved", context_length=131072)
    cases = [
        ("linear", dict(rope_type="linear", factor=4.0), dict(rope_scaling="linear", rope_factor=4.0)),
        ("yarn", dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768, beta_fast=32.0,
                      beta_slow=1.0), dict(rope_scaling="yarn", rope_factor=4.0, rope_orig_context=32768)),
        ("llama3", dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position_embeddings=8192), dict(rope_scaling="llama3")),
    ]
    for name, hf_scaling, ours in cases:
        cfg = LlamaConfig(hidden_size=512, num_attention_heads=4, head_dim=128, max_position_embeddings=131072,
                          rope_theta=500000.0, rope_scaling=dict(hf_scaling, rope_theta=500000.0))
        inv_hf, attn_factor = ROPE_INIT_FUNCTIONS[name](cfg, "cpu")
        freqs = llama3_rope_factors(128, 500000.0, 8.0, 1.0, 4.0, 8192) if name == "llama3" else None
        inv, mscale = rope_inv_freq(ModelConfig(**base, **ours), freqs)
        torch.testing.assert_close(inv.double(), inv_hf.double(), rtol=1e-6, atol=0)
        assert math.isclose(mscale, attn_factor, rel_tol=1e-6), (name, mscale, attn_factor)


def test_sentencepiece_style_tokenizer_from_metadata():
    """tokenizer.ggml.model = "llama": merges built from the scores, byte fallback for unknown characters."""
    pytest.importorskip("tokenizers")
    from llmkernels.engine.tokenizer import Tokenizer

    pieces = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "\u2581h", "ll", "\u2581he", "llo", "\u2581hello",
              "\u2581w", "or", "\u2581wor", "ld", "\u2581world"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + pieces
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    tok = Tokenizer({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
                     "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1,
                     "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0})
    ids = tok.encode("hello world")
    assert ids == [1, tokens.index("\u2581hello"), tokens.index("\u2581world")]  # BOS first (add_bos default)
    assert tok.decode(ids) == "hello world"
    ids = tok.encode("hello é", add_bos=False)  # é is not in the vocab: its UTF-8 bytes 0xC3 0xA9
    assert ids == [tokens.index("\u2581hello"), tokens.index("\u2581"), 3 + 0xC3, 3 + 0xA9]
    assert tok.decode(ids) == "hello é"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("P,F", [(7, 100), (1, 1030)])
def test_swiglu_oai(P, F, dtype, device):
    """gpt-oss's expert activation: biases by expert, both clamps active (products up to +-12), against float64."""
    from llmkernels.engine.config import OSS_ALPHA, OSS_LIMIT
    from llmkernels.engine.kernels import swiglu_oai

    E = 4
    g = (torch.randn(P, F, device=device) * 6).to(dtype)
    u = (torch.randn(P, F, device=device) * 6).to(dtype)
    ex = torch.randint(0, E, (P,), dtype=torch.int32, device=device)
    bg, bu = torch.randn(E, F, device=device), torch.randn(E, F, device=device)
    y = swiglu_oai(g, u, ex, bg, bu)
    gc = (g.double() + bg.double()[ex.long()]).clamp(max=OSS_LIMIT)
    uc = (u.double() + bu.double()[ex.long()]).clamp(-OSS_LIMIT, OSS_LIMIT)
    assert ((gc > OSS_LIMIT - 1e-9).any() and (uc.abs() > OSS_LIMIT - 1e-9).any())
    want = (uc + 1) * gc * torch.sigmoid(OSS_ALPHA * gc)
    assert y.shape == (P, F) and y.dtype == dtype and torch.isfinite(y).all()
    assert_close(y, want, dtype)
    with pytest.raises(ValueError, match="biases must be"):
        swiglu_oai(g, u, ex, bg[:, :-1], bu)


def test_moe_pairs_equals_moe_gemv(device):
    """The unchecked pair products (ids from moe_route) are moe_gemv's, pair p reading row p // top_k."""
    import llmkernels as lk
    from llmkernels.qgemv.moe import moe_gemv, moe_pairs

    qt = lk.quantize(torch.randn(5 * 24, 64, device=device) * 0.1, "mxfp4")
    x = torch.randn(3, 64, dtype=torch.float16, device=device)
    e = torch.tensor([4, 0, 1, 1, 0, 3], dtype=torch.int32, device=device)
    tok = torch.arange(3, device=device).repeat_interleave(2)
    assert torch.equal(moe_pairs(x, qt, 5, e, 2), moe_gemv(x, qt, 5, e, tok))
