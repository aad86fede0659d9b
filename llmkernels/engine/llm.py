"""The user-facing engine: ``LLM(path).generate(prompts, SamplingParams(...))``.

Each ``step`` asks the scheduler for a batch (decode tokens and prefill chunks mixed under a token budget), builds
the step's index tensors on the host, plans paged attention once for all layers, runs the model, samples the rows
that finished their known tokens, and retires finished sequences. Pure decode steps of up to ``max_graph_batch``
sequences replay CUDA graphs captured per batch size; everything else runs eagerly.
"""
from __future__ import annotations

import dataclasses
import gc
import os

import torch

from .._checks import interpreter_mode
from ..attention.plan import plan_paged_attention
from ..quant.gguf_io import read_gguf
from .config import ModelConfig
from .model import Model, StepInputs
from .torch_model import TorchModel
from .sampler import SamplingParams, make_generator, sample_tokens
from .scheduler import PageAllocator, Scheduler, Sequence, pages_for
from .tokenizer import Tokenizer


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a request: its text (cut before a stop string), token ids and why it ended."""
    index: int
    text: str
    token_ids: list
    finish_reason: str  # "stop" (EOS, a stop id or a stop string) | "length" (max_tokens or the model's limit)


@dataclasses.dataclass
class RequestOutput:
    """A request's result; ``text``, ``token_ids`` and ``finish_reason`` are its first completion's."""
    prompt: str | None
    prompt_token_ids: list
    text: str
    token_ids: list
    finish_reason: str
    num_preemptions: int = 0
    outputs: list = dataclasses.field(default_factory=list)  # CompletionOutput


@dataclasses.dataclass
class EngineStats:
    steps: int = 0
    graph_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    ahead_steps: int = 0  # decode steps launched before the previous step's tokens were read (LLM.step)


KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _kv_dtype(value):
    if value is None or isinstance(value, torch.dtype):
        if value not in (None, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"kv_cache_dtype must be fp16, bf16 or an fp8 dtype, got {value}")
        return value
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} or a torch dtype, got {value!r}")
    return KV_CACHE_DTYPES[value]


def stop_cut(text: str, stops) -> int | None:
    """Where ``text`` is cut for the first occurrence of any stop string, or None."""
    cuts = [i for i in (text.find(x) for x in stops) if i >= 0]
    return min(cuts) if cuts else None


def held_back(text: str, stops) -> int:
    """How many trailing characters of ``text`` could begin a stop string (a stream holds them back)."""
    keep = 0
    for x in stops:
        for n in range(min(len(x) - 1, len(text)), 0, -1):
            if text.endswith(x[:n]):
                keep = max(keep, n)
                break
    return keep


class LLM:
    """Load a GGUF model and generate text.

    Args:
        model: path to a GGUF file (llama, mistral, qwen2, qwen3 architectures).
        device: "cuda" (default when available; else the CPU through Triton's interpreter, slow, for tests).
        dtype: activation dtype, bfloat16 on a GPU (float16 on the CPU).
        page_size: tokens per KV-cache page.
        num_pages: cache pages; default: as many as ``gpu_memory_utilization`` leaves room for, at most what
            ``max_num_seqs`` sequences of ``max_model_len`` tokens need.
        max_model_len: longest prompt + generation (default: the model's context length, at most 8192).
        max_num_seqs, max_num_batched_tokens: the scheduler's sequence and per-step token budgets (2048 tokens per
            step: a 512-token prompt prefills in one step; bench/NOTES.md, engine prefill budgets).
        kv_cache_dtype: "auto" (= dtype), "fp8_e4m3" / "fp8_e5m2" (scales 1.0), or a torch dtype.
        tensor_parallel_size: GPUs to split the model over; only 1 is supported yet.
        cuda_graphs: capture decode steps for batch sizes 1, 2, 4, ... up to ``max_graph_batch``.
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

    >>> llm = LLM("model.gguf")
    >>> out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    >>> print(out[0].text)
    """

    def __init__(self, model, *, device=None, dtype=None, page_size: int = 16, num_pages: int | None = None,
                 max_model_len: int | None = None, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 kv_cache_dtype="auto", cuda_graphs: bool = True, max_graph_batch: int = 64,
                 gpu_memory_utilization: float = 0.9, num_splits: int = 0, progress: bool = True,
                 act_int8: bool = False, backend: str = "auto", tensor_parallel_size: int = 1,
                 _model: Model | None = None,
                 _tokenizer=None):
        if device is None:
            device = "cpu" if interpreter_mode() or not torch.cuda.is_available() else "cuda"
        self.device = torch.device(device)
        on_gpu = self.device.type == "cuda"
        dtype = dtype or (torch.bfloat16 if on_gpu else torch.float16)
        if dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
        if tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size must be 1 (tensor parallelism is not supported yet), got "
                             f"{tensor_parallel_size!r}")
        kv_cache_dtype = _kv_dtype(kv_cache_dtype)
        if backend not in ("auto", "triton", "torch"):
            raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
        if backend == "auto":  # act_int8 is a kernel feature: it takes the kernels on the CPU too
            backend = getattr(_model, "backend", None) or ("triton" if on_gpu or act_int8 is True else "torch")
        for name, v in (("page_size", page_size), ("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if _model is None:
            if not isinstance(model, (str, os.PathLike)):
                raise TypeError(f"model must be a path to a GGUF file, got {type(model).__name__}")
            f = read_gguf(model)
            cfg = ModelConfig.from_gguf(f.metadata, f.keys())
            progress_fn = None
            if progress:
                from tqdm.auto import tqdm

                progress_fn = tqdm
            model_cls = TorchModel if backend == "torch" else Model
            _model = model_cls(cfg, f, self.device, dtype, progress=progress_fn)
            _tokenizer = Tokenizer(f.metadata) if _tokenizer is None else _tokenizer
        if not isinstance(act_int8, bool):
            raise TypeError(f"act_int8 must be a bool, got {type(act_int8).__name__}")
        self.backend = getattr(_model, "backend", "triton")
        if backend != self.backend:
            raise ValueError(f"backend {backend!r} was asked for a model built for {self.backend!r}")
        if act_int8 and self.backend == "torch":
            raise ValueError("act_int8=True needs backend='triton' (the int8 GEMV kernels); the torch backend "
                             "computes exactly")
        self.model = _model
        self.model.act_int8 = act_int8
        self.tokenizer = _tokenizer
        cfg = self.cfg = self.model.cfg
        self.dtype = self.model.dtype
        self.page_size = page_size
        self.max_model_len = int(max_model_len or min(cfg.context_length, 8192))
        self.kv_dtype = kv_cache_dtype or self.dtype
        per_page = 2 * cfg.n_layers * page_size * cfg.n_kv_heads * cfg.head_dim * torch.empty(
            0, dtype=self.kv_dtype).element_size()
        want = max_num_seqs * pages_for(self.max_model_len, page_size)
        auto = num_pages is None
        if not auto and (not isinstance(num_pages, int) or num_pages < 1):
            raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
        if auto:
            if on_gpu:
                # what an earlier LLM left for the cyclic garbage collector or the caching allocator counts as free
                gc.collect()
                torch.cuda.empty_cache()
                free, _total = torch.cuda.mem_get_info(self.device)
                reserve = 2 * 2**30 + 4 * max_num_batched_tokens * (cfg.ffn + cfg.vocab_size) * 2
                num_pages = int(max(0, free * gpu_memory_utilization - reserve) // per_page)
                num_pages = min(num_pages, want)
            else:
                num_pages = min(want, 4096)
        if auto and num_pages < pages_for(min(self.max_model_len, 16 * page_size), page_size):
            raise MemoryError(f"only {num_pages} KV-cache pages fit ({per_page} bytes each); lower max_model_len or "
                              f"free GPU memory")
        self.num_pages = num_pages
        shape = (cfg.n_layers, 2, num_pages, page_size, cfg.n_kv_heads, cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.k_caches = [self.kv_cache[i, 0] for i in range(cfg.n_layers)]
        self.v_caches = [self.kv_cache[i, 1] for i in range(cfg.n_layers)]
        self.allocator = PageAllocator(num_pages)
        self.scheduler = Scheduler(self.allocator, page_size, max_num_seqs, max_num_batched_tokens)
        self.max_pages_per_seq = pages_for(self.max_model_len, page_size)
        self.stats = EngineStats()
        self.graphs = {}
        self._ahead = None  # (batch, logits) of a step launched before the previous one's tokens were read
        self._tokens_host = None
        self.use_graphs = bool(cuda_graphs and on_gpu and self.backend == "triton")
        self.max_graph_batch = min(max_graph_batch, max_num_seqs)
        if not isinstance(num_splits, int) or num_splits < 0:
            raise ValueError(f"num_splits must be an int >= 0, got {num_splits!r}")
        self.num_splits = num_splits

    @classmethod
    def from_model(cls, model: Model, tokenizer=None, **kw) -> "LLM":
        """An engine over an already built ``Model`` (e.g. random weights for benchmarks)."""
        return cls(None, device=model.device, dtype=model.dtype, _model=model, _tokenizer=tokenizer, **kw)

    # --- requests -------------------------------------------------------------------------------------------------
    def _eos_ids(self, params: SamplingParams) -> set:
        ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            ids |= set(self.cfg.eos_ids)
        return ids

    def add_request(self, prompt, params: SamplingParams, index: int = 0) -> Sequence:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass prompts as lists of token ids")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            raise TypeError(f"a prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("a prompt must have at least one token")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.cfg.vocab_size}), got {bad[:4]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        total = min(len(ids) + params.max_tokens, self.max_model_len)
        if pages_for(total, self.page_size) > self.num_pages:
            raise ValueError(f"a request of {total} tokens needs {pages_for(total, self.page_size)} pages; the "
                             f"cache has {self.num_pages}")
        seq = Sequence(ids, params, request_index=index, generator=make_generator(params, self.device))
        self.scheduler.add(seq)
        return seq

    # --- one step -------------------------------------------------------------------------------------------------
    def _inputs(self, batch):
        ids, pos, slots, cu, lens, logits_idx, table = [], [], [], [0], [], [], []
        width = max(len(s.pages) for s, _ in batch)
        ps = self.page_size
        for s, n in batch:
            start = s.num_computed
            toks = s.tokens
            ids += toks[start:start + n]
            p = list(range(start, start + n))
            pos += p
            slots += [s.pages[i // ps] * ps + i % ps for i in p]
            cu.append(cu[-1] + n)
            lens.append(start + n)
            if start + n == s.num_tokens:
                logits_idx.append(cu[-1] - 1)
            table.append(s.pages + [0] * (width - len(s.pages)))
        return ids, pos, slots, cu, lens, logits_idx, table

    def _eager(self, host, ids_dev=None):
        ids, pos, slots, cu, lens, logits_idx, table = host
        dev = self.device
        i32 = dict(dtype=torch.int32)
        cu_h, lens_h = torch.tensor(cu, **i32), torch.tensor(lens, **i32)
        plan = plan_paged_attention(cu_h, lens_h, self.page_size, self.cfg.n_heads, self.cfg.n_kv_heads,
                                    self.cfg.head_dim, q_dtype=self.dtype, kv_dtype=self.kv_dtype,
                                    num_splits=self.num_splits, device=dev)
        ids_t = ids_dev.to(torch.int32) if ids_dev is not None else torch.tensor(ids, **i32).to(dev)
        inp = StepInputs(ids_t, torch.tensor(pos, **i32).to(dev),
                         torch.tensor(slots, dtype=torch.int64).to(dev), torch.tensor(table, **i32).to(dev),
                         lens_h.to(dev), cu_h.to(dev), max(b - a for a, b in zip(cu, cu[1:])),
                         torch.tensor(logits_idx, dtype=torch.int64).to(dev))
        return self.model.forward(inp, self.k_caches, self.v_caches, plan)

    def _run(self, batch, host, ids_dev=None):
        """Launch the forward pass of a scheduled batch; returns (logits, whether it was a decode-only step).
        ``ids_dev``: the token ids on the device (a step launched ahead), replacing host[0]."""
        decode_only = all(n == 1 and s.num_computed + 1 == s.num_tokens for s, n in batch)
        if decode_only and self.use_graphs and len(batch) <= self.max_graph_batch:
            self.stats.graph_steps += 1
            return self._graph_step(host, ids_dev), True
        return self._eager(host, ids_dev), decode_only

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
        return need <= self.allocator.num_free

    def _token_buffer(self, n: int) -> torch.Tensor:
        """A host buffer for n sampled ids (pinned on a GPU machine, so the copy into it is asynchronous); read
        before the next copy into it is queued."""
        if self._tokens_host is None or self._tokens_host.numel() < n:
            pin = self.device.type == "cuda"
            self._tokens_host = torch.empty(max(n, 64), dtype=torch.int64, pin_memory=pin)
        return self._tokens_host[:n]

    def _look_ahead(self, batch, tokens: torch.Tensor) -> None:
        """Schedule and launch the next decode step with this step's sampled ids still on the device (``tokens``);
        each sequence holds a placeholder for them until the host has read them."""
        for s, _ in batch:
            s.out_ids.append(-1)
        nxt = self.scheduler.schedule()
        if [(s, n) for s, n in nxt] != [(s, 1) for s, _ in batch]:
            raise RuntimeError("look-ahead scheduled another batch than this step's (engine bug)")
        logits, _ = self._run(nxt, self._inputs(nxt), ids_dev=tokens)
        self._ahead = (nxt, logits)
        self.stats.ahead_steps += 1

    def step(self) -> list:
        """Run one scheduler step; returns the sequences that finished in it.

        Decode steps run one step ahead where the scheduler's next batch is known (see _can_look_ahead): the next
        step is launched, fed with the sampled ids on the device, before the host waits for this step's ids, so the
        GPU does not idle while the host samples, schedules and uploads. A sequence that stops (a stop token) while
        its next step is in flight has that step's result dropped. LLMK_LOOKAHEAD=0 turns this off (A/B runs)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:  # launched by the previous call
            batch, logits = ahead
            keep = [k for k, (s, _) in enumerate(batch) if s.finish_reason is None]
            if not keep:
                return self.step()
            if len(keep) < len(batch):
                batch = [batch[k] for k in keep]
                logits = logits.index_select(0, torch.tensor(keep, device=logits.device))
            decode_only = True
        else:
            batch = self.scheduler.schedule()
            if not batch:
                return []
            logits, decode_only = self._run(batch, self._inputs(batch))
        self.stats.steps += 1
        sampled = [s for s, n in batch if s.num_computed + n == s.num_tokens]
        for s, n in batch:
            if n == 1 and s.out_ids and s.num_computed + 1 == s.num_tokens:
                self.stats.decode_tokens += 1
            else:  # prompt tokens, or a preempted sequence's tokens being recomputed
                self.stats.prefill_tokens += n
            s.num_computed += n
        finished = []
        if sampled:
            tokens = sample_tokens(logits, [s.params for s in sampled], [s.generator for s in sampled])
            ahead = decode_only and len(sampled) == len(batch) and self._can_look_ahead(batch)
            if ahead:
                # read the ids back through pinned memory with an event, queued before the next step: a plain
                # .tolist() would wait for everything queued on the stream, the step launched ahead included
                host = self._token_buffer(len(sampled))
                host.copy_(tokens, non_blocking=True)
                done = torch.cuda.Event() if tokens.is_cuda else None
                if done is not None:
                    done.record()
                self._look_ahead(batch, tokens)
                if done is not None:
                    done.synchronize()
                tokens = host
            for s, t in zip(sampled, tokens.tolist()):
                if ahead:
                    s.out_ids[-1] = t
                else:
                    s.out_ids.append(t)
                if t in self._eos_ids(s.params):
                    s.finish_reason = "stop"
                elif s.params.stop and self._stop_string(s):
                    s.finish_reason = "stop"
                elif len(s.out_ids) >= s.params.max_tokens or s.num_tokens >= self.max_model_len:
                    s.finish_reason = "length"
                if s.finish_reason:
                    self.scheduler.finish(s)
                    finished.append(s)
        self.stats.preemptions = self.scheduler.num_preemptions
        return finished

    def _stop_string(self, s: Sequence) -> bool:
        """Whether the text so far holds one of the request's stop strings (searched from a few characters before
        the newest token's text, so a string spanning tokens is found once, where it completes)."""
        if self.tokenizer is None:
            return False
        text = self.tokenizer.decode(s.out_ids)
        start = max(0, s.stop_scan - max(map(len, s.params.stop)))
        cut = stop_cut(text[start:], s.params.stop)
        if cut is not None:
            s.stop_at = start + cut
            return True
        s.stop_scan = len(text)
        return False

    # --- CUDA graphs for decode -----------------------------------------------------------------------------------
    def _graph_for(self, bs: int):
        g = self.graphs.get(bs)
        if g is None:
            g = self.graphs[bs] = _DecodeGraph(self, bs)
        return g

    def _graph_step(self, host, ids_dev=None):
        bs = min(1 << (len(host[0]) - 1).bit_length(), self.max_graph_batch)
        return self._graph_for(bs).run(host, ids_dev)

    def capture_graphs(self, sizes=None) -> None:
        """Capture decode graphs ahead of time (they are otherwise captured at first use)."""
        if not self.use_graphs:
            return
        sizes = sizes or [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b <= self.max_graph_batch]
        for bs in sizes:
            self._graph_for(bs)

    def logits(self, prompt) -> torch.Tensor:
        """float32 [len, vocab]: next-token logits at every position of ``prompt`` (str or ids), e.g. for scoring.

        Runs the prompt through the cache in chunks of ``max_num_batched_tokens``; the pages are freed after.
        """
        seq = Sequence(self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt), SamplingParams())
        if len(seq.prompt_ids) > self.max_model_len or not seq.prompt_ids:
            raise ValueError(f"prompt must have 1..{self.max_model_len} tokens, got {len(seq.prompt_ids)}")
        need = pages_for(len(seq.prompt_ids), self.page_size)
        if need > self.allocator.num_free:
            raise MemoryError(f"the prompt needs {need} free pages, {self.allocator.num_free} are free")
        seq.pages = self.allocator.allocate(need)
        out = []
        try:
            while seq.num_computed < seq.num_tokens:
                n = min(self.scheduler.max_tokens, seq.num_tokens - seq.num_computed)
                ids, pos, slots, cu, lens, _, table = self._inputs([(seq, n)])
                out.append(self._eager((ids, pos, slots, cu, lens, list(range(n)), table)))
                seq.num_computed += n
        finally:
            self.allocator.free(seq.pages)
        return torch.cat(out)

    # --- generation -----------------------------------------------------------------------------------------------
    def _text(self, s: Sequence) -> str:
        text = self.tokenizer.decode(s.out_ids) if self.tokenizer is not None else ""
        return text[:s.stop_at] if s.stop_at is not None else text

    def _output(self, s: Sequence, prompt) -> RequestOutput:
        text = self._text(s)
        first = CompletionOutput(0, text, list(s.out_ids), s.finish_reason)
        return RequestOutput(prompt if isinstance(prompt, str) else None, s.prompt_ids, text, list(s.out_ids),
                             s.finish_reason, s.num_preemptions, [first])

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
        while self.scheduler.has_work():
            done = self.step()
            if bar is not None and done:
                bar.update(len(done))
        if bar is not None:
            bar.close()
        return [self._output(s, p) for s, p in zip(seqs, prompts)]

    def stream(self, prompt, params: SamplingParams | None = None):
        """Yield text pieces of one prompt's generation as tokens come (other queued requests advance too)."""
        seq = self.add_request(prompt, params or SamplingParams())
        sent, shown = 0, ""
        while seq.finish_reason is None and self.scheduler.has_work():
            self.step()
            if len(seq.out_ids) > sent:
                sent = len(seq.out_ids)
                text = self._text(seq)
                # hold back an incomplete UTF-8 character until the token that completes it, and text that may be
                # the start of a stop string until it is known not to be
                if text.endswith("\ufffd") and seq.finish_reason is None:
                    continue
                if seq.finish_reason is None and seq.params.stop:
                    text = text[:len(text) - held_back(text, seq.params.stop)]
                if len(text) > len(shown) and text.startswith(shown):
                    yield text[len(shown):]
                shown = text


