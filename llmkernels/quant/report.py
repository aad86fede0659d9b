"""``python -m llmkernels.quant.report``: bits per weight and measured error of every format (the README's table).

Relative RMS error ||w - dequantize(quantize(w))|| / ||w|| on 256 x 4096 weights, Gaussian and Student-t(3)
(heavy-tailed), seed 0; the K-quant rows also show a plain absmax quantizer with the same value bits and sub-block.
"""
from __future__ import annotations

import torch

from .formats import GGUF_FORMATS
from .kquants import absmax_baseline
from .tensor import dequantize, quantize

_BASELINE = {"q2_k": (2, 16), "q3_k": (3, 16), "q4_k": (4, 32), "q5_k": (5, 32), "q6_k": (6, 16)}


def rel_err(w, **kw) -> tuple[float, float]:
    qt = quantize(w, **kw)
    return float((w - dequantize(qt)).norm() / w.norm()), qt.bits_per_weight


def main() -> None:
    g = torch.Generator().manual_seed(0)
    gauss = torch.randn(256, 4096, generator=g)
    heavy = torch.distributions.StudentT(3.0).sample((256, 4096))
    print("| format | bits/weight | rel. RMS error, Gaussian | rel. RMS error, Student-t(3) | absmax baseline (G / t3) |")
    print("| --- | --- | --- | --- | --- |")
    for name in GGUF_FORMATS:
        eg, bpw = rel_err(gauss, format=name)
        eh, _ = rel_err(heavy, format=name)
        base = ""
        if name in _BASELINE:
            bits, grp = _BASELINE[name]
            bg = float((gauss - absmax_baseline(gauss, bits, grp)).norm() / gauss.norm())
            bh = float((heavy - absmax_baseline(heavy, bits, grp)).norm() / heavy.norm())
            base = f"{bg:.4f} / {bh:.4f}"
        print(f"| {name} | {bpw:.4g} | {eg:.4f} | {eh:.4f} | {base} |")
    for bits in (2, 3, 4, 5, 6, 8):
        for gs in (32, 64, 128):
            eg, bpw = rel_err(gauss, format="mlx", bits=bits, group_size=gs)
            eh, _ = rel_err(heavy, format="mlx", bits=bits, group_size=gs)
            print(f"| mlx {bits}-bit g{gs} | {bpw:.4g} | {eg:.4f} | {eh:.4f} | |")


if __name__ == "__main__":
    main()
