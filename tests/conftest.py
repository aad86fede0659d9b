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

# pytest-xdist workers share the cores: one torch thread pool per core, not per worker (on the GPU machine too: 12
# workers with a pool of every core each spent minutes in CPU-side quantization and compiles)
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    # LLMK_TEST_TIMES=path: one line per test as it finishes (seconds, outcome, id), written by the process that
    # collects the reports (xdist's controller), so that a run stopped at a time limit still says where time went
    path = os.environ.get("LLMK_TEST_TIMES")
    slow_setup = report.when == "setup" and report.duration > 1.0  # session fixtures building models
    if path and (report.when == "call" or slow_setup) and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(path, "a") as f:
            f.write(f"{report.duration:9.2f} {report.when:<5} {report.outcome:<8} {report.nodeid}\n")


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


@pytest.fixture(scope="session")
def model_files(tmp_path_factory):
    """make(arch, fmt, **kw) -> (checkpoint dir, gguf path, transformers model); built once per session."""
    pytest.importorskip("transformers")
    from llmkernels.engine import convert_hf_to_gguf
    from llmkernels.testing.tiny_models import make_checkpoint

    root = tmp_path_factory.mktemp("models")
    cache = {}

    def make(arch="llama", fmt="f32", **kw):
        key = (arch, tuple(sorted(kw.items())))
        if key not in cache:
            d = root / f"{arch}-{len(cache)}"
            cache[key] = (str(d), make_checkpoint(str(d), arch, **kw), {})
        d, hf, ggufs = cache[key]
        if fmt not in ggufs:
            ggufs[fmt] = convert_hf_to_gguf(d, os.path.join(d, f"model-{fmt}.gguf"), fmt, progress=False)
        return d, ggufs[fmt], hf

    return make
