"""Tuned kernel configurations as data, keyed on what stays fixed across steps (GPU, dtype, head dim, ...).

Tables live in JSON files beside this module and are regenerated on the GPU by ``python -m llmkernels.tuning.tune
[prefill] [decode] [gemv] [gemv_i8]``. Keys never include sequence length or batch size, so a new prompt length
never re-tunes or recompiles.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

_DIR = Path(__file__).parent


@functools.lru_cache(maxsize=None)
def load_table(name: str) -> dict:
    path = _DIR / f"{name}.json"
    if not path.exists():
        return {}
    return json.loads(path.read_text())


OVERRIDES: dict = {}  # (table, key) -> entry; set by the tuning script while it times candidates


def lookup(name: str, gpu: str, key: str):
    """The tuned entry for ``key`` on this GPU, else the table's "default" GPU entry, else None."""
    if (name, key) in OVERRIDES:
        return OVERRIDES[(name, key)]
    table = load_table(name)
    for g in (gpu, "default"):
        entry = table.get(g, {}).get(key)
        if entry is not None:
            return entry
    return None
