"""Test setup: Triton's interpreter when there is no GPU, the ``gpu`` marker, and a device fixture.

TRITON_INTERPRET must be set before triton is imported, so this runs before any llmkernels import.
"""
import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    """Where kernel tests put their tensors: CUDA on the GPU machine, CPU under the interpreter."""
    return torch.device("cuda") if HAS_GPU else torch.device("cpu")


@pytest.fixture(autouse=True)
def _seed(request):
    # a fresh but reproducible seed per test: inputs differ between cases, failures replay
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def _poison_outputs():
    # output buffers that kernels allocate themselves start as NaN, so elements a kernel never writes show
    from llmkernels import _runtime

    _runtime.POISON_OUTPUTS = True
    yield
    _runtime.POISON_OUTPUTS = False
