"""One tolerance table per dtype, in one place, and the comparison every test uses."""
from __future__ import annotations

import torch

# (atol, rtol) for outputs of that dtype compared with a float64/float32 reference of O(1) magnitude.
# fp8 rows cover attention over an fp8 KV cache (inputs quantized to 3 mantissa bits, e4m3, or 2, e5m2).
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-4, 2e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    torch.float8_e4m3fn: (1e-1, 1e-1),
    torch.float8_e5m2: (2e-1, 2e-1),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    return TOLERANCES[dtype]


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN (or the dtype's max for integers) so unwritten elements show."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.fill_(torch.iinfo(t.dtype).max)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None, name: str = "output",
                 atol: float | None = None, rtol: float | None = None) -> None:
    """out ~= ref elementwise at the tolerance of ``dtype`` (default: out's dtype); NaN/inf where ref is finite fails."""
    dtype = dtype or out.dtype
    a, r = TOLERANCES[dtype]
    atol = a if atol is None else atol
    rtol = r if rtol is None else rtol
    if out.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    o = out.detach().to(torch.float64).cpu()
    e = ref.detach().to(torch.float64).cpu()
    both_inf = torch.isinf(o) & torch.isinf(e) & (torch.sign(o) == torch.sign(e))
    bad_nan = ~torch.isfinite(o) & ~both_inf
    if bad_nan.any():
        idx = bad_nan.nonzero()[0].tolist()
        raise AssertionError(f"{name}: {int(bad_nan.sum())} non-finite elements (unwritten?) e.g. at {idx}: "
                             f"got {o[tuple(idx)].item()}, reference {e[tuple(idx)].item()}")
    diff = torch.where(both_inf, torch.zeros_like(o), (o - e).abs())
    allowed = atol + rtol * torch.where(both_inf, torch.zeros_like(e), e.abs())
    bad = diff > allowed
    if bad.any():
        idx = (diff - allowed).argmax()
        pos = list(torch.unravel_index(idx, o.shape)) if o.dim() else []
        pos = [int(p) for p in pos]
        raise AssertionError(f"{name}: {int(bad.sum())}/{o.numel()} elements off (atol={atol}, rtol={rtol}); "
                             f"worst at {pos}: got {o[tuple(pos)].item():.6g}, reference {e[tuple(pos)].item():.6g}, "
                             f"max abs diff {diff.max().item():.3g}")
