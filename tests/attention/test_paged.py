"""paged_attention (+ plan, store_kv) against the reference that gathers pages into dense K/V."""
import numpy as np
import pytest
import torch

import llmkernels as lk
from llmkernels.testing import assert_close, paged_attention_ref, poison

from .gluon_helpers import need_sm90, sm90_compile_report, sm90_compile_text, sm90_spill_bytes
from .paged_helpers import build, tree_mask

FP8 = torch.float8_e4m3fn


def check(q_lens, k_lens, page_size, Hq, Hkv, D, device, *, dtype=torch.float16, kv_dtype=None, scales=None,
          num_splits=0, causal=True, window=(-1, -1), softcap=0.0, sinks=False, tree=False, plan=False):
    q, kc, vc, pt, sl, cq = build(q_lens, k_lens, page_size, Hq, Hkv, D, dtype=dtype, kv_dtype=kv_dtype,
                                  device=device, scales=scales)
    s = torch.randn(Hq, device=device) if sinks else None
    mask = tree_mask(q_lens, device) if tree else None
    ks, vs = scales if scales else (None, None)
    p = lk.plan_paged_attention(cq.cpu(), sl.cpu(), page_size, Hq, Hkv, D, q_dtype=dtype, kv_dtype=kc.dtype,
                                num_splits=num_splits, device=device) if plan else None
    out = poison(torch.empty_like(q))
    o, lse = lk.paged_attention(q, kc, vc, pt, sl, cq, max(q_lens), causal=causal, window_size=window,
                                softcap=softcap, sinks=s, k_scale=ks, v_scale=vs, custom_mask=mask,
                                num_splits=num_splits, plan=p, return_lse=True, out=out)
    ro, rl = paged_attention_ref(q, kc, vc, pt, sl, cq, causal=causal, window_size=window, softcap=softcap, sinks=s,
                                 k_scale=ks, v_scale=vs, custom_mask=mask)
    assert_close(o, ro, dtype, "o")
    assert_close(lse, rl, torch.float32, "lse", atol=2e-3, rtol=2e-3)
    return o


# (q_lens, k_lens, page_size, Hq, Hkv, D, kwargs)
CPU_CASES = [
    ([1, 1, 1], [17, 1, 40], 16, 8, 2, 64, {}),  # decode, page 16, kv 17 = 16 + 1
    ([1, 1], [15, 33], 3, 7, 1, 64, {}),  # page 3, group 7
    ([1, 1], [97, 1], 1, 4, 4, 64, dict(num_splits=3)),  # page 1, group 1, split
    ([20, 1, 5], [50, 30, 5], 16, 8, 2, 64, {}),  # mixed: extend + decode + fresh prefill
    ([9, 1], [127, 129], 128, 16, 2, 64, {}),  # page 128, kv 128 +- 1, group 8
    ([6, 1], [40, 30], 8, 8, 2, 64, dict(window=(10, -1), softcap=20.0, sinks=True, num_splits=2)),
    ([6, 3], [40, 30], 8, 8, 2, 64, dict(tree=True)),
    ([0, 3], [10, 30], 8, 4, 2, 64, dict(causal=False)),  # an empty query sequence
    ([2, 1], [53, 61], 16, 8, 2, 64, dict(kv_dtype=FP8, scales=(0.05, 0.07))),
    ([2, 1], [53, 61], 16, 8, 2, 64, dict(kv_dtype=torch.float8_e5m2, scales=(0.05, 0.07), num_splits=2)),
    ([1, 2], [30, 41], 1, 6, 2, 96, dict(kv_dtype=FP8, scales=(0.5, 2.0))),  # fp8 words with D 96 (masked tail)
    ([1], [37], 16, 4, 1, 96, dict(plan=True)),
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: f"q{c[0]}k{c[1]}p{c[2]}H{c[3]}/{c[4]}")
def test_paged_cpu(case, device):
    q_lens, k_lens, ps, Hq, Hkv, D, kw = case
    kw = dict(kw)
    if kw.get("kv_dtype") in (FP8, torch.float8_e5m2):
        kw.setdefault("dtype", torch.float16)
    check(q_lens, k_lens, ps, Hq, Hkv, D, device, **kw)


def test_fixed_split_is_batch_invariant(device):
    q, kc, vc, pt, sl, cq = build([1, 1, 1], [300, 77, 150], 16, 4, 2, 64, device=device)
    full = lk.paged_attention(q, kc, vc, pt, sl, cq, 1, num_splits=3)
    alone = lk.paged_attention(q[:1], kc, vc, pt[:1], sl[:1], cq[:2], 1, num_splits=3)
    assert torch.equal(full[:1], alone)


