"""Helpers for the Gluon kernels' tests (attention/prefill_ws.py, attention/paged_ws.py)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def sm90_compile_text(call: str, key: str = "ttgir") -> str:
    """Run ``k = <call>`` in a subprocess without the interpreter (under TRITON_INTERPRET=1 Gluon functions are
    interpreted and cannot be compiled; llmkernels would turn it on where there is no GPU) -> the text of
    ``k.asm[key]`` ("ptx", or "ttgir": the IR after Triton's optimization passes; "cubin": the cubin's bytes in hex)."""
    from llmkernels.supported import GLUON_RANGE, gluon_supported

    if not gluon_supported():
        pytest.skip(f"the Gluon kernels are written against Triton {GLUON_RANGE[0]}'s Gluon API (this Triton runs "
                    "the portable kernels instead)")
    out = "k.asm['cubin'].hex()" if key == "cubin" else f"k.asm[{key!r}]"
    code = (f"import sys, triton; from llmkernels.attention import prefill_ws, paged_ws; k = {call}; "
            f"sys.stdout.write({out})")
    env = dict(os.environ, TRITON_INTERPRET="0")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def sm90_compile_report(call: str, checks: dict) -> dict:
    """``k = <call>`` compiled as in sm90_compile_text -> for each name in ``checks``, whether its PTX substring is
    in the compiled kernel."""
    ptx = sm90_compile_text(call, "ptx")
    return {name: sub in ptx for name, sub in checks.items()}


def sm90_sass(call: str) -> str:
    """``k = <call>`` compiled as in sm90_compile_text -> its SASS (the nvdisasm Triton ships; skips without it)."""
    import tempfile

    import triton.backends.nvidia as nv

    tool = Path(nv.__file__).parent / "bin" / "nvdisasm"
    if not tool.exists():
        pytest.skip(f"no nvdisasm at {tool}")
    cubin = bytes.fromhex(sm90_compile_text(call, "cubin"))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(cubin)
        res = subprocess.run([str(tool), "-c", str(path)], capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def sm90_spill_bytes(call: str) -> int:
    """``k = <call>`` compiled as in sm90_compile_text, its PTX assembled again by Triton's ptxas with -v -> the
    bytes of spill stores (register spills happen in ptxas, after the PTX; 0 is what the kernels are written for)."""
    import re
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    ptx = sm90_compile_text(call, "ptx")
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(src), "-o", str(Path(d) / "k.cubin")],
                             capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    found = re.findall(r"(\d+) bytes spill stores", res.stdout + res.stderr)
    assert found, res.stdout + res.stderr
    return sum(int(n) for n in found)


def need_sm90():
    from llmkernels.supported import gluon_supported

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are sm_90 code")
    if not gluon_supported():
        pytest.skip("this Triton's Gluon API is not the one the kernels are written against")


def spy(monkeypatch, module, name):
    """Count the calls of ``module.name`` (the Gluon launch functions)."""
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls
