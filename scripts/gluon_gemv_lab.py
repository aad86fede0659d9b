"""Lab (not routed): q4_k GEMV for M <= 8 as a Gluon kernel on sm_90, measured against gemv in session 19.

A persistent grid (one program per SM) walks work units (BN-row tile, K split). A one-warp loader partition copies
each super-block step with TMA into a ring of STAGES slots: the code bytes [BN, 1, 4, 32] (a 4-D view that skips
the 16-byte headers), the headers [BN, 1, 1, 4] as int32 words, and x [8, 256] (rows past M read as zeros). The
consumer warps turn the codes into fp16/bf16 pairs with tc.py's PTX and multiply them with mma.sync m16n8k16, the
activation rows as N. The loads from shared memory use blocked layouts whose reshape / permute lands exactly on
the mma operand layouts (SASS: no shuffles or shared stores for the conversion): rows are relabelled (mma row
16 a + 8 h + g holds weight row 16 a + 2 g + h) and k is permuted (k = 16 j + 8 p + 2 t + ll holds weight
64 t + 32 p + 2 j + ll), x the same way. Split-K partials are summed by the last unit of each tile to arrive.

Why it is not routed (bench/NOTES.md, session 19): at M = 1 it is 5-7 us slower than the m1 kernel on the 9-66 MB
layer shapes and streams at 2.1 TB/s on the vocabulary shape against 2.28; at M = 8 it takes about the M = 1 time
(ratio 1.0) but beats the current tensor-core path by more than 5% only on the two largest shapes.

    PYTHONPATH=. python scripts/gluon_gemv_lab.py [RT/STAGES/warps[/pdl[/acc2[/waves[/defer[/ctas]]]]]],...] [M list]

pdl: 1 waits for the previous kernel first, 2 also issues the first steps' weight copies before waiting; acc2: two
mma accumulators; waves: K splits until tiles x splits reach waves x SMs (0: no split); defer: arrivals of all
units at the program's end; ctas: CTAs per SM (maxnreg set so they fit). DTS=fp16,bf16 picks the activation dtypes.
"""
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from llmkernels._pdl import pdl_trigger, pdl_wait
from llmkernels.qgemv.m1 import _q4k_scales
from llmkernels.qgemv.tc import _ASM_Q4_BF16, _ASM_Q4_F16


