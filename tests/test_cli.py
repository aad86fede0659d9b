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


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "llmkernels", *args], capture_output=True, text=True)


@pytest.mark.parametrize("args,words", [
    (["generate", "/no/such/model.gguf", "--prompt", "hi"], "is not a file"),
    (["generate", __file__, "--prompt", "hi"], "GGUF"),
    (["convert", "/no/such/dir", "/tmp/out.gguf"], "is not a folder"),
    (["convert", "/", "/tmp/out.gguf"], "config.json"),
])
def test_cli_errors_are_one_line(args, words):
    r = _cli(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    r = _cli("--debug", *args)  # the traceback on request
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_cli_device_cuda_without_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    r = _cli("generate", __file__, "--prompt", "hi", "--device", "cuda")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no CUDA GPU" in r.stderr


def test_cli_bad_choice_and_help():
    r = _cli("convert", "a", "b", "--format", "q9_9")
    assert r.returncode == 2 and "invalid choice" in r.stderr
    for cmd in (["generate", "m.gguf", "--prompt", "hi"], ["serve", "m.gguf"]):
        r = _cli(*cmd, "--megakernel", "yes")
        assert r.returncode == 2 and "--megakernel: invalid choice: 'yes'" in r.stderr
    r = _cli("generate", "--help")
    assert r.returncode == 0 and "default: 64" in r.stdout and "--max-model-len" in r.stdout


def test_info_and_tune_without_gpu():
    import torch

    r = _cli("info")
    assert r.returncode == 0 and "torch" in r.stdout and "triton" in r.stdout and "kernel paths" in r.stdout
    if not torch.cuda.is_available():
        assert "interpreter" in r.stdout
        r = _cli("tune", "prefill")
        assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr
    r = _cli("tune", "nosuchsuite")
    assert r.returncode == 2 and "nosuchsuite" in r.stderr


def test_info_prints_a_gemv_route():
    """``info --route`` prints the kernel the routing table picks for a product; a bad format is one line, exit 2."""
    r = _cli("info", "--route", "q4_k", "1", "14336", "4096")
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip().splitlines()[-1]
    assert line.startswith("route of gemv q4_k M=1 N=14336 K=4096 fp16") and ": lanes (" in line
    assert "x copied into lane order" in line
    r = _cli("info", "--route", "q8_0", "8", "4096", "4096", "--op", "silu_mul", "--dtype", "bf16")
    assert r.returncode == 0 and ": tc (" in r.stdout.strip().splitlines()[-1]
    r = _cli("info", "--route", "q9", "1", "2", "3")
    assert r.returncode == 2 and "GGUF format" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = _cli("info", "--route", "q4_k", "one", "2", "3")
    assert r.returncode == 2 and "integer M, N, K" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_memcheck_refuses_an_unknown_part():
    """tools/memcheck.py takes nothing or one of its parts; anything else is one line on stderr and a non-zero
    exit."""
    from pathlib import Path

    tool = Path(__file__).parents[1] / "tools" / "memcheck.py"
    r = subprocess.run([sys.executable, str(tool), "everything"], capture_output=True, text=True, timeout=300)
    usage = ("usage: python tools/memcheck.py [tp | moe | prefill_ws | prefill_persist | prefill_rowsum | "
             "decode_ws | engine | megakernel | gemv | codebook], got 'everything'")
    assert r.returncode != 0 and usage in r.stderr
