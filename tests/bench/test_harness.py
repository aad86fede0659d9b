"""The benchmark harness without a GPU: tables, the results schema, committed results files, charts."""
import json
from pathlib import Path

import pytest

from llmkernels.bench.harness import Context, Row, format_table, write_results

RESULTS = sorted((Path(__file__).parents[2] / "bench" / "results").glob("*.json"))


def test_format_table_shows_ratios():
    rows = [Row("gemv", "q4_0 N4096 K4096 M1", "TB/s", 1.5, 48.0, {"cublas_f16": 1.0}),
            Row("gemv", "q8_0 N4096 K4096 M1", "TB/s", 2.0, 64.0, {})]
    text = format_table(rows)
    assert "== gemv" in text and "1.50" in text and "cublas_f16" in text


def test_write_results_schema(tmp_path):
    ctx = Context(read_bw_TBps=3.0, copy_bw_TBps=2.9, matmul_TFLOPs=700.0)
    rows = [Row("decode", "B1 L32768 page16 bf16", "TB/s", 2.4, 80.0, {"sdpa_cudnn": 2.5})]
    path = write_results(rows, ctx, tmp_path, ["decode"])
    doc = json.loads(path.read_text())
    for key, typ in (("gpu", str), ("torch", str), ("triton", str), ("commit", str), ("read_bandwidth_TBps", float)):
        assert isinstance(doc[key], typ)
    assert doc["rows"][0] == {"suite": "decode", "case": "B1 L32768 page16 bf16", "metric": "TB/s", "value": 2.4,
                              "roofline_pct": 80.0, "anchors": {"sdpa_cudnn": 2.5}}


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_committed_results_follow_the_schema(path):
    doc = json.loads(path.read_text())
    assert isinstance(doc["gpu"], str) and doc["gpu"].startswith("NVIDIA ")
    assert 1.0 < doc["read_bandwidth_TBps"] < 10.0
    assert doc["rows"]
    for r in doc["rows"]:
        assert r["metric"] in ("TB/s", "TFLOP/s", "tokens/s", "us/step")  # us/step: suite tp's all-reduce times
        assert isinstance(r["suite"], str) and isinstance(r["case"], str)
        assert r["value"] is None or r["value"] > 0
        assert all(v > 0 for v in r["anchors"].values())
        if r["metric"] == "TB/s" and r["value"] is not None:  # effective bandwidth can't beat the measured one by much
            assert r["value"] < 1.1 * doc["read_bandwidth_TBps"]


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from llmkernels.bench.harness import plot

    if not RESULTS:
        pytest.skip("no results committed")
    png = plot(RESULTS[-1], tmp_path / "chart.png")
    assert png.stat().st_size > 1000


def test_llama_cpp_output_parsing(tmp_path):
    """The llamacpp suite reads llama-bench's JSON and llama-batched-bench's JSONL (stand-in programs here)."""
    import os
    import stat

    from llmkernels.bench.suites.llamacpp import llama_batched_bench, llama_bench

    bench = ('[{"n_prompt": 512, "n_gen": 0, "avg_ts": 9400.5}, {"n_prompt": 4096, "n_gen": 0, "avg_ts": 10100.0},'
             ' {"n_prompt": 0, "n_gen": 128, "avg_ts": 270.25}]')
    lines = "\n".join('{"pp": 512, "tg": 128, "pl": %d, "speed_tg": %.1f, "speed_pp": 1.0}' % (b, 100.0 * b)
                      for b in (1, 16, 64))
    for name, text in (("llama-bench", "ggml_cuda_init: found 1 CUDA devices\n" + bench),
                       ("llama-batched-bench", "main: n_kv_max = 40960\n" + lines)):
        p = tmp_path / name
        p.write_text(f"#!/bin/sh\ncat <<'EOF'\n{text}\nEOF\n")
        p.chmod(p.stat().st_mode | stat.S_IEXEC)
    assert llama_bench(str(tmp_path), "m.gguf") == {"pp512": 9400.5, "pp4096": 10100.0, "tg128": 270.25}
    assert llama_batched_bench(str(tmp_path), "m.gguf") == {1: 100.0, 16: 1600.0, 64: 6400.0}
    (tmp_path / "llama-bench").write_text("#!/bin/sh\necho 'error: unable to load model' >&2\nexit 1\n")
    import pytest

    with pytest.raises(RuntimeError, match="exited 1: error: unable to load model"):
        llama_bench(str(tmp_path), "m.gguf")
    assert os.path.exists(tmp_path / "llama-batched-bench")


