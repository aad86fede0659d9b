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

    def __init__(self, group, device: torch.device, dtype: torch.dtype, mode: str | None = None, note: str = ""):
        self.group = group
        self.mode = mode or os.environ.get("LLMK_ALLREDUCE", "auto")
        if self.mode not in MODES:
            raise ValueError(f"LLMK_ALLREDUCE must be auto, nccl or symm, got {self.mode!r}")
        self.buf = None
        self.why = "torch.distributed.all_reduce" + (f" ({note or 'asked for'})" if self.mode == "nccl" else "")
        if self.mode != "nccl" and device.type == "cuda":
            try:
                self._setup_symm(device, dtype)
                self.why = f"symmetric-memory one-shot up to {SYMM_MAX_BYTES} bytes, NCCL above"
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
