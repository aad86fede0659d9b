"""Suite ``families``: decode of the other model families' shapes, llama.cpp beside on the same GGUF file.

Synthetic models (random weights in llama.cpp's Q4_K_M mix unless said, written as GGUF files llama.cpp loads, then
loaded back from them by our engine):

- Qwen3-30B-A3B (``qwen3moe``): 48 layers, hidden 2048, 32 query and 4 KV heads of 128, 128 experts of FFN width
  768 with 8 chosen per token, a 151936-token vocabulary;
- Gemma-2-9B (``gemma2``): 42 layers, hidden 3584, FFN 14336, 16 query and 8 KV heads of 256, soft caps 50 / 30, a
  4096-token window on every second layer, a 256000-token vocabulary tied to the output (q6_k, as llama.cpp
  stores a tied embedding in Q4_K_M);
- gpt-oss-20b (``gpt-oss``): 24 layers, hidden 2880, 64 query and 8 KV heads of 64, 32 experts of width 2880 with 4
  chosen per token, a 128-token window on every second layer, a 201088-token vocabulary; mxfp4 experts and q8_0
  elsewhere, as the released GGUF.

Rows: decode tokens/s at 1, 16 and 64 sequences (512-token prompts, 128 new tokens). Batch 1's bound is the read
bandwidth over the bytes one token reads (``Model.decode_bytes_per_token``: every matrix once, only the chosen
experts' share of the expert stacks, one embedding row). Anchors: llama.cpp's ``llama-bench -n 128`` (tg128) and
``llama-batched-bench`` (S_TG) on the same file, with ``--llama-cpp DIR`` or ``$LLMK_LLAMA_CPP``. The engine suite's
Llama-3-8B in the same mix gives the llama family's fraction of its bound in the same run, the yardstick of the
Gemma row.
"""
from __future__ import annotations

import os
import subprocess
import tempfile

import torch

from ..harness import Row
from .llamacpp import BATCHES, ENV, FORMAT, cached_file, llama_batched_bench, llama_bench

