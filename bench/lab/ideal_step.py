"""The floor of a kernel-per-op batch-1 decode step for the synthetic Llama-3-8B at q4_k sizes: plain reads of the
q4_k byte counts (int32 words, low nibble times x) stand for the GEMVs, and do-nothing kernels (read 4096 floats of
the previous output, write them back) stand for the small ops (norms, RoPE, attention, combine, roundings). Every
kernel waits on the previous one through PDL (launch_pdl, griddepcontrol) and the whole step is one CUDA graph.

Variants: how many small kernels per layer (the engine's act_int8 step has 7: norm, rope_store, attention,
combine, rounding, norm, silu-rounding); norms that reduce over the row between their load and store; an attention
stand-in that reads the layer's 640-token bf16 KV cache (2.6 MB, 64 or 640 programs); a kernel before the QKV
projection that asks L2 for that KV cache. Percentages are of the engine bench's bound at 3.117 TB/s (its measured
read bandwidth in session 32's runs). Usage on an H100: ``PYTHONPATH=. python bench/lab/ideal_step.py``."""
import time

import torch
import triton
import triton.language as tl

H, FFN, VOCAB, LAYERS = 4096, 14336, 128256, 32
Q4K = 144 / 256  # bytes per weight
BN, BK = 8, 256


@triton.jit
def read_kernel(W, X, Y, N, K4, BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    rows_c = tl.minimum(rows, N - 1)
    kk = tl.arange(0, BK)
    p = W + rows_c[:, None].to(tl.int64) * K4 + kk[None, :]
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BN, BK], tl.float32)
    w = tl.load(p, mask=(kk < K4)[None, :], other=0)
    for k in range(0, K4, BK):
        xv = tl.load(X + (k + kk) % 4096)
        wc = w
        nk = k + BK
        w = tl.load(p + nk, mask=((nk + kk) < K4)[None, :], other=0)
        acc += (wc & 0xF).to(tl.float32) * xv[None, :]
    tl.store(Y + rows, tl.sum(acc, 1) * 1e-3, mask=rows < N)


@triton.jit
def _prefetch(KV, kv_words, pid, P):
    """Ask L2 for this program's share of KV's words, in 4 KB bulk prefetches."""
    per = tl.cdiv(tl.cdiv(kv_words, 1024), P)
    for c0 in range(pid * per, pid * per + per, 16):
        c = c0 + tl.arange(0, 16)
        ptr = KV + tl.minimum(c, tl.cdiv(kv_words, 1024) - 1) * 1024
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], 4096; mov.u32 $0, 0;", "=r,l", [ptr],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def pf_kernel(X, Y, KV, kv_words, BLOCK: tl.constexpr):
    """Prefetches KV into L2 before its PDL wait, then copies X to Y like tiny_kernel."""
    pid = tl.program_id(0)
    _prefetch(KV, kv_words, pid, tl.num_programs(0))
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + (pid * BLOCK + offs) % 4096)
    tl.store(Y + (pid * BLOCK + offs) % 4096, x * 1.0001)


@triton.jit
def norm_kernel(X, Y, RES, BLOCK: tl.constexpr):
    """A residual add and RMSNorm stand-in: one program, the whole 4096 row, a reduction between load and store."""
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    offs = tl.arange(0, BLOCK)
    h = tl.load(X + offs) + tl.load(RES + offs)
    tl.store(RES + offs, h)
    r = tl.rsqrt(tl.sum(h * h) / BLOCK + 1e-5)
    tl.store(Y + offs, h * r)