def test_plan_describes_and_updates(device):
    cq = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    sl = torch.tensor([5, 900, 70], dtype=torch.int32)
    plan = lk.plan_paged_attention(cq, sl, 16, 32, 8, 128, q_dtype=torch.float16, kv_dtype=torch.float16,
                                   max_tiles=8, device=device)
    text = plan.describe()
    assert "decode" in text and "launch 'short'" in text and "split" in text
    plan.update(torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([4, 8], dtype=torch.int32))
    assert plan.launches[0].used == 2 and int(plan.launches[0].num_tiles) == 2
    with pytest.raises(ValueError, match="capacity"):
        plan.update(torch.arange(10, dtype=torch.int32), torch.full((9,), 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="'long' launch"):
        plan.update(torch.tensor([0, 40], dtype=torch.int32), torch.tensor([50], dtype=torch.int32))


@pytest.mark.parametrize("B,L,splits", [(1, 600, 17), (1, 300, 9), (1, 2048, 17), (1, 8192, 33), (1, 32768, 33),
                                         (4, 4096, 9), (16, 4096, 3), (16, 600, 2), (64, 1024, 1)])
def test_plan_split_count(B, L, splits, monkeypatch):
    """On 132 SMs with GQA 32/8: two waves of split programs while each keeps >= 512 keys (>= 64 when the programs
    fill at most half the SMs), else one wave down to 32 keys per split; no split once tiles x kv heads fill the
    SMs."""
    import llmkernels.attention.plan as plan_mod

    monkeypatch.setattr(plan_mod, "num_sms", lambda dev: 132)
    plan = lk.plan_paged_attention(torch.arange(B + 1, dtype=torch.int32), torch.full((B,), L, dtype=torch.int32),
                                   16, 32, 8, 128, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, device="cpu")
    assert plan.num_splits == splits


def test_plan_mismatch_is_an_error(device):
    q, kc, vc, pt, sl, cq = build([1], [20], 16, 4, 2, 64, device=device)
    plan = lk.plan_paged_attention(cq, sl, 8, 4, 2, 64, q_dtype=torch.float16, kv_dtype=torch.float16,
                                   device=device)
    with pytest.raises(ValueError, match="plan was made for"):
        lk.paged_attention(q, kc, vc, pt, sl, cq, 1, plan=plan)


def test_fp8_cache_misaligned_view_is_an_error(device):
    q, kc, vc, pt, sl, cq = build([1], [20], 16, 4, 2, 64, device=device)
    kc8, vc8 = kc.to(FP8), vc.to(FP8)
    shifted = torch.empty(kc8.numel() + 4, dtype=FP8, device=device)[4:].view(kc8.shape)  # data 4 bytes off
    shifted.copy_(kc8)
    with pytest.raises(ValueError, match="k_cache: an fp8 cache must start on a 16-byte boundary"):
        lk.paged_attention(q, shifted, vc8, pt, sl, cq, 1, k_scale=1.0, v_scale=1.0)
    wide = torch.empty(*kc8.shape[:3], 72, dtype=FP8, device=device)[..., :64]  # head stride 72: not 16-aligned
    with pytest.raises(ValueError, match="v_cache: an fp8 cache"):
        lk.paged_attention(q, kc8, wide, pt, sl, cq, 1, k_scale=1.0, v_scale=1.0)
    paged_ok = lk.paged_attention(q, kc8, vc8, pt, sl, cq, 1, k_scale=1.0, v_scale=1.0)
    assert torch.isfinite(paged_ok).all()


@pytest.mark.parametrize("mutate,match", [
    (lambda a: a["pt"].__setitem__((0, 0), 10_000), "outside \\[0, num_pages"),
    (lambda a: a.update(sl=torch.tensor([500], dtype=torch.int32)), "needs more than the page table"),
    (lambda a: a.update(cq=torch.tensor([0, 3], dtype=torch.int32), q=torch.randn(3, 4, 64, dtype=torch.float16),
                        sl=torch.tensor([2], dtype=torch.int32)), "q_len"),
    (lambda a: a.update(q=a["q"].to(torch.bfloat16)), "k_cache must have dtype"),
    (lambda a: a.update(sl=a["sl"].long()), "seq_lens must have dtype"),
    (lambda a: a.update(kc=a["kc"].to(FP8), vc=a["vc"].to(FP8)), "k_scale and v_scale are required"),
])
def test_bad_input(mutate, match, device):
    q, kc, vc, pt, sl, cq = build([1], [20], 16, 4, 2, 64, device=device)
    a = dict(q=q, kc=kc, vc=vc, pt=pt, sl=sl, cq=cq)
    mutate(a)
    a = {k: v.to(device) for k, v in a.items()}
    with pytest.raises((ValueError, TypeError), match=match):
        lk.paged_attention(a["q"], a["kc"], a["vc"], a["pt"], a["sl"], a["cq"], int((a["cq"][1:] - a["cq"][:-1]).max()))


def test_store_kv_skips_minus_one_and_quantizes(device):
    kc = torch.zeros(4, 3, 2, 64, dtype=torch.float16, device=device)
    vc = torch.zeros_like(kc)
    k = torch.randn(3, 2, 64, dtype=torch.float16, device=device)
    v = torch.randn(3, 2, 64, dtype=torch.float16, device=device)
    lk.store_kv(k, v, kc, vc, torch.tensor([5, -1, 0], device=device))
    assert torch.equal(kc[1, 2], k[0]) and torch.equal(vc[0, 0], v[2])
    assert kc.flatten(0, 1)[torch.tensor([1, 2, 3, 4, 6, 7, 8, 9, 10, 11])].abs().sum() == 0
    with pytest.raises(ValueError, match="outside"):
        lk.store_kv(k, v, kc, vc, torch.tensor([0, 1, 12], device=device))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_store_kv_fp8(fp8, device):
    k = torch.randn(3, 2, 64, dtype=torch.float16, device=device) * 1000
    v = torch.randn(3, 2, 64, dtype=torch.float16, device=device)
    k8 = torch.zeros(4, 3, 2, 64, dtype=fp8, device=device)
    v8 = torch.zeros_like(k8)
    lk.store_kv(k, v, k8, v8, torch.tensor([1, 2, 3], device=device), k_scale=0.5, v_scale=0.25)
    assert torch.isfinite(k8.float()).all()  # saturated to the fp8 range, never NaN
    assert k8.float().abs().max() <= (448 if fp8 == torch.float8_e4m3fn else 57344)
    if device.type == "cuda":
        # bit-exact with torch's rounding; Triton 3.6's interpreter drops the carry when rounding up to the next
        # power of two (triton-lang/triton#11897), so this is checked on the GPU only
        assert torch.equal(v8[1, 0], (v[2].float() / 0.25).to(fp8))
    else:
        assert_close(v8[1, 0].float() * 0.25, v[2].float(), fp8, atol=0.5, rtol=0.5)


GPU_CASES = [
    ([1] * 17, [1, 15, 16, 17, 31, 32, 33, 97, 127, 128, 129, 255, 256, 257, 1000, 2047, 4099], 16, 32, 8, 128),
    ([1] * 5, [1, 2, 3, 1000, 5000], 1, 28, 4, 128),  # page 1, group 7
    ([7, 1, 300, 1], [7, 513, 1300, 2], 64, 32, 4, 128),
    ([1, 1], [100000, 3], 128, 8, 1, 128),  # long context through split-KV
    ([1, 4, 1], [300, 64, 65], 3, 16, 16, 64),
    ([1, 33], [800, 900], 16, 16, 2, 256),
    ([5, 1], [600, 700], 16, 12, 1, 96),  # group 12
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"b{len(c[0])}p{c[2]}H{c[3]}/{c[4]}D{c[5]}")
def test_paged_gpu(case, dtype, device):
    check(*case, device, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("case", [([1, 1, 9], [3000, 17, 600], 16, 32, 8, 128), ([1, 4], [300, 65], 3, 12, 1, 96),
                                  ([1, 2], [257, 1000], 1, 8, 2, 256), ([1, 1], [4097, 63], 64, 32, 8, 64)],
                         ids=lambda c: f"p{c[2]}H{c[3]}/{c[4]}D{c[5]}")
def test_paged_fp8_gpu(case, kv_dtype, device):
    check(*case, device, dtype=torch.bfloat16, kv_dtype=kv_dtype, scales=(0.04, 0.03))


@pytest.mark.gpu
def test_paged_features_gpu(device):
    check([1, 12, 1], [5000, 700, 129], 16, 32, 8, 128, device, dtype=torch.bfloat16, window=(1024, -1),
          softcap=30.0, sinks=True)
    check([6, 3, 1], [400, 230, 17], 16, 32, 8, 128, device, dtype=torch.bfloat16, tree=True)
    # Gemma-2's batch-1 step: head dim 256 under the tables' few-programs entry, soft cap, a window past the keys
    for dtype in (torch.bfloat16, torch.float16):
        check([1], [601], 16, 16, 8, 256, device, dtype=dtype, window=(4095, -1), softcap=50.0)


def _graph_replay(device, kv_len, num_splits, warm_stream=False):
    """Capture one decode call of 8 sequences (GQA 32/8, bf16, page 16) made for kv_len keys, then replay it with
    new lengths (plan.update) and fresh queries against the reference. Returns the plan. ``warm_stream``: capture
    on a stream that ran the call first (so it has its split counters, as an engine's warmed-up capture)."""
    Hq, Hkv, D, ps = 32, 8, 128, 16
    q, kc, vc, pt, sl, cq = build([1] * 8, [kv_len] * 8, ps, Hq, Hkv, D, dtype=torch.bfloat16, device=device,
                                  extra_pages=400)
    plan = lk.plan_paged_attention(cq.cpu(), sl.cpu(), ps, Hq, Hkv, D, q_dtype=q.dtype, kv_dtype=kc.dtype,
                                   num_splits=num_splits, device=device)
    out = torch.empty_like(q)
    pt_big = torch.zeros(8, 64, dtype=torch.int32, device=device)
    pt_big[:, :pt.shape[1]] = pt
    stream = torch.cuda.Stream() if warm_stream else None
    with torch.cuda.stream(stream):
        lk.paged_attention(q, kc, vc, pt_big, sl, cq, 1, plan=plan, out=out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        lk.paged_attention(q, kc, vc, pt_big, sl, cq, 1, plan=plan, out=out)
    for new_len in (3, 49, kv_len + 1):
        lens = torch.randint(1, new_len + 1, (8,), dtype=torch.int32)
        sl.copy_(lens)
        plan.update(cq.cpu(), lens)
        q.copy_(torch.randn_like(q))
        g.replay()
        ref, _ = paged_attention_ref(q, kc, vc, pt_big, sl, cq)
        assert_close(out, ref, torch.bfloat16)
    return plan


@pytest.mark.gpu
def test_cuda_graph_replay_with_new_lengths(device):
    _graph_replay(device, 76, num_splits=2)


@pytest.mark.gpu
def test_torch_compile_paged(device):
    q, kc, vc, pt, sl, cq = build([1, 3], [70, 90], 16, 8, 2, 128, dtype=torch.bfloat16, device=device)
    plan = lk.plan_paged_attention(cq.cpu(), sl.cpu(), 16, 8, 2, 128, q_dtype=q.dtype, kv_dtype=kc.dtype,
                                   device=device)
    f = torch.compile(lambda q: lk.paged_attention(q, kc, vc, pt, sl, cq, 3, plan=plan, validate=False) * 2,
                      fullgraph=True)
    ref, _ = paged_attention_ref(q, kc, vc, pt, sl, cq)
    assert_close(f(q), 2 * ref, torch.bfloat16)


# --- the persistent Gluon decode kernel (attention/paged_ws.py, sm_90) -------------------------------------------

WS_CASES = [
    ([1] * 7, [1, 17, 100, 1000, 4097, 64, 65], 16, 32, 8, 128, {}),  # splits chosen by the plan
    ([1] * 5, [300, 31, 999, 1, 64], 64, 28, 4, 128, dict(num_splits=3)),  # group 7, page 64, fixed splits
    ([1, 0, 1], [700, 5, 2000], 128, 16, 2, 64, {}),  # page 128, D 64, a sequence without queries
    ([1] * 3, [33, 800, 257], 8, 8, 1, 128, dict(num_splits=1)),  # page 8, MQA (group 8), no split
    ([1], [30011], 16, 32, 8, 128, dict(balanced=True)),  # batch 1: each (sequence, kv head) cut over ~16 programs
    ([1] * 150, [(37 * i) % 997 + 1 for i in range(150)], 32, 8, 2, 128, {}),  # ragged, programs over many units
    # fixed splits over 90 sequences, group 7: 720 units, five or six per program (the consumer loads each next
    # unit's q and lengths ahead), sequences of one key leave their second split empty
    ([1] * 90, [(53 * i) % 611 + 1 for i in range(90)], 16, 28, 4, 128, dict(num_splits=2)),
    # page sizes TMA cannot copy by pages: rows gathered with cp.async
    ([1] * 6, [1, 17, 100, 1000, 64, 65], 1, 32, 8, 128, {}),  # page 1
    ([1] * 4, [300, 31, 999, 2], 3, 28, 4, 64, dict(num_splits=3)),  # page 3, group 7, D 64, fixed splits
    ([1], [20011], 1, 16, 2, 128, dict(balanced=True)),  # page 1, the balanced split
]


def _spy_ws(monkeypatch):
    """Records, for each launch of the Gluon decode kernel, whether it ran the balanced split."""
    from llmkernels.attention import paged_ws, plan

    monkeypatch.setattr(plan, "WS_DECODE_MIN_BYTES", 0)  # small test batches would take the Triton kernel
    calls = []
    real = paged_ws.launch_decode_ws
    monkeypatch.setattr(paged_ws, "launch_decode_ws",
                        lambda *a, **kw: calls.append(kw.get("balanced") is not None) or real(*a, **kw))
    return calls


def test_balanced_tables_cover_every_key_tile_once():
    from llmkernels.attention.schedule import balanced_table_size, balanced_tables

    rng = np.random.default_rng(0)
    for lens, hkv, programs, cap in ([[1], 8, 132, 1], [[4097, 1, 65, 64], 2, 7, 6], [rng.integers(1, 5000, 40), 8,
                                     132, 40], [[30000], 1, 132, 3], [[1, 1], 1, 132, 2], [[4096] * 16, 8, 132, 16],
                                     [[32768] + [1024] * 7, 8, 132, 8], [rng.integers(1, 300, 200), 4, 132, 256]):
        lens = np.asarray(lens)
        tab = balanced_tables(lens, hkv, programs, cap, 64, snap=0.5).astype(np.int64)
        assert len(tab) == balanced_table_size(cap, hkv, programs)
        n = -(-lens // 64)
        cu_t = tab[:len(lens) + 1]
        assert cu_t.tolist() == [0] + np.cumsum(n * hkv).tolist()
        T = int(cu_t[-1])
        g0 = tab[cap + 1:cap + 2 + programs]
        pstart = tab[cap + 2 + programs:cap + 2 + 2 * programs]
        units = cap * hkv
        p_first = tab[cap + 2 + 2 * programs:][:units]
        pieces = tab[cap + 2 + 2 * programs + units:][:units]
        used = int(np.sum(g0[:-1] < T))
        assert g0[0] == 0 and (np.diff(g0[:used + 1]) > 0).all() and (g0[used:] == T).all()  # no empty range inside
        share = T / min(programs, T)
        for p in range(used):
            assert cu_t[pstart[p]] <= g0[p] < cu_t[pstart[p] + 1]
            assert g0[p + 1] - g0[p] <= 2 * share + 1  # balanced: within a share of the ideal range
        for i in range(len(lens)):
            for h in range(hkv):
                u0 = cu_t[i] + h * n[i]
                holders = [p for p in range(used) if g0[p] < u0 + n[i] and g0[p + 1] > u0]
                u = i * hkv + h
                assert holders == list(range(p_first[u], p_first[u] + pieces[u]))
                if n[i] <= share / 2:
                    assert pieces[u] == 1, "a unit shorter than half a share is never cut"
        if len(set(lens.tolist())) == 1 and len(lens) * hkv <= programs and n[0] <= 1.1 * share:
            # e.g. 16 x 4096 keys, 8 kv heads: 128 units of 64 tiles for 132 programs
            assert (pieces[:len(lens) * hkv] == 1).all(), "equal units, about a share each: one per program"


def test_ws_plan_balances_ragged_batches_only(monkeypatch):
    from llmkernels.attention import plan as plan_mod

    monkeypatch.setattr(plan_mod, "_ws_decode", lambda *a: True)
    monkeypatch.setattr(plan_mod, "num_sms", lambda device: 132)

    def plan(lens, **kw):
        cq = torch.arange(len(lens) + 1, dtype=torch.int32)
        return lk.plan_paged_attention(cq, torch.tensor(lens, dtype=torch.int32), 16, 32, 8, 128,
                                       q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, device="cpu", **kw)

    for lens in ([32768] + [1024] * 7, [16384] * 2 + [512] * 30, [8192] * 4 + [256] * 100):
        p = plan(lens)
        assert p.balanced and "the balanced split" in p.describe()
        assert not plan(lens, num_splits=2).balanced  # a fixed split count: units
    for lens in ([32768], [4096] * 16, [1024] * 64, [2048] * 128):
        assert not plan(lens).balanced, lens


def test_ws_plan_refuses_more_than_one_query(monkeypatch):
    from llmkernels.attention import plan as plan_mod

    monkeypatch.setattr(plan_mod, "_ws_decode", lambda *a: True)
    cq = torch.tensor([0, 1, 2], dtype=torch.int32)
    p = lk.plan_paged_attention(cq, torch.tensor([40, 900], dtype=torch.int32), 16, 8, 2, 128,
                                q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, device="cpu")
    assert p.ws_decode and "persistent Gluon decode" in p.describe()
    with pytest.raises(ValueError, match="one-query-per-sequence decode kernel"):
        p.update(torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([40, 900], dtype=torch.int32))


@pytest.mark.parametrize("page_size, head_dim, split, balanced, kv, consumers", [
    (16, 128, False, False, "", 1), (128, 64, True, False, "", 1), (16, 128, False, True, "", 1),
    (16, 128, True, False, "fp8e4nv", 1), (64, 64, False, True, "fp8e5", 1),
    (1, 128, False, False, "", 1), (3, 64, True, True, "fp8e4nv", 1),  # rows gathered with cp.async
    (16, 128, True, False, "fp8e4nv", 2), (16, 128, False, True, "fp8e4nv", 2), (1, 128, True, False, "fp8e5", 2)])
def test_ws_decode_compiles_for_sm90_without_spills(page_size, head_dim, split, balanced, kv, consumers):
    # as test_prefill's: compiled for sm_90 in a subprocess without the interpreter; the split builds with PDL 1
    # (wait for the previous kernel before the partitions start), the others without
    call = (f"paged_ws.compile_sm90({page_size}, {head_dim}, split={split}, balanced={balanced}, kv={kv!r}, "
            f"pdl={int(split)}, consumers={consumers})")
    if consumers == 2:  # ptxas's own count (the checks below read the PTX, before register allocation)
        assert sm90_spill_bytes(call) == 0
    got = sm90_compile_report(call,
                              {"wgmma": "wgmma.mma_async", "tma": "cp.async.bulk.tensor",
                               "gather": "cp.async.cg.shared.global", "local": ".local", "cvt": "cvt.rn.f16x2.e",
                               "wait": "griddepcontrol.wait", "trigger": "griddepcontrol.launch_dependents"})
    tma = page_size in (8, 16, 32) or page_size % 64 == 0
    assert got == {"wgmma": True, "tma": tma, "gather": not tma, "local": False, "cvt": bool(kv), "wait": split,
                   "trigger": False}


@pytest.mark.parametrize("lead, stages", [(-1, 4), (2, 3)])
def test_ws_decode_loader_orders_compile_without_spills(lead, stages):
    call = f"paged_ws.compile_sm90(16, 128, stages={stages}, lead={lead})"
    assert sm90_spill_bytes(call) == 0
    # LEAD >= 0: a second barrier array frees the V halves (mbarrier inits: K and V ready per slot, one or two
    # empties per slot, the two consumers' hand-off pair)
    inits = sm90_compile_text(call, "ptx").count("mbarrier.init")
    assert inits == (4 if lead >= 0 else 3) * stages + 2, inits


@pytest.mark.parametrize("head_dim, split, kv, window, softcap", [
    (256, False, "", True, True), (256, True, "", False, True),  # Gemma-2's shape: D 256, soft cap, windows
    (128, True, "", True, False), (128, True, "fp8e4nv", True, True)])
def test_ws_decode_window_softcap_compiles_without_spills(head_dim, split, kv, window, softcap):
    call = (f"paged_ws.compile_sm90(16, {head_dim}, group=2, stages={3 if head_dim == 256 else 6 if kv else 4}, "
            f"split={split}, kv={kv!r}, window={window}, softcap={softcap}, consumers={2 if kv else 1})")
    assert sm90_spill_bytes(call) == 0
    got = sm90_compile_report(call, {"wgmma": "wgmma.mma_async", "tma": "cp.async.bulk.tensor", "local": ".local"})
    assert got == {"wgmma": True, "tma": True, "local": False}


def test_ws_decode_launch_refuses_a_window_with_the_balanced_split():
    from llmkernels.attention import paged_ws

    q = torch.zeros(1, 8, 128, dtype=torch.bfloat16)
    kc = torch.zeros(4, 1, 2, 128, dtype=torch.bfloat16)  # a row-gathered cache (page size 1)
    with pytest.raises(ValueError, match="left must be -1 with balanced"):
        paged_ws.launch_decode_ws(q, (kc, kc), None, None, None, None, None, None, None, 4, 1, 1, 1.0, 132,
                                  balanced=(None, 1), gather=True, left=10)


@pytest.mark.parametrize("lead", [3, -2, 1.5])
def test_ws_decode_launch_refuses_an_unknown_lead(lead):
    from llmkernels.attention import paged_ws

    q = torch.zeros(1, 8, 128, dtype=torch.bfloat16)
    kc = torch.zeros(4, 1, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="lead must be -1, 0, 1 or 2"):
        paged_ws.launch_decode_ws(q, (kc, kc), None, None, None, None, None, None, None, 4, 1, 1, 1.0, 132,
                                  gather=True, lead=lead)


def test_ws_plan_takes_head_dim_256_with_16_bit_caches_only(monkeypatch):
    from llmkernels.attention import plan as plan_mod
    from llmkernels.attention import prefill

    monkeypatch.setattr(plan_mod, "interpreter_mode", lambda: False)
    monkeypatch.setattr(prefill, "_gluon_hopper", lambda index: True)
    cuda = torch.device("cuda", 0)
    q_lens, k_lens = torch.ones(64, dtype=torch.int32), torch.full((64,), 4096, dtype=torch.int32)
    for kv, want in ((torch.bfloat16, True), (torch.float8_e4m3fn, False)):
        assert plan_mod._ws_decode(cuda, q_lens, k_lens, 16, 8, 256, 2, torch.bfloat16, kv) is want
    assert not plan_mod._ws_decode(cuda, q_lens, k_lens, 16, 8, 96, 2, torch.bfloat16, torch.bfloat16)


@pytest.mark.parametrize("kv", ["", "fp8e4nv"])
def test_ws_decode_consumer_look_ahead_survives_compilation(kv):
    # Triton 3.6 drops a loop-carried value whose only use in the loop is an inner loop's bound (the loop then
    # reuses its first value; 3.9 keeps it). A converter written that way hung on ragged fp8 batches
    # (bench/NOTES.md). The consumer's units loop carries the ring counter and six look-ahead values (two lengths, two
    # query tokens, a sequence id, the next q): all seven must still be there after the optimization passes.
    import re

    ttgir = sm90_compile_text(f"paged_ws.compile_sm90(16, 128, split=True, kv={kv!r})")
    loops = [ln for ln in ttgir.splitlines() if "scf.for" in ln and "%q0" in ln]
    assert len(loops) == 1, loops
    carried = re.search(r"iter_args\(([^)]*)\)", loops[0]).group(1)
    assert carried.count(" = ") == 7, carried


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", WS_CASES, ids=lambda c: f"k{c[1][:3]}p{c[2]}H{c[3]}/{c[4]}D{c[5]}")
def test_ws_decode_gpu(case, dtype, device, monkeypatch):
    need_sm90()
    launches = _spy_ws(monkeypatch)
    q_lens, k_lens, ps, Hq, Hkv, D, kw = case
    q, kc, vc, pt, sl, cq = build(q_lens, k_lens, ps, Hq, Hkv, D, dtype=dtype, device=device)
    if kw.get("balanced"):  # the balanced split even where the units split would be even
        from llmkernels.attention import plan as plan_mod

        monkeypatch.setattr(plan_mod, "BALANCE_MIN_SKEW", 0.0)
    p = lk.plan_paged_attention(cq.cpu(), sl.cpu(), ps, Hq, Hkv, D, q_dtype=dtype, kv_dtype=dtype, device=device,
                                num_splits=kw.get("num_splits", 0))
    assert p.ws_decode
    out = poison(torch.empty_like(q))
    lk.paged_attention(q, kc, vc, pt, sl, cq, 1, plan=p, out=out)
    ref, _ = paged_attention_ref(q, kc, vc, pt, sl, cq)
    assert_close(out, ref, dtype, "o")
    assert launches, "the call did not take the Gluon kernel"
    assert launches[-1] == bool(p.balanced), "the plan's split mode is the one launched"
    assert not (p.balanced and "num_splits" in kw), "a fixed num_splits keeps the units (batch-invariant)"
    # the calls it cannot take fall back to the Triton kernel with the same plan
    n = len(launches)
    o, lse = lk.paged_attention(q, kc, vc, pt, sl, cq, 1, plan=p, return_lse=True)
    ro, rl = paged_attention_ref(q, kc, vc, pt, sl, cq)
    assert_close(o, ro, dtype, "o")
    assert_close(lse, rl, torch.float32, "lse", atol=2e-3, rtol=2e-3)
    assert len(launches) == n


@pytest.mark.gpu
@pytest.mark.parametrize("lead, stages", [(-1, 4), (0, 3), (1, 3), (1, 4), (2, 3), (2, 4)])
@pytest.mark.parametrize("case", [WS_CASES[i] for i in (0, 1, 4, 6)], ids=lambda c: f"k{c[1][:3]}p{c[2]}H{c[3]}/{c[4]}")
def test_ws_decode_loader_orders_gpu(case, lead, stages, device, monkeypatch):
    # the loader's orders of a 16-bit cache's copies (paged_ws's LEAD: a slot's halves freed together or apart, V
    # copies up to two tiles behind K, carried across units and pieces) and ring depths of three and four slots
    from llmkernels.attention import paged_ws
    from llmkernels.attention import plan as plan_mod

    need_sm90()
    monkeypatch.setattr(paged_ws, "KV_LEAD", lead)
    monkeypatch.setattr(paged_ws, "STAGES", stages)
    monkeypatch.setattr(paged_ws, "STAGES_LEAD", stages)
    launches = _spy_ws(monkeypatch)
    q_lens, k_lens, ps, Hq, Hkv, D, kw = case
    q, kc, vc, pt, sl, cq = build(q_lens, k_lens, ps, Hq, Hkv, D, dtype=torch.bfloat16, device=device)
    if kw.get("balanced"):
        monkeypatch.setattr(plan_mod, "BALANCE_MIN_SKEW", 0.0)
    p = lk.plan_paged_attention(cq.cpu(), sl.cpu(), ps, Hq, Hkv, D, q_dtype=q.dtype, kv_dtype=q.dtype, device=device,
                                num_splits=kw.get("num_splits", 0))
    out = poison(torch.empty_like(q))
    lk.paged_attention(q, kc, vc, pt, sl, cq, 1, plan=p, out=out)
    ref, _ = paged_attention_ref(q, kc, vc, pt, sl, cq)
    assert_close(out, ref, torch.bfloat16, "o")
    assert launches, "the call did not take the Gluon kernel"


@pytest.mark.gpu
@pytest.mark.parametrize("consumers", [1, 2])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("case", WS_CASES, ids=lambda c: f"k{c[1][:3]}p{c[2]}H{c[3]}/{c[4]}D{c[5]}")
def test_ws_decode_fp8_gpu(case, kv_dtype, consumers, device, monkeypatch):
    from llmkernels.attention import plan as plan_mod
    from llmkernels.attention import schedule

    need_sm90()
    monkeypatch.setattr(schedule, "FP8_CONSUMERS", consumers)  # two: alternate key tiles, merged per unit
    launches = _spy_ws(monkeypatch)
    q_lens, k_lens, ps, Hq, Hkv, D, kw = case
    scales = (0.04, 0.03)
    q, kc, vc, pt, sl, cq = build(q_lens, k_lens, ps, Hq, Hkv, D, dtype=torch.bfloat16, kv_dtype=kv_dtype,
                                  device=device, scales=scales)
    if kw.get("balanced"):
        monkeypatch.setattr(plan_mod, "BALANCE_MIN_SKEW", 0.0)
    p = lk.plan_paged_attention(cq.cpu(), sl.cpu(), ps, Hq, Hkv, D, q_dtype=q.dtype, kv_dtype=kv_dtype,
                                device=device, num_splits=kw.get("num_splits", 0))
    assert p.ws_decode
    ref, _ = paged_attention_ref(q, kc, vc, pt, sl, cq, k_scale=scales[0], v_scale=scales[1])
    # scales as floats, and as one-element tensors (read in the kernel)
    for ks, vs in (scales, (torch.tensor(scales[0], device=device), torch.tensor([scales[1]], device=device))):
        out = poison(torch.empty_like(q))
        lk.paged_attention(q, kc, vc, pt, sl, cq, 1, plan=p, out=out, k_scale=ks, v_scale=vs)
        assert_close(out, ref, torch.bfloat16, "o")
    assert len(launches) == 2, "the calls did not take the Gluon kernel"
    assert launches[-1] == bool(p.balanced)
    if not p.balanced and plan_mod.tma_pages(ps):  # the ring the call chose (TMA pages), in the plan's words
        from llmkernels.attention.schedule import fp8_ring

        units = p.launches[0].capacity * Hkv * p.num_splits
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        assert f"a ring of {fp8_ring(units, sms, Hq // Hkv)} TMA" in p.describe()


# (q lens, k lens, page size, Hq, Hkv, D, plan kwargs, left window, soft cap): windows shorter and longer than the
# sequences, starting inside a key tile and on its first key, with split units; D 256 as Gemma-2 has it; caps of a
# few units, which bend scores of standard deviation 1
WS_WINDOW_CASES = [
    ([1] * 6, [1, 17, 100, 1000, 4097, 65], 16, 16, 8, 256, {}, 4095, 5.0),
    ([1] * 5, [300, 31, 999, 1, 2000], 16, 16, 8, 256, dict(num_splits=3), 127, 0.0),
    ([1] * 5, [300, 31, 999, 1, 2000], 16, 32, 8, 128, {}, 200, 3.0),
    ([1] * 4, [130, 64, 65, 3000], 32, 28, 4, 128, dict(num_splits=2), 63, 0.0),
    ([1], [30011], 16, 32, 8, 128, dict(balanced=True), 1000, 4.0),  # the balanced plan: windows run its units
    ([1] * 3, [333, 800, 257], 16, 16, 2, 256, dict(num_splits=1), -1, 2.5),
]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("case", WS_WINDOW_CASES, ids=lambda c: f"k{c[1][:2]}D{c[5]}w{c[7]}c{int(c[8])}")
def test_ws_decode_window_softcap_gpu(case, kv_dtype, device, monkeypatch):
    from llmkernels.attention import plan as plan_mod

    need_sm90()
    q_lens, k_lens, ps, Hq, Hkv, D, kw, left, cap = case
    fp8 = kv_dtype == torch.float8_e4m3fn
    if fp8 and D == 256:
        pytest.skip("head dim 256 with an fp8 cache runs the Triton kernel")
    launches = _spy_ws(monkeypatch)
    dtype = torch.bfloat16 if fp8 else kv_dtype
    scales = (0.05, 0.04) if fp8 else (None, None)
    q, kc, vc, pt, sl, cq = build(q_lens, k_lens, ps, Hq, Hkv, D, dtype=dtype, kv_dtype=kv_dtype, device=device,
                                  **({"scales": scales} if fp8 else {}))
    if kw.get("balanced"):
        monkeypatch.setattr(plan_mod, "BALANCE_MIN_SKEW", 0.0)
    p = lk.plan_paged_attention(cq.cpu(), sl.cpu(), ps, Hq, Hkv, D, q_dtype=dtype, kv_dtype=kv_dtype, device=device,
                                num_splits=kw.get("num_splits", 0))
    assert p.ws_decode and (p.balanced or not kw.get("balanced"))
    out = poison(torch.empty_like(q))
    lk.paged_attention(q, kc, vc, pt, sl, cq, 1, plan=p, out=out, window_size=(left, -1), softcap=cap,
                       k_scale=scales[0], v_scale=scales[1])
    ref, _ = paged_attention_ref(q, kc, vc, pt, sl, cq, window_size=(left, -1), softcap=cap, k_scale=scales[0],
                                 v_scale=scales[1])
    assert_close(out, ref, dtype, "o")
    # a window runs the plan's split units even where the plan chose the balanced split (which has no window)
    assert launches == [bool(p.balanced) and left < 0], "the call took the Gluon kernel, in the expected mode"


@pytest.mark.gpu
def test_ws_decode_cuda_graph_replay_with_new_lengths(device, monkeypatch):
    from llmkernels.attention import plan as plan_mod

    need_sm90()
    launches = _spy_ws(monkeypatch)
    monkeypatch.setattr(plan_mod, "BALANCE_MIN_SKEW", 0.0)  # the balanced split, whose tables update() refills
    plan = _graph_replay(device, 600, num_splits=0)  # the capture's stream has no counters: units split
    assert plan.ws_decode and plan.num_splits > 1 and plan.balanced
    assert launches == [True, False]
    launches.clear()
    _graph_replay(device, 600, num_splits=0, warm_stream=True)
    assert launches == [True, True]


@pytest.mark.gpu
def test_ws_decode_balanced_without_counters_falls_back_to_units(device, monkeypatch):
    from llmkernels.attention import paged

    need_sm90()
    launches = _spy_ws(monkeypatch)
    monkeypatch.setattr(paged, "split_counters", lambda device: None)
    q, kc, vc, pt, sl, cq = build([1] * 2, [3000, 70], 16, 16, 4, 128, dtype=torch.bfloat16, device=device)
    p = lk.plan_paged_attention(cq.cpu(), sl.cpu(), 16, 16, 4, 128, q_dtype=q.dtype, kv_dtype=kc.dtype,
                                device=device)
    assert p.balanced and p.num_splits > 1
    out = poison(torch.empty_like(q))
    lk.paged_attention(q, kc, vc, pt, sl, cq, 1, plan=p, out=out)
    ref, _ = paged_attention_ref(q, kc, vc, pt, sl, cq)
    assert_close(out, ref, torch.bfloat16, "o")
    assert launches == [False]


def test_ws_plan_takes_fp8_caches(monkeypatch):
    # fp8 caches run the Gluon kernel like 16-bit ones; a 16-bit cache of another dtype than q does not
    from llmkernels.attention import plan as plan_mod
    from llmkernels.attention import prefill

    monkeypatch.setattr(plan_mod, "interpreter_mode", lambda: False)
    monkeypatch.setattr(plan_mod, "num_sms", lambda device: 132)
    monkeypatch.setattr(prefill, "_gluon_hopper", lambda index: True)
    cuda = torch.device("cuda", 0)

    def ws(B, L, kv):
        q_lens, k_lens = np.ones(B, np.int64), np.full(B, L, np.int64)
        return plan_mod._ws_decode(cuda, q_lens, k_lens, 16, 8, 128, 4, torch.bfloat16, kv)

    assert ws(1, 32768, FP8) and ws(16, 4096, FP8) and ws(16, 4096, torch.float8_e5m2)
    assert ws(17, 4096, FP8) and ws(64, 1024, FP8)  # 136 and 512 programs for 132 SMs
    assert ws(64, 1024, torch.bfloat16) and ws(17, 4096, torch.bfloat16)
    assert not ws(1, 1000, FP8)  # below WS_DECODE_MIN_BYTES
    assert not ws(16, 4096, torch.float16)  # a 16-bit cache must be q's dtype


def test_fp8_ring_deepens_only_for_several_units_per_program(monkeypatch):
    from llmkernels.attention import schedule
    from llmkernels.attention.schedule import FP8_STAGES, FP8_STAGES_MULTI, fp8_ring

    monkeypatch.setattr(schedule, "FP8_CONSUMERS", 1)
    assert FP8_STAGES_MULTI > FP8_STAGES >= 3
    assert fp8_ring(128, 132) == fp8_ring(132, 132) == FP8_STAGES  # e.g. B=1 x 8 heads x 16 splits, B=16 x 8
    assert fp8_ring(133, 132) == fp8_ring(512, 132) == FP8_STAGES_MULTI  # e.g. B=64 x 8 heads
    # two consumers on alternate tiles hold up to six slots: a smaller ring would deadlock
    monkeypatch.setattr(schedule, "FP8_CONSUMERS", 2)
    assert min(fp8_ring(u, 132, g) for u in (128, 512) for g in (1, 4, 8)) >= 6
    assert fp8_ring(128, 132, 12) == FP8_STAGES  # larger groups keep one consumer


def test_ws_decode_two_consumers_only_for_fp8():
    from llmkernels.attention import paged_ws

    q = torch.zeros(1, 8, 128, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="consumers must be 1, or 2 for an fp8 cache"):
        paged_ws.launch_decode_ws(q, (cache, cache), q, q, None, None, None, None, None, 4, 16, 1, 1.0, 1,
                                  gather=True, consumers=2)


def test_ws_plan_mixed_batches(monkeypatch):
    # a mixed batch sends its one-query sequences to the Gluon kernel and its long tiles to the Triton kernel
    # (two streams) when neither needs split-KV; otherwise the Triton kernel takes both
    from llmkernels.attention import plan as plan_mod

    monkeypatch.setattr(plan_mod, "_ws_decode", lambda *a: True)
    monkeypatch.setattr(plan_mod, "num_sms", lambda device: 132)

    def plan(q_lens, k_lens, **kw):
        cq = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
        return lk.plan_paged_attention(cq, torch.tensor(k_lens, dtype=torch.int32), 16, 32, 8, 128,
                                       q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, device="cpu", **kw)

    p = plan([512] + [1] * 63, [4096] * 64)  # (63 + 32 tiles) x 8 heads = 760 programs
    assert p.variant == "mixed" and p.ws_decode and p.num_splits == 1 and "concurrently" in p.describe()
    assert [(ln.name, ln.block_q) for ln in p.launches] == [("short", 4), ("long", 32)]  # 128-row long tiles
    assert p.ws_maxnreg == 128  # 16-bit cache: the Gluon kernel leaves room for a Triton program on each SM
    assert not plan([64] + [1] * 8, [4096] * 9).ws_decode  # 12 x 8 programs < 132 SMs: the plan splits KV
    assert not plan([512] + [1] * 63, [4096] * 64, num_splits=2).ws_decode
    monkeypatch.setattr(plan_mod, "MIXED_WS", False)
    assert not plan([512] + [1] * 63, [4096] * 64).ws_decode
    monkeypatch.setattr(plan_mod, "MIXED_WS", True)
    # the plan's decode kernel takes one query per short sequence: an update with a 2-query one is refused, long
    # sequences of any length are fine
    p.update(torch.tensor([0, 100] + [101 + i for i in range(63)], dtype=torch.int32),
             torch.full((64,), 4000, dtype=torch.int32))
    with pytest.raises(ValueError, match="one-query-per-sequence decode kernel"):
        p.update(torch.tensor([0, 100, 102] + [103 + i for i in range(62)], dtype=torch.int32),
                 torch.full((64,), 4000, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_ws_decode_mixed_batch_gpu(kv_dtype, device, monkeypatch):
    # the decode part on the Gluon kernel, the long tiles on the Triton kernel in a second stream: eager, then
    # captured in a CUDA graph (the side stream forks and joins inside the capture) and replayed with new queries
    need_sm90()
    launches = _spy_ws(monkeypatch)
    q_lens = [37, 70] + [1] * 15  # 20 (16-bit) or 23 (fp8) tiles x 8 kv heads >= the SMs: no split
    k_lens = [300, 4097] + [(613 * i) % 2500 + 1 for i in range(15)]
    scales = (0.04, 0.03) if kv_dtype != torch.bfloat16 else None
    q, kc, vc, pt, sl, cq = build(q_lens, k_lens, 16, 32, 8, 128, dtype=torch.bfloat16, kv_dtype=kv_dtype,
                                  device=device, scales=scales)
    p = lk.plan_paged_attention(cq.cpu(), sl.cpu(), 16, 32, 8, 128, q_dtype=q.dtype, kv_dtype=kc.dtype,
                                device=device)
    assert p.variant == "mixed" and p.ws_decode and p.num_splits == 1
    kw = dict(k_scale=scales[0], v_scale=scales[1]) if scales else {}
    out = poison(torch.empty_like(q))
    lk.paged_attention(q, kc, vc, pt, sl, cq, max(q_lens), plan=p, out=out, **kw)
    ref, _ = paged_attention_ref(q, kc, vc, pt, sl, cq, **kw)
    assert_close(out, ref, torch.bfloat16, "o")
    assert len(launches) == 1, "the decode sequences did not take the Gluon kernel"
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        lk.paged_attention(q, kc, vc, pt, sl, cq, max(q_lens), plan=p, out=out, validate=False, **kw)
    for _ in range(2):
        q.copy_(torch.randn_like(q))
        out.copy_(poison(torch.empty_like(q)))
        g.replay()
        ref, _ = paged_attention_ref(q, kc, vc, pt, sl, cq, **kw)
        assert_close(out, ref, torch.bfloat16, "o")
