"""Chat templates: the GGUF's ``tokenizer.chat_template`` (a Jinja2 template, as Hugging Face tokenizers ship them)
rendered in a sandbox, so a template from a downloaded file cannot reach the process.

Templates see what Hugging Face's ``apply_chat_template`` gives them: ``messages``, ``add_generation_prompt``,
``bos_token``, ``eos_token``, ``raise_exception``, ``strftime_now`` and a ``tojson`` filter. A model file without a
template gets ChatML (``<|im_start|>role ... <|im_end|>``), which is what llama.cpp's server falls back to.
"""
from __future__ import annotations

import datetime
import json

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

ROLES = ("system", "developer", "user", "assistant", "tool")
RESERVED = ("messages", "add_generation_prompt", "bos_token", "eos_token", "raise_exception", "strftime_now")


class ChatTemplateError(ValueError):
    """A chat template that does not compile or render, or messages it cannot take."""


def _raise(msg):
    raise ChatTemplateError(f"the chat template refused the messages: {msg}")


def normalize_messages(messages) -> list:
    """Messages as plain {"role", "content": str} dicts; OpenAI's list-of-parts content is joined (text parts only).
    Raises ChatTemplateError naming what is wrong."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatTemplateError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.80}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ChatTemplateError(f"messages[{i}] must be a dict with a 'role', got {m!r:.80}")
        if m["role"] not in ROLES:
            raise ChatTemplateError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m['role']!r}")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ChatTemplateError(f"messages[{i}].content[{j}]: only text parts are supported, got "
                                            f"{part!r:.80}")
                parts.append(part["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise ChatTemplateError(f"messages[{i}].content must be a string or a list of text parts, got "
                                    f"{type(content).__name__}")
        msg = {**m, "role": m["role"], "content": content}
        if m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], i)
        out.append(msg)
    return out


def _tool_calls(calls, i: int) -> list:
    """An assistant message's tool calls with their JSON-string arguments (as OpenAI's API carries them) parsed
    into objects, which is what templates render (a string would be encoded twice)."""
    if not isinstance(calls, list):
        raise ChatTemplateError(f"messages[{i}].tool_calls must be a list, got {type(calls).__name__}")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatTemplateError(f"messages[{i}].tool_calls[{j}] must be {{'function': {{'name', 'arguments'}}}}, "
                                    f"got {c!r:.80}")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as e:
                raise ChatTemplateError(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON: {e}") from e
        out.append({**c, "function": {**fn, "arguments": args}})
    return out


class ChatTemplate:
    """A compiled chat template; ``render(messages)`` gives the prompt text."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = ""):
        try:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as e:  # pragma: no cover
            raise ImportError("chat templates need jinja2: pip install jinja2") from e
        self.source = source if source else CHATML
        self.is_default = not source
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            self._tpl = env.from_string(self.source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e}") from e
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages, add_generation_prompt: bool = True, variables: dict | None = None) -> str:
        """``variables``: more names for the template (``reasoning_effort`` for gpt-oss's, ``enable_thinking`` for
        Qwen3's), as Hugging Face's ``apply_chat_template(**kwargs)`` passes them."""
        import jinja2

        msgs = normalize_messages(messages)
        variables = dict(variables or {})
        for name in variables:
            if not isinstance(name, str) or not name.isidentifier() or name in RESERVED:
                raise ChatTemplateError(f"chat template variable names must be identifiers other than "
                                        f"{', '.join(RESERVED)}, got {name!r}")
        try:
            return self._tpl.render(**variables, messages=msgs, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.bos_token, eos_token=self.eos_token)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise ChatTemplateError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from e
