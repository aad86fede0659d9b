"""Request bodies of the OpenAI-compatible API, validated by pydantic, and their translation to SamplingParams.

Fields the engine honours are typed and range-checked; fields that OpenAI defines and the engine does not implement
are accepted at their neutral value and refused otherwise (a penalty the engine would silently ignore is a wrong
answer); unknown fields are ignored, as OpenAI's clients send new ones over time.
"""
from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..engine.sampler import MAX_LOGPROBS, SamplingParams

MAX_N = 16


class APIError(Exception):
    """An error answered with OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    user: str | None = None
    # extras that vLLM and llama.cpp's server take too
    top_k: int = Field(0, ge=-1)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return []
        v = [v] if isinstance(v, str) else v
        if any(not s for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    def check_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported by this server (got {getattr(self, name)}); leave it "
                                    f"at 0", param=name)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by this server", param="logit_bias")

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
                              seed=self.seed, max_tokens=max_tokens, stop=tuple(self.stop or ()),
                              stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                              n=self.n, logprobs=logprobs)


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list:
        """The prompts as a list of str or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if isinstance(p[0], int):
            return [p]
        return list(p)

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise APIError(400, "echo is not supported by this server", param="echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, f"best_of must equal n (got best_of={self.best_of}, n={self.n})", param="best_of")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict], None] = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list | None = None
    tool_choice: object = None
    response_format: dict | None = None
    add_generation_prompt: bool = True
    reasoning_effort: Literal["low", "medium", "high"] | None = None  # gpt-oss's template reads it
    chat_template_kwargs: dict | None = None  # more template variables (vLLM's extra), e.g. enable_thinking

    def template_variables(self) -> dict:
        out = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            out["reasoning_effort"] = self.reasoning_effort
        if self.tools and self.tool_choice != "none":
            out["tools"] = self.tools
        return out

    def check_unsupported(self, tools_ok: bool = False) -> None:
        """``tools_ok``: the model writes tool calls the server can read (harmony, ``<tool_call>`` blocks)."""
        super().check_unsupported()
        if self.tools and not tools_ok:
            raise APIError(400, "tools are supported for models whose chat template writes tool calls the server "
                                "reads (harmony: gpt-oss; <tool_call> blocks: Qwen, Hermes); this model's would "
                                "come back as text", param="tools")
        for i, t in enumerate(self.tools or ()):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) or \
                    not isinstance(fn.get("name"), str) or not fn["name"]:
                raise APIError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                                    f"'description': ..., 'parameters': ...}}}}, got {t!r:.100}", param="tools")
        if self.tool_choice not in (None, "auto", "none"):
            raise APIError(400, f"tool_choice may be 'auto' or 'none' (got {self.tool_choice!r:.60}); forcing a "
                                f"call is not supported", param="tool_choice")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise APIError(400, "response_format other than text is not supported by this server",
                           param="response_format")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")

    def wanted_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def wanted_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
