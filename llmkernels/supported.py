"""The Triton and torch versions llmkernels is tested on, and what happens outside them.

Compiled kernels are tested on the GPU with the versions of ``TESTED_GPU``; the interpreter (CPU) tests run in CI on
``TESTED_CPU``. A Triton outside ``TRITON_RANGE`` is refused at import with a message naming the range, instead of
failing later inside a kernel (``LLMKERNELS_ANY_TRITON=1`` skips the check, for trying a new release). A Triton
without Gluon's Hopper API keeps the portable Triton kernels (``info`` says so).
"""
from __future__ import annotations

# [lowest, first excluded): versions whose interpreter and compiler the test suite passes on
TRITON_RANGE = ((3, 6), (3, 10))
# versions whose Gluon API the warp-specialized sm_90 kernels (prefill_ws, paged_ws) are written against; other
# versions run the portable Triton kernels there (Triton 3.9 changed gl.warp_specialize's signature)
GLUON_RANGE = ((3, 6), (3, 7))
TESTED_GPU = {"torch": "2.11", "triton": "3.6"}
TESTED_CPU = {"torch": "2.13", "triton": ("3.6", "3.9")}


def _parse(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def triton_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("triton")
    except Exception:  # noqa: BLE001
        return None


def check_triton_version(version: str | None = None) -> str | None:
    """None when ``version`` (default: the installed Triton) is in the supported range, else the reason why not."""
    version = version or triton_version()
    if version is None:
        return "Triton is not installed (pip install 'triton>=3.6,<3.10')"
    v = _parse(version)[:2]
    lo, hi = TRITON_RANGE
    if not lo <= v < hi:
        return (f"Triton {version} is outside the supported range >={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]} "
                f"(pip install 'triton>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}')")
    return None


def gluon_supported(version: str | None = None) -> bool:
    """Whether this Triton has the Gluon Hopper API the sm_90 kernels are written against."""
    version = version or triton_version()
    if version is None or not GLUON_RANGE[0] <= _parse(version)[:2] < GLUON_RANGE[1]:
        return False
    try:
        import triton.experimental.gluon.language.nvidia.hopper  # noqa: F401
    except ImportError:
        return False
    return True


def require_supported_triton() -> None:
    """Raise ImportError with the supported range when the installed Triton is outside it."""
    reason = check_triton_version()
    if reason is not None:
        raise ImportError(f"llmkernels: {reason}")
