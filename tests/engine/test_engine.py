"""The engine against transformers on tiny random models (CPU: interpreter; GPU tests at the end)."""
import os

import pytest
import torch

from llmkernels.engine import LLM, SamplingParams, gguf_to_hf_state_dict
from llmkernels.testing.tiny_models import hf_model_from_state_dict

PROMPTS = ["The quick brown fox", "Hello, world! How are you today? I'm fine", "12345 東京"]
LONG_PROMPT = "A scheduler batches requests continuously: sequences join"  # 28 tokens: past Gemma's test window


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double()


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids):].tolist()


# Logit errors are max |error| / max |logit|. Our activations are fp16 on the CPU (bf16 on the GPU); the references
# compute in float32. Against the original float32 weights, the format's own error is allowed on top: it is measured
# as the distance of transformers-on-dequantized-weights from transformers-on-original-weights.
ACT_TOL = {torch.float16: 2e-2, torch.bfloat16: 6e-2}
CPU_CASES = [("llama", "f32"), ("llama", "q4_k"), ("qwen2", "f16"), ("qwen3", "q8_0"), ("phi3", "q8_0"),
             ("gemma2", "f32"), ("gemma3", "q4_k"), ("llama", "iq4_xs"), ("qwen2", "mxfp4")]


def check_logits(llm, d, path, hf, ids):
    ours = llm.logits(ids).cpu()
    assert ours.shape == (len(ids), llm.cfg.vocab_size) and ours.dtype == torch.float32
    same = hf_logits(hf_model_from_state_dict(d, gguf_to_hf_state_dict(path)), ids)
    orig = hf_logits(hf, ids)
    tol = ACT_TOL[llm.dtype]
    assert rel_err(ours, same) < tol
    assert rel_err(ours, orig) < rel_err(same, orig) + tol


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("arch,fmt", CPU_CASES, ids=[f"{a}-{f}" for a, f in CPU_CASES])
def test_logits_match_transformers(model_files, arch, fmt, backend):
    """The kernels (the interpreter on the CPU) and the pure-torch forward alike."""
    d, path, hf = model_files(arch, fmt)
    llm = LLM(path, progress=False, max_num_batched_tokens=64, backend=backend)
    assert llm.backend == backend
    check_logits(llm, d, path, hf, llm.tokenizer.encode(PROMPTS[1]))


def test_bf16_logits(model_files):
    """bf16 activations, also on the CPU (the interpreter's bf16 dot is patched by the library)."""
    d, path, hf = model_files("llama", "q8_0")
    llm = LLM(path, dtype=torch.bfloat16, progress=False, max_num_batched_tokens=64, backend="triton")
    assert llm.dtype == torch.bfloat16
    check_logits(llm, d, path, hf, llm.tokenizer.encode(PROMPTS[0]))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_act_int8_logits(model_files, fmt):
    """LLM(act_int8=True): the projections take int8-rounded activations at batch 1 (q4_k: rounded by the RMSNorm
    kernel, or by gemv's own launch with LLMK_I8NORM=0, the same numbers); the logits move (the path ran) but stay
    within twice the activation tolerance of transformers on the same weights. A two-token step computes exactly."""
    d, path, hf = model_files("llama", fmt)
    ids = [17]
    exact = LLM(path, progress=False, max_num_batched_tokens=64, backend="triton")
    i8 = LLM(path, progress=False, max_num_batched_tokens=64, act_int8=True)
    a, b = exact.logits(ids).cpu(), i8.logits(ids).cpu()
    assert 0 < rel_err(b, a) < 2 * ACT_TOL[i8.dtype]  # the rounding compounds over the layers (2.1e-2 seen)
    same = hf_logits(hf_model_from_state_dict(d, gguf_to_hf_state_dict(path)), ids)
    assert rel_err(b, same) < 2 * ACT_TOL[i8.dtype]
    assert torch.equal(i8.logits([17, 18]).cpu(), exact.logits([17, 18]).cpu())
    if fmt == "q4_k":
        os.environ["LLMK_I8NORM"] = "0"
        try:
            assert torch.equal(i8.logits(ids).cpu(), b)
        finally:
            del os.environ["LLMK_I8NORM"]
    with pytest.raises(TypeError, match="act_int8"):
        LLM(path, progress=False, act_int8="yes")


def test_more_bits_layers():
    """llama.cpp's Q4_K_M rule for 32 layers: the first and last 4 and every third layer from 6 to 27 take q6_k."""
    from llmkernels.engine.convert import mix_format, more_bits

    assert [i for i in range(32) if more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert mix_format("q4_k_m", "output.weight", 32) == "q6_k"
    assert mix_format("q4_k_m", "blk.6.ffn_down.weight", 32) == "q6_k"
    assert mix_format("q4_k_m", "blk.7.attn_v.weight", 32) == "q4_k"
    assert mix_format("q4_k_m", "blk.6.attn_q.weight", 32) == "q4_k"
    assert mix_format("q4_k_m", "token_embd.weight", 32) == "q4_k"
    assert mix_format("q8_0", "output.weight", 32) == "q8_0"
    assert mix_format("q5_k_m", "blk.31.attn_v.weight", 32) == "q6_k"  # Q5_K_M: the same rule over q5_k
    assert mix_format("q5_k_m", "blk.30.ffn_gate.weight", 32) == mix_format("q5_k_m", "blk.8.attn_v.weight", 32) \
        == "q5_k"


def test_routes_are_chosen_at_load(model_files, monkeypatch):
    """The engine chooses every projection's GEMV route when it loads and its steps only look them up; routes bound
    inside route.override hold for later steps."""
    from llmkernels.qgemv import route

    d, path, hf = model_files("llama", "q4_k")
    llm = LLM(path, progress=False, max_num_batched_tokens=64)
    ids = llm.tokenizer.encode(PROMPTS[1])
    ref = llm.logits(ids)

    def refuse(*args, **kw):
        raise AssertionError("route.choose called after load")

    monkeypatch.setattr(route, "choose", refuse)
    assert torch.equal(llm.logits(ids), ref)
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, temperature=0))
    monkeypatch.undo()
    with route.override(exclude={"planes", "m1", "tc", "lanes", "glu"}):
        llm.model.bind_routes()
    used = {r.kernel for t in llm.model._routes.values() for (op, act), rs in t.items() if not act for r in rs}
    assert used <= {"generic", "dequant"}
    assert rel_err(llm.logits(ids), ref) < 1e-2  # the same products by another kernel


