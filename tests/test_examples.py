"""Every file in examples/ runs (on CPU through the interpreter, on small sizes), and every Python snippet in the
README is part of one of them."""
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path):
    r = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]


def test_readme_snippets_are_examples():
    readme = (ROOT / "README.md").read_text()
    sources = "\n".join(p.read_text() for p in EXAMPLES)
    snippets = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert snippets, "the README has no Python snippet"
    for snip in snippets:
        for line in snip.strip().splitlines():
            assert line in sources, f"README line not in examples/: {line!r}"
