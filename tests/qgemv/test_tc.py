"""The tensor-core kernel for q4_k, q5_k, q6_k, q4_0, q8_0 and MLX 4-bit (qgemv/tc.py) against
x @ dequantize(W).T in float64: tile edges, split-K, M classes, group sizes, and on the GPU fp16 and bf16 at model
shapes, through gemv and directly."""
import pytest
import torch

import llmkernels as lk
from llmkernels._checks import interpreter_mode
from llmkernels.qgemv.ops import _finish
from llmkernels.qgemv.tc import launch_tc
from llmkernels.testing import assert_close, gemv_ref

TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2}


def _check(y, x, qt, dtype):
    ref = gemv_ref(x, qt)
    assert y.shape == ref.shape and y.dtype == dtype
    assert_close(y, ref, dtype, atol=TOL[dtype] * ref.abs().max().item(), rtol=TOL[dtype])


@pytest.mark.parametrize("N,K,M,config,sms", [
    (37, 512, 5, (16, 4, 1, 2), 4),     # rows not a multiple of the tile, K split into single super-blocks
    (70, 768, 16, (16, 4, 1, 2), 1),    # one program column, three super-blocks, no split
    (130, 256, 9, (64, 4, 1, 2), 64),   # more programs than blocks: the split is capped by the block count
    (45, 512, 29, (32, 4, 1, 2), 2),    # 32 activation rows per program, 3 of them padding
    (21, 256, 64, (16, 4, 1, 2), 3),    # 64 activation rows in one program
    (19, 512, 3, (16, 4, 1, 2), 2),     # 3 rows: 13 of the 16 padding
    (37, 512, 2, (16, 4, 1, 2, 0, 128), 4),  # a register cap (a compile option; the interpreter ignores it)
])
@pytest.mark.parametrize("fmt", ["q4_k", "q5_k"])
def test_tc_kernel(fmt, N, K, M, config, sms, device):
    """q4_k and q5_k (whose 5th bits come from qh: bits 2t, 2t + 1 of the byte for lane chunk t; the weights' spread
    over rows puts codes 0 and 31 in every super-block)."""
    qt = lk.quantize(torch.randn(N, K, device=device) * torch.logspace(-3, 0, N, device=device)[:, None], fmt)
    x = torch.randn(M, K, dtype=torch.float16, device=device)
    y = launch_tc(x, qt.data, N, K, config, sms, 1 if interpreter_mode() else 2, fmt=fmt)
    _check(_finish(y, x.dtype), x, qt, torch.float16)