def test_padded_output_matrix(model_files, monkeypatch):
    """An output matrix padded with zero blocks along K (what the engine does on the GPU for q6_k rows the
    tensor-core kernel cannot read, Model._pad_output), forced here: the same logits and tokens, also with the
    embedding tied to it (the file's output.weight left out), which then reads its rows from the padded matrix."""
    import llmkernels.engine.model as model_mod
    from llmkernels.engine.config import ModelConfig
    from llmkernels.quant.gguf_io import read_gguf
    from llmkernels.quant.tensor import dequantize

    d, path, hf = model_files("gemma2", "f32")
    f = read_gguf(path)
    cfg = ModelConfig.from_gguf(f.metadata, f.keys())
    tied = {k: v for k, v in f.items() if k != "output.weight"}
    plain = LLM(path, progress=False, max_num_batched_tokens=64, backend="triton")
    ids = plain.tokenizer.encode(PROMPTS[1])
    plain_tied = LLM.from_model(model_mod.Model(cfg, tied, "cpu", plain.dtype), max_num_batched_tokens=64)
    monkeypatch.setattr(model_mod, "tc_padding", lambda qt, dtype: qt.shape[1] + qt.gguf.block_size * (
        64 // qt.gguf.block_size or 1))
    llm = LLM(path, progress=False, max_num_batched_tokens=64, backend="triton")
    llm_tied = LLM.from_model(model_mod.Model(cfg, tied, "cpu", plain.dtype), max_num_batched_tokens=64)
    H = cfg.hidden
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for ours, ref, is_tied in ((llm, plain, False), (llm_tied, plain_tied, True)):
        m = ours.model
        assert m.output_pad > 0 and m.output.shape[1] == H + m.output_pad and (m.tok_embd is m.output) == is_tied
        w = dequantize(m.output)
        assert torch.equal(w[:, H:], torch.zeros_like(w[:, H:])) and torch.equal(w[:, :H],
                                                                                 dequantize(ref.model.output))
        assert rel_err(ours.logits(ids).cpu(), ref.logits(ids).cpu()) < 1e-3
        assert ours.generate([ids], p)[0].token_ids == ref.generate([ids], p)[0].token_ids
    check_logits(llm, d, path, hf, ids)


def test_padded_layer_matrices(model_files, monkeypatch):
    """A layer's q6_k V and down padded with zero blocks along K (what the engine does on the GPU where their rows
    are not 16-byte aligned, Model._pad_layers; forced here): x is padded to match,
    the logits and greedy tokens are the unpadded engine's, exactly and with act_int8 (whose fused int8 paths the
    padded products skip). One zero block more here (the GPU pads to a multiple of 2048: the interpreter is slow)."""
    import llmkernels.engine.model as model_mod

    _, path, _ = model_files("llama", "q4_k_m")
    kw = dict(progress=False, max_num_batched_tokens=64, backend="triton")
    plain, plain_i8 = LLM(path, **kw), LLM(path, act_int8=True, **kw)
    monkeypatch.setattr(model_mod, "tc_padding", lambda qt, dtype: qt.shape[1] + 256 if qt.format == "q6_k" else None)
    llm, llm_i8 = LLM(path, **kw), LLM(path, act_int8=True, **kw)
    L = llm.model.layers[1]
    assert [m.format for m in L.qkv] == ["q4_k", "q6_k"] and L.down.format == "q6_k"
    assert {id(L.qkv[1]), id(L.down)} <= set(llm.model.padded) and len(llm.model.padded) == 2
    assert L.down.shape[1] == llm.cfg.ffn + 256 and llm.model.padded[id(L.down)] == llm.cfg.ffn
    ids = llm.tokenizer.encode(PROMPTS[0])
    # x comes zero-padded from the norm (the V's) and from the activation kernel (the down's): no padding launch
    widths, pad = [], torch.nn.functional.pad
    monkeypatch.setattr(torch.nn.functional, "pad", lambda x, p, *a, **k: widths.append(x.shape[-1]) or pad(x, p, *a,
                                                                                                            **k))
    for ours, ref in ((llm, plain), (llm_i8, plain_i8)):
        assert rel_err(ours.logits(ids).cpu(), ref.logits(ids).cpu()) < 1e-3
    assert not widths, widths
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    assert llm.generate([ids], p)[0].token_ids == plain.generate([ids], p)[0].token_ids


@pytest.mark.parametrize("mix,base", [("q4_k_m", "q4_k"), ("q5_k_m", "q5_k")])
def test_k_m_file(model_files, mix, base):
    """A q4_k_m (q5_k_m) conversion holds llama.cpp's mix; the engine stacks the q4_k (q5_k) attn_q and attn_k of a
    layer whose attn_v is q6_k into one matrix, and its logits match transformers on the same weights, exactly and
    with act_int8 (q6_k at K = 256 then computes exactly, q4_k and q5_k round)."""
    from llmkernels import read_gguf

    d, path, hf = model_files("llama", mix)
    f = read_gguf(path)
    fmts = {n: qt.format for n, qt in f.items() if hasattr(qt, "format")}
    assert fmts["output.weight"] == "q6_k" and fmts["token_embd.weight"] == base
    assert [fmts[f"blk.{i}.attn_v.weight"] for i in range(2)] == [base, "q6_k"]  # more_bits(1, 2)
    assert [fmts[f"blk.{i}.ffn_down.weight"] for i in range(2)] == [base, "q6_k"]
    assert fmts["blk.1.attn_q.weight"] == fmts["blk.1.ffn_gate.weight"] == base
    llm = LLM(path, progress=False, max_num_batched_tokens=64, backend="triton")
    assert [[m.format for m in L.qkv] for L in llm.model.layers] == [[base], [base, "q6_k"]]
    assert llm.model.layers[1].qkv[0].shape[0] == (llm.cfg.n_heads + llm.cfg.n_kv_heads) * llm.cfg.head_dim
    check_logits(llm, d, path, hf, llm.tokenizer.encode(PROMPTS[1]))
    i8 = LLM(path, progress=False, max_num_batched_tokens=64, act_int8=True)
    same = hf_logits(hf_model_from_state_dict(d, gguf_to_hf_state_dict(path)), [17])
    a = i8.logits([17]).cpu()
    assert 0 < rel_err(a, llm.logits([17]).cpu()) and rel_err(a, same) < 2 * ACT_TOL[i8.dtype]


@pytest.mark.parametrize("arch,fmt", [("llama", "f32"), ("qwen2", "f16"), ("phi3", "f16"), ("gemma2", "f32"),
                                      ("gemma3", "f16")])
def test_greedy_tokens_identical(model_files, arch, fmt):
    """The kernels' greedy tokens are transformers' (the Gemma prompts outgrow their 8-token sliding window)."""
    d, path, hf = model_files(arch, fmt)
    ref = hf if fmt == "f32" else hf_model_from_state_dict(d, gguf_to_hf_state_dict(path))
    # fp16 activations on both machines (the GPU default, bf16, leaves ~8x the logit error: 0.10 against a top-2
    # margin of 0.21 on an H100, too close to owe identical tokens)
    llm = LLM(path, progress=False, dtype=torch.float16, backend="triton")
    ids = llm.tokenizer.encode(LONG_PROMPT if arch.startswith("gemma") else PROMPTS[0])
    want = hf_greedy(ref, ids, 6)
    # identical tokens are owed only where the reference's top-2 margin exceeds twice our logit error there
    lg = hf_logits(ref, ids + want[:-1])[len(ids) - 1:]
    err = (llm.logits(ids + want[:-1])[len(ids) - 1:].double().cpu() - lg).abs().max()
    top2 = lg.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 2 * err, "near-tie in the reference: pick another prompt or seed"
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert out.token_ids == want
    assert out.finish_reason == "length" and out.text == llm.tokenizer.decode(want)


def test_batching_chunking_and_preemption_do_not_change_outputs(model_files):
    _, path, _ = model_files("llama", "f32")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    solo = LLM(path, progress=False)
    alone = [solo.generate([p], params)[0].token_ids for p in PROMPTS]
    # a 7-token budget splits the longer prompts into chunks that share steps with other sequences' decodes
    llm = LLM(path, progress=False, max_num_batched_tokens=7, page_size=4)
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == alone
    assert llm.stats.steps > len(alone[0]) + 2
    # exactly the pages the three prompts fill: all start together, and the first decode step that crosses a page
    # boundary has no page left, so a sequence is preempted, recomputed later, and must still give the same tokens
    lens = [len(solo.tokenizer.encode(p)) for p in PROMPTS]
    assert all(n % 4 for n in lens)
    pages = sum(-(-n // 4) for n in lens)
    small = LLM(path, progress=False, num_pages=pages, page_size=4)
    outs = small.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == alone
    assert small.stats.preemptions > 0 and sum(o.num_preemptions for o in outs) == small.stats.preemptions
    assert small.allocator.num_free == pages


def test_torch_backend_is_batch_invariant(model_files):
    """The pure-torch path gives a sequence the same log-probabilities, bit for bit, alone and among others with
    its prompt chunked differently, so greedy near-ties cannot flip between a request served alone and under load."""
    _, path, _ = model_files("llama", "q8_0")
    prompts = [f"{PROMPTS[0]} {i} " + "ab" * (i % 5) for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    solo = LLM(path, progress=False, backend="torch", dtype=torch.float16, page_size=4)
    alone = [solo.generate([p], params)[0].outputs[0] for p in prompts]
    llm = LLM(path, progress=False, backend="torch", dtype=torch.float16, page_size=4, max_num_batched_tokens=16,
              max_num_seqs=5)
    together = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert [o.logprobs for o in together] == [o.logprobs for o in alone]


def test_sampling_seeds_and_filters(model_files):
    _, path, _ = model_files("llama", "f32")
    llm = LLM(path, progress=False)
    p = PROMPTS[0]
    a = llm.generate([p, p], [SamplingParams(temperature=1.0, seed=7, max_tokens=4, ignore_eos=True),
                              SamplingParams(temperature=1.0, seed=7, max_tokens=4, ignore_eos=True)])
    assert a[0].token_ids == a[1].token_ids  # each request draws from its own generator
    again = llm.generate([p, p], [SamplingParams(temperature=1.0, seed=7, max_tokens=4, ignore_eos=True),
                                  SamplingParams(temperature=1.0, seed=8, max_tokens=4, ignore_eos=True)])
    assert again[0].token_ids == a[0].token_ids  # the same batch replays exactly; the other request's seed is moot
    greedy = llm.generate([p], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].token_ids
    topk1 = llm.generate([p], SamplingParams(temperature=2.0, top_k=1, max_tokens=4, ignore_eos=True))[0]
    assert topk1.token_ids == greedy


def test_sampler_distribution():
    from llmkernels.engine.sampler import make_generator, sample

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    for params, allowed, probs in [
            (SamplingParams(temperature=1.0, seed=1), {0, 1, 2, 3}, [0.5, 0.3, 0.15, 0.05]),
            (SamplingParams(temperature=1.0, top_k=2, seed=2), {0, 1}, [0.625, 0.375]),
            (SamplingParams(temperature=1.0, top_p=0.7, seed=3), {0, 1}, [0.625, 0.375])]:
        g = make_generator(params, "cpu")
        toks = torch.tensor(sample(logits, [params] * 4000, [g] * 4000))
        assert set(toks.tolist()) <= allowed
        freq = torch.bincount(toks, minlength=4)[:len(probs)].double() / 4000
        assert (freq - torch.tensor(probs, dtype=torch.float64)).abs().max() < 0.03, freq


def test_stop_on_eos_and_stream(model_files):
    _, path, _ = model_files("llama", "f32")
    llm = LLM(path, progress=False)
    ids = llm.tokenizer.encode(PROMPTS[0])
    first = llm.generate([ids], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].token_ids
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first[1]]))[0]
    assert out.token_ids == first[:2] and out.finish_reason == "stop"
    pieces = list(llm.stream(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)))
    assert "".join(pieces) == llm.tokenizer.decode(first)


def test_bad_requests(model_files):
    _, path, _ = model_files("llama", "f32")
    llm = LLM(path, progress=False, max_model_len=64)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * 64])
    with pytest.raises(ValueError, match="token ids must be in"):
        llm.generate([[5, 100000]])
    with pytest.raises(TypeError, match="prompt must be"):
        llm.generate([3.5])
    assert not llm.scheduler.has_work()


