"""The mixture-of-experts GEMV against per-pair products with the dequantized experts (float64), and the router."""
import pytest
import torch

import llmkernels as lk
from llmkernels.qgemv import route
from llmkernels.qgemv.moe import group_pairs, moe_combine, moe_ffn, moe_gate_up_silu, moe_gemv, moe_route
from llmkernels.testing import assert_close, moe_gate_up_silu_ref, moe_gemv_ref

FORMATS = [("f16", {}), ("bf16", {}), ("q8_0", {}), ("q4_0", {}), ("q5_1", {}), ("q4_k", {}), ("q6_k", {}),
           ("q5_k", {}), ("q3_k", {}), ("iq4_xs", {}), ("iq4_nl", {}), ("mxfp4", {}),
           ("mlx", dict(bits=4, group_size=64))]
ids = [f if not kw else "mlx4g64" for f, kw in FORMATS]


def stacked(fmt, kw, E, N, K, device):
    return lk.quantize(torch.randn(E * N, K, device=device) * 0.05, fmt, **kw)


def rel_close(y, ref, dtype):
    tol = {torch.float16: 4e-3, torch.bfloat16: 2e-2, torch.float32: 1e-3}[dtype]
    assert_close(y, ref, dtype, atol=tol * (ref.abs().max().item() + 1e-6), rtol=tol)


@pytest.mark.parametrize("path", ["moe_gemv", "moe_grouped", "moe_tc"])
@pytest.mark.parametrize("fmt,kw", FORMATS, ids=ids)
def test_moe_gemv_every_format(fmt, kw, path, device):
    """5 experts of 19 rows, 3 tokens x top 3 (pairs in any order, expert 2 chosen by nobody), a single pair, and
    the down projection's one row per pair; a GEMV per pair, the pairs grouped by expert, and grouped on the tensor
    cores (the formats it reads; the others fall through to the grouped kernel)."""
    with route.override(exclude={"moe_gemv", "moe_grouped", "moe_tc"} - {path}):
        _every_format(fmt, kw, device)


def _every_format(fmt, kw, device):
    E, N, K = 5, 19, 256
    qt = stacked(fmt, kw, E, N, K, device)
    x = torch.randn(3, K, dtype=torch.float16, device=device)
    e = torch.tensor([4, 0, 1, 3, 0, 4, 1, 3, 0], dtype=torch.int32, device=device)
    t = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2], dtype=torch.int32, device=device)
    y = moe_gemv(x, qt, E, e, t)
    assert y.shape == (9, N) and y.dtype == torch.float16
    rel_close(y, moe_gemv_ref(x, qt, E, e, t), torch.float16)
    one = moe_gemv(x, qt, E, e[5:6], t[5:6].long())
    rel_close(one, moe_gemv_ref(x, qt, E, e[5:6], t[5:6]), torch.float16)
    h = torch.randn(9, K, dtype=torch.float16, device=device)
    rel_close(moe_gemv(h, qt, E, e), moe_gemv_ref(h, qt, E, e), torch.float16)
    if fmt != "mlx":  # as GGUF's ffn_*_exps are read: [E, N, K]
        qt3 = lk.quantize(torch.randn(E, N, K, device=device) * 0.05, fmt)
        rel_close(moe_gemv(x, qt3, E, e, t), moe_gemv_ref(x, qt3, E, e, t), torch.float16)