FAMILIES = {
    "qwen3-30b-a3b": dict(
        arch="qwen3moe", layers=48, hidden=2048, ffn=6144, heads=32, kv_heads=4, head_dim=128, vocab=151936,
        meta={"rope.freq_base": 1e6, "attention.layer_norm_rms_epsilon": 1e-6, "context_length": 40960,
              "expert_count": 128, "expert_used_count": 8, "expert_feed_forward_length": 768}),
    "gemma2-9b": dict(
        arch="gemma2", layers=42, hidden=3584, ffn=14336, heads=16, kv_heads=8, head_dim=256, vocab=256000,
        meta={"rope.freq_base": 10000.0, "attention.layer_norm_rms_epsilon": 1e-6, "context_length": 8192,
              "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "attention.sliding_window": 4096}),
    # as the released GGUF stores it: mxfp4 experts, q8_0 elsewhere (hidden 2880 is no multiple of 256)
    "gpt-oss-20b": dict(
        arch="gpt-oss", layers=24, hidden=2880, ffn=2880, heads=64, kv_heads=8, head_dim=64, vocab=201088,
        format="mxfp4", meta={"rope.freq_base": 150000.0, "attention.layer_norm_rms_epsilon": 1e-5,
                              "context_length": 131072, "rope.scaling.type": "yarn", "rope.scaling.factor": 32.0,
                              "rope.scaling.original_context_length": 4096, "attention.sliding_window": 128,
                              "expert_count": 32, "expert_used_count": 4, "expert_feed_forward_length": 2880}),
}


def family_tensors(spec: dict, fmt: str = FORMAT, device=None) -> dict:
    """Random weights of a ``FAMILIES`` entry under llama.cpp's GGUF names, each matrix in its ``fmt`` mix format."""
    from ...engine.convert import mix_format
    from ...quant.tensor import QuantizedTensor
    from ...testing.random_weights import random_qtensor

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    L, H, D = spec["layers"], spec["hidden"], spec["head_dim"]
    E = spec["meta"].get("expert_count", 0)
    tied = spec["arch"] == "gemma2"
    ones = torch.ones(H, device=device)

    oss = spec["arch"] == "gpt-oss"

    def rand(name, *shape):
        f = "q6_k" if tied and name == "token_embd.weight" else mix_format(fmt, name, L)
        if oss:
            f = "mxfp4" if "_exps." in name else "q8_0"
        if name.endswith("ffn_gate_inp.weight"):
            f = "f32"  # llama.cpp keeps the router in f32
        qt = random_qtensor(f, shape[0] * (shape[1] if len(shape) == 3 else 1), shape[-1], device, scale=0.02)
        return qt if len(shape) == 2 else QuantizedTensor(f, shape, qt.data.reshape(*shape[:2], -1))

    t = {"token_embd.weight": rand("token_embd.weight", spec["vocab"], H), "output_norm.weight": ones}
    if not tied:
        t["output.weight"] = rand("output.weight", spec["vocab"], H)
    for i in range(L):
        p = f"blk.{i}."
        shapes = {"attn_q": (spec["heads"] * D, H), "attn_k": (spec["kv_heads"] * D, H),
                  "attn_v": (spec["kv_heads"] * D, H), "attn_output": (H, spec["heads"] * D)}
        if E:
            F = spec["meta"]["expert_feed_forward_length"]
            shapes.update({"ffn_gate_inp": (E, H), "ffn_gate_exps": (E, F, H), "ffn_up_exps": (E, F, H),
                           "ffn_down_exps": (E, H, F)})
        else:
            shapes.update({"ffn_gate": (spec["ffn"], H), "ffn_up": (spec["ffn"], H), "ffn_down": (H, spec["ffn"])})
        for name, shape in shapes.items():
            t[p + name + ".weight"] = rand(p + name + ".weight", *shape)
        norms = ["attn_norm", "ffn_norm"] + (["post_attention_norm", "post_ffw_norm"] if tied else [])
        if oss:  # the FFN's norm under llama.cpp's gpt-oss name; sinks and biases, small and random
            norms = ["attn_norm", "post_attention_norm"]
            small = lambda *sh: 0.02 * torch.randn(*sh, device=device)  # noqa: E731
            t[p + "attn_sinks.weight"] = small(spec["heads"])
            for name, shape in shapes.items():
                if name != "ffn_down_exps":
                    t[p + name + ".bias"] = small(*shape[:-1])
            t[p + "ffn_down_exps.bias"] = small(E, H)
        t.update({p + n + ".weight": ones for n in norms})
        if spec["arch"] == "qwen3moe":
            t[p + "attn_q_norm.weight"] = torch.ones(D, device=device)
            t[p + "attn_k_norm.weight"] = torch.ones(D, device=device)
    return t


def write_family_gguf(path: str, name: str, fmt: str = FORMAT, spec: dict | None = None, vocab: bool = False) -> None:
    """``FAMILIES[name]`` (or ``spec``, an entry of that form) in ``fmt`` as a GGUF file llama.cpp loads (integer
    keys UINT32, dummy tokens; ``vocab``: the synthetic byte-level vocabulary our tokenizer reads too)."""
    import gguf

    from ...quant.gguf_io import GGUFMetadata, write_gguf
    from .llamacpp import synthetic_vocab

    spec = spec or FAMILIES[name]
    a = spec["arch"]
    meta = {"block_count": spec["layers"], "embedding_length": spec["hidden"], "feed_forward_length": spec["ffn"],
            "attention.head_count": spec["heads"], "attention.head_count_kv": spec["kv_heads"],
            "attention.key_length": spec["head_dim"], "attention.value_length": spec["head_dim"],
            "vocab_size": spec["vocab"], **spec["meta"]}
    meta = {"general.architecture": a, "general.name": f"synthetic-{name}-{fmt}",
            **{f"{a}.{k}": v for k, v in meta.items()}, "tokenizer.ggml.model": "none"}
    if vocab:
        meta.update(synthetic_vocab(spec["vocab"]))
    types = {k: (gguf.GGUFValueType.UINT32, None) for k, v in meta.items() if isinstance(v, int)
             and not isinstance(v, bool)}
    tensors = {k: v.to("cpu") for k, v in family_tensors(spec, fmt).items()}
    write_gguf(path, tensors, GGUFMetadata(meta, types=types))


def family_gguf(folder: str, name: str, fmt: str | None = None) -> str:
    """Path of ``write_family_gguf``'s file in ``folder``, or reused from ``$LLMK_BENCH_CACHE``."""
    fmt = fmt or FAMILIES[name].get("format", FORMAT)
    return cached_file(folder, f"synthetic-{name}-{fmt}.gguf", lambda p: write_family_gguf(p, name, fmt))


def _decode_rows(llm, label: str, bound: float, anchors_of) -> list:
    from .engine import _decode_rate

    rows = []
    for batch in BATCHES:
        _decode_rate(llm, batch)  # warm-up at this batch size
        rate = _decode_rate(llm, batch)[0]
        anchors = anchors_of(batch)
        row = Row("families", f"{label} batch{batch} decode (prompt 512, 128 new)", "tokens/s", rate,
                  100.0 * rate / bound if batch == 1 else None, anchors)
        row.note = (f"{rate / max(anchors.values()):.2f}x llama.cpp" if anchors else "no llama.cpp")
        if batch == 1:
            row.note += f"; {100.0 * rate / bound:.1f}% of the bound {bound:.0f} tok/s"
        print(row.case, f"{rate:.1f}", row.note, flush=True)
        rows.append(row)
    return rows


def _load(path: str, batches):
    from ...engine import LLM, Model, ModelConfig
    from ...quant import read_gguf

    f = read_gguf(path)
    model = Model(ModelConfig.from_gguf(f.metadata, f.keys()), f, "cuda", torch.bfloat16)
    llm = LLM.from_model(model, max_num_seqs=max(batches), max_model_len=512 + 128 + 16)
    llm.capture_graphs(list(batches))
    return llm


def _family_case(ctx, name: str, bin_dir: str | None):
    def run():
        with tempfile.TemporaryDirectory() as tmp:
            path = family_gguf(tmp, name)
            tg, batched, error = None, {}, ""
            if bin_dir:
                try:
                    tg = llama_bench(bin_dir, path, prompts="0")["tg128"]
                    batched = llama_batched_bench(bin_dir, path)
                except (RuntimeError, OSError, ValueError, KeyError, subprocess.TimeoutExpired) as e:
                    error = f"llama.cpp failed: {e}"
                    print(error, flush=True)
            llm = _load(path, BATCHES)
            bound = ctx.read_bw_TBps * 1e12 / llm.model.decode_bytes_per_token()

            def anchors_of(batch):
                a = {"llama.cpp batched S_TG": batched[batch]} if batch in batched else {}
                if batch == 1 and tg:
                    a["llama.cpp tg128"] = tg
                return a

            rows = _decode_rows(llm, f"{name} {FAMILIES[name].get('format', FORMAT)}", bound, anchors_of)
            if error:
                for r in rows:
                    r.note += "; " + error
            del llm
            return rows
    return run


def _llama_case(ctx):
    """The Llama-3-8B of the engine suite in the same mix, batch 1: the llama family's fraction of its bound."""
    def run():
        from .engine import _decode_rate
        from .llamacpp import synthetic_gguf

        with tempfile.TemporaryDirectory() as tmp:
            llm = _load(synthetic_gguf(tmp), (1,))
            bound = ctx.read_bw_TBps * 1e12 / llm.model.decode_bytes_per_token()
            _decode_rate(llm, 1)
            rate = _decode_rate(llm, 1)[0]
            row = Row("families", f"llama3-8b {FORMAT} batch1 decode (prompt 512, 128 new)", "tokens/s", rate,
                      100.0 * rate / bound)
            row.note = f"{100.0 * rate / bound:.1f}% of the bound {bound:.0f} tok/s: the llama family's fraction"
            print(row.case, f"{rate:.1f}", row.note, flush=True)
            return [row]
    return run


def cases(ctx):
    bin_dir = getattr(ctx, "llama_cpp", None) or os.environ.get(ENV)
    return ([(f"families {n}", _family_case(ctx, n, bin_dir)) for n in FAMILIES]
            + [("families llama3-8b", _llama_case(ctx))])
