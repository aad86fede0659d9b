"""Model configuration read from GGUF metadata, and the RoPE frequency table it implies."""
from __future__ import annotations

import dataclasses
import math

import torch

from ..attention.plan import PAGED_HEAD_DIMS
from ..attention.prefill import HEAD_DIMS as PREFILL_HEAD_DIMS

# GGUF architecture -> how its tensors are laid out. "interleaved" RoPE rotates pairs (2i, 2i+1): llama.cpp's
# converter permutes the rows of Q and K of llama-style checkpoints into that order. Qwen models keep the
# Hugging Face layout and rotate (i, i + D/2) ("neox").
ARCHITECTURES = {
    "llama": dict(rope="interleaved", qkv_bias=False, qk_norm=False),
    "mistral": dict(rope="interleaved", qkv_bias=False, qk_norm=False),
    "qwen2": dict(rope="neox", qkv_bias=True, qk_norm=False),
    "qwen3": dict(rope="neox", qkv_bias=False, qk_norm=True),
    # mixture-of-experts FFNs in every layer (Mixtral is "llama" with {arch}.expert_count in its metadata)
    "qwen3moe": dict(rope="neox", qkv_bias=False, qk_norm=True),
    # Q, K and V in one matrix (attn_qkv), gate and up in one (ffn_up: gate rows first)
    "phi3": dict(rope="neox", qkv_bias=False, qk_norm=False, fused=True),
    # norms after attention and FFN too, embeddings scaled by sqrt(hidden), GeGLU, soft caps, sliding windows on
    # every second layer (gemma2) or on 5 of every 6 (gemma3, which has QK-norm and its own RoPE base there)
    "gemma2": dict(rope="neox", qkv_bias=False, qk_norm=False, gemma=True, swa_pattern=2, swa_default=4096),
    "gemma3": dict(rope="neox", qkv_bias=False, qk_norm=True, gemma=True, swa_pattern=6, swa_default=0),
    # biases on Q/K/V, O, the router and every expert; a learned sink logit per head; a 128-token window on even
    # layers; experts' clamped SwiGLU (swiglu_oai); the FFN's norm stored as post_attention_norm
    "gpt-oss": dict(rope="neox", qkv_bias=True, qk_norm=False, oss=True, swa_pattern=2, swa_default=128),
}
# gpt-oss's expert activation: gate clamped above at LIMIT, up to [-LIMIT, LIMIT], (up + 1) * gate * sigmoid(ALPHA gate)
OSS_ALPHA, OSS_LIMIT = 1.702, 7.0
# llama.cpp's attention scale for the 27B Gemma models (hidden / heads, not the head dim): their layer counts
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


# head dims that both the prefill and the paged attention kernels take (the engine runs both)
ENGINE_HEAD_DIMS = tuple(d for d in PAGED_HEAD_DIMS if d in PREFILL_HEAD_DIMS)


def _harmony_eos(meta: dict, eos_ids: tuple) -> tuple:
    """A harmony vocabulary (gpt-oss) ends a reply at ``<|return|>`` or a tool ``<|call|>``; its ``<|end|>`` closes one
    message of several (the reasoning), so it is no end of generation even where a file marks it as one."""
    tokens = meta.get("tokenizer.ggml.tokens") or ()
    if "<|channel|>" not in tokens or "<|message|>" not in tokens:
        return eos_ids
    marks = {t: tokens.index(t) for t in ("<|end|>", "<|return|>", "<|call|>") if t in tokens}
    out = tuple(e for e in eos_ids if e != marks.get("<|end|>"))
    return out + tuple(i for t, i in marks.items() if t != "<|end|>" and i not in out)


class ModelConfigError(ValueError):
    """GGUF metadata that does not describe a model the engine can run."""


@dataclasses.dataclass
class ModelConfig:
    arch: str
    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_eps: float
    rope_theta: float
    rope_style: str  # "interleaved" | "neox"
    context_length: int
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: str = "none"  # "none" | "linear" | "yarn" | "llama3" (llama3: factors from rope_freqs.weight)
    rope_factor: float = 1.0
    rope_orig_context: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_attn_factor: float = 1.0
    yarn_truncate: bool = True  # the ramp's ends rounded to whole dims (llama.cpp; gpt-oss's reference does not)
    bos_id: int | None = None
    eos_ids: tuple = ()
    add_bos: bool = True
    name: str = ""
    fused: bool = False  # attn_qkv and a gate/up ffn_up (phi3)
    post_norms: bool = False  # RMSNorm on the attention and FFN outputs before the residual add (gemma)
    embed_scale: float = 1.0  # embeddings multiplied by this (gemma: sqrt(hidden), rounded to the activation dtype)
    act: str = "silu"  # the gated FFN's activation: "silu" | "gelu_tanh" | "swiglu_oai" (gpt-oss's experts)
    attn_scale: float = 0.0  # softmax scale; 0: head_dim ** -0.5
    attn_softcap: float = 0.0  # scores s -> cap * tanh(s / cap) when > 0
    final_softcap: float = 0.0  # the same on the logits
    sliding_window: int = 0  # tokens a query sees on the swa layers (itself included); 0: none
    swa_layers: tuple = ()  # per layer: whether it uses the sliding window
    rope_theta_swa: float = 0.0  # the swa layers' RoPE base (gemma3: unscaled); 0: rope_theta
    n_experts: int = 0  # mixture of experts in every layer's FFN (0: a dense FFN)
    n_experts_used: int = 0  # experts per token (top-k)
    expert_ffn: int = 0  # one expert's FFN width
    expert_norm: bool = True  # the top-k router weights renormalized to sum to 1
    attn_sinks: bool = False  # a learned logit per query head in each softmax's denominator (gpt-oss)
    o_bias: bool = False  # a bias on the attention output projection (gpt-oss)
    moe_bias: bool = False  # biases on the router and on each expert's gate, up and down rows (gpt-oss)

    def window(self, layer: int) -> int:
        """paged_attention's left window edge for ``layer`` (-1: unbounded)."""
        if self.sliding_window and layer < len(self.swa_layers) and self.swa_layers[layer]:
            return self.sliding_window - 1
        return -1

    @classmethod
    def from_gguf(cls, meta: dict, tensor_names=()) -> "ModelConfig":
        arch = meta.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise ModelConfigError(f"unsupported architecture {arch!r} (general.architecture); the engine runs "
                                   f"{', '.join(ARCHITECTURES)}")

        def get(key, default=None, required=True):
            full = f"{arch}.{key}"
            if full in meta:
                return meta[full]
            if default is None and required:
                raise ModelConfigError(f"GGUF metadata lacks {full!r}, needed for a {arch} model")
            return default

        n_heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        head_dim = int(get("attention.key_length", hidden // n_heads, required=False))
        if int(get("attention.value_length", head_dim, required=False)) != head_dim:
            raise ModelConfigError(f"{arch}: key_length != value_length is not supported")
        rot = int(get("rope.dimension_count", head_dim, required=False))
        if rot != head_dim:
            raise ModelConfigError(f"{arch}: partial rotary embeddings (rope.dimension_count {rot} < head dim "
                                   f"{head_dim}) are not supported")
        n_kv = get("attention.head_count_kv", n_heads, required=False)
        if isinstance(n_kv, list):
            raise ModelConfigError(f"{arch}: per-layer kv head counts are not supported")
        vocab = get("vocab_size", 0, required=False) or len(meta.get("tokenizer.ggml.tokens", ())) or 0
        scaling = str(get("rope.scaling.type", "none", required=False))
        factor = float(get("rope.scaling.factor", 1.0, required=False) or 1.0)
        if "rope_freqs.weight" in tensor_names:
            scaling = "llama3"
        if scaling not in ("none", "linear", "yarn", "llama3"):
            raise ModelConfigError(f"{arch}: unsupported rope.scaling.type {scaling!r}")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None)
        eot = meta.get("tokenizer.ggml.eot_token_id")
        if eot is not None and int(eot) not in eos_ids:
            eos_ids += (int(eot),)
        eos_ids = _harmony_eos(meta, eos_ids)
        cfg = cls(
            arch=arch, n_layers=int(get("block_count")), hidden=hidden, ffn=int(get("feed_forward_length")),
            n_heads=n_heads, n_kv_heads=int(n_kv), head_dim=head_dim, vocab_size=int(vocab),
            rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5, required=False)),
            rope_theta=float(get("rope.freq_base", 10000.0, required=False)),
            rope_style=ARCHITECTURES[arch]["rope"],
            context_length=int(get("context_length", 4096, required=False)),
            qkv_bias=ARCHITECTURES[arch]["qkv_bias"], qk_norm=ARCHITECTURES[arch]["qk_norm"],
            rope_scaling=scaling, rope_factor=factor,
            rope_orig_context=int(get("rope.scaling.original_context_length", 0, required=False) or 0),
            yarn_beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0, required=False)),
            yarn_beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0, required=False)),
            yarn_attn_factor=float(get("rope.scaling.attn_factor", 1.0, required=False) or 1.0),
            yarn_truncate=bool(get("rope.scaling.yarn_truncate", True, required=False)),
            bos_id=meta.get("tokenizer.ggml.bos_token_id"), eos_ids=eos_ids,
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", arch in ("llama", "mistral"))),
            name=str(meta.get("general.name", "")),
        )
        spec = ARCHITECTURES[arch]
        experts = int(get("expert_count", 0, required=False) or 0)
        names = set(tensor_names)
        if experts:
            if any("shexp" in n for n in names):
                raise ModelConfigError(f"{arch}: shared experts (ffn_*_shexp tensors) are not supported yet")
            cfg.n_experts = experts
            cfg.n_experts_used = int(get("expert_used_count"))
            cfg.expert_ffn = int(get("expert_feed_forward_length", cfg.ffn, required=False))
            cfg.expert_norm = bool(get("expert_weights_norm", True, required=False))
            if not 1 <= cfg.n_experts_used <= experts:
                raise ModelConfigError(f"{arch}.expert_used_count is {cfg.n_experts_used}, expected 1..{experts}")
        elif arch == "qwen3moe":
            raise ModelConfigError("qwen3moe: GGUF metadata lacks 'qwen3moe.expert_count'")
        if any(n.endswith(("rope_factors_long.weight", "rope_factors_short.weight")) for n in names):
            raise ModelConfigError(f"{arch}: LongRoPE (rope_factors_long / rope_factors_short, the 128k-context "
                                   f"Phi-3 models) is not supported yet")
        if spec.get("fused"):
            cfg.fused = True
        if "swa_pattern" in spec:
            cfg.sliding_window = int(get("attention.sliding_window", spec["swa_default"], required=False) or 0)
            pattern = get("attention.sliding_window_pattern", spec["swa_pattern"], required=False)
            if isinstance(pattern, (list, tuple)):
                cfg.swa_layers = tuple(bool(x) for x in pattern)
            else:
                cfg.swa_layers = tuple(i % int(pattern) < int(pattern) - 1 for i in range(cfg.n_layers))
            if len(cfg.swa_layers) != cfg.n_layers:
                raise ModelConfigError(f"{arch}: attention.sliding_window_pattern has {len(cfg.swa_layers)} "
                                       f"entries for {cfg.n_layers} layers")
        if spec.get("oss"):
            if not cfg.n_experts:
                raise ModelConfigError(f"{arch}: GGUF metadata lacks '{arch}.expert_count'")
            cfg.attn_sinks = cfg.o_bias = cfg.moe_bias = True
            cfg.act = "swiglu_oai"
        if spec.get("gemma"):
            cfg.post_norms, cfg.act = True, "gelu_tanh"
            cfg.embed_scale = math.sqrt(cfg.hidden)
            cfg.attn_softcap = float(get("attn_logit_softcapping", 0.0, required=False) or 0.0)
            cfg.final_softcap = float(get("final_logit_softcapping", 0.0, required=False) or 0.0)
            cfg.rope_theta_swa = float(get("rope.freq_base_swa", 0.0, required=False) or 0.0)
            scale = get("attention.scale", None, required=False)
            if scale:
                cfg.attn_scale = float(scale)
            elif cfg.n_layers == GEMMA_27B_LAYERS[arch]:
                cfg.attn_scale = (cfg.hidden / cfg.n_heads) ** -0.5
        cfg.check_limits()
        return cfg

    def check_limits(self) -> None:
        """ModelConfigError where the engine's kernels cannot run this model (checked at load, not mid-generation)."""
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise ModelConfigError(f"head_count {self.n_heads} is not a multiple of head_count_kv {self.n_kv_heads}")
        if self.head_dim not in ENGINE_HEAD_DIMS:
            raise ModelConfigError(f"{self.arch}: head dim {self.head_dim} (attention.key_length) is not supported by "
                                   f"the attention kernels; supported: {', '.join(map(str, ENGINE_HEAD_DIMS))}")


