"""The batch-1 kernel with block scales factored out (qgemv/m1.py), for every format it handles, every tile shape
class (rows per thread, blocks per step, split-K) and both unpacking paths (the Triton expression runs everywhere,
the inline PTX only on the GPU), against x @ dequantize(W).T in float64."""
import pytest
import torch

import llmkernels as lk
from llmkernels._checks import interpreter_mode
from llmkernels.qgemv.m1 import M1_LAYOUTS, launch_m1
from llmkernels.qgemv.ops import _finish
from llmkernels.testing import assert_close, gemv_ref, lane_positions

# GGUF formats, then MLX (bits, group size): 4-bit reads x as int32 pairs, 8-bit in natural order
FORMATS = [(f, {}) for f in sorted(M1_LAYOUTS)] + [("mlx", dict(bits=b, group_size=g))
                                                   for b, g in [(4, 32), (4, 64), (4, 128), (8, 32), (8, 64)]]
IDS = [f if not kw else f"mlx{kw['bits']}g{kw['group_size']}" for f, kw in FORMATS]


def _cfg(fmt, config):
    """q6_k takes at least 2 threads per chunk (one 16-weight scale group each), so 4 lanes at most along K: other
    configs get H = 2 and KT <= 4 for it."""
    if fmt != "q6_k" or (len(config) > 5 and config[5] >= 2):
        return config
    return config[:4] + (min(config[4] if len(config) > 4 else 1, 4), 2) + config[6:]


