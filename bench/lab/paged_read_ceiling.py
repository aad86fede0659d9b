"""The read ceiling of the decode suite's shapes (GQA 32/8, D=128, page 16, randomly permuted page table): a
persistent Gluon kernel (one program per SM) that only copies K and V with TMA into a ring of shared-memory slots
and waits for them, no attention. Four orders of the same bytes, the same [16, 128] TMA boxes:

- m0: units (sequence, kv head[, split]), 64-key tiles of one head = 4 pages: what paged_ws's loader reads;
- m1: units (sequence, split), tiles of one page of all 8 kv heads (16 contiguous rows of Hkv * D);
- m2: K / V contiguous as [B, Hkv, L, D] (the layout the SDPA cuDNN anchor reads), units as m0;
- m3: units (sequence, pair of kv heads[, split]), 64-key tiles of both heads (each page's two boxes issued back to
  back): the bytes of a 16-bit m0 tile for a one-byte cache.

Graph-timed over L2-overflowing copies; % of the read bandwidth measured in the same run. With ``attn``, each shape
also runs the bench's decode case (paged_attention through a plan, and SDPA cuDNN on contiguous bf16 K/V).

    PYTHONPATH=. python bench/lab/paged_read_ceiling.py [attn] [fp8] [mMODE/STAGES[/STAGES...] ...]   # m0/4 m3/3/4

``fp8``: only the one-byte cache.
"""
import sys
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from llmkernels._runtime import num_sms
from llmkernels.attention._gluon import row_descriptor
from llmkernels.bench.harness import time_graph_ms, copies_for, measure_read_bandwidth

HKV, D = 8, 128