def rope_inv_freq(cfg: ModelConfig, rope_freqs: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """float32 [head_dim / 2] angular frequencies (position p rotates pair i by p * inv_freq[i]), and the factor
    that multiplies cos and sin (YaRN's attention scaling; 1 otherwise)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    mscale = 1.0
    if cfg.rope_scaling == "linear":
        inv = inv / cfg.rope_factor
    elif cfg.rope_scaling == "llama3":
        if rope_freqs is None or rope_freqs.numel() != d // 2:
            raise ModelConfigError(f"llama3 rope scaling needs rope_freqs.weight with {d // 2} values")
        inv = inv / rope_freqs.double().reshape(-1).cpu()
    elif cfg.rope_scaling == "yarn":
        # YaRN (Peng et al. 2023): frequencies that turn fewer than beta_slow times over the original context are
        # interpolated (divided by the factor), those that turn more than beta_fast times are kept, a linear ramp
        # in between; cos/sin are scaled by 0.1 ln(factor) + 1.
        orig = cfg.rope_orig_context or cfg.context_length
        factor = cfg.rope_factor

        def dim_for(turns):
            return d * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

        lo, hi = dim_for(cfg.yarn_beta_fast), dim_for(cfg.yarn_beta_slow)
        if cfg.yarn_truncate:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, d - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(d // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
        extrapolate = 1 - ramp
        inv = (inv / factor) * (1 - extrapolate) + inv * extrapolate
        mscale = (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0) * cfg.yarn_attn_factor
    return inv.float(), float(mscale)


def llama3_rope_factors(head_dim: int, theta: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, orig_context: int) -> torch.Tensor:
    """The per-frequency divisors of Llama 3.1's rope scaling (what llama.cpp stores as rope_freqs.weight)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    wavelen = 2 * math.pi / inv
    low_wl, high_wl = orig_context / low_freq_factor, orig_context / high_freq_factor
    smooth = (orig_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    out = torch.where(wavelen < high_wl, torch.ones_like(inv),
                      torch.where(wavelen > low_wl, torch.full_like(inv, factor), 1 / ((1 - smooth) / factor + smooth)))
    return out.float()
