"""Harmony replies written by a scripted sampler, for tests of the reply split: a random tiny model writes no harmony,
so the engine's sampler is replaced by one that hands out a fixed token sequence."""
import torch

from llmkernels.engine import llm as llm_module

OSS = dict(layers=2, hidden=256, ffn=256, heads=4, kv_heads=2, head_dim=64)  # the tiny gpt-oss of these tests


def reply(tok, parts) -> list:
    """Token ids of a harmony reply: strings are encoded, marker names ("<|end|>") become their ids."""
    ids = []
    for p in parts:
        ids += [tok.special_id(p)] if p.startswith("<|") and p.endswith("|>") else tok.encode(p, add_bos=False)
    return ids


def script_sampler(monkeypatch, script) -> list:
    """Make every sampled token the next one of ``script`` (cycling; one request at a time). Returns the list of
    tokens handed out so far: clear it to start the script again."""
    made = []

    def scripted(logits, params, generators, greedy=None):
        made.append(script[len(made) % len(script)])
        return torch.tensor([made[-1]] * logits.shape[0])

    monkeypatch.setattr(llm_module, "sample_tokens", scripted)
    return made