def _run(fmt, kw, N, K, configs, sms, unpack, dtype, device):
    """Each config on one quantized matrix, a fresh x per config, output checked against the float64 reference."""
    if K % kw.get("group_size", 1):
        pytest.skip("K is not a multiple of the group size")
    qt = lk.quantize(torch.randn(N, K, device=device) * 0.05, fmt, **kw)  # on the GPU: K-quants take seconds on CPU
    for config in (_cfg(fmt, c) for c in configs):
        x = torch.randn(1, K, dtype=dtype, device=device)
        y = _finish(launch_m1(x, qt.data, fmt, N, K, config, sms, unpack, scales=qt.scales, biases=qt.biases,
                              bits=qt.bits or 0, group_size=qt.group_size or 0), dtype)
        ref = gemv_ref(x, qt)
        tol = 4e-3 if dtype == torch.float16 else 2e-2
        assert y.shape == (1, N) and y.dtype == dtype
        assert_close(y, ref, dtype, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("fmt,kw", FORMATS, ids=IDS)
@pytest.mark.parametrize("N,K,config,sms", [
    (37, 512, (1, 1, 1, 1), 4),    # rows not a multiple of the tile, split-K into single blocks
    (19, 768, (2, 2, 1, 1), 1),    # two rows per thread, two blocks per step, K split unevenly (3 q4_k blocks)
    (130, 256, (1, 1, 2, 1), 64),  # more programs than blocks: the split is capped by the block count
    (21, 320, (1, 1, 1, 1), 3),    # MLX: an odd group count (g64) or two groups per block (g32)
    (37, 2304, (2, 1, 1, 1, 8), 4),  # lanes along K: 8 blocks of a row per step, the last step partly past K
    (19, 1024, (1, 2, 2, 1, 2), 1),  # 2 lanes along K times 2 blocks per thread: whole steps, no masks
    (45, 2304, (4, 1, 1, 1, 4, 2), 2),  # two threads per chunk, 4 lanes along K, 4 rows per thread
])
def test_m1_kernel(fmt, kw, N, K, config, sms, device):
    if fmt != "mlx" and K % 256:
        pytest.skip("K is not a multiple of 256")
    _run(fmt, kw, N, K, [config], sms, 1 if interpreter_mode() else 2, torch.float16, device)


@pytest.mark.parametrize("fmt,kw", [FORMATS[2], FORMATS[0], FORMATS[4]], ids=[IDS[2], IDS[0], IDS[4]])
@pytest.mark.parametrize("M,rows_per_program,fixup", [(2, 4, True), (3, 2, False), (5, 4, True), (4, 3, True)])
def test_m1_rows_per_program(fmt, kw, M, rows_per_program, fixup, device):
    """Several activation rows per program share the unpacked weights; the last program's surplus rows (M not a
    multiple of rows_per_program) read a real row and are not stored."""
    N, K = 45, 512
    qt = lk.quantize(torch.randn(N, K, device=device) * 0.05, fmt, **kw)
    x = torch.randn(M, K, dtype=torch.float16, device=device)
    y = _finish(launch_m1(x, qt.data, fmt, N, K, (1, 1, 1, 1), 8, 1 if interpreter_mode() else 2, fixup=fixup,
                          scales=qt.scales, biases=qt.biases, bits=qt.bits or 0, group_size=qt.group_size or 0,
                          rows_per_program=rows_per_program), x.dtype)
    ref = gemv_ref(x, qt)
    assert_close(y, ref, torch.float16, atol=4e-3 * ref.abs().max().item(), rtol=4e-3)


def test_m1_q6k_needs_two_threads_per_chunk(device):
    qt = lk.quantize(torch.randn(16, 256, device=device) * 0.05, "q6_k")
    with pytest.raises(ValueError, match="q6_k needs at least 2 threads per chunk"):
        launch_m1(torch.randn(1, 256, dtype=torch.float16, device=device), qt.data, "q6_k", 16, 256, (1, 1, 1, 1), 4,
                  1)


def test_m1_mlx_bf16_activations(device):
    """bf16 activations split from int32 words by shifts (fp16 goes through a conversion)."""
    _run("mlx", dict(bits=4, group_size=64), 45, 512, [(1, 1, 1, 1)], 4, 1 if interpreter_mode() else 2,
         torch.bfloat16, device)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,kw", FORMATS, ids=IDS)
@pytest.mark.parametrize("unpack", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_m1_kernel_gpu(fmt, kw, unpack, dtype, device):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # rows across lanes, lanes along K (KT), two threads per chunk (H) with 8 rows each, masked last steps
    for N, K, configs in [(4096, 4096, [(4, 1, 4, 3), (4, 1, 4, 3, 8), (8, 1, 4, 3, 4, 2)]),
                          (1001, 14336, [(2, 2, 8, 1), (2, 1, 4, 1, 4), (4, 1, 2, 3, 2, 2)]),
                          (77, 2304, [(1, 1, 4, 3), (1, 2, 4, 3, 2), (4, 1, 4, 3, 8, 1, 1)])]:
        _run(fmt, kw, N, K, configs, sms, unpack, dtype, device)


@pytest.mark.parametrize("fixup", [True, False])
def test_m1_split_k_sum_in_kernel_or_after(fixup, device):
    """With fixup the last program of each output tile sums the split-K partials and resets its arrival counter,
    so repeated calls (as in a replayed CUDA graph) stay right; without it ops._finish sums them."""
    from llmkernels._runtime import split_counters

    N, K = 70, 1024
    qt = lk.quantize(torch.randn(N, K, device=device) * 0.05, "q4_k")
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
    qt = lk.quantize(torch.randn(N, K, device=device) * 0.05, "q4_k")
    buf = torch.zeros(qt.data.numel() + 2, dtype=torch.uint8, device=device)
    buf[2:] = qt.data.reshape(-1)
    shifted = QuantizedTensor.from_raw(buf[2:].view(N, -1), "q4_k", (N, K))
    assert shifted.data.data_ptr() % 16 == 2
    for M in (1, 6):
        x = torch.randn(M, K, dtype=torch.float16, device=device)
        ref = gemv_ref(x, qt)
        assert_close(lk.gemv(x, shifted), ref, torch.float16, atol=4e-3 * ref.abs().max().item(), rtol=4e-3)


def test_gemv_mlx4_activations_not_word_aligned(device):
    """x starting at an odd fp16 element cannot be read as int32 pairs: gemv takes another kernel and stays right."""
    N, K = 40, 256
    qt = lk.quantize(torch.randn(N, K, device=device) * 0.05, "mlx", bits=4, group_size=64)
    buf = torch.randn(K + 1, dtype=torch.float16, device=device)
    from llmkernels.qgemv.m1 import m1_supports

    assert not m1_supports(buf[1:].view(1, K), qt.data, "mlx", 4, 64, K)
    for x in (buf[1:].view(1, K), buf[:K].view(1, K)):
        ref = gemv_ref(x, qt)
        assert_close(lk.gemv(x, qt), ref, torch.float16, atol=4e-3 * ref.abs().max().item(), rtol=4e-3)


# --- activations in lane order (m1.lane_pos): the q4_k kernel with KT = 8 reading x laid out for its loads ---------
def _lanes_poisoned(x):
    """x in lane order with NaN in the positions no k maps to (the tail of the last group)."""
    from llmkernels.qgemv.m1 import lanes_width

    M, K = x.shape
    xl = torch.full((M, lanes_width(K)), float("nan"), dtype=x.dtype, device=x.device)
    xl[:, lane_positions(K).to(x.device)] = x
    return xl


@pytest.mark.parametrize("K", [2048, 2304, 4352])
def test_lane_order(K, device):
    from llmkernels.qgemv.m1 import lane_order

    x = torch.randn(3, K + 5, dtype=torch.float16, device=device)[:, 2:K + 2]  # a row stride that is not K
    xl = lane_order(x)
    pos = lane_positions(K).to(device)
    assert torch.equal(xl[:, pos], x)


@pytest.mark.parametrize("N,K,config,sms,fixup", [
    (37, 2304, (1, 1, 1, 1, 8), 4, True),      # 9 blocks: one whole step and a masked one past K
    (19, 4096, (2, 1, 2, 1, 8), 2, False),    # two splits of one step each, partials summed after the kernel
    (45, 2048, (2, 1, 1, 1, 8, 1, 1), 64, True),  # a table-style config, one step, no split
])
def test_m1_lane_order(N, K, config, sms, fixup, device):
    """The lane-order kernel against the float64 reference, x laid out independently of lane_pos with NaN in the
    unused tail, output poisoned before the call."""
    from llmkernels.qgemv.m1 import launch_m1

    qt = lk.quantize(torch.randn(N, K, device=device) * 0.05, "q4_k")
    for dtype in (torch.float16,) if interpreter_mode() else (torch.float16, torch.bfloat16):
        x = torch.randn(1, K, dtype=dtype, device=device)
        y = _finish(launch_m1(_lanes_poisoned(x), qt.data, "q4_k", N, K, config, sms,
                              1 if interpreter_mode() else 2, fixup=fixup, x_perm=True), dtype)
        ref = gemv_ref(x, qt)
        tol = 4e-3 if dtype == torch.float16 else 2e-2
        assert_close(y, ref, dtype, atol=tol * ref.abs().max().item(), rtol=tol)


def test_gemv_lanes_routes(device, monkeypatch):
    """gemv_lanes takes the lane kernel for q4_k at M = 1 and computes gemv otherwise (other formats, M > 1, float32
    x); gemv itself copies x into lane order for N * K >= LANES_MIN_WEIGHTS."""
    from llmkernels.qgemv import ops, route
    from llmkernels.qgemv.m1 import lane_order

    calls = []
    real = ops._launch_lanes
    monkeypatch.setattr(ops, "_launch_lanes", lambda *a, **k: calls.append(1) or real(*a, **k))
    N, K = 21, 2304
    for fmt, M, dtype, lanes in [("q4_k", 1, torch.float16, True), ("q8_0", 1, torch.float16, False),
                                 ("q4_k", 2, torch.float16, False), ("q4_k", 1, torch.float32, False)]:
        qt = lk.quantize(torch.randn(N, K, device=device) * 0.05, fmt)
        x = torch.randn(M, K, dtype=dtype, device=device)
        calls.clear()
        y = ops.gemv_lanes(x, lane_order(x), qt)
        assert len(calls) == int(lanes), (fmt, M, dtype)
        ref = gemv_ref(x, qt)
        assert_close(y, ref, dtype, atol=4e-3 * ref.abs().max().item(), rtol=4e-3)
    monkeypatch.setattr(route, "LANES_MIN_WEIGHTS", 16)
    calls.clear()
    qt = lk.quantize(torch.randn(N, K, device=device) * 0.05, "q4_k")
    x = torch.randn(1, K, dtype=torch.float16, device=device)
    ref = gemv_ref(x, qt)
    assert_close(lk.gemv(x, qt), ref, torch.float16, atol=4e-3 * ref.abs().max().item(), rtol=4e-3)
    assert calls == [1]


def test_gemv_lanes_bad_input(device):
    from llmkernels.qgemv.m1 import launch_m1
    from llmkernels.qgemv.ops import gemv_lanes

    N, K = 16, 2304
    qt = lk.quantize(torch.randn(N, K, device=device) * 0.05, "q4_k")
    x = torch.randn(1, K, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="x_lanes must be"):
        gemv_lanes(x, torch.zeros(1, K, dtype=torch.float16, device=device), qt)
    with pytest.raises(TypeError, match="x_lanes"):
        gemv_lanes(x, torch.zeros(1, 4096, dtype=torch.bfloat16, device=device), qt)
    with pytest.raises(ValueError, match="lane-order"):
        launch_m1(torch.zeros(1, 4096, dtype=torch.float16, device=device), qt.data, "q4_k", N, K, (1, 1, 1, 1, 4),
                  4, 1, x_perm=True)


@pytest.mark.gpu
def test_m1_lane_order_gpu(device):
    """Model-sized shapes, the tuned config and neighbours, inline-PTX unpacking, fp16 and bf16."""
    from llmkernels.qgemv.m1 import launch_m1

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for N, K in [(4096, 4096), (1001, 14336), (77, 2304)]:
        qt = lk.quantize(torch.randn(N, K, device=device) * 0.05, "q4_k")
        for config in [(2, 1, 4, 3, 8, 1, 1), (4, 1, 2, 4, 8, 1, 2), (1, 1, 8, 3, 8)]:
            for dtype in (torch.float16, torch.bfloat16):
                x = torch.randn(1, K, dtype=dtype, device=device)
                y = _finish(launch_m1(_lanes_poisoned(x), qt.data, "q4_k", N, K, config, sms, 2, x_perm=True), dtype)
                ref = gemv_ref(x, qt)
                tol = 4e-3 if dtype == torch.float16 else 2e-2
                assert_close(y, ref, dtype, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.gpu
def test_silu_large_gpu(device, monkeypatch):
    """silu_mul_gemv on q4_k at M = 1 with N * K >= route.LANES_MIN_WEIGHTS (the config "m1/q4_k/silu_large", K split
    over three programs per SM by default): odd N, one long and one wide shape, fp16 and bf16, against float64."""
    from llmkernels._runtime import gpu_name
    from llmkernels.qgemv import m1, route
    from llmkernels.testing import silu_mul_gemv_ref
    from llmkernels.tuning import lookup

    seen = []
    real = m1.launch_m1
    monkeypatch.setattr(m1, "launch_m1", lambda *a, **k: seen.append(tuple(a[5])) or real(*a, **k))
    for N, K in [(2347, 14336), (14337, 4096)]:
        assert N * K >= route.LANES_MIN_WEIGHTS
        qt = lk.quantize(torch.randn(N, K, device=device) * 0.05, "q4_k")
        for dtype in (torch.float16, torch.bfloat16):
            g, u = (torch.randn(1, K, dtype=dtype, device=device) * 2 for _ in range(2))
            y = lk.silu_mul_gemv(g, u, qt)
            ref = silu_mul_gemv_ref(g, u, qt)
            tol = 4e-3 if dtype == torch.float16 else 2e-2
            assert_close(y, ref, dtype, atol=tol * ref.abs().max().item(), rtol=tol)
    want = tuple(lookup("gemv", gpu_name(), "m1/q4_k/silu_large") or route.SILU_LARGE_DEFAULT)
    assert seen == [want] * 4


def _glu_ref(x, g, u):
    return torch.nn.functional.silu(gemv_ref(x, g)) * gemv_ref(x, u)


@pytest.mark.parametrize("N,K,M,config,lanes", [
    (37, 512, 1, (2, 1, 1, 1), False),            # one gate and one up row per thread, tile past N
    (19, 768, 3, (4, 1, 1, 1), False),            # three activation rows (run as four), two output rows per thread
    (45, 2048, 2, (4, 1, 1, 1, 4, 2), False),     # lanes along K and two threads per chunk
    (45, 2304, 1, (2, 1, 1, 1, 8, 1, 1), True),   # x in lane order (NaN in its unused tail)
    (130, 4096, 1, (2, 1, 2, 1, 8, 1, 1), True),  # two warps, two steps per program
])
def test_m1_glu(N, K, M, config, lanes, device):
    """silu(x G^T) * (x U^T) with the gate and up rows of each output in one thread (GLU), against float64, output
    poisoned before the call."""
    g = lk.quantize(torch.randn(N, K, device=device) * 0.05, "q4_k")
    u = lk.quantize(torch.randn(N, K, device=device) * 0.05, "q4_k")
    for dtype in (torch.float16,) if interpreter_mode() else (torch.float16, torch.bfloat16):
        x = torch.randn(M, K, dtype=dtype, device=device)
        y = _finish(launch_m1(_lanes_poisoned(x) if lanes else x, g.data, "q4_k", N, K, config, 4,
                              1 if interpreter_mode() else 2, up=u.data, x_perm=lanes), dtype)
        ref = _glu_ref(x, g, u)
        tol = 4e-3 if dtype == torch.float16 else 2e-2
        assert_close(y, ref, dtype, atol=tol * ref.abs().max().item(), rtol=tol)


def test_m1_glu_bad_config(device):
    g = lk.quantize(torch.randn(16, 256, device=device) * 0.05, "q4_k")
    x = torch.randn(1, 256, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="even R"):
        launch_m1(x, g.data, "q4_k", 16, 256, (1, 1, 1, 1), 4, 1, up=g.data)
    with pytest.raises(ValueError, match="of one shape"):
        launch_m1(x, g.data, "q4_k", 16, 256, (2, 1, 1, 1), 4, 1, up=g.data[:8])


def test_gate_up_silu_q4k_routes(device, monkeypatch):
    """Public gate_up_silu on q4_k at M <= 4 runs the m1 GLU kernel (through the lane copy for M = 1 on large
    matrices), larger M the general path; all against float64."""
    from llmkernels.qgemv import m1, route

    calls = []
    real = m1.launch_m1

    def spy(*a, **kw):
        calls.append((kw.get("up") is not None, kw.get("x_perm", False)))
        return real(*a, **kw)

    monkeypatch.setattr(m1, "launch_m1", spy)
    N, K = 21, 2304
    g = lk.quantize(torch.randn(N, K, device=device) * 0.05, "q4_k")
    u = lk.quantize(torch.randn(N, K, device=device) * 0.05, "q4_k")
    for M, min_w, want in [(1, 1 << 62, [(True, False)]), (4, 1 << 62, [(True, False)]), (1, 16, [(True, True)]),
                           (9, 1 << 62, [])]:
        monkeypatch.setattr(route, "LANES_MIN_WEIGHTS", min_w)
        calls.clear()
        x = torch.randn(M, K, dtype=torch.float16, device=device)
        y = lk.gate_up_silu(x, g, u)
        assert [c for c in calls if c[0]] == want, (M, min_w)
        ref = _glu_ref(x, g, u)
        assert_close(y, ref, torch.float16, atol=4e-3 * ref.abs().max().item(), rtol=4e-3)
