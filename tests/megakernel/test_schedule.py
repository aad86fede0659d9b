"""The one-kernel decode step's instruction schedule, in pure Python: coverage, dependencies, hazards, deadlock."""
import dataclasses

import numpy as np
import pytest

from llmkernels.bench.suites.engine import llama3_8b_config
from llmkernels.engine import ModelConfig
from llmkernels.megakernel import schedule as S


def _tiny(**kw) -> ModelConfig:
    base = dict(arch="llama", n_layers=3, hidden=320, ffn=704, n_heads=6, n_kv_heads=2, head_dim=64, vocab_size=1000,
                rms_eps=1e-5, rope_theta=10000.0, rope_style="interleaved", context_length=512, eos_ids=())
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("fmt", ["q4_k_m", "q4_k", "q8_0", "bf16"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_llama3_8b_layers_schedule_is_sound(fmt, batch):
    """Three layers of the 8B shape on 132 SMs: every rule of check, hazards included (the layers repeat)."""
    cfg = llama3_8b_config(layers=3)
    prog = S.build_decode_program(cfg, fmt, batch=batch, context=1000)
    S.check(prog)
    enc = prog.encode()
    assert enc.shape[0] == 132 and enc.shape[2] == len(S.FIELDS)
    assert (enc[:, -1] == 0).all()  # every list ends with END
    ops = [i.op for i in prog.instructions]
    assert ops[0] == "EMBED" and ops[-1] == "LOGITS"
    per_layer = {op: sum(1 for i in prog.instructions if i.op == op and i.layer == 1) for op in S.OPS[2:8]}
    # one ATTN per KV head, sequence and key split, the splits as many as keep them within the SMs
    assert prog.geometry["splits"] == 132 // (8 * batch)
    assert per_layer["ATTN"] == 8 * batch * (132 // (8 * batch)) and per_layer["MERGE"] == 32  # one per query head
    # the weights of the step are all streamed once
    rb = S.matrix_bytes(cfg, fmt)
    want = batch * rb[("embed", -1)] + cfg.vocab_size * rb[("logits", -1)] + sum(
        4096 * rb[("q", li)] + 1024 * (rb[("k", li)] + rb[("v", li)]) + 4096 * rb[("o", li)]
        + 14336 * rb[("gateup", li)] + 4096 * rb[("down", li)] for li in range(3))
    assert prog.weight_bytes == want


def test_whole_model_orders_and_covers():
    """All 32 layers (the quadratic hazard pass left out); the simulated step is deadlock-free and within the
    bound."""
    prog = S.build_decode_program(llama3_8b_config(), "q4_k_m")
    S.check(prog, hazards=False)
    sim = S.simulate(prog)
    assert sim["time"] >= sim["weight_time"] > 0 and 0 < sim["fraction"] <= 1
    assert max(sim["busy"]) <= sim["time"]


@pytest.mark.parametrize("num_sms", [1, 5, 16])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_awkward_sizes(num_sms, splits):
    """Odd SM counts, one SM (everything in one list), split counts that do not divide the heads."""
    prog = S.build_decode_program(_tiny(), "q8_0", batch=2, context=77, num_sms=num_sms, num_splits=splits)
    S.check(prog)
    S.simulate(prog)


@pytest.mark.parametrize("num_sms", [1, 5, 132])
@pytest.mark.parametrize("batch", [1, 3])
def test_mixture_of_experts_schedule_is_sound(num_sms, batch):
    """Per MoE layer ROUTER tiles, one TOPK, XGATEUP tiles of every expert slot, XDOWN tiles: every rule of check,
    and the weights counted once per sequence's routed experts (the active weights at batch 1)."""
    cfg = _tiny(n_experts=5, n_experts_used=2, expert_ffn=96)
    prog = S.build_decode_program(cfg, "q8_0", batch=batch, context=77, num_sms=num_sms)
    S.check(prog)
    S.simulate(prog)
    ops = {i.op for i in prog.instructions}
    assert {"GATEUP", "DOWN"}.isdisjoint(ops) and {"ROUTER", "TOPK", "XGATEUP", "XDOWN"} <= ops
    slots = {(i.layer, i.split) for i in prog.instructions if i.op == "XGATEUP"}
    assert slots == {(li, j) for li in range(3) for j in range(2)}
    rb = S.matrix_bytes(cfg, "q8_0")
    assert rb[("router", 0)] == 320 * 4  # float32 rows
    want = batch * rb[("embed", -1)] + 1000 * rb[("logits", -1)] + sum(
        (6 + 4) * 64 * rb[("q", li)] + 320 * rb[("o", li)] + 5 * rb[("router", li)]
        + batch * 2 * (96 * rb[("xgateup", li)] + 320 * rb[("xdown", li)]) for li in range(3))
    assert prog.weight_bytes == want


def test_qwen3_moe_layers_schedule_is_sound():
    """Three layers of the Qwen3-30B-A3B shape (128 experts, top 8) on 132 SMs, hazards included."""
    cfg = ModelConfig(arch="qwen3moe", n_layers=3, hidden=2048, ffn=6144, n_heads=32, n_kv_heads=4, head_dim=128,
                      vocab_size=151936, rms_eps=1e-6, rope_theta=1e6, rope_style="neox", context_length=4096,
                      eos_ids=(), qk_norm=True, n_experts=128, n_experts_used=8, expert_ffn=768)
    prog = S.build_decode_program(cfg, "q4_k_m", batch=1, context=1000)
    S.check(prog)
    per_layer = {op: sum(1 for i in prog.instructions if i.op == op and i.layer == 1)
                 for op in ("ROUTER", "TOPK", "XGATEUP", "XDOWN")}
    # the router's 128 rows one per SM (it is on the critical path), the expert slots' tiles a multiple of 8
    assert per_layer["TOPK"] == 1 and per_layer["XGATEUP"] % 8 == 0 and per_layer["ROUTER"] == 128


def test_tile_rows():
    assert S.tile_rows([(4096, 2304)], 132) == 32  # 128 tiles: one wave
    assert S.tile_rows([(4096, 100), (1024, 100), (1024, 100)], 132) == 48  # 86 + 22 + 22 = 130 tiles
    assert S.tile_rows([(100, 10)], 1) == 112  # one SM: one tile of the whole (rounded up to 16)


def _mutate(prog, pick, **change):
    """A copy of ``prog`` with the first instruction ``pick`` accepts replaced by ``dataclasses.replace(**change)``."""
    lists = [list(lst) for lst in prog.lists]
    for lst in lists:
        for k, i in enumerate(lst):
            if pick(i):
                lst[k] = dataclasses.replace(i, **change)
                return dataclasses.replace(prog, lists=lists)
    raise AssertionError("nothing to mutate")


def test_check_catches_broken_schedules():
    prog = S.build_decode_program(_tiny(), "q4_k", num_sms=4)
    S.check(prog)
    # a target nobody reaches
    bad = _mutate(prog, lambda i: i.op == "O" and i.layer == 1, target=99)
    with pytest.raises(ValueError, match="O layer 1 .* to reach 99, but 2 instructions signal it"):
        S.check(bad)
    # an O tile that does not wait for the attention: it reads and writes before MERGE and QKV are done
    bad = _mutate(prog, lambda i: i.op == "O" and i.layer == 2, wait=-1, target=0)
    with pytest.raises(ValueError, match="O layer 2 .* without depending on it"):
        S.check(bad)
    # a GEMV tile cut short: a gap in the rows
    bad = _mutate(prog, lambda i: i.op == "DOWN" and i.layer == 0 and i.lo == 0, hi=8)
    with pytest.raises(ValueError, match="DOWN layer 0: its tiles .* leave a gap"):
        S.check(bad)
    # an instruction lost
    lists = [[i for i in lst if not (i.op == "ATTN" and i.layer == 0)] for lst in prog.lists]
    with pytest.raises(ValueError, match="instruction numbers must be 0..n-1"):
        S.check(dataclasses.replace(prog, lists=lists))
    # an SM's list out of the global order
    lists = [list(lst) for lst in prog.lists]
    lists[0][1], lists[0][2] = lists[0][2], lists[0][1]
    with pytest.raises(ValueError, match="SM 0's list is not in the global order"):
        S.check(dataclasses.replace(prog, lists=lists))


def test_simulate_names_a_deadlock():
    """A list that waits on its own later instruction hangs the kernel; the simulation names it instead."""
    prog = S.build_decode_program(_tiny(n_layers=1), "q8_0", num_sms=1)
    lst = prog.lists[0]
    a = next(n for n, i in enumerate(lst) if i.op == "ATTN" and i.lo == 1)
    m = next(n for n, i in enumerate(lst) if i.op == "MERGE" and i.lo // 3 == 1)  # KV head 1's query heads
    lists = [lst[:a] + lst[a + 1:m + 1] + [lst[a]] + lst[m + 1:]]  # head 1's MERGE before the split it waits for
    with pytest.raises(RuntimeError, match="deadlocks: SM 0 at MERGE layer 0 .* waiting on layer 0 attn head 1 "
                                           r"splits \(0/1\)"):
        S.simulate(dataclasses.replace(prog, lists=lists))


def test_prefetch_hides_the_gaps(monkeypatch):
    """The cost model: with no signal latency and a prefetch window as large as any tile, only tile quantization,
    the attention's bytes and the run latency of ATTN and MERGE keep the step from the bound; without prefetch
    every dependency costs a bubble."""
    prog = S.build_decode_program(llama3_8b_config(layers=4), "q4_k", context=64)
    exposed = S.simulate(prog, prefetch_bytes=0, signal_latency=2e-6)
    with_latency = S.simulate(prog, prefetch_bytes=1 << 30, signal_latency=0.0)
    monkeypatch.setattr(S, "RUN_LATENCY", {})
    hidden = S.simulate(prog, prefetch_bytes=1 << 30, signal_latency=0.0)
    assert hidden["fraction"] > 0.9 > with_latency["fraction"] > exposed["fraction"]


def test_one_attention_split_per_sm():
    """ATTN's run latency in the cost model spreads the splits: no SM runs two of one layer while SMs are left."""
    prog = S.build_decode_program(llama3_8b_config(layers=2), "bf16", context=512, num_sms=132)
    for layer in range(2):
        per_sm = [sum(1 for i in lst if i.op == "ATTN" and i.layer == layer) for lst in prog.lists]
        assert sum(per_sm) == 128 and max(per_sm) == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="batch must be 1..8"):
        S.build_decode_program(_tiny(), "q8_0", batch=9)
    for kw, msg in ((dict(batch=0), "batch must be 1..8"), (dict(num_sms=0), "num_sms must be an int >= 1, got 0"),
                    (dict(context=0), "context must be"), (dict(num_splits=0), "num_splits must be None or an int")):
        with pytest.raises(ValueError, match=msg):
            S.build_decode_program(_tiny(), "q8_0", **kw)
    with pytest.raises(ValueError, match="fmt must be a GGUF format or a mix such as q4_k_m, got 'q9_k'"):
        S.build_decode_program(_tiny(), "q9_k")
    assert np.int32 == S.build_decode_program(_tiny(), "q8_0", num_sms=2).encode().dtype
