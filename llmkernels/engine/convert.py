"""Hugging Face checkpoints (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3, Mixtral, Qwen3-MoE, gpt-oss) to GGUF, and
GGUF back to a Hugging Face state dict.

The GGUF side follows llama.cpp's conventions: tensor names ``token_embd``, ``blk.N.attn_q`` ..., dims stored
reversed, the rows of Q and K of llama-architecture models permuted so that RoPE rotates adjacent pairs, norms and
biases in f32, Llama 3.1 rope scaling stored as the ``rope_freqs.weight`` divisors, and the tokenizer as
``tokenizer.ggml.*`` metadata.
"""
from __future__ import annotations

import json
import os
import sys

import torch

from ..quant.formats import GGUF_FORMATS
from ..quant.gguf_io import GGUFMetadata, read_gguf, write_gguf
from ..quant.tensor import QuantizedTensor, dequantize, quantize
from .config import ModelConfigError, llama3_rope_factors
from .tokenizer import (GPT4O_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN, TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL,
                        TOKEN_UNUSED, TOKEN_USER_DEFINED)

HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                    "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3", "Gemma2ForCausalLM": "gemma2",
                    "Gemma3ForCausalLM": "gemma3", "MixtralForCausalLM": "llama", "Qwen3MoeForCausalLM": "qwen3moe",
                    "GptOssForCausalLM": "gpt-oss"}
LAYER_NAMES = {  # Hugging Face suffix -> GGUF suffix, under model.layers.N. / blk.N.
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}
# the families whose Hugging Face names differ from the llama family's (llama.cpp's GGUF names on the right)
_GEMMA_NAMES = {"post_attention_layernorm.weight": "post_attention_norm.weight",
                "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
ARCH_LAYER_NAMES = {
    "phi3": {**LAYER_NAMES, "self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"},
    "gemma2": {**LAYER_NAMES, **_GEMMA_NAMES},
    "gemma3": {**LAYER_NAMES, **_GEMMA_NAMES},
    "gpt-oss": {**LAYER_NAMES, "post_attention_layernorm.weight": "post_attention_norm.weight",
                "self_attn.o_proj.bias": "attn_output.bias", "self_attn.sinks": "attn_sinks.weight",
                "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias"},
}
# gpt-oss keeps each layer's experts fused: gate and up interleaved by column in gate_up_proj [E, H, 2F] (gate at even
# columns), down_proj [E, F, H], each with a bias; GGUF stores them apart as [E, N, K] stacks and [E, N] biases
OSS_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj",
               "mlp.experts.down_proj_bias")
# mixture-of-experts FFNs: the router, and each expert's matrices (stacked into GGUF's [n_expert, N, K] tensors)
ROUTER_NAMES = {"mlp.gate.weight": "ffn_gate_inp.weight", "block_sparse_moe.gate.weight": "ffn_gate_inp.weight"}
EXPERT_NAMES = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
HF_EXPERT = {"qwen3moe": ("mlp.experts.{}.{}.weight", ("gate_proj", "up_proj", "down_proj")),
             "llama": ("block_sparse_moe.experts.{}.{}.weight", ("w1", "w3", "w2"))}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
# Gemma's RMSNorm multiplies by (1 + weight); GGUF stores 1 + weight (as llama.cpp's converter does)
NORM_PLUS_ONE = ("gemma2", "gemma3")


def hf_to_gguf_name(name: str, arch: str = "llama") -> str | None:
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    names = ARCH_LAYER_NAMES.get(arch, LAYER_NAMES)
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"]:
        if parts[3] in names:
            return f"blk.{parts[2]}.{names[parts[3]]}"
        if parts[3] in ROUTER_NAMES:
            return f"blk.{parts[2]}.{ROUTER_NAMES[parts[3]]}"
    return None


