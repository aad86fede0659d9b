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


def num_sms(device=None) -> int:
    import torch

    if torch.cuda.is_available() and (device is None or getattr(device, "type", "cuda") == "cuda"):
        return torch.cuda.get_device_properties(device or 0).multi_processor_count
    return 4  # interpreter: a small pretend GPU keeps split decisions testable


def gpu_name(device=None) -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(device or 0)
    return "cpu-interpreter"


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


def split_counters(device):
    """A zeroed int32 buffer of COUNTER_SLOTS arrival counters for split-K kernels that sum their own partials
    (the last program of an output tile to arrive adds the others' partials and resets its counter to 0).

    One buffer per (device, stream): kernels on one stream run one after another, so they can share it; two streams
    get different buffers. Returns None inside CUDA-graph capture when the stream has no buffer yet (allocating
    there would put it in the graph's private pool): callers then sum the partials with a separate kernel."""
    import torch

    if device.type != "cuda":
        key = (str(device), 0)
    else:
        key = (device.index if device.index is not None else torch.cuda.current_device(),
               torch.cuda.current_stream(device).cuda_stream)
    buf = _COUNTERS.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _COUNTERS[key] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return buf
