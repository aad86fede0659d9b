"""The tuned tables: exact GPU, then the user's folder first, then the architecture family, then defaults."""
import json

import pytest

from llmkernels import tuning

H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMKERNELS_TUNING_DIR", str(tmp_path))
    tuning.clear_cache()
    yield tmp_path
    tuning.clear_cache()


def test_every_table_has_a_default_for_every_key():
    for name in tuning.TABLES:
        table = tuning.load_table(name)
        assert "default" in table and "sm90" in table, name
        keys = {k for sec in table.values() for k in sec if not k.startswith("_")}
        missing = keys - set(table["default"])
        assert not missing, f"{name}: keys without a default entry: {sorted(missing)}"


def test_search_order(user_folder):
    key = "bfloat16/128/causal/ws"
    # an exact entry wins over the family; a GPU of the family without one gets the family's entry
    assert tuning.resolve("prefill", H100, key, "sm90")[1] == f"shipped:{H100}"
    assert tuning.resolve("prefill", H200, key, "sm90")[1] == "shipped:sm90"
    assert tuning.resolve("prefill", "NVIDIA H100 PCIe", key, "sm90")[1] == "shipped:sm90"
    # Ampere/Ada: the portable default, which keeps the Triton kernel ([0, 0]: no Gluon)
    entry, where = tuning.resolve("prefill", "NVIDIA A100-SXM4-80GB", key, "sm80")
    assert where == "shipped:default" and entry == [0, 0]
    entry, where = tuning.resolve("prefill", "NVIDIA GeForce RTX 4090", "bfloat16/128/full", "sm89")
    assert where == "shipped:default" and len(entry) >= 4
    # the interpreter never reads the tables (its small code defaults apply)
    assert tuning.resolve("prefill", tuning.INTERPRETER, key) == (None, None)
    # the user's own entries come first
    (user_folder / "prefill.json").write_text(json.dumps({H200: {key: [64, 3]}}))
    tuning.clear_cache()
    assert tuning.resolve("prefill", H200, key, "sm90") == ([64, 3], f"user:{H200}")
    assert tuning.resolve("prefill", H100, key, "sm90")[1] == f"shipped:{H100}"  # other GPUs unaffected


def test_broken_user_file_is_ignored_with_a_warning(user_folder):
    (user_folder / "gemv.json").write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring tuning file"):
        entry, where = tuning.resolve("gemv", H200, "tc/q4_k", "sm90")
    assert where == "shipped:sm90" and entry


def test_describe_names_the_sections(user_folder):
    lines = tuning.describe(H200, "sm90")
    assert len(lines) == 3 and all("shipped:sm90" in ln for ln in lines)
    assert any("tuned on NVIDIA H200" in ln for ln in lines)
    lines = tuning.describe("NVIDIA L4", "sm89")
    assert all("shipped:default" in ln and "portable default" in ln for ln in lines)


def test_user_dir_is_outside_the_package(monkeypatch, tmp_path):
    monkeypatch.delenv("LLMKERNELS_TUNING_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tuning.user_dir() == tmp_path / "llmkernels" / "tuning"


def test_supported_triton_range():
    from llmkernels.supported import check_triton_version

    assert check_triton_version("3.6.0") is None and check_triton_version("3.9.0") is None
    for bad in ("3.5.1", "3.10.0", "4.0.0"):
        msg = check_triton_version(bad)
        assert msg and bad in msg and ">=3.6,<3.10" in msg


def test_gluon_kernels_only_on_their_triton_api():
    from llmkernels.supported import gluon_supported

    assert not gluon_supported("3.9.0") and not gluon_supported("3.5.0")


def test_tuner_never_picks_a_candidate_that_computes_wrong_results(monkeypatch):
    """_best runs the check under each candidate before timing it: the fastest candidate, if wrong, is skipped;
    when every candidate is wrong the tuner raises instead of writing an entry."""
    from llmkernels.bench import harness
    from llmkernels.tuning import OVERRIDES, tune

    times = {(1,): 3.0, (2,): 1.0, (3,): 2.0}  # (2,) is the fastest, and wrong
    monkeypatch.setattr(harness, "time_ms", lambda fn, **kw: times[tuple(OVERRIDES[("gemv", "k")])])

    def check():
        assert OVERRIDES[("gemv", "k")] != [2], "wrong"

    assert tune._best("gemv", "k", list(times), [lambda: None], check=check) == [3]
    assert ("gemv", "k") not in OVERRIDES
    assert tune._best("gemv", "k", list(times), [lambda: None]) == [2]  # without a check the fastest wins

    def never():
        raise AssertionError("always wrong")

    with pytest.raises(RuntimeError, match="no candidate both ran and gave right results"):
        tune._best("gemv", "k", list(times), [lambda: None], check=never)


def test_gemv_check_compares_with_float64(device):
    """The tuners' GEMV check passes a right product and fails a wrong one (here: one output element off)."""
    import torch

    import llmkernels as lk
    from llmkernels.tuning import tune

    qt = lk.quantize(torch.randn(24, 256, device=device) * 0.05, "q8_0")
    xs, qts = [torch.randn(1, 256, device=device, dtype=torch.float16)], [[qt]]
    tune._gemv_check(xs, qts)()

    def off_by_one(x, qt):
        y = lk.gemv(x, qt)
        y[0, 3] += 1.0
        return y

    with pytest.raises(AssertionError, match="workload 0"):
        tune._gemv_check(xs, qts, off_by_one)()
