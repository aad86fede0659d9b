"""Triton interpreter fixes the library depends on (machines without a GPU run every kernel through it).

The interpreter stores bfloat16 tensors as their uint16 bit patterns, and its ``tl.dot`` and float arithmetic
(add, multiply, exp, fma, clamp, ...) compute on those integers (Triton 3.2 through 3.6 at least), so bf16 kernels
return values around 1e8 with no error. ``fix_interpreter`` makes the interpreter widen bf16 operands to float32 (exact)
first, as the tensor cores do for dots, and round float results back to bf16 (to nearest even), as compiled bf16
arithmetic does. Comparisons give int1 results (bool data) whatever their operands' dtype: Triton 3.9's interpreter
labels them with the left operand's dtype and widens them to it, so a mask such as ``(rows < N) & (m < M)`` became
int32 and its loads failed ("mask has unsupported dtype"). The fixes are idempotent and only touch the interpreter's
builder, never compiled kernels.
"""
from __future__ import annotations

_PATCHED = False


def _bf16_to_f32(handle, tl, TensorHandle, np):
    bits = handle.data.astype(np.uint32) << 16
    return TensorHandle(bits.view(np.float32), tl.float32)


_COMPARISONS = ("less", "less_equal", "greater", "greater_equal", "equal", "not_equal")


def fix_interpreter() -> bool:
    """Make the interpreter right for bfloat16 dots and arithmetic and for comparison results. Returns False when
    there is nothing to patch
    (a Triton without an interpreter builder of the known shape), in which case the public ops refuse bf16 tensors
    under the interpreter (``_checks.check_device``)."""
    global _PATCHED
    if _PATCHED:
        return True
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "InterpreterBuilder", None)
    TensorHandle = getattr(interpreter, "TensorHandle", None)
    names = ("create_dot", "binary_op", "unary_op", "create_fma", "create_clampf")
    if TensorHandle is None or any(not callable(getattr(builder, n, None)) for n in names):
        return False

    def is_bf16(h):
        return isinstance(h, TensorHandle) and h.dtype.scalar == tl.bfloat16

    def widen(h):
        return _bf16_to_f32(h, tl, TensorHandle, np) if is_bf16(h) else h

    def narrow(h):
        bits = np.asarray(h.data, dtype=np.float32).view(np.uint32)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return TensorHandle(rounded, tl.bfloat16)

    def wrap(original, round_back):
        def patched(self, *args, **kwargs):
            if not any(is_bf16(a) for a in args):
                return original(self, *args, **kwargs)
            out = original(self, *[widen(a) for a in args], **kwargs)
            return narrow(out) if round_back(args) else out
        return patched

    builder.create_dot = wrap(builder.create_dot, lambda args: False)  # accumulates in d's dtype (fp32)
    arithmetic = wrap(builder.binary_op, lambda args: is_bf16(args[0]))

    def binary_op(self, lhs, rhs, op):
        if getattr(op, "__name__", "") in _COMPARISONS:  # a comparison gives int1 (bool), whatever its operands' dtype
            lhs, rhs = widen(lhs), widen(rhs)
            return TensorHandle(np.asarray(op(lhs.data, rhs.data), dtype=np.bool_), tl.int1)
        return arithmetic(self, lhs, rhs, op)

    builder.binary_op = binary_op
    builder.unary_op = wrap(builder.unary_op, lambda args: is_bf16(args[0]))
    builder.create_fma = wrap(builder.create_fma, lambda args: is_bf16(args[2]))
    builder.create_clampf = wrap(builder.create_clampf, lambda args: is_bf16(args[0]))
    _PATCHED = True
    return True
