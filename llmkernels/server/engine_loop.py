"""One thread owns the engine and steps it continuously; HTTP handlers talk to it through queues.

Handlers (on the asyncio event loop) submit requests and aborts as commands; the engine thread applies them between
steps, runs ``LLM.step``, and after each step hands every request its new token ids, log-probabilities and finish
state in one call into the event loop. Detokenization and JSON happen on the event loop, off the engine's critical
path: with decode steps launched ahead (``LLM.step``), the engine thread spends most of a step waiting on the GPU
with the GIL released, which is when the event loop runs.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time

log = logging.getLogger("llmkernels.server")


@dataclasses.dataclass
class Delta:
    """What one completion gained in one step."""
    index: int  # completion index within the request (0 .. n-1)
    token_ids: list
    logprobs: list | None
    finish_reason: str | None
    stop_at: int | None


class QueueFull(Exception):
    pass


class EngineDead(Exception):
    pass


class RequestHandle:
    """A request in the engine, seen from the event loop: ``async for deltas in handle`` yields lists of Delta."""

    def __init__(self, prompt_ids: list, params):
        self.prompt_ids = prompt_ids
        self.params = params
        self.queue: asyncio.Queue = asyncio.Queue()
        self.seq = None  # the engine's first Sequence (set on the engine thread)
        self.sent: list = []  # tokens delivered per completion (engine thread)
        self.finished = False  # every completion's last delta has been delivered (event loop)
        self.open = params.n  # completions whose last delta has not been delivered (event loop)
        self.error: Exception | None = None
        self.arrival = time.perf_counter()
        self.first_token: float | None = None
        self.num_cached_tokens = 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.finished and self.queue.empty():
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, Exception):
            self.finished = True
            raise item
        return item


class EngineLoop:
    """Runs ``llm.step()`` on a thread of its own while requests are in flight."""

    def __init__(self, llm, max_queue: int = 256, on_step=None):
        self.llm = llm
        self.max_queue = max_queue
        self.on_step = on_step  # called on the engine thread after each step (metrics)
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._active: dict = {}  # handle -> None, engine thread only
        self._stop = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.num_requests = 0  # requests submitted and not yet finished (event loop only)
        self.dead: BaseException | None = None

    # --- event-loop side ------------------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="llmkernels-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    def submit(self, prompt_ids: list, params) -> RequestHandle:
        if not self.alive:
            raise EngineDead(f"the engine has stopped: {self.dead!r}")
        if self.num_requests >= self.llm.scheduler.max_num_seqs + self.max_queue:
            raise QueueFull()
        h = RequestHandle(prompt_ids, params)
        self.num_requests += 1
        self._cmds.put(("add", h))
        self._wake.set()
        return h

    def abort(self, h: RequestHandle) -> None:
        if not h.finished:
            self._cmds.put(("abort", h))
            self._wake.set()

    def _deliver(self, batch) -> None:
        for h, item in batch:
            if h.finished:
                continue
            if isinstance(item, Exception):
                h.finished = True
                self.num_requests -= 1
                h.queue.put_nowait(item)
                continue
            if h.first_token is None and any(d.token_ids for d in item):
                h.first_token = time.perf_counter()
            h.queue.put_nowait(item)
            h.open -= sum(d.finish_reason is not None for d in item)
            if h.open == 0:  # from the deltas, not the engine's live state: the engine thread is ahead of them
                h.finished = True
                self.num_requests -= 1

    # --- engine thread --------------------------------------------------------------------------------------------
    def _apply(self) -> tuple[list, bool]:
        """Apply queued commands; returns (errors to deliver, whether any request was added or aborted)."""
        out, changed = [], False
        while True:
            try:
                kind, h = self._cmds.get_nowait()
            except queue.Empty:
                return out, changed
            changed = True
            if kind == "add":
                try:
                    h.seq = self.llm.add_request(h.prompt_ids, h.params)
                    h.sent = [0] * len(h.seq.group)
                    self._active[h] = None
                except Exception as e:  # noqa: BLE001  (validated before submit; still never lose a request)
                    out.append((h, e))
            elif h in self._active:
                self.llm.abort(h.seq)

    def _collect(self) -> list:
        """Each active request's new tokens and finish states since the last call."""
        out, done = [], []
        for h in self._active:
            deltas = []
            for s in h.seq.group:
                k = h.sent[s.request_index]
                if k < 0:  # finished and delivered
                    continue
                new = s.out_ids[k:]
                if new or s.finish_reason is not None:
                    lps = s.logprobs[k:] if s.logprobs is not None else None
                    deltas.append(Delta(s.request_index, new, lps, s.finish_reason, s.stop_at))
                    h.sent[s.request_index] = -1 if s.finish_reason is not None else k + len(new)
            if deltas:
                h.num_cached_tokens = h.seq.num_cached_tokens
                out.append((h, deltas))
            if all(s.finish_reason is not None for s in h.seq.group):
                done.append(h)
        for h in done:
            del self._active[h]
        return out

    def _run(self) -> None:
        llm = self.llm
        try:
            while not self._stop:
                self._wake.clear()  # before reading the commands, so one submitted after this read still wakes us
                out, changed = self._apply()
                busy = llm.scheduler.has_work()
                if busy:
                    try:
                        llm.step()
                    except Exception as e:  # noqa: BLE001  (fail the requests in flight, keep serving)
                        log.exception("engine step failed; failing the requests in flight")
                        out += self._fail_all(e)
                    if self.on_step is not None:
                        self.on_step()
                if busy or changed:
                    out += self._collect()
                if out:
                    self._loop.call_soon_threadsafe(self._deliver, out)
                if not busy and not changed:
                    self._wake.wait(0.05)
        except BaseException as e:  # noqa: BLE001
            self.dead = e
            log.exception("the engine thread died")
            try:
                self._loop.call_soon_threadsafe(self._deliver, self._fail_all(e))
            except Exception:  # noqa: BLE001
                pass

    def _fail_all(self, e: BaseException) -> list:
        out = []
        for h in list(self._active):
            try:
                self.llm.abort(h.seq)
            except Exception:  # noqa: BLE001
                pass
            out.append((h, RuntimeError(f"the engine failed: {type(e).__name__}: {e}")))
        self._active.clear()
        self.llm._ahead = None
        return out
