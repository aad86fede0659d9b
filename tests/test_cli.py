"""The README's main job (``python -m llmkernels demo``) and the small CLI commands."""
import subprocess
import sys

import pytest


def test_demo_runs_and_every_kernel_matches(capsys):
    from llmkernels.demo import main

    assert main() == 0
    out = capsys.readouterr().out
    assert "MISMATCH" not in out and "flash_attn_varlen" in out and "paged_attention" in out and "gemv" in out


def test_demo_timed_branch_runs_small(capsys):
    # the branch a GPU takes (timings against SDPA / cuBLAS), here on small sizes with a stand-in timer
    from llmkernels.demo import CPU_SIZES, main

    calls = []

    def timer(fn):
        fn()
        calls.append(1)
        return 1.0

    assert main(timed=True, sizes=CPU_SIZES, timer=timer) == 0
    out = capsys.readouterr().out
    assert "MISMATCH" not in out and "us vs" in out and len(calls) == 14


def test_formats_command():
    out = subprocess.run([sys.executable, "-m", "llmkernels", "formats"], capture_output=True, text=True, check=True)
    assert "q4_k" in out.stdout and "4.5" in out.stdout


def test_bench_without_gpu_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    r = subprocess.run([sys.executable, "-m", "llmkernels.bench", "decode"], capture_output=True, text=True)
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr
