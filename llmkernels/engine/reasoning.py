"""Reasoning written between ``<think>`` and ``</think>`` (Qwen3, QwQ, DeepSeek-R1 and their distills), and tool calls
written as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (Qwen2.5, Qwen3, Hermes), split from the reply
as the text comes.

These models write the tags as text (their tokenizers do not make them control tokens). A think block opens the
reply, or the chat template opened it in the generation prompt and only the closing tag comes.
"""
from __future__ import annotations

import json

from .outputs import TextStream, held_back

OPEN, CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


def writes_tool_calls(template_source: str | None) -> bool:
    """Whether a chat template is one of a model that writes ``<tool_call>`` blocks."""
    return bool(template_source) and CALL_OPEN in template_source


def thinks(template_source: str | None) -> bool:
    """Whether a chat template is one of a model that reasons in ``<think>`` blocks."""
    return bool(template_source) and CLOSE in template_source


def opens_thinking(tokenizer, prompt_ids) -> bool:
    """Whether the prompt ends inside an open ``<think>`` block (the template opened it for the reply)."""
    tail = tokenizer.decode(list(prompt_ids)[-8:], skip_special_tokens=False).rstrip()
    return tail.endswith(OPEN)


class ThinkSplit:
    """Splits text fed in pieces into reasoning (inside the first ``<think>`` block, which must open the reply) and
    reply (the rest). ``feed`` returns the new (reasoning, reply) pieces; whitespace around the reasoning and before
    the reply is dropped, and text that may begin a tag is held back until it is known."""

    def __init__(self, inside: bool = False):
        self.mode = "open" if inside else "start"  # start | open (skip whitespace) | think | after | text
        self.buf = ""
        self.reasoning, self.text = "", ""

    def feed(self, piece: str, final: bool) -> tuple:
        self.buf += piece
        r = t = ""
        while True:
            if self.mode == "start":
                head = self.buf.lstrip()
                if head.startswith(OPEN):
                    self.buf, self.mode = head[len(OPEN):], "open"
                elif OPEN.startswith(head) and not final:
                    break  # may still become the tag
                else:
                    self.mode = "text"
            elif self.mode in ("open", "after"):
                self.buf = self.buf.lstrip()
                if not self.buf and not final:
                    break
                self.mode = "think" if self.mode == "open" else "text"
            elif self.mode == "think":
                at = self.buf.find(CLOSE)
                if at >= 0:
                    r += self.buf[:at].rstrip()
                    self.buf, self.mode = self.buf[at + len(CLOSE):], "after"
                    continue
                # hold back what may begin the closing tag and the whitespace before it (dropped if it comes)
                end = len(self.buf) if final else len(self.buf[:len(self.buf) - held_back(self.buf, (CLOSE,))].rstrip())
                r += self.buf[:end]
                self.buf = self.buf[end:]
                break
            else:
                t += self.buf
                self.buf = ""
                break
        self.reasoning += r
        self.text += t
        return r, t


class CallSplit:
    """Takes ``<tool_call>`` blocks out of reply text fed in pieces: ``feed`` returns the text outside them (holding
    back what may begin a block); ``tool_calls`` lists the blocks read, as (name, arguments JSON). A block that is
    not a JSON object with a string "name" stays in the text, so nothing the model wrote is lost."""

    def __init__(self):
        self.buf, self.inside = "", False
        self.tool_calls: list = []
        self.text = ""

    def _block(self, body: str) -> bool:
        try:
            call = json.loads(body)
        except ValueError:
            return False
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return False
        args = call.get("arguments", call.get("parameters", {}))
        self.tool_calls.append((call["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
        return True

    def feed(self, piece: str, final: bool) -> str:
        self.buf += piece
        out = ""
        while True:
            if not self.inside:
                at = self.buf.find(CALL_OPEN)
                if at < 0:
                    # hold back what may begin a block and the whitespace before it (dropped if one comes)
                    end = len(self.buf) if final else \
                        len(self.buf[:len(self.buf) - held_back(self.buf, (CALL_OPEN,))].rstrip())
                    out, self.buf = out + self.buf[:end], self.buf[end:]
                    break
                out, self.buf, self.inside = out + self.buf[:at].rstrip(), self.buf[at + len(CALL_OPEN):], True
            else:
                at = self.buf.find(CALL_CLOSE)
                if at < 0 and not final:
                    break
                body = self.buf[:at] if at >= 0 else self.buf
                call = self._block(body.strip())
                if not call:  # not a call after all: the model's text, tags included
                    out += CALL_OPEN + body + (CALL_CLOSE if at >= 0 else "")
                rest = self.buf[at + len(CALL_CLOSE):] if at >= 0 else ""
                self.buf = rest.lstrip() if call else rest
                self.inside = False
                if at < 0:
                    break
        self.text += out
        return out


class ThinkStream:
    """A completion's text stream (outputs.TextStream: stop strings, UTF-8) split by ThinkSplit and, with ``calls``,
    CallSplit: ``update`` returns the new (reasoning, reply) pieces; ``reasoning``, ``text`` and ``tool_calls``
    are what has been returned; ``call_pieces`` hands out each new call once, whole."""

    def __init__(self, tokenizer, prompt_ids, stops=(), calls: bool = False):
        self.raw = TextStream(tokenizer, prompt_ids, stops)
        self.split = ThinkSplit(opens_thinking(tokenizer, prompt_ids))
        self.calls = CallSplit() if calls else None
        self._handed = 0

    def update(self, new_ids, finished: bool, stop_at: int | None = None) -> tuple:
        r, t = self.split.feed(self.raw.update(new_ids, finished, stop_at), finished)
        return r, (self.calls.feed(t, finished) if self.calls is not None else t)

    @property
    def reasoning(self) -> str:
        return self.split.reasoning

    @property
    def text(self) -> str:
        return self.calls.text if self.calls is not None else self.split.text

    @property
    def tool_calls(self) -> list:
        return self.calls.tool_calls if self.calls is not None else []

    def call_pieces(self) -> list:
        """[(index, name, arguments)] of the calls read since the last call."""
        new = self.tool_calls[self._handed:]
        out = [(self._handed + i, name, args) for i, (name, args) in enumerate(new)]
        self._handed += len(new)
        return out
