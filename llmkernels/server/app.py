"""The OpenAI-compatible HTTP API (FastAPI) over one engine.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as server-sent events
or not), ``GET /health`` and ``GET /metrics``. Errors are OpenAI's error JSON; a request is validated (body, model
name, prompt length) before anything is scheduled, and a client that goes away cancels its request.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.chat import ChatTemplateError
from ..engine.harmony import HarmonyStream
from ..engine.reasoning import ThinkStream
from ..engine.outputs import TextStream
from .engine_loop import EngineDead, EngineLoop, QueueFull
from .metrics import Metrics
from .protocol import APIError, ChatCompletionRequest, CompletionRequest

log = logging.getLogger("llmkernels.server")

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks whether its client is still there


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request body", None
    e = errs[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    if e.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg', ''))}", None
    if not loc and isinstance(e.get("input"), (bytes, str)):
        return "the request body must be a JSON object sent as Content-Type: application/json", None
    param = ".".join(loc) or None
    return f"{param or 'body'}: {e.get('msg', 'invalid value')} (got {e.get('input')!r:.100})", param


class Server:
    """The app's state: the engine loop, the model's name, the tokenizer, metrics and the API key."""

    def __init__(self, llm, *, model_name: str, api_key: str | None = None, max_queue: int = 256):
        self.llm = llm
        self.tok = llm.tokenizer
        self.tool_calls_as = llm.tool_calls_as  # "harmony", "tags" (<tool_call> blocks) or None: tools refused
        self.model_name = model_name
        self.api_key = api_key
        self.metrics = Metrics(llm)
        self.engine = EngineLoop(llm, max_queue=max_queue, on_step=self.metrics.on_step)
        self.created = int(time.time())
        self.app = self._build()

    # --- helpers --------------------------------------------------------------------------------------------------
    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist. This server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def _prompt_ids(self, prompt, param="prompt") -> list:
        try:
            return self.llm.encode_prompt(prompt)
        except (ValueError, TypeError) as e:
            if "max_model_len" in str(e):
                raise APIError(400, f"This model's maximum context length is {self.llm.max_model_len} tokens "
                                    f"(prompt and completion together); {e}", param=param,
                               code="context_length_exceeded") from e
            raise APIError(400, str(e), param=param) from e

    def _max_tokens(self, ids: list, asked: int | None) -> int:
        room = self.llm.max_model_len - len(ids)
        if asked is None:
            return room
        if asked > room:
            raise APIError(400, f"This model's maximum context length is {self.llm.max_model_len} tokens. However, "
                                f"you requested {len(ids) + asked} tokens ({len(ids)} in the prompt, {asked} for the "
                                f"completion). Please reduce the prompt or max_tokens.", param="max_tokens",
                           code="context_length_exceeded")
        return asked

    def _submit(self, ids, params):
        try:
            return self.engine.submit(ids, params)
        except QueueFull:
            raise APIError(503, "the server is at capacity (request queue full); retry later", code="overloaded",
                           headers={"Retry-After": "1"}) from None
        except EngineDead as e:
            raise APIError(500, str(e)) from None

    def _token_str(self, t: int) -> str:
        """A token as text; a token that is part of a UTF-8 character reads as its bytes ("bytes:\\xe6"), as
        OpenAI's API writes them, so distinct tokens stay distinct keys of top_logprobs."""
        if self.tok is None:
            return str(t)
        s = self.tok.piece(t)
        if "\ufffd" in s:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in self.tok.token_bytes(t))
        return s

    def _completion_logprobs(self, d, offset: int) -> dict:
        toks = [self._token_str(t) for t in d.token_ids]
        offsets, o = [], offset
        for s in toks:
            offsets.append(o)
            o += len(s)
        return {"tokens": toks, "token_logprobs": [lp for lp, _ in d.logprobs],
                "top_logprobs": [{self._token_str(t): v for t, v in top} for _, top in d.logprobs],
                "text_offset": offsets}

    def _token_entry(self, t: int, lp: float) -> dict:
        b = self.tok.token_bytes(t) if self.tok is not None else str(t).encode()
        return {"token": self._token_str(t), "logprob": lp, "bytes": list(b)}

    def _chat_logprobs(self, d) -> list:
        return [{**self._token_entry(t, lp), "top_logprobs": [self._token_entry(a, v) for a, v in top]}
                for t, (lp, top) in zip(d.token_ids, d.logprobs)]

    @staticmethod
    def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    # --- generation -----------------------------------------------------------------------------------------------
    async def _drain(self, request: Request, handles: list):
        """Yield (prompt index, [Delta]) from every handle as steps deliver them; aborts what is left on exit."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i, h):
            try:
                async for deltas in h:
                    merged.put_nowait((i, deltas))
            except Exception as e:  # noqa: BLE001
                merged.put_nowait((i, e))
            merged.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
        open_ = len(handles)
        try:
            while open_:
                try:
                    i, item = await asyncio.wait_for(merged.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                if item is None:
                    open_ -= 1
                elif isinstance(item, Exception):
                    raise APIError(500, str(item))
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            for h in handles:
                if not h.finished:
                    self.engine.abort(h)
                    self.metrics.requests.labels("abort").inc()

    def _record(self, handles, states) -> None:
        now = time.perf_counter()
        for h in handles:
            n_out = sum(len(s.token_ids) for s in states if s.handle is h)
            self.metrics.request_done(h, now, n_out, [s.finish_reason for s in states if s.handle is h])

    async def _generate(self, request: Request, body, prompts: list, params_of, chat: bool):
        try:  # every prompt's parameters are checked before any is scheduled
            params = [params_of(ids) for ids in prompts]
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)) from e
        handles, states = [], []
        try:
            for ids, p in zip(prompts, params):
                h = self._submit(ids, p)
                handles.append(h)
                for j in range(p.n):
                    text = (self.llm.reply_stream(ids, p.stop) if chat else None) or TextStream(self.tok, ids, p.stop)
                    states.append(_Choice(len(states), h, j, text, chat))
        except APIError:
            for h in handles:
                self.engine.abort(h)
            raise
        by_key = {(id(s.handle), s.sub): s for s in states}
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if body.stream:
            return StreamingResponse(self._stream(request, body, handles, by_key, states, rid, created, chat),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        async for pi, deltas in self._drain(request, handles):
            for d in deltas:
                s = by_key[(id(handles[pi]), d.index)]
                s.add(d, self)
                s.call_deltas()  # gives each tool call its id
        if any(not h.finished for h in handles):  # the client went away
            return Response(status_code=499)
        self._record(handles, states)
        choices = []
        for s in states:
            lp = None
            if s.logprobs is not None:
                lp = {"content": s.logprobs} if chat else s.logprobs
            if chat:
                msg = {"role": "assistant", "content": s.text}
                if s.split:
                    msg["reasoning_content"] = s.stream.reasoning or None
                    if s.stream.tool_calls:
                        msg["tool_calls"] = [{"id": cid, "type": "function", "function": {"name": n, "arguments": a}}
                                             for cid, (n, a) in zip(s.call_ids, s.stream.tool_calls)]
                        msg["content"] = s.text or None
                choices.append({"index": s.index, "message": msg, "logprobs": lp, "finish_reason": s.finish_reason})
            else:
                choices.append({"index": s.index, "text": s.text, "logprobs": lp, "finish_reason": s.finish_reason})
        usage = self._usage(sum(len(h.prompt_ids) for h in handles), sum(len(s.token_ids) for s in states),
                            sum(h.num_cached_tokens for h in handles))
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": created, "model": self.model_name, "choices": choices, "usage": usage})

    async def _stream(self, request, body, handles, by_key, states, rid, created, chat):
        obj = "chat.completion.chunk" if chat else "text_completion"
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(choices, usage=None):
            c = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": choices}
            if include_usage:
                c["usage"] = usage
            return f"data: {json.dumps(c, ensure_ascii=False)}\n\n"

        try:
            if chat:  # the role comes first, as OpenAI's stream does
                yield chunk([{"index": s.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for s in states])
            async for pi, deltas in self._drain(request, handles):
                out = []
                for d in deltas:
                    s = by_key[(id(handles[pi]), d.index)]
                    piece, lp, thought = s.add(d, self)
                    calls = s.call_deltas()
                    if not piece and not thought and not calls and lp is None and s.finish_reason is None:
                        continue
                    if chat:
                        delta = {"reasoning_content": thought} if thought else {}
                        if piece:
                            delta["content"] = piece
                        if calls:
                            delta["tool_calls"] = calls
                        out.append({"index": s.index, "delta": delta,
                                    "logprobs": {"content": lp} if lp is not None else None,
                                    "finish_reason": s.finish_reason})
                    else:
                        out.append({"index": s.index, "text": piece, "logprobs": lp,
                                    "finish_reason": s.finish_reason})
                if out:
                    yield chunk(out)
            if all(h.finished for h in handles):
                self._record(handles, states)
                if include_usage:
                    yield chunk([], self._usage(sum(len(h.prompt_ids) for h in handles),
                                                sum(len(s.token_ids) for s in states),
                                                sum(h.num_cached_tokens for h in handles)))
            yield "data: [DONE]\n\n"
        except APIError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
            yield "data: [DONE]\n\n"

    # --- the app --------------------------------------------------------------------------------------------------
    def _build(self) -> FastAPI:
        server = self

        @contextlib.asynccontextmanager
        async def lifespan(app):
            server.engine.start(asyncio.get_running_loop())
            try:
                yield
            finally:
                server.engine.stop()

        app = FastAPI(title="llmkernels", docs_url=None, redoc_url=None, lifespan=lifespan)

        @app.exception_handler(APIError)
        async def _api_error(request, e: APIError):
            return _error_response(e)

        @app.exception_handler(RequestValidationError)
        async def _invalid(request, exc: RequestValidationError):
            msg, param = _validation_message(exc)
            return _error_response(APIError(400, msg, param=param))

        @app.exception_handler(StarletteHTTPException)
        async def _http(request, exc: StarletteHTTPException):
            return _error_response(APIError(exc.status_code, str(exc.detail),
                                            type="invalid_request_error" if exc.status_code < 500 else None))

        @app.exception_handler(Exception)
        async def _crash(request, exc: Exception):
            log.exception("unhandled error")
            return _error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

        if server.api_key is not None:
            app.add_middleware(_APIKey, key=server.api_key)

        @app.get("/health")
        async def health():
            if not server.engine.alive:
                return _error_response(APIError(500, f"the engine has stopped: {server.engine.dead!r}"))
            return {"status": "ok"}

        @app.get("/metrics")
        async def metrics():
            data, ctype = server.metrics.render(server.engine.num_requests)
            return Response(data, media_type=ctype)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                                "owned_by": "llmkernels", "max_model_len": server.llm.max_model_len}]}

        @app.get("/v1/models/{name:path}")
        async def model(name: str):
            server._check_model(name)
            return {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "llmkernels"}

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request):
            server._check_model(body.model)
            body.check_unsupported()
            prompts = [server._prompt_ids(p) for p in body.prompts()]
            return await server._generate(
                request, body, prompts,
                lambda ids: body.sampling_params(server._max_tokens(ids, body.max_tokens), body.logprobs), chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(body: ChatCompletionRequest, request: Request):
            server._check_model(body.model)
            body.check_unsupported(tools_ok=server.tool_calls_as is not None)
            msgs = [m.model_dump(exclude_none=True) for m in body.messages]
            try:
                ids = server.llm.chat_prompt(msgs, body.add_generation_prompt, body.template_variables())
            except ChatTemplateError as e:
                raise APIError(400, str(e), param="messages") from e
            ids = server._prompt_ids(ids, "messages")
            return await server._generate(
                request, body, [ids],
                lambda ids: body.sampling_params(server._max_tokens(ids, body.wanted_max_tokens()),
                                                 body.wanted_logprobs()), chat=True)

        return app


class _APIKey:
    """Every ``/v1`` route answers 401 without ``Authorization: Bearer KEY`` (plain ASGI: Starlette's
    BaseHTTPMiddleware would end streaming responses early)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            token = auth[7:] if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.key):
                err = APIError(401, "Incorrect or missing API key (send it as 'Authorization: Bearer KEY').",
                               code="invalid_api_key")
                await _error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Choice:
    """One choice of a response being built: its text stream, tokens and log-probabilities."""

    def __init__(self, index: int, handle, sub: int, text, chat: bool):
        self.index, self.handle, self.sub, self.stream, self.chat = index, handle, sub, text, chat
        self.split = isinstance(text, (HarmonyStream, ThinkStream))  # its pieces come as (reasoning, reply)
        self.call_ids: list = []  # the tool calls' ids, one per call as it starts
        self.token_ids: list = []
        self.logprobs = None  # chat: [{token, logprob, bytes, top_logprobs}]; completions: {tokens, ...}
        self.finish_reason = None

    @property
    def text(self) -> str:
        return self.stream.text

    def add(self, d, server: Server):
        """Take a Delta; returns (new text piece, this delta's log-probabilities in the response's shape or None,
        new reasoning piece)."""
        thought = ""
        if self.split:
            thought, piece = self.stream.update(d.token_ids, d.finish_reason is not None, d.stop_at)
        else:
            piece = self.stream.update(d.token_ids, d.finish_reason is not None, d.stop_at)
        offset = len(self.stream.text) - len(piece)
        self.token_ids += d.token_ids
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason if d.finish_reason != "abort" else None
            if self.split and self.finish_reason == "stop" and self.stream.tool_calls:
                self.finish_reason = "tool_calls"
        lp = None
        if d.logprobs is not None:
            if self.chat:
                lp = server._chat_logprobs(d)
                self.logprobs = (self.logprobs or []) + lp
            else:
                lp = server._completion_logprobs(d, offset)
                if self.logprobs is None:
                    self.logprobs = {k: [] for k in lp}
                for k, v in lp.items():
                    self.logprobs[k] += v
        return piece, lp, thought

    def call_deltas(self) -> list:
        """The stream's tool-call deltas since the last call (OpenAI's shape: id, type and name with the first)."""
        if not self.split:
            return []
        out = []
        for i, name, args in self.stream.call_pieces():
            if name is not None:
                self.call_ids.append("call_" + uuid.uuid4().hex[:24])
                out.append({"index": i, "id": self.call_ids[i], "type": "function",
                            "function": {"name": name, "arguments": args}})
            else:
                out.append({"index": i, "function": {"arguments": args}})
        return out
