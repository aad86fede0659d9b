"""Where kernels run: picks Triton's interpreter on machines with no GPU, before triton is imported."""
from __future__ import annotations

import os
import sys


def configure() -> None:
    """Set TRITON_INTERPRET=1 when no CUDA device exists and triton is not imported yet.

    Then every kernel runs on CPU tensors through the interpreter: slow but exact enough for tests and the demo.
    A user who sets TRITON_INTERPRET themselves keeps their choice.
    """
    if "TRITON_INTERPRET" in os.environ or "triton" in sys.modules:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def default_device():
    import torch

    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


_FACTS: dict = {}  # (what, device index) -> value, for devices CUDA has initialized


def _index(device):
    """The device index a fact is cached under: None -> 0 (what these functions read then), an int, a CUDA
    torch.device's index; None for the current device (torch.device("cuda")), which is not cached."""
    return device if isinstance(device, int) else (0 if device is None else getattr(device, "index", None))


def _device_fact(what: str, device, read, fallback):
    """read(device or 0) on a CUDA device, else ``fallback``; cached per device index once CUDA is initialized:
    every kernel launch asks for these, and torch's lookups (availability included) cost microseconds a call."""
    import torch

    idx = _index(device)
    if idx is not None and (what, idx) in _FACTS:
        return _FACTS[(what, idx)]
    if getattr(device, "type", "cuda") != "cuda" or not torch.cuda.is_available():
        return fallback
    value = read(device or 0)
    if idx is not None and torch.cuda.is_initialized():
        _FACTS[(what, idx)] = value
    return value


def num_sms(device=None) -> int:
    import torch

    # interpreter: a small pretend GPU (4 SMs) keeps split decisions testable
    return _device_fact("sms", device, lambda d: torch.cuda.get_device_properties(d).multi_processor_count, 4)


def gpu_name(device=None) -> str:
    import torch

    return _device_fact("name", device, torch.cuda.get_device_name, "cpu-interpreter")


_CAPABILITY: dict = {}


def capability(device=None):
    """(major, minor) compute capability of a CUDA device (cached); None for CPU tensors under the interpreter."""
    import torch

    if not torch.cuda.is_available() or (device is not None and getattr(device, "type", "cuda") != "cuda"):
        return None
    idx = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    if idx not in _CAPABILITY:
        _CAPABILITY[idx] = torch.cuda.get_device_capability(idx)
    return _CAPABILITY[idx]


def has_tma(device=None) -> bool:
    """Whether kernels on ``device`` may read through TMA tensor descriptors: sm_90 or newer, or the interpreter."""
    cap = capability(device)
    return cap is None or cap[0] >= 9


POISON_OUTPUTS = False  # tests set this: buffers from empty() start as NaN, so elements a kernel never writes show


def empty(*shape, dtype, device):
    """torch.empty for kernel outputs; filled with NaN while POISON_OUTPUTS is set (tests)."""
    import torch

    t = torch.empty(*shape, dtype=dtype, device=device)
    if POISON_OUTPUTS:
        t.fill_(float("nan") if t.is_floating_point() else -1)
    return t


_COUNTERS: dict = {}
COUNTER_SLOTS = 4096


def split_counters(device, slots: int = COUNTER_SLOTS, purpose: str = "split"):
    """A zeroed int32 buffer of ``slots`` counters: by default COUNTER_SLOTS arrival counters for split-K kernels
    that sum their own partials (the last program of an output tile to arrive adds the others' partials and
    resets its counter to 0); another ``purpose`` gets a buffer of its own (a kernel launched with PDL may start
    before the one ahead of it ends, so kernels of different kinds do not share counters).

    One buffer per (device, stream, purpose): kernels on one stream run one after another, so they can share it;
    two streams get different buffers. Returns None inside CUDA-graph capture when the stream has no buffer yet
    (allocating there would put it in the graph's private pool): callers then take a path without counters."""
    import torch

    if device.type != "cuda":
        key = (str(device), 0, purpose)
    else:
        key = (device.index if device.index is not None else torch.cuda.current_device(),
               torch.cuda.current_stream(device).cuda_stream, purpose)
    buf = _COUNTERS.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _COUNTERS[key] = torch.zeros(slots, dtype=torch.int32, device=device)
    return buf