def _oss_experts(name: str, w: torch.Tensor) -> list:
    """[(GGUF name, tensor)] of one of gpt-oss's fused expert tensors (OSS_EXPERTS), or [] for any other name."""
    parts = name.split(".", 3)
    if len(parts) != 4 or parts[:2] != ["model", "layers"] or parts[3] not in OSS_EXPERTS:
        return []
    p = f"blk.{parts[2]}."
    if parts[3].endswith("gate_up_proj"):
        return [(p + "ffn_gate_exps.weight", w[..., 0::2].transpose(1, 2)),
                (p + "ffn_up_exps.weight", w[..., 1::2].transpose(1, 2))]
    if parts[3].endswith("gate_up_proj_bias"):
        return [(p + "ffn_gate_exps.bias", w[:, 0::2]), (p + "ffn_up_exps.bias", w[:, 1::2])]
    if parts[3].endswith("down_proj"):
        return [(p + "ffn_down_exps.weight", w.transpose(1, 2))]
    return [(p + "ffn_down_exps.bias", w)]


def _expert_part(name: str):
    """(layer, expert, GGUF stack name) of a Hugging Face expert matrix, else None."""
    parts = name.split(".")
    if len(parts) == 8 and parts[:2] == ["model", "layers"] and parts[4] == "experts" and parts[7] == "weight":
        if parts[3] in ("mlp", "block_sparse_moe") and parts[6] in EXPERT_NAMES:
            return int(parts[2]), int(parts[5]), EXPERT_NAMES[parts[6]]
    return None


