"""Three numbers the one-kernel decode step's cost model (llmkernels.megakernel.simulate) takes, measured:

- stream: what P persistent programs reading disjoint chunks with plain loads get, per program and together
  (P = 1 .. 4 per SM, 8 or 32 KB per loop step): how many bytes an SM must keep in flight for its share;
- pingpong: two programs handing a counter back and forth (release / acquire atomics): the latency from one SM's
  signal to another SM seeing it;
- barrier: P programs each adding one to a counter and waiting until all P have, repeatedly: the cost of an op
  boundary that waits on every SM.

    PYTHONPATH=. python bench/lab/megakernel_probe.py

Every program of a launch must be resident at once (the waits spin): P never exceeds the SM count.
"""
import torch
import triton
import triton.language as tl

from llmkernels._runtime import num_sms


@triton.jit
def _stream(X, OUT, chunk, BLOCK: tl.constexpr):
    base = X + tl.program_id(0).to(tl.int64) * chunk
    acc = tl.zeros([BLOCK], tl.float32)
    for off in range(0, chunk, BLOCK):
        acc += tl.load(base + off + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(OUT + tl.program_id(0), tl.sum(acc))


@triton.jit
def _pingpong(A, B, n):
    for i in range(1, n + 1):
        if tl.program_id(0) == 0:
            tl.atomic_xchg(A, i, sem="release")
            v = tl.atomic_add(B, 0, sem="acquire")
            while v < i:
                v = tl.atomic_add(B, 0, sem="acquire")
        else:
            v = tl.atomic_add(A, 0, sem="acquire")
            while v < i:
                v = tl.atomic_add(A, 0, sem="acquire")
            tl.atomic_xchg(B, i, sem="release")


@triton.jit
def _barriers(C, n):
    for i in range(1, n + 1):
        tl.atomic_add(C, 1, sem="release")
        target = i * tl.num_programs(0)
        v = tl.atomic_add(C, 0, sem="acquire")
        while v < target:
            v = tl.atomic_add(C, 0, sem="acquire")


def _ms(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return sorted(out)[len(out) // 2]


def main():
    sms = num_sms()
    chunk = 8 << 20  # bf16 elements per program: 16 MB
    x = torch.randn(2 * sms * chunk // 8, device="cuda", dtype=torch.bfloat16)  # L2-overflowing, reused per P
    print(f"{torch.cuda.get_device_name()}, {sms} SMs")
    out = torch.empty(4 * sms, device="cuda")
    # bytes in flight per program: BLOCK bf16 elements per loop step, 4 or 8 warps
    for P, block, warps in [(1, 4096, 8), (8, 4096, 8), (33, 4096, 8), (66, 4096, 8), (sms, 4096, 8),
                            (2 * sms, 4096, 8), (sms, 16384, 8), (sms, 16384, 4), (2 * sms, 16384, 4),
                            (4 * sms, 4096, 4)]:
        c = min(chunk, x.numel() // P // block * block)
        ms = _ms(lambda: _stream[(P,)](x, out, c, BLOCK=block, num_warps=warps))
        gbs = 2 * c / (ms * 1e-3) / 1e9
        print(f"stream P={P:>3} ({2 * block // 1024} KB per step, {warps} warps): {gbs:7.1f} GB/s per program, "
              f"{P * gbs / 1e3:6.3f} TB/s together", flush=True)
    a = torch.zeros(2, dtype=torch.int32, device="cuda")
    n = 10000
    a.zero_()
    ms = _ms(lambda: (a.zero_(), _pingpong[(2,)](a[0:], a[1:], n, num_warps=4)))
    print(f"pingpong: {ms * 1e3 / (2 * n):.2f} us from a signal to the other SM's acquire", flush=True)
    c = torch.zeros(1, dtype=torch.int32, device="cuda")
    for P in (2, 8, 33, sms):
        n = 2000
        ms = _ms(lambda: (c.zero_(), _barriers[(P,)](c, n, num_warps=4)))
        print(f"barrier over {P:>3} programs: {ms * 1e3 / n:.2f} us each", flush=True)


if __name__ == "__main__":
    main()
