"""The GEMV routing table (qgemv.route.choose), pinned: which kernel serves each format, operation and M band on an
sm_90 GPU, and the override hook. A change of route shows here before it shows in a benchmark."""
import dataclasses

import pytest
import torch

from llmkernels.qgemv import route

H200 = route.Target("NVIDIA H200")
MS = (1, 2, 3, 4, 5, 8, 16, 17, 64, 65)

# (op, format, N, K, activation dtype, act_int8, MLX bits) -> the kernel at each M of MS
TABLE = {
    ("gemv", "f32", 4096, 4096, "fp16", False, 0): "generic generic generic generic generic generic generic generic generic dequant",
    ("gemv", "f16", 4096, 4096, "fp16", False, 0): "generic cublas cublas cublas cublas cublas cublas cublas cublas cublas",
    ("gemv", "bf16", 4096, 4096, "fp16", False, 0): "generic generic generic generic generic generic generic generic generic dequant",
    ("gemv", "bf16", 4096, 4096, "bf16", False, 0): "generic cublas cublas cublas cublas cublas cublas cublas cublas cublas",
    ("gemv", "q4_0", 4096, 4096, "fp16", False, 0): "tc tc tc tc tc tc tc tc tc dequant",
    ("gemv", "q4_1", 4096, 4096, "fp16", False, 0): "generic generic generic generic generic generic generic generic generic dequant",
    ("gemv", "q5_0", 4096, 4096, "fp16", False, 0): "generic generic generic generic generic generic generic generic generic dequant",
    ("gemv", "q8_0", 4096, 4096, "fp16", False, 0): "tc tc tc tc tc tc tc tc tc dequant",
    ("gemv", "q2_k", 4096, 4096, "fp16", False, 0): "generic generic generic generic generic generic generic generic generic dequant",
    ("gemv", "q3_k", 4096, 4096, "fp16", False, 0): "generic generic generic generic generic generic generic generic generic dequant",
    ("gemv", "q4_k", 4096, 4096, "fp16", False, 0): "m1 tc tc tc tc tc tc tc tc dequant",
    ("gemv", "q4_k", 14336, 4096, "fp16", False, 0): "lanes tc tc tc tc tc tc tc tc dequant",
    ("gemv", "q4_k", 4096, 4096, "fp32", False, 0): "m1 m1 m1 m1 planes planes planes planes planes dequant",
    ("gemv", "q5_k", 4096, 4096, "fp16", False, 0): "m1 m1 tc tc tc tc tc tc tc dequant",
    ("gemv", "q5_k", 4096, 14336, "fp16", False, 0): "m1 tc tc tc tc tc tc tc tc dequant",
    ("gemv", "q6_k", 4096, 4096, "fp16", False, 0): "tc tc tc tc tc tc tc tc tc dequant",
    ("gemv", "mlx", 4096, 4096, "fp16", False, 4): "m1 tc tc tc tc tc tc tc tc dequant",
    ("gemv", "mlx", 4096, 4096, "fp16", False, 8): "m1 m1 planes planes planes planes planes planes planes dequant",
    ("gemv", "mlx", 4096, 4096, "fp16", False, 3): "generic generic generic generic generic generic generic generic generic dequant",
    ("gemv", "q4_k", 4096, 4096, "fp16", True, 0): "i8_lanes tc tc tc tc tc tc tc tc dequant",
    ("gemv", "q8_0", 4096, 4096, "fp16", True, 0): "i8 tc tc tc tc tc tc tc tc dequant",
    ("gemv", "q6_k", 4096, 4096, "fp16", True, 0): "i8_lanes tc tc tc tc tc tc tc tc dequant",
    ("silu_mul", "q4_k", 4096, 14336, "fp16", False, 0): "m1 m1 m1 m1 tc tc tc tc tc dequant",
    ("gate_up", "q4_k", 14336, 4096, "fp16", False, 0): "lanes glu glu glu generic generic generic generic generic dequant",
    ("gate_up", "q8_0", 14336, 4096, "fp16", False, 0): "generic generic generic generic generic generic generic generic generic dequant",
    ("lanes", "q4_k", 4096, 4096, "fp16", False, 0): "lanes tc tc tc tc tc tc tc tc dequant",
}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def kernels(op, fmt, N, K, dtype, act, bits, operands=route.Operands()):
    return " ".join(route.choose(op, fmt, M, N, K, DTYPES[dtype], act, bits=bits, group_size=64 if bits else 0,
                                 operands=operands, target=H200).kernel for M in MS)


