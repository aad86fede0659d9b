"""An OpenAI-compatible HTTP server over the engine: ``python -m llmkernels serve model.gguf``.

>>> from llmkernels.server import build_app
>>> app = build_app(LLM("model.gguf"), model_name="model")      # a FastAPI app; serve it with uvicorn
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("llmkernels.server")


def _require_server_deps() -> None:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ImportError(f"the server needs FastAPI, uvicorn and prometheus-client ({e.name} is missing): "
                          f"pip install 'llmkernels[serve]'") from e


def build_app(llm, *, model_name: str, api_key: str | None = None, max_queue: int = 256):
    """The FastAPI app serving ``llm`` (an ``engine.LLM``) under ``model_name``."""
    _require_server_deps()
    from .app import Server

    return Server(llm, model_name=model_name, api_key=api_key, max_queue=max_queue).app


def warm_up(llm) -> None:
    """Compile the kernels and capture the decode graphs before the first request, so that no client waits while
    Triton compiles a kernel variant the engine meets for the first time (each costs seconds and stalls every
    request in flight): decode graphs for every batch size, prefill chunks of several lengths mixed with decodes,
    and short extends over cached prefixes."""
    import random

    from ..engine import SamplingParams

    llm.capture_graphs()
    rng = random.Random(0)
    top = llm.max_model_len - 8
    lens = sorted({n for n in (1, 5, 16, 48, 100, 300, 1000, llm.scheduler.max_tokens, 2 * llm.scheduler.max_tokens + 5)
                   if n <= top})
    prompts = [[rng.randrange(llm.cfg.vocab_size) for _ in range(n)] for n in lens]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts, params)  # mixed steps: prompt chunks beside decodes
    for p in prompts:  # one at a time, then again with a cached prefix and a few new tokens
        for tail in ([], [1, 2, 3], list(range(40))):
            if len(p) + len(tail) <= top:
                llm.generate([p + tail], params)
    llm.pool.reset_cache()


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          served_model_name: str | None = None, chat_template: str | None = None, max_queue: int = 256,
          log_level: str = "info", **llm_kw) -> None:
    """Load ``model`` (a GGUF path), warm it up and serve it until interrupted. ``llm_kw`` go to ``LLM``."""
    _require_server_deps()
    import uvicorn

    from ..engine import LLM

    template = None
    if chat_template is not None:
        with open(chat_template, encoding="utf-8") as f:
            template = f.read()
    llm = LLM(model, chat_template=template, **llm_kw)
    if chat_template is None and not getattr(llm.tokenizer, "chat_template", None):
        log.warning("the model file has no chat template: /v1/chat/completions uses ChatML (--chat-template FILE "
                    "sets one)")
    llm.chat_template  # compile it now: a broken template fails at start, not at the first chat request
    warm_up(llm)
    name = served_model_name or os.path.splitext(os.path.basename(model))[0]
    app = build_app(llm, model_name=name, api_key=api_key, max_queue=max_queue)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