@pytest.mark.parametrize("fmt,K", [("q4_k", 1024), ("q6_k", 2048), ("q8_0", 768)])
def test_tc_fixup(fmt, K, device):
    """Split-K partials summed by the kernel's last program per tile (fixup) give the bits of the separate sum
    kernel (same order), with M = 1, 5 and 17 (two activation tiles) and more tiles than one wave; the arrival
    counters are back to zero afterwards."""
    from llmkernels._runtime import split_counters
    from llmkernels.qgemv.ops import split_k

    qt = lk.quantize(torch.randn(45, K, device=device) * 0.05, fmt)
    for M in (1, 5, 17):
        x = torch.randn(M, K, dtype=torch.float16, device=device)
        unpack = 1 if interpreter_mode() else 2
        y1 = launch_tc(x, qt.data, 45, K, (16, 4, 1, 8), 8, unpack, fmt=fmt)  # 3 or 6 tiles x 4 or 8 splits
        y0 = launch_tc(x, qt.data, 45, K, (16, 4, 1, 8), 8, unpack, fmt=fmt, fixup=False)
        assert y1.shape == (1, M, 45) and y0.shape[0] > 1 and y0.dtype == torch.float32
        assert torch.equal(y1[0], _finish(y0, x.dtype))
        _check(y1[0], x, qt, torch.float16)
    assert not split_counters(x.device).any()
    # only a grid of at most waves x SMs programs sums in the kernel; past that the partials come back
    fused = []
    for sms in (4, 5):
        split, _ = split_k(3, K // 256, 1, sms, 2)
        y = launch_tc(x, qt.data, 45, K, (16, 4, 1, 2), sms, unpack, fmt=fmt)
        assert y.shape[0] == (1 if 3 * split <= 2 * sms else split)
        fused.append(y.shape[0] == 1)
        _check(_finish(y, x.dtype), x, qt, torch.float16)
    assert not all(fused)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
@pytest.mark.parametrize("N,K,M,config,sms", [
    (37, 512, 5, (16, 4, 1, 2), 4),     # rows not a multiple of the tile, K split into single steps of 8 blocks
    (19, 768, 16, (32, 4, 1, 2), 1),    # three steps, no split, a 32-row tile over 19 rows
    (45, 512, 29, (16, 4, 1, 2), 2),    # 32 activation rows per program, 3 of them padding
    (130, 256, 3, (64, 4, 1, 2), 64),   # more programs than steps: the split is capped by the step count
    (37, 768, 1, (16, 4, 1, 2, 1), 2),  # the next step's weights loaded ahead: uneven splits of 3 steps
    (45, 256, 2, (16, 4, 1, 2, 1), 64), # ahead with single-step splits (the load past the split is masked)
])
def test_tc_kernel_legacy(fmt, N, K, M, config, sms, device):
    """q4_0 / q8_0: each lane's two blocks start 4t bytes past a 16-byte boundary (all four shifts in every step);
    scales of both signs and sizes (the block's absmax sets d), codes -8..7 / -128..127."""
    w = torch.randn(N, K) * torch.logspace(-3, 1, N)[:, None]
    w[::5, :32] = -w[::5, :32].abs()  # blocks whose extreme code is -8 / -128
    qt = lk.quantize(w, fmt).to(device)
    x = torch.randn(M, K, dtype=torch.float16, device=device)
    y = launch_tc(x, qt.data, N, K, config, sms, 1 if interpreter_mode() else 2, fmt=fmt)
    _check(_finish(y, x.dtype), x, qt, torch.float16)


@pytest.mark.parametrize("N,K,M,config,sms", [
    (37, 2048, 5, (16, 4, 1, 2), 4),    # rows not a multiple of the tile, K split: blocks at all 8 offsets mod 16
    (19, 4096, 16, (32, 4, 1, 2), 1),   # one program column, 16 blocks, no split, a 32-row tile over 19 rows
    (45, 2048, 29, (16, 4, 1, 2), 40),  # 32 activation rows per program; single-block splits at odd blocks
])
def test_tc_kernel_q6k(N, K, M, config, sms, device):
    """q6_k: 210-byte blocks start 2 (kb % 8) bytes past a 16-byte boundary, so each block's words are shifted into
    place by the program (_shift_words); signed 6-bit codes and int8 scales of both signs."""
    w = torch.randn(N, K) * torch.logspace(-3, 0, N)[:, None]
    w[::3, :16] = -w[::3, :16].abs() * 4  # sub-blocks whose scale comes out negative
    qt = lk.quantize(w, "q6_k").to(device)
    x = torch.randn(M, K, dtype=torch.float16, device=device)
    y = launch_tc(x, qt.data, N, K, config, sms, 1 if interpreter_mode() else 2, fmt="q6_k")
    _check(_finish(y, x.dtype), x, qt, torch.float16)


@pytest.mark.parametrize("N,K,M,gs,sdt", [
    (37, 512, 5, 64, torch.float16),   # rows not a multiple of the tile, K split
    (20, 768, 3, 32, torch.float16),   # group 32: two groups per lane chunk
    (45, 512, 17, 128, torch.float16), # group 128: one group over two lanes; 32 rows per program
    (70, 256, 9, 64, torch.bfloat16),  # bf16 scales with fp16 x
])
def test_tc_kernel_mlx(N, K, M, gs, sdt, device):
    qt = lk.quantize(torch.randn(N, K, device=device) * 0.05, "mlx", bits=4, group_size=gs, scale_dtype=sdt)
    x = torch.randn(M, K, dtype=torch.float16, device=device)
    y = launch_tc(x, qt.data, N, K, (16, 4, 1, 2), 4, 1 if interpreter_mode() else 2, qt.scales, qt.biases, gs)
    _check(_finish(y, x.dtype), x, qt, torch.float16)


def test_gemv_takes_tc_for_mlx4(device, monkeypatch):
    """MLX 4-bit at M = 2..64, and at M = 1 from K = route.TC_LONG_K, goes to the tensor-core kernel; 8-bit, K not a
    multiple of 256 and M = 1 with a shorter K do not."""
    from llmkernels.qgemv import tc

    calls = []
    real = tc.launch_tc
    monkeypatch.setattr(tc, "launch_tc", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    for bits, K, M in ((4, 256, 1), (4, 256, 2), (4, 256, 3), (4, 256, 16), (8, 256, 8), (4, 320, 8), (4, 8192, 1)):
        qt = lk.quantize(torch.randn(24, K, device=device) * 0.05, "mlx", bits=bits, group_size=64)
        x = torch.randn(M, K, dtype=torch.float16, device=device)
        _check(lk.gemv(x, qt), x, qt, torch.float16)
    assert calls == [(2, 256), (3, 256), (16, 256), (1, 8192)]


def test_gemv_takes_tc_for_mid_m(device, monkeypatch):
    """gemv routes q4_k at M = 2..64 (fp16/bf16) to the tensor-core kernel (M = 2 only on wide matrices for the
    formats whose route.TC_FIRST_M is 3); fp32 activations, silu_mul_gemv at M <= 4 and other M elsewhere."""
    from llmkernels.qgemv import route, tc

    calls = []
    real = tc.launch_tc
    monkeypatch.setattr(tc, "launch_tc", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    qt = lk.quantize(torch.randn(40, 256, device=device) * 0.05, "q4_k")
    for M in (1, 2, 3, 4, 16, 17, 64, 65):
        x = torch.randn(M, 256, dtype=torch.float16, device=device)
        _check(lk.gemv(x, qt), x, qt, torch.float16)
    y = lk.gemv(torch.randn(6, 256, device=device), qt)  # fp32 x: the planes kernel
    assert y.dtype == torch.float32
    lk.silu_mul_gemv(torch.randn(3, 256, dtype=torch.float16, device=device),
                     torch.randn(3, 256, dtype=torch.float16, device=device), qt)
    assert calls == [(2, 256), (3, 256), (4, 256), (16, 256), (17, 256), (64, 256)]
    monkeypatch.setitem(route.TC_FIRST_M, "q4_k", 3)  # M = 2 only on wide matrices
    monkeypatch.setitem(route.TC_FIRST_M_LARGE, "q4_k", 2)
    x = torch.randn(2, 256, dtype=torch.float16, device=device)
    _check(lk.gemv(x, qt), x, qt, torch.float16)
    assert len(calls) == 6
    monkeypatch.setattr(route, "TC_WIDE_N", 40)
    _check(lk.gemv(x, qt), x, qt, torch.float16)
    assert calls[-1] == (2, 256) and len(calls) == 7


@pytest.mark.parametrize("fmt,M,config,sms", [
    ("q4_k", 17, (16, 4, 1, 2), 4),   # 32 rows per program (15 padding, zero-filled by TMA), K split
    ("q5_k", 40, (32, 4, 1, 2), 2),   # 64 rows per program
    ("q6_k", 33, (16, 4, 1, 2), 1),   # 64 rows, no split
    ("q4_0", 70, (16, 4, 1, 2), 3),   # two program rows in M (64 + 6)
    ("q8_0", 20, (16, 4, 1, 2), 4),
    ("mlx", 32, (16, 4, 1, 2), 2),
])
def test_tc_x_in_k_order(fmt, M, config, sms, device):
    """tc_order puts each step's 256 columns in the kernel's k order (TC_PERMS); the kernel reading it by TMA (XT)
    gives the same result as loading and permuting x itself, bit for bit, and matches the float64 reference."""
    from llmkernels.qgemv.tc import TC_FORMATS, TC_PERMS, tc_order

    N, K = 45, 2048
    kw = dict(bits=4, group_size=64) if fmt == "mlx" else {}
    qt = lk.quantize(torch.randn(N, K, device=device) * torch.logspace(-3, 0, N, device=device)[:, None], fmt, **kw)
    x = torch.randn(M, K, dtype=torch.float16, device=device)
    xt = tc_order(x, fmt)
    perm = TC_PERMS[TC_FORMATS[fmt]].long().to(device)
    assert sorted(perm.tolist()) == list(range(256))
    assert torch.equal(xt, x.view(M, K // 256, 256)[:, :, perm].reshape(M, K))
    args = dict(scales=qt.scales, biases=qt.biases, group_size=qt.group_size or 0, fmt=fmt)
    unpack = 1 if interpreter_mode() else 2
    a = _finish(launch_tc(x, qt.data, N, K, config, sms, unpack, **args), x.dtype)
    b = _finish(launch_tc(x, qt.data, N, K, config, sms, unpack, xt=xt, **args), x.dtype)
    assert torch.equal(a, b)
    _check(b, x, qt, torch.float16)
    with pytest.raises(ValueError, match="xt"):
        launch_tc(x, qt.data, N, K, config, sms, unpack, xt=xt[:, :256], **args)


def test_gemv_hands_x_in_k_order(device, monkeypatch):
    """gemv gives the tensor-core kernel x in k order from route.TC_XT_MIN_M rows on (plain gemv only, not
    silu_mul_gemv; q8_0 up to 32 rows), and not where an override turns it off."""
    import dataclasses

    from llmkernels.qgemv import route, tc

    calls = []
    real = tc.launch_tc
    monkeypatch.setattr(tc, "launch_tc", lambda *a, **k: calls.append((a[0].shape[0], k.get("xt") is not None))
                        or real(*a, **k))
    qt = lk.quantize(torch.randn(40, 512, device=device) * 0.05, "q4_k")
    for M in (16, 17, 64):
        x = torch.randn(M, 512, dtype=torch.float16, device=device)
        _check(lk.gemv(x, qt), x, qt, torch.float16)
    lk.silu_mul_gemv(torch.randn(20, 512, dtype=torch.float16, device=device),
                     torch.randn(20, 512, dtype=torch.float16, device=device), qt)
    q8 = lk.quantize(torch.randn(40, 512, device=device) * 0.05, "q8_0")  # route.TC_XT_NOT_64: up to 32 rows only
    for M in (32, 33):
        x = torch.randn(M, 512, dtype=torch.float16, device=device)
        _check(lk.gemv(x, q8), x, q8, torch.float16)
    with route.override(lambda q, r: dataclasses.replace(r, xt=False) if r.xt else None):
        lk.gemv(torch.randn(30, 512, dtype=torch.float16, device=device), qt)
    assert calls == [(16, False), (17, True), (64, True), (20, False), (32, True), (33, False), (30, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tc_kernel_gpu(dtype, device):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for N, K, M, config in [(4096, 4096, 8, (128, 8, 1, 2)), (1001, 14336, 16, (64, 4, 1, 4)),
                            (77, 1024, 5, (128, 8, 1, 2)), (14336, 4096, 13, (64, 4, 1, 4)),
                            (4096, 4096, 33, (128, 4, 1, 2)), (6144, 4096, 64, (64, 4, 1, 4)),
                            (32768, 1024, 2, (64, 4, 1, 4)), (300, 2048, 3, (64, 4, 2, 2))]:
        qt = lk.quantize(torch.randn(N, K, device=device) * 0.05, "q4_k")
        x = torch.randn(M, K, dtype=dtype, device=device)
        _check(_finish(launch_tc(x, qt.data, N, K, config, sms, 2), dtype), x, qt, dtype)
        _check(lk.gemv(x, qt), x, qt, dtype)


def test_gemv_takes_tc_for_legacy(device, monkeypatch):
    """q4_0 and q8_0 with K a multiple of 256 go to the tensor-core kernel from route.TC_FIRST_M up to 64 rows,
    silu_mul_gemv too (silu(g) * u formed in the kernel); K = 320 and fp32 x do not."""
    from llmkernels.qgemv import route, tc

    calls = []
    real = tc.launch_tc
    monkeypatch.setattr(tc, "launch_tc", lambda *a, **k: calls.append((k["fmt"], a[0].shape[0])) or real(*a, **k))
    want = []
    for fmt in ("q4_0", "q8_0"):
        lo = route.TC_FIRST_M[fmt]
        for K, M in ((256, lo - 1), (256, lo), (512, 16), (256, 64), (256, 65), (320, 8)):
            if M < 1:
                continue
            qt = lk.quantize(torch.randn(24, K, device=device) * 0.05, fmt)
            x = torch.randn(M, K, dtype=torch.float16, device=device)
            _check(lk.gemv(x, qt), x, qt, torch.float16)
        want += [(fmt, lo), (fmt, 16), (fmt, 64), (fmt, 8)]
        qt = lk.quantize(torch.randn(24, 256, device=device) * 0.05, fmt)
        lk.gemv(torch.randn(8, 256, device=device), qt)
        g, u = (torch.randn(8, 256, dtype=torch.float16, device=device) for _ in range(2))
        _check_silu(lk.silu_mul_gemv(g, u, qt), g, u, qt)
    assert calls == want


def _check_silu(y, g, u, qt):
    """silu_mul_gemv against the two-step reference: silu(g) * u rounded to g's dtype, then x @ W.T in float64."""
    _check(y, (torch.nn.functional.silu(g.float()) * u.float()).to(g.dtype), qt, g.dtype)


@pytest.mark.parametrize("fmt,M", [("q4_0", 1), ("q8_0", 3), ("q4_k", 5), ("mlx", 3), ("q4_k", 17), ("q5_k", 4)])
def test_silu_mul_gemv_takes_tc(fmt, M, device, monkeypatch):
    """silu_mul_gemv runs the tensor-core kernel with silu(g) * u formed in its x loads where gemv runs it and the
    m1 kernel does not (q4_k beyond route.M1_MAX_M, MLX 4-bit from M = 3, q4_0 / q8_0 at every M); q5_k and q6_k
    wherever gemv does."""
    from llmkernels.qgemv import tc

    calls = []
    real = tc.launch_tc
    monkeypatch.setattr(tc, "launch_tc", lambda *a, **k: calls.append(k.get("x2") is not None) or real(*a, **k))
    kw = dict(bits=4, group_size=64) if fmt == "mlx" else {}
    qt = lk.quantize(torch.randn(45, 512, device=device) * 0.05, fmt, **kw)
    g, u = (torch.randn(M, 512, dtype=torch.float16, device=device) * 3 for _ in range(2))
    _check_silu(lk.silu_mul_gemv(g, u, qt), g, u, qt)
    assert calls == [True]


# model-shape GPU cases per GGUF format: (N, K, M, config); q4_0 / q8_0 also load ahead (a fifth config field)
_GPU_CASES = {
    "legacy": [(4096, 4096, 8, (64, 4, 1, 4)), (1001, 14336, 16, (64, 4, 1, 4)), (77, 1024, 5, (128, 8, 1, 2)),
               (14336, 4096, 13, (128, 4, 1, 2)), (4096, 4096, 33, (64, 4, 1, 2)), (300, 2048, 3, (64, 4, 1, 8)),
               (4097, 4096, 1, (64, 4, 1, 2, 1)), (77, 1024, 2, (128, 8, 1, 2, 1))],
    "kquant": [(4096, 4096, 8, (64, 4, 1, 4)), (1001, 14336, 16, (64, 4, 1, 4)), (77, 2048, 5, (128, 8, 1, 2)),
               (14336, 4096, 1, (128, 4, 1, 2)), (4096, 4096, 33, (64, 4, 1, 2)), (300, 2048, 3, (64, 4, 1, 8)),
               (4097, 4096, 2, (64, 4, 1, 2)), (130, 6144, 64, (64, 4, 1, 4))],
}


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "q5_k", "q6_k"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tc_kernel_gguf_gpu(fmt, dtype, device):
    """q4_0, q8_0, q5_k and q6_k at model shapes, directly and through gemv (q5_k / q6_k also silu_mul_gemv);
    scales of both signs and sizes."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kquant = fmt in ("q5_k", "q6_k")
    for N, K, M, config in _GPU_CASES["kquant" if kquant else "legacy"]:
        w = torch.randn(N, K, device=device) * torch.logspace(-3, 1, N, device=device)[:, None]
        w[::5, :32] = -w[::5, :32].abs()
        qt = lk.quantize(w, fmt)
        x = torch.randn(M, K, dtype=dtype, device=device)
        _check(_finish(launch_tc(x, qt.data, N, K, config, sms, 2, fmt=fmt), dtype), x, qt, dtype)
        _check(lk.gemv(x, qt), x, qt, dtype)
        if kquant:
            _check_silu(lk.silu_mul_gemv(x, x * 2, qt), x, x * 2, qt)


def test_gemv_takes_tc_for_kquants(device, monkeypatch):
    """q5_k from route.TC_FIRST_M (route.TC_FIRST_M_LARGE from K = route.TC_LONG_K, not silu_mul_gemv) and q6_k (K
    a multiple of 2048) go to the tensor-core kernel up to 64 rows, silu_mul_gemv too; q6_k with K = 1024 does not."""
    from llmkernels.qgemv import route, tc

    calls = []
    real = tc.launch_tc
    monkeypatch.setattr(tc, "launch_tc", lambda *a, **k: calls.append((k["fmt"], a[0].shape[0])) or real(*a, **k))
    want = []
    for fmt, K in (("q5_k", 256), ("q6_k", 2048)):
        lo = route.TC_FIRST_M[fmt]
        qt = lk.quantize(torch.randn(20, K, device=device) * 0.05, fmt)
        for M in (lo - 1, lo, 64, 65):
            if M < 1:
                continue
            x = torch.randn(M, K, dtype=torch.float16, device=device)
            _check(lk.gemv(x, qt), x, qt, torch.float16)
        g, u = (torch.randn(lo, K, dtype=torch.float16, device=device) for _ in range(2))
        _check_silu(lk.silu_mul_gemv(g, u, qt), g, u, qt)
        want += [(fmt, lo), (fmt, 64), (fmt, lo)]
    qt = lk.quantize(torch.randn(20, 1024, device=device) * 0.05, "q6_k")
    x = torch.randn(8, 1024, dtype=torch.float16, device=device)
    _check(lk.gemv(x, qt), x, qt, torch.float16)
    K = route.TC_LONG_K
    qt = lk.quantize(torch.randn(20, K, device=device) * 0.05, "q5_k")
    lo = route.TC_FIRST_M_LARGE["q5_k"]
    g, u = (torch.randn(lo, K, dtype=torch.float16, device=device) for _ in range(2))
    _check(lk.gemv(g, qt), g, qt, torch.float16)
    _check_silu(lk.silu_mul_gemv(g, u, qt), g, u, qt)  # silu_mul_gemv from TC_FIRST_M only
    want += [("q5_k", lo)] if lo < route.TC_FIRST_M["q5_k"] else []
    assert calls == want


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tc_kernel_mlx_gpu(dtype, device):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for N, K, M, gs, config in [(4096, 4096, 8, 64, (64, 4, 1, 4)), (1001, 14336, 16, 32, (64, 4, 1, 4)),
                                (77, 1024, 5, 128, (128, 8, 1, 2)), (14336, 4096, 33, 64, (64, 4, 1, 4)),
                                (300, 2048, 3, 64, (64, 4, 2, 2))]:
        qt = lk.quantize(torch.randn(N, K, device=device) * 0.05, "mlx", bits=4, group_size=gs)
        x = torch.randn(M, K, dtype=dtype, device=device)
        y = launch_tc(x, qt.data, N, K, config, sms, 2, qt.scales, qt.biases, gs)
        _check(_finish(y, dtype), x, qt, dtype)
        _check(lk.gemv(x, qt), x, qt, dtype)


@pytest.mark.gpu
def test_tc_config_keys(device, monkeypatch):
    """gemv reads "tc/<format>/m1" at M = 1 and "tc/<format>" otherwise; silu_mul_gemv "tc/<format>/silu" from
    M = 2."""
    from llmkernels.qgemv import tc
    from llmkernels.tuning import OVERRIDES

    seen = []
    real = tc.launch_tc
    monkeypatch.setattr(tc, "launch_tc", lambda *a, **k: seen.append(tuple(a[4])) or real(*a, **k))
    monkeypatch.setitem(OVERRIDES, ("gemv", "tc/q8_0/m1"), [128, 4, 1, 2])
    monkeypatch.setitem(OVERRIDES, ("gemv", "tc/q8_0"), [64, 4, 1, 8])
    monkeypatch.setitem(OVERRIDES, ("gemv", "tc/q8_0/silu"), [64, 4, 1, 4, 1])
    qt = lk.quantize(torch.randn(300, 512, device=device), "q8_0")
    for M in (1, 2):
        x = torch.randn(M, 512, dtype=torch.float16, device=device)
        _check(lk.gemv(x, qt), x, qt, torch.float16)
        _check_silu(lk.silu_mul_gemv(x, x, qt), x, x, qt)
    assert seen == [(128, 4, 1, 2), (128, 4, 1, 2), (64, 4, 1, 8), (64, 4, 1, 4, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_silu_tc_gpu(dtype, device):
    """silu(g) * u through tanh.approx in the tensor-core kernel, every format it reads, model shapes."""
    for fmt, N, K, M in [("q4_0", 4096, 14336, 1), ("q8_0", 1001, 4096, 8), ("q4_k", 4096, 14336, 16),
                         ("mlx", 300, 2048, 5), ("q4_0", 77, 1024, 33)]:
        kw = dict(bits=4, group_size=64) if fmt == "mlx" else {}
        qt = lk.quantize(torch.randn(N, K, device=device) * 0.05, fmt, **kw)
        g, u = (torch.randn(M, K, dtype=dtype, device=device) * 3 for _ in range(2))
        _check_silu(lk.silu_mul_gemv(g, u, qt), g, u, qt)


def _codebook_weights(fmt, N, K, device):
    """Rows over four decades of scale (mxfp4 exponents and iq4_nl scales of many sizes), some blocks all negative."""
    w = torch.randn(N, K, device=device) * torch.logspace(-3, 1, N, device=device)[:, None]
    w[::5, :32] = -w[::5, :32].abs()
    return lk.quantize(w, fmt)


@pytest.mark.parametrize("fmt", ["iq4_nl", "mxfp4", "iq4_xs"])
@pytest.mark.parametrize("N,K,M,config,sms", [
    (37, 512, 5, (16, 4, 1, 2), 4),     # whole steps; mxfp4's blocks at every even offset mod 16 (two steps)
    (19, 768, 3, (16, 4, 1, 2), 2),     # iq4_xs: 408-byte rows padded to 416, super-blocks at both alignments
    (19, 352, 3, (16, 4, 1, 2), 2),     # 11 blocks: a whole step and a last step of 3 blocks (masked), split
    (21, 96, 1, (16, 4, 1, 2), 1),      # 3 blocks: one partial step
    (40, 2880, 17, (32, 4, 1, 2), 3),   # gpt-oss's K (90 blocks), 32 activation rows per program
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tc_kernel_codebook(fmt, N, K, M, config, sms, dtype, device):
    """iq4_nl (18-byte blocks, q4_0's), mxfp4 (17-byte blocks: 2-byte aligned, shifted into place per lane) and
    iq4_xs (136-byte super-blocks, 6-bit sub-block scales; K a multiple of 256): the levels looked up by byte
    permutes, rows padded to 16 bytes (pad_rows) where K does not give that, the last step's missing blocks masked;
    against the unpadded matrix's float64 products."""
    from llmkernels.quant.tensor import pad_rows

    if fmt == "iq4_xs" and K % 256:
        pytest.skip("iq4_xs rows are whole 256-weight super-blocks")
    qt = _codebook_weights(fmt, N, K, device)
    padded = pad_rows(qt)
    assert padded.data.shape[-1] % 16 == 0
    x = torch.randn(M, K, dtype=dtype, device=device)
    y = launch_tc(x, padded.data, N, K, config, sms, 1 if interpreter_mode() else 2, fmt=fmt)
    _check(_finish(y, dtype), x, qt, dtype)


def test_gemv_takes_tc_for_codebooks(device, monkeypatch):
    """gemv runs iq4_nl and mxfp4 on the tensor-core kernel from M = 1 where their rows are 16-byte aligned (K a
    multiple of 256 / 512), and iq4_xs where K is a multiple of 512 (272-byte rows), silu_mul_gemv too; other rows
    (mxfp4 and iq4_xs at K = 256: 136 bytes) take the generic kernel."""
    from llmkernels.qgemv import tc

    calls = []
    real = tc.launch_tc
    monkeypatch.setattr(tc, "launch_tc", lambda *a, **k: calls.append((k["fmt"], a[0].shape[0])) or real(*a, **k))
    for fmt, K, M in (("iq4_nl", 256, 1), ("mxfp4", 512, 2), ("mxfp4", 256, 1), ("iq4_nl", 352, 3), ("iq4_xs", 512, 1),
                      ("iq4_xs", 256, 2)):
        qt = _codebook_weights(fmt, 24, K, device)
        x = torch.randn(M, K, dtype=torch.float16, device=device)
        _check(lk.gemv(x, qt), x, qt, torch.float16)
    g, u = (torch.randn(2, 512, dtype=torch.float16, device=device) for _ in range(2))
    qt = _codebook_weights("mxfp4", 24, 512, device)
    _check_silu(lk.silu_mul_gemv(g, u, qt), g, u, qt)
    assert calls == [("iq4_nl", 1), ("mxfp4", 2), ("iq4_xs", 1), ("mxfp4", 2)]


def test_codebook_tc_compiles_for_sm90():
    """The tensor-core kernel's iq4_nl, mxfp4 and iq4_xs builds (inline PTX: byte-permute lookups, per-lane shifts) compile to
    sm_90 code without a GPU, fp16 and bf16, the MoE build too; the interpreter covers their arithmetic above."""
    from tests.compiled import run_compiled

    code = ("from llmkernels.qgemv.tc import compile_sm90; "
            "print(all(len(compile_sm90(f, dtype=d, top_k=k).asm['cubin']) > 0 "
            "for f in ('iq4_nl', 'mxfp4', 'iq4_xs') for d in ('fp16', 'bf16') for k in (0, 4)))")
    assert run_compiled(code) == "True"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["iq4_nl", "mxfp4", "iq4_xs"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tc_kernel_codebook_gpu(fmt, dtype, device):
    """iq4_nl and mxfp4 at model shapes (gpt-oss's 2880 with padded rows among them), directly and, where the rows
    are aligned as stored, through gemv and silu_mul_gemv."""
    from llmkernels.quant.tensor import pad_rows

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for N, K, M, config in [(4096, 4096, 1, (64, 4, 1, 4)), (5760, 2880, 1, (64, 4, 1, 4)),
                            (2880, 2880, 8, (128, 8, 1, 2)), (1001, 14336, 16, (64, 4, 1, 4)),
                            (77, 1024, 33, (64, 4, 1, 2)), (300, 2880, 64, (64, 4, 1, 4))]:
        if fmt == "iq4_xs" and K % 256:
            continue
        qt = _codebook_weights(fmt, N, K, device)
        x = torch.randn(M, K, dtype=dtype, device=device)
        _check(_finish(launch_tc(x, pad_rows(qt).data, N, K, config, sms, 2, fmt=fmt), dtype), x, qt, dtype)
        _check(lk.gemv(x, qt), x, qt, dtype)
        if K % 512 == 0:
            _check_silu(lk.silu_mul_gemv(x, x * 2, qt), x, x * 2, qt)
