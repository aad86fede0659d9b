"""QuantizedTensor and the public ``quantize`` / ``dequantize``."""
from __future__ import annotations

import math

import torch

from .._checks import check_tensor
from .formats import GGUF_FORMATS, MLX_BITS, MLX_GROUP_SIZES, GGUFFormat
from .gguf_codec import dequantize_blocks, quantize_blocks
from .mlx import dequantize_mlx, quantize_mlx

FORMATS = tuple(GGUF_FORMATS) + ("mlx",)


class QuantizedTensor:
    """A weight matrix in a stored format, with its logical shape [..., N, K] (K last, the reduction dim).

    GGUF formats: ``data`` is uint8 [..., N, bytes_per_row] holding each row's blocks, byte for byte as in a GGUF file.
    MLX: ``data`` is uint32 [N, K*bits/32], ``scales`` and ``biases`` are fp16/bf16 [N, K/group_size].
    """

    def __init__(self, format: str, shape, data: torch.Tensor, scales: torch.Tensor | None = None,
                 biases: torch.Tensor | None = None, bits: int | None = None, group_size: int | None = None):
        self.format = format
        self.shape = torch.Size(shape)
        self.data = data
        self.scales = scales
        self.biases = biases
        self.bits = bits
        self.group_size = group_size

    @property
    def gguf(self) -> GGUFFormat | None:
        """The GGUF format record (block size, bytes, fields), or None for MLX."""
        return GGUF_FORMATS.get(self.format)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes of stored weights (what a GEMV must read)."""
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales, self.biases) if t is not None)

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / max(1, math.prod(self.shape))

    def to(self, device) -> "QuantizedTensor":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return QuantizedTensor(self.format, self.shape, mv(self.data), mv(self.scales), mv(self.biases), self.bits,
                               self.group_size)

    def cuda(self) -> "QuantizedTensor":
        return self.to("cuda")

    def __repr__(self) -> str:
        fmt = f"mlx{self.bits} g{self.group_size}" if self.format == "mlx" else self.format
        return (f"QuantizedTensor({fmt}, shape={tuple(self.shape)}, {self.bits_per_weight:.3g} bits/weight, "
                f"{self.nbytes / 2**20:.2f} MiB, device={self.device})")

    @staticmethod
    def from_raw(data, format: str, shape) -> "QuantizedTensor":
        """Wrap existing GGUF block bytes (uint8 [..., N, bytes_per_row], tensor or numpy array) without copying."""
        if format not in GGUF_FORMATS:
            raise ValueError(f"format must be a GGUF format {tuple(GGUF_FORMATS)}, got {format!r}")
        if not isinstance(data, torch.Tensor):
            data = torch.from_numpy(data)
        if data.dtype != torch.uint8:
            data = data.view(torch.uint8)
        shape = torch.Size(shape)
        fmt = GGUF_FORMATS[format]
        if len(shape) < 1 or shape[-1] % fmt.block_size:
            raise ValueError(f"shape {tuple(shape)}: last dim K must be a multiple of {format}'s block size "
                             f"{fmt.block_size}")
        want = (*shape[:-1], fmt.bytes_per_row(shape[-1]))
        if tuple(data.shape) != want:
            if data.numel() != math.prod(want):
                raise ValueError(f"data has {data.numel()} bytes, {format} shape {tuple(shape)} needs "
                                 f"{math.prod(want)} (uint8 {want})")
            data = data.reshape(want)
        return QuantizedTensor(format, shape, data)


def quantize(w: torch.Tensor, format: str, *, bits: int = 4, group_size: int = 64,
             scale_dtype: torch.dtype | None = None) -> QuantizedTensor:
    """Quantize weights w [..., N, K] (float) into ``format``.

    GGUF formats: ``f32 f16 bf16 q4_0 q4_1 q5_0 q5_1 q8_0 q2_k q3_k q4_k q5_k q6_k``; K must be a multiple of the
    block size (32 for legacy formats, 256 for K-quants). ``"mlx"``: affine with ``bits`` in (2, 3, 4, 5, 6, 8) and
    ``group_size`` in (32, 64, 128); scales/biases in ``scale_dtype`` (default: w's dtype if fp16/bf16, else fp16).

    >>> qt = quantize(torch.randn(64, 256), "q4_k")
    >>> qt.data.shape
    torch.Size([64, 144])
    """
    check_tensor("w", w, dtypes=(torch.float32, torch.float16, torch.bfloat16, torch.float64))
    if w.dim() < 1:
        raise ValueError(f"w must have at least 1 dim, got shape {tuple(w.shape)}")
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    K = w.shape[-1]
    if format == "mlx":
        if bits not in MLX_BITS:
            raise ValueError(f"bits must be one of {MLX_BITS} for mlx, got {bits}")
        if group_size not in MLX_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {MLX_GROUP_SIZES} for mlx, got {group_size}")
        if w.dim() != 2:
            raise ValueError(f"w must be 2-D [N, K] for mlx, got shape {tuple(w.shape)}")
        if K % group_size:
            raise ValueError(f"w's last dim K={K} must be a multiple of group_size={group_size}")
        sd = scale_dtype or (w.dtype if w.dtype in (torch.float16, torch.bfloat16) else torch.float16)
        if sd not in (torch.float16, torch.bfloat16):
            raise TypeError(f"scale_dtype must be float16 or bfloat16, got {sd}")
        data, scales, biases = quantize_mlx(w, bits, group_size, sd)
        return QuantizedTensor("mlx", w.shape, data, scales, biases, bits, group_size)
    fmt = GGUF_FORMATS[format]
    if K % fmt.block_size:
        raise ValueError(f"w's last dim K={K} must be a multiple of {format}'s block size {fmt.block_size}")
    if fmt.family != "dense" and not bool(torch.isfinite(w).all()):
        raise ValueError(f"w contains NaN or inf; {format} cannot represent them")
    blocks = w.float().reshape(-1, fmt.block_size)
    data = quantize_blocks(blocks, format).reshape(*w.shape[:-1], fmt.bytes_per_row(K))
    return QuantizedTensor(format, w.shape, data)


def dequantize(qt: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """QuantizedTensor -> dense [..., N, K] in ``dtype`` (computed in float32 on qt's device)."""
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"qt must be a QuantizedTensor, got {type(qt).__name__}")
    if qt.format == "mlx":
        out = dequantize_mlx(qt.data, qt.scales, qt.biases, qt.bits, qt.group_size, qt.shape[-1])
    else:
        fmt = GGUF_FORMATS[qt.format]
        if qt.data.shape[-1] != fmt.bytes_per_row(qt.shape[-1]):
            raise ValueError(f"qt's rows are {qt.data.shape[-1]} bytes apart, {qt.format} rows of K={qt.shape[-1]} "
                             f"are {fmt.bytes_per_row(qt.shape[-1])} (a pad_rows copy is for the kernels only)")
        blocks = qt.data.reshape(-1, fmt.block_bytes)
        out = dequantize_blocks(blocks, qt.format)
    return out.reshape(qt.shape).to(dtype)


def pad_k(qt: QuantizedTensor, K: int) -> QuantizedTensor:
    """A GGUF-format [N, k] matrix as [N, K] (K >= k, a whole number of blocks more): each row's blocks followed by
    all-zero blocks, which decode to zero weights in every GGUF format (their scales are zero), so x @ W^T is
    unchanged for any x whose extra columns are finite."""
    f = qt.gguf
    if f is None or len(qt.shape) != 2:
        raise ValueError(f"pad_k takes a 2-D GGUF-format matrix, got {qt.format} {tuple(qt.shape)}")
    N, k = qt.shape
    if K < k or (K - k) % f.block_size:
        raise ValueError(f"K must be >= {k} and add whole blocks of {f.block_size}, got {K}")
    data = torch.zeros(N, f.bytes_per_row(K), dtype=torch.uint8, device=qt.data.device)
    data[:, :qt.data.shape[-1]] = qt.data.reshape(N, -1).view(torch.uint8)
    return QuantizedTensor(qt.format, (N, K), data)


def pad_rows(qt: QuantizedTensor, multiple: int = 16) -> QuantizedTensor:
    """A GGUF-format matrix (or stack [E, N, K]) whose rows start ``multiple`` bytes apart or a multiple of it: each
    row's blocks followed by zero bytes. The same QuantizedTensor when they already do. The kernels that take a
    row's bytes from ``data.shape[-1]`` (the MoE and tensor-core GEMVs) read it; ``dequantize`` refuses it. For
    q6_k (210-byte blocks), whose rows are 16-byte aligned only when K is a multiple of 2048."""
    f = qt.gguf
    if f is None:
        raise ValueError(f"pad_rows takes a GGUF-format matrix, got {qt.format}")
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise ValueError(f"multiple must be a positive int (bytes), got {multiple!r}")
    row = f.bytes_per_row(qt.shape[-1])
    if qt.data.shape[-1] != row:
        raise ValueError(f"qt's rows are already {qt.data.shape[-1]} bytes apart (padded)")
    stride = -(-row // multiple) * multiple
    if stride == row:
        return qt
    data = torch.zeros(*qt.data.shape[:-1], stride, dtype=torch.uint8, device=qt.data.device)
    data[..., :row] = qt.data.view(torch.uint8)
    return QuantizedTensor(qt.format, qt.shape, data)


def cat_rows(qts: list) -> QuantizedTensor | None:
    """Stack QuantizedTensors [N_i, K] of one format into [sum N_i, K] (rows are independent in every format)."""
    a = qts[0]
    if any((q.format, q.bits, q.group_size, q.shape[1:]) != (a.format, a.bits, a.group_size, a.shape[1:])
           for q in qts):
        return None
    cat = lambda ts: None if ts[0] is None else torch.cat(ts, 0)  # noqa: E731
    n = sum(q.shape[0] for q in qts)
    return QuantizedTensor(a.format, (n, *a.shape[1:]), cat([q.data for q in qts]), cat([q.scales for q in qts]),
                           cat([q.biases for q in qts]), a.bits, a.group_size)