@pytest.mark.parametrize("case", list(TABLE), ids=["/".join(map(str, c)) for c in TABLE])
def test_routing_table(case):
    assert kernels(*case) == TABLE[case]


def test_routes_follow_the_operands():
    """Weights that are not 16-byte aligned leave the m1, lane and tensor-core kernels; f16 weights whose rows are
    not K elements of x's dtype leave cuBLAS."""
    assert kernels("gemv", "q4_k", 4096, 4096, "fp16", False, 0, route.Operands(aligned=False)) == \
        "planes planes planes planes planes planes planes planes planes dequant"
    assert kernels("gemv", "f16", 4096, 4096, "fp16", False, 0, route.Operands(dense_rows=False)) == \
        "generic generic generic generic generic generic generic generic generic dequant"
    r = route.choose("lanes", "q4_k", 1, 4096, 4096, torch.float16, operands=route.Operands(aligned=False), target=H200)
    assert r.kernel == "planes"


def test_route_details():
    """x handed over in k order from TC_XT_MIN_M rows (plain gemv only), the lane copy on large q4_k matrices, and
    configs from the tables (the interpreter: its small fixed tiles)."""
    xt = [route.choose("gemv", "q4_k", M, 4096, 4096, torch.float16, target=H200).xt for M in (16, 17, 64)]
    assert xt == [False, True, True]
    assert not route.choose("silu_mul", "q4_k", 32, 4096, 4096, torch.float16, target=H200).xt
    assert not route.choose("gemv", "q8_0", 64, 4096, 4096, torch.float16, target=H200).xt
    assert route.choose("gemv", "q4_k", 1, 14336, 4096, torch.float16, target=H200).lane_copy
    assert not route.choose("lanes", "q4_k", 1, 14336, 4096, torch.float16, target=H200).lane_copy
    interp = route.Target("cpu-interpreter", interpreter=True)
    assert route.choose("gemv", "q4_k", 8, 4096, 4096, torch.float16, target=interp).config == (128, 4, 1, 2)
    assert route.choose("gemv", "q4_k", 8, 96, 4096, torch.float16, target=interp).config == (16, 4, 1, 2)
    r = route.choose("gemv", "q4_1", 3, 40, 256, torch.float16, target=interp)
    assert r.kernel == "generic" and r.config == (16, 2, 4, 1)


def test_override_hook():
    """route.override: excluded kernels fall through to the next rule; a function may replace the answer; both end
    with the block."""
    choose = lambda: route.choose("gemv", "q4_k", 8, 4096, 4096, torch.float16, target=H200)  # noqa: E731
    assert choose().kernel == "tc"
    with route.override(exclude={"tc"}):
        assert choose().kernel == "planes"
        with route.override(exclude={"planes"}):
            assert choose().kernel == "generic"
        assert choose().kernel == "planes"
    with route.override(lambda q, r: dataclasses.replace(r, xt=True) if q.M == 8 else None):
        assert choose().xt and choose().kernel == "tc"
    assert choose() == route.choose("gemv", "q4_k", 8, 4096, 4096, torch.float16, target=H200)
    assert not choose().xt


def test_bad_queries_are_refused():
    with pytest.raises(ValueError, match="op must be one of"):
        route.choose("matmul", "q4_k", 1, 64, 256, torch.float16, target=H200)
    with pytest.raises(ValueError, match="GGUF format or 'mlx'"):
        route.choose("gemv", "q9_k", 1, 64, 256, torch.float16, target=H200)
    with pytest.raises(ValueError, match="M, N and K must be positive"):
        route.choose("gemv", "q4_k", 0, 64, 256, torch.float16, target=H200)


@pytest.mark.parametrize("fmt,N,K", [("q4_k", 14336, 4096), ("q6_k", 4096, 14336), ("q8_0", 96, 256)])
def test_route_table_holds_what_choose_says(fmt, N, K):
    """ops.route_table (the engine's routes, chosen at load) answers as route.choose would at every M, also past
    MID_M where one entry serves all; an override active when the table is made stays in it."""
    from llmkernels.qgemv.ops import operands, route_table, table_route, target
    from llmkernels.quant import GGUF_FORMATS
    from llmkernels.quant.tensor import QuantizedTensor

    # routes depend on the shape and the storage, not the values: random block bytes, not a slow quantization
    qt = QuantizedTensor.from_raw(torch.randint(0, 256, (N, GGUF_FORMATS[fmt].bytes_per_row(K)), dtype=torch.uint8),
                                  fmt, (N, K))
    table = route_table(qt, torch.float16)
    x = torch.empty(1, K, dtype=torch.float16)
    o = operands("gemv", x, None, qt.data, None, qt.scales, qt.biases, fmt, 0, K)
    for op in ("gemv", "lanes", "silu_mul"):
        for act in (False, True):
            for M in (1, 2, 5, 16, 64, 65, 300, 4096):
                want = route.choose(op, fmt, M, N, K, torch.float16, act, operands=o, target=target(qt.data.device))
                assert table_route(table, op, M, act) == want, (op, act, M)
    with route.override(exclude={"planes", "m1", "tc", "lanes", "i8_lanes"}):
        held = route_table(qt, torch.float16)
    assert {r.kernel for rs in held.values() for r in rs} <= {"generic", "i8", "dequant"}
    assert {r.kernel for rs in table.values() for r in rs} != {r.kernel for rs in held.values() for r in rs}


