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
        self.peers = None  # on rank 0 of a tensor-parallel group: the other ranks' processes (tp.Peers)

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
        if self.peers is not None:  # every rank runs the same step
            self.peers.send(("run", step, ids_dev is not None))
            if ids_dev is not None:
                self.peers.broadcast(ids_dev.to(torch.int64).contiguous())
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
        if self.peers is not None:
            self.peers.send(("copy", pairs))
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
        if self.peers is not None:  # graphs hold collectives: every rank captures them together
            self.peers.send(("graphs", sizes))
        for bs in sizes:
            self._graph_for(bs)

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
                self.capture_graphs(cmd[1])
            elif cmd[0] == "stop":
                return
            else:
                raise RuntimeError(f"unknown tensor-parallel command {cmd[0]!r}")
