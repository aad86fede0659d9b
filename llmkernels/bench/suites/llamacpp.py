"""Suite ``llamacpp``: our engine and llama.cpp on one GGUF file, in one run.

The engine suite's Llama-3-8B-shaped synthetic model (random weights, llama.cpp's Q4_K_M mix) is written to a GGUF
that llama.cpp reads (integer ``llama.*`` keys as UINT32, ``tokenizer.ggml.model = "none"`` with the vocabulary size
set, so llama.cpp makes dummy tokens), then loaded back from that file by our engine. Rows: prefill tokens/s of 512- and
4096-token prompts, decode tokens/s at 1, 16 and 64 sequences (512-token prompts, 128 new tokens), ours exact and
with act_int8 at batch 1; llama.cpp's figures are each row's anchors, measured in the same run on the same file:
``llama-bench -p 512,4096 -n 128`` (pp / tg) and ``llama-batched-bench -npp 512 -ntg 128 -npl 1,16,64`` (S_TG).

llama.cpp is not part of llmkernels: point the suite at a build with ``--llama-cpp DIR`` (the folder holding
``llama-bench`` and ``llama-batched-bench``) or ``$LLMK_LLAMA_CPP``. Without one, only our rows are measured.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile

import torch

from ..harness import Row

ENV = "LLMK_LLAMA_CPP"
FORMAT = "q4_k_m"
BATCHES = (1, 16, 64)


def synthetic_vocab(vocab_size: int) -> dict:
    """``tokenizer.ggml.*`` metadata of a byte-level BPE vocabulary of ``vocab_size`` tokens that llama.cpp and our
    tokenizer both read: the 256 byte tokens, every pair and then triples of printable ASCII characters (each made
    by one merge), and BOS / EOS control tokens at the end."""
    from ...engine.tokenizer import byte_chars

    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    n = vocab_size - len(specials)
    alpha = [chr(c) for c in range(33, 127)]
    tokens, merges = list(byte_chars()), []
    pairs = [a + b for a in alpha for b in alpha]
    for t in pairs + [ab + c for ab in pairs for c in alpha]:
        if len(tokens) >= n:
            break
        tokens.append(t)
        merges.append(f"{t[:-1]} {t[-1]}")
    types = [1] * len(tokens) + [3] * len(specials)
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.tokens": tokens + specials,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": n, "tokenizer.ggml.eos_token_id": n + 1,
            "tokenizer.ggml.add_bos_token": False}


def write_synthetic_gguf(path: str, fmt: str = FORMAT, layers: int = 32, vocab: bool = False,
                         shape: str = "8b") -> None:
    """The engine suite's synthetic model in ``fmt`` as a GGUF file llama.cpp loads; ``vocab``: with a synthetic
    byte-level BPE vocabulary (``synthetic_vocab``) instead of llama.cpp's dummy tokens, for servers; ``shape``:
    Llama-3's "8b" (``layers`` of them) or "70b"."""
    import gguf

    from ...quant.gguf_io import GGUFMetadata, write_gguf
    from .engine import SHAPES, llama3_8b_config, synthetic_tensors

    cfg = llama3_8b_config(layers) if shape == "8b" else SHAPES[shape]()
    tensors = {name: t.to("cpu") for name, t in synthetic_tensors(fmt, cfg).items()}
    meta = {"general.architecture": "llama", "general.name": f"synthetic-llama3-{shape}-{fmt}",
            "llama.block_count": cfg.n_layers, "llama.context_length": cfg.context_length,
            "llama.embedding_length": cfg.hidden, "llama.feed_forward_length": cfg.ffn,
            "llama.attention.head_count": cfg.n_heads, "llama.attention.head_count_kv": cfg.n_kv_heads,
            "llama.rope.freq_base": cfg.rope_theta, "llama.attention.layer_norm_rms_epsilon": cfg.rms_eps,
            "llama.rope.dimension_count": cfg.head_dim, "llama.vocab_size": cfg.vocab_size,
            "tokenizer.ggml.model": "none"}
    if vocab:
        meta.update(synthetic_vocab(cfg.vocab_size))
    types = {k: (gguf.GGUFValueType.UINT32, None) for k, v in meta.items() if isinstance(v, int)
             and not isinstance(v, bool)}
    write_gguf(path, tensors, GGUFMetadata(meta, types=types))


def synthetic_gguf(folder: str, fmt: str = FORMAT, vocab: bool = False, shape: str = "8b") -> str:
    """Path of ``write_synthetic_gguf``'s file, written into ``folder``; with ``$LLMK_BENCH_CACHE`` set, written once
    into that folder and reused by later suites and runs (the weights are seeded, so the file is the same)."""
    return cached_file(folder, f"synthetic-llama3-{shape}-{fmt}{'-vocab' if vocab else ''}.gguf",
                       lambda p: write_synthetic_gguf(p, fmt, vocab=vocab, shape=shape))


