"""The reference executor of the instruction lists (megakernel/kernel.py) against the engine, step by step."""
import pytest
import torch

from llmkernels.engine import LLM, ModelConfig
from llmkernels.engine.config import rope_inv_freq
from llmkernels.megakernel import build_decode_program
from llmkernels.megakernel.kernel import DecodeStep
from llmkernels.quant import read_gguf
from llmkernels.quant.tensor import dequantize


def _weights(f, cfg, dtype):
    def t(name):
        return dequantize(f[name], torch.float32).to(dtype)

    L = range(cfg.n_layers)
    out = t("output.weight") if "output.weight" in f.keys() else t("token_embd.weight")
    return dict(
        emb=t("token_embd.weight"), wout=out, onorm=t("output_norm.weight"),
        wqkv=torch.stack([torch.cat([t(f"blk.{i}.attn_{x}.weight") for x in "qkv"]) for i in L]),
        wo=torch.stack([t(f"blk.{i}.attn_output.weight") for i in L]),
        wgu=torch.stack([torch.cat([t(f"blk.{i}.ffn_gate.weight"), t(f"blk.{i}.ffn_up.weight")]) for i in L]),
        wd=torch.stack([t(f"blk.{i}.ffn_down.weight") for i in L]),
        norms=torch.stack([torch.stack([t(f"blk.{i}.attn_norm.weight"), t(f"blk.{i}.ffn_norm.weight")]) for i in L]))


def _setup(model_files, batch, num_sms, device, T=6, **kw):
    _, path, _ = model_files("llama", "f16")
    f = read_gguf(path)
    cfg = ModelConfig.from_gguf(f.metadata, f.keys())
    prog = build_decode_program(cfg, "f16", batch=batch, context=16, num_sms=num_sms, **kw)
    page = 4
    pages = -(-T // page)
    num_pages = batch * pages + 3
    shape = (cfg.n_layers, num_pages, page, cfg.n_kv_heads, cfg.head_dim)
    nan = dict(dtype=torch.float16, device=device)
    kc, vc = torch.full(shape, float("nan"), **nan), torch.full(shape, float("nan"), **nan)
    table = torch.randperm(num_pages)[:batch * pages].view(batch, pages).to(torch.int32).to(device)  # scattered
    inv, _ = rope_inv_freq(cfg)
    w = {k: v.to(device) for k, v in _weights(f, cfg, torch.float16).items()}
    return path, cfg, prog, DecodeStep(prog, cfg, w, kc, vc, inv.to(device), batch=batch), table, T


def _match_the_engine(path, cfg, step, table, T, batch, device):
    prompts = torch.randint(1, cfg.vocab_size, (batch, T), dtype=torch.int32)
    llm = LLM(path, progress=False, dtype=torch.float16, device=device)
    ref = [llm.logits(prompts[b].tolist()) for b in range(batch)]
    for t in range(T):
        lens = torch.full((batch,), t + 1, dtype=torch.int32, device=device)
        got = step(prompts[:, t].contiguous().to(device), lens, table).clone()
        for b in range(batch):
            want = ref[b][t].float()
            err = (got[b] - want).abs().max().item() / want.abs().max().item()
            assert err < 2e-2, f"step {t}, sequence {b}: max error {err:.3g} of the largest logit"
            assert got[b].argmax() == want.argmax()


@pytest.mark.parametrize("batch", [1, 2])
def test_steps_match_the_engine(model_files, batch):
    """Every position of ``batch`` prompts decoded one token per step through the cache the steps fill (page size
    4, scattered pages, NaN where nothing was written, 2 key splits): each step's logits match the engine's
    next-token logits at that position. One program: the interpreter runs programs one after another."""
    path, cfg, prog, step, table, T = _setup(model_files, batch, 1, "cpu", num_splits=2)
    _match_the_engine(path, cfg, step, table, T, batch, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 5])
def test_gpu_steps_match_the_engine(model_files, batch):
    """The same with one program per SM, concurrent, waiting on each other's counters."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    path, cfg, prog, step, table, T = _setup(model_files, batch, sms, "cuda", T=9)
    _match_the_engine(path, cfg, step, table, T, batch, "cuda")


def test_a_schedule_that_cannot_finish_raises(model_files):
    """Under the interpreter programs run one after another: with two SMs the first waits on counters the second
    has not signalled yet, and the spin limit turns that into an error naming the instruction."""
    path, cfg, prog, step, table, T = _setup(model_files, 1, 2, "cpu")
    step.spin_limit = 200
    with pytest.raises(RuntimeError, match=r"decode step: SM 0 waited 200 polls at \w+ layer \d+ \[\d+, \d+\) for "
                                           r"counter \d+ \(layer \d+ .*\) to reach \d+: the schedule cannot finish"):
        step(torch.ones(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), table)
