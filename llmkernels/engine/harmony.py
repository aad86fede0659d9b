"""OpenAI's harmony format (gpt-oss), split into reasoning and reply as the tokens come.

A harmony reply is a run of messages, each ``<|start|>{header}<|message|>{body}`` closed by ``<|end|>``, ``<|return|>``
(the reply's last) or ``<|call|>`` (a tool call). The header names the channel (``<|channel|>analysis``,
``commentary`` or ``final``) and may name a recipient (`` to=functions.f``) and a ``<|constrain|>`` type. The chat
prompt ends with ``<|start|>assistant``, so a completion opens inside a header (or inside a message's body, where a
template writes ``<|channel|>final<|message|>`` after it). The markers are special tokens, so
they are found by id, never by matching text the model wrote.
"""
from __future__ import annotations

from .outputs import Detokenizer, held_back, stop_cut

MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")


def harmony_ids(tokenizer) -> dict | None:
    """The ids of the harmony markers (keys as MARKERS) if ``tokenizer`` has them all as special tokens, else None."""
    find = getattr(tokenizer, "special_id", None)
    if find is None:
        return None
    ids = {m: find(m) for m in MARKERS}
    return ids if None not in ids.values() else None


class HarmonyStream:
    """One harmony completion's reasoning (the analysis channel) and reply (every other channel: final, and
    commentary such as preambles) as its tokens arrive. ``update`` returns the new (reasoning, reply) pieces, each
    holding back text that may begin a stop string; ``reasoning`` and ``text`` are what has been returned.

    Stop strings cut the message they occur in, and later messages are dropped (the engine stopped at that
    message). Tokens outside any message header and body (a model that ignores the format) count as reply text.
    ``prompt_ids``: the prompt, whose last ``<|start|>`` says where the completion begins (a header by default)."""

    def __init__(self, tokenizer, ids: dict, stops=(), prompt_ids=()):
        self.tok, self.stops = tokenizer, tuple(stops)
        self.start, self.message = ids["<|start|>"], ids["<|message|>"]
        self.close = {ids["<|end|>"], ids["<|return|>"], ids["<|call|>"]}
        self.channel_text = "<|channel|>"
        self.mode = "header"
        self.header: list = []
        self.prompt_head = 0  # leading header tokens that came with the prompt
        self.segments: list = []  # [is_reasoning, Detokenizer, done]
        self.sent = [0, 0]  # characters returned: reasoning, reply
        self.stopped = False
        self._vis = ["", ""]
        self._resume(list(prompt_ids))

    def _resume(self, prompt: list) -> None:
        """Start where the prompt leaves off: inside the header (or the body) that its last ``<|start|>`` opened."""
        starts = [i for i, t in enumerate(prompt) if t == self.start]
        if not starts:
            return
        tail = prompt[starts[-1] + 1:]
        if any(t in self.close for t in tail):
            self.mode = "between"
        elif self.message in tail:
            self.header = tail[:tail.index(self.message)]
            self._open(bool(self._channel_is_reasoning()))
            self.mode, self.header = "body", []
        else:
            self.header, self.prompt_head = tail, len(tail)

    def _open(self, reasoning: bool) -> Detokenizer:
        d = Detokenizer(self.tok)
        self.segments.append([reasoning, d, False])
        return d

    def _channel_is_reasoning(self) -> bool | None:
        """Whether the header just read opens an analysis message (None: it names no channel)."""
        head = self.tok.decode(self.header, skip_special_tokens=False)
        at = head.find(self.channel_text)
        if at < 0:
            return None
        name = head[at + len(self.channel_text):].split("<|", 1)[0].split()
        return bool(name) and name[0] == "analysis"

    def _header_as_text(self) -> None:
        """A header that ends with no channel named is text outside the format: the reply's."""
        mine = self.header[self.prompt_head:]
        if mine and self._channel_is_reasoning() is None:
            self._open(False).push(mine)
            self._end_segment()
        self.header, self.prompt_head = [], 0

    def _end_segment(self) -> None:
        if self.segments and not self.segments[-1][2]:
            self.segments[-1][1].flush()
            self.segments[-1][2] = True

    def _push(self, t: int) -> None:
        if self.mode == "header":
            if t == self.message:
                self._open(bool(self._channel_is_reasoning()))
                self.mode, self.header = "body", []
            elif t in self.close:
                self._header_as_text()
                self.mode, self.header, self.prompt_head = "between", [], 0
            else:
                self.header.append(t)
        elif self.mode == "body":
            if t in self.close or t == self.start:
                self._end_segment()
                self.mode, self.header, self.prompt_head = ("header" if t == self.start else "between"), [], 0
            else:
                self.segments[-1][1].push([t])
        elif t == self.start:  # between messages
            self.mode, self.header, self.prompt_head = "header", [], 0
        elif t not in self.close:  # text outside the format: part of the reply
            self._open(False).push([t])
            self.mode = "body"

    def _visible(self, finished: bool) -> list:
        """[reasoning, reply] text that may be returned now."""
        out = ["", ""]
        for i, (reasoning, d, done) in enumerate(self.segments):
            text = d.text
            cut = stop_cut(text, self.stops) if self.stops else None
            if cut is not None:
                out[0 if reasoning else 1] += text[:cut]
                self.stopped = True
                break
            if not (done or finished) and i == len(self.segments) - 1 and self.stops:
                text = text[:len(text) - held_back(text, self.stops)]
            out[0 if reasoning else 1] += text
        return out

    def update(self, new_ids, finished: bool) -> tuple:
        if not self.stopped:
            for t in new_ids:
                self._push(int(t))
            if finished:
                if self.mode == "header":
                    self._header_as_text()
                self._end_segment()
        vis = self._visible(finished)
        pieces = []
        for k in (0, 1):
            pieces.append(vis[k][self.sent[k]:] if len(vis[k]) > self.sent[k] else "")
            self.sent[k] = max(self.sent[k], len(vis[k]))
        self._vis = vis
        return tuple(pieces)

    @property
    def reasoning(self) -> str:
        return self._vis[0][:self.sent[0]]

    @property
    def text(self) -> str:
        return self._vis[1][:self.sent[1]]
