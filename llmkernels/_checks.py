"""Input checks for the public boundary.

Every public function validates its tensors here, so kernels can assume what the wrapper checked. Each check raises
``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong shape, device, layout or value) with a message that names
the argument, what it got and what was expected.
"""
from __future__ import annotations

import os
import weakref
from typing import Iterable, Sequence

import torch


def interpreter_mode() -> bool:
    """True when Triton kernels run through the interpreter (TRITON_INTERPRET=1): tensors then live on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, t, *, dtypes: Sequence[torch.dtype] | None = None, ndim: int | None = None,
                 shape: Sequence[int | None] | None = None, last_dim_contiguous: bool = False,
                 contiguous: bool = False) -> torch.Tensor:
    """Check one tensor argument. ``shape`` entries that are None match any size."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in ({_dtype_names(dtypes)}), got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None:
        want = tuple("*" if s is None else s for s in shape)
        if t.dim() != len(shape) or any(s is not None and s != g for s, g in zip(shape, t.shape)):
            raise ValueError(f"{name} must have shape {want} ('*' = any), got {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")
    return t


def check_device(**tensors) -> torch.device:
    """All given tensors (None entries skipped) on one device, CUDA unless kernels run through the interpreter."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = items[0]
    dev = first.device
    for n, t in items[1:]:
        if t.device != dev:
            raise ValueError(f"{n} is on {t.device} but {first_name} is on {dev}: all tensors must be on one device")
    if dev.type != "cuda" and not interpreter_mode():
        raise ValueError(f"{first_name} is on {dev}: kernels need CUDA tensors "
                         "(or TRITON_INTERPRET=1 to run them on the CPU through Triton's interpreter)")
    if interpreter_mode() and any(t.dtype == torch.bfloat16 for _, t in items):
        from ._interpreter import fix_interpreter

        if not fix_interpreter():
            name = next(n for n, t in items if t.dtype == torch.bfloat16)
            raise TypeError(f"{name} is bfloat16, which this Triton's interpreter cannot multiply correctly; use "
                            "float16 or float32 on the CPU, or a CUDA GPU")
    return dev


# cu_seqlens tensors whose values passed the checks: id -> (weak reference, version counter, total). A tensor seen
# again unchanged (same object, same version: no in-place write since) skips the device-to-host copy, so a layer
# loop or a benchmark that reuses one cu_seqlens syncs once instead of once per call.
_VALIDATED: dict = {}


def _version(t: torch.Tensor):
    try:
        return t._version
    except RuntimeError:  # inference tensors track no version: never cached
        return None


def check_cu_seqlens(name: str, t, batch: int | None = None, total: int | None = None,
                     validate_values: bool = True, max_len: tuple[str, int] | None = None) -> torch.Tensor:
    """int32 [batch+1] prefix sums: starts at 0, non-decreasing, ends at ``total``; with ``max_len`` = (argument
    name, value), no sequence longer than value (a smaller max_seqlen would leave rows unwritten).

    The value checks copy the tensor to the host (a sync) the first time a tensor is seen, and again only after it
    was written in place."""
    check_tensor(name, t, dtypes=(torch.int32,), ndim=1)
    if t.shape[0] < 2:
        raise ValueError(f"{name} must have batch+1 >= 2 entries, got shape {tuple(t.shape)}")
    if batch is not None and t.shape[0] != batch + 1:
        raise ValueError(f"{name} must have shape ({batch + 1},) (batch+1), got {tuple(t.shape)}")
    if validate_values and not _capturing():
        # one entry per (tensor, condition): the same tensor is often both cu_seqlens_q and cu_seqlens_k
        key, version = (id(t), total, max_len[1] if max_len else None), _version(t)
        seen = _VALIDATED.get(key)
        if version is not None and seen is not None and seen[0]() is t and seen[1] == version:
            return t
        v = t.cpu()
        if int(v[0]) != 0:
            raise ValueError(f"{name}[0] must be 0, got {int(v[0])}")
        if bool((v[1:] < v[:-1]).any()):
            raise ValueError(f"{name} must be non-decreasing, got {v.tolist()[:16]}")
        if total is not None and int(v[-1]) != total:
            raise ValueError(f"{name}[-1] must equal the number of tokens {total}, got {int(v[-1])}")
        if max_len is not None:
            longest = int((v[1:] - v[:-1]).max())
            if longest > max_len[1]:
                raise ValueError(f"{max_len[0]} is {max_len[1]} but {name} holds a sequence of {longest} tokens: it "
                                 f"must be at least the longest length")
        if version is not None:
            if len(_VALIDATED) >= 1024:  # dead entries are few in practice; bound the table anyway
                _VALIDATED.clear()
            _VALIDATED[key] = (weakref.ref(t), version)
    return t


def check_choice(name: str, value, choices: Iterable) -> None:
    choices = list(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_positive_int(name: str, value, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _capturing() -> bool:
    """Inside CUDA-graph capture or a torch.compile trace, value checks (which sync) are skipped."""
    # is_initialized: no capture can run before CUDA is initialized, and it is cheaper than is_available
    if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
        return True
    try:
        return torch.compiler.is_compiling()
    except AttributeError:  # older torch
        return False


def call_op(op, impl, *args):
    """Run a registered op: straight to its implementation in eager mode (no dispatcher overhead, tens of us at
    decode sizes), through ``torch.library`` while torch.compile traces."""
    if _capturing_compile():
        return op(*args)
    return impl(*args)


def _capturing_compile() -> bool:
    try:
        return torch.compiler.is_compiling()
    except AttributeError:
        return False
