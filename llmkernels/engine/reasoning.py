"""Reasoning written between ``<think>`` and ``</think>`` (Qwen3, QwQ, DeepSeek-R1 and their distills), split from the
reply as the text comes.

These models write the tags as text (their tokenizers do not make them control tokens), either at the start of the
reply or, where the chat template already opened the block in the generation prompt, only the closing one.
"""
from __future__ import annotations

from .outputs import TextStream, held_back

OPEN, CLOSE = "<think>", "</think>"


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


class ThinkStream:
    """A completion's text stream (outputs.TextStream: stop strings, UTF-8) split by ThinkSplit: ``update`` returns
    the new (reasoning, reply) pieces; ``reasoning`` and ``text`` are what has been returned."""

    def __init__(self, tokenizer, prompt_ids, stops=()):
        self.raw = TextStream(tokenizer, prompt_ids, stops)
        self.split = ThinkSplit(opens_thinking(tokenizer, prompt_ids))

    def update(self, new_ids, finished: bool, stop_at: int | None = None) -> tuple:
        return self.split.feed(self.raw.update(new_ids, finished, stop_at), finished)

    @property
    def reasoning(self) -> str:
        return self.split.reasoning

    @property
    def text(self) -> str:
        return self.split.text
