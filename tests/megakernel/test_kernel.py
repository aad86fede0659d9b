"""The reference executor of the instruction lists (megakernel/kernel.py) against the engine, step by step."""
import pytest
import torch

from llmkernels.engine import LLM, ModelConfig
from llmkernels.engine.config import rope_inv_freq
from llmkernels.megakernel import build_decode_program
from llmkernels.megakernel.kernel import DecodeStep
from llmkernels.quant import read_gguf


def _setup(model_files, batch, num_sms, device, fmt="f16", T=6, step_kw=None, arch="llama", **kw):
    _, path, _ = model_files(arch, fmt)
    f = read_gguf(path)
    cfg = ModelConfig.from_gguf(f.metadata, f.keys())
    prog = build_decode_program(cfg, fmt, batch=batch, context=16, num_sms=num_sms, **kw)
    page = 4
    pages = -(-T // page)
    num_pages = batch * pages + 3
    shape = (cfg.n_layers, num_pages, page, cfg.n_kv_heads, cfg.head_dim)
    nan = dict(dtype=torch.float16, device=device)
    kc, vc = torch.full(shape, float("nan"), **nan), torch.full(shape, float("nan"), **nan)
    table = torch.randperm(num_pages)[:batch * pages].view(batch, pages).to(torch.int32).to(device)  # scattered
    inv, _ = rope_inv_freq(cfg)
    return path, cfg, prog, DecodeStep(prog, cfg, f, kc, vc, inv.to(device), batch=batch, **(step_kw or {})), table, T


def _match_the_engine(path, cfg, step, table, T, batch, device, solo=None, lead=0):
    """Decode ``batch`` prompts one token per step; sequence 0 first runs ``lead`` steps alone through ``solo`` (a
    batch-1 step on the same caches), so that the batch's sequences sit at different positions."""
    prompts = [torch.randint(1, cfg.vocab_size, (T + (lead if b == 0 else 0),), dtype=torch.int32)
               for b in range(batch)]
    llm = LLM(path, progress=False, dtype=torch.float16, device=device)
    ref = [llm.logits(p.tolist()) for p in prompts]

    def same(b, pos, got):
        want = ref[b][pos].float()
        err = (got - want).abs().max().item() / want.abs().max().item()
        assert err < 2e-2, f"sequence {b} at position {pos}: max error {err:.3g} of the largest logit"
        # the same greedy token, unless the engine's top two are closer than the error allowed (a near tie)
        top = want.max().item()
        assert got.argmax() == want.argmax() or want[got.argmax()].item() >= top - 2e-2 * want.abs().max().item()

    i32 = dict(dtype=torch.int32, device=device)
    for t in range(lead):
        same(0, t, solo(prompts[0][t:t + 1].to(device), torch.full((1,), t + 1, **i32), table[:1])[0])
    for t in range(T):
        pos = [t + (lead if b == 0 else 0) for b in range(batch)]
        got = step(torch.tensor([int(prompts[b][pos[b]]) for b in range(batch)], **i32),
                   torch.tensor([p + 1 for p in pos], **i32), table)
        for b in range(batch):
            same(b, pos[b], got[b])


@pytest.mark.parametrize("fmt, batch, blocks_per_step, vector_loads",
                         [("f16", 1, 1, True), ("q4_k_m", 2, 1, True), ("q8_0", 1, 1, True), ("q4_k_m", 1, 2, True),
                          ("q4_k_m", 1, 1, False)])
def test_steps_match_the_engine(model_files, fmt, batch, blocks_per_step, vector_loads):
    """Every position of ``batch`` prompts decoded one token per step through the cache the steps fill (page size
    4, scattered pages, NaN where nothing was written, 2 key splits): each step's logits match the engine's
    next-token logits at that position, on the same GGUF (q4_k_m: q4_k with q6_k for attn_v and ffn_down in some
    layers and for the output; q4_k through the vector-load tile or the generic dequantizer). One program: the
    interpreter runs programs one after another."""
    path, cfg, prog, step, table, T = _setup(model_files, batch, 1, "cpu", fmt, num_splits=2,
                                             step_kw=dict(blocks_per_step=blocks_per_step,
                                                          vector_loads=vector_loads))
    if fmt == "q4_k_m":  # the mix's two formats are both read
        f = read_gguf(path)
        assert {f[n].format for n in f.keys() if n.endswith("weight") and "norm" not in n} == {"q4_k", "q6_k"}
    _match_the_engine(path, cfg, step, table, T, batch, "cpu")


@pytest.mark.parametrize("fmt, batch", [("f16", 1), ("q8_0", 2)])
def test_mixture_of_experts_steps_match_the_engine(model_files, fmt, batch):
    """Mixtral (5 experts, top 2 per token): ROUTER tiles, TOPK, the routed experts' XGATEUP tiles and XDOWN's
    weighted sum give every step's logits of the engine, whose experts differ between the batch's sequences."""
    path, cfg, prog, step, table, T = _setup(model_files, batch, 1, "cpu", fmt, arch="mixtral", num_splits=2)
    assert cfg.n_experts == 5 and cfg.n_experts_used == 2
    assert {i.op for i in prog.instructions} >= {"ROUTER", "TOPK", "XGATEUP", "XDOWN"}
    _match_the_engine(path, cfg, step, table, T, batch, "cpu")
    assert ((step.route_i >= 0) & (step.route_i < 5)).all() and torch.allclose(step.route_w.sum(1), torch.ones(batch))


@pytest.mark.parametrize("arch, fmt, batch", [("qwen3", "f16", 1), ("qwen3moe", "q8_0", 2)])
def test_neox_qk_norm_steps_match_the_engine(model_files, arch, fmt, batch):
    """Qwen3 and Qwen3-MoE: neox RoPE pairs (i, i + D / 2) and each head of q and k RMS-normed before RoPE."""
    path, cfg, prog, step, table, T = _setup(model_files, batch, 1, "cpu", fmt, arch=arch, num_splits=2)
    assert cfg.rope_style == "neox" and cfg.qk_norm and bool(cfg.n_experts) == (arch == "qwen3moe")
    _match_the_engine(path, cfg, step, table, T, batch, "cpu")


def test_models_it_does_not_run_are_refused(model_files):
    """Qwen2's QKV biases are not in the decode step: refused at construction, naming them, never run."""
    _, path, _ = model_files("qwen2", "f16")
    f = read_gguf(path)
    cfg = ModelConfig.from_gguf(f.metadata, f.keys())
    prog = build_decode_program(cfg, "f16", batch=1, context=16, num_sms=1)
    shape = (cfg.n_layers, 4, 4, cfg.n_kv_heads, cfg.head_dim)
    kc = torch.zeros(shape, dtype=torch.float16)
    inv, _ = rope_inv_freq(cfg)
    with pytest.raises(ValueError, match="does not run qwen2 models with QKV biases"):
        DecodeStep(prog, cfg, f, kc, kc.clone(), inv, batch=1)


def test_sequences_at_different_positions(model_files):
    """A batch whose sequences are at different positions (RoPE angles, split bounds and pages per sequence): the
    first sequence runs five steps alone first, through a batch-1 step on the same caches. Three key splits."""
    path, cfg, prog, step, table, T = _setup(model_files, 3, 1, "cpu", T=9, num_splits=3)
    f = read_gguf(path)
    solo = DecodeStep(build_decode_program(cfg, "f16", batch=1, context=16, num_sms=1, num_splits=3), cfg, f,
                      step.kc, step.vc, step.inv_freq, batch=1)
    _match_the_engine(path, cfg, step, table, 4, 3, "cpu", solo=solo, lead=5)


@pytest.mark.gpu
@pytest.mark.parametrize("arch, fmt, batch", [("llama", "f16", 1), ("llama", "q4_k_m", 5), ("llama", "bf16", 2),
                                              ("mixtral", "q8_0", 3)])
def test_gpu_steps_match_the_engine(model_files, arch, fmt, batch):
    """The same with one program per SM, concurrent, waiting on each other's counters."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    path, cfg, prog, step, table, T = _setup(model_files, batch, sms, "cuda", fmt, T=9, arch=arch)
    _match_the_engine(path, cfg, step, table, T, batch, "cuda")


def test_a_schedule_that_cannot_finish_raises(model_files):
    """Under the interpreter programs run one after another: with two SMs the first waits on counters the second
    has not signalled yet, and the spin limit turns that into an error naming the instruction."""
    path, cfg, prog, step, table, T = _setup(model_files, 1, 2, "cpu")
    step.spin_limit = 200
    with pytest.raises(RuntimeError, match=r"decode step: SM 0 waited 200 polls at \w+ layer \d+ \[\d+, \d+\) for "
                                           r"counter \d+ \(layer \d+ .*\) to reach \d+: the schedule cannot finish"):
        step(torch.ones(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), table)


def test_compiles_for_sm90():
    """The kernel compiles for sm_90 at the 8B shape (in a subprocess: without a GPU llmkernels turns the
    interpreter on), its waits are acquire loads, its signals release atomics, and ptxas assembles it."""
    import os
    import re
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from triton.backends.nvidia.compiler import get_ptxas

    code = ("import sys; from llmkernels.megakernel.kernel import compile_sm90; "
            "sys.stdout.write(compile_sm90(batch=2).asm['ptx'])")
    env = dict(os.environ, TRITON_INTERPRET="0")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    ptx = res.stdout
    assert "ld.global.gpu.acquire" in ptx and re.search(r"(atom|red)\.global\.gpu\.release\.add", ptx)
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "k.ptx").write_text(ptx)
        out = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(Path(d) / "k.ptx"), "-o",
                              str(Path(d) / "k.cubin")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]


def test_bad_inputs(model_files):
    """Wrong dtypes, shapes, batch or caches: ValueError naming the argument, before any launch."""
    path, cfg, prog, step, table, T = _setup(model_files, 2, 1, "cpu")
    ok = dict(ids=torch.ones(2, dtype=torch.int32), seq_lens=torch.ones(2, dtype=torch.int32), page_table=table)
    for name, bad in (("ids", torch.ones(2, dtype=torch.int64)), ("seq_lens", torch.ones(3, dtype=torch.int32)),
                      ("page_table", table[0])):
        with pytest.raises(ValueError, match=f"{name} must be an int32 tensor with 2 rows"):
            step(**dict(ok, **{name: bad}))
    f = read_gguf(path)
    with pytest.raises(ValueError, match=r"batch must be the program's \(2\), got 1"):
        DecodeStep(prog, cfg, f, step.kc, step.vc, step.inv_freq, batch=1)
    with pytest.raises(ValueError, match="k_cache must be a 16-bit"):
        DecodeStep(prog, cfg, f, step.kc.float(), step.vc, step.inv_freq, batch=2)
    with pytest.raises(ValueError, match="v_cache must be a 16-bit .* got torch.float16 \\(2, "):
        DecodeStep(prog, cfg, f, step.kc, step.vc[:, :, :, :1], step.inv_freq, batch=2)
    with pytest.raises(ValueError, match="blocks_per_step must be 1, 2 or 4, got 3"):
        DecodeStep(prog, cfg, f, step.kc, step.vc, step.inv_freq, batch=2, blocks_per_step=3)
    with pytest.raises(ValueError, match="stages must be an int in 1..8, got 0"):
        DecodeStep(prog, cfg, f, step.kc, step.vc, step.inv_freq, batch=2, stages=0)
    # a matrix format the executor does not read
    from llmkernels.quant import GGUF_FORMATS
    from llmkernels.quant.tensor import QuantizedTensor

    tensors = {n: f[n] for n in f.keys()}
    q = tensors["blk.0.attn_q.weight"]
    K = q.shape[1]
    tensors["blk.0.attn_q.weight"] = QuantizedTensor(
        "q4_0", q.shape, torch.zeros(q.shape[0], GGUF_FORMATS["q4_0"].bytes_per_row(K), dtype=torch.uint8))
    with pytest.raises(ValueError, match="blk.0.attn_q.weight: format q4_0 is not one the decode step reads"):
        DecodeStep(prog, cfg, tensors, step.kc, step.vc, step.inv_freq, batch=2)
