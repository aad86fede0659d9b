"""Random quantized weights of a given shape, fast at any size (benchmarks): random codes, finite small scales."""
from __future__ import annotations

import math

import torch

from ..quant.formats import GGUF_FORMATS
from ..quant.tensor import QuantizedTensor


def random_qtensor(fmt: str, N: int, K: int, device, *, bits: int = 4, group_size: int = 64,
                   scale: float = 0.01) -> QuantizedTensor:
    """A QuantizedTensor [N, K] of random block bytes whose fp16 scale fields hold N(0, scale) values (E8M0
    exponents: powers of two near scale / 4)."""
    if fmt == "mlx":
        words = torch.randint(-2**31, 2**31, (N, K * bits // 32), dtype=torch.int64, device=device)
        data = words.to(torch.int32).view(torch.uint32)
        s = (torch.randn(N, K // group_size, device=device) * scale).to(torch.float16)
        b = (torch.randn(N, K // group_size, device=device) * scale).to(torch.float16)
        return QuantizedTensor("mlx", (N, K), data, s, b, bits, group_size)
    f = GGUF_FORMATS[fmt]
    if f.family == "dense":
        dt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[fmt]
        w = (torch.randn(N, K, device=device) * scale).to(dt)
        return QuantizedTensor(fmt, (N, K), w.view(torch.uint8))
    nb = K // f.block_size
    data = torch.randint(0, 256, (N * nb, f.block_bytes), dtype=torch.uint8, device=device)
    for field in f.fields:
        if field.kind == "f16":
            vals = (torch.randn(N * nb, field.nbytes // 2, device=device) * scale).to(torch.float16)
            data[:, field.offset:field.offset + field.nbytes] = vals.view(torch.uint8)
        elif field.kind == "e8m0":  # power-of-two block scales near ``scale`` / 4 (levels reach 6)
            e = 126 + round(math.log2(scale))
            data[:, field.offset] = torch.randint(e - 2, e + 1, (N * nb,), dtype=torch.uint8, device=device)
    return QuantizedTensor(fmt, (N, K), data.reshape(N, nb * f.block_bytes))
