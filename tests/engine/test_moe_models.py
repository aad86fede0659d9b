"""Mixture-of-experts models (Qwen3-MoE, Mixtral) converted from tiny random transformers checkpoints: logits and
greedy tokens against transformers, on the kernels (the interpreter on the CPU) and the pure-torch forward."""
import pytest
import torch

from llmkernels.engine import LLM, ModelConfigError, SamplingParams, gguf_to_hf_state_dict
from llmkernels.engine.config import ModelConfig
from llmkernels.testing.tiny_models import hf_model_from_state_dict

from .test_engine import ACT_TOL, LONG_PROMPT, PROMPTS, hf_logits, rel_err

# 5 experts of width 128 (so q4_k's down projection, K = 128, falls back to q8_0), 2 per token
MOE = dict(layers=2, hidden=256, ffn=128, heads=4, kv_heads=2, head_dim=64)
CASES = [("qwen3moe", "f32", "torch"), ("qwen3moe", "q8_0", "triton"), ("mixtral", "f16", "torch"),
         ("mixtral", "q4_k", "triton")]


@pytest.mark.parametrize("arch,fmt,backend", CASES, ids=["-".join(c) for c in CASES])
def test_moe_matches_transformers(model_files, arch, fmt, backend):
    d, path, hf = model_files(arch, fmt, **MOE)
    llm = LLM(path, progress=False, backend=backend, max_num_batched_tokens=64)
    assert llm.cfg.n_experts == 5 and llm.cfg.n_experts_used == 2 and llm.cfg.expert_ffn == 128
    ids = llm.tokenizer.encode(PROMPTS[1])
    same = hf_model_from_state_dict(d, gguf_to_hf_state_dict(path))
    assert rel_err(llm.logits(ids).cpu(), hf_logits(same, ids)) < ACT_TOL[llm.dtype]
    with torch.no_grad():
        want = same.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False)[0, len(ids):].tolist()
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    assert llm.generate([ids], params)[0].token_ids == want
    # batched with other prompts and chunked: the same tokens
    outs = llm.generate([PROMPTS[0], ids, PROMPTS[2]], params)
    assert outs[1].token_ids == want


def test_moe_config_errors(model_files):
    _, path, _ = model_files("qwen3moe", "f32", **MOE)
    from llmkernels.quant.gguf_io import read_gguf

    f = read_gguf(path)
    meta = dict(f.metadata)
    meta["qwen3moe.expert_used_count"] = 6
    with pytest.raises(ModelConfigError, match="expert_used_count is 6, expected 1..5"):
        ModelConfig.from_gguf(meta, f.keys())
    with pytest.raises(ModelConfigError, match="shared experts"):
        ModelConfig.from_gguf(dict(f.metadata), list(f.keys()) + ["blk.0.ffn_up_shexp.weight"])
    meta = {k: v for k, v in f.metadata.items() if k != "qwen3moe.expert_count"}
    with pytest.raises(ModelConfigError, match="lacks 'qwen3moe.expert_count'"):
        ModelConfig.from_gguf(meta, f.keys())
    with pytest.raises(ModelConfigError, match="tensor_parallel_size=2 does not divide the 5 experts"):
        LLM(path, progress=False, backend="torch", tensor_parallel_size=2)


def rows_before_near_tie(hf, ids, top_k: int, margin: float) -> int:
    """How many leading positions of ``ids`` route clearly in every layer of the reference: the first position whose
    k-th and (k+1)-th router logits are within ``margin`` may pick other experts after rounding, and that changes its
    row (and, through attention, the rows after it) by far more than any tolerance."""
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_router_logits=True)
    first = len(ids)
    for logits in out.router_logits:
        top = logits.double().view(len(ids), -1).sort(-1, descending=True).values
        close = ((top[:, top_k - 1] - top[:, top_k]) < margin).nonzero()
        if close.numel():
            first = min(first, int(close[0]))
    return first


