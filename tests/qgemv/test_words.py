"""The q4_0 / q8_0 small-M kernel that reads aligned groups of blocks as words (qgemv/words.py): every group size
(word vectors of 1, 2 and 4 words), several activation rows per program, split-K with and without the in-kernel
sum, bf16 activations, against x @ dequantize(W).T in float64; and the routing conditions."""
import pytest
import torch

import llmkernels as lk
from llmkernels._checks import interpreter_mode
from llmkernels.qgemv.ops import _finish
from llmkernels.qgemv.words import launch_words, words_layout, words_supports
from llmkernels.testing import assert_close, gemv_ref


def _check(fmt, N, K, M, config, sms, dtype, device, **kw):
    qt = lk.quantize(torch.randn(N, K) * 0.05, fmt).to(device)
    x = torch.randn(M, K, dtype=dtype, device=device)
    y = _finish(launch_words(x, qt.data, fmt, N, K, config, sms, 1 if interpreter_mode() else 2, **kw), dtype)
    ref = gemv_ref(x, qt)
    tol = 4e-3 if dtype == torch.float16 else 2e-2
    assert y.shape == (M, N) and y.dtype == dtype
    assert_close(y, ref, dtype, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
@pytest.mark.parametrize("N,K,config,sms", [
    (37, 512, (2, 2, 1, 1), 4),    # 2 blocks per step: single-word vectors; rows not a multiple of the tile
    (19, 768, (2, 4, 1, 1), 1),    # 4 blocks per step: 2-word vectors (q4_0) / 2-word (q8_0), 6 steps, no split
    (130, 256, (2, 8, 2, 1), 64),  # 8 blocks per step: 4-word vectors, one step per row, more programs than steps
    (21, 1024, (4, 8, 1, 1), 3),   # four rows per thread, K split unevenly
    (37, 2048, (2, 8, 1, 1, 8), 4),  # lanes along K: 8 neighbouring groups of a row per warp load
    (45, 4096, (1, 8, 1, 1, 4), 8),  # 4 lanes along K with K split in 4 (one 4-group step per split)
    (19, 768, (2, 4, 1, 1, 8), 1),  # 6 groups: not a multiple of 8 lanes, so one lane per row
])
def test_words_kernel(fmt, N, K, config, sms, device):
    assert words_layout(fmt, config[1]) is not None
    _check(fmt, N, K, 1, config, sms, torch.float16, device)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
@pytest.mark.parametrize("M,rows_per_program,fixup,dtype", [
    (2, 4, True, torch.bfloat16), (3, 2, False, torch.float16), (5, 4, True, torch.float16),
    (4, 4, False, torch.bfloat16)])
def test_words_rows_per_program(fmt, M, rows_per_program, fixup, dtype, device):
    """Activation rows share the unpacked codes; surplus rows of the last program read a real row, are not stored."""
    _check(fmt, 45, 512, M, (2, 4, 1, 1), 8, dtype, device, fixup=fixup, rows_per_program=rows_per_program)


def test_words_supports_and_routing(device):
    """The kernel takes fp16/bf16 x with 4-byte aligned rows, K a multiple of 256 and 16-byte aligned weights;
    gemv gives the same answer through the planes kernel when one of them fails."""
    K = 512
    qt = lk.quantize(torch.randn(24, K) * 0.05, "q4_0").to(device)
    buf = torch.randn(2 * K + 1, dtype=torch.float16, device=device)
    x = buf[:K].view(1, K)
    x_odd = buf[1:K + 1].view(1, K)  # 2-byte aligned only
    assert words_supports(x, qt.data, "q4_0", K)
    assert not words_supports(x_odd, qt.data, "q4_0", K)
    assert not words_supports(x.float(), qt.data, "q4_0", K)
    assert not words_supports(x, qt.data, "q4_k", K)
    qt_short = lk.quantize(torch.randn(24, 288) * 0.05, "q4_0").to(device)
    assert not words_supports(torch.randn(1, 288, dtype=torch.float16, device=device), qt_short.data, "q4_0", 288)
    for xi in (x, x_odd):
        ref = gemv_ref(xi, qt)
        assert_close(lk.gemv(xi, qt), ref, torch.float16, atol=4e-3 * ref.abs().max().item(), rtol=4e-3)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_words_one_row_per_thread(fmt, device):
    """R = 1 with 4 warps and split-K summed in the kernel: on an H100 this returned wrong sums until the arrival
    count got a barrier before it (the count's atomic runs in one thread; other warps were still storing)."""
    interp = interpreter_mode()
    for _ in range(1 if interp else 5):  # a race shows up in some launches only
        _check(fmt, 300 if interp else 14336, 1024, 1, (1, 4, 4, 1 if interp else 3), 8 if interp else 132,
               torch.float16, device)
        _check(fmt, 300 if interp else 14336, 1024, 1, (1, 4, 4, 1 if interp else 3, 8), 8 if interp else 132,
               torch.float16, device)