def test_unsupported_architecture_and_missing_tensor(model_files, tmp_path):
    from llmkernels import read_gguf, write_gguf
    from llmkernels.engine import ModelConfigError

    _, path, _ = model_files("llama", "f32")
    f = read_gguf(path)
    meta = dict(f.metadata)
    meta["general.architecture"] = "gpt2"
    write_gguf(tmp_path / "gpt2.gguf", dict(f), meta)
    with pytest.raises(ModelConfigError, match="unsupported architecture 'gpt2'"):
        LLM(str(tmp_path / "gpt2.gguf"), progress=False)
    tensors = {k: v for k, v in f.items() if k != "blk.1.ffn_up.weight"}
    write_gguf(tmp_path / "missing.gguf", tensors, f.metadata)
    with pytest.raises(ModelConfigError, match="blk.1.ffn_up.weight"):
        LLM(str(tmp_path / "missing.gguf"), progress=False)


def test_cli_generate(model_files, capsys):
    from llmkernels.__main__ import main

    _, path, _ = model_files("llama", "f32")
    llm = LLM(path, progress=False)
    want = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].text
    assert main(["generate", path, "--prompt", PROMPTS[0], "--max-tokens", "3", "--ignore-eos"]) == 0
    assert capsys.readouterr().out == PROMPTS[0] + want + "\n"


