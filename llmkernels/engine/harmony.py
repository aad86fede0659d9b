"""OpenAI's harmony format (gpt-oss), split into reasoning and reply as the tokens come.

A harmony reply is a run of messages, each ``<|start|>{header}<|message|>{body}`` closed by ``<|end|>``, ``<|return|>``
(the reply's last) or ``<|call|>`` (a tool call). The header names the channel (``<|channel|>analysis``,
``commentary`` or ``final``) and may name a recipient (`` to=functions.f``) and a ``<|constrain|>`` type. The chat
prompt ends with ``<|start|>assistant``, so a completion opens inside a header (or inside a message's body, where a
template writes ``<|channel|>final<|message|>`` after it). The markers are special tokens, so
they are found by id, never by matching text the model wrote.
"""
from __future__ import annotations

import re

from .outputs import Detokenizer, held_back, stop_cut

MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
REASONING, TEXT, CALL = 0, 1, 2  # what a message's body is
_RECIPIENT = re.compile(r"to=([^\s<]+)")


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
    holding back text that may begin a stop string; ``reasoning`` and ``text`` are what has been returned. A message
    with a recipient (``to=functions.f``) is a tool call: ``tool_calls`` lists them as (name, arguments) and
    ``call_pieces`` hands out their new argument text.

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
        self._calls = 0  # tool calls before any stop string
        self._call_sent: list = []  # arguments characters handed out per call
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
            self._open_header()
            self.mode, self.header = "body", []
        else:
            self.header, self.prompt_head = tail, len(tail)

    def _open(self, kind: int, name: str = "") -> Detokenizer:
        d = Detokenizer(self.tok)
        self.segments.append([kind, d, False, name])
        return d

    def _header_kind(self) -> tuple | None:
        """(kind, tool name) of the message the header just read opens; None where it names no channel and no
        recipient."""
        head = self.tok.decode(self.header, skip_special_tokens=False)
        to = _RECIPIENT.search(head)
        if to is not None:
            name = to.group(1)
            return CALL, name[len("functions."):] if name.startswith("functions.") else name
        at = head.find(self.channel_text)
        if at < 0:
            return None
        name = head[at + len(self.channel_text):].split("<|", 1)[0].split()
        return (REASONING if name and name[0] == "analysis" else TEXT), ""

    def _open_header(self) -> None:
        self._open(*(self._header_kind() or (TEXT, "")))

    def _header_as_text(self) -> None:
        """A header that ends with no channel named is text outside the format: the reply's."""
        mine = self.header[self.prompt_head:]
        if mine and self._header_kind() is None:
            self._open(TEXT).push(mine)
            self._end_segment()
        self.header, self.prompt_head = [], 0

    def _end_segment(self) -> None:
        if self.segments and not self.segments[-1][2]:
            self.segments[-1][1].flush()
            self.segments[-1][2] = True

    def _push(self, t: int) -> None:
        if self.mode == "header":
            if t == self.message:
                self._open_header()
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
            self._open(TEXT).push([t])
            self.mode = "body"

    def _visible(self, finished: bool) -> list:
        """[reasoning, reply] text that may be returned now."""
        out = ["", ""]
        self._calls = 0
        for i, (kind, d, done, _) in enumerate(self.segments):
            if kind == CALL:  # arguments are no text for stop strings
                self._calls += 1
                continue
            text = d.text
            cut = stop_cut(text, self.stops) if self.stops else None
            if cut is not None:
                out[kind] += text[:cut]
                self.stopped = True
                break
            if not (done or finished) and i == len(self.segments) - 1 and self.stops:
                text = text[:len(text) - held_back(text, self.stops)]
            out[kind] += text
        return out

    def update(self, new_ids, finished: bool, stop_at: int | None = None) -> tuple:
        """``stop_at`` (where the engine cut the raw text) is not needed: stop strings are found per message."""
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
    def tool_calls(self) -> list:
        """[(name, arguments)] of the tool calls so far (the last one's arguments may still grow)."""
        calls = [seg for seg in self.segments if seg[0] == CALL][:self._calls]
        return [(name, d.text) for _, d, _, name in calls]

    def call_pieces(self) -> list:
        """[(index, name or None, arguments piece)] of what the tool calls gained since the last call: the name
        with a call's first piece, None after."""
        out = []
        for i, (name, args) in enumerate(self.tool_calls):
            if i == len(self._call_sent):
                self._call_sent.append(0)
                out.append((i, name, args))
            elif len(args) > self._call_sent[i]:
                out.append((i, None, args[self._call_sent[i]:]))
            self._call_sent[i] = len(args)
        return out

    @property
    def reasoning(self) -> str:
        return self._vis[0][:self.sent[0]]

    @property
    def text(self) -> str:
        return self._vis[1][:self.sent[1]]
