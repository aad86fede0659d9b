"""Decode tokens/s of a families-suite model at one batch size, with whichever ``llmkernels`` comes first on the path:
an A/B of two trees is this script run alternately against each (e.g. the previous commit checked out with ``git
worktree add /tmp/prev HEAD~1``, then ``PYTHONPATH=/tmp/prev``). ``LLMK_BENCH_CACHE`` keeps the synthetic GGUF
between runs.

    PYTHONPATH=. python bench/lab/family_rate.py gemma2-9b [batch]
"""
import os
import sys
import tempfile

import llmkernels
from llmkernels.bench.suites.engine import _decode_rate
from llmkernels.bench.suites.families import _load, family_gguf


def main():
    what = sys.argv[1] if len(sys.argv) > 1 else "gemma2-9b"
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    with tempfile.TemporaryDirectory() as tmp:
        llm = _load(family_gguf(tmp, what), (batch,))
        _decode_rate(llm, batch)  # warm-up (graph capture)
        rates = [_decode_rate(llm, batch)[0] for _ in range(2)]
    print(f"{os.path.dirname(llmkernels.__file__)} {what} batch {batch}: "
          + " ".join(f"{r:.1f}" for r in rates) + " tokens/s", flush=True)


if __name__ == "__main__":
    main()
