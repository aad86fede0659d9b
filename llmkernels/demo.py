"""``python -m llmkernels demo``: every kernel once, checked against its pure-torch reference, timed on a GPU.

Without a GPU the kernels run through Triton's interpreter on small sizes (correctness only; timings there mean
nothing and are not shown).
"""
from __future__ import annotations

import time

import torch


def _row(name, err, tol, ours_ms=None, ref_ms=None, ref_name=""):
    status = "ok" if err <= tol else "MISMATCH"
    line = f"  {name:<44} max rel err {err:9.2e} (tol {tol:.0e}) {status}"
    if ours_ms is not None and ref_ms is not None:
        line += f" | {ours_ms * 1e3:8.1f} us vs {ref_name} {ref_ms * 1e3:8.1f} us ({ref_ms / ours_ms:5.2f}x)"
    print(line, flush=True)
    return err <= tol


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max() / (b.abs().max() + 1e-12))


GPU_SIZES = dict(S=4096, H=32, Hkv=8, D=128, B=32, L=4096, N=14336, K=4096)
CPU_SIZES = dict(S=67, H=4, Hkv=2, D=64, B=3, L=45, N=40, K=512)


def main(timed: bool | None = None, sizes: dict | None = None, timer=None) -> int:
    """Run every kernel once against its reference; ``timed`` (default: a GPU is present) adds timings.

    ``sizes`` and ``timer`` exist so tests can run the timed branch small, with a stand-in timer, on any device.
    """
    import llmkernels as lk
    from llmkernels._checks import interpreter_mode
    from llmkernels.testing import flash_attn_varlen_ref, gemv_ref, paged_attention_ref

    on_gpu = torch.cuda.is_available() and not interpreter_mode()
    gpu = on_gpu if timed is None else timed
    dev = "cuda" if on_gpu else "cpu"
    sz = sizes or (GPU_SIZES if gpu else CPU_SIZES)
    if gpu:
        if timer is None:
            from llmkernels.bench.harness import time_ms as timer
        time_ms = timer
        print(f"llmkernels demo on {torch.cuda.get_device_name() if on_gpu else dev} (timed)")
    else:
        print("llmkernels demo: no CUDA GPU here, so kernels run through Triton's interpreter on small sizes "
              "(correctness only, no timings)")
    dt = torch.bfloat16 if on_gpu else torch.float16
    tol_attn = 2e-2 if on_gpu else 5e-3
    ok = True
    t0 = time.time()

    print("attention")
    S, H, Hkv, D = sz["S"], sz["H"], sz["Hkv"], sz["D"]
    lens = [S, S // 3]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).to(dev)
    q = torch.randn(int(cu[-1]), H, D, device=dev, dtype=dt)
    k = torch.randn(int(cu[-1]), Hkv, D, device=dev, dtype=dt)
    v = torch.randn(int(cu[-1]), Hkv, D, device=dev, dtype=dt)
    o = lk.flash_attn_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    ref, _ = flash_attn_varlen_ref(q, k, v, cu, cu, causal=True, dtype=torch.float32)
    ours_ms = ref_ms = None
    if gpu:
        import torch.nn.functional as F
        qd = q[:S].view(1, S, H, D).transpose(1, 2)
        kd = k[:S].view(1, S, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, 1)
        vd = v[:S].view(1, S, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, 1)
        ours_ms = time_ms(lambda: lk.flash_attn_varlen(q[:S], k[:S], v[:S], cu[:2], cu[:2], S, S, causal=True))
        ref_ms = time_ms(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True))
    ok &= _row(f"flash_attn_varlen causal {lens} H{H}/{Hkv} D{D}", _rel(o, ref), tol_attn, ours_ms, ref_ms,
               f"SDPA S{S}")

    ps = 16
    B, L = sz["B"], sz["L"]
    pages = -(-L // ps)
    kc = torch.randn(B * pages, ps, Hkv, D, device=dev, dtype=dt)
    vc = torch.randn(B * pages, ps, Hkv, D, device=dev, dtype=dt)
    pt = torch.randperm(B * pages, device=dev).to(torch.int32).view(B, pages)
    sl = torch.full((B,), L, dtype=torch.int32, device=dev)
    cq = torch.arange(B + 1, dtype=torch.int32, device=dev)
    qd1 = torch.randn(B, H, D, device=dev, dtype=dt)
    plan = lk.plan_paged_attention(cq.cpu(), sl.cpu(), ps, H, Hkv, D, q_dtype=dt, kv_dtype=dt, device=dev)
    o = lk.paged_attention(qd1, kc, vc, pt, sl, cq, 1, plan=plan)
    ref, _ = paged_attention_ref(qd1, kc, vc, pt, sl, cq, dtype=torch.float32)
    ours_ms = ref_ms = None
    if gpu:
        import torch.nn.functional as F
        ours_ms = time_ms(lambda: lk.paged_attention(qd1, kc, vc, pt, sl, cq, 1, plan=plan, validate=False))
        kd = kc[pt.long()].reshape(B, pages * ps, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, 1)
        vd = vc[pt.long()].reshape(B, pages * ps, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, 1)
        qq = qd1.view(B, 1, H, D).transpose(1, 2)
        ref_ms = time_ms(lambda: F.scaled_dot_product_attention(qq, kd, vd))
    ok &= _row(f"paged_attention decode B{B} L{L} page {ps}", _rel(o, ref), tol_attn, ours_ms, ref_ms,
               "SDPA (dense)")

    print("quantized GEMV (x @ dequantize(W).T)")
    N, K = sz["N"], sz["K"]
    for fmt, kw in [("q4_0", {}), ("q4_k", {}), ("q6_k", {}), ("q8_0", {}), ("mlx", dict(bits=4, group_size=64))]:
        qt = lk.quantize(torch.randn(N, K, device=dev) * 0.02, fmt, **kw)
        x = torch.randn(1, K, device=dev, dtype=dt)
        y = lk.gemv(x, qt)
        ref = gemv_ref(x, qt, dtype=torch.float32)
        ours_ms = ref_ms = None
        if gpu:
            w16 = lk.dequantize(qt, dtype=dt)
            ours_ms = time_ms(lambda: lk.gemv(x, qt))
            ref_ms = time_ms(lambda: x @ w16.T)
        name = fmt if fmt != "mlx" else "mlx 4-bit g64"
        ok &= _row(f"gemv {name} N{N} K{K} M1", _rel(y, ref), 2e-2 if on_gpu else 5e-3, ours_ms, ref_ms,
                   "cuBLAS fp16")
    print(f"done in {time.time() - t0:.1f} s: {'all kernels match their references' if ok else 'MISMATCHES above'}")
    return 0 if ok else 1
