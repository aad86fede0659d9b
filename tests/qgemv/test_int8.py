"""GEMV with int8 activations (qgemv/int8.py, ``gemv(..., act_int8=True)``): the activation rounding checked as a
property, the integer dot-product kernel against x' @ dequantize(W).T in float64 (x' the rounded activations, so
the tolerance is fp16 output rounding), and gemv's routing and fallbacks."""
import pytest
import torch

import llmkernels as lk
from llmkernels._checks import interpreter_mode
from llmkernels.qgemv.int8 import i8_layout, i8_lanes_supports, i8_supports, launch_i8, launch_i8_lanes, quantize_act
from llmkernels.qgemv.ops import _finish, gemv_i8_lanes
from llmkernels.testing import assert_close, gemv_ref, i8_lane_positions


def _dequant_act(q, ds):
    M, K = q.shape
    return (q.double().view(M, K // 32, 32) * ds[..., :1].double()).view(M, K)


def _check_rounding(x, q, ds):
    """d = absmax / 127 per block, q = x / d rounded to the nearest integer, s = d * sum q."""
    M, K = x.shape
    xb = x.double().view(M, K // 32, 32)
    amax = xb.abs().amax(-1)
    d = ds[..., 0].double()
    assert torch.allclose(d, amax / 127, rtol=1e-6, atol=0)
    safe = torch.where(d > 0, d, torch.ones_like(d))
    v = torch.where(d[..., None] > 0, xb / safe[..., None], torch.zeros_like(xb))
    qb = q.double().view(M, K // 32, 32)
    assert (qb.abs() <= 127).all()
    assert ((qb - v).abs() <= 0.5 + 1e-4).all(), (qb - v).abs().max()
    assert torch.allclose(ds[..., 1].double(), d * qb.sum(-1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_quantize_act(dtype, device):
    M, K = 3, 1120  # 35 blocks: the second program's block range is partly past the row
    x = torch.randn(M, K, dtype=torch.float32, device=device) * 3
    x[1, 32:64] = 0  # an all-zero block: d = 0, q = 0
    x[2, 100] = 300.0  # one large value: its block's other entries round to small codes
    x = x.to(dtype)
    q, ds = quantize_act(x)
    assert q.dtype == torch.int8 and q.shape == (M, K) and ds.shape == (M, K // 32, 2)
    _check_rounding(x, q, ds)
    assert (q[1, 32:64] == 0).all() and (ds[1, 1] == 0).all()


@pytest.mark.parametrize("K", [4096, 1120])
def test_quantize_act_lanes(K, device):
    """lanes=True: the same codes and scales, the codes at their i8 lane-order places (checked against a reshape)."""
    x = torch.randn(1, K, dtype=torch.bfloat16, device=device) * 2
    q, ds = quantize_act(x)
    ql, dsl = quantize_act(x, lanes=True)
    assert ql.shape == (1, -(-K // 2048) * 2048) and torch.equal(dsl, ds)
    assert torch.equal(ql[:, i8_lane_positions(K).to(device)], q)


def test_quantize_act_silu(device):
    g = torch.randn(2, 256, dtype=torch.float16, device=device) * 2
    u = torch.randn(2, 256, dtype=torch.float16, device=device)
    q, ds = quantize_act(g, u)
    a = torch.nn.functional.silu(g.float()) * u.float()
    _check_rounding(a, q, ds)


def _run(fmt, N, K, M, config, sms, device, dtype=torch.float16, **kw):
    qt = lk.quantize(torch.randn(N, K, device=device) * 0.05, fmt)
    x = torch.randn(M, K, dtype=dtype, device=device)
    q, ds = quantize_act(x)
    y = _finish(launch_i8(q, ds, qt.data, fmt, N, K, config, sms, not interpreter_mode(), dtype, **kw), dtype)
    ref = gemv_ref(_dequant_act(q, ds), qt)
    tol = 4e-3 if dtype == torch.float16 else 2e-2
    assert y.shape == (M, N) and y.dtype == dtype
    assert_close(y, ref, dtype, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "q4_k"])
@pytest.mark.parametrize("N,K,config,sms", [
    (37, 512, (2, 1, 1, 1), 4),    # one row per thread, rows not a multiple of the tile, K split in two
    (19, 768, (1, 1, 1, 1, 1, 1), 1),  # three steps (q4_0/q4_k) in one program, coalesced + prefetched loads
    (130, 256, (2, 1, 2, 1), 64),  # one step per row, more programs than steps
    (21, 1024, (4, 1, 1, 1, 0, 1), 3),  # four rows per thread, K split unevenly, next step prefetched
    (45, 1536, (2, 4, 1, 1), 2),   # groups across threads: 2 of the 6 per step (q4_0/q4_k; q8_0: 1 of 3)
    (45, 1536, (2, 4, 1, 1, 1, 1), 2),  # the same, coalesced + prefetched
    (70, 2048, (1, 8, 2, 1), 1),   # 8 groups of a row across threads, 8 rows per warp pair, no split
])
def test_i8_kernel(fmt, N, K, config, sms, device):
    assert i8_layout(fmt) is not None
    _run(fmt, N, K, 1, config, sms, device)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "q4_k"])
@pytest.mark.parametrize("M,rows_per_program,fixup,dtype,config", [
    (2, 4, True, torch.bfloat16, (2, 2, 1, 1)), (3, 2, False, torch.float16, (2, 2, 1, 1)),
    (5, 4, True, torch.float16, (2, 2, 1, 1)), (16, 4, True, torch.bfloat16, (2, 2, 1, 1)),
    (2, 2, True, torch.float16, (2, 2, 1, 1, 1, 1))])  # the routed M = 2 with coalesced + prefetched loads
def test_i8_rows_per_program(fmt, M, rows_per_program, fixup, dtype, config, device):
    """Activation rows share the unpacked codes; surplus rows of the last program read a real row, are not stored."""
    _run(fmt, 45, 512, M, config, 8, device, dtype, fixup=fixup, rows_per_program=rows_per_program)


@pytest.mark.parametrize("N,K,config,sms,fixup,dtype", [
    (37, 256, (1, 1, 1, 1), 4, True, torch.float16),    # one block: lanes kt >= 1 masked, rows past N
    (77, 2304, (2, 2, 1, 1), 4, True, torch.bfloat16),  # 9 blocks: a split of 8 and a ragged one of 1
    (40, 4096, (1, 1, 1, 1), 64, False, torch.float16),  # whole steps, K split in two, partials summed outside
    (130, 1792, (2, 1, 2, 1), 3, True, torch.float32),  # 7 blocks (one ragged step), two rows per thread
    (9, 6144, (1, 2, 4, 1), 16, True, torch.float16),   # three steps, split three ways, most rows past N
])
@pytest.mark.parametrize("fmt", ["q4_k", "q5_k"])
def test_i8_lanes_kernel(fmt, N, K, config, sms, fixup, dtype, device):
    """The q4_k / q5_k int8 lane kernel against x' @ dequantize(W).T in float64 (x' the rounded activations)."""
    w = torch.randn(N, K) * 0.05
    w[:, -256:] *= 40  # one super-block with large weights and scales
    qt = lk.quantize(w, fmt).to(device)
    assert i8_lanes_supports(qt.data, fmt, K) and not i8_lanes_supports(qt.data, fmt, K - 32)
    x = torch.randn(1, K, dtype=torch.float16, device=device)
    q, ds = quantize_act(x)
    ql, dsl = quantize_act(x, lanes=True)
    y = _finish(launch_i8_lanes(ql, dsl, qt.data, N, K, config, sms, not interpreter_mode(), dtype, fixup=fixup,
                                fmt=fmt), dtype)
    ref = gemv_ref(_dequant_act(q, ds), qt)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}[dtype]
    assert y.shape == (1, N) and y.dtype == dtype
    assert_close(y, ref, dtype, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("N,K,config,sms,fixup,dtype", [
    (37, 2048, (1, 1, 1, 1), 4, True, torch.float16),     # KT 4 by default, one step, rows past N
    (70, 4096, (2, 1, 2, 1, 2), 8, True, torch.bfloat16),  # KT 2, two row sets per thread, K split in two
    (9, 6144, (1, 2, 4, 1, 4), 16, False, torch.float32),  # KT 4: three steps split three ways, partials outside
    (21, 2048, (2, 1, 1, 1, 4), 2, True, torch.float16),   # KT 4, two row sets, one split
])
def test_i8_q6_kernel(N, K, config, sms, fixup, dtype, device):
    """The q6_k int8 kernel (210-byte blocks shifted into place) against x' @ dequantize(W).T in float64."""
    w = torch.randn(N, K) * 0.05
    w[:, :256] *= 40  # one super-block with large weights: scales near +-127 stress the integer sums
    qt = lk.quantize(w, "q6_k").to(device)
    assert i8_lanes_supports(qt.data, "q6_k", K) and not i8_lanes_supports(qt.data, "q6_k", K - 256)
    with pytest.raises(ValueError, match="2 or 4 lanes along K"):
        launch_i8_lanes(*quantize_act(torch.randn(1, K, dtype=torch.float16, device=device), lanes=True), qt.data, N, K,
                        (1, 1, 1, 1, 1), sms, not interpreter_mode(), dtype, fmt="q6_k")
    x = torch.randn(1, K, dtype=torch.float16, device=device)
    q, ds = quantize_act(x)
    ql, dsl = quantize_act(x, lanes=True)
    y = _finish(launch_i8_lanes(ql, dsl, qt.data, N, K, config, sms, not interpreter_mode(), dtype, fixup=fixup,
                                fmt="q6_k"), dtype)
    ref = gemv_ref(_dequant_act(q, ds), qt)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}[dtype]
    assert y.shape == (1, N) and y.dtype == dtype
    assert_close(y, ref, dtype, atol=tol * ref.abs().max().item(), rtol=tol)


def test_gemv_i8_lanes_op(device):
    """ops.gemv_i8_lanes (activations rounded by the caller) is gemv(act_int8=True); bad operands raise."""
    N, K = 24, 512
    qt = lk.quantize(torch.randn(N, K, device=device) * 0.05, "q4_k")
    x = torch.randn(1, K, dtype=torch.float16, device=device)
    ql, dsl = quantize_act(x, lanes=True)
    assert torch.equal(gemv_i8_lanes(ql, dsl, qt, torch.float16), lk.gemv(x, qt, act_int8=True))
    with pytest.raises(ValueError, match="xq must be"):
        gemv_i8_lanes(ql[:, :K], dsl, qt, torch.float16)
    with pytest.raises(TypeError, match="xq"):
        gemv_i8_lanes(ql.to(torch.int32), dsl, qt, torch.float16)
    with pytest.raises(ValueError, match="q4_k"):
        gemv_i8_lanes(ql, dsl, lk.quantize(torch.randn(N, K, device=device) * 0.05, "q8_0"), torch.float16)
    with pytest.raises(TypeError, match="out_dtype"):
        gemv_i8_lanes(ql, dsl, qt, torch.int8)
    with pytest.raises(ValueError, match="q6_k with K a multiple of 2048"):  # q6_k rows must be 16-byte aligned
        gemv_i8_lanes(ql, dsl, lk.quantize(torch.randn(N, K, device=device) * 0.05, "q6_k"), torch.float16)
    K = 2048
    qt6 = lk.quantize(torch.randn(N, K, device=device) * 0.05, "q6_k")
    x = torch.randn(1, K, dtype=torch.float16, device=device)
    ql, dsl = quantize_act(x, lanes=True)
    assert torch.equal(gemv_i8_lanes(ql, dsl, qt6, torch.float16), lk.gemv(x, qt6, act_int8=True))
    qt5 = lk.quantize(torch.randn(N, K, device=device) * 0.05, "q5_k")
    assert torch.equal(gemv_i8_lanes(ql, dsl, qt5, torch.float16), lk.gemv(x, qt5, act_int8=True))


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "q4_k", "q5_k", "q6_k"])
def test_gemv_act_int8(fmt, device):
    """gemv(act_int8=True) is x' @ W.T for the rounded x' (and near x @ W.T) up to the format's M limit, exact
    beyond it; silu_mul_gemv rounds silu(g) * u."""
    from llmkernels.qgemv.route import I8_MAX_M

    N, K = 40, 2048 if fmt == "q6_k" else 512
    qt = lk.quantize(torch.randn(N, K, device=device) * 0.05, fmt)
    M = I8_MAX_M[fmt]
    x = torch.randn(M + 1, K, dtype=torch.float16, device=device)
    y = lk.gemv(x[:M], qt, act_int8=True)
    q, ds = quantize_act(x[:M])
    ref = gemv_ref(_dequant_act(q, ds), qt)
    assert_close(y, ref, torch.float16, atol=4e-3 * ref.abs().max().item(), rtol=4e-3)
    exact = gemv_ref(x[:M], qt)
    err = ((y.double().cpu() - exact.cpu()).abs().max() / exact.abs().max()).item()
    assert 1e-4 < err < 3e-2  # the rounding shows, and stays small
    exact = gemv_ref(x, qt)  # one row more: exact
    assert_close(lk.gemv(x, qt, act_int8=True), exact, torch.float16, atol=4e-3 * exact.abs().max().item(),
                 rtol=4e-3)
    g = torch.randn(1, K, dtype=torch.float16, device=device)
    u = torch.randn(1, K, dtype=torch.float16, device=device)
    y2 = lk.silu_mul_gemv(g, u, qt, act_int8=True)
    q2, ds2 = quantize_act(g, u)
    ref2 = gemv_ref(_dequant_act(q2, ds2), qt)
    assert_close(y2, ref2, torch.float16, atol=4e-3 * ref2.abs().max().item(), rtol=4e-3)


def test_gemv_act_int8_fallbacks(device):
    """Formats and shapes without an int8 kernel compute exactly; a non-bool act_int8 is a TypeError."""
    K = 256
    x = torch.randn(2, K, dtype=torch.float16, device=device)  # q5_k at M = 2: exact (route.I8_MAX_M)
    qt5 = lk.quantize(torch.randn(24, K, device=device) * 0.05, "q5_k")
    ref = gemv_ref(x, qt5)
    assert_close(lk.gemv(x, qt5, act_int8=True), ref, torch.float16, atol=4e-3 * ref.abs().max().item(), rtol=4e-3)
    qt_short = lk.quantize(torch.randn(24, 288, device=device) * 0.05, "q4_0")  # K not a multiple of 256
    assert not i8_supports(qt_short.data, "q4_0", 288)
    xs = torch.randn(1, 288, dtype=torch.float16, device=device)
    ref = gemv_ref(xs, qt_short)
    assert_close(lk.gemv(xs, qt_short, act_int8=True), ref, torch.float16, atol=4e-3 * ref.abs().max().item(),
                 rtol=4e-3)
    qt6 = lk.quantize(torch.randn(24, 1024, device=device) * 0.05, "q6_k")  # K not a multiple of 2048
    x6 = torch.randn(1, 1024, dtype=torch.float16, device=device)
    ref = gemv_ref(x6, qt6)
    assert_close(lk.gemv(x6, qt6, act_int8=True), ref, torch.float16, atol=4e-3 * ref.abs().max().item(), rtol=4e-3)
    with pytest.raises(TypeError, match="act_int8"):
        lk.gemv(x, qt5, act_int8=1)