def test_report_from_committed_results(tmp_path):
    """bench/RESULTS.md is generated from the committed files: every GPU and suite, newest file of each."""
    import pathlib

    from llmkernels.bench.report import render, write_report

    results = pathlib.Path(__file__).resolve().parents[2] / "bench" / "results"
    text = render(results)
    assert "## NVIDIA H200" in text and "### decode" in text and "sdpa_cudnn (ratio)" in text
    out = write_report(results, tmp_path / "RESULTS.md")
    assert out.read_text() == text


def test_report_names_runs_of_uncommitted_code(tmp_path, monkeypatch):
    import llmkernels.bench.harness as H
    from llmkernels.bench.report import render

    monkeypatch.setattr(H, "tree_changed", lambda: True)
    ctx = Context(read_bw_TBps=3.0, copy_bw_TBps=2.9, matmul_TFLOPs=700.0)
    path = write_results([Row("decode", "B1 L32768 page16 bf16", "TB/s", 2.4, 80.0, {})], ctx, tmp_path, ["decode"])
    doc = json.loads(path.read_text())
    assert doc["tree_changed"] is True
    doc["gpu"] = "NVIDIA G"
    path.write_text(json.dumps(dict(doc, tree_note="the kernel of abc1234")))
    assert "with uncommitted changes (the kernel of abc1234)" in render(tmp_path)


def test_report_merges_case_limited_runs(tmp_path):
    """A run limited with -k updates only its rows: the older whole run's other rows stay, marked rows name their file;
    a later whole run replaces everything."""
    import json

    from llmkernels.bench.report import latest_tables

    def write(name, cases, **extra):
        rows = [{"suite": "tp", "case": c, "metric": "tokens/s", "value": v} for c, v in cases]
        (tmp_path / name).write_text(json.dumps({"gpu": "G", "rows": rows, **extra}))

    write("20260101-000000-g-tp.json", [("a", 1.0), ("b", 2.0)])
    write("20260102-000000-g-tp.json", [("b", 3.0), ("c", 4.0)], case_filter="b")
    name, _, rows = latest_tables(tmp_path)["G"]["tp"]
    assert name.startswith("20260101") and [(r["case"], r["value"], r.get("source")) for r in rows] == [
        ("a", 1.0, None), ("b", 3.0, "20260102-000000-g-tp.json"), ("c", 4.0, "20260102-000000-g-tp.json")]
    write("20260103-000000-g-tp.json", [("a", 5.0)])
    assert [(r["case"], r["value"]) for r in latest_tables(tmp_path)["G"]["tp"][2]] == [("a", 5.0)]


def test_report_keeps_the_last_run_with_a_peer(tmp_path):
    """A newer whole run without an anchor an older one had (llama.cpp not given) leads the section; the older run
    follows whole, labelled with the missing anchor; once a newer run has the anchor again, only it shows."""
    import json

    from llmkernels.bench.report import earlier_anchor_runs, render

    def write(name, value, anchors=None):
        row = {"suite": "families", "case": "m", "metric": "tokens/s", "value": value, "anchors": anchors or {}}
        (tmp_path / name).write_text(json.dumps({"gpu": "G", "rows": [row], "commit": name[:8]}))

    write("20260101-000000-g-families.json", 300.0, {"llama.cpp tg128": 200.0})
    write("20260102-000000-g-families.json", 310.0)
    assert earlier_anchor_runs(tmp_path)["G"]["families"][0].startswith("20260101")
    text = render(tmp_path)
    assert text.index("| m | tokens/s | 310.0") < text.index("The latest run with llama.cpp tg128 beside")
    assert "| m | tokens/s | 300.0 | - | 200.0 (1.50x) |" in text
    write("20260103-000000-g-families.json", 320.0, {"llama.cpp tg128": 210.0})
    assert earlier_anchor_runs(tmp_path) == {} and "The latest run with" not in render(tmp_path)


def test_case_filter_that_matches_nothing_is_refused(monkeypatch, capsys):
    """bench -k TEXT: an empty TEXT is a usage error; a TEXT no case name holds says so and exits 2 before anything
    is timed (the GPU and its measured ceilings are stood in for)."""
    import torch

    from llmkernels.bench import __main__ as bench, harness

    with pytest.raises(SystemExit) as e:
        bench.main(["tp", "-k", " "])
    assert e.value.code == 2 and "-k/--case needs a non-empty TEXT" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Test GPU")
    for name in ("measure_read_bandwidth", "measure_copy_bandwidth", "measure_matmul_tflops"):
        monkeypatch.setattr(harness, name, lambda: 1.0)
    assert bench.main(["tp", "-k", "no-such-case"]) == 2
    assert "no case of ['tp'] has 'no-such-case' in its name" in capsys.readouterr().err


