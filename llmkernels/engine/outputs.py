"""What a request gives back: completions, incremental detokenization and stop strings.

``Detokenizer`` turns a completion's token ids into text a few tokens at a time, as they come: each new piece is the
decode of a short window ending at the new tokens minus the decode of the same window without them, so its cost does
not grow with the length of the text, words that span tokens come out whole, an incomplete UTF-8 character waits
for the token that completes it, and the first generated token keeps the space that the prompt's last tokens give
it (SentencePiece vocabularies drop a leading space when decoding alone).
"""
from __future__ import annotations

import dataclasses

CONTEXT_TOKENS = 4  # prompt tokens decoded before the first output token, for its leading space


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a request: its text (cut before a stop string), token ids, why it ended and, when asked for,
    each token's log-probability with the most likely alternatives (``[(logprob, [(token id, logprob), ...])]``)."""
    index: int
    text: str
    token_ids: list
    finish_reason: str | None  # "stop" (EOS, a stop id or a stop string) | "length" (max_tokens or the model's limit)
    logprobs: list | None = None
    reasoning_content: str | None = None  # LLM.chat on a harmony model (gpt-oss): its analysis channel; text the reply
    tool_calls: list | None = None  # LLM.chat on a harmony model: [{"name", "arguments"}] of the calls it made


@dataclasses.dataclass
class RequestOutput:
    """A request's result; ``text``, ``token_ids`` and ``finish_reason`` are its first completion's."""
    prompt: str | None
    prompt_token_ids: list
    text: str
    token_ids: list
    finish_reason: str | None
    num_preemptions: int = 0
    outputs: list = dataclasses.field(default_factory=list)  # CompletionOutput, one per completion (n)
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    reasoning_content: str | None = None  # the first completion's (CompletionOutput.reasoning_content)
    tool_calls: list | None = None  # the first completion's (CompletionOutput.tool_calls)


class Detokenizer:
    """Incremental text of a completion: ``push(ids)`` returns the text those tokens add (possibly ""), ``flush()``
    what was held back; ``text`` is everything returned so far."""

    def __init__(self, tokenizer, prompt_ids=()):
        self.tok = tokenizer
        ctx = [int(t) for t in list(prompt_ids)[-CONTEXT_TOKENS:]]
        self.ids = ctx
        self.prefix = 0  # window start
        self.read = len(ctx)  # tokens whose text has been returned
        self.text = ""

    def _piece(self, final: bool) -> str:
        if self.read == len(self.ids):
            return ""
        base = self.tok.decode(self.ids[self.prefix:self.read])
        full = self.tok.decode(self.ids[self.prefix:])
        if not final and full.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for the rest
            return ""
        if not full.startswith(base):  # a decoder that rewrote the window's start: take the new tokens alone
            full = base + self.tok.decode(self.ids[self.read:])
        piece = full[len(base):]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += piece
        return piece

    def push(self, ids) -> str:
        self.ids.extend(int(t) for t in ids)
        return self._piece(final=False)

    def flush(self) -> str:
        return self._piece(final=True)


def completion_text(tokenizer, prompt_ids, out_ids) -> str:
    """The text of ``out_ids`` following ``prompt_ids``, as a Detokenizer fed them all would give."""
    if tokenizer is None:
        return ""
    d = Detokenizer(tokenizer, prompt_ids)
    d.push(out_ids)
    d.flush()
    return d.text


def stop_cut(text: str, stops) -> int | None:
    """Where ``text`` is cut for the first occurrence of any stop string, or None."""
    cuts = [i for i in (text.find(x) for x in stops) if i >= 0]
    return min(cuts) if cuts else None


def held_back(text: str, stops) -> int:
    """How many trailing characters of ``text`` could begin a stop string (a stream holds them back)."""
    keep = 0
    for x in stops:
        for n in range(min(len(x) - 1, len(text)), 0, -1):
            if text.endswith(x[:n]):
                keep = max(keep, n)
                break
    return keep


class TextStream:
    """The text of one completion as its tokens arrive, for streaming: ``update`` returns the new piece, holding back
    text that may begin a stop string and cutting at the stop the engine found (``stop_at``)."""

    def __init__(self, tokenizer, prompt_ids, stops=()):
        self.detok = Detokenizer(tokenizer, prompt_ids) if tokenizer is not None else None
        self.stops = stops
        self.sent = 0  # characters returned so far

    @property
    def text(self) -> str:
        return self.detok.text[:self.sent] if self.detok is not None else ""

    def update(self, new_ids, finished: bool, stop_at: int | None = None) -> str:
        if self.detok is None:
            return ""
        self.detok.push(new_ids)
        if finished:
            self.detok.flush()
        text = self.detok.text
        if stop_at is not None:
            text = text[:stop_at]
        elif not finished and self.stops:
            text = text[:len(text) - held_back(text, self.stops)]
        if len(text) <= self.sent:
            return ""
        piece, self.sent = text[self.sent:], len(text)
        return piece


class StopScanner:
    """Finds a completion's first stop string as its text grows (the engine's check, one per request with stops)."""

    def __init__(self, tokenizer, prompt_ids, stops):
        self.detok = Detokenizer(tokenizer, prompt_ids)
        self.stops = stops
        self.longest = max(map(len, stops))
        self.scanned = 0  # text length already searched

    def push(self, token: int) -> int | None:
        """Feed one token; returns the cut position in the text when a stop string has completed."""
        self.detok.push([token])
        text = self.detok.text
        start = max(0, self.scanned - self.longest + 1)
        cut = stop_cut(text[start:], self.stops)
        self.scanned = len(text)
        return None if cut is None else start + cut