@gluon.jit
def _loader(desc_q, desc_h, desc_x, q_s, h_s, x_s, ready, empty, units, split, per_split,
            STAGES: gl.constexpr, PDL: gl.constexpr):
    BN: gl.constexpr = desc_q.block_type.shape[0]
    XB: gl.constexpr = desc_x.block_type.nbytes
    WB: gl.constexpr = desc_q.block_type.nbytes + desc_h.block_type.nbytes
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    total = gl.cdiv(units - pid, P) * per_split
    first = gl.minimum(total, STAGES)
    if PDL == 2:  # the first steps' weights before waiting for the previous kernel (they do not depend on it)
        for i in range(first):
            u = pid + (i // per_split) * P
            mbarrier.expect(ready.index(i), WB + XB)
            row0 = (u // split) * BN
            kb0 = (u % split) * per_split + i % per_split
            tma.async_copy_global_to_shared(desc_q, [row0, kb0, 0, 0], ready.index(i), q_s.index(i))
            tma.async_copy_global_to_shared(desc_h, [row0, kb0, 0, 0], ready.index(i), h_s.index(i))
    if PDL:
        pdl_wait(True)
    i = 0
    for u in range(pid, units, P):
        row0 = (u // split) * BN
        kb_lo = (u % split) * per_split
        for kb0 in range(kb_lo, kb_lo + per_split):
            s = i % STAGES
            if PDL == 2 and i < first:
                tma.async_copy_global_to_shared(desc_x, [0, kb0 * 256], ready.index(s), x_s.index(s))
            else:
                mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), WB + XB)
                tma.async_copy_global_to_shared(desc_q, [row0, kb0, 0, 0], ready.index(s), q_s.index(s))
                tma.async_copy_global_to_shared(desc_h, [row0, kb0, 0, 0], ready.index(s), h_s.index(s))
                tma.async_copy_global_to_shared(desc_x, [0, kb0 * 256], ready.index(s), x_s.index(s))
            i += 1


@gluon.jit
def _consumer(Y, PART, COUNT, q_s, h_s, x_s, ready, empty, M, N, units, split, per_split, stride_ym,
              RT: gl.constexpr, STAGES: gl.constexpr, FIXUP: gl.constexpr, PDL: gl.constexpr,
              ACC2: gl.constexpr, DEFER: gl.constexpr):
    W: gl.constexpr = gl.num_warps()
    BN: gl.constexpr = 16 * RT * W
    DT: gl.constexpr = x_s.dtype
    # codes [BN, 1, 4 t, 32 bytes]: lane = t + 4 g, thread rows 2 g, 2 g + 1 of each 16-row tile, 32 bytes in-thread
    B4: gl.constexpr = gl.BlockedLayout([2, 1, 1, 32], [8, 1, 4, 1], [W, 1, 1, 1], [3, 2, 1, 0])
    XL: gl.constexpr = gl.BlockedLayout([1, 64], [8, 4], [W, 1], [1, 0])
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1], instr_shape=[16, 8])
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    BL: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    widx = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, B4))))[None, None, None, :]
    tj = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, B4))))[None, None, :, None]
    lr = gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
    # logical mma row 16 a + 8 h + g holds the weights of row 16 a + 2 g + h
    prow = (lr // 16) * 16 + (lr % 8) * 2 + (lr % 16) // 8
    cols = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    if PDL:
        pdl_wait(True)
    i = 0
    for u in range(pid, units, P):
        acc = gl.zeros([BN, 8], gl.float32, MMA)
        acc1 = gl.zeros([BN, 8], gl.float32, MMA)
        for kk in range(per_split):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            q = q_s.index(s).load(B4)
            hw = h_s.index(s).load(B4)  # [BN, 1, 1, 4] words, replicated over t
            xn = x_s.index(s).load(XL)  # [8, 256] natural order
            mbarrier.arrive(empty.index(s), count=1)
            i += 1
            w0 = gl.expand_dims(gl.sum(gl.where(widx == 0, hw, 0), axis=3), 3)
            w1 = gl.expand_dims(gl.sum(gl.where(widx == 1, hw, 0), axis=3), 3)
            w2 = gl.expand_dims(gl.sum(gl.where(widx == 2, hw, 0), axis=3), 3)
            w3 = gl.expand_dims(gl.sum(gl.where(widx == 3, hw, 0), axis=3), 3)
            d = (w0 & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
            dmin = (w0 >> 16).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
            sc0, mn0, sc1, mn1 = _q4k_scales(w1, w2, w3, tj)  # [BN, 1, 4, 1]
            s_lo, _ = gl.broadcast((d * sc0).to(DT), q)
            z_lo, _ = gl.broadcast((-dmin * mn0).to(DT), q)
            s_hi, _ = gl.broadcast((d * sc1).to(DT), q)
            z_hi, _ = gl.broadcast((-dmin * mn1).to(DT), q)
            if DT == gl.float16:
                w_lo, w_hi = gl.inline_asm_elementwise(_ASM_Q4_F16, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r",
                                                       [q, s_lo, z_lo, s_hi, z_hi], dtype=(gl.float16, gl.float16),
                                                       is_pure=True, pack=4)
            else:
                w_lo, w_hi = gl.inline_asm_elementwise(_ASM_Q4_BF16, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r",
                                                       [q, s_lo, z_lo, s_hi, z_hi], dtype=(gl.bfloat16, gl.bfloat16),
                                                       is_pure=True, pack=4)
            # [BN, 1, 4 t, 32 b, 2 p] -> rows (a, g, h) -> (a, h, g); k = 16 j + 8 p + 2 t + ll (b = 2 j + ll)
            if ACC2:  # two accumulators (bytes 0-15 and 16-31 of each chunk): half the mma dependency chain
                w = gl.reshape(gl.join(w_lo, w_hi), [BN // 16, 8, 2, 4, 2, 8, 2, 2])  # a g h t jh jl ll p
                w = gl.reshape(gl.permute(w, [0, 2, 1, 5, 7, 3, 6, 4]), [BN, 128, 2])
                w0, w1 = gl.split(w)
                xt = gl.reshape(gl.permute(gl.reshape(xn, [8, 4, 2, 2, 8, 2]), [4, 2, 1, 5, 0, 3]), [128, 8, 2])
                x0, x1 = gl.split(xt)
                acc = mma_v2(gl.convert_layout(w0, AL), gl.convert_layout(x0, BL), acc)
                acc1 = mma_v2(gl.convert_layout(w1, AL), gl.convert_layout(x1, BL), acc1)
            else:
                w = gl.reshape(gl.join(w_lo, w_hi), [BN // 16, 8, 2, 4, 16, 2, 2])  # a g h t j ll p
                w = gl.reshape(gl.permute(w, [0, 2, 1, 4, 6, 3, 5]), [BN, 256])
                xt = gl.reshape(gl.permute(gl.reshape(xn, [8, 4, 2, 16, 2]), [3, 2, 1, 4, 0]), [256, 8])
                acc = mma_v2(gl.convert_layout(w, AL), gl.convert_layout(xt, BL), acc)
        if ACC2:
            acc += acc1
        if PDL:  # noqa: SIM102 (constexpr test, then a runtime one)
            if u + P >= units:
                pdl_trigger(True)
        r = (u // split) * BN + prow
        ok = (r < N)[:, None] & (cols < M)[None, :]
        offs = cols[None, :] * stride_ym + r[:, None]
        if FIXUP:
            gl.store(PART + (u % split) * M * N + cols[None, :] * N + r[:, None], acc, mask=ok)
            if not DEFER:
                _fixup(Y, PART, COUNT, u, split, M, N, stride_ym, prow, cols, BN, MMA)
        else:
            gl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=ok)
    if FIXUP:  # noqa: SIM102
        if DEFER:  # every unit's partials stored first: one wait for the stores, then the arrivals
            for u in range(pid, units, P):
                _fixup(Y, PART, COUNT, u, split, M, N, stride_ym, prow, cols, BN, MMA)


@gluon.jit
def _fixup(Y, PART, COUNT, u, split, M, N, stride_ym, prow, cols, BN: gl.constexpr, MMA: gl.constexpr):
    r = (u // split) * BN + prow
    ok = (r < N)[:, None] & (cols < M)[None, :]
    gl.thread_barrier()
    if gl.atomic_add(COUNT + u // split, 1, sem="acq_rel") == split - 1:
        t2 = gl.zeros([BN, 8], gl.float32, MMA)
        for k2 in range(split):
            t2 += gl.load(PART + k2 * M * N + cols[None, :] * N + r[:, None], mask=ok, other=0.0,
                          cache_modifier=".cg")
        gl.store(Y + cols[None, :] * stride_ym + r[:, None], t2.to(Y.dtype.element_ty), mask=ok)
        gl.atomic_xchg(COUNT + u // split, 0)


@gluon.jit
def q4k_mma_kernel(desc_q, desc_h, desc_x, Y, PART, COUNT, M, N, units, split, per_split, stride_ym,
                   RT: gl.constexpr, STAGES: gl.constexpr, FIXUP: gl.constexpr, PDL: gl.constexpr = 0,
                   ACC2: gl.constexpr = 0, DEFER: gl.constexpr = 0):
    BN: gl.constexpr = desc_q.block_type.shape[0]
    gl.static_assert(BN == 16 * RT * gl.num_warps(), "BN = 16 rows per mma tile * RT * warps")
    q_s = gl.allocate_shared_memory(gl.uint8, [STAGES] + desc_q.block_type.shape, desc_q.layout)
    h_s = gl.allocate_shared_memory(gl.int32, [STAGES] + desc_h.block_type.shape, desc_h.layout)
    x_s = gl.allocate_shared_memory(desc_x.dtype, [STAGES] + desc_x.block_type.shape, desc_x.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(ready.index(j), count=1)
        mbarrier.init(empty.index(j), count=1)
    gl.warp_specialize([
        (_consumer, (Y, PART, COUNT, q_s, h_s, x_s, ready, empty, M, N, units, split, per_split, stride_ym, RT,
                     STAGES, FIXUP, PDL, ACC2, DEFER)),
        (_loader, (desc_q, desc_h, desc_x, q_s, h_s, x_s, ready, empty, units, split, per_split, STAGES, PDL)),
    ], [1], [40])


def layouts(BN, xdt):
    lq = gl.NVMMASharedLayout.get_default_for([BN, 1, 4, 32], gl.uint8)
    lh = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=4)
    lx = gl.NVMMASharedLayout.get_default_for([8, 256], xdt)
    return lq, lh, lx


_COUNTERS = {}


def launch(x, data, N, K, cfg, sms):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    RT, STAGES, W = cfg[:3]
    pdl = cfg[3] if len(cfg) > 3 else 0
    acc2 = cfg[4] if len(cfg) > 4 else 0
    waves = cfg[5] if len(cfg) > 5 else 1
    defer = cfg[6] if len(cfg) > 6 else 0
    ctas = cfg[7] if len(cfg) > 7 else 1  # CTAs per SM: registers per thread capped to fit them
    opts = {"maxnreg": 65536 // (ctas * (W + 4) * 32) // 8 * 8} if ctas > 1 else {}
    BN = 16 * RT * W
    M = x.shape[0]
    nb = K // 256
    row = nb * 144
    w8 = data.view(torch.uint8).reshape(-1)
    lq, lh, lx = layouts(BN, gl.float16 if x.dtype == torch.float16 else gl.bfloat16)
    dq = TensorDescriptor(w8[16:], [N, nb, 4, 32], [row, 144, 32, 1], [BN, 1, 4, 32], lq)
    dh = TensorDescriptor(w8.view(torch.int32), [N, nb, 1, 4], [row // 4, 36, 4, 1], [BN, 1, 1, 4], lh)
    dx = TensorDescriptor(x, [M, K], [x.stride(0), 1], [8, 256], lx)
    tiles = triton.cdiv(N, BN)
    split = 1
    while tiles * split < sms * ctas * waves and nb // (split * 2) >= 1:
        split *= 2
    per_split = triton.cdiv(nb, split)
    split = triton.cdiv(nb, per_split)
    units = tiles * split
    P = min(units, sms * ctas)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if split > 1:
        part = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
        cnt = _COUNTERS.get(x.device)
        if cnt is None:
            cnt = _COUNTERS[x.device] = torch.zeros(1 << 16, dtype=torch.int32, device=x.device)
    else:
        part, cnt = y, y
    q4k_mma_kernel[(P,)](dq, dh, dx, y, part, cnt, M, N, units, split, per_split, y.stride(0), RT=RT, STAGES=STAGES,
                         FIXUP=split > 1, PDL=pdl, ACC2=acc2, DEFER=defer, num_warps=W, **opts,
                         **({"launch_pdl": True} if pdl else {}))
    return y


def main():
    from llmkernels.bench.harness import copies_for, time_graph_ms
    from llmkernels.qgemv import gemv
    from llmkernels.quant import dequantize
    from llmkernels.testing.random_weights import random_qtensor

    cfgs = [tuple(int(v) for v in c.split("/")) for c in sys.argv[1].split(",")] if len(sys.argv) > 1 else \
        [(1, 4, 4, 2), (1, 4, 8, 2), (2, 4, 4, 2), (1, 8, 4, 2)]
    ms = [int(v) for v in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 8]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [(4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336), (128256, 4096), (28672, 4096), (77, 768)]
    for dt in [{"fp16": torch.float16, "bf16": torch.bfloat16}[d] for d in os.environ.get("DTS", "fp16,bf16").split(",")]:
        for N, K in shapes:
            first = random_qtensor("q4_k", N, K, "cuda")
            qts = [first] + [random_qtensor("q4_k", N, K, "cuda") for _ in range(copies_for(first.nbytes) - 1)]
            for M in ms:
                x = torch.randn(M, K, device="cuda", dtype=dt)
                ref = x.double() @ dequantize(first).double().T
                tb = lambda t, nbytes=first.nbytes: nbytes / t / 1e9
                t_g = time_graph_ms([lambda qt=qt, x=x: gemv(x, qt) for qt in qts])
                line = f"{str(dt)[6:]} {N}x{K} M{M}: gemv {t_g * 1e3:6.1f} us {tb(t_g):.2f} |"
                for cfg in cfgs:
                    try:
                        y = launch(x, first.data, N, K, cfg, sms)
                        err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
                        t = time_graph_ms([lambda qt=qt, x=x, N=N, K=K, cfg=cfg: launch(x, qt.data, N, K, cfg, sms)
                                           for qt in qts])
                        line += f" {'/'.join(map(str, cfg))} {t * 1e3:6.1f} {tb(t):.2f}" + (
                            f" WRONG {err:.1e}" if err > 2e-2 else "")
                    except Exception as e:  # noqa: BLE001
                        line += f" {'/'.join(map(str, cfg))} ERR {type(e).__name__}: {str(e)[:300]}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