@gluon.jit
def _issue(i, desc_k, desc_v, k_smem, v_smem, ready, PT, pid, P, T, pps, L, S,
           MODE: gl.constexpr, NCOPY: gl.constexpr, STAGES: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr):
    k = i // T
    t = i % T
    u = pid + k * P
    s = i % STAGES
    mbarrier.expect(ready.index(s), 2 * NCOPY * desc_k.block_type.nbytes)
    for r in gl.static_range(NCOPY):
        if MODE == 0:
            b = u // (HKV * S)
            h = (u // S) % HKV
            sp = u % S
            pg = (sp * T + t) * NCOPY + r
            row = gl.load(PT + b * pps + pg) * 16
            col = h * D
        elif MODE == 1:
            b = u // S
            sp = u % S
            pg = sp * T + t
            row = gl.load(PT + b * pps + pg) * 16
            col = r * D
        elif MODE == 3:  # NCOPY = 2 heads x 4 pages
            b = u // (HKV // 2 * S)
            h = 2 * ((u // S) % (HKV // 2)) + r % 2
            sp = u % S
            pg = (sp * T + t) * (NCOPY // 2) + r // 2
            row = gl.load(PT + b * pps + pg) * 16
            col = h * D
        else:
            b = u // (HKV * S)
            h = (u // S) % HKV
            sp = u % S
            row = (b * HKV + h) * L + ((sp * T + t) * NCOPY + r) * 16
            col = 0
        tma.async_copy_global_to_shared(desc_k, [row, col], ready.index(s), k_smem.index(s).slice(r * 16, 16))
        tma.async_copy_global_to_shared(desc_v, [row, col], ready.index(s), v_smem.index(s).slice(r * 16, 16))


@gluon.jit
def read_kernel(desc_k, desc_v, PT, n_units, T, pps, L, S, MODE: gl.constexpr, NCOPY: gl.constexpr,
                STAGES: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr):
    dtype: gl.constexpr = desc_k.dtype
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, NCOPY * 16, D], desc_k.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, NCOPY * 16, D], desc_k.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(ready.index(j), count=1)
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    my_units = (n_units - pid + P - 1) // P
    total = my_units * T
    for j in gl.static_range(STAGES - 1):
        if j < total:
            _issue(j, desc_k, desc_v, k_smem, v_smem, ready, PT, pid, P, T, pps, L, S, MODE, NCOPY, STAGES, HKV, D)
    for i in range(total):
        if i + STAGES - 1 < total:
            _issue(i + STAGES - 1, desc_k, desc_v, k_smem, v_smem, ready, PT, pid, P, T, pps, L, S, MODE, NCOPY,
                   STAGES, HKV, D)
        mbarrier.wait(ready.index(i % STAGES), (i // STAGES) & 1)
    for j in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(j))


def case(B, L, dtype, mode, stages, splits):
    pps = L // 16
    ncopy = 8 if mode in (1, 3) else 4
    elem = torch.tensor([], dtype=dtype).element_size()
    kv_bytes = 2 * B * L * HKV * D * elem
    n = copies_for(kv_bytes, most=4)
    fns = []
    keep = []  # the caches behind the descriptors stay alive until timed
    for _ in range(n):
        if mode == 2:
            k = torch.randn(B * HKV * L, D, device="cuda", dtype=torch.bfloat16).to(dtype)
            v = torch.randn(B * HKV * L, D, device="cuda", dtype=torch.bfloat16).to(dtype)
            dk = row_descriptor(k, [B * HKV * L, D], D, 16)
            dv = row_descriptor(v, [B * HKV * L, D], D, 16)
        else:
            k = torch.randn(B * pps * 16, HKV * D, device="cuda", dtype=torch.bfloat16).to(dtype)
            v = torch.randn(B * pps * 16, HKV * D, device="cuda", dtype=torch.bfloat16).to(dtype)
            dk = row_descriptor(k.view(B * pps * 16, HKV, D), [B * pps * 16, HKV * D], HKV * D, 16)
            dv = row_descriptor(v.view(B * pps * 16, HKV, D), [B * pps * 16, HKV * D], HKV * D, 16)
        pt = torch.randperm(B * pps, device="cuda").to(torch.int32)
        if mode == 1:
            n_units = B * splits
            T = pps // splits
        elif mode == 3:
            n_units = B * HKV // 2 * splits
            T = pps // 4 // splits
        else:
            n_units = B * HKV * splits
            T = pps // ncopy // splits
        keep.append((k, v, pt))
        grid = (min(num_sms(), n_units),)  # one program per SM, as paged_ws
        fns.append(lambda dk=dk, dv=dv, pt=pt, n_units=n_units, T=T, grid=grid:
                   read_kernel[grid](dk, dv, pt, n_units, T, pps, L, splits, MODE=mode, NCOPY=ncopy,
                                     STAGES=stages, HKV=HKV, D=D, num_warps=4))
    ms = time_graph_ms(fns)
    return ms * 1e3, kv_bytes / (ms * 1e-3) / 1e12


def main():
    bw = measure_read_bandwidth()
    print(f"read bandwidth {bw:.3f} TB/s", flush=True)
    shapes = [(1, 32768, 16), (16, 4096, 1), (64, 1024, 1), (64, 8192, 1), (128, 2048, 1)]
    dtypes = ((torch.bfloat16, "bf16"), (torch.float8_e4m3fn, "fp8"))
    modes = [(int(m[1]), tuple(int(x) for x in m.split("/")[1:])) for m in sys.argv[1:] if m[0] == "m"]
    for dtype, name in dtypes[1:] if "fp8" in sys.argv else dtypes:
        for B, L, sp in shapes:
            res = []
            for mode, stages_list in modes or ((0, (4, 6)), (2, (4, 6)), (1, (2, 3)), (3, (3, 4))):
                for st in stages_list:
                    s = sp * HKV if mode == 1 else sp * 2 if mode == 3 and B * HKV // 2 * sp < 128 else sp
                    if mode == 1 and B * s < 128:
                        s = max(s, 128 // B)
                    try:
                        us, tb = case(B, L, dtype, mode, st, s)
                        res.append(f"m{mode}/st{st}/sp{s} {us:6.1f}us {100 * tb / bw:5.1f}%")
                    except Exception as e:  # noqa
                        res.append(f"m{mode}/st{st} ERR {type(e).__name__}: {str(e)[:80]}")
            print(f"{name} B{B} L{L}: " + " | ".join(res), flush=True)
            if "attn" in sys.argv:
                from llmkernels.bench.suites import decode as dec
                ctx = type("C", (), {"bw_pct": lambda self, t: 100 * t / bw})()
                row = dec._case(ctx, B, L, 16, dtype)()
                cud = row.anchors.get("sdpa_cudnn_bf16")
                print(f"   attention {row.note} {row.roofline_pct:.1f}%"
                      + (f" cudnn-bf16 {100 * cud / bw:.1f}% ratio {row.value / cud:.3f}" if cud else ""), flush=True)


if __name__ == "__main__":
    main()
