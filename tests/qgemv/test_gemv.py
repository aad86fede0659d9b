"""gemv / silu_mul_gemv / gate_up_silu / embedding against products with the dequantized weights (float64)."""
import pytest
import torch

import llmkernels as lk
from llmkernels.testing import assert_close, embedding_ref, gemv_ref, silu_mul_gemv_ref

GGUF = ["f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl",
        "iq4_xs", "mxfp4"]
MLX = [(4, 64), (3, 32), (5, 128), (6, 64), (2, 32), (8, 128)]
ALL = [(f, {}) for f in GGUF] + [("mlx", dict(bits=b, group_size=g)) for b, g in MLX]
ids = [f if not kw else f"mlx{kw['bits']}g{kw['group_size']}" for f, kw in ALL]


def weights(fmt, kw, N, K, device):
    return lk.quantize(torch.randn(N, K, device=device) * 0.05, fmt, **kw)


def rel_close(y, ref, dtype):
    """Relative to the output's scale: a dot over K of O(1) terms, rounded to the activation dtype."""
    tol = {torch.float16: 4e-3, torch.bfloat16: 2e-2, torch.float32: 1e-3}[dtype]
    scale = ref.abs().max().item() + 1e-6
    assert_close(y, ref, dtype, atol=tol * scale, rtol=tol)


@pytest.mark.parametrize("fmt,kw", ALL, ids=ids)
def test_gemv_every_format(fmt, kw, device):
    K = 512 if fmt != "f16" else 96  # dense formats: K need not be a multiple of 32
    N = 37
    qt = weights(fmt, kw, N, K, device)
    for M in (1, 3, 5):  # q4_k: M <= 4 takes the m1 kernel, one program row per activation row
        x = torch.randn(M, K, dtype=torch.float16, device=device)
        y = lk.gemv(x, qt)
        assert y.shape == (M, N) and y.dtype == torch.float16
        rel_close(y, gemv_ref(x, qt), torch.float16)


@pytest.mark.parametrize("fmt,kw", [("q4_k", {}), ("q8_0", {}), ("mlx", dict(bits=4, group_size=64))])
def test_embedding(fmt, kw, device):
    qt = weights(fmt, kw, 29, 256, device)
    ids_ = torch.tensor([[3, 0], [28, 3]], device=device)
    e = lk.embedding(ids_, qt, dtype=torch.float32)
    assert e.shape == (2, 2, 256)
    assert_close(e, embedding_ref(ids_, qt), torch.float32, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="ids must be in"):
        lk.embedding(torch.tensor([29], device=device), qt)


def test_silu_mul_and_gate_up(device):
    K, N = 256, 33
    down = weights("q4_k", {}, N, K, device)
    gate = torch.randn(3, K, dtype=torch.float16, device=device)
    up = torch.randn(3, K, dtype=torch.float16, device=device)
    rel_close(lk.silu_mul_gemv(gate, up, down), silu_mul_gemv_ref(gate, up, down), torch.float16)
    wg, wu = weights("q8_0", {}, N, K, device), weights("q8_0", {}, N, K, device)
    x = torch.randn(2, K, dtype=torch.float16, device=device)
    g, u = gemv_ref(x, wg), gemv_ref(x, wu)
    rel_close(lk.gate_up_silu(x, wg, wu), torch.nn.functional.silu(g) * u, torch.float16)


@pytest.mark.parametrize("fmt,kw,M", [("q4_k", {}, 1), ("q4_k", {}, 3), ("q5_k", {}, 1), ("q5_k", {}, 2),
                                      ("q6_k", {}, 2),
                                      ("mlx", {"bits": 4, "group_size": 64}, 2),
                                      ("mlx", {"bits": 8, "group_size": 32}, 1)])
