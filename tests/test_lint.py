"""Names that do not exist fail only when their line runs, and some lines run only on a GPU (CUDA graphs, Gluon
kernels): pyflakes finds them in every file of the package without running it."""
import pathlib

import pytest

pyflakes_api = pytest.importorskip("pyflakes.api")
from pyflakes import messages, reporter  # noqa: E402

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "llmkernels"
FATAL = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)


class _Collect(reporter.Reporter):
    def __init__(self):
        self.found = []

    def flake(self, msg):
        if isinstance(msg, FATAL):
            self.found.append(str(msg))

    def syntaxError(self, filename, msg, lineno, offset, text):
        self.found.append(f"{filename}:{lineno}: {msg}")

    def unexpectedError(self, filename, msg):
        self.found.append(f"{filename}: {msg}")


def test_no_undefined_names():
    rep = _Collect()
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20
    for f in files:
        pyflakes_api.checkPath(str(f), rep)
    assert not rep.found, "\n".join(rep.found)
