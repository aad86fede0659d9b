import os

import pytest


@pytest.fixture(scope="session")
def model_files(tmp_path_factory):
    """make(arch, fmt, **kw) -> (checkpoint dir, gguf path, transformers model); built once per session."""
    pytest.importorskip("transformers")
    from llmkernels.engine import convert_hf_to_gguf
    from llmkernels.testing.tiny_models import make_checkpoint

    root = tmp_path_factory.mktemp("models")
    cache = {}

    def make(arch="llama", fmt="f32", **kw):
        key = (arch, tuple(sorted(kw.items())))
        if key not in cache:
            d = root / f"{arch}-{len(cache)}"
            cache[key] = (str(d), make_checkpoint(str(d), arch, **kw), {})
        d, hf, ggufs = cache[key]
        if fmt not in ggufs:
            ggufs[fmt] = convert_hf_to_gguf(d, os.path.join(d, f"model-{fmt}.gguf"), fmt, progress=False)
        return d, ggufs[fmt], hf

    return make