@pytest.mark.gpu
@pytest.mark.parametrize("arch,fmt", [("qwen3moe", "q4_k"), ("mixtral", "q8_0")])
def test_gpu_moe_models(model_files, arch, fmt):
    """Compiled kernels, CUDA graphs for decode: logits near transformers' in fp16 up to the first near-tied router
    choice, and in both dtypes the tokens of the eager engine. (A tie within rounding flips either way: the mixtral
    model's reference gaps go down to 0.0014, and on the pure-torch forward 4 of 84 rows then differ by more than
    0.06 in fp16 and 25 in bf16.)"""
    kw = dict(MOE, hidden=512, ffn=256, head_dim=128)
    d, path, _ = model_files(arch, fmt, **kw)
    same = hf_model_from_state_dict(d, gguf_to_hf_state_dict(path))
    for dtype in (torch.float16, torch.bfloat16):
        eager = LLM(path, progress=False, cuda_graphs=False, num_splits=2, max_num_batched_tokens=64, dtype=dtype)
        ids = eager.tokenizer.encode(PROMPTS[1] * 4)
        if dtype == torch.float16:
            clear = rows_before_near_tie(same, ids, eager.cfg.n_experts_used, 0.01)
            assert clear >= 16, f"only {clear} positions route clearly: the check would mean little"
            got, want = eager.logits(ids).cpu(), hf_logits(same, ids)
            assert rel_err(got[:clear], want[:clear]) < ACT_TOL[dtype]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        want = [o.token_ids for o in eager.generate([ids, PROMPTS[0]], params)]
        graphs = LLM(path, progress=False, num_splits=2, max_num_batched_tokens=64, dtype=dtype)
        assert [o.token_ids for o in graphs.generate([ids, PROMPTS[0]], params)] == want
        assert graphs.stats.graph_steps > 0


def test_q6_k_experts_padded_rows(model_files):
    """A qwen3moe file in q6_k whose expert rows are 210 bytes (K = 256): the engine pads the three stacks to 224-byte
    rows at load, and the prompt's logits still match transformers with its pairs grouped on the tensor cores and
    without them (the grouped kernel reads the same padded rows)."""
    from llmkernels.qgemv import route

    d, path, hf = model_files("qwen3moe", "q6_k", **dict(MOE, ffn=256))
    llm = LLM(path, progress=False, backend="triton", max_num_batched_tokens=64)
    assert [m.data.shape[-1] for m in llm.model.layers[0].moe[1:]] == [224, 224, 224]
    ids = llm.tokenizer.encode(PROMPTS[1])
    same = hf_model_from_state_dict(d, gguf_to_hf_state_dict(path))
    want_logits = hf_logits(same, ids)
    with route.override(exclude={"moe_gemv", "moe_grouped"}):
        assert rel_err(llm.logits(ids).cpu(), want_logits) < ACT_TOL[llm.dtype]
    with route.override(exclude={"moe_tc"}):
        assert rel_err(llm.logits(ids).cpu(), want_logits) < ACT_TOL[llm.dtype]


# gpt-oss: 5 experts of width 256, top 2, biases everywhere, a sink logit per head, an 8-token window on layer 0,
# its YaRN (factor 32, ramp ends not rounded)
OSS = dict(layers=2, hidden=256, ffn=256, heads=4, kv_heads=2, head_dim=64)
OSS_CASES = [("f32", "torch"), ("q8_0", "triton"), ("mxfp4", "triton"), ("iq4_xs", "torch")]


