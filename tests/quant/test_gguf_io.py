"""GGUF files: round trips, memory mapping, and malformed input (fuzzed)."""
import os
import random

import numpy as np
import pytest
import torch

import llmkernels as lk
from llmkernels.quant import GGUFError

gguf = pytest.importorskip("gguf")


def make_file(path, formats=("q4_k", "q8_0", "f16", "q6_k", "f32", "bf16")):
    tensors = {f"blk.{i}.w_{fmt}": lk.quantize(torch.randn(8, 256), fmt) for i, fmt in enumerate(formats)}
    tensors["norm"] = lk.quantize(torch.randn(256), "f32")
    meta = {"general.architecture": "llama", "general.name": "tiny", "llama.block_count": 2,
            "llama.rope.freq_base": 10000.0, "tokenizer.ggml.tokens": ["<s>", "a", "b"], "some.flag": True}
    lk.write_gguf(path, tensors, meta)
    return tensors, meta


def test_round_trip_values_and_metadata(tmp_path):
    tensors, meta = make_file(tmp_path / "a.gguf")
    f = lk.read_gguf(tmp_path / "a.gguf")
    assert set(f) == set(tensors)
    for name, qt in tensors.items():
        got = f[name]
        assert got.format == qt.format and got.shape == qt.shape
        assert torch.equal(got.data, qt.data)
    for k, v in meta.items():
        assert f.metadata[k] == v
    assert f["norm"].shape == (256,)


def test_file_to_tensors_to_file_is_byte_identical(tmp_path):
    make_file(tmp_path / "a.gguf")
    f = lk.read_gguf(tmp_path / "a.gguf")
    lk.write_gguf(tmp_path / "b.gguf", f, f.metadata)
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()


def test_metadata_types_survive_with_plain_tensor_dicts(tmp_path):
    import numpy as np

    w = gguf.GGUFWriter(tmp_path / "u.gguf", "llama")
    w.add_uint32("llama.block_count", 2)  # an int that inference alone would write as INT32
    w.add_tensor("x", np.zeros((2, 4), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    f = lk.read_gguf(tmp_path / "u.gguf")
    lk.write_gguf(tmp_path / "v.gguf", dict(f), f.metadata)  # a plain dict of tensors, the file's metadata
    assert (tmp_path / "u.gguf").read_bytes() == (tmp_path / "v.gguf").read_bytes()


def test_tensors_are_memory_mapped(tmp_path):
    make_file(tmp_path / "a.gguf")
    f = lk.read_gguf(tmp_path / "a.gguf")
    ptr = f["blk.0.w_q4_k"].data.data_ptr()
    path = os.path.realpath(tmp_path / "a.gguf")
    maps = [line.split() for line in open("/proc/self/maps") if line.rstrip().endswith(path)]
    ranges = [tuple(int(x, 16) for x in m[0].split("-")) for m in maps]
    assert any(lo <= ptr < hi for lo, hi in ranges), "tensor data does not live in the file's mapping"


def test_unsupported_type_is_a_clear_error(tmp_path):
    w = gguf.GGUFWriter(tmp_path / "iq.gguf", "llama")
    w.add_tensor("x", np.zeros((4, 66), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(GGUFError, match="IQ2_XXS"):
        lk.read_gguf(tmp_path / "iq.gguf")
    assert len(lk.read_gguf(tmp_path / "iq.gguf", strict=False)) == 0


def test_missing_file():
    with pytest.raises(FileNotFoundError):
        lk.read_gguf("/nonexistent/model.gguf")


def _read_ok_or_clear_error(path):
    try:
        f = lk.read_gguf(path)
    except GGUFError:
        return "error"
    for qt in f.values():  # whatever was accepted must decode without crashing
        lk.dequantize(qt)
    return "ok"


def test_fuzz_truncated_files(tmp_path):
    make_file(tmp_path / "a.gguf")
    raw = (tmp_path / "a.gguf").read_bytes()
    cuts = sorted(set([0, 1, 3, 4, 8, 16, 24, 40, 100, len(raw) - 1, len(raw) - 100] +
                      random.Random(0).sample(range(len(raw)), 40)))
    outcomes = []
    for n in cuts:
        p = tmp_path / f"cut{n}.gguf"
        p.write_bytes(raw[:n])
        outcomes.append(_read_ok_or_clear_error(p))
    assert outcomes.count("error") >= len(cuts) - 2  # only cuts inside trailing padding can still parse


def test_fuzz_random_and_corrupted_bytes(tmp_path):
    make_file(tmp_path / "a.gguf")
    raw = bytearray((tmp_path / "a.gguf").read_bytes())
    rng = random.Random(1)
    p = tmp_path / "x.gguf"
    for trial in range(60):
        if trial < 10:
            data = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 4096)))
            if trial % 2:
                data = b"GGUF" + (3).to_bytes(4, "little") + data
        else:
            data = bytearray(raw)
            header_end = min(len(data), 2048)  # mostly corrupt the header, where parsing happens
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(header_end)] = rng.getrandbits(8)
        p.write_bytes(bytes(data))
        _read_ok_or_clear_error(p)


def test_write_rejects_mlx(tmp_path):
    with pytest.raises(ValueError, match="MLX"):
        lk.write_gguf(tmp_path / "m.gguf", {"w": lk.quantize(torch.randn(4, 64), "mlx", group_size=32)}, {})