@triton.jit
def tiny_kernel(X, Y, KV, kv_words, BLOCK: tl.constexpr):
    """Reads X[0:4096] (and its share of KV's words when kv_words > 0), writes Y[0:4096]."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    per = tl.cdiv(kv_words, P)
    for k in range(pid * per, tl.minimum(pid * per + per, kv_words), BLOCK):
        acc += tl.load(KV + k + offs, mask=k + offs < kv_words, other=0)
    x = tl.load(X + (pid * BLOCK + offs) % 4096)
    tl.store(Y + (pid * BLOCK + offs) % 4096, x * 1.0001 + (tl.sum(acc) & 1).to(tl.float32))


def main():
    dev = torch.device("cuda")
    shapes = [(6144, H), (H, H), (2 * FFN, H), (H, FFN)]
    wl = []
    total = 0
    for _ in range(LAYERS):
        layer = []
        for n, k in shapes:
            k4 = int(k * Q4K) // 4
            layer.append((torch.randint(-2**31, 2**31 - 1, (n, k4), dtype=torch.int32, device=dev), n, k4))
            total += n * k4 * 4
        wl.append(layer)
    lm_k4 = int(H * Q4K) // 4
    lm = (torch.randint(-2**31, 2**31 - 1, (VOCAB, lm_k4), dtype=torch.int32, device=dev), VOCAB, lm_k4)
    total += VOCAB * lm_k4 * 4 + int(H * Q4K)  # + one embedding row
    kv = torch.randint(-2**31, 2**31 - 1, (LAYERS, 640 * 8 * 128 * 2 * 2 // 4), dtype=torch.int32, device=dev)
    bufs = [torch.rand(2 * VOCAB, device=dev) for _ in range(2)]

    big = torch.empty(2 * 2**30 // 2, dtype=torch.bfloat16, device=dev)
    for _ in range(3):
        big.sum()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        big.sum()
    torch.cuda.synchronize()
    bw = big.numel() * 2 * 10 / (time.perf_counter() - t)
    del big
    bound_us = total / bw * 1e6
    print(f"weights {total / 1e9:.3f} GB, read bw (torch sum) {bw / 1e12:.3f} TB/s, bound {bound_us:.1f} us "
          f"= {1e6 / bound_us:.1f} tok/s; with 3.117 TB/s {total / 3.117e12 * 1e6:.1f} us", flush=True)

    state = {"i": 0}

    def nxt():
        state["i"] ^= 1
        return bufs[state["i"] ^ 1], bufs[state["i"]]

    def R(w):
        x, y = nxt()
        W, n, k4 = w
        read_kernel[(triton.cdiv(n, BN),)](W, x, y, n, k4, BN=BN, BK=BK, num_warps=4, launch_pdl=True)

    def T(grid=1, kvl=None):
        x, y = nxt()
        kvw = kv[kvl] if kvl is not None else kv[0]
        tiny_kernel[(grid,)](x, y, kvw, kvw.numel() if kvl is not None else 0, BLOCK=1024, num_warps=4,
                             launch_pdl=True)

    res = torch.zeros(4096, device=dev)

    def N():
        x, y = nxt()
        norm_kernel[(1,)](x, y, res, BLOCK=4096, num_warps=16, launch_pdl=True)

    def PF(li, grid=64):
        x, y = nxt()
        pf_kernel[(grid,)](x, y, kv[li], kv[li].numel(), BLOCK=1024, num_warps=4, launch_pdl=True)

    def step(smalls, attn_kv):
        """smalls: which small ops to launch per layer, a subset of the engine's seven (plus "realnorm": norms
        with a reduction, "pf": a kernel before QKV that prefetches the layer's KV into L2)."""
        T()  # embedding row
        for li, (qkv, o, gu, down) in enumerate(wl):
            if "norm1" in smalls:
                N() if "realnorm" in smalls else T()
            if "pf" in smalls:
                PF(li)
            R(qkv)
            if "rope" in smalls:
                T(4)
            if "attn" in smalls:
                T(640 if "attn640" in smalls else 64, li if attn_kv else None)
            if "combine" in smalls:
                T(32)
            if "round" in smalls:
                T(1)
            R(o)
            if "norm2" in smalls:
                N() if "realnorm" in smalls else T()
            R(gu)
            if "silu" in smalls:
                T(8)
            R(down)
        T()  # final norm
        R(lm)
        T()  # argmax

    def timed(fn, reps=10):
        fn()
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            fn()
        g.replay()
        torch.cuda.synchronize()
        best = 1e9
        for _ in range(5):
            e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
            e0.record()
            for _ in range(reps):
                g.replay()
            e1.record()
            torch.cuda.synchronize()
            best = min(best, e0.elapsed_time(e1) * 1e3 / reps)
        return best

    seven = ("norm1", "rope", "attn", "combine", "round", "norm2", "silu")
    variants = [
        ("reads only (3 small kernels per step)", (), False),
        ("7 small/layer (engine act_int8)", seven, False),
        ("7 small/layer, attention reads 2.6 MB", seven, True),
        ("6 small/layer (no round)", ("norm1", "rope", "attn", "combine", "norm2", "silu"), False),
        ("5 small/layer (no round, combine)", ("norm1", "rope", "attn", "norm2", "silu"), False),
        ("4 small/layer (norm1, attn, norm2, silu)", ("norm1", "attn", "norm2", "silu"), False),
        ("3 small/layer (rope, attn, silu)", ("rope", "attn", "silu"), False),
        ("2 small/layer (attn, combine)", ("attn", "combine"), False),
        ("1 small/layer (attn)", ("attn",), True),
        ("7 small/layer, norms reduce", seven + ("realnorm",), False),
        ("7 small/layer, norms reduce, attention reads", seven + ("realnorm",), True),
        ("7+pf small/layer, attention reads", seven + ("pf",), True),
        ("7+pf small/layer, norms reduce, attn reads", seven + ("pf", "realnorm"), True),
        ("7 small/layer, attention reads, grid 640", seven + ("attn640",), True),
        ("7 small/layer, norms reduce, attn reads 640", seven + ("realnorm", "attn640"), True),
        ("3 small/layer (rope, attn, silu), attn reads", ("rope", "attn", "silu"), True),
        ("3 small/layer, attn reads 640", ("rope", "attn", "silu", "attn640"), True),
        ("2 small/layer (attn, combine), attn reads 640", ("attn", "combine", "attn640"), True),
        ("1 small/layer (attn), attn reads 640", ("attn", "attn640"), True),
    ]
    for rnd in range(2):
        for name, smalls, akv in variants:
            t = timed(lambda: step(smalls, akv))
            print(f"round {rnd} {name:44s} {t:7.1f} us/step {1e6 / t:6.1f} tok/s {100 * bound_us / t:5.1f}% of bound "
                  f"({100 * total / 3.117e12 * 1e6 / t:5.1f}% at 3.117)", flush=True)
    # the reads alone: effective bandwidth of the per-layer read shapes, one at a time over all layers
    for j, (n, k) in enumerate(shapes):
        def only():
            for layer in wl:
                R(layer[j])
        t = timed(only)
        b = sum(layer[j][0].numel() * 4 for layer in wl)
        print(f"reads {n}x{k} x{LAYERS}: {t / LAYERS:6.2f} us each, {b / t / 1e6:.3f} TB/s", flush=True)
    t = timed(lambda: R(lm))
    print(f"reads lm head: {t:6.2f} us, {lm[0].numel() * 4 / t / 1e6:.3f} TB/s", flush=True)


main()
