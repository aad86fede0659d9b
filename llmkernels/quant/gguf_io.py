"""GGUF files through the ``gguf`` package: memory-mapped reading into QuantizedTensors, and writing.

A malformed or truncated file raises ``GGUFError`` (a ValueError) naming the file and what is wrong; it never
crashes the process or returns garbage tensors.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from .formats import GGML_TYPE_TO_FORMAT, GGUF_FORMATS
from .tensor import QuantizedTensor


class GGUFError(ValueError):
    """A GGUF file that cannot be read: not GGUF, truncated, inconsistent, or of an unsupported tensor type."""


class GGUFMetadata(dict):
    """Metadata key -> Python value; ``.types`` keeps each key's GGUF value type so a rewrite is byte-identical."""

    def __init__(self, *args, types=None, **kw):
        super().__init__(*args, **kw)
        self.types = dict(types or {})


class GGUFFile(dict):
    """Tensor name -> QuantizedTensor (memory-mapped on the CPU), with ``.metadata`` and ``.path``."""

    def __init__(self, path, tensors, metadata):
        super().__init__(tensors)
        self.path = path
        self.metadata = metadata


def _field_value(field):
    from gguf import GGUFValueType

    main = field.types[0]
    if main == GGUFValueType.ARRAY:
        return list(field.contents())
    return field.contents()


def read_gguf(path, *, strict: bool = True) -> GGUFFile:
    """Read a GGUF file: {name: QuantizedTensor} with ``.metadata``.

    Tensors are memory-mapped (copy-on-write), not read into memory; shapes are logical [..., N, K] (GGUF stores
    dims reversed). ``strict=False`` skips tensors of types llmkernels has no format for instead of raising.
    """
    try:
        import gguf
    except ImportError as e:  # pragma: no cover
        raise ImportError("read_gguf needs the gguf package: pip install gguf") from e
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such GGUF file: {path}")
    size = os.path.getsize(path)
    try:
        reader = gguf.GGUFReader(path, "c")
    except Exception as e:  # the gguf parser raises many kinds on bad bytes: report them as one
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    try:
        meta, types = {}, {}
        for name, field in reader.fields.items():
            if name.startswith("GGUF."):
                continue
            meta[name] = _field_value(field)
            types[name] = (field.types[0], field.types[-1] if len(field.types) > 1 else None)
        tensors = {}
        for t in reader.tensors:
            fmt = GGML_TYPE_TO_FORMAT.get(int(t.tensor_type))
            if fmt is None:
                if strict:
                    raise GGUFError(f"{path}: tensor {t.name!r} has GGML type {t.tensor_type.name}, which llmkernels "
                                    f"does not support (supported: {', '.join(GGUF_FORMATS)})")
                continue
            if t.data_offset + t.n_bytes > size:
                raise GGUFError(f"{path}: tensor {t.name!r} needs bytes {t.data_offset}..{t.data_offset + t.n_bytes} "
                                f"but the file has {size}: truncated")
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            data = np.asarray(t.data).view(np.uint8)
            tensors[t.name] = QuantizedTensor.from_raw(torch.from_numpy(data), fmt, shape)
    except GGUFError:
        raise
    except Exception as e:
        raise GGUFError(f"{path}: malformed GGUF contents ({type(e).__name__}: {e})") from None
    return GGUFFile(path, tensors, GGUFMetadata(meta, types=types))


def _value_type(v):
    from gguf import GGUFValueType

    if isinstance(v, (list, tuple)):
        if not v:
            raise ValueError("empty arrays cannot be written to GGUF metadata")
        return GGUFValueType.ARRAY, _value_type(v[0])[0]
    if isinstance(v, (bool, np.bool_)):
        return GGUFValueType.BOOL, None
    if isinstance(v, (int, np.integer)):
        return (GGUFValueType.INT32 if -2**31 <= int(v) < 2**31 else GGUFValueType.INT64), None
    if isinstance(v, (float, np.floating)):
        return GGUFValueType.FLOAT32, None
    if isinstance(v, str):
        return GGUFValueType.STRING, None
    raise TypeError(f"cannot store metadata value of type {type(v).__name__} in GGUF")


def write_gguf(path, tensors: dict, metadata: dict | None = None) -> None:
    """Write {name: QuantizedTensor or float/int torch.Tensor} and metadata to a GGUF file.

    Metadata values are Python scalars, strings or lists; types come from ``metadata.types`` when it is a
    ``GGUFMetadata`` (as ``read_gguf`` returns), else from the values (int -> INT32/INT64, float -> FLOAT32).
    """
    import gguf

    # GGUF value types: from the metadata if read_gguf made it, else from the file the tensors came from, else inferred
    types = getattr(metadata, "types", None)
    if types is None and isinstance(tensors, GGUFFile):
        types = tensors.metadata.types
    types = types or {}
    metadata = dict(metadata or {})
    arch = metadata.get("general.architecture", "llama")
    writer = gguf.GGUFWriter(os.fspath(path), arch)
    if "general.alignment" in metadata:
        writer.data_alignment = int(metadata["general.alignment"])
    for key, value in metadata.items():
        if key == "general.architecture" or key.startswith("GGUF."):
            continue
        vtype, sub = types.get(key) or _value_type(value)
        writer.add_key_value(key, value, vtype, sub_type=sub)
    for name, t in tensors.items():
        if isinstance(t, QuantizedTensor):
            if t.format == "mlx":
                raise ValueError(f"tensor {name!r} is MLX affine, which has no GGUF type")
            arr = t.data.detach().cpu().contiguous().numpy()
            writer.add_tensor(name, arr, raw_dtype=gguf.GGMLQuantizationType(t.gguf.ggml_type))
        elif isinstance(t, torch.Tensor):
            if t.dtype == torch.bfloat16:
                arr = t.detach().cpu().contiguous().view(torch.uint8).numpy()
                writer.add_tensor(name, arr, raw_dtype=gguf.GGMLQuantizationType.BF16)
            else:
                writer.add_tensor(name, t.detach().cpu().contiguous().numpy())
        else:
            raise TypeError(f"tensor {name!r} must be a QuantizedTensor or torch.Tensor, got {type(t).__name__}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
