"""Helpers shared by the GEMV kernels' launchers: how K is split over the grid, how split partials are summed into
the output, and the byte / fp16 / int8 views of one weight buffer."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._pdl import pdl_options, pdl_supported, pdl_trigger, pdl_wait
from .._runtime import empty


def _views(data: torch.Tensor):
    """Byte view, fp16 view and int8 view of one weight buffer (same memory)."""
    w8 = data.view(torch.uint8) if data.dtype != torch.uint8 else data
    if w8.shape[-1] % 2 == 0:
        w16 = w8.view(torch.float16)
    else:  # only f32/bf16/f16-free layouts can be odd; the fp16 view is then unused
        w16 = w8
    return w8, w16, w8.view(torch.int8)


def split_k(programs: int, nblocks: int, nb: int, sms: int, waves: int = 2, fit: bool = False) -> tuple[int, int]:
    """(split, blocks per split) for a grid of ``programs`` output tiles over ``nblocks`` K blocks taken ``nb`` per
    step: K is split until the grid has about ``waves`` programs per SM (never below one step per split); with
    ``fit``, at most that many (so a kernel that sums its own partials can)."""
    split = 1
    if programs < waves * sms:
        split = max(1, min((waves * sms) // programs if fit else triton.cdiv(waves * sms, programs), nblocks // nb))
    per_split = triton.cdiv(triton.cdiv(nblocks, split), nb) * nb
    return triton.cdiv(nblocks, per_split), per_split


@triton.jit
def _splitk_sum_kernel(P, Y, n, SPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """y = sum over splits of the float32 partials P [SPLIT, n], cast to y's dtype: one pass, one launch (with PDL
    its launch overlaps the GEMV's last programs, see _pdl.py)."""
    pdl_wait(PDL)
    pdl_trigger(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(P + s * n + offs, mask=mask, other=0.0)
    tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def store_tile(out, rows, m, ok, Y, PART, COUNT, M, N, pid_k, split, tile, stride_ys, stride_ym, FIXUP: tl.constexpr):
    """Store a program's float32 sums ``out`` [rows, m] (mask ``ok``) for K split ``pid_k`` of ``split``.

    With FIXUP the split programs of output tile ``tile`` store partials in PART [split, M, N] and count their arrival
    in COUNT (zero on entry, see _runtime.split_counters); the last to arrive sums them in split order (the bits of
    _splitk_sum_kernel), writes Y [1, M, N] and resets the counter. Otherwise Y [split, M, N] gets the partials (with
    one split, the result)."""
    if FIXUP:
        part = PART + m[None, :] * N + rows[:, None]
        tl.store(part + pid_k * N * M, out, mask=ok)
        # every warp's partials stored before the one thread that runs the scalar atomic releases them
        tl.debug_barrier()
        if tl.atomic_add(COUNT + tile, 1, sem="acq_rel") == split - 1:
            total = tl.zeros(out.shape, dtype=tl.float32)
            for s in range(split):
                total += tl.load(part + s * N * M, mask=ok, other=0.0, cache_modifier=".cg")
            tl.store(Y + m[None, :] * stride_ym + rows[:, None], total.to(Y.dtype.element_ty), mask=ok)
            tl.atomic_xchg(COUNT + tile, 0)
    else:
        tl.store(Y + pid_k * stride_ys + m[None, :] * stride_ym + rows[:, None], out.to(Y.dtype.element_ty), mask=ok)


def _finish(y: torch.Tensor, out_dtype) -> torch.Tensor:
    """The [M, N] result of a launch that wrote ``y`` [split, M, N] (float32 partials when split > 1)."""
    split, M, N = y.shape
    if split == 1:
        return y[0]
    out = empty(M, N, dtype=out_dtype, device=y.device)
    BLOCK = 1024
    pdl = pdl_supported(y.device)
    _splitk_sum_kernel[(triton.cdiv(M * N, BLOCK),)](y, out, M * N, SPLIT=split, BLOCK=BLOCK, PDL=pdl,
                                                     **pdl_options(pdl))
    return out


def split_outputs(M: int, dtype, device, N: int, split: int, tiles: int, fixup: bool):
    """(y, part, counters) for a GEMV launch (m1, int8, tensor-core or generic kernel) with M activation rows,
    output ``dtype``, ``split`` K splits and ``tiles`` output tiles. With fixup, a counter buffer (see
    _runtime.split_counters) and room for the tiles: y [1, M, N] in ``dtype``, float32 partials part [split, M, N]
    summed in the kernel. Otherwise counters is None and y [split, M, N] (float32 when split) is also part."""
    from .._runtime import split_counters

    counters = split_counters(device) if fixup and split > 1 else None
    if counters is not None and tiles <= counters.numel():
        y = empty(1, M, N, dtype=dtype, device=device)
        return y, empty(split, M, N, dtype=torch.float32, device=device), counters
    y = empty(split, M, N, dtype=torch.float32 if split > 1 else dtype, device=device)
    return y, y, None