def test_tc_padding(monkeypatch):
    """Which matrices the engine pads along K (ops.tc_padding): large q6_k ones whose K is not a multiple of 2048
    (rows not 16-byte aligned) and q4_0 / q8_0 ones whose K is not a multiple of 256, to the next multiple, where
    the padded shape takes the tensor-core kernel; nothing else, and nothing under the interpreter."""
    from llmkernels.qgemv import ops
    from llmkernels.quant.tensor import QuantizedTensor

    def qt(fmt, N, K):
        from llmkernels.quant import GGUF_FORMATS

        return QuantizedTensor(fmt, (N, K), torch.empty(N, GGUF_FORMATS[fmt].bytes_per_row(K), dtype=torch.uint8))

    assert ops.tc_padding(qt("q6_k", 256000, 3584), torch.bfloat16) is None  # the interpreter: never
    monkeypatch.setattr(ops, "target", lambda device: H200)
    assert ops.tc_padding(qt("q6_k", 256000, 3584), torch.bfloat16) == 4096  # Gemma 2's output matrix
    assert ops.tc_padding(qt("q6_k", 152064, 18944), torch.float16) == 20480
    assert ops.tc_padding(qt("q6_k", 128256, 4096), torch.bfloat16) is None  # aligned already
    assert ops.tc_padding(qt("q6_k", 2048, 3584), torch.bfloat16) == 4096  # Gemma 2's V
    assert ops.tc_padding(qt("q6_k", 4096, 7168), torch.bfloat16) == 8192  # a TP = 2 rank's down (Llama-3-8B)
    assert ops.tc_padding(qt("q6_k", 512, 3584), torch.bfloat16) is None  # small: not worth a launch for x
    assert ops.tc_padding(qt("q4_k", 256000, 3584), torch.bfloat16) is None  # 144-byte blocks: always aligned
    assert ops.tc_padding(qt("q6_k", 256000, 3584), torch.float32) is None  # float32 x: no tensor-core route
    # q4_0 / q8_0 with K not a multiple of 256 (gpt-oss: K = 2880): whole 256-weight steps, 16-byte aligned rows
    assert ops.tc_padding(qt("q8_0", 5120, 2880), torch.bfloat16) == 3072  # gpt-oss's QKV
    assert ops.tc_padding(qt("q8_0", 201088, 2880), torch.float16) == 3072  # its output matrix
    assert ops.tc_padding(qt("q4_0", 5120, 2880), torch.bfloat16) == 3072
    assert ops.tc_padding(qt("q8_0", 2880, 4096), torch.bfloat16) is None  # K whole steps already
    assert ops.tc_padding(qt("q8_0", 512, 2880), torch.bfloat16) is None  # small
    assert ops.tc_padding(qt("iq4_nl", 5120, 2880), torch.bfloat16) is None  # not padded along K


def test_moe_config_reads_the_table_then_falls_back(monkeypatch):
    """The per-pair MoE GEMV takes its own tuned entry (``tune moe``: shipped for sm90, an override first), else the
    generic kernel's M = 1 config; the interpreter never reads the tables."""
    from llmkernels.tuning import OVERRIDES, lookup

    gpu = route.Target("NVIDIA H200")
    entry = lookup("gemv", gpu.gpu, "moe/kquant")  # none shipped while no checked winner exists: the fallback
    want = tuple(entry) if entry is not None else route.generic_config(gpu, "q4_k", 1, 768, 2048, 0, 0)
    assert route.moe_config(gpu, "q4_k", 768, 2048, 0, 0) == want
    monkeypatch.setitem(OVERRIDES, ("gemv", "moe/kquant"), [32, 2, 8, 2])
    assert route.moe_config(gpu, "q4_k", 768, 2048, 0, 0) == (32, 2, 8, 2)
    monkeypatch.setitem(OVERRIDES, ("gemv", "moe/kquant"), [8, 1, 2, 4])  # K-quants never get 8-row tiles
    assert route.moe_config(gpu, "q4_k", 768, 2048, 0, 0) == (16, 1, 2, 4)
    assert route.moe_config(gpu, "q8_0", 768, 2048, 0, 0) == tuple(lookup("gemv", gpu.gpu, "moe/legacy"))
    interp = route.Target("cpu", interpreter=True)
    assert route.moe_config(interp, "q4_k", 768, 2048, 0, 0) == route.generic_config(interp, "q4_k", 1, 768, 2048, 0,
                                                                                      0)
    real = route.lookup
    monkeypatch.setattr(route, "lookup", lambda table, g, key: None if key.startswith("moe") else real(table, g, key))
    assert route.moe_config(gpu, "q8_0", 768, 2048, 0, 0) == route.generic_config(gpu, "q8_0", 1, 768, 2048, 0, 0)


