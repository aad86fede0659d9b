"""The paged-attention planner: decide once per batch, reuse for every layer, replay in CUDA graphs.

``plan_paged_attention`` reads the batch's lengths (on the host), sorts sequences into short ones (decode and small
speculative verifies) and long ones (extend / chunked prefill), builds each class's tile list, picks the split-KV
count and the tile sizes from the tuned table, and allocates fixed-capacity buffers. ``plan.update`` refills those
buffers in place for the next step, so a captured CUDA graph replays with new lengths and page tables.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
import triton

from .._checks import check_positive_int, check_tensor, interpreter_mode
from .._runtime import gpu_name, num_sms
from ..kv_cache import FP8_DTYPES
from ..tuning import lookup
from . import schedule
from .schedule import balanced_table_size, balanced_tables, fp8_ring, tma_pages

PAGED_HEAD_DIMS = (64, 96, 128, 256)
LONG_ROWS = 64  # rows (query tokens x group) of a long tile
MIN_KEYS_PER_SPLIT = 512  # keys per split below which a second wave of split programs does not pay
MIN_KEYS_FEW = 64  # the same with few programs (see _kernel_config's "few" tiles)
MIN_KEYS_SHORT = 32  # the least keys per split for short contexts (one or two K/V tiles)
# The Gluon decode kernel (paged_ws.py) serves calls that read at least this many K/V bytes: its host cost per eager
# call (descriptors, Gluon launch) is about 100 us more than the Triton kernel's, as for prefill
WS_DECODE_MIN_BYTES = 1 << 25
WS_MIN_KEYS_PER_SPLIT = 256
# num_splits=0 on the Gluon decode kernel: equal key-tile ranges per SM (schedule.balanced_tables) when the units
# (sequence, kv head, split) dealt round-robin leave the busiest SM more than BALANCE_MIN_SKEW times the mean work.
# H100, GQA 32/8, bf16, page 16 (graph-timed, us, units / balanced; bench/NOTES.md): ragged B=8
# 1 x 32768 + 7 x 1024 keys 216 / 69; B=32 2 x 16384 + 30 x 512 212 / 80; B=104 4 x 8192 + 100 x 256 140 / 96; B=48 random 64..8192 337 / 295; but
# where every unit is cut, even batches lose: B=1 L=32768 55 / 64, B=4 L=8192 55 / 60, B=64 L=1024 97 / 106
BALANCED_SPLIT = True
BALANCE_MIN_SKEW = 1.25
# mixed batches (decode sequences with one query each, plus long tiles): the decode part on the Gluon kernel and the
# long tiles on the Triton kernel, launched on two streams so that the long tiles' arithmetic overlaps the decode
# part's streaming (bench/NOTES.md)
MIXED_WS = True


def _beside_config(kv_dtype):
    """(rows of a long tile, (block_n, warps, stages) of its Triton launch, register cap of the Gluon kernel) for a
    mixed batch whose long tiles run beside the Gluon decode kernel.

    The two kernels overlap only where one Triton program fits on an SM next to the Gluon kernel's: uncapped, the
    16-bit Gluon kernel (8 warps at 255 registers) takes the whole register file and the two ran in turn. Capped at
    128 its consumer still gets 232 (setmaxnreg) and a 128-row Triton program (4 warps) fits beside it. The fp8
    kernel's converter partition (12 warps) leaves no room at any cap that keeps 232 for the consumer, so there the
    two share the GPU by SMs. H100, GQA 32/8, D 128, page 16 (graph-timed, us; bench/NOTES.md; both kernels
    in turn on the Triton kernel / 64-row tiles (64, 4, 3) with the 16-bit kernel capped at 152 / 128-row tiles
    (32, 4, 3) capped at 128):

    | batch | bf16 | fp8 e4m3 |
    |---|---|---|
    | 512-token chunk + 63 x 4096 | 485.8 / 414.8 / 378.1 | 366.6 / 342.6 / 444.3 |
    | 2048-token chunk + 63 x 4096 | 771.8 / 649.1 / 671.2 | 745.2 / 681.3 / 699.4 |
    | 128-token chunk + 127 x 2048 | 435.0 / 360.6 / 363.8 | 293.8 / 268.2 / 320.5 |
    | 2 x 512-token chunks + 30 x 8192 | 823.7 / 741.4 / 726.7 | 879.2 / 769.8 / 714.7 |
    | 1024-token chunk + 31 x 8192 | 833.4 / 745.9 / 719.8 | 876.0 / 759.4 / 712.5 |
    """
    if kv_dtype.itemsize == 1:
        return 64, (64, 4, 3), 0
    return 128, (32, 4, 3), 128


@dataclasses.dataclass
class TileLaunch:
    """One kernel launch over the tiles of one class of sequences."""
    name: str  # "short" (decode / small verify) or "long" (extend, chunked prefill)
    block_q: int  # query tokens per tile
    block_m: int  # rows per tile: block_q * group, padded to a power of two >= 16
    block_n: int  # keys per inner step
    num_warps: int
    num_stages: int
    capacity: int  # tiles the buffers hold
    tile_seq: torch.Tensor  # int32 [capacity]: sequence of each tile
    tile_q: torch.Tensor  # int32 [capacity]: first query (within its sequence) of each tile
    num_tiles: torch.Tensor  # int32 [1]: tiles in use; programs past it exit at once
    used: int = 0

    def config(self) -> list[int]:
        return [self.block_q, self.block_m, self.block_n, self.num_warps, self.num_stages, self.capacity]


@dataclasses.dataclass
class PagedAttentionPlan:
    page_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    num_splits: int
    launches: list
    variant: str  # "decode", "extend" or "mixed"
    batch: int
    total_q: int
    device: torch.device
    reasons: list
    workspace_o: torch.Tensor | None = None  # float32 [num_splits, token_capacity, Hq, D]
    workspace_lse: torch.Tensor | None = None  # float32 [num_splits, token_capacity, Hq]
    short_q_max: int = 1
    ws_decode: bool = False  # the persistent Gluon decode kernel (paged_ws.py) where the call allows it
    ws_maxnreg: int = 0  # its register cap (0: none), set for mixed batches (see _beside_config)
    # its balanced split (num_splits=0): the int32 table of schedule.balanced_tables and float32 slots
    # [2 * SMs, Hq, D] / [2 * SMs, Hq] for the pieces of (sequence, kv head) units that straddle programs
    balanced: list | None = None

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def describe(self) -> str:
        """The dispatch decision in words: each branch of the decision tree that was taken, and why."""
        lines = [f"paged attention plan: {self.variant}, batch {self.batch}, {self.total_q} query tokens, "
                 f"Hq {self.num_q_heads} / Hkv {self.num_kv_heads} (group {self.group}), D {self.head_dim}, "
                 f"page size {self.page_size}, q {str(self.q_dtype)[6:]}, kv {str(self.kv_dtype)[6:]}"]
        lines += [f"  - {r}" for r in self.reasons]
        for ln in self.launches:
            lines.append(f"  launch '{ln.name}': {ln.used} tiles (capacity {ln.capacity}) x {self.num_kv_heads} kv "
                         f"heads x {self.num_splits} splits; tile = {ln.block_q} tokens x {self.group} heads "
                         f"-> {ln.block_m} rows, {ln.block_n} keys per step, {ln.num_warps} warps, "
                         f"{ln.num_stages} stages")
        if self.ws_decode:
            part = ("the 'short' launch's sequences run on the" if self.variant == "mixed" else "kernel:")
            copies = ("TMA page copies" if tma_pages(self.page_size) else
                      "cache rows gathered with cp.async (a page size TMA does not copy whole)")
            lines.append(f"  {part} persistent Gluon decode kernel (sm_90, {copies}) over {self.num_splits} "
                         f"split(s) per (sequence, kv head), one program per SM; the Triton launches above serve "
                         f"the calls it cannot take (left window, softcap, sinks, custom mask, LSE output, caches "
                         f"it cannot read)")
            if self.kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and self.variant != "mixed" \
                    and not self.balanced and tma_pages(self.page_size):

                units = self.launches[0].capacity * self.num_kv_heads * self.num_splits
                sms = num_sms(self.device)
                ring = fp8_ring(units, sms, self.group)
                if schedule.FP8_CONSUMERS > 1 and self.group <= 8:
                    lines.append(f"  fp8 cache: a ring of {ring} TMA slots, two consumer warp groups on alternate "
                                 "key tiles")
                else:
                    lines.append(f"  fp8 cache: a ring of {ring} TMA slots ({units} units "
                                 f"{'>' if units > sms else '<='} {sms} programs: "
                                 f"{'several units' if units > sms else 'at most one unit'} per program)")
            if self.variant == "mixed":
                lines.append("  the 'long' launch runs on the Triton kernel in a second stream, beside the Gluon "
                             "kernel" + (f" (capped at {self.ws_maxnreg} registers so that a Triton program fits "
                                         f"on each SM with it)" if self.ws_maxnreg else ""))
        if self.balanced:
            lines.append(f"  balanced split (the Gluon kernel): its {self.balanced[1].shape[0] // 2} programs take "
                         f"ranges of about equal length of the batch's 64-key tiles (a boundary near a (sequence, kv "
                         f"head) unit's edge moves onto it); a unit cut between programs is merged by the last of "
                         f"them to finish; the split-KV x{self.num_splits} below serves the Triton fallback and "
                         f"streams without counters")
        if self.num_splits > 1:
            lines.append(f"  merge: the {self.num_splits} split partials (o, lse) of each query and head merge in "
                         f"float32 in combine_kernel, a second launch")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()

    def update(self, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor) -> "PagedAttentionPlan":
        """Refill the tile buffers for a new batch of the same shape class, in place (CUDA-graph replay).

        Raises ValueError if the new batch needs a launch the plan lacks, more tiles than its capacity, or more
        query tokens than its workspace holds.
        """
        q_lens, k_lens = _host_lengths(cu_seqlens_q, seq_lens)
        _check_lengths(q_lens, k_lens)
        if self.ws_decode:
            many = (q_lens > 1) & (q_lens <= self.short_q_max)
            if many.any():
                raise ValueError(f"plan.update: the plan runs the one-query-per-sequence decode kernel, but sequence "
                                 f"{int(np.nonzero(many)[0][0])} has {int(q_lens[many][0])} new queries; make a new "
                                 f"plan")
        tiles = _tiles(q_lens, self.short_q_max, {ln.name: ln.block_q for ln in self.launches})
        names = {ln.name for ln in self.launches}
        for name, (seqs, _) in tiles.items():
            if len(seqs) and name not in names:
                raise ValueError(f"plan.update: the batch has {name} sequences but the plan was made without a "
                                 f"'{name}' launch; make a new plan")
        for ln in self.launches:
            seqs = tiles.get(ln.name, (np.zeros(0, np.int32), None))[0]
            if len(seqs) > ln.capacity:
                raise ValueError(f"plan.update: {len(seqs)} '{ln.name}' tiles exceed capacity {ln.capacity}")
        if self.workspace_o is not None and int(q_lens.sum()) > self.workspace_o.shape[1]:
            raise ValueError(f"plan.update: {int(q_lens.sum())} query tokens exceed the split-KV workspace "
                             f"capacity ({self.workspace_o.shape[1]} tokens); make a new plan")
        for ln in self.launches:
            seqs, starts = tiles.get(ln.name, (np.zeros(0, np.int32), np.zeros(0, np.int32)))
            _fill(ln, seqs, starts)
        if self.balanced:
            _fill_balanced(self.balanced[0], k_lens[tiles["short"][0]], self.num_kv_heads,
                           self.balanced[1].shape[0] // 2, self.launches[0].capacity)
        self.batch = len(q_lens)
        self.total_q = int(q_lens.sum())
        return self


def _host_lengths(cu_seqlens_q, seq_lens):
    check_tensor("cu_seqlens_q", cu_seqlens_q, dtypes=(torch.int32,), ndim=1)
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), ndim=1)
    if cu_seqlens_q.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(f"cu_seqlens_q must have shape ({seq_lens.shape[0] + 1},) (batch+1 for seq_lens of batch "
                         f"{seq_lens.shape[0]}), got {tuple(cu_seqlens_q.shape)}")
    cu = cu_seqlens_q.detach().cpu().numpy().astype(np.int64)
    k = seq_lens.detach().cpu().numpy().astype(np.int64)
    if cu[0] != 0 or (np.diff(cu) < 0).any():
        raise ValueError(f"cu_seqlens_q must start at 0 and be non-decreasing, got {cu[:16].tolist()}")
    return np.diff(cu), k


def _check_lengths(q_lens, k_lens):
    bad = np.nonzero(q_lens > k_lens)[0]
    if len(bad):
        b = int(bad[0])
        raise ValueError(f"sequence {b} has {int(q_lens[b])} new queries but seq_lens[{b}] = {int(k_lens[b])}: "
                         f"seq_lens counts the new tokens too, so q_len <= seq_len")
    if (k_lens < 0).any():
        raise ValueError("seq_lens must be >= 0")


def _tiles(q_lens, short_q_max, block_q):
    """{launch name: (tile_seq, tile_q)} for short and long sequences; empty sequences get no tile."""
    out = {}
    for name in ("short", "long"):
        sel = (q_lens > 0) & (q_lens <= short_q_max) if name == "short" else q_lens > short_q_max
        seqs_idx = np.nonzero(sel)[0]
        if name not in block_q:
            out[name] = (seqs_idx.astype(np.int32), np.zeros(len(seqs_idx), np.int32))
            continue
        bq = block_q[name]
        n = -(-q_lens[seqs_idx] // bq)
        seqs = np.repeat(seqs_idx, n).astype(np.int32)
        starts = (np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)) * bq
        out[name] = (seqs, starts.astype(np.int32))
    return out


def _fill(ln: TileLaunch, seqs, starts):
    n = len(seqs)
    host = torch.zeros(2, ln.capacity, dtype=torch.int32)
    host[0, :n] = torch.from_numpy(seqs)
    host[1, :n] = torch.from_numpy(starts)
    ln.tile_seq.copy_(host[0], non_blocking=True)
    ln.tile_q.copy_(host[1], non_blocking=True)
    ln.num_tiles.fill_(n)
    ln.used = n


def _units_load(tile_k_lens, num_kv_heads, num_splits, programs, block_n=64):
    """(busiest, mean) 64-key tiles per program of the Gluon decode kernel's units split (paged_ws._unit; units
    dealt u = pid, pid + P, ...)."""
    lens = np.asarray(tile_k_lens, dtype=np.int64)
    chunk = -(-(-(-lens // num_splits)) // block_n) * block_n
    lo = np.minimum(np.arange(num_splits)[None, :] * chunk[:, None], lens[:, None])
    tiles = -(-(np.minimum(lo + chunk[:, None], lens[:, None]) - lo) // block_n)  # [seqs, splits]
    per_unit = np.repeat(tiles[:, None, :], num_kv_heads, axis=1).reshape(-1)  # (seq, head, split) order
    load = np.bincount(np.arange(len(per_unit)) % programs, weights=per_unit, minlength=programs)
    return int(load.max()) if len(load) else 0, float(per_unit.sum()) / max(1, min(programs, len(per_unit)))


def _fill_balanced(buf, tile_k_lens, num_kv_heads, programs, capacity):
    """Refill the balanced split's table (schedule.balanced_tables) in ``buf``."""

    buf.copy_(torch.from_numpy(balanced_tables(tile_k_lens, num_kv_heads, programs, capacity)), non_blocking=True)