def test_cli_generate_act_int8(model_files, capsys, monkeypatch):
    """--act-int8 reaches the engine (the LLM the CLI builds is recorded) and generates what LLM(act_int8=True) does."""
    import llmkernels.engine
    from llmkernels.__main__ import main

    made = []

    class Recording(LLM):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    _, path, _ = model_files("llama", "q4_k")
    llm = LLM(path, progress=False, act_int8=True)
    want = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].text
    monkeypatch.setattr(llmkernels.engine, "LLM", Recording)
    assert main(["generate", path, "--prompt", PROMPTS[0], "--max-tokens", "3", "--ignore-eos", "--act-int8"]) == 0
    assert capsys.readouterr().out == PROMPTS[0] + want + "\n"
    assert len(made) == 1 and made[0].runner.act_int8


@pytest.mark.gpu
@pytest.mark.parametrize("arch,fmt", [("llama", "f16"), ("qwen2", "q8_0"), ("qwen3", "q4_k"), ("mistral", "f32")])
def test_gpu_larger_models(model_files, arch, fmt):
    kw = dict(layers=4, hidden=1024, ffn=2816 if fmt != "q4_k" else 2816 - 256, heads=8, kv_heads=2, head_dim=128,
              vocab=1024)
    d, path, hf = model_files(arch, fmt, **kw)
    prompts = [PROMPTS[1] * 20, PROMPTS[0], PROMPTS[2] * 3]
    eager = LLM(path, progress=False, cuda_graphs=False, max_num_batched_tokens=128)
    check_logits(eager, d, path, hf, eager.tokenizer.encode(prompts[0]))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # the same batch eagerly and through CUDA graphs (padded to 4): the same kernels per row, so the same tokens
    eager = LLM(path, progress=False, cuda_graphs=False, max_num_batched_tokens=64, num_splits=2)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    graphs = LLM(path, progress=False, max_num_batched_tokens=64, num_splits=2)
    got = graphs.generate(prompts, params)
    assert [o.token_ids for o in got] == want
    assert graphs.stats.graph_steps > 0 and eager.stats.graph_steps == 0


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["f16", "q4_k"])
def test_gpu_extend_graphs(model_files, fmt):
    """One sequence's prompt chunks replay graphs padded to 32, 64, ... tokens: cold prompts of awkward lengths and
    the rest of prompts whose prefix is cached give eager's greedy tokens and first-token log-probabilities, within
    what another GEMM route gives (a 12-token chunk is a GEMV eagerly and a 32-row GEMM in its graph: 0.066 apart
    on the H200; a wrong cache or position gives other tokens)."""
    kw = dict(layers=4, hidden=1024, ffn=2816 if fmt != "q4_k" else 2560, heads=8, kv_heads=2, head_dim=128,
              vocab=1024)
    _, path, _ = model_files("llama", fmt, **kw)
    g = torch.Generator().manual_seed(3)
    base = torch.randint(0, 1024, (300,), generator=g).tolist()
    # the last prompt: three chunks launched back to back (no result read between them), so the host refills the
    # first chunk's input buffers while the GPU may not have read them yet
    long = torch.randint(0, 1024, (700,), generator=g).tolist()
    prompts = [base[:1], base[:37], base[:200], base, base + base[:13], base[:290] + base[100:160], long]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    runs = {}
    for graphs in (False, True):
        llm = LLM(path, progress=False, cuda_graphs=graphs, max_num_batched_tokens=256, num_splits=2, page_size=16)
        runs[graphs] = [llm.generate([p], params)[0].outputs[0] for p in prompts]
        if graphs:
            assert len(llm.runner.extend_graphs) >= 3
            assert llm.stats.cached_tokens >= 288 + 288  # the last two prompts extend cached prefixes
    for e, c in zip(runs[False], runs[True]):
        # greedy tokens agree up to a step where eager's top two were within the routes' difference (a near tie
        # that the other GEMM's rounding may break the other way; the tokens after it are free)
        gaps = [top[0][1] - top[1][1] for _, top in e.logprobs]
        j = next((i for i, (a, b) in enumerate(zip(e.token_ids, c.token_ids)) if a != b), None)
        assert len(c.token_ids) == len(e.token_ids) and (j is None or gaps[j] < 0.15), (e.token_ids, c.token_ids,
                                                                                         gaps)
        assert abs(c.logprobs[0][0] - e.logprobs[0][0]) < 0.15
        want = dict(e.logprobs[0][1])
        assert all(abs(lp - want[t]) < 0.15 for t, lp in c.logprobs[0][1] if t in want)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "q4_k_m", "q5_k_m"])
