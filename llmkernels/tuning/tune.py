"""Tune the kernels for the GPU at hand: ``python -m llmkernels tune [suites]``.

For each key of a table (what stays fixed across steps: dtype, head dim, page-size class, format, M class) the
candidates are timed on representative shapes and the fastest is written to ``<table>.json`` under this GPU's
name, in the user's tuning folder (``llmkernels.tuning.user_dir()``), which later runs read before the shipped
tables. Shapes never become part of a key, so a new sequence length never re-tunes or recompiles. Maintainers
regenerate a shipped family section with ``--out llmkernels/tuning --section sm90``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from ..supported import gluon_supported
from . import OVERRIDES, clear_cache, user_dir


def _best(table, key, candidates, workloads, check=None, graph=False):
    """Time every candidate on every workload (geometric mean); -> the best entry. ``check``: called under each
    candidate before it is timed, raises AssertionError if the candidate computes a wrong result (it is then
    never chosen: a fast wrong kernel must not reach a table). ``graph``: time callables by CUDA-graph replay
    (the kernels alone), for calls whose eager host time rivals their kernels' (then eager timing ranks noise)."""
    from ..bench.harness import time_graph_ms, time_ms

    results = []
    for cand in candidates:
        OVERRIDES[(table, key)] = list(cand)
        if check is not None:
            try:
                check()
            except AssertionError as e:
                print(f"    {key} {cand}: wrong result, skipped ({str(e).splitlines()[0][:160]})", flush=True)
                results.append((float("inf"), cand))
                OVERRIDES.pop((table, key), None)
                continue
        try:
            # a workload is one callable (timed with do_bench) or a list of copies (graph replay, L2 overflowed)
            times = [time_graph_ms(w, reps=10, trials=3) if isinstance(w, list) else
                     time_ms(w, rep_ms=40, cuda_graph=True) if graph else time_ms(w, warmup_ms=10, rep_ms=40)
                     for w in workloads]
            score = math.exp(sum(math.log(t) for t in times) / len(times))
        except Exception as e:  # a candidate that does not fit (shared memory, registers) is skipped
            score = float("inf")
            print(f"    {key} {cand}: {type(e).__name__}", flush=True)
        results.append((score, cand))
        OVERRIDES.pop((table, key), None)
    results.sort(key=lambda r: r[0])
    best = results[0]
    if not math.isfinite(best[0]):
        raise RuntimeError(f"tuning {table} {key}: no candidate both ran and gave right results")
    print(f"  {table} {key}: best {best[1]} {best[0] * 1e3:.1f} us (worst finite "
          f"{max(r[0] for r in results if math.isfinite(r[0])) * 1e3:.1f} us)", flush=True)
    return list(best[1])


def _close_check(cases, tol: float):
    """A check for _best: ``cases`` [(fn, ref_fn)], each fn's output within ``tol`` of its float64 reference
    relative to the reference's largest element (a product over K of O(1) terms; a miscompiled config is off by
    O(1)). References are computed once, at the first call."""
    from ..testing import assert_close

    refs = []

    def check():
        if not refs:
            refs.extend(ref() for _, ref in cases)
        for i, ((fn, _), want) in enumerate(zip(cases, refs)):
            scale = want.abs().max().item() + 1e-6
            assert_close(fn(), want, torch.float64, name=f"workload {i}", atol=tol * scale, rtol=tol)
    return check


def _gemv_check(xs, qts, fn=None, ref=None, tol: float = 4e-3):
    """_close_check over one (x, first weight copy) per shape: ``fn(x, qt)`` (default gemv) against ``ref(x, qt)``
    (default gemv_ref)."""
    from ..qgemv import gemv
    from ..testing import gemv_ref

    fn, ref = fn or gemv, ref or gemv_ref
    return _close_check([(lambda x=x, qt=copies[0]: fn(x, qt), lambda x=x, qt=copies[0]: ref(x, qt))
                         for x, copies in zip(xs, qts)], tol)


# per head dim, the (batch, q heads, kv heads, length) workloads of the prefill tuners, geometric mean. One short and
# one long: S=4096 alone measured bimodal on the H100 (about 290 or 370 TFLOP/s for one config from run to run), and
# at D=256 it picked a config 10% slower at 8192
PREFILL_SHAPES = {64: [(4, 16, 16, 4096), (1, 16, 16, 8192)], 128: [(1, 32, 32, 4096), (1, 32, 8, 8192)],
                  256: [(1, 16, 16, 4096), (1, 16, 16, 8192)]}


def _prefill_inputs(D, dtype=None):
    """[(q, k, v, cu_seqlens, S)] of PREFILL_SHAPES[D] (bf16, or cast to ``dtype``)."""
    from ..bench.suites.prefill import dense_inputs

    inputs = []
    for B, Hq, Hkv, S in PREFILL_SHAPES[D]:
        q, k, v, cu = dense_inputs(B, Hq, Hkv, S, D)
        if dtype is not None:
            q, k, v = (t.to(dtype) for t in (q, k, v))
        inputs.append((q, k, v, cu, S))
    return inputs


def _prefill_check(D: int, dtype, causal: bool):
    """A check for _best: flash_attn_varlen on a small ragged GQA batch at head dim ``D`` in ``dtype`` (bf16, or
    e4m3 inputs) against float64 on the same (dequantized) inputs; the tolerance is the dtype's, relative to the
    largest output."""
    from ..attention import flash_attn_varlen
    from ..testing import flash_attn_varlen_ref

    g = torch.Generator(device="cuda").manual_seed(2)
    lens = [333, 128, 700]
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(sum(lens), h, D, device="cuda", generator=g).to(dtype) for h in (8, 2, 2))
    fp8 = dtype == torch.float8_e4m3fn
    return _close_check([(lambda: flash_attn_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=causal),
                          lambda: flash_attn_varlen_ref(q.float(), k.float(), v.float(), cu, cu, causal=causal)[0])],
                        0.1 if fp8 else 2e-2)


