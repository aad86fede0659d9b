"""All-reduce of a tensor-parallel step's partial sums: NCCL (torch.distributed), or a one-shot all-reduce over CUDA
symmetric memory for the small messages of decode steps.

A one-shot all-reduce has every rank copy its partials into a buffer the others can read over NVLink, then each rank
sums all the buffers itself: one synchronisation, where NCCL's ring pays several steps of latency on messages of a
few kilobytes. ``torch.distributed._symmetric_memory`` provides the buffers and the kernel (no multicast: it stays
off on shared machines). ``LLMK_ALLREDUCE`` picks: ``nccl``, ``symm`` (symmetric memory up to ``SYMM_MAX_BYTES``,
NCCL above) or ``auto`` (the default: ``symm`` where it can be set up, else NCCL).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

SYMM_MAX_BYTES = 1 << 20  # decode steps up to batch 128 at hidden 4096 in bf16
MODES = ("auto", "nccl", "symm")
_symm_used = False  # this process has entered a symmetric-memory rendezvous (see engine_mode)


def engine_mode(requested: str | None = None) -> tuple[str, str]:
    """(mode, note) that every rank of a new tensor-parallel engine uses, decided on rank 0 (the workers get it
    with their spec). torch numbers its symmetric-memory rendezvous exchanges per process, and an engine's workers
    are new processes: after an earlier engine in this process rendezvoused, rank 0 would wait on keys no worker
    writes. There ``auto`` takes NCCL and ``symm`` is refused."""
    mode = requested or os.environ.get("LLMK_ALLREDUCE", "auto")
    if mode not in MODES:
        raise ValueError(f"LLMK_ALLREDUCE must be auto, nccl or symm, got {mode!r}")
    if _symm_used and mode != "nccl":
        note = "symmetric memory was set up by an earlier engine in this process, which torch allows once"
        if mode == "symm":
            raise RuntimeError(f"LLMK_ALLREDUCE=symm: {note}; use auto or nccl, or one engine per process")
        return "nccl", note
    return mode, ""


def _group_name(group) -> str:
    import torch.distributed as dist

    return (group if group is not None else dist.group.WORLD).group_name


class AllReduce:
    """Sum over the ranks of ``group`` of a tensor: ``ar(x)`` returns the sum (``x`` itself, summed in place, or a new
    tensor); callers use the returned tensor."""

    def __init__(self, group, device: torch.device, dtype: torch.dtype, mode: str | None = None, note: str = "",
                 hidden: int = 0):
        self.group = group
        self.fused = None  # FusedRows: add_rmsnorm's in-kernel all-reduce of rows of ``hidden`` (symmetric memory)
        self.mode = mode or os.environ.get("LLMK_ALLREDUCE", "auto")
        if self.mode not in MODES:
            raise ValueError(f"LLMK_ALLREDUCE must be auto, nccl or symm, got {self.mode!r}")
        self.buf = None
        self.why = "torch.distributed.all_reduce" + (f" ({note or 'asked for'})" if self.mode == "nccl" else "")
        if self.mode != "nccl" and device.type == "cuda":
            try:
                self._setup_symm(device, dtype)
                self.why = f"symmetric-memory one-shot up to {SYMM_MAX_BYTES} bytes, NCCL above"
                if hidden and dtype in (torch.float16, torch.bfloat16) and os.environ.get("LLMK_FUSED_ALLREDUCE",
                                                                                        "1") != "0":
                    import torch.distributed as dist

                    self.fused = FusedRows(self.name, dist.get_world_size(self.group), device, dtype, hidden)
                    self.why += f"; fused into add_rmsnorm up to {self.fused.rows} rows"
            except (RuntimeError, AttributeError, ImportError) as e:
                if self.mode == "symm":
                    raise RuntimeError(f"LLMK_ALLREDUCE=symm: symmetric memory could not be set up: {e}") from e
                self.why = f"torch.distributed.all_reduce (symmetric memory unavailable: {e})"

    def _setup_symm(self, device, dtype) -> None:
        # every rank builds the model in the same order, so the rendezvous below meets on all of them
        import torch.distributed._symmetric_memory as symm_mem

        self.name = _group_name(self.group)
        ops = torch.ops.symm_mem
        # the _copy variant stages the input into the symmetric buffer inside the reducing kernel: one launch, not 3
        self.copy_op = getattr(ops, "one_shot_all_reduce_copy", None)
        self.op = ops.one_shot_all_reduce
        buf = symm_mem.empty(SYMM_MAX_BYTES // dtype.itemsize, dtype=dtype, device=device)
        buf.zero_()
        global _symm_used
        _symm_used = True  # from here on this process's rendezvous count has moved, whatever happens next
        symm_mem.rendezvous(buf, self.name)
        self.buf = buf

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        if self.buf is not None and x.dtype == self.buf.dtype and n <= self.buf.numel() and x.is_contiguous():
            b = self.buf[:n]
            if self.copy_op is not None and x.data_ptr() % 16 == 0:  # the op wants input and buffer equally aligned
                return self.copy_op(b, x.view(-1), "sum", self.name).view(x.shape)
            b.copy_(x.view(-1))
            return self.op(b, "sum", self.name).view(x.shape)
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x


# --- the all-reduce fused into add_rmsnorm ------------------------------------------------------------------------
# A decode step's row-parallel partials feed a residual add and an RMSNorm. One kernel can do all three: each row's
# program stages its partial in this rank's symmetric buffer, signals the peers, waits for theirs and sums every
# rank's row over NVLink before the norm: one launch where the one-shot all-reduce and add_rmsnorm take two.
FUSED_SPIN_LIMIT = 1 << 26  # polls of a peer's flag (tens of seconds) before the kernel traps rather than hang


@triton.jit
def _trap(v):
    return tl.inline_asm_elementwise("trap; mov.b32 $0, $1;", "=r,r", [v], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def peer_sum(x, row, cols, mask, H, PTRS, CNT, rows, flag_off, rank, WORLD: tl.constexpr, SPIN: tl.constexpr):
    """Row ``row`` of x (H wide, elements at ``cols``) summed over the WORLD ranks, each running this on its own
    partial x of the same row.

    PTRS [WORLD] int64: each rank's symmetric buffer (2 slots of ``rows`` rows of H, then int32 flags
    [rows, WORLD] at byte ``flag_off``); CNT [rows] int32: this rank's count of the row's sums so far. The counts
    move alike on every rank (they run the same steps), so the n-th sum of a row waits for flag >= n from each peer:
    no flag is ever reset, and CUDA graphs replay the kernel with its arguments as captured. Slots alternate
    between odd and even sums; one is written again two sums later, when every peer has passed the next sum's
    barrier and so has finished reading it. Each rank stores its row in its own buffer and reads the peers'. The sum
    runs over the ranks in order in float32 on every rank: every rank gets the same bits."""
    n = tl.load(CNT + row) + 1  # stored back after the barriers below, once every warp has read the old count
    par = n & 1
    base = tl.load(PTRS + rank)
    at = (par * rows + row) * H + cols
    tl.store(tl.multiple_of(base.to(tl.pointer_type(x.dtype)), 16) + at, x, mask=mask)
    tl.debug_barrier()  # every thread's part of the row is stored before the one thread's release below
    for r in tl.static_range(WORLD):
        if r != rank:  # flag [row, rank] in peer r's buffer
            peer_flags = (tl.load(PTRS + r) + flag_off).to(tl.pointer_type(tl.int32))
            tl.atomic_add(peer_flags + row * WORLD + rank, 1, sem="release", scope="sys")
    own_flags = (base + flag_off).to(tl.pointer_type(tl.int32))
    for r in tl.static_range(WORLD):
        if r != rank:
            f = own_flags + row * WORLD + r
            seen = tl.atomic_add(f, 0, sem="acquire", scope="sys")
            polls = 0
            while seen - n < 0:  # wrap-safe: counts are compared as a difference
                seen = tl.atomic_add(f, 0, sem="acquire", scope="sys")
                polls += 1
                if polls > SPIN:  # a peer is gone: fail the launch rather than spin forever
                    seen = _trap(seen) + n
    tl.debug_barrier()
    tl.store(CNT + row, n)
    acc = tl.zeros(x.shape, dtype=tl.float32)
    for r in tl.static_range(WORLD):
        if r == rank:
            acc += x.to(tl.float32)
        else:
            p = tl.multiple_of(tl.load(PTRS + r).to(tl.pointer_type(x.dtype)), 16)
            acc += tl.load(p + at, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    return acc.to(x.dtype)


class FusedRows:
    """The symmetric buffer, flags and counts of ``peer_sum`` for rows of ``hidden`` elements of ``dtype``: up to
    ``rows`` rows a call (SYMM_MAX_BYTES of partials, and no more rows than SMs). Made on every rank in the same order
    (a rendezvous)."""

    def __init__(self, group_name: str, world: int, device: torch.device, dtype: torch.dtype, hidden: int):
        import torch.distributed._symmetric_memory as symm_mem

        if world > 64:
            raise ValueError(f"the fused all-reduce supports up to 64 ranks, got {world}")
        self.hidden, self.dtype = hidden, dtype
        # at most one row per SM: every row's program must be resident at once, or two ranks could each wait on
        # rows the other has not started
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.rows = max(1, min(SYMM_MAX_BYTES // (hidden * dtype.itemsize), sms))
        data = 2 * self.rows * hidden * dtype.itemsize
        self.flag_off = -(-data // 128) * 128
        buf = symm_mem.empty(self.flag_off + 4 * self.rows * 64, dtype=torch.uint8, device=device)
        buf.zero_()  # flags start at 0 before any peer can know where they are
        hdl = symm_mem.rendezvous(buf, group_name)
        self.world, self.rank = hdl.world_size, hdl.rank
        self.buf = buf  # kept alive: the peers read it
        self.ptrs = torch.tensor(hdl.buffer_ptrs, dtype=torch.int64, device=device)
        self.counts = torch.zeros(self.rows, dtype=torch.int32, device=device)

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.dim() == 2 and x.shape[1] == self.hidden and 0 < x.shape[0] <= self.rows
