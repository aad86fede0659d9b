"""Pieces the Gluon kernels (prefill_ws.py, paged_ws.py) share: shared-memory layouts for TMA tiles, TMA
descriptors over row views, and compiling a kernel for sm_90 without a GPU."""
import functools

import torch
import triton
from triton.experimental.gluon import language as gl

LN2: gl.constexpr = gl.constexpr(0.6931471805599453)
_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv,
              torch.float8_e5m2: gl.float8e5}
_SIG_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8e4nv": torch.float8_e4m3fn,
               "fp8e5": torch.float8_e5m2}


@functools.cache
def smem_layout(rows: int, head_dim: int, dtype: torch.dtype):
    """The NVMMA shared layout of a [rows, head_dim] tile (the swizzle follows the row bytes, not the row count)."""
    return gl.NVMMASharedLayout.get_default_for([rows, head_dim], _GL_DTYPES[dtype])


def row_descriptor(t: torch.Tensor, shape, row_stride: int, rows: int):
    """A Gluon TMA descriptor over ``t`` viewed as 2-D ``shape`` = [rows total, head-major columns] with
    [rows, head dim] tiles (head dim = t.shape[-1])."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    D = t.shape[-1]
    return TensorDescriptor(t, list(shape), [row_stride, 1], [rows, D], smem_layout(rows, D, t.dtype))


def compile_sm90(kernel, signature: dict, constexprs: dict, num_warps: int = 4, aligned=()):
    """Compile a Gluon kernel for sm_90 without a GPU (ptxas ships with Triton) -> the compiled kernel (``.asm`` holds
    ttgir / ptx / cubin, ``.metadata.shared`` the shared memory). Used by the tests and for reading the code the
    compiler makes. It needs the compiler, not the interpreter: on a machine without a GPU set TRITON_INTERPRET=0
    before importing llmkernels (which otherwise turns the interpreter on). ``aligned`` names the arguments that
    a launch would specialize as multiples of 16."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    # ``aligned``: arguments a launch would see as multiples of 16 (pointers 16-byte aligned, strides)
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    return triton.compile(GluonASTSource(kernel, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps})


def tile_desc_type(dtype: str, rows: int, head_dim: int) -> str:
    """The signature string of a descriptor argument with [rows, head_dim] tiles ("fp16", "bf16", "fp8e4nv",
    "fp8e5")."""
    tdt = _SIG_DTYPES[dtype]
    return f"tensordesc<{dtype}[{rows},{head_dim}],{smem_layout(rows, head_dim, tdt)!r}>"
