"""The batch-1 kernel with block scales factored out (qgemv/m1.py), for every format it handles, every tile shape
class (rows per thread, blocks per step, split-K) and both unpacking paths (the Triton expression runs everywhere,
the inline PTX only on the GPU), against x @ dequantize(W).T in float64."""
import pytest
import torch

import llmkernels as lk
from llmkernels._checks import interpreter_mode
from llmkernels.qgemv.m1 import M1_LAYOUTS, launch_m1
from llmkernels.qgemv.ops import _finish
from llmkernels.testing import assert_close, gemv_ref

FORMATS = sorted(M1_LAYOUTS)


def _run(fmt, N, K, config, sms, unpack, dtype, device):
    qt = lk.quantize(torch.randn(N, K) * 0.05, fmt).to(device)
    x = torch.randn(1, K, dtype=dtype, device=device)
    y = _finish(launch_m1(x, qt.data, fmt, N, K, config, sms, unpack), dtype)
    ref = gemv_ref(x, qt)
    tol = 4e-3 if dtype == torch.float16 else 2e-2
    assert y.shape == (1, N) and y.dtype == dtype
    assert_close(y, ref, dtype, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("N,K,config,sms", [
    (37, 512, (1, 1, 1, 1), 4),    # rows not a multiple of the tile, split-K into single blocks
    (19, 768, (2, 2, 1, 1), 1),    # two rows per thread, two blocks per step, K split unevenly (3 q4_k blocks)
    (130, 256, (1, 1, 2, 1), 64),  # more programs than blocks: the split is capped by the block count
])
def test_m1_kernel(fmt, N, K, config, sms, device):
    _run(fmt, N, K, config, sms, 1 if interpreter_mode() else 2, torch.float16, device)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("unpack", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_m1_kernel_gpu(fmt, unpack, dtype, device):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for N, K, config in [(4096, 4096, (4, 1, 4, 3)), (1001, 14336, (2, 2, 8, 1)), (77, 1024, (1, 1, 4, 3))]:
        _run(fmt, N, K, config, sms, unpack, dtype, device)


@pytest.mark.parametrize("fixup", [True, False])
def test_m1_split_k_sum_in_kernel_or_after(fixup, device):
    """With fixup the last program of each output tile sums the split-K partials and resets its arrival counter,
    so repeated calls (as in a replayed CUDA graph) stay right; without it ops._finish sums them."""
    from llmkernels._runtime import split_counters

    N, K = 70, 1024
    qt = lk.quantize(torch.randn(N, K) * 0.05, "q4_k").to(device)
    for M in (1, 3):
        x = torch.randn(M, K, dtype=torch.float16, device=device)
        for _ in range(2):
            y = launch_m1(x, qt.data, "q4_k", N, K, (1, 1, 1, 1), 64, 1 if interpreter_mode() else 2,
                          fixup=fixup)
            assert y.shape[0] == (1 if fixup else 4)  # 4 super-blocks, one per split
            ref = gemv_ref(x, qt)
            assert_close(_finish(y, x.dtype), ref, torch.float16, atol=4e-3 * ref.abs().max().item(), rtol=4e-3)
    assert int(split_counters(x.device).abs().sum()) == 0


def test_gemv_q4k_weights_not_16_byte_aligned(device):
    """Block bytes wrapped at an offset that is not a multiple of 16 (QuantizedTensor.from_raw on a slice): gemv
    does not take the kernels that read int32 header words, and stays right."""
    from llmkernels.quant.tensor import QuantizedTensor

    N, K = 33, 512
    qt = lk.quantize(torch.randn(N, K) * 0.05, "q4_k").to(device)
    buf = torch.zeros(qt.data.numel() + 2, dtype=torch.uint8, device=device)
    buf[2:] = qt.data.reshape(-1)
    shifted = QuantizedTensor.from_raw(buf[2:].view(N, -1), "q4_k", (N, K))
    assert shifted.data.data_ptr() % 16 == 2
    for M in (1, 6):
        x = torch.randn(M, K, dtype=torch.float16, device=device)
        ref = gemv_ref(x, qt)
        assert_close(lk.gemv(x, shifted), ref, torch.float16, atol=4e-3 * ref.abs().max().item(), rtol=4e-3)
