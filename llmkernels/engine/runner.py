"""The model runner: the KV cache, one step's inputs, and running a step eagerly or as a replayed CUDA graph.

It knows nothing of requests or sampling: it takes a scheduled batch ([(sequence, new tokens)]), packs the tokens'
ids, positions, cache slots and page tables into a ``StepBatch``, plans paged attention once for all layers, and
returns the logits of the rows whose sequences reach their last known token. Pure decode batches of up to
``max_graph_batch`` sequences replay a CUDA graph captured per batch size (1, 2, 4, ...); a single sequence's
prompt chunk of up to ``max_extend_graph`` tokens replays one captured per padded token count (32, 64, ...);
everything else (several sequences with prompt tokens) runs eagerly.
"""
from __future__ import annotations

import dataclasses
import gc
import os

import torch

from ..attention.plan import plan_paged_attention
from .model import Model, StepInputs
from .scheduler import pages_for

EXTEND_TOKENS = (32, 64, 128, 256, 512)  # the padded token counts of the prompt-chunk graphs


@dataclasses.dataclass
class StepBatch:
    """One step's tokens as host lists (what ``ModelRunner.prepare`` packs from a scheduled batch)."""
    ids: list  # token ids [T]
    positions: list  # [T]
    slots: list  # cache slot of each token [T]
    cu_seqlens: list  # [B + 1]
    seq_lens: list  # kv length of each sequence after the step [B]
    logits_idx: list  # rows of T whose next-token logits are wanted
    page_table: list  # [B][pages], padded with page 0
    decode_only: bool  # every sequence adds its one newest token

    @property
    def max_q(self) -> int:
        c = self.cu_seqlens
        return max(b - a for a, b in zip(c, c[1:]))


def kv_bytes_per_page(cfg, page_size: int, kv_dtype: torch.dtype) -> int:
    return 2 * cfg.n_layers * page_size * cfg.n_kv_heads * cfg.head_dim * torch.empty(0, dtype=kv_dtype).element_size()


