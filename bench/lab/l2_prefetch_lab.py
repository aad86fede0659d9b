"""Batch-1 GEMVs read from DRAM against read after an L2 prefetch of their weights (sm_90 bulk prefetch): what
pulling the next projection's weights into L2 beside the current one could save.

    PYTHONPATH=. python bench/lab/l2_prefetch_lab.py [gemma2-9b|llama3-8b ...]

Each matrix of family_gemv.matrices, per call: L2 flushed (a 256 MB read), then optionally the prefetch and a
pause, then the GEMV alone between two events; median of 20 calls, us. "pf+0" starts the GEMV right after the
prefetch launch (they overlap), as in the engine.
"""
import sys

import torch
import triton
import triton.language as tl

from llmkernels.qgemv import gemv
from llmkernels.testing.random_weights import random_qtensor

from family_gemv import SHAPES, matrices


@triton.jit
def _l2_prefetch_kernel(P, nbytes, CHUNK: tl.constexpr, PER: tl.constexpr):
    offs = (tl.program_id(0) * PER + tl.arange(0, PER)).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - offs, CHUNK).to(tl.int32)  # nbytes is a multiple of 16, as the instruction needs
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r", [P + offs, size], dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch(t: torch.Tensor, limit: int) -> None:
    """Start pulling the first ``limit`` bytes of ``t`` (contiguous, 16-byte aligned) into L2."""
    nbytes = (min(t.numel() * t.element_size(), limit) // 16) * 16
    chunk, per = 4096, 128
    _l2_prefetch_kernel[(triton.cdiv(nbytes, chunk * per),)](t.view(-1).view(torch.uint8), nbytes, CHUNK=chunk,
                                                             PER=per, num_warps=4)


def _time(m, x, flush, mode: str, reps: int = 20) -> float:
    ts = []
    for _ in range(reps):
        flush.sum()
        if mode != "cold":
            for t in (m.data, m.scales, m.biases):
                if t is not None:
                    l2_prefetch(t, 1 << 40)
            if mode == "pf+pause":
                torch.cuda._sleep(200_000)  # ~100 us: the pull has finished
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        gemv(x, m)
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3)
    return sorted(ts)[len(ts) // 2]


def main():
    names = sys.argv[1:] or ["gemma2-9b", "llama3-8b"]
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda").view(torch.int32)
    print(torch.cuda.get_device_name(), flush=True)
    for name in names:
        for label, N, K, fmt in matrices(SHAPES[name]):
            m = random_qtensor(fmt, N, K, device="cuda")
            x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
            y = gemv(x, m)
            for t in (m.data, m.scales, m.biases):
                if t is not None:
                    l2_prefetch(t, 1 << 40)
            torch.cuda.synchronize()
            assert torch.equal(gemv(x, m), y)
            res = {mode: _time(m, x, flush, mode) for mode in ("cold", "pf+pause", "pf+0")}
            print(f"{name} {label} {fmt} {N}x{K} {m.nbytes / 1e6:.1f} MB: "
                  + " | ".join(f"{k} {v:6.1f}" for k, v in res.items()), flush=True)


if __name__ == "__main__":
    main()