def _kernel_config(name, kv_dtype, head_dim, page_size, group, few: bool = False):
    """(block_n, num_warps, num_stages) from the tuned table (GPU, kv dtype, D, page-size class, group class).

    ``few``: the batch has so few (tile, KV head) programs that at most half the SMs would be busy without split-KV
    (batch-1 decode). Its splits hold few keys each, and short key tiles measured faster there: H100, B=1, GQA 32/8,
    bf16, page 16, caches read from DRAM (bench/lab/paged_lab.py --cold), BLOCK_N 16 against 32 at the splits each
    chose: L=532 7.7 against 9.5 us, L=4096 14.8 against 22.9, L=32768 57.2 against 69.4. The table's key gets the
    suffix "/few" (decode_few in tuning/tune.py); without such an entry the general one applies."""
    if interpreter_mode():
        return 16 if name == "short" else 32, 4, 1
    page_class = "p1" if page_size == 1 else ("small" if page_size < 64 else "large")
    group_class = "g1" if group == 1 else ("g<=8" if group <= 8 else "g>8")
    key = f"{name}/{str(kv_dtype)[6:]}/{head_dim}/{page_class}/{group_class}"
    entry = lookup("paged", gpu_name(), key + "/few") if few else None
    if entry is None:
        entry = lookup("paged", gpu_name(), key)
    if entry is not None:
        return tuple(entry)
    if head_dim > 128:
        return 32, 4, 2
    return (64, 4, 3) if name == "short" else (64, 4, 2)


