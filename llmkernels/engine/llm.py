"""The user-facing engine: ``LLM(path).generate(prompts, SamplingParams(...))``.

``LLM`` ties the parts together: the scheduler (``scheduler.py``, with the prefix cache of ``pages.py``) picks each
step's batch, the model runner (``runner.py``) packs and runs it, and ``step`` samples the rows that finished their
known tokens, forks the completions of an ``n > 1`` request off their shared prompt, applies stop conditions and
retires finished sequences. Text comes out through ``outputs.py``'s incremental detokenizer.
"""
from __future__ import annotations

import dataclasses
import os

import torch

from .._checks import interpreter_mode
from ..quant.gguf_io import read_gguf
from .chat import ChatTemplate
from .config import ModelConfig
from .harmony import HarmonyStream, harmony_ids
from .reasoning import CallSplit, ThinkSplit, ThinkStream, opens_thinking, thinks, writes_tool_calls
from .model import Model
from .build import build_runner, load_model
from .outputs import CompletionOutput, RequestOutput, StopScanner, TextStream, completion_text
from .pages import PagePool
from .sampler import SamplingParams, make_generator, sample_tokens, token_logprobs
from .scheduler import Scheduler, Sequence, pages_for
from .tokenizer import Tokenizer

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "EngineStats"]


@dataclasses.dataclass
class _InFlight:
    """A launched step whose tokens are still to be sampled (decode steps run one ahead: LLM.step)."""
    batch: list  # [(sequence, new tokens)]
    logits: torch.Tensor
    greedy: torch.Tensor | None  # the logits' argmax where the step computed it (ModelRunner.greedy_ids)
    greedy_host: torch.Tensor | None = None  # the same, written into pinned memory by the step (ModelRunner's)


@dataclasses.dataclass
class EngineStats:
    steps: int = 0
    graph_steps: int = 0
    prefill_tokens: int = 0  # prompt tokens computed (prefix-cache hits are not)
    decode_tokens: int = 0
    preemptions: int = 0
    ahead_steps: int = 0  # decode steps launched before the previous step's tokens were read (LLM.step)
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache


KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _kv_dtype(value):
    if value is None or isinstance(value, torch.dtype):
        if value not in (None, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"kv_cache_dtype must be fp16, bf16 or an fp8 dtype, got {value}")
        return value
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} or a torch dtype, got {value!r}")
    return KV_CACHE_DTYPES[value]