@pytest.mark.parametrize("fmt,backend", OSS_CASES, ids=["-".join(c) for c in OSS_CASES])
def test_gpt_oss_matches_transformers(model_files, fmt, backend):
    """Logits against transformers on the same (dequantized) weights, over the prompt's rows before its first
    near-tied router choice (a tie within rounding flips either way and changes that row by far more than any
    tolerance); greedy tokens of the two backends agree."""
    d, path, _ = model_files("gpt_oss", fmt, **OSS)
    llm = LLM(path, progress=False, backend=backend, max_num_batched_tokens=64)
    cfg = llm.cfg
    assert (cfg.n_experts, cfg.n_experts_used, cfg.expert_ffn, cfg.sliding_window) == (5, 2, 256, 8)
    assert cfg.attn_sinks and cfg.o_bias and cfg.moe_bias and cfg.act == "swiglu_oai"
    assert cfg.swa_layers == (True, False) and cfg.rope_scaling == "yarn" and not cfg.yarn_truncate
    from tokenizers import Tokenizer  # the o200k split (tokenizer.ggml.pre "gpt-4o") as the checkpoint's own

    text = "Hello World's HTTPServer don't 12345 ok/// \n\n  x東京 " + PROMPTS[1]
    assert llm.tokenizer.encode(text) == Tokenizer.from_file(f"{d}/tokenizer.json").encode(text).ids
    same = hf_model_from_state_dict(d, gguf_to_hf_state_dict(path))
    # of a few prompts, the one whose rows route clearly the longest (each format's weights tie elsewhere)
    prompts = [PROMPTS[1] + " " + PROMPTS[0], LONG_PROMPT, PROMPTS[0] + " " + PROMPTS[2], PROMPTS[2] + PROMPTS[1]]
    n, ids = max((rows_before_near_tie(same, i, 2, 0.01), i) for i in map(llm.tokenizer.encode, prompts))
    assert n >= 8, n
    assert rel_err(llm.logits(ids).cpu()[:n], hf_logits(same, ids)[:n]) < ACT_TOL[llm.dtype]
    if backend == "triton":
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        ref = LLM(path, progress=False, backend="torch", max_num_batched_tokens=64)
        want = ref.generate([ids[:n]], params)[0].token_ids
        assert llm.generate([PROMPTS[0], ids[:n]], params)[1].token_ids == want


def test_gpt_oss_refusals(model_files):
    """What the engine does not run of gpt-oss yet fails at load, naming it."""
    _, path, _ = model_files("gpt_oss", "f32", **OSS)
    with pytest.raises(ModelConfigError, match="gpt-oss .*one GPU only"):
        LLM(path, progress=False, backend="torch", tensor_parallel_size=2)
    from llmkernels.megakernel.kernel import unsupported

    assert {"attention sinks", "O, router and expert biases"} <= set(unsupported(LLM(path, progress=False,
                                                                                     backend="torch").cfg))


def test_gpt_oss_converter_refuses_mxfp4_blocks(tmp_path):
    """A checkpoint whose experts are stored as MXFP4 blocks (the released gpt-oss weights) is refused naming the
    tensor and what to do, not converted wrongly."""
    import json

    from safetensors.torch import save_file

    from llmkernels.engine import convert_hf_to_gguf
    from llmkernels.testing.tiny_models import make_checkpoint

    make_checkpoint(str(tmp_path), "gpt_oss", **OSS)
    save_file({"model.layers.0.mlp.experts.gate_up_proj_blocks": torch.zeros(5, 512, 8, 16, dtype=torch.uint8)},
              str(tmp_path / "zz-blocks.safetensors"))
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["architectures"] == ["GptOssForCausalLM"]
    with pytest.raises(ModelConfigError, match="MXFP4 blocks.*dequantize"):
        convert_hf_to_gguf(str(tmp_path), str(tmp_path / "m.gguf"), "q8_0", progress=False)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "iq4_xs"])
def test_gpu_gpt_oss(model_files, fmt):
    """Compiled kernels (sinks in the paged kernel, the codebook formats, swiglu_oai), CUDA graphs for decode: logits
    near transformers' in fp16 up to the first near-tied router choice, and in both dtypes the eager engine's
    tokens."""
    d, path, _ = model_files("gpt_oss", fmt, **dict(OSS, hidden=512, ffn=512))
    same = hf_model_from_state_dict(d, gguf_to_hf_state_dict(path))
    for dtype in (torch.float16, torch.bfloat16):
        eager = LLM(path, progress=False, cuda_graphs=False, max_num_batched_tokens=64, dtype=dtype)
        ids = eager.tokenizer.encode(PROMPTS[1] * 4)
        if dtype == torch.float16:
            clear = rows_before_near_tie(same, ids, 2, 0.01)
            assert clear >= 8, f"only {clear} positions route clearly: the check would mean little"
            assert rel_err(eager.logits(ids).cpu()[:clear], hf_logits(same, ids)[:clear]) < ACT_TOL[dtype]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        want = [o.token_ids for o in eager.generate([ids, PROMPTS[0]], params)]
        graphs = LLM(path, progress=False, max_num_batched_tokens=64, dtype=dtype)
        assert [o.token_ids for o in graphs.generate([ids, PROMPTS[0]], params)] == want
        assert graphs.stats.graph_steps > 0
