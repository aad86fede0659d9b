"""Tiny random Hugging Face checkpoints (Llama, Mistral, Qwen2, Qwen3) with trained BPE tokenizers, for engine tests.

Needs ``transformers`` and ``tokenizers``; nothing is downloaded: the tokenizer is trained on a built-in text.
"""
from __future__ import annotations

import json
import os

import torch

CORPUS = """The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in fixed-size pages.
A scheduler batches requests continuously: sequences join and leave between steps. 12345 67890 3.14159 2026-11-22.
Quantized weights are read once per token; the bandwidth of the memory sets the speed of decoding.
def forward(x): return x * 2  # code, too!  Ünïcödé wörds, émigré café, 東京 and ☃ snowmen.
Hello, world! How are you today? I'm fine, thanks. We'll see; they've gone, it's late, you'd know.
"""

# a small chat template in the style of the ones Hugging Face tokenizers ship (role headers, EOS after each turn)
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + '\\n' + m['content'] + eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' + '\\n' }}{% endif %}")

# gpt-oss's harmony format: role headers, channels, <|end|> after each message, <|return|> after the reply
HARMONY_SPECIALS = ("<|bos|>", "<|eos|>", "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>",
                    "<|call|>", "<|constrain|>")
HARMONY_TEMPLATE = ("{% if reasoning_effort is defined %}{{ '<|start|>system<|message|>Reasoning: ' + reasoning_effort"
                    " + '<|end|>' }}{% endif %}{% if tools %}{{ '<|start|>developer<|message|>Tools: ' + (tools | "
                    "map(attribute='function') | map(attribute='name') | join(',')) + '<|end|>' }}{% endif %}"
                    "{% for m in messages %}{% if m.tool_calls %}{{ '<|start|>assistant to=functions.' + "
                    "m.tool_calls[0].function.name + '<|channel|>commentary json<|message|>' + "
                    "(m.tool_calls[0].function.arguments | tojson) + '<|call|>' }}{% elif m.role == 'tool' %}"
                    "{{ '<|start|>functions.' + m.name + ' to=assistant<|channel|>commentary<|message|>' + m.content"
                    " + '<|end|>' }}{% else %}{{ '<|start|>' + m['role'] + '<|message|>' + m['content'] + '<|end|>' }}"
                    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}")

PATTERNS = {"llama3": "llama-bpe", "qwen2": "qwen2", "gpt2": "gpt-2"}


def train_tokenizer(style: str = "llama3", vocab_size: int = 384, specials=("<|bos|>", "<|eos|>")):
    """A byte-level BPE tokenizer trained on CORPUS, split like Llama 3 ("llama3"), Qwen2, GPT-4o ("gpt4o") or
    GPT-2."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from ..engine.tokenizer import GPT4O_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN

    tok = Tokenizer(models.BPE())
    if style == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        pat = {"llama3": LLAMA3_PATTERN, "qwen2": QWEN2_PATTERN, "gpt4o": GPT4O_PATTERN}[style]
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pat), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS] * 4, trainer)
    return tok


def make_checkpoint(path, arch: str = "llama", *, layers: int = 2, hidden: int = 256, ffn: int = 512,
                    heads: int = 4, kv_heads: int = 2, head_dim: int = 64, vocab: int = 512, std: float = 0.15,
                    seed: int = 0, tie: bool = False, rope_scaling: dict | None = None, tokenizer_style=None,
                    experts: int = 5, top_k: int = 2):
    """Write a random ``arch`` model (llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3, and the mixture-of-experts
    qwen3moe, mixtral and gpt_oss, with ``experts`` experts of width ``ffn``, ``top_k`` per token) with its tokenizer
    into directory ``path``. The Gemma models get an 8-token sliding window and small soft caps, so that both act on test
    prompts; gemma3's second layer is global.

    Returns the transformers model (float32, eval mode). ``std`` sets the embedding and output init: larger than
    usual so the next-token distribution is peaked and greedy choices are far from ties; the projections have unit
    gain (std 1/sqrt(fan_in)).
    """
    import transformers

    os.makedirs(path, exist_ok=True)
    style = tokenizer_style or ("qwen2" if arch.startswith("qwen") else "gpt4o" if arch == "gpt_oss" else "llama3")
    harmony = arch == "gpt_oss"
    tok = train_tokenizer(style, vocab_size=min(vocab - 16, 384), **(dict(specials=HARMONY_SPECIALS) if harmony else {}))
    tok.save(os.path.join(path, "tokenizer.json"))
    eos_text = "<|return|>" if harmony else "<|eos|>"
    bos, eos = tok.token_to_id("<|bos|>"), tok.token_to_id(eos_text)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|bos|>", "eos_token": eos_text, "add_bos_token": arch in ("llama", "mistral"),
                   "chat_template": HARMONY_TEMPLATE if harmony else CHAT_TEMPLATE}, f)
    cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
           "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
           "phi3": ("Phi3Config", "Phi3ForCausalLM"), "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
           "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"), "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
           "mixtral": ("MixtralConfig", "MixtralForCausalLM"), "gpt_oss": ("GptOssConfig", "GptOssForCausalLM")}[arch]
    kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
              max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=tie,
              bos_token_id=bos, eos_token_id=eos, initializer_range=std)
    if arch in ("mistral", "mixtral"):
        kw["sliding_window"] = None
    if arch == "qwen3moe":
        kw.update(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=ffn, norm_topk_prob=True,
                  decoder_sparse_step=1, mlp_only_layers=[])
    if arch in ("mixtral", "gpt_oss"):
        kw.update(num_local_experts=experts, num_experts_per_tok=top_k)
    if arch == "gpt_oss":  # its YaRN (factor 32, unrounded ramp), sinks and biases; an 8-token window on even layers
        kw.update(sliding_window=8, attention_bias=True)
    if arch == "qwen2":
        kw["use_sliding_window"] = False
    if arch not in ("gemma3", "gpt_oss"):  # gemma3 keeps its two bases (1e6 global, 1e4 sliding), gpt-oss 150000
        kw["rope_theta"] = 10000.0
    if arch == "phi3":
        kw["pad_token_id"] = eos
    if arch.startswith("gemma"):
        kw.update(query_pre_attn_scalar=head_dim, sliding_window=8, pad_token_id=eos)
        if arch == "gemma2":
            kw.update(attn_logit_softcapping=10.0, final_logit_softcapping=15.0)
        else:
            kw["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if rope_scaling is not None:
        kw["rope_scaling"] = rope_scaling
    config = getattr(transformers, cls[0])(**kw)
    config._attn_implementation = "eager"  # SDPA drops Gemma 2's attention soft cap: the reference must not
    torch.manual_seed(seed)
    model = getattr(transformers, cls[1])(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(std * torch.randn_like(p))
            else:  # unit gain per projection, so quantization errors do not grow from layer to layer
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)  # (fused experts: [E, N, K])
    model.save_pretrained(path, safe_serialization=True)
    return model


def hf_model_from_state_dict(path, state_dict):
    """The transformers model of checkpoint directory ``path`` with ``state_dict`` loaded (float32, eval)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    missing, unexpected = model.load_state_dict(_fuse_experts(model, state_dict), strict=False)
    missing = [m for m in missing if not m.endswith("rotary_emb.inv_freq")
               and not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"state dict mismatch: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return model


def _fuse_experts(model, state_dict) -> dict:
    """A checkpoint's per-expert matrices (mlp.experts.E.{gate,up,down}_proj or Mixtral's block_sparse_moe.experts.E.
    {w1,w3,w2}) as the fused parameters transformers keeps in memory (experts.gate_up_proj [E, 2F, H] with gate
    rows first, experts.down_proj [E, H, F])."""
    sd = dict(state_dict)
    for name, p in model.named_parameters():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")) or name in sd:
            continue
        layer = name.split(".")[2]

        def take(e, qwen, mixtral):
            for key in (f"model.layers.{layer}.mlp.experts.{e}.{qwen}.weight",
                        f"model.layers.{layer}.block_sparse_moe.experts.{e}.{mixtral}.weight"):
                if key in sd:
                    return sd.pop(key)
            raise KeyError(f"expert {e} of layer {layer}: no {qwen} / {mixtral} matrix in the state dict")

        E = p.shape[0]
        if name.endswith("gate_up_proj"):
            sd[name] = torch.stack([torch.cat([take(e, "gate_proj", "w1"), take(e, "up_proj", "w3")])
                                    for e in range(E)])
        else:
            sd[name] = torch.stack([take(e, "down_proj", "w2") for e in range(E)])
        router = f"model.layers.{layer}.block_sparse_moe.gate.weight"
        if router in sd:
            sd[f"model.layers.{layer}.mlp.gate.weight"] = sd.pop(router)
    return sd
