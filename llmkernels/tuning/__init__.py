"""Tuned kernel configurations as data, keyed on what stays fixed across steps (GPU, dtype, head dim, ...).

Each table (``prefill``, ``paged``, ``gemv``) is a JSON file beside this module holding sections of entries:

- one per exact GPU name (``torch.cuda.get_device_name()``, e.g. "NVIDIA H100 80GB HBM3"), tuned on that GPU;
- one per architecture family, named from the compute capability ("sm90" for every Hopper part: H100 PCIe/SXM/NVL,
  H200, H800, H20, GH200), tuned on one member of the family;
- "default", with a portable entry for every key (configs that fit the shared memory of Ampere and Ada).

A lookup takes the first section that has the key, in this order: the user's own tuned entries for this exact GPU
(``python -m llmkernels tune`` writes them to :func:`user_dir`), the shipped exact-GPU section, the family section,
"default". Keys never include sequence length or batch size, so a new prompt length never re-tunes or recompiles.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

_DIR = Path(__file__).parent
TABLES = ("prefill", "paged", "gemv")
DEFAULT = "default"


def user_dir() -> Path:
    """Where ``python -m llmkernels tune`` writes this machine's entries: ``$LLMKERNELS_TUNING_DIR``, else
    ``$XDG_CACHE_HOME/llmkernels/tuning``, else ``~/.cache/llmkernels/tuning``. Never inside the installed package."""
    env = os.environ.get("LLMKERNELS_TUNING_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llmkernels" / "tuning"


def _read(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:  # a broken user file must not stop the library: its entries are ignored
        import warnings

        warnings.warn(f"llmkernels: ignoring tuning file {path}: {e}", stacklevel=3)
        return {}
    return doc if isinstance(doc, dict) else {}


@functools.lru_cache(maxsize=None)
def load_table(name: str) -> dict:
    """The shipped table ``name`` ({section: {key: entry}})."""
    return _read(_DIR / f"{name}.json")


@functools.lru_cache(maxsize=None)
def load_user_table(name: str) -> dict:
    """This machine's tuned table ``name`` from :func:`user_dir` (empty when there is none)."""
    return _read(user_dir() / f"{name}.json")


def clear_cache() -> None:
    """Forget loaded tables (after a tuning run wrote new ones)."""
    load_table.cache_clear()
    load_user_table.cache_clear()


INTERPRETER = "cpu-interpreter"  # _runtime.gpu_name() when there is no CUDA device
OVERRIDES: dict = {}  # (table, key) -> entry; set by the tuning script while it times candidates


def family_of(capability) -> str | None:
    """The architecture family section for a compute capability: (9, 0) -> "sm90"; None for no GPU."""
    if capability is None:
        return None
    major, minor = capability
    return f"sm{major}{minor}"


@functools.lru_cache(maxsize=None)
def _family_of_gpu(gpu: str) -> str | None:
    import torch

    if not torch.cuda.is_available():
        return None
    for i in range(torch.cuda.device_count()):
        if torch.cuda.get_device_name(i) == gpu:
            return family_of(torch.cuda.get_device_capability(i))
    return None


def sections(gpu: str, family: str | None = None) -> list[tuple[str, str, str]]:
    """The (where, table source, section) search order for a GPU: user file, exact name, family, default."""
    family = family if family is not None else _family_of_gpu(gpu)
    order = [("user", gpu), ("shipped", gpu)]
    if family:
        order.append(("shipped", family))
    order.append(("shipped", DEFAULT))
    return [(f"{src}:{sec}", src, sec) for src, sec in order]


def resolve(name: str, gpu: str, key: str, family: str | None = None):
    """-> (entry, where) for ``key`` of table ``name`` on ``gpu``; where is e.g. "shipped:sm90" (None if missing)."""
    if (name, key) in OVERRIDES:
        return OVERRIDES[(name, key)], "override"
    if gpu == INTERPRETER:  # kernels under the interpreter keep their small code defaults
        return None, None
    for where, src, sec in sections(gpu, family):
        table = load_user_table(name) if src == "user" else load_table(name)
        entry = table.get(sec, {}).get(key)
        if entry is not None:
            return entry, where
    return None, None


def lookup(name: str, gpu: str, key: str):
    """The entry for ``key`` on this GPU (see the module docstring for the search order), else None."""
    return resolve(name, gpu, key)[0]


def describe(gpu: str, family: str | None = None) -> list[str]:
    """Lines for ``llmkernels info``: per table, which section serves how many of its keys on this GPU, and why."""
    lines = []
    for name in TABLES:
        keys = set()
        for table in (load_table(name), load_user_table(name)):
            for sec in table.values():
                if isinstance(sec, dict):
                    keys.update(k for k in sec if not k.startswith("_"))
        counts: dict = {}
        for key in keys:
            where = resolve(name, gpu, key, family)[1] or "code default"
            counts[where] = counts.get(where, 0) + 1
        shipped = load_table(name)
        parts = []
        for where, n in sorted(counts.items(), key=lambda kv: -kv[1]):
            src, _, sec = where.partition(":")
            if src == "user":
                why = "tuned on this machine"
            elif src == "shipped":
                kind = "exact GPU" if sec == gpu else ("portable default" if sec == DEFAULT else "architecture family")
                about = shipped.get(sec, {}).get("_about")
                why = kind + (f", {about}" if about else "")
            else:
                why = "no table entry"
            parts.append(f"{n} from {where} ({why})")
        lines.append(f"  {name}: {len(keys)} keys: " + ", ".join(parts))
    return lines
