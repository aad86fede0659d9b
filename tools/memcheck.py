"""Every kernel once on small odd shapes, for ``compute-sanitizer --tool memcheck python tools/memcheck.py``
(``... memcheck.py moe`` for the MoE kernels alone, and so for the other parts the usage line names, ``codebook``
among them; ``... --target-processes all python tools/memcheck.py tp`` for tensor parallelism on 2 GPUs).

Shapes are chosen to hit the edges: lengths not multiple of any block, page size 1 and 3, groups of 7, empty
sequences, K-quant and MLX 3-bit rows, M = 1 and 7, split-K and split-KV.
"""
import torch

import llmkernels as lk


def ws_cases(dev="cuda", persist_only=False, rowsum=False):
    """The Gluon prefill kernel (sm_90) at every tuning candidate, overlapped and not, a program per tile and
    persistent (a grid of 3 programs, so each loops over many tiles; tiles in turn and claimed from a counter),
    bf16 and fp8 (V^T tiles, per-head descales): odd lengths, q_len != k_len, an empty sequence, group 7, LSE
    written. persist_only: the persistent candidates at head dim 128 alone (the quick part); rowsum: fp8 calls
    without an LSE too (the row sums on the tensor cores serve those), its keys permuted (PERM 1)."""
    from llmkernels.attention import prefill, prefill_ws
    from llmkernels.tuning import OVERRIDES

    if torch.cuda.get_device_capability() != (9, 0):
        return
    prefill.WS_MIN_WORK = 0
    prefill_ws.num_sms = lambda device=None: 3
    cq = torch.tensor([0, 13, 13, 50, 250], dtype=torch.int32, device=dev)
    ck = torch.tensor([0, 17, 20, 57, 190], dtype=torch.int32, device=dev)
    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float8_e4m3fn, "float8_e4m3fn"))[int(rowsum):]:
        fp8 = dtype == torch.float8_e4m3fn
        ds = dict(q_descale=torch.rand(14, device=dev) + 0.5, k_descale=0.5, v_descale=torch.rand(2, device=dev) + 0.5)
        for D in (128,) if persist_only else (64, 128, 256):
            q = torch.randn(250, 14, D, device=dev).to(dtype)
            k = torch.randn(190, 2, D, device=dev).to(dtype)
            cfgs = ((64, 2), (32, 3), (64, 2, 1), (64, 2, 1, 1)) if D == 256 else (
                (128, 2), (128, 3), (64, 3), (64, 4), (128, 2, 1), (128, 3, 1, 1), (128, 2, 1, 2), (128, 3, 0, 2))
            if fp8:
                cfgs = ((64, 2), (64, 3), (64, 2, 1), (128, 2, 0, 1)) if D == 256 else (
                    (128, 3), (128, 4), (256, 2), (128, 2, 1), (256, 2, 0, 1), (256, 2, 0, 2))
                if rowsum:  # the keys permuted too (PERM), in a program per tile and persistent
                    cfgs = ((128, 2, 0, 0, 1), (128, 2, 0, 2, 1)) if D == 256 else (
                        (256, 2, 0, 0, 1), (128, 2, 0, 1, 1), (128, 2, 0, 2, 1), (256, 2, 0, 1, 1))
            for cfg in cfgs:
                if persist_only and (len(cfg) < 4 or not cfg[3]):
                    continue
                for causal in (False, True):
                    OVERRIDES[("prefill", f"{name}/{D}/{'causal' if causal else 'full'}/ws")] = list(cfg)
                    for return_lse in (True, False) if rowsum else (True,):  # the row sums serve calls without
                        lk.flash_attn_varlen(q, k, k, cq, ck, 200, 133, causal=causal, return_lse=return_lse,
                                             **(ds if fp8 else {}))
    for key in [k for k in OVERRIDES if k[1].endswith("/ws")]:
        del OVERRIDES[key]