def cached_file(folder: str, name: str, write) -> str:
    """``folder/name`` made by ``write(path)``; with ``$LLMK_BENCH_CACHE`` set, made once in that folder and reused."""
    cache = os.environ.get("LLMK_BENCH_CACHE")
    folder = cache or folder
    path = os.path.join(folder, name)
    if not (cache and os.path.exists(path)):
        os.makedirs(folder, exist_ok=True)
        write(path + ".part")
        os.replace(path + ".part", path)
    return path


def _run(cmd: list[str], timeout: int = 900) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{os.path.basename(cmd[0])} exited {r.returncode}: {r.stderr.strip()[-400:]}")
    return r.stdout + "\n" + r.stderr


def llama_bench(bin_dir: str, path: str, prompts: str = "512,4096") -> dict:
    """{"pp512": tok/s, "pp4096": ..., "tg128": ...} from llama-bench (-ngl 99 -fa 1, JSON output); ``prompts``
    "0": tg128 alone."""
    out = _run([os.path.join(bin_dir, "llama-bench"), "-m", path, "-ngl", "99", "-fa", "1", "-p", prompts,
                "-n", "128", "-r", "3", "-o", "json"])
    start = out.index("[")
    res = {}
    for t in json.loads(out[start:out.rindex("]") + 1]):
        key = f"pp{t['n_prompt']}" if t["n_prompt"] else f"tg{t['n_gen']}"
        res[key] = float(t["avg_ts"])
    return res


def llama_batched_bench(bin_dir: str, path: str) -> dict:
    """{sequences: decode tok/s (S_TG)} from llama-batched-bench, 512-token prompts and 128 new tokens each."""
    ctx = max(BATCHES) * (512 + 128)
    out = _run([os.path.join(bin_dir, "llama-batched-bench"), "-m", path, "-ngl", "99", "-fa", "on", "-c", str(ctx),
                "-b", "2048", "-ub", "512", "-npp", "512", "-ntg", "128", "-npl", ",".join(map(str, BATCHES)),
                "--output-format", "jsonl"])
    res = {}
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("{") and "speed_tg" in line:
            rec = json.loads(line)
            res[int(rec["pl"])] = float(rec["speed_tg"])
    return res


def _case(ctx, bin_dir: str | None):
    def run():
        from ...engine import LLM, Model, ModelConfig
        from ...quant import read_gguf
        from .engine import PREFILL_LENGTHS, _decode_rate, prefill_rows

        with tempfile.TemporaryDirectory() as tmp:
            path = synthetic_gguf(tmp)
            peer, batched, peer_error = {}, {}, ""
            if bin_dir:
                try:
                    peer = llama_bench(bin_dir, path)
                    batched = llama_batched_bench(bin_dir, path)
                except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as e:
                    peer_error = f"llama.cpp failed: {e}"
            f = read_gguf(path)
            model = Model(ModelConfig.from_gguf(f.metadata, f.keys()), f, "cuda", torch.bfloat16)
            rows = []
            for act_int8 in (False, True):
                llm = LLM.from_model(model, max_num_seqs=max(BATCHES), max_model_len=max(PREFILL_LENGTHS) + 16,
                                     act_int8=act_int8)
                llm.capture_graphs(list(BATCHES) if not act_int8 else [1])
                label = FORMAT + (" act_int8" if act_int8 else "")
                for batch in (BATCHES if not act_int8 else (1,)):
                    _decode_rate(llm, batch)  # warm-up at this batch size
                    rate = _decode_rate(llm, batch)[0]
                    anchors = {}
                    if batch == 1 and "tg128" in peer:
                        anchors["llama.cpp tg128"] = peer["tg128"]
                    if batch in batched:
                        anchors["llama.cpp batched S_TG"] = batched[batch]
                    row = Row("llamacpp", f"llama3-8b {label} batch{batch} decode (prompt 512, 128 new)", "tokens/s",
                              rate, None, anchors)
                    row.note = peer_error or (f"same GGUF file; ratio to llama.cpp "
                                              f"{rate / max(anchors.values()):.2f}x" if anchors else "no llama.cpp")
                    rows.append(row)
                if not act_int8:
                    pp = {n: {f"llama.cpp pp{n}": peer[f"pp{n}"]} for n in PREFILL_LENGTHS if f"pp{n}" in peer}
                    rows += prefill_rows(llm, FORMAT, suite="llamacpp", anchors=pp)
                del llm
            del model, f
        return rows
    return run


def cases(ctx):
    bin_dir = getattr(ctx, "llama_cpp", None) or os.environ.get(ENV)
    return [(f"llamacpp {FORMAT}", _case(ctx, bin_dir))]