def permute_rows(w: torch.Tensor, n_head: int, inverse: bool = False) -> torch.Tensor:
    """Reorder each head's rows from the rotate-half layout to adjacent pairs (llama.cpp's Q/K permutation)."""
    d2 = w.shape[0] // n_head // 2
    if inverse:
        return w.reshape(n_head, d2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return w.reshape(n_head, 2, d2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_json(path, required=True):
    if not os.path.isfile(path):
        if required:
            raise FileNotFoundError(f"{path} not found")
        return {}
    with open(path) as f:
        return json.load(f)


def _iter_safetensors(model_dir, tensors=True):
    """(name, tensor) of every tensor in the directory's .safetensors files, one at a time (names only if not
    ``tensors``)."""
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    for fn in files:
        with safe_open(os.path.join(model_dir, fn), framework="pt") as f:
            for name in f.keys():
                yield (name, f.get_tensor(name)) if tensors else name


def _token_id(tok, added, vocab):
    if isinstance(tok, dict):
        tok = tok.get("content")
    if tok is None:
        return None
    return added.get(tok, vocab.get(tok))


def tokenizer_metadata(model_dir: str, vocab_size: int, config: dict) -> dict:
    """``tokenizer.ggml.*`` metadata from a Hugging Face tokenizer.json (+ tokenizer_config.json)."""
    tj = _load_json(os.path.join(model_dir, "tokenizer.json"))
    tc = _load_json(os.path.join(model_dir, "tokenizer_config.json"), required=False)
    model = tj.get("model", {})
    if model.get("type") != "BPE":
        raise ModelConfigError(f"tokenizer model type {model.get('type')!r} is not supported (BPE only)")
    vocab = dict(model["vocab"])
    added = {a["content"]: a["id"] for a in tj.get("added_tokens", [])}
    special = {a["id"] for a in tj.get("added_tokens", []) if a.get("special")}
    n = max(vocab_size, max(list(vocab.values()) + list(added.values())) + 1)
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [TOKEN_UNUSED] * n
    for t, i in vocab.items():
        tokens[i], types[i] = t, TOKEN_NORMAL
    for t, i in added.items():
        tokens[i], types[i] = t, (TOKEN_CONTROL if i in special else TOKEN_USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    pre = json.dumps(tj.get("pre_tokenizer") or {})
    meta = {}
    if "ByteLevel" in pre:
        meta["tokenizer.ggml.model"] = "gpt2"
        if json.dumps(LLAMA3_PATTERN)[1:-1] in pre:
            meta["tokenizer.ggml.pre"] = "llama-bpe"
        elif json.dumps(QWEN2_PATTERN)[1:-1] in pre:
            meta["tokenizer.ggml.pre"] = "qwen2"
        elif json.dumps(GPT4O_PATTERN)[1:-1] in pre:
            meta["tokenizer.ggml.pre"] = "gpt-4o"
        elif '"use_regex": true' in pre and '"Split"' not in pre:
            meta["tokenizer.ggml.pre"] = "gpt-2"
        else:
            raise ModelConfigError("unrecognised byte-level pre-tokenizer split pattern in tokenizer.json")
    elif model.get("byte_fallback"):
        meta["tokenizer.ggml.model"] = "llama"
        for i, t in enumerate(tokens):
            if len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                types[i] = TOKEN_BYTE
        meta["tokenizer.ggml.scores"] = [-float(i) for i in range(n)]
    else:
        raise ModelConfigError("only byte-level BPE and byte-fallback (SentencePiece-style) BPE tokenizers convert")
    meta["tokenizer.ggml.tokens"] = tokens
    meta["tokenizer.ggml.token_type"] = types
    if merges:
        meta["tokenizer.ggml.merges"] = merges
    bos = _token_id(tc.get("bos_token"), added, vocab)
    eos = _token_id(tc.get("eos_token"), added, vocab)
    bos = bos if bos is not None else config.get("bos_token_id")
    eos = eos if eos is not None else config.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0]
    if bos is not None:
        meta["tokenizer.ggml.bos_token_id"] = int(bos)
    if eos is not None:
        meta["tokenizer.ggml.eos_token_id"] = int(eos)
    post = json.dumps(tj.get("post_processor") or {})
    add_bos = tc.get("add_bos_token")
    if add_bos is None:
        add_bos = bos is not None and bos in {i for t, i in added.items() if t in post}
    meta["tokenizer.ggml.add_bos_token"] = bool(add_bos)
    if isinstance(tc.get("chat_template"), str):
        meta["tokenizer.chat_template"] = tc["chat_template"]
    return meta


# llama.cpp's mixes by name -> their base format; the rest of each mix is in mix_format
MIXES = {"q4_k_m": "q4_k", "q5_k_m": "q5_k"}


def more_bits(layer: int, n_layers: int) -> bool:
    """The layers whose attn_v and ffn_down llama.cpp's Q4_K_M and Q5_K_M keep in q6_k: the first and last eighth and
    every third layer between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def mix_format(fmt: str, gname: str, n_layers: int) -> str:
    """The format of GGUF tensor ``gname`` under ``fmt``: a GGUF format itself, or for the mixes q4_k_m and q5_k_m
    q6_k for output.weight and for attn_v / ffn_down in the more_bits layers, the base format (q4_k, q5_k) elsewhere
    (llama.cpp's Q4_K_M and Q5_K_M for llama models; its rule matches the expert stacks ffn_down_exps too)."""
    if fmt not in MIXES:
        return fmt
    parts = gname.split(".")
    if gname == "output.weight" or (len(parts) > 3 and parts[0] == "blk"
                                    and parts[2] in ("attn_v", "ffn_down", "ffn_down_exps")
                                    and more_bits(int(parts[1]), n_layers)):
        return "q6_k"
    return MIXES[fmt]


def _pick_format(fmt: str, K: int) -> str:
    """``fmt`` if K is a multiple of its block size, else q8_0 (iq4_xs: iq4_nl, its codebook in blocks of 32), else
    f16 (as llama.cpp falls back)."""
    for f in (fmt, "iq4_nl" if fmt == "iq4_xs" else "q8_0", "q8_0", "f16"):
        if K % GGUF_FORMATS[f].block_size == 0:
            return f
    return "f32"


def convert_hf_to_gguf(model_dir, out_path, format: str = "f16", *, output_format: str | None = None,
                       progress: bool = True) -> str:
    """Convert a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json) to GGUF.

    format: GGUF format of the 2-D weights (f32 f16 bf16 q4_0 q4_1 q5_0 q5_1 q8_0 q2_k ... q6_k iq4_nl iq4_xs
    mxfp4), or the mix
    q4_k_m or q5_k_m (llama.cpp's Q4_K_M / Q5_K_M: q6_k for the output matrix and for attn_v and ffn_down in about
    half of the layers, q4_k / q5_k elsewhere; mix_format); a matrix whose row length is not a multiple of the
    format's block falls back to q8_0, then f16. output_format: the format of the output (lm head) matrix, default
    ``format``'s. Norms and biases stay f32. Returns ``out_path``.
    """
    if format not in GGUF_FORMATS and format not in MIXES:
        raise ValueError(f"format must be a GGUF format {tuple(GGUF_FORMATS)} or a mix {tuple(MIXES)}, got "
                         f"{format!r}")
    output_format = output_format or format
    if output_format not in GGUF_FORMATS and output_format not in MIXES:
        raise ValueError(f"output_format must be a GGUF format or a mix, got {output_format!r}")
    model_dir = os.fspath(model_dir)
    config = _load_json(os.path.join(model_dir, "config.json"))
    archs = config.get("architectures") or []
    arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if arch is None:
        raise ModelConfigError(f"unsupported Hugging Face architecture {archs}; supported: "
                               f"{', '.join(HF_ARCHITECTURES)}")
    n_heads = int(config["num_attention_heads"])
    n_kv = int(config.get("num_key_value_heads") or n_heads)
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // n_heads)
    vocab_size = int(config["vocab_size"])
    rp = config.get("rope_parameters") or {}
    if "full_attention" in rp:  # per layer type (gemma3): the global layers' parameters are the model's
        rp = rp["full_attention"]
    theta = float(config.get("rope_theta") or rp.get("rope_theta") or 10000.0)
    meta = {"general.architecture": arch, "general.name": os.path.basename(os.path.normpath(model_dir)),
            f"{arch}.block_count": int(config["num_hidden_layers"]),
            f"{arch}.context_length": int(config.get("max_position_embeddings", 4096)),
            f"{arch}.embedding_length": hidden, f"{arch}.feed_forward_length": int(config["intermediate_size"]),
            f"{arch}.attention.head_count": n_heads, f"{arch}.attention.head_count_kv": n_kv,
            f"{arch}.attention.key_length": head_dim, f"{arch}.attention.value_length": head_dim,
            f"{arch}.rope.dimension_count": head_dim, f"{arch}.rope.freq_base": theta,
            f"{arch}.attention.layer_norm_rms_epsilon": float(config.get("rms_norm_eps", 1e-6)),
            f"{arch}.vocab_size": vocab_size, "general.file_type": 1}
    extra = {}
    scaling = config.get("rope_scaling") or rp
    rtype = scaling.get("rope_type", scaling.get("type"))
    if rtype == "linear":
        meta[f"{arch}.rope.scaling.type"] = "linear"
        meta[f"{arch}.rope.scaling.factor"] = float(scaling["factor"])
    elif rtype == "yarn":
        meta[f"{arch}.rope.scaling.type"] = "yarn"
        meta[f"{arch}.rope.scaling.factor"] = float(scaling["factor"])
        meta[f"{arch}.rope.scaling.original_context_length"] = int(scaling["original_max_position_embeddings"])
        for k, key in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow"),
                       ("attention_factor", "attn_factor")):
            if scaling.get(k) is not None:
                meta[f"{arch}.rope.scaling.{key}"] = float(scaling[k])
    elif rtype == "llama3":
        extra["rope_freqs.weight"] = llama3_rope_factors(
            head_dim, theta, float(scaling["factor"]), float(scaling["low_freq_factor"]),
            float(scaling["high_freq_factor"]), int(scaling["original_max_position_embeddings"]))
    elif rtype not in (None, "default"):
        raise ModelConfigError(f"rope scaling {rtype!r} is not supported (linear, yarn, llama3)")
    if arch == "phi3" and float((config.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelConfigError("phi3: partial rotary embeddings are not supported")
    if arch in NORM_PLUS_ONE:
        meta.update(_gemma_metadata(arch, config, head_dim))
    n_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if n_experts:
        if arch == "qwen3moe" and (config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1)) != 1):
            raise ModelConfigError("qwen3moe: dense layers among the expert layers (mlp_only_layers, "
                                   "decoder_sparse_step) are not supported")
        meta.update({f"{arch}.expert_count": n_experts,
                     f"{arch}.expert_used_count": int(config["num_experts_per_tok"]),
                     f"{arch}.expert_weights_norm": bool(config.get("norm_topk_prob", True))})
        if arch == "qwen3moe":
            meta[f"{arch}.expert_feed_forward_length"] = int(config["moe_intermediate_size"])
    if arch == "gpt-oss":
        meta.update(_oss_metadata(config, n_experts))
        if scaling.get("truncate") is False:  # the reference's YaRN ramp without rounded ends
            meta[f"{arch}.rope.scaling.yarn_truncate"] = False
    meta.update(tokenizer_metadata(model_dir, vocab_size, config))
    names = list(_iter_safetensors(model_dir, tensors=False))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(names), desc="converting", unit="tensor")
    tensors = dict(extra)
    fallbacks = []  # matrices whose row length the asked format's block does not divide

    def store(gname, w):
        if w.dim() == 1 or gname.endswith((".bias", "ffn_gate_inp.weight")):  # norms, biases and routers stay f32
            tensors[gname] = w.contiguous()
            return
        fmt = mix_format(output_format if gname == "output.weight" else format, gname,
                         int(config["num_hidden_layers"]))
        used = _pick_format(fmt, w.shape[-1])
        if used != fmt:
            fallbacks.append(f"{gname} [{w.shape[0]}, {w.shape[-1]}]: {fmt} -> {used} (row length "
                             f"{w.shape[-1]} is not a multiple of {fmt}'s block of {GGUF_FORMATS[fmt].block_size})")
        tensors[gname] = quantize(w.contiguous(), used)

    experts = {}  # (layer, stack name) -> {expert: float32 matrix}, stacked once all experts are read
    for name, w in _iter_safetensors(model_dir):
        if bar is not None:
            bar.update(1)
        if name.endswith(("_blocks", "_scales")) and arch == "gpt-oss":
            raise ModelConfigError(f"{name!r}: the checkpoint's experts are stored as MXFP4 blocks, which the "
                                   f"converter does not read yet; save the model dequantized first (transformers: "
                                   f"Mxfp4Config(dequantize=True))")
        oss = _oss_experts(name, w) if arch == "gpt-oss" else []
        for gname, part in oss:
            store(gname, part.float())
        if oss:
            continue
        gname = hf_to_gguf_name(name, arch)
        part = _expert_part(name) if gname is None else None
        if part is not None:
            i, e, stack = part
            got = experts.setdefault((i, stack), {})
            got[e] = w.float()
            if len(got) < n_experts:
                continue
            gname, w = f"blk.{i}.{stack}.weight", torch.stack([got[j] for j in range(n_experts)])
            del experts[(i, stack)]
        if gname is None:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            raise ModelConfigError(f"unexpected tensor {name!r} in the checkpoint")
        w = w.float()
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_q.bias")):
            w = permute_rows(w, n_heads)
        elif arch == "llama" and gname.endswith(("attn_k.weight", "attn_k.bias")):
            w = permute_rows(w, n_kv)
        if arch in NORM_PLUS_ONE and gname.endswith("norm.weight"):
            w = w + 1.0
        store(gname, w)
    if bar is not None:
        bar.close()
    if fallbacks:
        print(f"convert: {len(fallbacks)} matrices fell back to another format:", file=sys.stderr)
        for line in fallbacks:
            print(f"  {line}", file=sys.stderr)
    if config.get("tie_word_embeddings") and "output.weight" in tensors:
        del tensors["output.weight"]
    types = {}
    from gguf import GGUFValueType as VT

    for k, v in meta.items():
        if isinstance(v, bool):
            continue
        if isinstance(v, int) and k != "general.file_type" and not k.startswith("tokenizer."):
            types[k] = (VT.UINT32, None)
        elif k in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
            types[k] = (VT.UINT32, None)
    write_gguf(out_path, tensors, GGUFMetadata(meta, types=types))
    return os.fspath(out_path)


def _gemma_metadata(arch: str, config: dict, head_dim: int) -> dict:
    """Gemma 2 / 3 keys under llama.cpp's names: soft caps, the sliding window and which layers use it, the
    sliding layers' RoPE base (gemma3) and the attention scale (query_pre_attn_scalar ** -0.5)."""
    meta = {}
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key):
            meta[f"{arch}.{key}"] = float(config[key])
    if config.get("sliding_window"):
        meta[f"{arch}.attention.sliding_window"] = int(config["sliding_window"])
    types = config.get("layer_types")
    if types:
        meta[f"{arch}.attention.sliding_window_pattern"] = [t == "sliding_attention" for t in types]
    elif config.get("sliding_window_pattern"):
        meta[f"{arch}.attention.sliding_window_pattern"] = int(config["sliding_window_pattern"])
    local = (config.get("rope_parameters") or {}).get("sliding_attention", {}).get("rope_theta")
    local = local or config.get("rope_local_base_freq")
    if arch == "gemma3" and local:
        meta[f"{arch}.rope.freq_base_swa"] = float(local)
    meta[f"{arch}.attention.scale"] = float(config.get("query_pre_attn_scalar") or head_dim) ** -0.5
    return meta