def _ws_decode(device, q_lens, k_lens, page_size, num_kv_heads, head_dim, group, q_dtype, kv_dtype) -> bool:
    """Whether the batch suits the persistent Gluon decode kernel (paged_ws.py): sm_90 with Gluon, one query per
    sequence, a cache of q's dtype or fp8, any page size (8/16/32 or a multiple of 64 copied by pages with TMA, the
    others gathered by rows with cp.async), head dim 64 or 128 (or 256 with a 16-bit cache), group <= 64,
    and enough K/V bytes to hide its host cost (fp8 caches included: since its consumer reads K as fp8, it beat the
    Triton kernel at every decode-suite shape, see bench/NOTES.md)."""
    if interpreter_mode() or device.type != "cuda" or head_dim not in (64, 128, 256) or group > 64:
        return False
    if head_dim == 256 and kv_dtype in FP8_DTYPES:  # its fp16 V ring would not fit beside the fp8 one
        return False
    if kv_dtype != q_dtype and kv_dtype not in FP8_DTYPES:
        return False
    if not len(q_lens) or int(q_lens.max()) != 1:
        return False
    if int(k_lens.sum()) * num_kv_heads * head_dim * 2 * kv_dtype.itemsize < WS_DECODE_MIN_BYTES:
        return False
    from .prefill import _gluon_hopper

    return _gluon_hopper(device.index if device.index is not None else torch.cuda.current_device())