class LLM:
    """Load a GGUF model and generate text.

    Args:
        model: path to a GGUF file (llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3).
        device: "cuda" (default when available; else the CPU).
        dtype: activation dtype, bfloat16 on a GPU (float16 on the CPU).
        page_size: tokens per KV-cache page.
        num_pages: cache pages; default: as many as ``gpu_memory_utilization`` leaves room for, at most what
            ``max_num_seqs`` sequences of ``max_model_len`` tokens need.
        max_model_len: longest prompt + generation (default: the model's context length, at most 8192).
        max_num_seqs, max_num_batched_tokens: the scheduler's sequence and per-step token budgets (2048 tokens per
            step: a 512-token prompt prefills in one step; bench/NOTES.md, engine prefill budgets).
        kv_cache_dtype: "auto" (= dtype), "fp8_e4m3" / "fp8_e5m2" (scales 1.0), or a torch dtype.
        enable_prefix_caching: keep full KV pages by a hash of their tokens after their sequence ends, and start a
            request whose prompt begins with the same tokens from them (greedy outputs do not change).
        tensor_parallel_size: processes (one per GPU) to split the model over (engine.tp): rank 0 runs in this
            process, the others are started here and stopped by ``close()``. On the CPU they share it (gloo).
        cuda_graphs: capture decode steps for batch sizes 1, 2, 4, ... up to ``max_graph_batch``, and one
            sequence's prompt chunks (a cold prompt, or the rest of one whose prefix is cached) padded to 32, 64,
            ... up to 512 tokens (or max_num_batched_tokens rounded up to one of those).
        num_splits: split-KV count of paged attention; 0 lets each plan choose (graphs choose at capture, for
            max_model_len). A fixed count makes eager and graph steps compute attention identically.
        backend: "triton" runs the model on llmkernels' kernels (through Triton's interpreter on the CPU: slow, for
            kernel tests); "torch" runs a pure-torch forward with the same weights and caches (fast on the CPU, for
            tests, servers and tools on machines without a GPU); "auto" (default): triton on a GPU or with
            act_int8, else torch.
        act_int8: round the activations of the q4_0 / q8_0 / q4_k projections to int8 per block of 32 at batch 1
            and use integer dot products (gemv's act_int8, as llama.cpp does): faster decode, slightly different
            logits. For q4_k the RMSNorm kernel writes the rounded activations. Other formats and batches compute
            exactly.
        megakernel: run decode steps of up to 8 sequences as one persistent kernel over all layers
            (megakernel.engine, sm_90 GPUs, llama-family layers with every matrix in one format, bf16 activations
            and cache). None (default): where that is measured faster than the kernel-per-op step (bf16 weights, the
            batch sizes of megakernel.engine.AUTO_BATCHES, up to 8192 cached tokens); True: at every decode step of
            1-8 sequences (q4_k: one), or ValueError saying why it cannot (q4_k needs act_int8=True: its products
            take int8 activations); False: never. ``describe()`` says which runs.

    >>> llm = LLM("model.gguf")
    >>> out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    >>> print(out[0].text)
    """

    def __init__(self, model, *, device=None, dtype=None, page_size: int = 16, num_pages: int | None = None,
                 max_model_len: int | None = None, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 kv_cache_dtype="auto", enable_prefix_caching: bool = True, cuda_graphs: bool = True,
                 max_graph_batch: int = 64, gpu_memory_utilization: float = 0.9, num_splits: int = 0,
                 progress: bool = True, act_int8: bool = False, backend: str = "auto", tensor_parallel_size: int = 1,
                 chat_template: str | None = None, megakernel: bool | None = None, _model: Model | None = None,
                 _tokenizer=None):
        if device is None:
            device = "cpu" if interpreter_mode() or not torch.cuda.is_available() else "cuda"
        self.device = torch.device(device)
        on_gpu = self.device.type == "cuda"
        dtype = dtype or (torch.bfloat16 if on_gpu else torch.float16)
        if dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
        tp_size = tensor_parallel_size
        if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp_size!r}")
        if tp_size > 1 and _model is not None:
            raise ValueError("tensor_parallel_size > 1 needs a GGUF path: each rank loads its own shard")
        if tp_size > 1 and on_gpu and torch.cuda.device_count() < tp_size:
            raise ValueError(f"tensor_parallel_size={tp_size} needs {tp_size} GPUs; {torch.cuda.device_count()} "
                             f"are visible")
        kv_cache_dtype = _kv_dtype(kv_cache_dtype)
        if backend not in ("auto", "triton", "torch"):
            raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
        if backend == "auto":  # act_int8 is a kernel feature: it takes the kernels on the CPU too
            backend = getattr(_model, "backend", None) or ("triton" if on_gpu or act_int8 is True else "torch")
        for name, v in (("page_size", page_size), ("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not isinstance(enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be a bool, got {type(enable_prefix_caching).__name__}")
        if not isinstance(num_splits, int) or num_splits < 0:
            raise ValueError(f"num_splits must be an int >= 0, got {num_splits!r}")
        if not isinstance(act_int8, bool):
            raise TypeError(f"act_int8 must be a bool, got {type(act_int8).__name__}")
        if megakernel is not None and not isinstance(megakernel, bool):
            raise TypeError(f"megakernel must be None, True or False, got {type(megakernel).__name__}")
        if megakernel is True and tp_size > 1:
            raise ValueError("megakernel=True runs on one GPU; tensor_parallel_size > 1 takes the kernel-per-op step")
        if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 2):
            raise ValueError(f"max_model_len must be an int >= 2, got {max_model_len!r}")
        if act_int8 and backend == "torch":
            raise ValueError("act_int8=True needs backend='triton' (the int8 GEMV kernels); the torch backend "
                             "computes exactly")
        if num_pages is not None and (not isinstance(num_pages, int) or num_pages < 1):
            raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
        self._peers = None
        spec = dict(dtype=dtype, backend=backend, act_int8=act_int8, page_size=page_size, num_pages=num_pages,
                    max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens, kv_dtype=kv_cache_dtype, cuda_graphs=cuda_graphs,
                    max_graph_batch=max_graph_batch, gpu_memory_utilization=gpu_memory_utilization,
                    num_splits=num_splits, megakernel=megakernel)
        if _model is None:
            if not isinstance(model, (str, os.PathLike)):
                raise TypeError(f"model must be a path to a GGUF file, got {type(model).__name__}")
            f = read_gguf(model)
            shard = None
            if tp_size > 1:
                from .parallel import Peers
                from .tp import plan_shards

                from .allreduce import engine_mode

                # the checks (heads, K blocks, all-reduce mode) raise here, before any process starts
                shard = plan_shards(ModelConfig.from_gguf(f.metadata, f.keys()), tp_size, f)[0]
                spec["allreduce"] = engine_mode()
                self._peers = Peers.start(os.fspath(model), tp_size, self.device, spec)
            try:
                _model = load_model(f, self.device, spec, progress, shard)
            except BaseException:
                self.close()
                raise
            _tokenizer = Tokenizer(f.metadata) if _tokenizer is None else _tokenizer
        else:  # a model built by hand skipped from_gguf's checks
            _model.cfg.check_limits()
        self.backend = getattr(_model, "backend", "triton")
        if backend != self.backend:
            raise ValueError(f"backend {backend!r} was asked for a model built for {self.backend!r}")
        self.model = _model
        self.tokenizer = _tokenizer
        # the whole model's config (on a tensor-parallel rank the model holds its share's)
        self.cfg = getattr(self.model, "full_cfg", self.model.cfg)
        self.dtype = self.model.dtype
        self.page_size = page_size
        try:
            self.runner = build_runner(self.model, self.device, spec)
        except BaseException:
            self.close()
            raise
        self.runner.peers = self._peers
        self.max_model_len = self.runner.max_model_len
        self.kv_dtype = self.runner.kv_dtype
        self.num_pages = self.runner.num_pages
        self.pool = PagePool(self.num_pages, page_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, max_num_seqs, max_num_batched_tokens)
        self.stats = EngineStats()
        self._ahead: _InFlight | None = None
        self._tokens_host = None
        self._chat = None
        self._harmony = False  # not looked up yet
        self._chat_source = chat_template

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do on one GPU); the engine is unusable after."""
        peers, self._peers = getattr(self, "_peers", None), None
        if peers is not None:
            if getattr(self, "runner", None) is not None:
                if self.runner.device.type == "cuda":
                    torch.cuda.synchronize(self.runner.device)
                self.runner.release_graphs()
            peers.stop()
            if getattr(self, "runner", None) is not None:
                self.runner.peers = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass

    @classmethod
    def from_model(cls, model: Model, tokenizer=None, **kw) -> "LLM":
        """An engine over an already built ``Model`` (e.g. random weights for benchmarks)."""
        return cls(None, device=model.device, dtype=model.dtype, _model=model, _tokenizer=tokenizer, **kw)

    # the runner's and the pool's state, under the names the engine has always had
    kv_cache = property(lambda self: self.runner.kv_cache)
    k_caches = property(lambda self: self.runner.k_caches)
    v_caches = property(lambda self: self.runner.v_caches)
    allocator = property(lambda self: self.pool)
    use_graphs = property(lambda self: self.runner.use_graphs)

    def describe(self) -> str:
        """The engine's configuration and the step paths it takes, a few lines."""
        cfg = self.cfg
        fmts = sorted({getattr(m, "format", "?") for L in self.model.layers for m in (*L.qkv, L.wo)})
        return "\n".join([
            f"model: {cfg.arch}, {cfg.n_layers} layers, hidden {cfg.hidden}, {', '.join(fmts)} weights, "
            f"{self.backend} backend, {self.dtype} activations",
            f"KV cache: {self.num_pages} pages of {self.page_size} tokens, {self.kv_dtype}, max_model_len "
            f"{self.max_model_len}",
            f"decode steps: {self.runner.decode_path}",
            f"other steps: kernel per op{', CUDA graphs' if self.use_graphs else ', eager'}"])

    def capture_graphs(self, sizes=None, extend_sizes=None) -> None:
        """Capture CUDA graphs ahead of time (they are otherwise captured at first use): decode steps of batch
        ``sizes`` and one sequence's prompt chunks padded to ``extend_sizes`` tokens; default all of them."""
        self.runner.capture_graphs(sizes, extend_sizes)

    # --- requests -------------------------------------------------------------------------------------------------
    def encode_prompt(self, prompt) -> list:
        """Token ids of a prompt (str, or a list of ids), checked against the vocabulary and the context length."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass prompts as lists of token ids")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            ids = list(prompt)
        else:
            raise TypeError(f"a prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("a prompt must have at least one token")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.cfg.vocab_size}), got {bad[:4]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} (prompt and "
                             f"generated tokens together)")
        return ids

    def add_request(self, prompt, params: SamplingParams, index: int = 0) -> Sequence:
        """Queue a prompt; returns its first completion's Sequence (``.group`` holds all ``params.n`` of them)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        ids = self.encode_prompt(prompt)
        total = min(len(ids) + params.max_tokens, self.max_model_len)
        if pages_for(total, self.page_size) > self.num_pages:
            raise ValueError(f"a request of {total} tokens needs {pages_for(total, self.page_size)} pages; the "
                             f"cache has {self.num_pages}")
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(self.cfg.eos_ids))
        group = []
        for i in range(params.n):
            s = Sequence(list(ids), params, request_index=i, generator=make_generator(params, self.device, i),
                         stop_ids=stop_ids, logprobs=[] if params.logprobs is not None else None)
            if params.stop and self.tokenizer is not None:
                s.stop_text = StopScanner(self.tokenizer, ids, params.stop)
            group.append(s)
        for s in group:
            s.group = group
        first = group[0]
        first.forks = group[1:]  # they start from first's prompt once it is computed (scheduler.fork)
        self.scheduler.add(first)
        return first

    def abort(self, seq: Sequence) -> None:
        """Stop every completion of ``seq``'s request now and release its pages (finish_reason "abort")."""
        for s in reversed(seq.group or [seq]):
            if s.finish_reason is None:
                s.finish_reason = "abort"
                s.forks = []
                self.scheduler.finish(s)

    # --- one step -------------------------------------------------------------------------------------------------
    def _can_look_ahead(self, batch) -> bool:
        """Whether the next step can be launched before this one's tokens are known: every running sequence decodes
        in this step and, whatever it samples except a stop token, decodes again in the next one with nothing else
        scheduled (nobody waiting, no length limit reached, pages for the next slot free without preempting)."""
        if os.environ.get("LLMK_LOOKAHEAD", "1") == "0" or self.scheduler.waiting:
            return False
        if [s for s, _ in batch] != self.scheduler.running or self.scheduler.max_tokens < len(batch):
            return False
        need = 0
        for s, _ in batch:
            if len(s.out_ids) + 1 >= s.params.max_tokens or s.num_tokens + 1 >= self.max_model_len:
                return False
            need += max(0, pages_for(s.num_computed + 1, self.page_size) - len(s.pages))
        return need <= self.pool.num_free

    def _token_buffer(self, n: int) -> torch.Tensor:
        """A host buffer for n sampled ids (pinned on a GPU machine, so the copy into it is asynchronous); read
        before the next copy into it is queued."""
        if self._tokens_host is None or self._tokens_host.numel() < n:
            pin = self.device.type == "cuda"
            self._tokens_host = torch.empty(max(n, 64), dtype=torch.int64, pin_memory=pin)
        return self._tokens_host[:n]

    def _launch(self, batch, ids_dev=None) -> _InFlight:
        logits, graph = self.runner.run(self.runner.prepare(batch), ids_dev)
        self.stats.graph_steps += graph
        return _InFlight(batch, logits, self.runner.greedy_ids, self.runner.greedy_host)

    def _look_ahead(self, batch, tokens: torch.Tensor) -> None:
        """Schedule and launch the next decode step with this step's sampled ids still on the device (``tokens``);
        each sequence holds a placeholder for them until the host has read them."""
        for s, _ in batch:
            s.out_ids.append(-1)
        nxt = self.scheduler.schedule()
        if [(s, n) for s, n in nxt] != [(s, 1) for s, _ in batch]:
            raise RuntimeError("look-ahead scheduled another batch than this step's (engine bug)")
        self._ahead = self._launch(nxt, tokens)
        self.stats.ahead_steps += 1

    def _fork(self, sampled: list, logits: torch.Tensor) -> torch.Tensor:
        """Start the sibling completions of sequences whose prompt this step finished; each samples from its
        parent's logits row. Returns the logits with a row per entry of ``sampled`` (which grows)."""
        rows, copies = list(range(len(sampled))), []
        for i, s in enumerate(list(sampled)):
            forks, s.forks = s.forks, []
            for c in forks:
                r = self.scheduler.fork(s, c)
                if r is False:  # no room now: it computes its prompt itself later (mostly from the prefix cache)
                    continue
                if r is not None:
                    copies.append(r)
                sampled.append(c)
                rows.append(i)
        if copies:
            self.runner.copy_pages(copies)
        if len(rows) > logits.shape[0]:
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        return logits

    def step(self) -> list:
        """Run one scheduler step; returns the sequences that finished in it.

        Decode steps run one step ahead where the scheduler's next batch is known (see _can_look_ahead): the next
        step is launched, fed with the sampled ids on the device, before the host waits for this step's ids, so the
        GPU does not idle while the host samples, schedules and uploads. A sequence that stops (a stop token) while
        its next step is in flight has that step's result dropped. LLMK_LOOKAHEAD=0 turns this off (A/B runs)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:  # launched by the previous call
            batch, logits, greedy, greedy_host = ahead.batch, ahead.logits, ahead.greedy, ahead.greedy_host
            keep = [k for k, (s, _) in enumerate(batch) if s.finish_reason is None]
            if not keep:
                return self.step()
            if len(keep) < len(batch):
                batch = [batch[k] for k in keep]
                logits = logits.index_select(0, torch.tensor(keep, device=logits.device))
                greedy = greedy_host = None
            decode_only = True
        else:
            batch = self.scheduler.schedule()
            if not batch:
                return []
            decode_only = all(n == 1 and s.num_computed + 1 == s.num_tokens for s, n in batch)
            launched = self._launch(batch)
            logits, greedy, greedy_host = launched.logits, launched.greedy, launched.greedy_host
        self.stats.steps += 1
        sampled = [s for s, n in batch if s.num_computed + n == s.num_tokens]
        for s, n in batch:
            if n == 1 and s.out_ids and s.num_computed + 1 == s.num_tokens:
                self.stats.decode_tokens += 1
            else:  # prompt tokens, or a preempted sequence's tokens being recomputed
                self.stats.prefill_tokens += n
            s.num_computed += n
            self.scheduler.computed(s)
        self.stats.preemptions = self.scheduler.num_preemptions
        self.stats.cached_tokens = self.scheduler.cache_hits
        if not sampled:
            return []
        if any(s.forks for s in sampled):
            logits, greedy = self._fork(sampled, logits), None
        tokens = sample_tokens(logits, [s.params for s in sampled], [s.generator for s in sampled], greedy)
        lp_rows = [i for i, s in enumerate(sampled) if s.logprobs is not None]
        lps = dict(zip(lp_rows, token_logprobs(logits, tokens, lp_rows, [sampled[i].params.logprobs
                                                                         for i in lp_rows]))) if lp_rows else {}
        ahead = decode_only and len(sampled) == len(batch) and not lp_rows and self._can_look_ahead(batch)
        if ahead:
            # read the ids back through pinned memory with an event, queued before the next step: a plain .tolist()
            # would wait for everything queued on the stream, the step launched ahead included
            if tokens is greedy and greedy_host is not None:  # the step writes them there itself
                host = greedy_host
            else:
                host = self._token_buffer(len(sampled))
                host.copy_(tokens, non_blocking=True)
            done = torch.cuda.Event() if tokens.is_cuda else None
            if done is not None:
                done.record()
            self._look_ahead(batch, tokens)
            if done is not None:
                done.synchronize()
            tokens = host
        finished = []
        for i, (s, t) in enumerate(zip(sampled, tokens.tolist())):
            if ahead:
                s.out_ids[-1] = t
            else:
                s.out_ids.append(t)
            if s.logprobs is not None:
                s.logprobs.append(lps[i])
            if t in s.stop_ids:
                s.finish_reason = "stop"
            elif s.stop_text is not None and (cut := s.stop_text.push(t)) is not None:
                s.stop_at, s.finish_reason = cut, "stop"
            elif len(s.out_ids) >= s.params.max_tokens or s.num_tokens >= self.max_model_len:
                s.finish_reason = "length"
            if s.finish_reason:
                self.scheduler.finish(s)
                finished.append(s)
        return finished

    def logits(self, prompt) -> torch.Tensor:
        """float32 [len, vocab]: next-token logits at every position of ``prompt`` (str or ids), e.g. for scoring.

        Runs the prompt through the cache in chunks of ``max_num_batched_tokens``; the pages are freed after.
        """
        seq = Sequence(self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt), SamplingParams())
        if len(seq.prompt_ids) > self.max_model_len or not seq.prompt_ids:
            raise ValueError(f"prompt must have 1..{self.max_model_len} tokens, got {len(seq.prompt_ids)}")
        need = pages_for(len(seq.prompt_ids), self.page_size)
        if need > self.pool.num_free:
            raise MemoryError(f"the prompt needs {need} free pages, {self.pool.num_free} are free")
        seq.pages = self.pool.allocate(need)
        out = []
        try:
            while seq.num_computed < seq.num_tokens:
                n = min(self.scheduler.max_tokens, seq.num_tokens - seq.num_computed)
                out.append(self.runner.run(self.runner.prepare([(seq, n)], logits_all=True))[0])
                seq.num_computed += n
        finally:
            self.pool.release(seq.pages)
        return torch.cat(out)

    # --- generation -----------------------------------------------------------------------------------------------
    def completion(self, s: Sequence) -> CompletionOutput:
        """A sequence's output so far: its text is cut before a stop string."""
        text = completion_text(self.tokenizer, s.prompt_ids, s.out_ids)
        if s.stop_at is not None:
            text = text[:s.stop_at]
        return CompletionOutput(s.request_index, text, list(s.out_ids), s.finish_reason,
                                list(s.logprobs) if s.logprobs is not None else None)

    def output(self, seq: Sequence, prompt=None) -> RequestOutput:
        """The RequestOutput of the request whose first completion is ``seq``."""
        outs = [self.completion(s) for s in sorted(seq.group or [seq], key=lambda s: s.request_index)]
        first = outs[0]
        return RequestOutput(prompt if isinstance(prompt, str) else None, seq.prompt_ids, first.text,
                             first.token_ids, first.finish_reason, sum(s.num_preemptions for s in seq.group or [seq]),
                             outs, seq.num_cached_tokens)

    def generate(self, prompts, params: SamplingParams | list | None = None, *, use_tqdm: bool = False) -> list:
        """Generate for each prompt (str or token-id list); returns RequestOutputs in prompt order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        seqs = [self.add_request(p, sp, i) for i, (p, sp) in enumerate(zip(prompts, plist))]
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(seqs), desc="generating", unit="req")
        try:
            while self.scheduler.has_work():
                done = self.step()
                if bar is not None and done:
                    bar.update(sum(s.request_index == 0 for s in done))
        except BaseException:
            for s in seqs:  # an interrupted call leaves no request behind
                self.abort(s)
            self._ahead = None
            raise
        finally:
            if bar is not None:
                bar.close()
        return [self.output(s, p) for s, p in zip(seqs, prompts)]

    def stream(self, prompt, params: SamplingParams | None = None):
        """Yield text pieces of one prompt's (first) completion as tokens come (other queued requests advance too).
        Pieces never hold an incomplete UTF-8 character or text that may begin a stop string."""
        seq = self.add_request(prompt, params or SamplingParams())
        text = TextStream(self.tokenizer, seq.prompt_ids, seq.params.stop)
        sent = 0
        try:
            while True:
                if seq.finish_reason is None and self.scheduler.has_work():
                    self.step()
                new = seq.out_ids[sent:]
                sent = len(seq.out_ids)
                piece = text.update(new, seq.finish_reason is not None, seq.stop_at)
                if piece:
                    yield piece
                if seq.finish_reason is not None:
                    return
        finally:
            self.abort(seq)

    # --- chat -----------------------------------------------------------------------------------------------------
    @property
    def chat_template(self) -> ChatTemplate:
        """The model's chat template (``chat_template=`` overrides the GGUF's; ChatML when neither exists)."""
        if self._chat is None:
            tok = self.tokenizer
            src = self._chat_source or getattr(tok, "chat_template", None)
            bos = tok.token_text(tok.bos_id) if tok is not None and tok.bos_id is not None else ""
            eos = tok.token_text(tok.eos_id) if tok is not None and tok.eos_id is not None else ""
            self._chat = ChatTemplate(src, bos, eos)
        return self._chat

    def chat_prompt(self, messages, add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None) \
            -> list:
        """The token ids of ``messages`` rendered by the chat template (special tokens in the text match whole; no
        BOS is added: templates write their own). ``chat_template_kwargs``: more variables for the template, such as
        ``{"reasoning_effort": "high"}`` (gpt-oss) or ``{"enable_thinking": False}`` (Qwen3)."""
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: chat needs one")
        text = self.chat_template.render(messages, add_generation_prompt, chat_template_kwargs)
        return self.tokenizer.encode(text, add_bos=False)

    def chat(self, messages, params: SamplingParams | None = None, *, use_tqdm: bool = False,
             chat_template_kwargs: dict | None = None, tools: list | None = None) -> list:
        """Generate replies: ``messages`` is one conversation (a list of {"role", "content"} dicts) or a list of
        them; each is rendered with the chat template. Returns one RequestOutput per conversation. A harmony model's
        reply (gpt-oss) is split: ``text`` is its reply (final and commentary channels), ``reasoning_content`` its
        analysis channel, ``tool_calls`` the functions it called ([{"name", "arguments"}], arguments as the
        model wrote them). A model whose template writes ``<think>`` blocks (Qwen3, DeepSeek-R1) gets the same
        split: the block's text in ``reasoning_content``, the rest in ``text``. ``tools``: OpenAI-style function
        definitions for the template (its ``tools``)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        params = params or SamplingParams()
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise TypeError(f"tools must be a list of OpenAI-style function dicts, got {tools!r:.80}")
        variables = dict(chat_template_kwargs or {}, **({"tools": tools} if tools else {}))
        outs = self.generate([self.chat_prompt(c, True, variables) for c in convs], params, use_tqdm=use_tqdm)
        marks = self.harmony
        if marks is not None:  # a harmony reply: its analysis channel apart from the text
            for out, p in zip(outs, params if isinstance(params, list) else [params] * len(outs)):
                for c in out.outputs:
                    split = HarmonyStream(self.tokenizer, marks, p.stop, out.prompt_token_ids)
                    split.update(c.token_ids, finished=True)
                    c.text, c.reasoning_content = split.text, split.reasoning or None
                    c.tool_calls = [{"name": n, "arguments": a} for n, a in split.tool_calls] or None
                first = out.outputs[0]
                out.text, out.reasoning_content, out.tool_calls = first.text, first.reasoning_content, first.tool_calls
        elif self.thinking or self.tool_calls_as:  # a <think> block and <tool_call> blocks apart from the text
            for out in outs:
                for c in out.outputs:
                    split = ThinkSplit(opens_thinking(self.tokenizer, out.prompt_token_ids))
                    _, text = split.feed(c.text, True)
                    calls = CallSplit()
                    c.text, c.reasoning_content = calls.feed(text, True), split.reasoning or None
                    c.tool_calls = [{"name": n, "arguments": a} for n, a in calls.tool_calls] or None
                first = out.outputs[0]
                out.text, out.reasoning_content, out.tool_calls = first.text, first.reasoning_content, first.tool_calls
        return outs

    def reply_stream(self, prompt_ids, stops=()):
        """The chat reply splitter for this model (harmony.HarmonyStream or reasoning.ThinkStream: ``update`` gives
        (reasoning, text) pieces, with ``tool_calls``), or None where replies are plain text."""
        if self.harmony is not None:
            return HarmonyStream(self.tokenizer, self.harmony, stops, prompt_ids)
        if self.thinking or self.tool_calls_as:
            return ThinkStream(self.tokenizer, prompt_ids, stops, calls=self.tool_calls_as == "tags")
        return None

    @property
    def thinking(self) -> bool:
        """Whether chat replies open with a ``<think>`` block (the template is of such a model; not harmony)."""
        return self.tokenizer is not None and self.harmony is None and thinks(self.chat_template.source)

    @property
    def tool_calls_as(self) -> str | None:
        """How the model writes tool calls that chat replies read back: "harmony" (gpt-oss), "tags"
        (``<tool_call>`` JSON blocks, Qwen and Hermes templates) or None (tools are not offered)."""
        if self.harmony is not None:
            return "harmony"
        if self.tokenizer is not None and writes_tool_calls(self.chat_template.source):
            return "tags"
        return None

    @property
    def harmony(self) -> dict | None:
        """The harmony format's marker ids when the tokenizer has them (gpt-oss), else None."""
        if self._harmony is False:
            self._harmony = harmony_ids(self.tokenizer) if self.tokenizer is not None else None
        return self._harmony
