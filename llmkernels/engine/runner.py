"""The model runner: the KV cache, one step's inputs, and running a step eagerly or as a replayed CUDA graph.

It knows nothing of requests or sampling: it takes a scheduled batch ([(sequence, new tokens)]), packs the tokens'
ids, positions, cache slots and page tables into a ``StepBatch``, plans paged attention once for all layers, and
returns the logits of the rows whose sequences reach their last known token. Pure decode batches of up to
``max_graph_batch`` sequences replay a CUDA graph captured per batch size (1, 2, 4, ...); everything else runs
eagerly.
"""
from __future__ import annotations

import dataclasses
import gc

import torch

from ..attention.plan import plan_paged_attention
from .model import Model, StepInputs
from .scheduler import pages_for


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
                 cuda_graphs: bool, max_graph_batch: int, num_splits: int):
        self.model = model
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
        token ids already on the device (sampled by a step still in flight), replacing ``step.ids``."""
        if step.decode_only and self.use_graphs and len(step.ids) <= self.max_graph_batch:
            bs = min(1 << (len(step.ids) - 1).bit_length(), self.max_graph_batch)
            return self._graph_for(bs).run(step, ids_dev), True
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
        return self.model.forward(inp, self.k_caches, self.v_caches, plan)

    def copy_pages(self, pairs) -> None:
        """Copy whole pages (every layer's K and V) from ``src`` to ``dst`` for each (src, dst) in ``pairs``."""
        src = torch.tensor([a for a, _ in pairs], device=self.device)
        dst = torch.tensor([b for _, b in pairs], device=self.device)
        self.kv_cache.index_copy_(2, dst, self.kv_cache.index_select(2, src))

    # --- CUDA graphs for decode -----------------------------------------------------------------------------------
    def _graph_for(self, bs: int) -> "DecodeGraph":
        g = self.graphs.get(bs)
        if g is None:
            g = self.graphs[bs] = DecodeGraph(self, bs)
        return g

    def capture_graphs(self, sizes=None) -> None:
        """Capture decode graphs ahead of time (they are otherwise captured at first use)."""
        if not self.use_graphs:
            return
        sizes = sizes or [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b <= self.max_graph_batch]
        for bs in sizes:
            self._graph_for(bs)


class DecodeGraph:
    """A CUDA graph of one decode step for a fixed batch size, fed through fixed buffers.

    A decode batch of ``bs`` sequences always has the same attention tiles (one per sequence), so the plan made at
    capture stays valid; each step only uploads token ids, positions, kv lengths, page tables (one int32 copy) and
    cache slots (one int64 copy) from pinned host buffers.
    """

    def __init__(self, runner: ModelRunner, bs: int):
        cfg, dev = runner.cfg, runner.device
        self.bs = bs
        P = self.P = runner.max_pages_per_seq
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
        self.plan = plan_paged_attention(cu_h, torch.full((bs,), runner.max_model_len, dtype=torch.int32),
                                         runner.page_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                                         q_dtype=runner.dtype, kv_dtype=runner.kv_dtype, max_tiles=bs, max_tokens=bs,
                                         num_splits=runner.num_splits, device=dev)
        self.inp = StepInputs(self.ids, self.pos, self.slots, self.table, self.lens, self.cu, 1, self.idx)
        fwd = lambda: runner.model.forward(self.inp, runner.k_caches, runner.v_caches, self.plan)  # noqa: E731
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

    def run(self, step: StepBatch, ids_dev=None) -> torch.Tensor:
        n, bs, P = len(step.ids), self.bs, self.P
        self.turn ^= 1
        host32, host64 = self.host32s[self.turn], self.host64s[self.turn]
        h = host32.numpy()
        h[:] = 0
        h[:n], h[bs:bs + n] = step.ids, step.positions
        h[2 * bs:3 * bs] = 1  # padding rows: one key at page 0, outputs unused
        h[2 * bs:2 * bs + n] = step.seq_lens
        h[3 * bs:].reshape(bs, P)[:n, :len(step.page_table[0])] = step.page_table
        h64 = host64.numpy()
        h64[:] = -1  # padding rows store nothing
        h64[:n] = step.slots
        self.dev32.copy_(host32, non_blocking=True)
        self.slots.copy_(host64, non_blocking=True)
        if ids_dev is not None:  # sampled by the previous step, still on the device
            self.ids[:n].copy_(ids_dev)
        self.graph.replay()
        return self.logits[:n]