def plan_paged_attention(cu_seqlens_q, seq_lens, page_size: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                         *, q_dtype, kv_dtype, num_splits: int = 0, max_tiles: int | None = None,
                         max_tokens: int | None = None, device=None) -> PagedAttentionPlan:
    """Plan a paged-attention batch once; pass the plan to every layer's ``paged_attention`` call.

    Args:
        cu_seqlens_q: int32 [batch+1] prefix sums of new-query counts; seq_lens: int32 [batch] kv lengths
            (new tokens included). CPU tensors avoid a device sync; device tensors are copied to the host.
        page_size, num_q_heads, num_kv_heads, head_dim: the cache geometry.
        q_dtype, kv_dtype: query dtype (fp16/bf16) and cache dtype (same, or fp8 e4m3fn/e5m2).
        num_splits: 0 lets the plan choose split-KV from the SM count, tiles, heads and lengths; a fixed value makes
            every sequence's result independent of the rest of the batch.
        max_tiles, max_tokens: capacities for ``plan.update`` (CUDA graphs); default: this batch's sizes.

    >>> plan = plan_paged_attention(cu_q, seq_lens, 16, 32, 8, 128, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    >>> print(plan.describe())
    """
    for name, val in (("page_size", page_size), ("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads)):
        check_positive_int(name, val)
    check_positive_int("num_splits", num_splits, minimum=0)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if head_dim not in PAGED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {PAGED_HEAD_DIMS}, got {head_dim}")
    if q_dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"q_dtype must be float16 or bfloat16, got {q_dtype}")
    if kv_dtype not in (q_dtype,) + FP8_DTYPES:
        raise TypeError(f"kv_dtype must be q_dtype ({q_dtype}) or an fp8 type {FP8_DTYPES}, got {kv_dtype}")
    device = torch.device(device) if device is not None else (
        seq_lens.device if seq_lens.device.type != "cpu" or interpreter_mode() else torch.device("cuda"))
    q_lens, k_lens = _host_lengths(cu_seqlens_q, seq_lens)
    _check_lengths(q_lens, k_lens)
    group = num_q_heads // num_kv_heads
    reasons = []
    short_q_max = max(1, 16 // group)
    block_q = {"short": short_q_max, "long": max(1, LONG_ROWS // group)}
    tiles = _tiles(q_lens, short_q_max, block_q)
    n_short, n_long = len(tiles["short"][0]), len(tiles["long"][0])
    reasons.append(f"sequences with 1..{short_q_max} new tokens -> 'short' tiles of {short_q_max} tokens "
                   f"({short_q_max * group} rows); longer ones -> 'long' tiles of {block_q['long']} tokens")
    total_tiles = n_short + n_long
    sms = num_sms(device)
    programs = max(1, total_tiles * num_kv_heads)
    few = 2 * programs <= sms
    short_seqs = tiles["short"][0]
    ws = _ws_decode(device, q_lens[short_seqs], k_lens[short_seqs], page_size, num_kv_heads, head_dim, group,
                    q_dtype, kv_dtype)
    beside = None
    if ws and n_long:
        # a mixed batch: its decode sequences on the Gluon kernel, its long tiles on the Triton kernel beside it
        # (a second stream), where neither needs split-KV (the two would share one set of split slots)
        rows, cfg, maxnreg = _beside_config(kv_dtype)
        bq = {"short": short_q_max, "long": max(1, rows // group)}
        tiles_b = _tiles(q_lens, short_q_max, bq)
        programs_b = (n_short + len(tiles_b["long"][0])) * num_kv_heads
        # (the register cap below leaves the cp.async loader of other page sizes too few registers)
        ws = MIXED_WS and num_splits in (0, 1) and programs_b >= sms and tma_pages(page_size)
        if ws:
            beside = cfg, maxnreg
            block_q, tiles, n_long, programs = bq, tiles_b, len(tiles_b["long"][0]), programs_b
            reasons.append(f"mixed batch, {n_short} one-query sequences with >= {WS_DECODE_MIN_BYTES >> 20} MB of "
                           f"K/V and {programs} programs >= {sms} SMs -> the decode sequences on the persistent "
                           f"Gluon decode kernel, the long tiles ({rows} rows) on the Triton kernel in a second "
                           f"stream, concurrently" + (f" (the Gluon kernel capped at {maxnreg} registers, so that a "
                                                      f"Triton program fits beside it)" if maxnreg else ""))
    elif ws:
        reasons.append(f"one query per sequence, {str(kv_dtype)[6:]} cache, page size and head dim it takes, "
                       f">= {WS_DECODE_MIN_BYTES >> 20} MB of K/V -> the persistent Gluon decode kernel (sm_90)")
    balance = ws and num_splits == 0 and BALANCED_SPLIT
    if ws and num_splits == 0:
        # one program per SM walks the (sequence, kv head, split) units: split only to give every SM a unit
        max_len = int(k_lens.max()) if len(k_lens) else 0
        num_splits = int(max(1, min(sms // programs, max_len // WS_MIN_KEYS_PER_SPLIT, 64)))
        reasons.append(f"{programs} (tile, kv head) units for {sms} SMs -> split-KV x{num_splits} (>= "
                       f"{WS_MIN_KEYS_PER_SPLIT} keys per split)")
        if balance:
            most, mean = _units_load(k_lens[tiles["short"][0]], num_kv_heads, num_splits, sms)
            balance = most > BALANCE_MIN_SKEW * mean
            reasons.append(f"busiest program's 64-key tiles / mean: {most} / {mean:.1f} "
                           + (f"> {BALANCE_MIN_SKEW} -> the balanced split" if balance else
                              f"<= {BALANCE_MIN_SKEW} -> the units"))
    elif num_splits == 0:
        max_len = int(k_lens.max()) if len(k_lens) else 0
        if programs >= sms:
            num_splits = 1
            reasons.append(f"{programs} programs (tiles x kv heads) >= {sms} SMs -> no split")
        else:
            # two waves of programs when each split still gets MIN_KEYS_PER_SPLIT keys (the prologue is paid once
            # per program); otherwise one wave, down to MIN_KEYS_SHORT keys per split. H100, B=1, GQA 32/8, page 16
            # (graph-timed): L=600 1/4/8/16 splits 22.4/11.9/10.4/9.9 us; L=8192 16 splits 28.6 us, 32 31.0;
            # L=32768 32 splits 56.5 us, 16 64.1
            # With few programs (batch 1) the splits use short key tiles (see _kernel_config), and two waves pay
            # from MIN_KEYS_FEW keys per split: B=1, L=4096 33 splits 14.8 us against 17 splits 17.3 (BLOCK_N 16)
            two = -(-2 * sms // programs)
            min_keys = MIN_KEYS_FEW if few else MIN_KEYS_PER_SPLIT
            if max_len // two >= min_keys:
                num_splits = int(min(two, 64))
                why = f"2 waves: {two} splits of >= {min_keys} keys"
            else:
                one = -(-sms // programs)
                num_splits = int(max(1, min(one, max_len // MIN_KEYS_SHORT, 64)))
                why = (f"1 wave: wanted {one}, at most longest {max_len} keys / {MIN_KEYS_SHORT}; 2 waves would "
                       f"leave < {min_keys} keys per split")
            reasons.append(f"{programs} programs < {sms} SMs -> split-KV x{num_splits} ({why})")
    else:
        reasons.append(f"num_splits={num_splits} fixed by the caller (batch-invariant results)")
    variant = "mixed" if n_short and n_long else ("extend" if n_long else "decode")
    launches = []
    for name, count in (("short", n_short), ("long", n_long)):
        if count == 0 and not (name == "short" and n_long == 0):
            continue
        cap = max(count, (max_tiles or 0), 1)
        bq = block_q[name]
        bm = max(16, triton.next_power_of_2(bq * group))
        if name == "long" and beside is not None:
            bn, warps, stages = beside[0]
        else:
            bn, warps, stages = _kernel_config(name, kv_dtype, head_dim, page_size, group, few and num_splits > 1)
        buf = torch.zeros(2 * cap + 1, dtype=torch.int32, device=device)
        ln = TileLaunch(name, bq, bm, bn, warps, stages, cap, buf[:cap], buf[cap:2 * cap], buf[2 * cap:])
        _fill(ln, *tiles[name])
        launches.append(ln)
    total_q = int(q_lens.sum())
    plan = PagedAttentionPlan(page_size, num_q_heads, num_kv_heads, head_dim, q_dtype, kv_dtype, num_splits,
                              launches, variant, len(q_lens), total_q, device, reasons, short_q_max=short_q_max,
                              ws_decode=ws, ws_maxnreg=beside[1] if beside is not None else 0)
    if ws and balance:
        # the Gluon kernel's balanced split: every SM gets the same number of key tiles (no idle SMs in a last,
        # partial wave of units); fixed split counts keep the units (batch-invariant)

        cap = plan.launches[0].capacity
        plan.balanced = [torch.zeros(balanced_table_size(cap, num_kv_heads, sms), dtype=torch.int32, device=device),
                         torch.empty(2 * sms, num_q_heads, head_dim, dtype=torch.float32, device=device),
                         torch.empty(2 * sms, num_q_heads, dtype=torch.float32, device=device)]
        _fill_balanced(plan.balanced[0], k_lens[tiles["short"][0]], num_kv_heads, sms, cap)
        reasons.append(f"num_splits=0 -> the Gluon kernel splits the batch's key tiles evenly over {sms} programs "
                       f"(calls with a left window run the split-KV units instead)")
    if num_splits > 1:
        cap_tokens = max(total_q, max_tokens or 0, 1)
        plan.workspace_o = torch.empty(num_splits, cap_tokens, num_q_heads, head_dim, dtype=torch.float32,
                                       device=device)
        plan.workspace_lse = torch.empty(num_splits, cap_tokens, num_q_heads, dtype=torch.float32, device=device)
    return plan
