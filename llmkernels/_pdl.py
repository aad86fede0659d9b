"""Programmatic dependent launch (PDL, sm_90+): a kernel may start while the kernel before it on the stream is still
running and wait there for that kernel's results; its launch and setup overlap the other kernel's last programs.

The contract, for every kernel launched with ``launch_pdl=True``:
- it loads and stores nothing before ``pdl_wait``;
- ``pdl_wait`` blocks until the previous kernel has finished and its writes are visible. Since that kernel also
  waited for its own predecessor before finishing, every earlier kernel has finished too;
- ``pdl_trigger`` (called after the wait) lets the next kernel start early. Called before the wait it would let a
  chain of waiting kernels pile up on the GPU. Long kernels call it after their main loop: called right after the
  wait, the next GEMV's programs took their SM slots early and a Llama-3-8B layer's four q4_k GEMVs ran 17% slower
  on an H100 (88.8 us against 75.7 without PDL and 73.3 with the late trigger; bench/NOTES.md).
A kernel that is launched without the flag starts after the previous one finishes, as usual; calling
``pdl_wait``/``pdl_trigger`` in it does nothing. The interpreter has no PDL: the flags are off there.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl


_CAPABLE: dict = {}


def pdl_supported(device) -> bool:
    """Whether kernels on ``device`` are launched with ``launch_pdl=True``: a CUDA device of sm_90 or newer, not the
    interpreter. ``LLMK_PDL=0`` in the environment turns it off (read at each launch, for A/B timing)."""
    if os.environ.get("LLMK_PDL", "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if getattr(device, "type", None) != "cuda":
        return False
    import torch

    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CAPABLE:
        _CAPABLE[idx] = torch.cuda.get_device_capability(device)[0] >= 9
    return _CAPABLE[idx]


def pdl_options(pdl: bool) -> dict:
    """Launch options of a kernel whose PDL constexpr is ``pdl``."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the previous kernel of the stream (no-op unless PDL)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_trigger(PDL: tl.constexpr):
    """Let the next kernel of the stream launch once every program of this one has passed here (no-op unless
    PDL)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