@pytest.mark.parametrize("fmt,kw", [("q4_k", {}), ("q8_0", {}), ("mlx", dict(bits=4, group_size=64))],
                         ids=["q4_k", "q8_0", "mlx4g64"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_moe_gate_up_silu(fmt, kw, dtype, device):
    E, F, K = 7, 24, 512
    gate, up = stacked(fmt, kw, E, F, K, device), stacked(fmt, kw, E, F, K, device)
    x = torch.randn(2, K, dtype=dtype, device=device)
    w, e = moe_route(torch.randn(2, E, device=device), top_k=3)
    tok = torch.arange(2, device=device).repeat_interleave(3)
    h = moe_gate_up_silu(x, gate, up, E, e.flatten(), tok)
    assert h.shape == (6, F) and h.dtype == dtype
    rel_close(h, moe_gate_up_silu_ref(x, gate, up, E, e.flatten(), tok), dtype)


def test_group_pairs(device):
    """Every pair in exactly one slot, each block holding pairs of its expert only, padding -1, blocks past the
    last expert's marked -1; experts nobody chose take no block."""
    E, bm = 6, 4
    e = torch.tensor([5, 0, 5, 3, 0, 5, 5, 5, 0, 3, 5], dtype=torch.int32, device=device)
    pairs, owner = group_pairs(e, E, bm)
    assert pairs.shape[0] == owner.shape[0] * bm
    got = pairs[pairs >= 0].sort().values
    assert got.tolist() == list(range(e.shape[0]))
    blocks = pairs.view(-1, bm).cpu()
    for b, o in enumerate(owner.cpu().tolist()):
        members = blocks[b][blocks[b] >= 0]
        if o < 0:
            assert members.numel() == 0
        else:
            assert members.numel() > 0 and (e.cpu()[members.long()] == o).all()
    assert sorted(set(owner.cpu().tolist()) - {-1}) == [0, 3, 5]
    assert owner.cpu().tolist().count(5) == 2  # 6 pairs of expert 5 in blocks of 4


@pytest.mark.parametrize("fmt,kw", [("q4_k", {}), ("q8_0", {}), ("q6_k", {}), ("mlx", dict(bits=4, group_size=32))],
                         ids=["q4_k", "q8_0", "q6_k", "mlx4g32"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_moe_ffn_prefill_grouped(fmt, kw, dtype, device):
    """A prefill-sized MoE FFN (23 tokens, top 3 of 7 experts, two of them never chosen, F = 256, H = 512): the
    grouped kernels against float64 per-pair products, and in fp16 against the GEMV per pair (outputs start as
    NaN)."""
    E, F, H, T, k = 7, 256, 512, 23, 3
    gate, up = stacked(fmt, kw, E, F, H, device), stacked(fmt, kw, E, F, H, device)
    down = stacked(fmt, kw, E, H, F, device)
    x = torch.randn(T, H, dtype=dtype, device=device)
    logits = torch.randn(T, E, device=device)
    logits[:, [1, 4]] = -1e4  # experts 1 and 4: chosen by nobody
    w, e = moe_route(logits, top_k=k)
    assert route.moe_grouped(T * k, E)
    tok = torch.arange(T, device=device).repeat_interleave(k)
    h = moe_gate_up_silu(x, gate, up, E, e.flatten(), tok)
    ref_h = moe_gate_up_silu_ref(x, gate, up, E, e.flatten(), tok)
    rel_close(h, ref_h, dtype)
    y = moe_ffn(x, w, e, gate, up, down, E)
    ref = (moe_gemv_ref(h, down, E, e.flatten()).view(T, k, -1).double() * w.view(T, k, 1).double()).sum(1)
    rel_close(y, ref, dtype)
    if dtype == torch.float16:
        with route.override(exclude={"moe_grouped", "moe_tc"}):
            rel_close(y, moe_ffn(x, w, e, gate, up, down, E).double(), dtype)


def test_moe_route():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 3.0, 0.0, 0.0]])
    w, e = moe_route(logits, 2)
    assert e.dtype == torch.int32 and e[0].tolist() == [1, 2] and sorted(e[1].tolist()) == [0, 1]  # a tie
    p = torch.softmax(torch.tensor([2.0, 1.0]), 0)
    assert torch.allclose(w[0], p) and torch.allclose(w[1], torch.tensor([0.5, 0.5]))
    w2, _ = moe_route(logits, 2, renormalize=False)
    assert torch.allclose(w2[0], torch.softmax(logits[0], 0)[[1, 2]])
    with pytest.raises(ValueError, match="top_k \\(5\\) must be at most the number of experts \\(4\\)"):
        moe_route(logits, 5)
    with pytest.raises(TypeError, match="router_logits must be a float tensor"):
        moe_route(logits.long(), 1)


def test_moe_errors(device):
    E, N, K = 4, 8, 256
    qt = stacked("q8_0", {}, E, N, K, device)
    x = torch.randn(2, K, dtype=torch.float16, device=device)
    e = torch.tensor([0, 3], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="or \\[num_experts, N, K\\] with num_experts = 3"):
        moe_gemv(x, qt, 3, e)
    with pytest.raises(ValueError, match="expert_ids must lie in \\[0, 4\\), got values in \\[0, 4\\]"):
        moe_gemv(x, qt, E, torch.tensor([0, 4], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="token_ids must lie in \\[0, 2\\)"):
        moe_gemv(x, qt, E, e, torch.tensor([0, 2], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="one row per pair"):
        moe_gemv(x, qt, E, e[:1])
    with pytest.raises(TypeError, match="expert_ids must have dtype"):
        moe_gemv(x, qt, E, e.float())
    with pytest.raises(ValueError, match="x must be \\[tokens, K=256\\]"):
        moe_gemv(x[:, :128], qt, E, e)
    with pytest.raises(ValueError, match="must share a format"):
        moe_gate_up_silu(x, qt, stacked("q4_0", {}, E, N, K, device), E, e)
    empty = moe_gemv(x, qt, E, e[:0], e[:0])
    assert empty.shape == (0, N)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q8_0"])
@pytest.mark.parametrize("tokens", [1, 5, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_moe_qwen3_30b_shapes(fmt, tokens, dtype):
    """Qwen3-30B-A3B's expert shapes (128 experts, top 8, hidden 2048, expert FFN 768), compiled: a GEMV per pair
    for 1 and 5 tokens, the pairs grouped by expert for a 300-token prefill."""
    E, F, H, k = 128, 768, 2048, 8
    gate, up = stacked(fmt, {}, E, F, H, "cuda"), stacked(fmt, {}, E, F, H, "cuda")
    down = stacked(fmt, {}, E, H, F, "cuda")
    x = torch.randn(tokens, H, dtype=dtype, device="cuda")
    w, e = moe_route(torch.randn(tokens, E, device="cuda"), top_k=k)
    assert route.moe_grouped(tokens * k, E) == (tokens == 300)
    tok = torch.arange(tokens, device="cuda").repeat_interleave(k)
    h = moe_gate_up_silu(x, gate, up, E, e.flatten(), tok)
    rel_close(h, moe_gate_up_silu_ref(x, gate, up, E, e.flatten(), tok), dtype)
    y = moe_gemv(h, down, E, e.flatten())
    rel_close(y, moe_gemv_ref(h, down, E, e.flatten()), dtype)


@pytest.mark.parametrize("T,E,k", [(1, 128, 8), (5, 8, 2), (3, 7, 7), (4, 300, 3)])
def test_fused_route_matches_torch(T, E, k, device):
    """The one-launch router (what moe_route runs on a GPU) against softmax, torch.topk and the renormalization;
    logits of bf16 rows, a row with experts far below the rest (probabilities that underflow to 0), never a
    padding lane chosen."""
    from llmkernels.qgemv.moe import _route_fused, _route_torch

    logits = torch.randn(T, E, device=device).to(torch.bfloat16)
    logits[0, : E // 2] = -1e4
    for renorm in (True, False):
        w, e = _route_fused(logits, k, renorm)
        rw, re = _route_torch(logits, k, renorm)
        assert e.dtype == torch.int32 and w.dtype == torch.float32 and w.shape == e.shape == (T, k)
        assert ((e >= 0) & (e < E)).all() and all(len(set(r)) == k for r in e.tolist())
        assert torch.allclose(w, rw, atol=1e-6, rtol=1e-5)
        same = torch.gather(torch.softmax(logits.float(), -1), 1, e.long())  # ties may order differently
        assert torch.allclose(same, torch.gather(torch.softmax(logits.float(), -1), 1, re.long()), atol=1e-7)
    # gpt-oss's router bias: added in float32, rounded to the logits' dtype (fp16: the interpreter rounds bf16
    # toward zero, a GPU to nearest)
    bias, lh = torch.randn(E, device=device), logits.to(torch.float16)
    w, e = _route_fused(lh, k, True, bias)
    rw, re = _route_torch((lh.float() + bias).half(), k, True)
    assert torch.allclose(w, rw, atol=1e-6, rtol=1e-5)
    assert torch.allclose(moe_route(lh, k, bias=bias)[0], rw, atol=1e-6, rtol=1e-5)
    assert torch.allclose(_route_torch(lh, k, True, bias)[0], rw)


def test_moe_route_bias_is_checked(device):
    logits = torch.randn(2, 4, device=device)
    with pytest.raises(ValueError, match="bias must have shape \\(4,\\)"):
        moe_route(logits, 2, bias=torch.zeros(5, device=device))
    with pytest.raises(TypeError, match="bias must have dtype"):
        moe_route(logits, 2, bias=torch.zeros(4, dtype=torch.int32, device=device))
    with pytest.raises(TypeError, match="bias must be a torch.Tensor"):
        moe_route(logits, 2, bias=[0.0] * 4)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "q6_k"])
def test_moe_ffn_decode_matches_per_pair_reference(fmt, device, monkeypatch):
    """moe_ffn at decode sizes (a GEMV per pair, tokens implied by the pair index, the weighted sum in one
    kernel): 3 tokens x top 2 of 7 experts against float64 per-pair products; the output starts as NaN. The
    K-quants run the m1 kernel over the stacked experts (q4_k's gate and up fused, as its GLU; q6_k's down). (With
    6 pairs over 7 experts the route would group them on the tensor cores, which other tests cover: kept out.)"""
    import llmkernels.qgemv.moe as moe

    calls = []
    real = moe.launch_m1
    monkeypatch.setattr(moe, "launch_m1", lambda *a, **kw: calls.append(kw["up"] is not None) or real(*a, **kw))
    E, F, H, T, k = 7, 256, 256, 3, 2
    gate, up, down = (stacked(fmt, {}, E, n, kk, device) for n, kk in ((F, H), (F, H), (H, F)))
    x = torch.randn(T, H, dtype=torch.float16, device=device)
    w, e = moe_route(torch.randn(T, E, device=device), top_k=k)
    assert not route.moe_grouped(T * k, E)
    tok = torch.arange(T, device=device).repeat_interleave(k)
    h = moe_gate_up_silu_ref(x, gate, up, E, e.flatten(), tok).to(torch.float16)
    ref = (moe_gemv_ref(h, down, E, e.flatten()).view(T, k, -1).double() * w.view(T, k, 1).double()).sum(1)
    assert route.moe_tc(T * k, E)
    with route.override(exclude={"moe_tc"}):
        rel_close(moe_ffn(x, w, e, gate, up, down, E), ref, torch.float16)
        # the sum left to the caller: the pairs' products and float32 weights, which moe_combine adds as moe_ffn does
        pairs, pw = moe_ffn(x, w, e, gate, up, down, E, combine=False)
        assert pairs.shape == (T * k, H) and pw.dtype == torch.float32 and torch.equal(pw, w)
        assert torch.equal(moe_combine(pairs, pw), moe_ffn(x, w, e, gate, up, down, E))
    assert calls == {"q8_0": [], "q4_k": [True, False], "q6_k": [False]}[fmt] * 3


def test_moe_m1_builds_compile_for_sm90():
    """The m1 kernel's mixture-of-experts builds (q4_k gate/up as GLU over 8 experts per token, q6_k's down) compile
    to sm_90 code on a machine without a GPU; the interpreter runs the same source, so its tests cover the logic."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("from llmkernels.qgemv.m1 import compile_sm90; "
            "print(all(len(compile_sm90(*a).asm['cubin']) > 0 for a in "
            "[('q4_k', (2, 1, 4, 3, 8, 1, 1), 8, True), ('q6_k', (4, 1, 4, 3, 1, 2), 1)]))")
    env = dict(os.environ, TRITON_INTERPRET="0")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip() == "True", res.stderr[-3000:]


@pytest.mark.parametrize("path", ["moe_tc", "moe_gemv", "moe_grouped"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_moe_ffn_row_padded_q6_k_down(path, dtype, device):
    """q6_k expert downs whose rows are not 16-byte aligned (K = 256: 210-byte rows), padded to 224 bytes as the
    engine pads them (pad_rows): every MoE kernel reads the padded stack right (the tensor cores only with the
    padding); 6 tokens x top 2 of 5 experts against float64 per-pair products of the unpadded stack."""
    from llmkernels.quant.tensor import pad_rows

    E, F, H, T, k = 5, 256, 512, 6, 2
    gate, up = stacked("q4_k", {}, E, F, H, device), stacked("q4_k", {}, E, F, H, device)
    down = stacked("q6_k", {}, E, H, F, device)
    padded = pad_rows(down)
    assert padded.data.shape == (E * H, 224) and (padded.data[:, 210:] == 0).all()
    x = torch.randn(T, H, dtype=dtype, device=device)
    w, e = moe_route(torch.randn(T, E, device=device), top_k=k)
    tok = torch.arange(T, device=device).repeat_interleave(k)
    h = moe_gate_up_silu_ref(x, gate, up, E, e.flatten(), tok).to(dtype)
    ref = (moe_gemv_ref(h, down, E, e.flatten()).view(T, k, -1).double() * w.view(T, k, 1).double()).sum(1)
    with route.override(exclude={"moe_gemv", "moe_grouped", "moe_tc"} - {path}):
        rel_close(moe_ffn(x, w, e, gate, up, padded, E), ref, dtype)


def test_pad_rows(device):
    from llmkernels.quant.tensor import dequantize, pad_rows

    q6 = stacked("q6_k", {}, 3, 4, 768, device)  # 630-byte rows
    p = pad_rows(q6)
    assert p.data.shape == (12, 640) and p.shape == q6.shape and torch.equal(p.data[:, :630], q6.data)
    with pytest.raises(ValueError, match="rows are 640 bytes apart, q6_k rows of K=768 are 630"):
        dequantize(p)
    with pytest.raises(ValueError, match="already 640 bytes apart"):
        pad_rows(p)
    q4 = stacked("q4_k", {}, 3, 4, 768, device)  # 432-byte rows, aligned already
    assert pad_rows(q4) is q4
    with pytest.raises(ValueError, match="takes a GGUF-format matrix"):
        pad_rows(stacked("mlx", dict(bits=4, group_size=64), 3, 4, 256, device))
    for bad in (0, -16, 2.5, True):
        with pytest.raises(ValueError, match=f"multiple must be a positive int .bytes., got {bad!r}"):
            pad_rows(q6, bad)


@pytest.mark.parametrize("fmt", ["mxfp4", "iq4_nl"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_codebook_experts_take_tc_at_decode(fmt, dtype, device, monkeypatch):
    """Codebook expert stacks (gpt-oss's mxfp4) have no m1 kernel, so even one token's pairs run on the tensor
    cores, each expert a block of its own; with K = 352 (11 blocks, 187- or 198-byte rows) only once the rows are
    padded to 16 bytes as the engine pads them (pad_rows), the generic kernel otherwise. Against the unpadded
    stack's float64 per-pair products, gate, up and down as gpt-oss's engine runs them (moe_pairs)."""
    import llmkernels.qgemv.moe as moe
    from llmkernels.qgemv.moe import moe_pairs
    from llmkernels.quant.tensor import pad_rows

    calls = []
    real = moe.launch_tc_moe
    monkeypatch.setattr(moe, "launch_tc_moe", lambda *a, **kw: calls.append(a[1].shape[-1]) or real(*a, **kw))
    E, F, H, k = 8, 40, 352, 4
    gate, down = stacked(fmt, {}, E, F, H, device), stacked(fmt, {}, E, H, F * 8 + 32, device)
    for T in (1, 3):
        x = torch.randn(T, H, dtype=dtype, device=device)
        _, e = moe_route(torch.randn(T, E, device=device), top_k=k)
        ex = e.flatten()
        tok = torch.arange(T, device=device).repeat_interleave(k)
        ref = moe_gemv_ref(x, gate, E, ex, tok)
        rel_close(moe_pairs(x, gate, E, ex, k), ref, dtype)  # 187 / 198-byte rows: the generic kernel
        assert calls == []
        rel_close(moe_pairs(x, pad_rows(gate), E, ex, k), ref, dtype)
        h = torch.randn(T * k, F * 8 + 32, dtype=dtype, device=device)
        rel_close(moe_pairs(h, pad_rows(down), E, ex), moe_gemv_ref(h, down, E, ex), dtype)
        assert calls == [pad_rows(gate).data.shape[-1], pad_rows(down).data.shape[-1]]
        calls.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_moe_gpt_oss_shapes(tokens, dtype):
    """gpt-oss-20b's expert shapes ([2880, 2880] experts, top 4; 8 of its 32 experts, to keep the float64 reference
    small; mxfp4, rows padded as the engine pads them) on the tensor cores, compiled, against float64 per-pair
    products of the unpadded stacks."""
    from llmkernels.qgemv.moe import moe_pairs
    from llmkernels.quant.tensor import pad_rows

    E, F, H, k = 8, 2880, 2880, 4
    gate, down = stacked("mxfp4", {}, E, F, H, "cuda"), stacked("mxfp4", {}, E, H, F, "cuda")
    x = torch.randn(tokens, H, dtype=dtype, device="cuda")
    _, e = moe_route(torch.randn(tokens, E, device="cuda"), top_k=k)
    ex = e.flatten()
    tok = torch.arange(tokens, device="cuda").repeat_interleave(k)
    rel_close(moe_pairs(x, pad_rows(gate), E, ex, k), moe_gemv_ref(x, gate, E, ex, tok), dtype)
    h = torch.randn(tokens * k, F, dtype=dtype, device="cuda")
    rel_close(moe_pairs(h, pad_rows(down), E, ex), moe_gemv_ref(h, down, E, ex), dtype)


@pytest.mark.parametrize("split", [1, 2, 3])
def test_moe_pairs_gate_and_up_in_one_launch(split, device, monkeypatch):
    """moe_pairs(..., up=) returns [P, 2N], the up products after the gate's: one tensor-core launch for mxfp4 stacks
    (padded rows), K split ``split`` ways (forced; on a GPU route.moe_tc_split splits small grids) with the
    partials summed after; two per-pair launches where the tensor cores do not read the stacks (q4_1). Bad
    ``up`` stacks are refused."""
    import llmkernels.qgemv.moe as moe
    from llmkernels.qgemv.moe import moe_pairs
    from llmkernels.quant.tensor import pad_rows

    calls = []
    real = moe.launch_tc_moe
    monkeypatch.setattr(moe, "launch_tc_moe", lambda *a, **kw: calls.append(kw["split"]) or real(*a, **kw))
    monkeypatch.setattr(route, "moe_tc_split", lambda *a: split)
    E, F, H, k = 6, 24, 352, 3
    x = torch.randn(2, H, dtype=torch.float16, device=device)
    _, e = moe_route(torch.randn(2, E, device=device), top_k=k)
    ex, tok = e.flatten(), torch.arange(2, device=device).repeat_interleave(k)
    for fmt in ("mxfp4", "q4_1"):
        gate, up = stacked(fmt, {}, E, F, H, device), stacked(fmt, {}, E, F, H, device)
        pad = pad_rows if fmt == "mxfp4" else (lambda q: q)
        gu = moe_pairs(x, pad(gate), E, ex, k, up=pad(up))
        assert gu.shape == (2 * k, 2 * F)
        rel_close(gu[:, :F], moe_gemv_ref(x, gate, E, ex, tok), torch.float16)
        rel_close(gu[:, F:], moe_gemv_ref(x, up, E, ex, tok), torch.float16)
    assert calls == [split]
    # one token's distinct experts: each pair a block of its own, no grouping launch; the same products
    down_plain = stacked("mxfp4", {}, E, H, 64, device)
    gate, up = (pad_rows(stacked("mxfp4", {}, E, 64, H, device)) for _ in range(2))
    down = pad_rows(down_plain)
    x1, e1 = x[:1], e[:1].flatten()
    groups = moe.pair_groups(e1, E, one_token=True)
    assert groups[0].tolist() == sum(([p] + [-1] * (groups[2] - 1) for p in range(k)), [])
    assert torch.equal(groups[1], e1) and groups[2] == route.moe_tc_rows(k, E)
    assert torch.equal(moe_pairs(x1, gate, E, e1, k, up=up, groups=groups), moe_pairs(x1, gate, E, e1, k, up=up))
    h = torch.randn(k, 64, dtype=torch.float16, device=device)
    assert torch.equal(moe_pairs(h, down, E, e1, groups=groups), moe_pairs(h, down, E, e1))
    rel_close(moe_pairs(h, down, E, e1, groups=groups), moe_gemv_ref(h, down_plain, E, e1), torch.float16)
    with pytest.raises(ValueError, match="groups must be pair_groups"):  # made for other pairs
        moe_pairs(x, gate, E, ex, k, up=up, groups=groups)
    with pytest.raises(ValueError, match="groups must be pair_groups"):
        moe_pairs(h, down, E, e1, groups=groups[:2])
    with pytest.raises(TypeError, match="expert_ids must have dtype"):
        moe.pair_groups(e1.float(), E)
    with pytest.raises(ValueError, match="num_experts must be"):
        moe.pair_groups(e1, 0, one_token=True)
    with pytest.raises(ValueError, match="up must have qt's shape"):
        moe_pairs(x, gate, E, ex, k, up=stacked("q4_1", {}, E, F + 1, H, device))
    with pytest.raises(ValueError, match="up must have qt's shape"):
        moe_pairs(x, gate, E, ex, k, up=stacked("q8_0", {}, E, F, H, device))


def test_moe_ffn_one_token_pairs_each_a_block(device, monkeypatch):
    """moe_ffn at one token gives each pair a block of its own on the tensor cores (no grouping launch), which is
    right for any ids: a row that names one expert twice, against float64 per-pair products; the output starts as
    NaN."""
    import llmkernels.qgemv.moe as moe

    launched = []
    real = moe.group_pairs
    monkeypatch.setattr(moe, "group_pairs", lambda *a: launched.append(1) or real(*a))
    E, F, H = 6, 64, 256
    gate, up, down = (stacked("q8_0", {}, E, n, k, device) for n, k in ((F, H), (F, H), (H, F)))
    x = torch.randn(1, H, dtype=torch.float16, device=device)
    e = torch.tensor([[2, 5, 2]], dtype=torch.int32, device=device)
    w = torch.tensor([[0.5, 0.3, 0.2]], device=device)
    h = moe_gate_up_silu_ref(x, gate, up, E, e.flatten(), torch.zeros(3, dtype=torch.int32, device=device))
    y = moe_gemv_ref(h.to(torch.float16), down, E, e.flatten())
    ref = (y * w.double().reshape(3, 1)).sum(0, keepdim=True)
    with route.override(exclude={"moe_gemv", "moe_grouped"}):
        out = moe_ffn(x, w, e, gate, up, down, E)
    assert not launched and not out.isnan().any()
    rel_close(out, ref, torch.float16)
