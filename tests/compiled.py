"""Code that compiles kernels for sm_90 on a machine without a GPU, run in a subprocess without the interpreter
(llmkernels turns TRITON_INTERPRET on where there is no GPU, and an interpreted kernel cannot be compiled)."""
import os
import subprocess
import sys
from pathlib import Path


def run_compiled(code: str, timeout: int = 600) -> str:
    """Run ``code`` with TRITON_INTERPRET=0 and the repository on the path -> its stdout, stripped; asserts it
    exits 0 (with its stderr's tail as the message)."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.strip()