def test_tp_sizes_env(monkeypatch):
    from llmkernels.bench.suites.tp import _sizes

    monkeypatch.setenv("LLMK_TP_SIZES", "1,4")
    assert _sizes() == [1, 4]
    monkeypatch.setenv("LLMK_TP_SIZES", "1,two")
    with pytest.raises(ValueError, match="LLMK_TP_SIZES must be a comma-separated list of integers, got '1,two'"):
        _sizes()


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gemma2-9b", "gpt-oss-20b"])
def test_family_gguf_loads(tmp_path, monkeypatch, name):
    """The families suite's synthetic GGUF, shrunk: our loader reads the family it names, in the Q4_K_M mix (q6_k
    for the more-bits layers' down projections, experts included, and for a tied embedding), and the engine runs it."""
    import torch

    from llmkernels.bench.suites import families
    from llmkernels.engine import LLM, Model, ModelConfig
    from llmkernels.quant import read_gguf

    spec = dict(families.FAMILIES[name], layers=2, hidden=256, ffn=512, vocab=300, heads=2, kv_heads=1)
    if spec["arch"] in ("qwen3moe", "gpt-oss"):
        spec["meta"] = dict(spec["meta"], expert_count=5, expert_used_count=2, expert_feed_forward_length=256)
    monkeypatch.setitem(families.FAMILIES, name, spec)
    path = str(tmp_path / "m.gguf")
    families.write_family_gguf(path, name)
    f = read_gguf(path)
    cfg = ModelConfig.from_gguf(f.metadata, f.keys())
    assert (cfg.arch, cfg.n_layers, cfg.head_dim, cfg.vocab_size) == (spec["arch"], 2, spec["head_dim"], 300)
    down = "blk.1.ffn_down_exps.weight" if cfg.n_experts else "blk.1.ffn_down.weight"
    if cfg.arch == "gpt-oss":
        assert f[down].format == "mxfp4" and f["blk.1.attn_q.weight"].format == "q8_0"
        assert cfg.attn_sinks and cfg.moe_bias and cfg.swa_layers == (True, False) and cfg.sliding_window == 128
    elif cfg.n_experts:
        assert f[down].format == "q6_k"
        assert (cfg.n_experts, cfg.n_experts_used, cfg.expert_ffn) == (5, 2, 256)
        assert f["blk.0.ffn_gate_inp.weight"].format == "f32" and f["output.weight"].format == "q6_k"
    else:
        assert f[down].format == "q6_k"
        assert cfg.attn_softcap == 50.0 and cfg.final_softcap == 30.0 and cfg.sliding_window == 4096
        assert "output.weight" not in f.keys() and f["token_embd.weight"].format == "q6_k"
    # bf16 as on the GPU: random block scales make activations that overflow fp16
    llm = LLM.from_model(Model(cfg, f, "cpu", torch.bfloat16), max_num_batched_tokens=64)
    logits = llm.logits([1, 5, 7, 11])
    assert logits.shape == (4, 300) and torch.isfinite(logits).all()


@pytest.mark.parametrize("cached", [False, True])
def test_decode_rate_runs_the_whole_batch_or_says_so(monkeypatch, cached):
    """The engine suite's decode rate is a batch's only if every sequence is still decoding once every prompt is
    done. Four prompts of 60 tokens prefilled 32 tokens per step give the first sequence its GEN tokens before the
    fourth's prompt is done: without the prefix-cache warm-up the helper must refuse; with it, all four decode
    together."""
    import torch

    from llmkernels.bench.suites import engine as suite
    from llmkernels.engine import LLM, Model, ModelConfig

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(suite, "GEN", 3)
    cfg = ModelConfig(arch="llama", n_layers=1, hidden=128, ffn=128, n_heads=2, n_kv_heads=1, head_dim=64,
                      vocab_size=50, rms_eps=1e-5, rope_theta=10000.0, rope_style="interleaved", context_length=128,
                      eos_ids=())
    llm = LLM.from_model(Model(cfg, suite.synthetic_tensors("f16", cfg, device="cpu"), "cpu", torch.float16),
                         max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    if not cached:
        with pytest.raises(RuntimeError, match="of 4 sequences were decoding"):
            suite._decode_rate(llm, 4, prompt=60)
        return
    rate, wall, steps = suite._decode_rate(llm, 4, prompt=60, cached=True)
    assert rate > 0 and steps >= 1
    assert llm.scheduler.cache_hits == 4 * 48  # each prompt's three full pages, found
