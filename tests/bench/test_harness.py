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
    assert isinstance(doc["gpu"], str) and "H100" in doc["gpu"]
    assert 1.0 < doc["read_bandwidth_TBps"] < 10.0
    assert doc["rows"]
    for r in doc["rows"]:
        assert r["metric"] in ("TB/s", "TFLOP/s", "tokens/s")
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
