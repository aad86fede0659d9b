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