@pytest.mark.parametrize("layout", ["halves", "separate"])
def test_silu_mul_fused_in_m1(fmt, kw, M, layout, device, monkeypatch):
    """silu_mul_gemv at small M runs the m1 kernel with the product formed in its loads: gate and up as the halves
    of one [M, 2K] projection output (the engine's layout) or as two tensors."""
    from llmkernels.qgemv import m1

    calls = []
    real = m1.launch_m1

    def spy(*args, **kwargs):
        calls.append(kwargs.get("x2") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(m1, "launch_m1", spy)
    N, K = 37, 512
    qt = weights(fmt, kw, N, K, device)
    if layout == "halves":
        gu = torch.randn(M, 2 * K, dtype=torch.float16, device=device)
        gate, up = gu[:, :K], gu[:, K:]
    else:
        gate, up = (torch.randn(M, K, dtype=torch.float16, device=device) for _ in range(2))
    rel_close(lk.silu_mul_gemv(gate, up, qt), silu_mul_gemv_ref(gate, up, qt), torch.float16)
    assert calls == [True]


@pytest.mark.parametrize("fmt", ["q5_k", "q6_k"])
@pytest.mark.parametrize("M", [1, 4, 7, 9])
def test_q5k_q6k_small_m_take_m1(fmt, M, device, monkeypatch):
    """q5_k below TC_FIRST_M and q6_k with K not a multiple of 2048 (so not on the tensor-core kernel) up to
    M1_MAX_M run the m1 kernel (their high bits merged into 5- or 6-bit codes in registers), beyond it the generic
    one."""
    from llmkernels.qgemv import m1 as m1_mod
    from llmkernels.qgemv.route import M1_MAX_M, TC_FIRST_M

    m1 = M <= M1_MAX_M[fmt] and not (fmt == "q5_k" and M >= TC_FIRST_M[fmt])
    calls = []
    real = m1_mod.launch_m1
    monkeypatch.setattr(m1_mod, "launch_m1", lambda *a, **kw: calls.append(a[2]) or real(*a, **kw))
    qt = weights(fmt, {}, 45, 768, device)
    x = torch.randn(M, 768, dtype=torch.float16, device=device)
    rel_close(lk.gemv(x, qt), gemv_ref(x, qt), torch.float16)
    assert calls == ([fmt] if m1 else [])


def test_fp32_activations_and_leading_dims(device):
    qt = weights("q5_1", {}, 17, 128, device)
    x = torch.randn(2, 3, 128, dtype=torch.float32, device=device)
    y = lk.gemv(x, qt)
    assert y.shape == (2, 3, 17)
    rel_close(y.reshape(6, 17), gemv_ref(x.reshape(6, 128), qt), torch.float32)


def test_mid_and_large_m_paths(device):
    qt = weights("q4_0", {}, 19, 64, device)
    for M in (40, 70):  # M-blocks of 16 in the grid; dequantize + matmul
        x = torch.randn(M, 64, dtype=torch.float16, device=device)
        rel_close(lk.gemv(x, qt), gemv_ref(x, qt), torch.float16)


@pytest.mark.parametrize("fmt,dtype", [("f16", torch.float16), ("bf16", torch.bfloat16), ("f32", torch.float32)])
def test_dense_weights_in_x_dtype(fmt, dtype, device):
    """f16/bf16 weights stored in x's dtype go to torch's matmul from M = 2 (the kernel at M = 1, for f32, and for
    silu_mul_gemv): every path right."""
    qt = weights(fmt, {}, 23, 96, device)
    for M in (1, 2, 17, 40):
        x = torch.randn(M, 96, dtype=dtype, device=device)
        y = lk.gemv(x, qt)
        assert y.shape == (M, 23) and y.dtype == dtype
        rel_close(y, gemv_ref(x, qt), dtype)
    g, u = torch.randn(2, 17, 96, dtype=dtype, device=device)
    rel_close(lk.silu_mul_gemv(g, u, qt), silu_mul_gemv_ref(g, u, qt), dtype)


@pytest.mark.parametrize("call,exc,match", [
    (lambda qt, d: lk.gemv(torch.randn(1, 100, dtype=torch.float16, device=d), qt), ValueError, "K=64"),
    (lambda qt, d: lk.gemv(torch.randn(0, 64, dtype=torch.float16, device=d), qt), ValueError, "M = 0"),
    (lambda qt, d: lk.gemv(torch.randint(0, 3, (1, 64), device=d), qt), TypeError, "x must have dtype"),
    (lambda qt, d: lk.gemv(torch.randn(1, 64, dtype=torch.float16, device=d), torch.randn(4, 64)), TypeError,
     "QuantizedTensor"),
    (lambda qt, d: lk.silu_mul_gemv(torch.randn(1, 64, dtype=torch.float16, device=d),
                                    torch.randn(2, 64, dtype=torch.float16, device=d), qt), ValueError, "must match"),
])
def test_bad_input(call, exc, match, device):
    qt = weights("q4_0", {}, 8, 64, device)
    with pytest.raises(exc, match=match):
        call(qt, device)


@pytest.mark.parametrize("fmt,N,K,M", [("f32", 37, 768, 1), ("bf16", 53, 1024, 1), ("q2_k", 19, 1280, 3),
                                       ("q4_1", 70, 512, 1)])
@pytest.mark.parametrize("small", [True, False])
def test_generic_split_k_sums_in_kernel(fmt, N, K, M, small, device, monkeypatch):
    """The generic kernel with K split: for matrices up to route.GENERIC_FIXUP_MAX_WEIGHTS the last program of each
    tile sums the partials (no second launch) and resets its counter, so repeated calls (a replayed graph) stay
    right; larger ones get the separate sum. The splits are forced by a large SM count."""
    from llmkernels._runtime import split_counters
    from llmkernels.qgemv import common, ops, route

    if not small:
        monkeypatch.setattr(route, "GENERIC_FIXUP_MAX_WEIGHTS", N * K - 1)
    monkeypatch.setattr(ops, "num_sms", lambda device: 64)
    splits, sums = [], []
    monkeypatch.setattr(ops, "split_k", lambda *a, **kw: splits.append(common.split_k(*a, **kw)) or splits[-1])
    real = common._splitk_sum_kernel
    monkeypatch.setattr(common, "_splitk_sum_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: (sums.append(grid), real[grid])[1]})())
    qt = weights(fmt, {}, N, K, device)
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float16
    assert route.choose("gemv", fmt, M, N, K, dtype, target=ops.target(qt.device)).kernel == "generic"
    for _ in range(2):
        x = torch.randn(M, K, dtype=dtype, device=device)
        rel_close(lk.gemv(x, qt), gemv_ref(x, qt), dtype)
    assert splits and all(split > 1 for split, _ in splits), splits
    assert (sums == []) == small and int(split_counters(qt.device).abs().sum()) == 0


GPU_SHAPES = [(4096, 4096), (1000, 14336), (129, 2048), (32768 + 64, 1024)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])  # float32 x: the planes kernel
@pytest.mark.parametrize("fmt,kw", ALL, ids=ids)
def test_gemv_gpu(fmt, kw, dtype, device):
    for N, K in GPU_SHAPES[:2] if fmt in ("q4_k", "q5_k", "q6_k", "q4_0", "q8_0", "mlx") else GPU_SHAPES[2:3]:
        qt = weights(fmt, kw, N, K, device)
        for M in (1, 2, 7, 16, 33, 64):
            x = torch.randn(M, K, dtype=dtype, device=device)
            rel_close(lk.gemv(x, qt), gemv_ref(x, qt), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["q5_k", "q6_k"])
def test_tc_register_cap_gpu(fmt, device, monkeypatch):
    """The tensor-core kernel's register cap holds up to route.TC_CAP_MAX_M rows only (it spills beyond); the results
    stay right either way."""
    from llmkernels.qgemv import route, tc

    seen = []
    real = tc.launch_tc

    def spy(x, data, N, K, config, *a, **kw):
        seen.append((x.shape[0], tuple(config)))
        return real(x, data, N, K, config, *a, **kw)

    monkeypatch.setattr(tc, "launch_tc", spy)
    qt = weights(fmt, {}, 2048, 4096, device)
    for M in (16, 32, 48, 64):
        x = torch.randn(M, 4096, dtype=torch.bfloat16, device=device)
        rel_close(lk.gemv(x, qt), gemv_ref(x, qt), torch.bfloat16)
    assert [M for M, _ in seen] == [16, 32, 48, 64]
    for M, config in seen:
        capped = len(config) > 5 and config[5] > 0
        assert capped == (M <= route.TC_CAP_MAX_M[fmt]), (M, config)


@pytest.mark.gpu
def test_wide_n_and_fused_gpu(device):
    N, K = GPU_SHAPES[3]
    qt = weights("q6_k", {}, N, K, device)
    x = torch.randn(1, K, dtype=torch.bfloat16, device=device)
    rel_close(lk.gemv(x, qt), gemv_ref(x, qt), torch.bfloat16)
    down = weights("q4_k", {}, 4096, 14336, device)
    gate = torch.randn(4, 14336, dtype=torch.bfloat16, device=device)
    up = torch.randn(4, 14336, dtype=torch.bfloat16, device=device)
    rel_close(lk.silu_mul_gemv(gate, up, down), silu_mul_gemv_ref(gate, up, down), torch.bfloat16)


@pytest.mark.gpu
def test_gemv_compile_and_graph(device):
    qt = weights("q4_k", {}, 4096, 4096, device)
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device=device)
    f = torch.compile(lambda x: lk.gemv(x, qt) + 1, fullgraph=True)
    rel_close(f(x) - 1, gemv_ref(x, qt), torch.bfloat16)
    y = lk.gemv(x, qt)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = lk.gemv(x, qt)
    x.copy_(torch.randn_like(x))
    g.replay()
    rel_close(y, gemv_ref(x, qt), torch.bfloat16)


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "f16"])
def test_model_sized_tiles_with_a_ragged_tail(fmt, device):
    """N >= 128 takes the large tiles (in the interpreter too); N = 130 leaves a 2-row tail block."""
    N, K = 130, 512
    qt = weights(fmt, {}, N, K, device)
    for M in (1, 5):
        x = torch.randn(M, K, dtype=torch.float16, device=device)
        rel_close(lk.gemv(x, qt), gemv_ref(x, qt), torch.float16)


def test_codebook_formats_compile_for_sm90():
    """The generic kernel's codebook branches (iq4_nl, iq4_xs, mxfp4: levels looked up in registers, E8M0 scales)
    compile to sm_90 code on a machine without a GPU, at M = 1 with fused gate/up and on the tensor-core path; the
    interpreter runs the same source, so the tests above cover the arithmetic."""
    from tests.compiled import run_compiled

    code = ("from llmkernels.qgemv.kernels import compile_sm90; "
            "print(all(len(compile_sm90(f, m, m == 1).asm['cubin']) > 0 "
            "for f in ('iq4_nl', 'iq4_xs', 'mxfp4') for m in (1, 16)))")
    assert run_compiled(code) == "True"