def test_moe_m1_config(monkeypatch):
    """The m1 kernel's MoE config: a tuned moe_m1 entry first, else the dense M = 1 one; GLU gets an even R, and the
    lanes along K shrink to an expert's block count."""
    from llmkernels.tuning import OVERRIDES

    gpu = route.Target("NVIDIA H200")
    OVERRIDES[("gemv", "moe_m1/q4_k")] = [3, 1, 4, 3, 8, 1, 1]
    try:
        assert route.moe_m1_config(gpu, "q4_k", 768, 2048, glu=True) == (4, 1, 4, 3, 8, 1, 1)
        assert route.moe_m1_config(gpu, "q4_k", 2048, 768, glu=False) == (3, 1, 4, 3, 2, 1, 1)  # 3 blocks: 2 lanes
    finally:
        OVERRIDES.pop(("gemv", "moe_m1/q4_k"), None)
    real = route.lookup
    monkeypatch.setattr(route, "lookup", lambda table, g, key: None if key.startswith("moe") else real(table, g, key))
    assert route.moe_m1_config(gpu, "q6_k", 2048, 768, glu=False)[:4] == route.m1_config(gpu, "q6_k", 1)[:4]


def test_moe_tc_rule():
    """MoE pairs go to the tensor cores once random choices would share experts 1.25 times on average: Qwen3-MoE's
    128 experts top 8 from 8 tokens, Mixtral's 8 experts top 2 from 3 tokens; never one pair; blocks of 16 or 32."""
    assert not route.moe_tc(8, 128) and not route.moe_tc(32, 128) and route.moe_tc(64, 128)
    assert not route.moe_tc(2, 8) and not route.moe_tc(4, 8) and route.moe_tc(6, 8)
    assert not route.moe_tc(1, 1)
    with route.override(exclude={"moe_tc"}):
        assert not route.moe_tc(4096, 128)
    with route.override(exclude={"moe_gemv", "moe_grouped"}):
        assert route.moe_tc(2, 128)
    assert [route.moe_tc_rows(p, 128) for p in (8, 512, 2048, 4096, 32768)] == [16, 16, 16, 32, 32]
    # formats without an m1 kernel (the per-pair GEMV would be the generic kernel): from one pair, unless excluded
    assert route.moe_tc(1, 32, per_pair_m1=False) and route.moe_tc(4, 128, per_pair_m1=False)
    assert not route.moe_tc(0, 32, per_pair_m1=False)
    with route.override(exclude={"moe_tc"}):
        assert not route.moe_tc(4, 32, per_pair_m1=False)


def test_moe_tc_split_rule():
    """Small tensor-core MoE grids split K until about MOE_TC_WAVES busy programs per SM, at most MOE_TC_MAX_SPLIT
    ways, each split keeping MOE_TC_MIN_STEPS steps: gpt-oss's one-token down (45 tiles x 4 experts, 12 steps) on
    132 SMs splits 2 ways, its fused gate/up (90 tiles x 4) and any grid past 2 x 132 programs not at all, a
    3-step row (Qwen3-MoE's down, K = 768) never; never under the interpreter."""
    assert route.moe_tc_split(180, 12, 132) == 2
    assert route.moe_tc_split(360, 12, 132) == 1 and route.moe_tc_split(264, 12, 132) == 1
    assert route.moe_tc_split(20, 12, 132) == route.MOE_TC_MAX_SPLIT
    assert route.moe_tc_split(20, 6, 132) == 2 and route.moe_tc_split(20, 3, 132) == 1
    assert route.moe_tc_split(180, 12, 132, interpreter=True) == 1 and route.moe_tc_split(0, 12, 132) == 1