def _oss_metadata(config: dict, n_experts: int) -> dict:
    """gpt-oss keys under llama.cpp's names: the experts' width, the sliding window and which layers use it."""
    meta = {"gpt-oss.expert_feed_forward_length": int(config["intermediate_size"])}
    if config.get("sliding_window"):
        meta["gpt-oss.attention.sliding_window"] = int(config["sliding_window"])
    types = config.get("layer_types")
    if types:
        meta["gpt-oss.attention.sliding_window_pattern"] = [t == "sliding_attention" for t in types]
    return meta


def gguf_to_hf_state_dict(path_or_file, dtype=torch.float32) -> dict:
    """The tensors of a GGUF model as a Hugging Face state dict (dequantized, Q/K rows un-permuted for llama)."""
    f = read_gguf(path_or_file) if isinstance(path_or_file, (str, os.PathLike)) else path_or_file
    arch = f.metadata.get("general.architecture")
    n_heads = int(f.metadata[f"{arch}.attention.head_count"])
    n_kv = int(f.metadata.get(f"{arch}.attention.head_count_kv", n_heads))
    inv_top = {v: k for k, v in TOP_NAMES.items()}
    inv_layer = {v: k for k, v in ARCH_LAYER_NAMES.get(arch, LAYER_NAMES).items()}
    out = {}
    for gname, qt in f.items():
        if gname in inv_top:
            name = inv_top[gname]
        elif gname.startswith("blk."):
            _, i, rest = gname.split(".", 2)
            if arch == "gpt-oss" and "_exps." in rest:
                _oss_to_hf(out, f, i, rest, dtype)
                continue
            if rest == "ffn_gate_inp.weight" and arch != "gpt-oss":
                name = f"model.layers.{i}.{'mlp' if arch == 'qwen3moe' else 'block_sparse_moe'}.gate.weight"
            elif rest.endswith("_exps.weight") and arch in HF_EXPERT:
                pattern, hf = HF_EXPERT[arch]
                w = dequantize(qt, torch.float32)
                j = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight").index(rest)
                for e in range(w.shape[0]):
                    out[f"model.layers.{i}." + pattern.format(e, hf[j])] = w[e].to(dtype)
                continue
            elif rest not in inv_layer:
                continue
            else:
                name = f"model.layers.{i}.{inv_layer[rest]}"
        else:
            continue
        w = dequantize(qt, torch.float32) if isinstance(qt, QuantizedTensor) else qt.float()
        if arch in NORM_PLUS_ONE and gname.endswith("norm.weight"):
            w = w - 1.0
        if arch in ("llama", "mistral") and rest_is(gname, "attn_q"):
            w = permute_rows(w, n_heads, inverse=True)
        elif arch in ("llama", "mistral") and rest_is(gname, "attn_k"):
            w = permute_rows(w, n_kv, inverse=True)
        out[name] = w.to(dtype)
    if "lm_head.weight" not in out and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def _oss_to_hf(out: dict, f, i: str, rest: str, dtype) -> None:
    """gpt-oss's fused expert tensors of layer ``i`` in ``out``, filled from GGUF stack ``rest`` (the inverse of
    _oss_experts: gate and up interleaved by column)."""
    w = f[f"blk.{i}.{rest}"]
    w = dequantize(w, torch.float32) if isinstance(w, QuantizedTensor) else w.float()
    p = f"model.layers.{i}.mlp.experts."
    if rest.startswith("ffn_down_exps"):
        out[p + ("down_proj" if rest.endswith("weight") else "down_proj_bias")] = (
            w.transpose(1, 2) if rest.endswith("weight") else w).contiguous().to(dtype)
        return
    key = p + ("gate_up_proj" if rest.endswith("weight") else "gate_up_proj_bias")
    part = w.transpose(1, 2) if rest.endswith("weight") else w  # [E, H, F] / [E, F]
    if key not in out:
        out[key] = torch.zeros(*part.shape[:-1], 2 * part.shape[-1], dtype=dtype)
    first = 0 if rest.startswith("ffn_gate") else 1
    out[key][..., first::2] = part.to(dtype)


def rest_is(gname: str, base: str) -> bool:
    return gname.endswith((f".{base}.weight", f".{base}.bias"))