def test_gpu_act_int8_graphs(model_files, fmt):
    """act_int8 on a q8_0, q4_k, q4_k_m or q5_k_m model (decode steps take the int8 kernels; q4_k's FFN width 2560
    is 10 blocks, a ragged last step; the mixes at widths 2048 and 4096, so their q6_k matrices take the q6_k int8
    kernel, with the RMSNorm's rounding shared by the q4_k / q5_k and q6_k projections): the same tokens eagerly
    and through CUDA graphs, one-token logits near transformers'."""
    kw = dict(layers=4, hidden=1024, ffn=2560, heads=8, kv_heads=2, head_dim=128, vocab=1024)
    mix = fmt in ("q4_k_m", "q5_k_m")
    if mix:
        kw.update(hidden=2048, ffn=4096, heads=16, kv_heads=4)
    d, path, hf = model_files("llama", fmt, **kw)
    eager = LLM(path, progress=False, cuda_graphs=False, max_num_batched_tokens=64, num_splits=2, act_int8=True)
    same = hf_logits(hf_model_from_state_dict(d, gguf_to_hf_state_dict(path)), [17])
    assert rel_err(eager.logits([17]).cpu(), same) < 2 * ACT_TOL[eager.dtype]
    if mix:  # layers 2 and 3 hold q6_k (more_bits): all projections round in the RMSNorm
        assert [len(L.qkv) for L in eager.model.layers] == [1, 1, 2, 2]
        assert all(eager.model._i8(1, *L.qkv) and eager.model._i8(1, *L.gate_up) for L in eager.model.layers)
        a = eager.logits([17]).cpu()
        os.environ["LLMK_I8NORM"] = "0"
        try:  # the rounding in gemv's own launches: the same numbers
            assert torch.equal(eager.logits([17]).cpu(), a)
        finally:
            del os.environ["LLMK_I8NORM"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    graphs = LLM(path, progress=False, max_num_batched_tokens=64, num_splits=2, act_int8=True)
    for prompt in (PROMPTS[1] * 20, PROMPTS[0]):
        want = eager.generate([prompt], params)[0].token_ids
        assert graphs.generate([prompt], params)[0].token_ids == want
    assert graphs.stats.graph_steps > 0


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_gpu_long_context_graphs(model_files, kv, monkeypatch):
    """Decode steps of a batch with 3-5k-token contexts on the persistent Gluon decode kernel (two consumers on an
    fp8 cache) replayed from CUDA graphs planned at capture for max_model_len give the eager steps' greedy tokens
    (planned per step from the real lengths; the same fixed split count)."""
    from llmkernels.attention import plan as plan_mod

    monkeypatch.setattr(plan_mod, "WS_DECODE_MIN_BYTES", 0)  # every decode call on the Gluon kernel, eager too
    kw = dict(layers=2, hidden=1024, ffn=2816, heads=8, kv_heads=2, head_dim=128, vocab=1024)
    _, path, _ = model_files("llama", "f16", **kw)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in (3000, 5200, 4097, 3333, 4800, 3999)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = {}
    for graphs in (False, True):
        llm = LLM(path, progress=False, cuda_graphs=graphs, max_model_len=8192, max_num_seqs=8, num_splits=2,
                  kv_cache_dtype=kv)
        runs[graphs] = [o.token_ids for o in llm.generate(prompts, params)]
        assert (llm.stats.graph_steps > 0) == graphs
    assert runs[True] == runs[False]


@pytest.mark.gpu
def test_gpu_fp8_kv_cache(model_files):
    """An fp8 e4m3 cache (scale 1) against transformers on the same weights: within 3x the bf16 cache's tolerance."""
    kw = dict(layers=4, hidden=1024, ffn=2816, heads=8, kv_heads=2, head_dim=128, vocab=1024)
    d, path, hf = model_files("llama", "f16", **kw)
    llm = LLM(path, progress=False, kv_cache_dtype=torch.float8_e4m3fn, max_num_batched_tokens=128)
    assert llm.kv_cache.dtype == torch.float8_e4m3fn
    ids = llm.tokenizer.encode(PROMPTS[1] * 20)
    same = hf_logits(hf_model_from_state_dict(d, gguf_to_hf_state_dict(path)), ids)
    err = rel_err(llm.logits(ids).cpu(), same)
    print(f"fp8 kv cache: max logit error {err:.4f} of max |logit|")
    assert err < 3 * ACT_TOL[torch.bfloat16]
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8


def test_look_ahead_keeps_outputs(model_files, monkeypatch):
    """Decode steps launched before the previous step's tokens are read give the same tokens as without: a batch
    whose sequences stop at different steps (length limits, a stop token while the next step is in flight, a
    seeded sampled request), a request added while a step is in flight; no page is lost."""
    _, path, _ = model_files("llama", "f32")
    ids = LLM(path, progress=False).tokenizer.encode(PROMPTS[0])

    def run(look_ahead):
        monkeypatch.setenv("LLMK_LOOKAHEAD", "1" if look_ahead else "0")
        llm = LLM(path, progress=False, page_size=4)
        first = llm.generate([ids], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].token_ids
        params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                  SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first[2]]),
                  SamplingParams(temperature=0.8, seed=3, max_tokens=7, ignore_eos=True),
                  SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)]
        outs = [o.token_ids for o in llm.generate([ids, ids, PROMPTS[1], PROMPTS[2]], params)]
        # a request joins while a decode step is in flight
        a = llm.add_request(ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        for _ in range(3):
            llm.step()
        b = llm.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        while llm.scheduler.has_work():
            llm.step()
        assert llm.allocator.num_free == llm.num_pages
        return first, outs, a.out_ids, b.out_ids, llm.stats.ahead_steps

    base, ahead = run(False), run(True)
    assert base[:4] == ahead[:4]
    assert base[1][1] == base[0][:3]  # the stop token ended the second request
    assert base[4] == 0 and ahead[4] > 5


def test_unsupported_head_dim_fails_at_load(model_files):
    """A head dim the attention kernels do not take raises ModelConfigError when the model loads, naming it."""
    from llmkernels.engine import ModelConfigError

    _, path, _ = model_files("llama", "f32", hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128)
    with pytest.raises(ModelConfigError, match="head dim 16"):
        LLM(path, progress=False)


def test_from_model_checks_kernel_limits():
    """A Model built by hand (LLM.from_model, as the benchmarks do) gets the same check, before any step."""
    from llmkernels.bench.suites.engine import synthetic_tensors
    from llmkernels.engine import Model, ModelConfig, ModelConfigError

    cfg = ModelConfig(arch="llama", n_layers=1, hidden=64, ffn=128, n_heads=2, n_kv_heads=1, head_dim=32,
                      vocab_size=50, rms_eps=1e-5, rope_theta=10000.0, rope_style="interleaved", context_length=128,
                      eos_ids=())
    model = Model(cfg, synthetic_tensors("f16", cfg, device="cpu"), "cpu", torch.float16)
    with pytest.raises(ModelConfigError, match="head dim 32"):
        LLM.from_model(model)


def test_convert_reports_fallbacks(tmp_path, capsys):
    """q4_k on matrices whose row length is not a multiple of 256: the fallback to q8_0 is printed per tensor."""
    from llmkernels import read_gguf
    from llmkernels.engine import convert_hf_to_gguf
    from llmkernels.testing.tiny_models import make_checkpoint

    make_checkpoint(str(tmp_path), "llama", hidden=128, ffn=320, heads=2, kv_heads=1, head_dim=64, vocab=384)
    out = convert_hf_to_gguf(str(tmp_path), str(tmp_path / "m.gguf"), "q4_k", progress=False)
    err = capsys.readouterr().err
    assert "fell back" in err and "blk.0.ffn_down.weight [128, 320]: q4_k -> q8_0" in err
    assert "blk.0.attn_q.weight" in err  # K = 128 too
    assert read_gguf(out)["blk.0.ffn_down.weight"].format == "q8_0"
    out = convert_hf_to_gguf(str(tmp_path), str(tmp_path / "m2.gguf"), "iq4_xs", progress=False)
    assert "blk.0.ffn_down.weight [128, 320]: iq4_xs -> iq4_nl" in capsys.readouterr().err
    assert read_gguf(out)["blk.0.ffn_down.weight"].format == "iq4_nl"


def test_backend_choice(model_files):
    """backend="auto" takes the pure-torch forward on the CPU (the kernels with act_int8); bad values are refused."""
    _, path, _ = model_files("llama", "q8_0")
    if not torch.cuda.is_available():
        assert LLM(path, progress=False).backend == "torch"
        assert LLM(path, progress=False, act_int8=True).backend == "triton"
    with pytest.raises(ValueError, match="backend must be 'auto', 'triton' or 'torch', got 'cuda'"):
        LLM(path, progress=False, backend="cuda")
    with pytest.raises(ValueError, match="act_int8=True needs backend='triton'"):
        LLM(path, progress=False, backend="torch", act_int8=True)


def test_torch_backend_generates_as_the_kernels_do(model_files):
    """Greedy tokens of the pure-torch forward equal the kernel path's (fp16, where both are near the reference)."""
    _, path, _ = model_files("llama", "f32")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = LLM(path, progress=False).tokenizer.encode(PROMPTS[1])
    outs = [LLM(path, progress=False, dtype=torch.float16, backend=b).generate([ids], params)[0].token_ids
            for b in ("torch", "triton")]
    assert outs[0] == outs[1]


def test_stop_strings_cut_the_text_and_the_stream(model_files):
    """A stop string ends generation at its first occurrence, which is not in the text, also when it spans tokens;
    the streamed pieces join to the same text (held back while they may begin a stop string)."""
    _, path, _ = model_files("llama", "q8_0")
    llm = LLM(path, progress=False, backend="torch")
    greedy = dict(temperature=0, max_tokens=24, ignore_eos=True)
    ids = llm.tokenizer.encode(PROMPTS[0])
    free = llm.generate([ids], SamplingParams(**greedy))[0]
    toks = [llm.tokenizer.decode(free.token_ids[:i]) for i in range(len(free.token_ids) + 1)]
    # a stop string spanning the 4th and 5th tokens' text
    start, end = len(toks[3]) - 1, len(toks[5])
    assert 0 <= start < end
    stop = free.text[start:end]
    out = llm.generate([ids], SamplingParams(stop=[stop, "\x00never"], **greedy))[0]
    cut = free.text.find(stop)
    assert out.text == free.text[:cut] and out.finish_reason == "stop"
    assert out.outputs[0].text == out.text and out.outputs[0].token_ids == out.token_ids
    assert out.token_ids == free.token_ids[:len(out.token_ids)] and len(out.token_ids) < len(free.token_ids)
    pieces = list(llm.stream(ids, SamplingParams(stop=stop, **greedy)))
    assert "".join(pieces) == out.text
    assert all(stop not in p for p in pieces)
    for bad in ([""], [3], 5):
        with pytest.raises(TypeError, match="stop must be"):
            SamplingParams(stop=bad)


def test_design_keyword_arguments(model_files):
    _, path, _ = model_files("llama", "q8_0")
    llm = LLM(path, progress=False, backend="torch", kv_cache_dtype="auto", tensor_parallel_size=1)
    assert llm.kv_dtype == llm.dtype
    assert LLM(path, progress=False, backend="torch", kv_cache_dtype="fp8_e4m3").kv_dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8_e4m3, fp8_e5m2"):
        LLM(path, progress=False, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        LLM(path, progress=False, tensor_parallel_size=0)


def test_prefix_cache_and_preemption_keep_greedy_outputs(model_files):
    """Prompts sharing prefixes, served with the prefix cache (hits counted) and with memory short enough to preempt
    and evict, give the tokens they give without the cache."""
    _, path, _ = model_files("llama", "f32")
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    tok = LLM(path, progress=False).tokenizer
    base = tok.encode(PROMPTS[1])
    prompts = [base, base + tok.encode(" again"), base[:5] + tok.encode(PROMPTS[0]), tok.encode(PROMPTS[2])]
    plain = LLM(path, progress=False, page_size=4, enable_prefix_caching=False)
    want = [plain.generate([p], params)[0].token_ids for p in prompts]
    cached = LLM(path, progress=False, page_size=4)
    outs = [cached.generate([p], params)[0] for p in prompts]
    assert [o.token_ids for o in outs] == want
    assert outs[0].num_cached_tokens == 0 and outs[1].num_cached_tokens == len(base) // 4 * 4
    assert outs[2].num_cached_tokens == 4 and cached.stats.cached_tokens == sum(o.num_cached_tokens for o in outs)
    # all at once in a cache too small for them: preemption, eviction and hits mixed
    small = LLM(path, progress=False, page_size=4, num_pages=max(-(-(len(p) + 5) // 4) for p in prompts))
    outs = small.generate(prompts, params)
    assert [o.token_ids for o in outs] == want and small.stats.preemptions > 0
    assert small.pool.num_used == 0 and small.pool.num_free == small.num_pages


def test_n_completions_share_the_prompt(model_files):
    """n greedy completions are one output n times (and, on the CPU, the n = 1 output: on a GPU the kernels take
    other paths at other batch sizes); the prompt is computed once, its pages shared."""
    _, path, _ = model_files("llama", "f32")
    llm = LLM(path, progress=False, page_size=4)
    ids = llm.tokenizer.encode(PROMPTS[1])
    one = llm.generate([ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    before = llm.stats.prefill_tokens
    llm.pool.reset_cache()
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=3))[0]
    assert [o.token_ids for o in out.outputs] == [out.outputs[0].token_ids] * 3
    assert [o.index for o in out.outputs] == [0, 1, 2] and out.outputs[0].token_ids[0] == one.token_ids[0]
    if not torch.cuda.is_available():
        assert out.outputs[0].token_ids == one.token_ids and out.text == one.text
    assert llm.stats.prefill_tokens - before == len(ids)
    assert llm.pool.num_used == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="exact replay across batch shapes holds on the CPU path")
def test_n_seeded_completions_are_seed_plus_index(model_files):
    _, path, _ = model_files("llama", "f32")
    llm = LLM(path, progress=False)
    kw = dict(temperature=1.0, max_tokens=6, ignore_eos=True)
    out = llm.generate([PROMPTS[0]], SamplingParams(n=3, seed=5, **kw))[0]
    each = llm.generate([PROMPTS[0]] * 3, [SamplingParams(seed=5 + i, **kw) for i in range(3)])
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in each]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_logprobs_and_abort(model_files):
    _, path, _ = model_files("llama", "f32")
    llm = LLM(path, progress=False)
    ids = llm.tokenizer.encode(PROMPTS[0])
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3))[0]
    lps = out.outputs[0].logprobs
    ref = torch.log_softmax(llm.logits(ids + out.token_ids).double(), -1)
    tol = 2e-2 if llm.dtype == torch.float16 else 8e-2  # the decode steps' logits against a prefill's
    for i, (t, (lp, top)) in enumerate(zip(out.token_ids, lps)):
        assert abs(lp - ref[len(ids) - 1 + i, t].item()) < tol
        assert len(top) == 3 and top[0][0] == t and [v for _, v in top] == sorted([v for _, v in top], reverse=True)
    seq = llm.add_request(ids, SamplingParams(max_tokens=50, ignore_eos=True, n=2))
    llm.step()
    llm.abort(seq)
    assert [s.finish_reason for s in seq.group] == ["abort", "abort"] and not llm.scheduler.has_work()
    assert llm.pool.num_used == 0


def test_chat(model_files):
    from llmkernels.engine.chat import ChatTemplateError

    d, path, _ = model_files("llama", "f32")
    llm = LLM(path, progress=False)
    msgs = [{"role": "user", "content": "Hello"}]
    ids = llm.chat_prompt(msgs)
    assert llm.tokenizer.decode(ids, skip_special_tokens=False) == "<|bos|><|user|>\nHello<|eos|><|assistant|>\n"
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert out.token_ids == llm.generate([ids], SamplingParams(temperature=0, max_tokens=3,
                                                               ignore_eos=True))[0].token_ids
    assert len(llm.chat([msgs, msgs], SamplingParams(max_tokens=2))) == 2
    for bad, msg in [([], "non-empty list"), ([{"content": "x"}], "'role'"), ([{"role": "king", "content": "x"}],
                     "role must be one of"), ([{"role": "user", "content": [{"type": "image_url"}]}],
                     "only text parts")]:
        with pytest.raises(ChatTemplateError, match=msg):
            llm.chat_prompt(bad)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        LLM(path, progress=False, chat_template="{% for %}").chat_prompt(msgs)
    refusing = "{{ raise_exception('only user turns') }}"
    with pytest.raises(ChatTemplateError, match="only user turns"):
        LLM(path, progress=False, chat_template=refusing).chat_prompt(msgs)
    # template variables (apply_chat_template's kwargs); they cannot replace the messages
    effort = LLM(path, progress=False, chat_template="{{ reasoning_effort | default('medium') }}|{{ messages[0].role }}")
    assert effort.tokenizer.decode(effort.chat_prompt(msgs, True, {"reasoning_effort": "high"})) == "high|user"
    assert effort.tokenizer.decode(effort.chat_prompt(msgs)) == "medium|user"
    for bad in ({"messages": []}, {"not an identifier": 1}):
        with pytest.raises(ChatTemplateError, match="variable names"):
            effort.chat_prompt(msgs, True, bad)


def test_fp8_kv_cache_error(model_files):
    """fp8 e4m3 caches with static scales 1.0 (saturating, as vLLM's default): the logits against the same engine
    with a cache in the activation dtype stay within 10% of max |logit| (e4m3 keeps 3 mantissa bits: a relative step
    of 6.25%), and a page takes half the bytes, so the same memory holds twice the pages."""
    from llmkernels.engine.runner import kv_bytes_per_page

    _, path, _ = model_files("qwen3", "q8_0")
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    for dtype in (torch.float16, torch.bfloat16):
        ref = LLM(path, progress=False, backend="torch", dtype=dtype)
        f8 = LLM(path, progress=False, backend="torch", dtype=dtype, kv_cache_dtype="fp8_e4m3")
        a, b = ref.logits(prompt), f8.logits(prompt)
        err = ((a - b).abs().max() / a.abs().max()).item()
        print(f"fp8 e4m3 cache, {dtype}: max logit error {err:.4f} of max |logit|")
        assert err < 0.1
        assert 2 * kv_bytes_per_page(f8.cfg, 16, f8.kv_dtype) == kv_bytes_per_page(ref.cfg, 16, ref.kv_dtype)


def test_unsupported_features_fail_at_load(model_files, tmp_path):
    """A file that says it has experts but lacks their tensors, and LongRoPE Phi-3 files, raise ModelConfigError
    naming what is missing or unsupported."""
    from llmkernels import read_gguf, write_gguf
    from llmkernels.engine import ModelConfigError

    _, path, _ = model_files("llama", "f32")
    f = read_gguf(path)
    tensors = {k: f[k] for k in f.keys()}
    meta = dict(f.metadata)
    write_gguf(tmp_path / "moe.gguf", tensors, {**meta, "llama.expert_count": 8})
    with pytest.raises(ModelConfigError, match="lacks 'llama.expert_used_count'"):
        LLM(str(tmp_path / "moe.gguf"), progress=False)
    write_gguf(tmp_path / "moe2.gguf", tensors, {**meta, "llama.expert_count": 8, "llama.expert_used_count": 2})
    with pytest.raises(ModelConfigError, match="lacks tensor\\(s\\) blk.0.ffn_gate_inp.weight"):
        LLM(str(tmp_path / "moe2.gguf"), progress=False)
    write_gguf(tmp_path / "long.gguf", {**tensors, "rope_factors_long.weight": torch.ones(32)}, meta)
    with pytest.raises(ModelConfigError, match="LongRoPE"):
        LLM(str(tmp_path / "long.gguf"), progress=False)


@pytest.mark.gpu
@pytest.mark.parametrize("act_int8", [False, True])
def test_gpu_padded_output_matrix(monkeypatch, act_int8):
    """A Gemma-2-9B-shaped model (one layer, the real 256000 x 3584 q6_k tied output, a 2048 x 3584 q6_k V): the
    engine pads the output matrix and V for the tensor-core kernel, and its logits match the same model left
    unpadded, exact and with act_int8."""
    import dataclasses

    import llmkernels.engine.model as model_mod
    from llmkernels.bench.suites.families import FAMILIES, family_tensors
    from llmkernels.engine.config import ModelConfig

    spec = dict(FAMILIES["gemma2-9b"], layers=1)
    tensors = family_tensors(spec, device="cuda")
    meta = {f"gemma2.{k}": v for k, v in spec["meta"].items()}
    meta.update({"general.architecture": "gemma2", "gemma2.block_count": 1, "gemma2.embedding_length": 3584,
                 "gemma2.feed_forward_length": 14336, "gemma2.attention.head_count": 16,
                 "gemma2.attention.head_count_kv": 8, "gemma2.attention.key_length": 256,
                 "gemma2.attention.value_length": 256, "gemma2.vocab_size": 256000})
    # random weights saturate the final soft cap (every logit near +-30): compare the logits before it
    cfg = dataclasses.replace(ModelConfig.from_gguf(meta, tensors.keys()), final_softcap=0.0)

    def engine():
        m = model_mod.Model(cfg, tensors, "cuda", torch.bfloat16)
        return m, LLM.from_model(m, max_num_seqs=1, max_model_len=128, act_int8=act_int8)

    padded, llm = engine()
    monkeypatch.setattr(model_mod, "tc_padding", lambda qt, dtype: None)
    plain, ref = engine()
    assert padded.output_pad == 512 and padded.tok_embd is padded.output and plain.output_pad == 0
    assert list(padded.padded.values()) == [3584] and padded.layers[0].qkv[1].shape == (2048, 4096)
    assert not plain.padded
    for ids in ([5], list(range(1, 40))):  # one row (the batch-1 route the padding is for) and a prompt
        a, b = llm.logits(ids).float(), ref.logits(ids).float()
        assert ((a - b).abs().max() / b.abs().max()).item() < 2e-2