class _DecodeGraph:
    """A CUDA graph of one decode step for a fixed batch size, fed through fixed buffers.

    A decode batch of ``bs`` sequences always has the same attention tiles (one per sequence), so the plan made at
    capture stays valid; each step only uploads token ids, positions, kv lengths, page tables (one int32 copy) and
    cache slots (one int64 copy) from pinned host buffers.
    """

    def __init__(self, llm: LLM, bs: int):
        cfg, dev = llm.cfg, llm.device
        self.llm, self.bs = llm, bs
        P = self.P = llm.max_pages_per_seq
        # two sets of pinned input buffers, used in turn: with look-ahead a step is filled while the previous one's
        # upload may still be queued (the one before that has been read: its tokens were synchronised on)
        self.host32s = [torch.zeros(3 * bs + bs * P, dtype=torch.int32).pin_memory() for _ in range(2)]
        self.host64s = [torch.full((bs,), -1, dtype=torch.int64).pin_memory() for _ in range(2)]
        self.turn = 0
        self.dev32 = torch.zeros(3 * bs + bs * P, dtype=torch.int32, device=dev)
        self.ids, self.pos, self.lens = self.dev32[:bs], self.dev32[bs:2 * bs], self.dev32[2 * bs:3 * bs]
        self.table = self.dev32[3 * bs:].view(bs, P)
        self.lens.fill_(1)
        self.slots = torch.full((bs,), -1, dtype=torch.int64, device=dev)
        self.cu = torch.arange(bs + 1, dtype=torch.int32, device=dev)
        self.idx = torch.arange(bs, dtype=torch.int64, device=dev)
        # split-KV is fixed at capture: plan for the longest sequences the engine allows
        cu_h = torch.arange(bs + 1, dtype=torch.int32)
        self.plan = plan_paged_attention(cu_h, torch.full((bs,), llm.max_model_len, dtype=torch.int32),
                                         llm.page_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                                         q_dtype=llm.dtype, kv_dtype=llm.kv_dtype, max_tiles=bs, max_tokens=bs,
                                         num_splits=llm.num_splits, device=dev)
        self.inp = StepInputs(self.ids, self.pos, self.slots, self.table, self.lens, self.cu, 1, self.idx)
        fwd = lambda: llm.model.forward(self.inp, llm.k_caches, llm.v_caches, self.plan)  # noqa: E731
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            for _ in range(2):  # compile and warm up outside the capture
                fwd()
        torch.cuda.current_stream(dev).wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        # captured on the warm-up stream: the split-K GEMVs' arrival counters (one buffer per stream) exist by now
        with torch.cuda.graph(self.graph, stream=s):
            self.logits = fwd()

    def run(self, host, ids_dev=None):
        ids, pos, slots, cu, lens, logits_idx, table = host
        n, bs, P = len(ids), self.bs, self.P
        self.turn ^= 1
        host32, host64 = self.host32s[self.turn], self.host64s[self.turn]
        h = host32.numpy()
        h[:] = 0
        h[:n], h[bs:bs + n] = ids, pos
        h[2 * bs:3 * bs] = 1  # padding rows: one key at page 0, outputs unused
        h[2 * bs:2 * bs + n] = lens
        h[3 * bs:].reshape(bs, P)[:n, :len(table[0])] = table
        h64 = host64.numpy()
        h64[:] = -1  # padding rows store nothing
        h64[:n] = slots
        self.dev32.copy_(host32, non_blocking=True)
        self.slots.copy_(host64, non_blocking=True)
        if ids_dev is not None:  # sampled by the previous step, still on the device
            self.ids[:n].copy_(ids_dev)
        self.graph.replay()
        return self.logits[:n]