def tune_prefill(gpu):
    from ..attention import flash_attn_varlen
    from ..bench.suites.prefill import varlen_lengths

    out = {}
    for D in PREFILL_SHAPES:
        inputs = _prefill_inputs(D)
        if D == 128:
            # a ragged batch (16 sequences of 100..8000 tokens, not the suite's): it favours other tiles than dense
            # shapes do (BLOCK_M 128 ran it at 345 TFLOP/s, BLOCK_M 64 at 190, both causal)
            lens = varlen_lengths(seed=1)
            cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).cuda()
            q, k, v = (torch.randn(int(cu[-1]), 32, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            inputs.append((q, k, v, cu, max(lens)))
        # (BLOCK_M, BLOCK_N, warps, stages, FOLD_SCALE, TMA). FOLD_SCALE picks the unmasked loop with the scale
        # folded into the exponent (1) or the generic one (0); TMA loads that loop's K/V tiles through tensor
        # descriptors. In bench/lab/prefill_lab.py TMA ran D=256 6% faster and D=64/128 4-10% slower at equal tiles
        if D <= 128:
            cands = [(128, 64, 8, 3, 1), (128, 64, 8, 4, 1), (128, 128, 8, 3, 1), (128, 128, 8, 3, 1, 1),
                     (128, 128, 8, 2, 1), (64, 64, 4, 3, 1), (64, 128, 4, 3, 1), (128, 64, 4, 3, 1)]
        else:
            cands = [(128, 64, 8, 2, 0), (128, 64, 8, 2, 1), (128, 64, 8, 2, 1, 1), (64, 64, 4, 3, 1, 1),
                     (64, 32, 4, 2, 0), (128, 32, 8, 2, 0)]
        for causal in (False, True):
            key = f"bfloat16/{D}/{'causal' if causal else 'full'}"
            fns = [lambda q=q, k=k, v=v, cu=cu, S=S: flash_attn_varlen(q, k, v, cu, cu, S, S, causal=causal)
                   for q, k, v, cu, S in inputs]
            check = _prefill_check(D, torch.bfloat16, causal)
            best = _best("prefill", key, cands, fns, check=check)
            out[key] = best
            out[key.replace("bfloat16", "float16")] = best
            if torch.cuda.get_device_capability() == (9, 0) and gluon_supported():
                # the warp-specialized Gluon kernel (attention/prefill_ws.py), (BLOCK_N, STAGES, OVERLAP, PERSIST),
                # against the Triton kernel's best config just found ([0, 0] keeps the Triton kernel); at D=256 two
                # K/V stages of 64 keys fill 197 KB of shared memory with Q
                OVERRIDES[("prefill", key)] = best
                ws_cands = ([(0, 0), (64, 2), (32, 3), (64, 2, 1), (64, 2, 1, 1), (64, 2, 1, 2)] if D == 256 else
                            [(0, 0), (128, 2), (128, 3), (64, 3), (64, 4), (128, 2, 1), (128, 3, 1), (128, 2, 1, 1),
                             (128, 3, 1, 1), (128, 3, 0, 1), (128, 2, 1, 2), (128, 3, 1, 2), (128, 3, 0, 2)])
                ws = _best("prefill", key + "/ws", ws_cands, fns, check=check, graph=True)
                OVERRIDES.pop(("prefill", key), None)
                out[key + "/ws"] = ws
                out[key.replace("bfloat16", "float16") + "/ws"] = ws
    return out


def tune_prefill_fp8(gpu):
    """The Gluon kernel's (BLOCK_N, STAGES[, OVERLAP[, PERSIST[, PERM]]]) for fp8 e4m3 q/k/v per head dim ([0, 0]:
    the Triton kernel, which widens to fp16), on the dense shapes of tune_prefill."""
    from ..attention import flash_attn_varlen

    if torch.cuda.get_device_capability() != (9, 0) or not gluon_supported():
        return {}
    out = {}
    for D in PREFILL_SHAPES:
        inputs = _prefill_inputs(D, torch.float8_e4m3fn)
        # fp8 tiles are half the bytes of bf16 ones: deeper rings and wider key blocks fit
        # (at D=256, 128 keys spill a few registers and still ran fastest on the H200)
        cands = ([(0, 0), (64, 2), (64, 3), (128, 2), (64, 2, 1), (128, 2, 0, 1), (128, 2, 0, 2), (128, 2, 0, 0, 1),
                  (128, 2, 0, 2, 1)] if D == 256 else
                 [(0, 0), (128, 2), (128, 3), (128, 4), (256, 2), (256, 3), (128, 2, 1), (256, 2, 0, 1),
                  (256, 3, 0, 1), (256, 2, 0, 2), (128, 2, 0, 2), (128, 2, 0, 0, 1), (256, 2, 0, 0, 1),
                  (128, 2, 0, 2, 1), (256, 2, 0, 1, 1)])
        for causal in (False, True):
            key = f"float8_e4m3fn/{D}/{'causal' if causal else 'full'}/ws"
            fns = [lambda q=q, k=k, v=v, cu=cu, S=S: flash_attn_varlen(q, k, v, cu, cu, S, S, causal=causal)
                   for q, k, v, cu, S in inputs]
            # graph replay: an eager fp8 call spends about as long on the host as its kernel at S = 4096
            out[key] = _best("prefill", key, cands, fns, check=_prefill_check(D, torch.float8_e4m3fn, causal),
                             graph=True)
    return out


class _DecodeWork:
    """One decode batch; re-plans when the candidate under test changes (tile sizes are read at plan time)."""

    def __init__(self, key, B, L, ps, kv, Hq, Hkv, D):
        pages = -(-L // ps)
        self.key, self.args = key, (B, L, ps, kv, Hq, Hkv, D)
        self.kc = torch.randn(B * pages, ps, Hkv, D, device="cuda").to(kv)
        self.vc = torch.randn(B * pages, ps, Hkv, D, device="cuda").to(kv)
        self.pt = torch.randperm(B * pages, device="cuda").to(torch.int32).view(B, pages)
        self.cu = torch.arange(B + 1, dtype=torch.int32, device="cuda")
        self.sl = torch.full((B,), L, dtype=torch.int32, device="cuda")
        self.q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
        self.sc = dict(k_scale=1.0, v_scale=1.0) if kv != torch.bfloat16 else {}
        self.plan, self.plan_key = None, "unset"

    def __call__(self):
        from ..attention import paged_attention, plan_paged_attention

        B, L, ps, kv, Hq, Hkv, D = self.args
        cand = OVERRIDES.get(("paged", self.key))
        if cand != self.plan_key:
            self.plan = plan_paged_attention(self.cu.cpu(), self.sl.cpu(), ps, Hq, Hkv, D, q_dtype=torch.bfloat16,
                                             kv_dtype=kv, device="cuda")
            self.plan_key = cand
        return paged_attention(self.q, self.kc, self.vc, self.pt, self.sl, self.cu, 1, plan=self.plan,
                               validate=False, **self.sc)


def _decode_check(key, ps, kv, Hq, Hkv, D, B=3, L=333):
    """A check for _best: a small decode batch (``B`` sequences of ``L`` tokens, page size ``ps``, cache dtype
    ``kv``) through the planner and paged_attention under the candidate, against float64 on the dequantized cache."""
    from ..testing import paged_attention_ref

    w = _DecodeWork(key, B, L, ps, kv, Hq, Hkv, D)
    fp8 = kv != torch.bfloat16
    return _close_check([(w, lambda: paged_attention_ref(w.q, w.kc, w.vc, w.pt, w.sl, w.cu, **w.sc)[0])],
                        0.1 if fp8 else 2e-2)


def tune_decode(gpu):
    out = {}
    Hq, Hkv, D = 32, 8, 128
    # (BLOCK_N, warps, stages). The page-table load before each K/V load takes pipeline stages: a loop gets
    # (stages - 1) // 2 K/V buffers, so 5 stages means 2 buffers (bench/lab/paged_lab.py; 7 and 9 measured no faster)
    cands = [(32, 4, 3), (64, 4, 3), (64, 4, 4), (128, 4, 3), (64, 8, 3), (128, 8, 3), (32, 4, 5), (128, 4, 2),
             (16, 4, 4), (64, 4, 5), (128, 4, 5)]
    for kv in (torch.bfloat16, torch.float8_e4m3fn):
        for page_class, ps in (("p1", 1), ("small", 16), ("large", 64)):
            key = f"short/{str(kv)[6:]}/{D}/{page_class}/g<=8"
            works = [[_DecodeWork(key, B, L, ps, kv, Hq, Hkv, D) for _ in range(n)]
                     for B, L, n in ((16, 4096, 2), (64, 4096, 1), (1, 16384, 4))]
            out[key] = _best("paged", key, cands, works, check=_decode_check(key, ps, kv, Hq, Hkv, D))
            del works
    return out


def tune_decode_few(gpu):
    """The "/few" entries (attention/plan.py _kernel_config): batch-1 decode, split-KV, caches read from DRAM."""
    out = {}
    Hq, Hkv, D = 32, 8, 128
    cands = [(16, 4, 3), (16, 4, 5), (16, 4, 7), (32, 4, 3), (32, 4, 5), (64, 4, 5), (16, 2, 5)]
    for kv in (torch.bfloat16, torch.float8_e4m3fn):
        for page_class, ps in (("p1", 1), ("small", 16), ("large", 64)):
            key = f"short/{str(kv)[6:]}/{D}/{page_class}/g<=8/few"
            # copies so that each graph replay reads its K/V from DRAM, as in an engine step
            works = [[_DecodeWork(key, 1, L, ps, kv, Hq, Hkv, D) for _ in range(n)]
                     for L, n in ((600, 48), (4096, 8), (32768, 2))]
            # one sequence, as the "/few" entries serve
            out[key] = _best("paged", key, cands, works, check=_decode_check(key, ps, kv, Hq, Hkv, D, B=1, L=1500))
            del works
    return out


# the tensor-core kernel (qgemv/tc.py: q4_k, q5_k and MLX 4-bit at M = 3..64, q4_0, q8_0 and q6_k at M = 1..64):
# (BLOCK_N, warps, stages, waves); pipelined stages (> 1) lost 2x, and so did loading the next step's weights one
# step ahead for q4_k (163 registers: 3 programs per SM)
TC_CANDS = [(64, 4, 1, 4), (64, 4, 1, 2), (128, 8, 1, 2), (128, 8, 1, 4), (128, 4, 1, 2), (64, 4, 1, 8)]
# q4_0 / q8_0 also try loading the next step's weights one step ahead (a fifth field, tc.launch_tc), also with
# registers capped at 128 (a sixth field)
TC_LEGACY_CANDS = TC_CANDS + [(64, 4, 1, 2, 1), (64, 4, 1, 4, 1), (128, 8, 1, 2, 1), (64, 4, 1, 2, 1, 128)]
# q5_k / q6_k: also with registers capped at 128 (a sixth field: 4 programs per SM, bench/NOTES.md)
TC_KQ_CANDS = [(64, 4, 1, 4, 0, 128), (64, 4, 1, 2, 0, 128), (128, 8, 1, 2, 0, 128), (64, 4, 1, 8, 0, 128),
               (64, 4, 1, 4), (128, 8, 1, 2)]
# q4_0 and q8_0: gemv and silu_mul_gemv take the tensor-core kernel at every M (entries "tc/<format>/m1" for M = 1,
# tuned at M = 1, "tc/<format>" and "tc/<format>/silu", tuned at M = 8); the planes kernel serves float32 x
TC_ALL_M = ("q4_0", "q8_0")
# formats whose batch-1 gemv runs a kernel of its own, with its table key and candidate configs (rows per thread,
# blocks, warps, stages[, lanes along K, ...]: see m1.launch_m1)
SMALL_M_KERNEL = {
    "q4_k": ("m1/q4_k", [(4, 1, 4, 3), (4, 1, 4, 3, 8, 1, 1), (4, 1, 2, 3, 8, 1, 1), (4, 1, 4, 3, 4, 2, 1),
                         (8, 1, 4, 3, 4, 2, 1), (4, 1, 4, 3, 4, 1, 1), (2, 1, 4, 3, 8, 1, 1), (2, 1, 4, 3)]),
}


def tune_gemv(gpu):
    from ..qgemv import gemv, silu_mul_gemv
    from ..testing import silu_mul_gemv_ref
    from ..testing.random_weights import random_qtensor

    out = {}
    shapes = [(14336, 4096), (4096, 14336)]
    # MLX 4-bit is not tuned: with BLOCK_N=8, NB=8 the planes kernel returned zeros on an H100 (Triton 3.6) while
    # the interpreter was right; its defaults are verified by the GPU tests instead
    fmts = [("q4_0", {}, 8), ("q8_0", {}, 8), ("q4_k", {}, 1)]
    tc_works, tc_checks = {}, {}
    for fmt, kw, nb in fmts:
        qts = [[random_qtensor(fmt, N, K, "cuda", **kw) for _ in range(6)] for N, K in shapes]
        name = fmt if fmt != "mlx" else f"mlx{kw['bits']}"
        for mclass, M in (("m1", 1), ("m16", 8)):
            xs = [torch.randn(M, K, device="cuda", dtype=torch.float16) for _, K in shapes]
            works = [[lambda x=x, qt=qt: gemv(x, qt) for qt in copies] for x, copies in zip(xs, qts)]
            half = max(1, nb // 2)
            if mclass == "m1":
                cands = [(16, nb, 4, 3), (32, nb, 4, 3), (64, nb, 4, 3), (32, nb, 8, 3), (32, 2 * nb, 4, 3),
                         (32, half, 4, 4), (16, 2 * nb, 4, 2), (64, nb, 8, 2), (8, 2 * nb, 4, 3), (16, nb, 2, 4)]
            else:
                cands = [(32, nb, 4, 3), (64, nb, 4, 3), (64, nb, 8, 3), (128, nb, 8, 3), (64, half, 4, 4),
                         (32, 2 * nb, 4, 2), (16, nb, 4, 3)]
            key = f"planes/{name}/{mclass}"
            # fp16/bf16 activations of these formats now run other kernels (m1, the tensor cores) for gemv and
            # silu_mul_gemv; the planes kernel serves float32 x (and K not a multiple of 256), so its entries are
            # timed with float32 x
            planes_works = [[lambda x=x.float(), qt=qt: gemv(x, qt) for qt in copies] for x, copies in zip(xs, qts)]
            out[key] = _best("gemv", key, cands, planes_works,
                             check=_gemv_check([x.float() for x in xs], qts, tol=1e-3))
            check = _gemv_check(xs, qts)
            if fmt in TC_ALL_M:
                tc_works[f"tc/{fmt}" + ("/m1" if mclass == "m1" else "")] = works
                tc_checks[f"tc/{fmt}" + ("/m1" if mclass == "m1" else "")] = check
                if mclass == "m16":  # silu_mul_gemv from M = 2
                    tc_works[f"tc/{fmt}/silu"] = [[lambda x=x, qt=qt: silu_mul_gemv(x, x, qt) for qt in copies]
                                                  for x, copies in zip(xs, qts)]
                    tc_checks[f"tc/{fmt}/silu"] = _gemv_check(xs, qts, lambda x, qt: silu_mul_gemv(x, x, qt),
                                                              lambda x, qt: silu_mul_gemv_ref(x, x, qt), tol=1e-2)
            elif fmt == "q4_k" and mclass == "m16":
                # gemv takes the tensor-core kernel: (BLOCK_N, warps, stages, waves); pipelined stages (> 1) lost 2x
                out["tc/q4_k"] = _best("gemv", "tc/q4_k", TC_CANDS, works, check=check)
            elif fmt in SMALL_M_KERNEL and mclass == "m1":
                # these shapes take the lane kernel at M = 1 (route.LANES_MIN_WEIGHTS); the m1 entry serves the
                # smaller matrices (attention projections of an 8B model), so it is timed on those
                small_key, small_cands = SMALL_M_KERNEL[fmt]
                small = [(4096, 4096), (6144, 4096)]
                sq = [[random_qtensor(fmt, N, K, "cuda", **kw) for _ in range(8)] for N, K in small]
                sx = [torch.randn(1, K, device="cuda", dtype=torch.float16) for _, K in small]
                out[small_key] = _best("gemv", small_key, small_cands,
                                       [[lambda x=x, qt=qt: gemv(x, qt) for qt in c] for x, c in zip(sx, sq)],
                                       check=_gemv_check(sx, sq))
                del sq
    for key, works in tc_works.items():
        out[key] = _best("gemv", key, TC_LEGACY_CANDS, works, check=tc_checks[key])
    # MLX 4-bit from M = 3 takes the tensor-core kernel as well (its M = 1 and 2 entries are m1/mlx4*, tune gemv_m1)
    mlx = [[random_qtensor("mlx", N, K, "cuda", bits=4, group_size=64) for _ in range(6)] for N, K in shapes]
    xs = [torch.randn(8, K, device="cuda", dtype=torch.float16) for _, K in shapes]
    out["tc/mlx4"] = _best("gemv", "tc/mlx4", TC_CANDS,
                           [[lambda x=x, qt=qt: gemv(x, qt) for qt in copies] for x, copies in zip(xs, mlx)],
                           check=_gemv_check(xs, mlx))
    # q5_k from M = 3 and q6_k at every M (K a multiple of 2048) take the tensor-core kernel, tuned at M = 8
    for fmt in ("q5_k", "q6_k"):
        qts = [[random_qtensor(fmt, N, K, "cuda") for _ in range(4)] for N, K in shapes]
        xs = [torch.randn(8, K, device="cuda", dtype=torch.float16) for _, K in shapes]
        out[f"tc/{fmt}"] = _best("gemv", f"tc/{fmt}", TC_KQ_CANDS,
                                 [[lambda x=x, qt=qt: gemv(x, qt) for qt in copies] for x, copies in zip(xs, qts)],
                                 check=_gemv_check(xs, qts))
    # the generic kernel's K-quant entries, timed on q3_k (q5_k and q6_k have kernels of their own at these shapes)
    generic = [("legacy", "q5_0", {}, 8), ("kquant", "q3_k", {}, 1), ("dense", "f16", {}, 8),
               ("mlx_odd", "mlx", dict(bits=3, group_size=64), 4)]
    for family, fmt, kw, nb in generic:
        qts = [[random_qtensor(fmt, N, K, "cuda", **kw) for _ in range(4)] for N, K in shapes]
        for mclass, M in (("m1", 1), ("m16", 8)):
            xs = [torch.randn(M, K, device="cuda", dtype=torch.float16) for _, K in shapes]
            works = [[lambda x=x, qt=qt: gemv(x, qt) for qt in copies] for x, copies in zip(xs, qts)]
            st = 1 if family == "mlx_odd" else 3
            cands = [(16, nb, 4, st), (32, nb, 4, st), (64, nb, 4, st), (32, max(1, nb // 2), 4, st),
                     (32, nb, 8, st), (64, nb, 8, max(1, st - 1))]
            key = f"{family}/{mclass}"
            out[key] = _best("gemv", key, cands, works, check=_gemv_check(xs, qts))
    return out


# m1 kernel (qgemv/m1.py) configs (R, NB, warps, stages[, KT lanes along K, H threads per chunk, waves]) for the
# M classes other than q4_k at M = 1 (tuned with the other small-M kernels in tune_gemv)
M1_CANDIDATES = [(4, 1, 4, 3), (4, 1, 4, 3, 8, 1, 1), (4, 1, 4, 3, 4, 2, 1), (8, 1, 4, 3, 4, 2, 1),
                 (8, 1, 4, 3, 2, 4, 1), (2, 1, 4, 3, 8, 1, 1)]
# q6_k takes at least 2 threads per chunk (H), hence at most 4 lanes along K
Q6_M1_CANDIDATES = [(4, 1, 4, 3, 4, 2, 1), (2, 1, 4, 3, 4, 2, 1), (4, 1, 4, 3, 2, 2, 1), (4, 1, 4, 3, 2, 4, 1),
                    (4, 1, 4, 3, 1, 2, 1), (4, 1, 4, 3, 4, 2, 2), (2, 1, 4, 3, 2, 4, 1)]
# the lane-order q4_k kernel (ops.gemv_lanes, key "lanes/q4_k"): NB = 1, KT = 8, H = 1 are fixed by the layout
LANE_CANDIDATES = [(2, 1, 4, 3, 8, 1, 1), (2, 1, 2, 3, 8, 1, 1), (2, 1, 4, 4, 8, 1, 1), (4, 1, 4, 3, 8, 1, 1),
                   (1, 1, 4, 3, 8, 1, 1), (2, 1, 8, 3, 8, 1, 1), (2, 1, 4, 3, 8, 1, 2), (4, 1, 2, 3, 8, 1, 1)]


def tune_gemv_m1(gpu):
    """m1 kernel keys (route.m1_key): q4_k at M = 2 and 4, q5_k and q6_k at M = 1, 2 and 4, MLX 4- and 8-bit (group
    64) at M = 1 and 2, on a small, a wide and a long Llama-3-8B shape, weights read from DRAM."""
    from ..qgemv import route

    # gemv takes the tensor-core kernel for many of these cases (route.TC_FIRST_M: q6_k at every M, q4_k and MLX 4-bit
    # from M = 2, long matrices earlier); the m1 entries serve the others (shapes or K it does not take, silu_mul_gemv),
    # so they are timed with that route off
    with route.override(exclude={"tc"}):
        return _tune_gemv_m1()


def _tune_gemv_m1():
    from ..bench.harness import copies_for
    from ..qgemv import gemv, silu_mul_gemv
    from ..qgemv.route import m1_key
    from ..testing import silu_mul_gemv_ref
    from ..testing.random_weights import random_qtensor

    out = {}
    shapes = [(4096, 4096), (28672, 4096), (4096, 14336)]
    for name, fmt, kw, ms in (("q4_k", "q4_k", {}, (2, 4)), ("q5_k", "q5_k", {}, (1, 2, 4)),
                              ("q6_k", "q6_k", {}, (1, 2, 4)), ("mlx4", "mlx", dict(bits=4, group_size=64), (1, 2)),
                              ("mlx8", "mlx", dict(bits=8, group_size=64), (1, 2))):
        qts = []
        for N, K in shapes:
            first = random_qtensor(fmt, N, K, "cuda", **kw)
            qts.append([first] + [random_qtensor(fmt, N, K, "cuda", **kw) for _ in range(copies_for(first.nbytes) - 1)])
        for M in ms:
            xs = [torch.randn(M, K, device="cuda", dtype=torch.float16) for _, K in shapes]
            # plain q4_k gemv takes the tensor-core kernel from M = 2: its m1 entries serve silu_mul_gemv there
            fn = silu_mul_gemv if name == "q4_k" else (lambda x, y, qt: gemv(x, qt))
            works = [[lambda x=x, qt=qt: fn(x, x, qt) for qt in copies] for x, copies in zip(xs, qts)]
            key = m1_key(name, M)
            if name == "q4_k":
                check = _gemv_check(xs, qts, lambda x, qt: silu_mul_gemv(x, x, qt),
                                    lambda x, qt: silu_mul_gemv_ref(x, x, qt), tol=1e-2)
            else:
                check = _gemv_check(xs, qts)
            out[key] = _best("gemv", key, Q6_M1_CANDIDATES if fmt == "q6_k" else M1_CANDIDATES, works, check=check)
        del qts
    return out


def tune_gemv_lanes(gpu):
    """The lane-order q4_k kernel at M = 1 (key "lanes/q4_k"): the shapes of tune_gemv_m1 and the vocabulary
    projection (gemv copies x into lane order itself from route.LANES_MIN_WEIGHTS), weights read from DRAM."""
    from ..bench.harness import copies_for
    from ..qgemv.m1 import lane_order
    from ..qgemv.ops import gemv_lanes
    from ..testing.random_weights import random_qtensor

    works, xs, qts = [], [], []
    for N, K in [(4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]:
        first = random_qtensor("q4_k", N, K, "cuda")
        copies = [first] + [random_qtensor("q4_k", N, K, "cuda") for _ in range(copies_for(first.nbytes) - 1)]
        x = torch.randn(1, K, device="cuda", dtype=torch.float16)
        xl = lane_order(x)
        works.append([lambda x=x, xl=xl, qt=qt: gemv_lanes(x, xl, qt) for qt in copies])
        xs.append(x)
        qts.append(copies)
    check = _gemv_check(xs, qts, lambda x, qt: gemv_lanes(x, lane_order(x), qt))
    return {"lanes/q4_k": _best("gemv", "lanes/q4_k", LANE_CANDIDATES, works, check=check)}


# int8-activation gemv (qgemv/int8.py): the size classes of route.i8_config with representative shapes, and candidate
# configs (R, GP, warps, stages, COAL, PREFETCH)
I8_CLASSES = {"small": [(4096, 4096), (6144, 4096)], "large": [(4096, 14336), (28672, 4096)],
              "wide": [(128256, 4096)]}
I8_CANDIDATES = [(2, 16, 4, 3, 0, 0), (1, 4, 4, 3, 0, 0), (1, 16, 4, 3, 0, 0), (4, 8, 4, 3, 0, 0),
                 (2, 4, 4, 3, 1, 1), (1, 4, 4, 3, 1, 1), (1, 1, 4, 3, 1, 1), (2, 2, 4, 3, 1, 1)]


def tune_gemv_i8(gpu):
    from ..bench.harness import copies_for
    from ..qgemv import gemv
    from ..testing.random_weights import random_qtensor

    out = {}
    for fmt in ("q4_0", "q4_k", "q8_0"):
        for size, shapes in I8_CLASSES.items():
            works, xs, qts = [], [], []
            for N, K in shapes:
                first = random_qtensor(fmt, N, K, "cuda")
                copies = [first] + [random_qtensor(fmt, N, K, "cuda") for _ in range(copies_for(first.nbytes) - 1)]
                x = torch.randn(1, K, device="cuda", dtype=torch.float16)
                works.append([lambda x=x, qt=qt: gemv(x, qt, act_int8=True) for qt in copies])
                xs.append(x)
                qts.append(copies)
            key = f"i8/{fmt}/{size}"
            # against the exact product: int8 activations move it by about 1e-2 of its largest element at most
            check = _gemv_check(xs, qts, lambda x, qt: gemv(x, qt, act_int8=True), tol=3e-2)
            out[key] = _best("gemv", key, I8_CANDIDATES, works, check=check)
            del works
    return out


# table name -> tuner, or (JSON table it writes into, tuner)
# per-pair MoE GEMV (qgemv/moe.py) configs (BLOCK_N, NB, warps, stages)
MOE_CANDIDATES = [(16, 1, 4, 3), (8, 1, 4, 3), (32, 1, 4, 3), (64, 1, 8, 3), (16, 2, 4, 3), (32, 2, 4, 3),
                  (16, 1, 2, 3), (8, 1, 2, 4), (32, 1, 8, 2), (16, 2, 8, 3), (64, 2, 8, 2), (8, 2, 4, 2)]


# the formats each per-family MoE entry is checked on before it may win
MOE_CHECK_FORMATS = ["q4_k", "q5_k", "q6_k", "q4_0", "q8_0", "f16"]

# the m1 kernel's MoE configs for q4_k (R even: gate/up run as its GLU)
MOE_M1_Q4K_CANDIDATES = [(2, 1, 4, 3, 8, 1, 1), (2, 1, 4, 3, 4, 1, 1), (2, 1, 4, 3, 2, 1, 1), (2, 1, 4, 3, 1, 1, 1),
                         (4, 1, 4, 3, 8, 1, 1), (4, 1, 4, 3, 2, 1, 1), (2, 1, 8, 3, 8, 1, 1), (2, 1, 2, 3, 8, 1, 1),
                         (4, 1, 4, 3, 4, 2, 1), (2, 1, 4, 4, 8, 1, 1)]


def _moe_check(formats, m1: bool, products=("gate/up", "down")):
    """A check for _best: the MoE ``products`` (gate/up fused, and down) on Qwen3-30B-A3B's expert shapes for every
    format that shares the entry, against float64 references. ``m1``: pairs without token ids (the m1 kernel's
    route for K-quants), else with them (the generic kernel's). The tensor-core path (route.moe_tc) is kept out, so
    that the check runs the kernel being tuned."""
    from ..qgemv.moe import moe_gate_up_silu, moe_gemv
    from ..quant import quantize
    from ..testing import moe_gate_up_silu_ref, moe_gemv_ref

    E, P, H, F = 16, 8, 2048, 768
    g = torch.Generator(device="cuda").manual_seed(1)
    e = torch.randint(0, E, (P,), device="cuda", generator=g).to(torch.int32)
    tok = None if m1 else (torch.arange(P, device="cuda", dtype=torch.int32) % 3)
    x = torch.randn(P if m1 else 3, H, device="cuda", dtype=torch.bfloat16, generator=g)
    h = torch.randn(P if m1 else 3, F, device="cuda", dtype=torch.bfloat16, generator=g)
    cases = []
    for f in formats:
        gate, up, down = (quantize(torch.randn(E * n, kk, device="cuda", generator=g) * 0.05, f)
                          for n, kk in ((F, H), (F, H), (H, F)))
        if "gate/up" in products:
            cases.append((lambda gate=gate, up=up: moe_gate_up_silu(x, gate, up, E, e, tok),
                          lambda gate=gate, up=up: moe_gate_up_silu_ref(x, gate, up, E, e, tok)))
        if "down" in products:
            cases.append((lambda down=down: moe_gemv(h, down, E, e, tok),
                          lambda down=down: moe_gemv_ref(h, down, E, e, tok)))
    return _excluding({"moe_tc"}, _close_check(cases, 2e-2))


def _excluding(kernels, check):
    from ..qgemv import route

    def run():
        with route.override(exclude=kernels):
            check()
    return run


def _moe_ffn_check(down_fmt: str):
    """A check for the tensor-core MoE entries: moe_ffn (q4_k gate and up, a ``down_fmt`` down padded as the engine
    pads it) on Qwen3-30B-A3B's expert shapes, 4 tokens x top 2 of 16 experts, the pairs forced onto the tensor
    cores, against float64 per-pair products."""
    from ..qgemv.moe import moe_ffn, moe_route
    from ..quant import quantize
    from ..quant.tensor import pad_rows
    from ..testing import moe_gate_up_silu_ref, moe_gemv_ref

    E, T, k, H, F = 16, 4, 2, 2048, 768
    g = torch.Generator(device="cuda").manual_seed(2)
    gate, up = (quantize(torch.randn(E * F, H, device="cuda", generator=g) * 0.05, "q4_k") for _ in range(2))
    down = quantize(torch.randn(E * H, F, device="cuda", generator=g) * 0.05, down_fmt)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    w, e = moe_route(torch.randn(T, E, device="cuda", generator=g), top_k=k)
    tok = torch.arange(T, device="cuda").repeat_interleave(k)

    def ref():
        h = moe_gate_up_silu_ref(x, gate, up, E, e.flatten(), tok).to(torch.bfloat16)
        return (moe_gemv_ref(h, down, E, e.flatten()).view(T, k, -1) * w.view(T, k, 1).double()).sum(1)

    padded = pad_rows(down)
    return _excluding({"moe_gemv", "moe_grouped"},
                      _close_check([(lambda: moe_ffn(x, w, e, gate, up, padded, E), ref)], 2e-2))


def tune_moe(gpu):
    """The generic per-pair MoE GEMV at batch 1 on Qwen3-30B-A3B's expert shapes (128 experts, top 8, hidden 2048,
    expert FFN 768): moe_ffn, each format family's entry timed on one format of it. (q4_k, q5_k and q6_k products run
    the m1 kernel, except gate/up fused in q5_k / q6_k: q5_k stands for the K-quants here.) Then the m1 kernel's
    and the tensor-core kernel's MoE entries (_tune_moe_tc)."""
    from ..qgemv.moe import moe_ffn, moe_gemv
    from ..quant.formats import GGUF_FORMATS
    from ..quant.tensor import pad_rows
    from ..testing.random_weights import random_qtensor

    E, k, H, F = 128, 8, 2048, 768
    out = {}
    g = torch.Generator().manual_seed(0)
    # six expert sets, so the timed reads (6 x 8 experts) overflow L2
    ids = [torch.randperm(E, generator=g)[:k].to(torch.int32).view(1, k).cuda() for _ in range(6)]
    w = torch.full((1, k), 1.0 / k, device="cuda")
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    for fmt in ("q5_k", "q8_0", "f16"):
        gate, up = (random_qtensor(fmt, E * F, H, "cuda") for _ in range(2))
        down = random_qtensor(fmt, E * H, F, "cuda")
        works = [[lambda e=e: moe_ffn(x, w, e, gate, up, down, E) for e in ids]]
        family = GGUF_FORMATS[fmt].family
        key = f"moe/{family}"
        # timed on one format, checked on every format of the family (the entry serves them all)
        same = [f for f in MOE_CHECK_FORMATS if GGUF_FORMATS[f].family == family]
        out[key] = _best("gemv", key, MOE_CANDIDATES, works, check=_moe_check(same, m1=False))
    # the m1 kernel's MoE builds: q4_k gate/up (GLU) and down, q6_k down (the Q4_K_M mix's more-bits layers)
    gate, up, down = (random_qtensor("q4_k", n, kk, "cuda") for n, kk in ((E * F, H), (E * F, H), (E * H, F)))
    out["moe_m1/q4_k"] = _best("gemv", "moe_m1/q4_k", MOE_M1_Q4K_CANDIDATES,
                               [[lambda e=e: moe_ffn(x, w, e, gate, up, down, E) for e in ids]],
                               check=_moe_check(["q4_k"], m1=True))
    down6 = random_qtensor("q6_k", E * H, F, "cuda")
    h = torch.randn(k, F, device="cuda", dtype=torch.bfloat16)
    out["moe_m1/q6_k"] = _best("gemv", "moe_m1/q6_k", Q6_M1_CANDIDATES,
                               [[lambda e=e: moe_gemv(h, down6, E, e.view(-1)) for e in ids]],
                               check=_moe_check(["q6_k"], m1=True, products=("down",)))
    out.update(_tune_moe_tc(E, k, H, F, gate, up, down, pad_rows(down6)))
    return out


# the tensor-core kernel's MoE configs (BLOCK_N, warps, stages, waves[, ahead, register cap]; waves unused)
MOE_TC_CANDIDATES = [(64, 4, 1, 1), (128, 4, 1, 1), (128, 8, 1, 1), (256, 8, 1, 1), (64, 4, 1, 1, 0, 128),
                     (128, 8, 1, 1, 0, 128)]


def _tune_moe_tc(E, k, H, F, gate, up, down, down6):
    """The tensor-core MoE entries (pairs grouped by expert): ``moe_tc/q4_k`` (gate and up in one grid) and the
    down products ``moe_tc/<format>/silu`` (silu(gate) * up formed as they load), moe_ffn timed at 16 and 64 tokens
    (128 and 512 pairs over the 128 experts), the other product at its current entry."""
    from ..qgemv.moe import moe_ffn

    g = torch.Generator().manual_seed(1)
    works = []
    for T in (16, 64):
        ids = [torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32).cuda()
               for _ in range(2)]
        w = torch.full((T, k), 1.0 / k, device="cuda")
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        works.append((x, w, ids))
    out = {}
    for key, dn, dfmt in (("moe_tc/q4_k", down, "q4_k"), ("moe_tc/q4_k/silu", down, "q4_k"),
                          ("moe_tc/q6_k/silu", down6, "q6_k")):
        out[key] = _best("gemv", key, MOE_TC_CANDIDATES,
                         [[lambda e=e, x=x, w=w, dn=dn: moe_ffn(x, w, e, gate, up, dn, E) for e in ids]
                          for x, w, ids in works],
                         check=_moe_ffn_check(dfmt))
    return out


TUNERS = {"prefill": tune_prefill, "decode": ("paged", tune_decode), "decode_few": ("paged", tune_decode_few),
          "gemv": tune_gemv, "gemv_m1": ("gemv", tune_gemv_m1),
          "gemv_lanes": ("gemv", tune_gemv_lanes),
          "gemv_i8": ("gemv", tune_gemv_i8), "moe": ("gemv", tune_moe),
          "prefill_fp8": ("prefill", tune_prefill_fp8)}


SUITES = ["prefill", "prefill_fp8", "decode", "decode_few", "gemv", "gemv_m1", "gemv_lanes", "gemv_i8", "moe"]


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="python -m llmkernels tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suites", nargs="*", metavar="SUITE", default=list(SUITES),
                   help=f"what to tune (default: all): {', '.join(SUITES)}")
    p.add_argument("--out", default=None,
                   help="folder for the JSON tables (default: the user tuning folder, $LLMKERNELS_TUNING_DIR or "
                        "~/.cache/llmkernels/tuning)")
    p.add_argument("--section", default=None,
                   help="table section to write (default: this GPU's exact name; e.g. sm90 for a family entry)")
    return p


def run(args) -> int:
    unknown = [t for t in args.suites if t not in TUNERS]
    if unknown:
        raise ValueError(f"unknown tuning suite {unknown[0]!r}: expected some of {', '.join(SUITES)}")
    if not torch.cuda.is_available():
        raise RuntimeError("tuning needs a CUDA GPU, and torch sees none")
    gpu = torch.cuda.get_device_name()
    section = args.section or gpu
    out = Path(args.out) if args.out else user_dir()
    out.mkdir(parents=True, exist_ok=True)
    for name in args.suites:
        t0 = time.time()
        table, fn = TUNERS[name] if isinstance(TUNERS[name], tuple) else (name, TUNERS[name])
        print(f"tuning {name} on {gpu}", flush=True)
        entries = fn(gpu)
        path = out / f"{table}.json"
        doc = json.loads(path.read_text()) if path.exists() else {}
        doc.setdefault(section, {}).update(entries)
        path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        clear_cache()
        print(f"wrote {path} [{section}] ({len(entries)} entries, {time.time() - t0:.0f} s)", flush=True)
    return 0


def main(argv=None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
