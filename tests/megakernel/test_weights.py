"""The decode step's weight stacks (megakernel/weights.py): built from a GGUF's tensors, or moved into from a loaded
engine model, which then computes as before and shares their storage."""
import pytest
import torch

from llmkernels.engine import LLM, ModelConfig
from llmkernels.megakernel.weights import share_stacks, stack_tensors
from llmkernels.quant import dequantize, read_gguf


def _expected_rows(cfg, f):
    """{stack: [(first row, GGUF name)]} as the module's table lays them out."""
    out = "output.weight" if "output.weight" in f.keys() else "token_embd.weight"
    nq = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    per = nq + 2 * cfg.ffn
    rows = {"a": [], "o": [], "d": []}
    for li in range(cfg.n_layers):
        r = li * per
        for name in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up"):
            rows["a"].append((r, f"blk.{li}.{name}.weight"))
            r += f[f"blk.{li}.{name}.weight"].shape[0]
        rows["o"].append((li * cfg.hidden, f"blk.{li}.attn_output.weight"))
        rows["d"].append((li * cfg.hidden, f"blk.{li}.ffn_down.weight"))
    rows["a"].append((cfg.n_layers * per, out))
    return rows


@pytest.mark.parametrize("fmt, tie", [("f16", False), ("q4_k", True), ("q8_0", False)])
def test_stack_tensors_hold_the_files_rows(model_files, fmt, tie):
    _, path, _ = model_files("llama", fmt, tie=tie)
    f = read_gguf(path)
    cfg = ModelConfig.from_gguf(f.metadata, f.keys())
    st = stack_tensors(cfg, f)
    assert st.format == fmt
    t = st.table.tolist()
    for li in range(cfg.n_layers):
        assert t[li][1] - t[li][0] == (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
        assert t[li][2] - t[li][1] == cfg.ffn
    for stack, items in _expected_rows(cfg, f).items():
        total = 0
        for r0, name in items:
            m = f[name]
            got = dequantize(st.rows(stack, r0, m.shape[0], m.shape[1]), torch.float32)
            assert torch.equal(got, dequantize(m, torch.float32)), f"{name} at row {r0} of stack {stack!r}"
            total += m.shape[0]
        assert getattr(st, stack).shape[0] == total  # nothing else in the stack


@pytest.mark.parametrize("fmt, tie, backend", [("f16", False, "torch"), ("q4_k", True, "torch"),
                                               ("q8_0", False, "torch"), ("f16", True, "triton")])
def test_share_stacks_keeps_what_the_model_computes(model_files, fmt, tie, backend):
    """The model's logits are the same after its matrices move into the stacks (the torch path's dequantized
    cache and the kernel path's routes rebuilt), and every matrix is then a view of a stack."""
    _, path, _ = model_files("llama", fmt, tie=tie)
    llm = LLM(path, progress=False, dtype=torch.float16, backend=backend)
    prompt = torch.randint(1, llm.model.cfg.vocab_size, (5 if backend == "torch" else 3,)).tolist()
    before = llm.logits(prompt)
    st = share_stacks(llm.model)
    m = llm.model
    storage = {k: getattr(st, k).untyped_storage().data_ptr() for k in "aod"}
    for L in m.layers:
        for mat, k in ((L.qkv[0], "a"), (L.gate_up[0], "a"), (L.wo, "o"), (L.down, "d")):
            assert mat.data.untyped_storage().data_ptr() == storage[k]
    assert m.output.data.untyped_storage().data_ptr() == storage["a"]
    assert (m.tok_embd is m.output) == tie
    after = llm.logits(prompt)
    assert torch.equal(before, after), (before - after).abs().max()


def test_share_stacks_refuses_what_does_not_fit(model_files):
    """A Q4_K_M file (q6_k V and down beside q4_k) and a mixture of experts are refused by name, and the model
    is left as it was."""
    _, path, _ = model_files("llama", "q4_k_m")
    llm = LLM(path, progress=False, dtype=torch.float16)
    ids = [id(x) for L in llm.model.layers for x in (*L.qkv, L.wo, *L.gate_up, L.down)]
    with pytest.raises(ValueError, match="pieces|one format"):
        share_stacks(llm.model)
    assert ids == [id(x) for L in llm.model.layers for x in (*L.qkv, L.wo, *L.gate_up, L.down)]
    _, path, _ = model_files("mixtral", "f16")
    with pytest.raises(ValueError, match="mixture of experts"):
        share_stacks(LLM(path, progress=False, dtype=torch.float16).model)
    f = read_gguf(path)
    with pytest.raises(ValueError, match="mixture of experts"):
        stack_tensors(ModelConfig.from_gguf(f.metadata, f.keys()), f)


def test_stack_tensors_and_share_stacks_name_bad_input(model_files):
    """A missing tensor, a matrix of the wrong shape, one in another format, and something that is not an engine
    model: each a clear error naming what is wrong."""
    from llmkernels.quant.tensor import QuantizedTensor

    _, path, _ = model_files("llama", "q8_0")
    f = read_gguf(path)
    cfg = ModelConfig.from_gguf(f.metadata, f.keys())
    tensors = {n: f[n] for n in f.keys()}
    missing = dict(tensors)
    del missing["blk.1.ffn_down.weight"]
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_down\.weight: missing"):
        stack_tensors(cfg, missing)
    short = dict(tensors)
    w = tensors["blk.0.attn_k.weight"]
    short["blk.0.attn_k.weight"] = QuantizedTensor(w.format, (w.shape[0] - 32, w.shape[1]), w.data[32:])
    with pytest.raises(ValueError, match=r"blk\.0\.attn_k\.weight: expected shape"):
        stack_tensors(cfg, short)
    _, path16, _ = model_files("llama", "f16")
    mixed = dict(tensors, **{"blk.1.attn_v.weight": read_gguf(path16)["blk.1.attn_v.weight"]})
    with pytest.raises(ValueError, match=r"blk\.1\.attn_v\.weight: every matrix must be in one format \(q8_0\)"):
        stack_tensors(cfg, mixed)
    with pytest.raises(TypeError, match="engine Model"):
        share_stacks(LLM(path, progress=False, dtype=torch.float16))  # the LLM, not its model


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "q4_k", "q8_0"])
def test_gpu_share_stacks_keeps_the_engines_tokens(model_files, fmt):
    """On the GPU (kernel path, CUDA graphs captured after the move): greedy tokens and logits after the model's
    matrices move into the stacks equal those before."""
    from llmkernels.engine import SamplingParams

    _, path, _ = model_files("llama", fmt)
    prompt = torch.randint(1, 500, (7,)).tolist()
    sp = SamplingParams(max_tokens=12, temperature=0.0)
    llm = LLM(path, progress=False, cuda_graphs=False)
    before, want = llm.logits(prompt), llm.generate([prompt], sp)[0].token_ids
    share_stacks(llm.model)
    assert torch.equal(before, llm.logits(prompt))
    llm.close()
    llm = LLM(path, progress=False)
    share_stacks(llm.model)
    assert llm.generate([prompt], sp)[0].token_ids == want