def _paged_cache(lens, ps, Hkv, D, kv, dev):
    """Random K/V caches of dtype kv with consecutive pages per sequence, two spare pages and two spare page-table
    columns: (k_cache, v_cache, page_table, seq_lens)."""
    npg = [-(-L // ps) for L in lens]
    kc = torch.randn(sum(npg) + 2, ps, Hkv, D, device=dev, dtype=torch.bfloat16).to(kv)
    vc = torch.randn_like(kc, dtype=torch.bfloat16).to(kv)
    pt = torch.zeros(len(lens), max(npg) + 2, dtype=torch.int32, device=dev)
    off = 0
    for b, n in enumerate(npg):
        pt[b, :n] = torch.arange(off, off + n, device=dev)
        off += n
    return kc, vc, pt, torch.tensor(lens, dtype=torch.int32, device=dev)


def ws_decode_cases(dev="cuda"):
    """The Gluon decode kernel (sm_90): odd lengths, pages 8 / 16 / 32 / 64 / 128 (TMA) and 1 / 3 (rows gathered
    with cp.async), split and not, groups 7, 8 and 12 (8 and 16 padded heads), bf16 and fp8 caches (the fp8 dots and
    the converter partition; one and two consumer warp groups), the balanced split, head dim 256, soft caps and
    left windows."""
    from llmkernels.attention import schedule

    if torch.cuda.get_device_capability() != (9, 0):
        return
    from llmkernels.attention import paged_ws

    shipped = schedule.FP8_CONSUMERS
    for n in (2, 1):
        schedule.FP8_CONSUMERS = n
        _ws_decode_cases(dev, fp8_only=n != shipped)
    schedule.FP8_CONSUMERS = shipped
    # the loader's other orders of a 16-bit cache's copies (paged_ws's LEAD) and ring depths
    lead, stages = paged_ws.KV_LEAD, paged_ws.STAGES_LEAD
    for paged_ws.KV_LEAD, paged_ws.STAGES_LEAD in ((-1, stages), (2, 3), (1, 4)):
        _ws_decode_cases(dev, bf16_only=True)
    paged_ws.KV_LEAD, paged_ws.STAGES_LEAD = lead, stages


def _decode_inputs(lens, ps, Hq, Hkv, D, kv, splits, dev):
    """One query per sequence over random caches (_paged_cache) and its plan: (q, caches, tables, plan)."""
    kc, vc, pt, sl = _paged_cache(lens, ps, Hkv, D, kv, dev)
    cq = torch.arange(len(lens) + 1, dtype=torch.int32, device=dev)
    q = torch.randn(len(lens), Hq, D, device=dev, dtype=torch.bfloat16)
    plan = lk.plan_paged_attention(cq.cpu(), sl.cpu(), ps, Hq, Hkv, D, q_dtype=q.dtype, kv_dtype=kc.dtype,
                                   num_splits=splits, device=dev)
    assert plan.ws_decode
    return q, kc, vc, pt, sl, cq, plan


def _ws_decode_cases(dev, fp8_only=False, bf16_only=False):
    from llmkernels.attention import plan as plan_mod

    plan_mod.WS_DECODE_MIN_BYTES = 0
    for ps, Hq, Hkv, D, splits, kv in ((16, 28, 4, 128, 0, torch.bfloat16), (8, 8, 1, 128, 1, torch.bfloat16),
                                       (128, 16, 2, 64, 3, torch.bfloat16), (16, 28, 4, 128, 0, torch.float8_e4m3fn),
                                       (64, 16, 2, 64, 2, torch.float8_e5m2), (8, 8, 1, 128, 1, torch.float8_e4m3fn),
                                       (32, 24, 2, 128, 0, torch.float8_e4m3fn), (16, 24, 2, 64, 2, torch.bfloat16),
                                       # page sizes gathered by rows (cp.async)
                                       (1, 32, 8, 128, 0, torch.bfloat16), (3, 28, 4, 64, 2, torch.float8_e4m3fn),
                                       (1, 16, 2, 128, 0, torch.float8_e5m2)):
        if (fp8_only and kv == torch.bfloat16) or (bf16_only and kv != torch.bfloat16):
            continue
        q, kc, vc, pt, sl, cq, plan = _decode_inputs([1, 17, 300, 65, 1000], ps, Hq, Hkv, D, kv, splits, dev)
        sc = dict(k_scale=0.5, v_scale=torch.tensor([2.0], device=dev)) if kv != torch.bfloat16 else {}
        lk.paged_attention(q, kc, vc, pt, sl, cq, 1, plan=plan, **sc)
        if splits == 0:  # the balanced split too
            plan_mod.BALANCE_MIN_SKEW = 0.0
            plan = lk.plan_paged_attention(cq.cpu(), sl.cpu(), ps, Hq, Hkv, D, q_dtype=q.dtype, kv_dtype=kc.dtype,
                                           device=dev)
            assert plan.balanced
            lk.paged_attention(q, kc, vc, pt, sl, cq, 1, plan=plan, **sc)
            plan_mod.BALANCE_MIN_SKEW = 1.25
    # many units per program (the consumer loads each next unit's q and lengths ahead), empty second splits
    lens = [(53 * i) % 611 + 1 for i in range(70)]
    for kv in (torch.bfloat16,) if bf16_only else (torch.bfloat16, torch.float8_e4m3fn):
        q, kc, vc, pt, sl, cq, plan = _decode_inputs(lens, 16, 28, 4, 128, kv, 2, dev)
        assert not plan.balanced
        sc = dict(k_scale=0.5, v_scale=2.0) if kv != torch.bfloat16 else {}
        lk.paged_attention(q, kc, vc, pt, sl, cq, 1, plan=plan, **sc)
    # head dim 256 (a ring of three slots), soft caps, left windows from inside a key tile, split or not
    for ps, Hq, Hkv, D, splits, kv, left, cap in ((16, 16, 8, 256, 0, torch.bfloat16, 100, 50.0),
                                                  (32, 16, 2, 256, 3, torch.bfloat16, -1, 30.0),
                                                  (16, 28, 4, 128, 2, torch.float8_e4m3fn, 77, 20.0)):
        if bf16_only and kv != torch.bfloat16:
            continue
        q, kc, vc, pt, sl, cq, plan = _decode_inputs([1, 17, 300, 65, 1000], ps, Hq, Hkv, D, kv, splits, dev)
        sc = dict(k_scale=0.5, v_scale=2.0) if kv != torch.bfloat16 else {}
        lk.paged_attention(q, kc, vc, pt, sl, cq, 1, plan=plan, window_size=(left, -1), softcap=cap, **sc)
    plan_mod.WS_DECODE_MIN_BYTES = 1 << 25


def ws_mixed_cases(dev="cuda"):
    """Mixed batches with the decode part on the Gluon kernel and the long tiles on the Triton kernel beside it (two
    streams; 16-bit caches with the Gluon kernel's register cap): odd lengths, bf16 and fp8, groups 4 and 7."""
    from llmkernels.attention import plan as plan_mod

    if torch.cuda.get_device_capability() != (9, 0):
        return
    plan_mod.WS_DECODE_MIN_BYTES = 0
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for ps, Hq, Hkv, kv in ((16, 32, 8, torch.bfloat16), (16, 32, 8, torch.float8_e4m3fn), (8, 28, 4, torch.bfloat16)):
        n_dec = -(-sms // Hkv)  # enough one-query sequences that the batch needs no split
        q_lens = [45, 131] + [1] * n_dec
        lens = [301, 4099] + [(389 * i) % 1700 + 1 for i in range(n_dec)]
        kc, vc, pt, sl = _paged_cache(lens, ps, Hkv, 128, kv, dev)
        cq = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(dev)
        q = torch.randn(int(cq[-1]), Hq, 128, device=dev, dtype=torch.bfloat16)
        plan = lk.plan_paged_attention(cq.cpu(), sl.cpu(), ps, Hq, Hkv, 128, q_dtype=q.dtype, kv_dtype=kc.dtype,
                                       device=dev)
        assert plan.ws_decode and plan.variant == "mixed", plan.describe()
        sc = dict(k_scale=0.5, v_scale=torch.tensor([2.0], device=dev)) if kv != torch.bfloat16 else {}
        lk.paged_attention(q, kc, vc, pt, sl, cq, max(q_lens), plan=plan, **sc)
    plan_mod.WS_DECODE_MIN_BYTES = 1 << 25


def m1_cases(dev="cuda"):
    """The batch-1 kernel with scales factored out (m1.py), every format it has: odd row counts, uneven K splits,
    split-K summed in the kernel or after it; q6_k (two threads per chunk at least) with its own configs."""
    from llmkernels.qgemv.m1 import M1_LAYOUTS, launch_m1

    for fmt in M1_LAYOUTS:
        qt = lk.quantize(torch.randn(37, 768, device=dev), fmt)
        configs = (((1, 1, 1, 1), 4), ((2, 2, 4, 3), 132), ((4, 1, 4, 3), 7))
        if fmt == "q6_k":
            configs = (((1, 1, 1, 1, 1, 2), 4), ((2, 1, 4, 3, 2, 4, 1), 132), ((4, 1, 4, 3, 4, 2, 1), 7))
        for config, sms in configs:
            for M, fixup in ((1, True), (3, True), (2, False)):
                launch_m1(torch.randn(M, 768, device=dev, dtype=torch.float16), qt.data, fmt, 37, 768, config, sms,
                          2, fixup=fixup)
    for fmt in ("q5_k", "q6_k"):  # both activation dtypes through gemv (M up to M1_MAX_M), silu fused
        qt = lk.quantize(torch.randn(77, 1280, device=dev), fmt)
        for M, dt in ((1, torch.bfloat16), (2, torch.float16), (4, torch.bfloat16)):
            lk.gemv(torch.randn(M, 1280, device=dev, dtype=dt), qt)
            lk.silu_mul_gemv(torch.randn(M, 1280, device=dev, dtype=dt), torch.randn(M, 1280, device=dev, dtype=dt),
                             qt)


def i8_lanes_cases(dev="cuda"):
    """The q4_k, q5_k and q6_k int8 lane kernels (int8.gemv_i8_lanes_kernel, gemv_i8_q6_kernel) and their
    producers: one block (lanes past it masked), ragged last steps, K splits summed in the kernel or after it, rows
    past N; the rounding kernel and the fused RMSNorm writing i8 lane order on partial groups."""
    from llmkernels.engine.kernels import add_rmsnorm
    from llmkernels.qgemv.int8 import launch_i8_lanes, quantize_act

    for fmt in ("q4_k", "q5_k"):
        for K in (256, 1792, 2304, 4096):
            qt = lk.quantize(torch.randn(37, K, device=dev), fmt)
            q, ds = quantize_act(torch.randn(1, K, device=dev, dtype=torch.bfloat16), lanes=True)
            for config, sms in (((1, 1, 1, 1), 4), ((2, 2, 1, 1), 132), ((1, 4, 2, 1), 7), ((2, 4, 4, 1), 1)):
                for fixup in (True, False):
                    launch_i8_lanes(q, ds, qt.data, 37, K, config, sms, True, torch.float16, fixup=fixup, pdl=True,
                                    fmt=fmt)
            lk.gemv(torch.randn(1, K, device=dev, dtype=torch.float16), qt, act_int8=True)
            lk.silu_mul_gemv(torch.randn(1, K, device=dev, dtype=torch.bfloat16),
                             torch.randn(1, K, device=dev, dtype=torch.bfloat16), qt, act_int8=True)
    quantize_act(torch.randn(2, 1120, device=dev, dtype=torch.float16), lanes=True)
    x = torch.randn(3, 1056, device=dev, dtype=torch.bfloat16)
    add_rmsnorm(x, torch.randn(1056, device=dev), 1e-5, residual=torch.randn_like(x), i8=True)
    # q6_k (int8.gemv_i8_q6_kernel): 1 to 3 steps, KT 2 / 4, rows past N, K splits in and after the kernel
    for K in (2048, 6144):
        qt = lk.quantize(torch.randn(37, K, device=dev), "q6_k")
        q, ds = quantize_act(torch.randn(1, K, device=dev, dtype=torch.bfloat16), lanes=True)
        for config, sms in (((1, 1, 1, 1, 2), 4), ((2, 2, 1, 1, 2), 132), ((1, 4, 2, 1, 4), 7),
                            ((2, 4, 4, 1, 4), 1), ((1, 1, 4, 1, 4), 132)):
            for fixup in (True, False):
                launch_i8_lanes(q, ds, qt.data, 37, K, config, sms, True, torch.float16, fixup=fixup, pdl=True,
                                fmt="q6_k")
        lk.gemv(torch.randn(1, K, device=dev, dtype=torch.float16), qt, act_int8=True)
        lk.silu_mul_gemv(torch.randn(1, K, device=dev, dtype=torch.bfloat16),
                         torch.randn(1, K, device=dev, dtype=torch.bfloat16), qt, act_int8=True)


def tc_cases(dev="cuda"):
    """The tensor-core kernel (tc.py): rows past the tile, uneven K splits, both activation dtypes; q4_k, q5_k, q6_k,
    q4_0, q8_0 and MLX 4-bit at each group size; partials summed by the split-K sum kernel (ops._finish) where the
    grid exceeds its waves."""
    from llmkernels.qgemv.ops import _finish
    from llmkernels.qgemv.tc import launch_tc, tc_order

    for fmt in ("q4_k", "q4_0", "q8_0"):
        qt = lk.quantize(torch.randn(77, 768, device=dev), fmt)
        cases = ((5, (128, 4, 1, 2), 132), (16, (64, 4, 1, 4), 7), (9, (128, 8, 1, 2), 1), (40, (64, 4, 1, 4), 7),
                 (3, (64, 4, 2, 2), 5))
        if fmt != "q4_k":  # the next step's weights loaded ahead, past the last row's end masked
            cases += ((1, (64, 4, 1, 2, 1), 132), (2, (128, 8, 1, 2, 1), 1), (7, (64, 4, 1, 4, 1), 5))
        for dt in (torch.float16, torch.bfloat16):
            for M, config, sms in cases:
                _finish(launch_tc(torch.randn(M, 768, device=dev, dtype=dt), qt.data, 77, 768, config, sms, 2,
                                  fmt=fmt), dt)
            lk.gemv(torch.randn(2, 768, device=dev, dtype=dt), qt)
            for M in (1, 5):  # silu_mul_gemv: silu(x) * x2 formed in the kernel's x loads
                lk.silu_mul_gemv(torch.randn(M, 768, device=dev, dtype=dt), torch.randn(M, 768, device=dev, dtype=dt),
                                 qt)
    for fmt, K in (("q5_k", 768), ("q6_k", 2048)):  # q6_k: blocks at every offset mod 16, the last row's end
        qt = lk.quantize(torch.randn(77, K, device=dev), fmt)
        for dt in (torch.float16, torch.bfloat16):
            for M, config, sms in ((1, (64, 4, 1, 4), 132), (5, (128, 4, 1, 2), 132), (16, (64, 4, 1, 4), 7),
                                   (40, (64, 4, 1, 4), 7), (3, (64, 4, 2, 2), 5)):
                _finish(launch_tc(torch.randn(M, K, device=dev, dtype=dt), qt.data, 77, K, config, sms, 2, fmt=fmt), dt)
            lk.silu_mul_gemv(torch.randn(5, K, device=dev, dtype=dt), torch.randn(5, K, device=dev, dtype=dt), qt)
    for gs in (32, 64, 128):
        qt = lk.quantize(torch.randn(77, 768, device=dev), "mlx", bits=4, group_size=gs)
        for M, config, sms in ((5, (128, 4, 1, 2), 132), (40, (64, 4, 1, 4), 7), (3, (64, 4, 2, 2), 5),
                               (1, (64, 4, 1, 4), 132)):
            launch_tc(torch.randn(M, 768, device=dev, dtype=torch.bfloat16), qt.data, 77, 768, config, sms, 2,
                      qt.scales, qt.biases, gs)
    # x in k order by TMA (XT): 32- and 64-row programs with padding rows, two program rows in M, splits
    for fmt, K in (("q4_k", 768), ("q5_k", 768), ("q6_k", 2048), ("q4_0", 768), ("q8_0", 768), ("mlx", 768)):
        kw = dict(bits=4, group_size=64) if fmt == "mlx" else {}
        qt = lk.quantize(torch.randn(77, K, device=dev), fmt, **kw)
        args = dict(scales=qt.scales, biases=qt.biases, group_size=qt.group_size or 0, fmt=fmt)
        for M, config, sms in ((17, (64, 4, 1, 4), 7), (40, (128, 4, 1, 2), 132), (70, (64, 4, 1, 2), 5),
                               (64, (64, 8, 1, 4), 1)):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            _finish(launch_tc(x, qt.data, 77, K, config, sms, 2, xt=tc_order(x, fmt), **args), x.dtype)
        lk.gemv(torch.randn(33, K, device=dev, dtype=torch.float16), qt)


def codebook_cases(dev="cuda"):
    """iq4_nl and mxfp4 on the tensor cores: K = 352 and 2880 (a partial last step) and 512 on rows padded to 16 bytes,
    iq4_xs at K = 768 (padded) and 1024; 77 rows, uneven splits, both dtypes; the last row's last vectors end at its
    padded stride. Then their expert
    stacks at one token (each expert a block of its own, K split) and at 11 tokens, padded as the engine pads them,
    gate and up in one launch too."""
    from llmkernels.qgemv.moe import moe_pairs, moe_route
    from llmkernels.qgemv.ops import _finish
    from llmkernels.qgemv.tc import launch_tc
    from llmkernels.quant.tensor import pad_rows

    for fmt in ("iq4_nl", "mxfp4", "iq4_xs"):
        for K in ((352, 512, 2880) if fmt != "iq4_xs" else (768, 1024)):
            qt = pad_rows(lk.quantize(torch.randn(77, K, device=dev), fmt))
            for dt in (torch.float16, torch.bfloat16):
                for M, config, sms in ((1, (64, 4, 1, 4), 132), (5, (128, 4, 1, 2), 132), (16, (64, 4, 1, 4), 7),
                                       (40, (64, 4, 1, 4), 7), (3, (64, 4, 2, 2), 5)):
                    _finish(launch_tc(torch.randn(M, K, device=dev, dtype=dt), qt.data, 77, K, config, sms, 2,
                                      fmt=fmt), dt)
                lk.gemv(torch.randn(2, K, device=dev, dtype=dt), qt)
        E = 5
        for K in ((352, 2880) if fmt != "iq4_xs" else (768, 2816)):  # one token's small grid splits K at 2880 / 2816
            g = pad_rows(lk.quantize(torch.randn(E, 37, K, device=dev), fmt))
            for T in (1, 11):
                x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
                _, ex = moe_route(torch.randn(T, E, device=dev), top_k=2)
                moe_pairs(x, g, E, ex.flatten(), 2)
                moe_pairs(x, g, E, ex.flatten(), 2, up=g)


def tp_cases():
    """Tensor parallelism on 2 GPUs, both all-reduces, decode graphs and a prompt chunk: a small q4_k_m llama split
    in two (run ``compute-sanitizer --target-processes all python tools/memcheck.py tp``)."""
    import os
    import tempfile

    from llmkernels.bench.suites.families import write_family_gguf
    from llmkernels.engine import LLM, SamplingParams

    spec = dict(arch="llama", layers=3, hidden=1024, ffn=3072, heads=8, kv_heads=2, head_dim=128, vocab=1000,
                meta={"rope.freq_base": 10000.0, "attention.layer_norm_rms_epsilon": 1e-5, "context_length": 2048})
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tp.gguf")
        write_family_gguf(path, "small-llama", "q4_k_m", spec=spec, vocab=True)
        for mode in ("nccl", "symm"):
            os.environ["LLMK_ALLREDUCE"] = mode
            with LLM(path, tensor_parallel_size=2, max_num_batched_tokens=64, max_graph_batch=4,
                     progress=False) as llm:
                params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
                llm.generate([list(range(3, 40)), list(range(7, 90)), [5]], params)
                llm.generate([list(range(3, 300))], params)


def moe_cases(dev="cuda"):
    """The MoE GEMV, the grouped kernel and the tensor-core one (each path forced): 5 experts of 37 rows, 3 tokens x top 3 with an
    expert nobody picks, a lone pair, [E, N, K] stacks, and the whole FFN on the router's output (3 and 11 tokens)."""
    from llmkernels.qgemv import route
    from llmkernels.qgemv.moe import moe_ffn, moe_gate_up_silu, moe_gemv, moe_route
    from llmkernels.quant.tensor import pad_rows

    E, N, K = 5, 37, 512
    for path in route.MOE_KERNELS:
        with route.override(exclude=set(route.MOE_KERNELS) - {path}):
            for fmt, kw in (("q4_k", {}), ("q6_k", {}), ("q8_0", {}), ("q5_1", {}),
                            ("mlx", dict(bits=3, group_size=32)), ("mlx", dict(bits=4, group_size=64))):
                qt = lk.quantize(torch.randn(E * N, K, device=dev), fmt, **kw)
                x = torch.randn(3, K, device=dev, dtype=torch.bfloat16)
                e = torch.tensor([4, 0, 1, 3, 0, 4, 1, 3, 0], dtype=torch.int32, device=dev)
                t = torch.arange(3, dtype=torch.int32, device=dev).repeat_interleave(3)
                moe_gemv(x, qt, E, e, t)
                moe_gemv(x, qt, E, e[5:6], t[5:6])
                moe_gate_up_silu(x, qt, qt, E, e, t)
                if fmt != "mlx":
                    g = lk.quantize(torch.randn(E, 256, K, device=dev), fmt)
                    d = pad_rows(lk.quantize(torch.randn(E, K, 256, device=dev), fmt))  # q6_k: as the engine
                    for T in (3, 11):
                        xt = torch.randn(T, K, device=dev, dtype=torch.float16)
                        w, ex = moe_route(torch.randn(T, E, device=dev), top_k=3)
                        moe_ffn(xt, w, ex, g, g, d, E)


def gemv_cases(dev="cuda"):
    """Every weight format through gemv (M = 1, 7, 70), silu_mul_gemv, gate_up_silu and embedding on 37 x 512."""
    for fmt, kw in (("q4_0", {}), ("q5_1", {}), ("q3_k", {}), ("q5_k", {}), ("q6_k", {}), ("bf16", {}),
                    ("iq4_nl", {}), ("iq4_xs", {}), ("mxfp4", {}),
                    ("mlx", dict(bits=3, group_size=32)), ("mlx", dict(bits=6, group_size=128))):
        qt = lk.quantize(torch.randn(37, 512, device=dev), fmt, **kw)
        for M in (1, 7, 70):
            lk.gemv(torch.randn(M, 512, device=dev, dtype=torch.bfloat16), qt)
        lk.silu_mul_gemv(torch.randn(2, 512, device=dev, dtype=torch.float16),
                         torch.randn(2, 512, device=dev, dtype=torch.float16), qt)
        lk.gate_up_silu(torch.randn(3, 512, device=dev, dtype=torch.float16), qt, qt)
        lk.embedding(torch.tensor([36, 0, 5], device=dev), qt)


def main():
    dev = "cuda"
    torch.manual_seed(0)
    for D in (64, 80, 256):
        cq = torch.tensor([0, 13, 13, 50], dtype=torch.int32, device=dev)
        ck = torch.tensor([0, 17, 20, 57], dtype=torch.int32, device=dev)
        q = torch.randn(50, 14, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(57, 2, D, device=dev, dtype=torch.bfloat16)
        lk.flash_attn_varlen(q, k, k, cq, ck, 37, 37, causal=True, window_size=(5, -1), softcap=10.0,
                             sinks=torch.randn(14, device=dev), return_lse=True)
        lk.flash_attn_varlen(q, k, k, cq, ck, 37, 37)
    for D in (64, 96, 128, 256):  # lengths spanning several key blocks: the unmasked loop runs (TMA at D=256)
        cq = torch.tensor([0, 200, 201, 330], dtype=torch.int32, device=dev)
        q = torch.randn(330, 6, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(330, 3, D, device=dev, dtype=torch.bfloat16)
        for causal in (False, True):
            lk.flash_attn_varlen(q, k, k, cq, cq, 200, 200, causal=causal)
    ws_cases()
    ws_decode_cases()
    ws_mixed_cases()
    q8 = torch.randn(250, 14, 64, device=dev).to(torch.float8_e4m3fn)  # fp8 prefill, odd lengths
    k8 = torch.randn(190, 2, 64, device=dev).to(torch.float8_e4m3fn)
    for causal in (False, True):
        lk.flash_attn_varlen(q8, k8, k8, torch.tensor([0, 13, 13, 50, 250], dtype=torch.int32, device=dev),
                             torch.tensor([0, 17, 20, 57, 190], dtype=torch.int32, device=dev), 200, 133,
                             causal=causal, return_lse=True, q_descale=0.5, k_descale=2.0, v_descale=3.0)
    for ps, kv in ((1, torch.bfloat16), (3, torch.bfloat16), (16, torch.float8_e4m3fn), (3, torch.float8_e4m3fn),
                   (1, torch.float8_e5m2)):
        lens = [5, 33, 1]
        qlens = [1, 9, 1]
        pages = [-(-L // ps) for L in lens]
        kc = torch.randn(sum(pages) + 2, ps, 2, 128, device=dev).to(kv)
        vc = torch.randn_like(kc.float()).to(kv)
        pt = torch.zeros(3, max(pages), dtype=torch.int32, device=dev)
        off = 0
        for b, n in enumerate(pages):
            pt[b, :n] = torch.arange(off, off + n, device=dev)
            off += n
        sl = torch.tensor(lens, dtype=torch.int32, device=dev)
        cu = torch.tensor([0] + qlens).cumsum(0).to(torch.int32).to(dev)
        q = torch.randn(int(cu[-1]), 14, 128, device=dev, dtype=torch.bfloat16)
        scales = dict(k_scale=0.5, v_scale=0.5) if kv != torch.bfloat16 else {}
        for splits in (1, 3):
            lk.paged_attention(q, kc, vc, pt, sl, cu, 9, num_splits=splits, return_lse=True, **scales)
        mask = torch.ones(int(cu[-1]), 9, dtype=torch.bool, device=dev)
        lk.paged_attention(q, kc, vc, pt, sl, cu, 9, custom_mask=mask, sinks=torch.randn(14, device=dev), **scales)
        knew = torch.randn(3, 2, 128, device=dev, dtype=torch.bfloat16)
        lk.store_kv(knew, knew, kc, vc, torch.tensor([0, -1, kc.shape[0] * ps - 1], device=dev), **scales)
    gemv_cases(dev)
    m1_cases(dev)
    moe_cases(dev)
    # q4_k with activations in lane order: a partial last group (K = 2304, 4352), split-K or not, the public copy path
    from llmkernels._runtime import gpu_name
    from llmkernels.qgemv import route
    from llmkernels.qgemv.m1 import lane_order, launch_m1

    for N, K in ((77, 2304), (5, 4352)):
        qt = lk.quantize(torch.randn(N, K, device=dev), "q4_k")
        for dt in (torch.float16, torch.bfloat16):
            x = torch.randn(1, K, device=dev, dtype=dt)
            for config, sms, fixup in (((1, 1, 1, 1, 8), 132, True), ((2, 1, 2, 3, 8, 1, 1), 4, False)):
                launch_m1(lane_order(x), qt.data, "q4_k", N, K, config, sms, 2, fixup=fixup, x_perm=True)
            with route.override(lambda q, r: route.Route("lanes", route.lanes_config(route.Target(gpu_name()), q.N,
                                                                                     False), lane_copy=True)):
                lk.gemv(x, qt)
    # GLU (silu(x G^T) * (x U^T), a gate and an up row per thread): odd N, M = 1..4, x natural or in lane order
    g, u = (lk.quantize(torch.randn(37, 768, device=dev), "q4_k") for _ in range(2))
    for config in ((2, 1, 1, 1), (4, 1, 4, 3, 4, 2)):
        for M in (1, 3, 4):
            launch_m1(torch.randn(M, 768, device=dev, dtype=torch.float16), g.data, "q4_k", 37, 768, config, 132, 2,
                      up=u.data)
    g, u = (lk.quantize(torch.randn(77, 2304, device=dev), "q4_k") for _ in range(2))
    x = torch.randn(1, 2304, device=dev, dtype=torch.bfloat16)
    launch_m1(lane_order(x), g.data, "q4_k", 77, 2304, (2, 1, 2, 3, 8, 1, 1), 132, 2, up=u.data, x_perm=True)
    for bits, gs, K in ((4, 64, 768), (4, 32, 96), (8, 128, 640), (4, 128, 384)):  # MLX: 4/2/1 groups per block
        qt = lk.quantize(torch.randn(37, K, device=dev), "mlx", bits=bits, group_size=gs)
        for config, sms in (((1, 1, 1, 1), 4), ((2, 2, 4, 3), 132), ((4, 1, 4, 3), 7)):
            for dt in (torch.float16, torch.bfloat16):
                launch_m1(torch.randn(2, K, device=dev, dtype=dt), qt.data, "mlx", 37, K, config, sms, 2,
                          scales=qt.scales, biases=qt.biases, bits=bits, group_size=gs)
    # int8 activations (int8.py): the rounding kernel on a partial block range, the dp4a kernel on every format,
    # one to four rows per thread, odd rows, split or not, several activation rows per program, coalesced and
    # prefetched weight loads
    from llmkernels.qgemv.int8 import launch_i8, quantize_act

    for fmt in ("q4_0", "q8_0", "q4_k"):
        qt = lk.quantize(torch.randn(37, 768, device=dev), fmt)
        for config, sms in (((1, 1, 1, 1), 4), ((2, 8, 4, 3), 132), ((4, 2, 2, 3), 7), ((2, 4, 4, 3), 1),
                            ((1, 1, 1, 1, 1, 1), 4), ((2, 4, 4, 3, 1, 1), 1), ((1, 4, 4, 3, 0, 1), 132)):
            for M, fixup, rpp in ((1, True, 2), (3, True, 2), (2, False, 2), (5, True, 4)):
                q, ds = quantize_act(torch.randn(M, 768, device=dev, dtype=torch.bfloat16))
                launch_i8(q, ds, qt.data, fmt, 37, 768, config, sms, True, torch.float16, fixup=fixup,
                          rows_per_program=rpp)
    quantize_act(torch.randn(3, 1120, device=dev, dtype=torch.float16),
                 torch.randn(3, 1120, device=dev, dtype=torch.float16))
    lk.gemv(torch.randn(2, 768, device=dev, dtype=torch.float16), lk.quantize(torch.randn(37, 768, device=dev),
                                                                               "q4_k"), act_int8=True)
    i8_lanes_cases(dev)
    tc_cases(dev)
    codebook_cases(dev)
    engine_kernel_cases(dev)
    megakernel_cases(dev)


def engine_kernel_cases(dev="cuda"):
    """The engine's kernels: add + RMSNorm on an odd width (with a post-norm, lanes), SiLU / GeGLU, gpt-oss's
    clamped SwiGLU and pair products, RoPE + KV store with bias, QK-norm, skipped slots, fp8, V apart."""
    from llmkernels.engine.kernels import add_rmsnorm, rope_store, silu_mul, swiglu_oai
    from llmkernels.qgemv.moe import moe_pairs

    silu_mul(torch.randn(3, 2 * 1100, device=dev, dtype=torch.bfloat16))
    g = torch.randn(5, 1100, device=dev, dtype=torch.bfloat16)  # gpt-oss's experts: 5 pairs over 3 experts
    ex = torch.tensor([2, 0, 1, 2, 0], dtype=torch.int32, device=dev)
    swiglu_oai(g, torch.randn_like(g), ex, torch.randn(3, 1100, device=dev), torch.randn(3, 1100, device=dev))
    moe_pairs(torch.randn(3, 512, device=dev, dtype=torch.bfloat16),
              lk.quantize(torch.randn(3 * 37, 512, device=dev), "mxfp4"), 3, ex[:3].repeat_interleave(2)[:6], 2)
    silu_mul(torch.randn(1, 2 * 1100, device=dev, dtype=torch.bfloat16), lanes=True, act="gelu_tanh")

    x = torch.randn(7, 1000, device=dev, dtype=torch.bfloat16)
    add_rmsnorm(x, torch.randn(1000, device=dev), 1e-5, residual=torch.randn_like(x))
    add_rmsnorm(x, torch.randn(1000, device=dev), 1e-5, lanes=True)
    add_rmsnorm(x, torch.randn(1000, device=dev), 1e-5, residual=torch.randn_like(x),
                pre_weight=torch.randn(1000, device=dev))
    for kv, neox in ((torch.bfloat16, True), (torch.float8_e4m3fn, False)):
        T, Hq, Hkv, D = 5, 6, 2, 64
        qkv = torch.randn(T, (Hq + 2 * Hkv) * D, device=dev, dtype=torch.bfloat16)
        kc = torch.zeros(3, 4, Hkv, D, device=dev).to(kv)
        slots = torch.tensor([0, 11, -1, 5, 6], device=dev)
        rope_store(qkv, torch.arange(T, dtype=torch.int32, device=dev), slots, torch.rand(D // 2, device=dev), kc,
                   kc.clone(), n_heads=Hq, n_kv_heads=Hkv, neox=neox, bias=torch.randn(qkv.shape[1], device=dev),
                   q_norm=torch.randn(D, device=dev), k_norm=torch.randn(D, device=dev))
        # V apart from q and k (a q6_k V beside a q/k stack): exact-size buffers, so a read past either shows
        rope_store(qkv[:, :(Hq + Hkv) * D].contiguous(), torch.arange(T, dtype=torch.int32, device=dev), slots,
                   torch.rand(D // 2, device=dev), kc, kc.clone(), n_heads=Hq, n_kv_heads=Hkv, neox=neox,
                   v=qkv[:, (Hq + Hkv) * D:].contiguous())
    torch.cuda.synchronize()
    print("memcheck script finished")


def megakernel_cases(dev="cuda"):
    """The one-kernel decode step (Gluon, sm_90) on a tiny llama, 5 steps each: bf16 and q4_k, 4, 8 and 16 compute
    warps, batch 1 and bf16 at batch 3, 5 and 8 (tensor and CUDA cores), 2 and 3 key splits, each way the loader
    holds its stream (fast.FastStep's hold), programs
    for 7 SMs and for all of them, scattered pages, short splits and splits of several blocks of keys (bf16 through
    ATTN's cp.async ring of 2 and 3 blocks, and through registers), the token and error flag written into pinned
    host memory."""
    if torch.cuda.get_device_capability() != (9, 0):
        return
    import tempfile

    from llmkernels.engine import ModelConfig, convert_hf_to_gguf
    from llmkernels.engine.config import rope_inv_freq
    from llmkernels.megakernel import build_decode_program
    from llmkernels.megakernel.fast import FastStep
    from llmkernels.quant import read_gguf
    from llmkernels.testing.tiny_models import make_checkpoint

    d = tempfile.mkdtemp()
    make_checkpoint(d, "llama", hidden=512, ffn=1024, heads=8, kv_heads=2, head_dim=64)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    files = {}
    cases = (("bf16", 4, 2, 7, {}, 0), ("bf16", 4, 3, sms, dict(hold=0), 0), ("bf16", 4, 2, sms, dict(hold=3), 0),
             ("q4_k", 8, 3, 7, {}, 0), ("q4_k", 8, 2, sms, dict(hold=2), 0),
             # splits of several blocks of 32 keys
             ("bf16", 4, 2, 7, {}, 203), ("bf16", 8, 3, sms, {}, 203), ("q4_k", 8, 2, sms, {}, 203),
             ("bf16", 4, 3, sms, dict(kv_ring=3), 203), ("bf16", 4, 2, 7, dict(kv_ring=0), 203),
             # 16 compute warps (q4_k slots in pairs, a filler slot after odd rows)
             ("q4_k", 16, 2, sms, {}, 0), ("q4_k", 16, 3, 7, {}, 203),
             # batch 3 and 8: the tensor cores and the CUDA cores
             ("bf16", 4, 2, sms, dict(batch=3), 203), ("bf16", 4, 3, 7, dict(batch=8), 40),
             ("bf16", 8, 2, sms, dict(batch=3, batch_mma=False), 203),
             ("bf16", 4, 2, 7, dict(batch=5, batch_mma=False), 40))
    out = torch.zeros(3, dtype=torch.int64).pin_memory()
    for fmt, warps, splits, n_sms, opts, ctx in cases:
        opts = dict(opts)
        B = opts.pop("batch", 1)
        if fmt not in files:
            files[fmt] = read_gguf(convert_hf_to_gguf(d, f"{d}/model-{fmt}.gguf", fmt, progress=False))
        f = files[fmt]
        cfg = ModelConfig.from_gguf(f.metadata, f.keys())
        prog = build_decode_program(cfg, fmt, batch=B, context=max(16, ctx), num_sms=n_sms, num_splits=splits)
        # short: the GPU tests' page geometry (their compiled kernels are reused); long: pages of 16, the last
        # one partly used
        page, pages = (4, 4) if not ctx else (16, -(-(ctx + 5) // 16))
        kc = torch.zeros(cfg.n_layers, B * pages + 3, page, cfg.n_kv_heads, cfg.head_dim, dtype=torch.bfloat16,
                         device=dev)
        vc = torch.zeros_like(kc)
        table = torch.randperm(B * pages + 3)[:B * pages].view(B, pages).to(torch.int32).to(dev)
        inv, _ = rope_inv_freq(cfg)
        fast = FastStep.from_tensors(prog, cfg, f, kc, vc, inv.to(dev), warps=warps, spin_limit=1 << 30, **opts)
        for t in range(5):  # batch > 1: sequence b holds 3 b keys fewer
            args = (torch.full((B,), 3 + t, dtype=torch.int32, device=dev),
                    torch.tensor([max(1, ctx + 1 + t - 3 * b) for b in range(B)], dtype=torch.int32, device=dev),
                    table)
            if t % 2 and B == 1:
                fast.launch(*args, out=out)
            else:
                fast(*args)
    torch.cuda.synchronize()
    print("memcheck script finished")


if __name__ == "__main__":
    import sys

    # "tp": tensor parallelism alone (2 GPUs); "moe" / "prefill_ws" / "prefill_persist" / "prefill_rowsum" /
    # "decode_ws" / "engine" / "megakernel" / "gemv" / "codebook": those kernels alone; no argument: every
    # single-GPU kernel
    parts = {"": main, "tp": tp_cases, "moe": moe_cases, "prefill_ws": ws_cases,
             "prefill_persist": lambda: ws_cases(persist_only=True), "prefill_rowsum": lambda: ws_cases(rowsum=True),
             "decode_ws": ws_decode_cases, "engine": engine_kernel_cases, "megakernel": megakernel_cases,
             "gemv": gemv_cases, "codebook": codebook_cases}
    part = sys.argv[1] if len(sys.argv) > 1 else ""
    if part not in parts or len(sys.argv) > 2:
        sys.exit(f"usage: python tools/memcheck.py [tp | moe | prefill_ws | prefill_persist | prefill_rowsum | "
                 f"decode_ws | engine | megakernel | gemv | codebook], got {' '.join(sys.argv[1:])!r}")
    parts[part]()
