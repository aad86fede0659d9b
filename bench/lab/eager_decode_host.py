"""Host cost of an eager paged_attention decode call against its graph-replayed time.

    PYTHONPATH=. python bench/lab/eager_decode_host.py

GQA 32/8, D 128, page 16, a random page table over one 32768-page cache; for each shape: the host time to enqueue
a call (50 calls, no sync), eager wall time per call, triton's do_bench, CUDA-graph replay, and the kernels the
profiler sees; a cProfile of the host side where enqueuing takes more than 200 us.
"""
import cProfile, io, pstats, time, torch
import triton.testing as tt
from torch.profiler import ProfilerActivity, profile
from llmkernels.attention import paged_attention, plan_paged_attention
dev = torch.device("cuda")
NP = 32768
kc = torch.randn(NP, 16, 8, 128, device=dev, dtype=torch.bfloat16); vc = torch.randn_like(kc)
def case(B, L, fp8=False):
    lens_h = torch.tensor([L - 4 * i for i in range(B)], dtype=torch.int32)
    W = -(-L // 16)
    perm = torch.randperm(NP)[: B * W].view(B, W).to(torch.int32)
    table = perm.to(dev); lens = lens_h.to(dev); cu_h = torch.arange(B + 1, dtype=torch.int32); cu = cu_h.to(dev)
    q = torch.randn(B, 32, 128, device=dev, dtype=torch.bfloat16)
    k, v, kw = kc, vc, {}
    if fp8:
        k, v = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn); kw = dict(k_scale=torch.ones((), device=dev), v_scale=torch.ones((), device=dev))
    plan = plan_paged_attention(cu_h, lens_h, 16, 32, 8, 128, q_dtype=torch.bfloat16, kv_dtype=k.dtype, device=dev)
    f = lambda: paged_attention(q, k, v, table, lens, cu, 1, plan=plan, validate=False, **kw)
    f(); torch.cuda.synchronize()
    t = time.perf_counter(); n = 50
    for _ in range(n): f()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize(); wall = (time.perf_counter() - t) / n * 1e6
    eb = tt.do_bench(f, warmup=10, rep=100) * 1e3
    g = torch.cuda.CUDAGraph(); s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s): f()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g): f()
    gb = tt.do_bench(lambda: g.replay(), warmup=10, rep=100) * 1e3
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(5): f()
        torch.cuda.synchronize()
    ks = [(e.key, e.self_device_time_total / 5, e.count / 5) for e in prof.key_averages() if e.self_device_time_total > 0]
    byt = 2 * int(lens_h.sum()) * 8 * 128 * k.element_size()
    print(f"B{B} L{L} {'fp8' if fp8 else 'bf16'}: host {host:.0f} us/call, eager wall {wall:.0f}, do_bench {eb:.1f}, graph {gb:.1f} us ({byt/gb/1e6:.0f} GB/s); kernels {[(a[:30], round(b,1), c) for a,b,c in ks]}", flush=True)
    if host > 200:
        pr = cProfile.Profile(); pr.enable()
        for _ in range(10): f()
        pr.disable(); sio = io.StringIO(); [pstats.Stats(pr, stream=sio).sort_stats(k).print_stats(25) for k in ("tottime", "cumulative")]; print(sio.getvalue())
    print(plan.describe().splitlines()[-3:], flush=True)
for B, L in ((6, 8100), (1, 32768), (64, 8192), (16, 4096), (64, 1024)):
    case(B, L)
case(6, 8100, True); case(64, 8192, True)