def pages_that_fit(cfg, device, page_size, kv_dtype, max_num_batched_tokens, gpu_memory_utilization) -> int:
    """KV pages that fit in the GPU memory left after the weights, keeping room for one step's activations."""
    gc.collect()  # what an earlier engine left for the cyclic collector or the caching allocator counts as free
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info(device)
    reserve = 2 * 2**30 + 4 * max_num_batched_tokens * (cfg.ffn + cfg.vocab_size) * 2
    return int(max(0, free * gpu_memory_utilization - reserve) // kv_bytes_per_page(cfg, page_size, kv_dtype))


class ModelRunner:
    """The KV cache of ``num_pages`` pages and the forward steps over it."""

    def __init__(self, model: Model, *, page_size: int, num_pages: int, max_model_len: int, kv_dtype: torch.dtype,
                 cuda_graphs: bool, max_graph_batch: int, num_splits: int, max_extend_graph: int = 512,
                 act_int8: bool = False):
        self.model = model
        self.act_int8 = act_int8  # every step's projections round their activations to int8 (Model.forward)
        self.cfg = cfg = model.cfg
        self.device = model.device
        self.dtype = model.dtype
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_model_len = max_model_len
        self.max_pages_per_seq = pages_for(max_model_len, page_size)
        self.kv_dtype = kv_dtype
        self.num_splits = num_splits
        shape = (cfg.n_layers, 2, num_pages, page_size, cfg.n_kv_heads, cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=kv_dtype, device=self.device)
        self.k_caches = [self.kv_cache[i, 0] for i in range(cfg.n_layers)]
        self.v_caches = [self.kv_cache[i, 1] for i in range(cfg.n_layers)]
        self.use_graphs = bool(cuda_graphs and self.device.type == "cuda" and model.backend == "triton")
        self.max_graph_batch = max_graph_batch
        self.graphs = {}
        # LLMK_EXTEND_GRAPHS=0 runs prompt chunks eagerly (A/B runs)
        on = os.environ.get("LLMK_EXTEND_GRAPHS", "1") != "0"
        self.extend_sizes = [t for t in EXTEND_TOKENS if t <= max_extend_graph] if on else []
        self.extend_graphs = {}
        self.peers = None  # on rank 0 of a tensor-parallel group: the other ranks' processes (tp.Peers)
        # decode steps as one persistent kernel (megakernel.engine.OneKernelSteps), where the model takes it
        self.one_kernel = None
        self.greedy_ids = self.greedy_host = None
        self.decode_path = "kernel per op"

    def prepare(self, batch, logits_all: bool = False) -> StepBatch:
        """Pack a scheduled batch [(sequence, new tokens)]; ``logits_all``: logits for every token (scoring)."""
        ids, pos, slots, cu, lens, logits_idx, table = [], [], [], [0], [], [], []
        width = max(len(s.pages) for s, _ in batch)
        ps = self.page_size
        decode_only = True
        for s, n in batch:
            start = s.num_computed
            ids += s.token_slice(start, start + n)
            p = range(start, start + n)
            pos += p
            pages = s.pages
            slots += [pages[i // ps] * ps + i % ps for i in p]
            cu.append(cu[-1] + n)
            lens.append(start + n)
            last = start + n == s.num_tokens
            decode_only = decode_only and n == 1 and last
            if logits_all:
                logits_idx += range(cu[-2], cu[-1])
            elif last:
                logits_idx.append(cu[-1] - 1)
            table.append(pages + [0] * (width - len(pages)))
        return StepBatch(ids, pos, slots, cu, lens, logits_idx, table, decode_only and not logits_all)

    def run(self, step: StepBatch, ids_dev: torch.Tensor | None = None) -> tuple[torch.Tensor, bool]:
        """Launch a step; returns (float32 logits [rows, vocab], whether a CUDA graph ran it). ``ids_dev``: the
        token ids already on the device (sampled by a step still in flight), replacing ``step.ids``. Afterwards
        ``greedy_ids`` holds the argmax of the logits' rows where the step computed it (int64 [rows] on the device,
        a buffer the next step reuses), else None; ``greedy_host``, where not None, the same ids in pinned host
        memory, written by the step itself (valid once the GPU is past it, until the step after next)."""
        if self.peers is not None:  # every rank runs the same step
            self.peers.send(("run", step, ids_dev is not None))
            if ids_dev is not None:
                self.peers.broadcast(ids_dev.to(torch.int64).contiguous())
        self.greedy_ids = self.greedy_host = None
        one = self.one_kernel.takes(step) if step.decode_only and self.one_kernel is not None else None
        if one is not None:
            logits = one.run(step, ids_dev)
            if one.batch == 1:  # the step chose its greedy token itself
                self.greedy_ids, self.greedy_host = one.fast.token, one.greedy_host
            return logits, True
        if step.decode_only and self.use_graphs and len(step.ids) <= self.max_graph_batch:
            bs = min(1 << (len(step.ids) - 1).bit_length(), self.max_graph_batch)
            return self._graph_for(bs).run(step, ids_dev), True
        if self.use_graphs and ids_dev is None and not step.decode_only:
            T = next((t for t in self.extend_sizes if t >= len(step.ids)), 0)
            if T and ExtendGraph.fits(step, T, self.page_size, self.max_pages_per_seq):
                return self._extend_for(T).run(step), True
        return self._eager(step, ids_dev), False

    def _eager(self, step: StepBatch, ids_dev=None) -> torch.Tensor:
        dev = self.device
        i32 = dict(dtype=torch.int32)
        cu_h, lens_h = torch.tensor(step.cu_seqlens, **i32), torch.tensor(step.seq_lens, **i32)
        plan = plan_paged_attention(cu_h, lens_h, self.page_size, self.cfg.n_heads, self.cfg.n_kv_heads,
                                    self.cfg.head_dim, q_dtype=self.dtype, kv_dtype=self.kv_dtype,
                                    num_splits=self.num_splits, device=dev)
        ids_t = ids_dev.to(torch.int32) if ids_dev is not None else torch.tensor(step.ids, **i32).to(dev)
        inp = StepInputs(ids_t, torch.tensor(step.positions, **i32).to(dev),
                         torch.tensor(step.slots, dtype=torch.int64).to(dev),
                         torch.tensor(step.page_table, **i32).to(dev), lens_h.to(dev), cu_h.to(dev), step.max_q,
                         torch.tensor(step.logits_idx, dtype=torch.int64).to(dev))
        return self.model.forward(inp, self.k_caches, self.v_caches, plan, act_int8=self.act_int8)

    def copy_pages(self, pairs) -> None:
        """Copy whole pages (every layer's K and V) from ``src`` to ``dst`` for each (src, dst) in ``pairs``."""
        if self.peers is not None:
            self.peers.send(("copy", pairs))
        src = torch.tensor([a for a, _ in pairs], device=self.device)
        dst = torch.tensor([b for _, b in pairs], device=self.device)
        self.kv_cache.index_copy_(2, dst, self.kv_cache.index_select(2, src))

    # --- CUDA graphs ----------------------------------------------------------------------------------------------
    def _graph_for(self, bs: int) -> "DecodeGraph":
        g = self.graphs.get(bs)
        if g is None:
            g = self.graphs[bs] = DecodeGraph(self, bs)
        return g

    def _extend_for(self, tokens: int) -> "ExtendGraph":
        g = self.extend_graphs.get(tokens)
        if g is None:
            g = self.extend_graphs[tokens] = ExtendGraph(self, tokens)
        return g

    def capture_graphs(self, sizes=None, extend_sizes=None) -> None:
        """Capture the decode graphs (batch ``sizes``) and the prompt-chunk graphs (``extend_sizes`` tokens) ahead
        of time; they are otherwise captured at first use. Default: all of them."""
        if not self.use_graphs:
            return
        if self.one_kernel is not None:
            self.one_kernel.build(sizes)
        sizes = sizes or [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b <= self.max_graph_batch]
        extend_sizes = self.extend_sizes if extend_sizes is None else extend_sizes
        if self.peers is not None:  # graphs hold collectives: every rank captures them together
            self.peers.send(("graphs", sizes, extend_sizes))
        for bs in sizes:
            self._graph_for(bs)
        for t in extend_sizes:
            self._extend_for(t)

    def release_graphs(self) -> None:
        """Free the captured graphs. A process group whose NCCL work some live graph captured cannot be torn down
        (destroy and abort hang: pytorch/pytorch#115388), so tensor-parallel ranks call this before leaving it."""
        for g in (*self.graphs.values(), *self.extend_graphs.values()):
            g.graph.reset()
        self.graphs, self.extend_graphs = {}, {}

    def serve_steps(self, conn) -> None:
        """On a rank other than 0: run what rank 0 sends through ``conn`` (steps, page copies, graph captures) until
        it says stop or goes away."""
        import torch.distributed as dist

        while True:
            try:
                cmd = conn.recv()
            except EOFError:  # rank 0 is gone
                return
            if cmd[0] == "run":
                step, has_ids = cmd[1], cmd[2]
                ids = None
                if has_ids:
                    ids = torch.empty(len(step.ids), dtype=torch.int64, device=self.device)
                    dist.broadcast(ids, src=0, group=self.model.tp.group)
                self.run(step, ids)
            elif cmd[0] == "copy":
                self.copy_pages(cmd[1])
            elif cmd[0] == "graphs":
                self.capture_graphs(cmd[1], cmd[2])
            elif cmd[0] == "stop":
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self.release_graphs()
                return
            else:
                raise RuntimeError(f"unknown tensor-parallel command {cmd[0]!r}")


class _Graph:
    """A captured forward step over fixed device inputs (``self.inp``) and a plan made at capture."""

    def _capture(self, runner: ModelRunner) -> None:
        dev = runner.device
        fwd = lambda: runner.model.forward(self.inp, runner.k_caches, runner.v_caches, self.plan,  # noqa: E731
                                           act_int8=runner.act_int8)
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

    def _pinned(self, n32: int, n64: int, dev):
        # two sets of pinned input buffers, used in turn, so that a step can be filled while the previous one's
        # upload is still queued; a set is refilled only once its last upload has run (prompt chunks are launched
        # without waiting for any result, so the host can be several steps ahead of the GPU)
        self.host32s = [torch.zeros(n32, dtype=torch.int32).pin_memory() for _ in range(2)]
        self.host64s = [torch.zeros(n64, dtype=torch.int64).pin_memory() for _ in range(2)]
        self.uploaded = [None, None]  # CUDA event after each set's last upload
        self.turn = 0
        self.dev32 = torch.zeros(n32, dtype=torch.int32, device=dev)
        self.dev64 = torch.zeros(n64, dtype=torch.int64, device=dev)

    def _host(self):
        self.turn ^= 1
        if self.uploaded[self.turn] is not None:
            self.uploaded[self.turn].synchronize()
        return self.host32s[self.turn], self.host64s[self.turn]

    def _upload(self, host32, host64) -> None:
        self.dev32.copy_(host32, non_blocking=True)
        if self.dev64.numel():
            self.dev64.copy_(host64, non_blocking=True)
        ev = self.uploaded[self.turn] = torch.cuda.Event()
        ev.record()


class DecodeGraph(_Graph):
    """A CUDA graph of one decode step for a fixed batch size, fed through fixed buffers.

    A decode batch of ``bs`` sequences always has the same attention tiles (one per sequence), so the plan made at
    capture stays valid; each step only uploads token ids, positions, kv lengths, page tables (one int32 copy) and
    cache slots (one int64 copy) from pinned host buffers.
    """

    def __init__(self, runner: ModelRunner, bs: int):
        cfg, dev = runner.cfg, runner.device
        self.bs = bs
        P = self.P = runner.max_pages_per_seq
        self._pinned(3 * bs + bs * P, bs, dev)
        self.ids, self.pos, self.lens = self.dev32[:bs], self.dev32[bs:2 * bs], self.dev32[2 * bs:3 * bs]
        self.table = self.dev32[3 * bs:].view(bs, P)
        self.lens.fill_(1)
        self.slots = self.dev64
        self.slots.fill_(-1)
        self.cu = torch.arange(bs + 1, dtype=torch.int32, device=dev)
        self.idx = torch.arange(bs, dtype=torch.int64, device=dev)
        # split-KV is fixed at capture: plan for the longest sequences the engine allows
        cu_h = torch.arange(bs + 1, dtype=torch.int32)
        self.plan = plan_paged_attention(cu_h, torch.full((bs,), runner.max_model_len, dtype=torch.int32),
                                         runner.page_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                                         q_dtype=runner.dtype, kv_dtype=runner.kv_dtype, max_tiles=bs, max_tokens=bs,
                                         num_splits=runner.num_splits, device=dev)
        self.inp = StepInputs(self.ids, self.pos, self.slots, self.table, self.lens, self.cu, 1, self.idx)
        self._capture(runner)

    def run(self, step: StepBatch, ids_dev=None) -> torch.Tensor:
        n, bs, P = len(step.ids), self.bs, self.P
        host32, host64 = self._host()
        h = host32.numpy()
        h[:] = 0
        h[:n], h[bs:bs + n] = step.ids, step.positions
        h[2 * bs:3 * bs] = 1  # padding rows: one key at page 0, outputs unused
        h[2 * bs:2 * bs + n] = step.seq_lens
        h[3 * bs:].reshape(bs, P)[:n, :len(step.page_table[0])] = step.page_table
        h64 = host64.numpy()
        h64[:] = -1  # padding rows store nothing
        h64[:n] = step.slots
        self._upload(host32, host64)
        if ids_dev is not None:  # sampled by the previous step, still on the device
            self.ids[:n].copy_(ids_dev)
        self.graph.replay()
        return self.logits[:n]


class ExtendGraph(_Graph):
    """A CUDA graph of one sequence computing up to ``tokens`` new tokens over its cached ones: a prompt's first
    chunk, or the rest of a prompt whose prefix the cache held. Eagerly such a step costs tens of milliseconds of
    Python launches on an 8B model, more than its GPU work.

    The step is padded to ``tokens`` queries: the padding tokens come after the real ones (causal attention keeps
    the real rows from seeing them), store nothing (slot -1) and read page 0. Only the last real row's logits are
    computed. The tiles depend on the query count alone, so the plan made at capture stays valid.
    """

    def __init__(self, runner: ModelRunner, tokens: int):
        cfg, dev = runner.cfg, runner.device
        T = self.T = tokens
        P = self.P = runner.max_pages_per_seq
        self._pinned(2 * T + 1 + P, T + 1, dev)
        self.ids, self.pos = self.dev32[:T], self.dev32[T:2 * T]
        self.lens, self.table = self.dev32[2 * T:2 * T + 1], self.dev32[2 * T + 1:].view(1, P)
        self.lens.fill_(T)
        self.slots, self.idx = self.dev64[:T], self.dev64[T:]
        self.slots.fill_(-1)
        self.cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
        self.plan = plan_paged_attention(torch.tensor([0, T], dtype=torch.int32),
                                         torch.tensor([P * runner.page_size], dtype=torch.int32),
                                         runner.page_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                                         q_dtype=runner.dtype, kv_dtype=runner.kv_dtype,
                                         num_splits=runner.num_splits, device=dev)
        self.inp = StepInputs(self.ids, self.pos, self.slots, self.table, self.lens, self.cu, T, self.idx)
        self._capture(runner)

    @staticmethod
    def fits(step: StepBatch, tokens: int, page_size: int, max_pages: int) -> bool:
        """Whether ``step`` is one sequence whose padded step stays inside the page table, wanting at most its last
        row's logits."""
        n = len(step.ids)
        return (len(step.seq_lens) == 1 and n <= tokens and step.seq_lens[0] - n + tokens <= max_pages * page_size
                and step.logits_idx in ([], [n - 1]))

    def run(self, step: StepBatch) -> torch.Tensor:
        n, T = len(step.ids), self.T
        start = step.seq_lens[0] - n
        host32, host64 = self._host()
        h = host32.numpy()
        h[:] = 0
        h[:n] = step.ids
        h[T:2 * T] = range(start, start + T)
        h[2 * T] = start + T
        h[2 * T + 1:2 * T + 1 + len(step.page_table[0])] = step.page_table[0]
        h64 = host64.numpy()
        h64[:] = -1
        h64[:n] = step.slots
        h64[T] = n - 1
        self._upload(host32, host64)
        self.graph.replay()
        return self.logits[:len(step.logits_idx)]
