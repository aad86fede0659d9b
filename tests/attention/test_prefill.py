"""flash_attn_varlen / flash_attn against the float64 reference."""
import pytest
import torch

import llmkernels as lk
from llmkernels.testing import assert_close, flash_attn_varlen_ref, poison

from .gluon_helpers import need_sm90, sm90_compile_report, sm90_sass, sm90_spill_bytes, spy

# (q_lens, k_lens, Hq, Hkv, D, causal, window, softcap, sinks)
CPU_CASES = [
    ([5, 37], [5, 37], 4, 2, 64, True, (-1, -1), 0.0, False),
    ([3, 0, 33], [40, 7, 33], 4, 4, 32, True, (-1, -1), 0.0, False),  # empty sequence, q_len != k_len
    ([33, 20], [50, 20], 6, 2, 80, False, (8, 3), 0.0, False),  # padded head dim, two-sided window
    ([33, 20], [33, 70], 7, 1, 64, True, (16, -1), 30.0, True),  # MQA, group 7, window + softcap + sinks
    ([40], [20], 2, 1, 32, True, (-1, -1), 0.0, False),  # q_len > k_len: early queries see nothing
    ([1, 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53], None, 2, 2, 32, True, (-1, -1), 0.0, False),
    ([31], [31], 2, 1, 96, False, (-1, -1), 5.0, False),
    # several unmasked key blocks per query block: the software-pipelined loop (and its one-block edge, k = 64)
    ([70, 9, 20], [130, 64, 45], 4, 2, 64, False, (-1, -1), 0.0, False),
    ([101], [101], 2, 1, 32, True, (-1, -1), 0.0, True),
]


def make(q_lens, k_lens, Hq, Hkv, D, dtype, device):
    k_lens = k_lens or q_lens
    cq = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32).to(device)
    ck = torch.tensor([0] + k_lens).cumsum(0).to(torch.int32).to(device)
    q = torch.randn(int(cq[-1]), Hq, D, dtype=dtype, device=device)
    k = torch.randn(int(ck[-1]), Hkv, D, dtype=dtype, device=device)
    v = torch.randn(int(ck[-1]), Hkv, D, dtype=dtype, device=device)
    return q, k, v, cq, ck, max(q_lens), max(k_lens)


def check(case, dtype, device):
    q_lens, k_lens, Hq, Hkv, D, causal, window, softcap, sinks = case
    q, k, v, cq, ck, mq, mk = make(q_lens, k_lens, Hq, Hkv, D, dtype, device)
    s = torch.randn(Hq, device=device) if sinks else None
    out = poison(torch.empty_like(q))
    o, lse = lk.flash_attn_varlen(q, k, v, cq, ck, mq, mk, causal=causal, window_size=window, softcap=softcap,
                                  sinks=s, return_lse=True, out=out)
    assert o.data_ptr() == out.data_ptr()
    ro, rl = flash_attn_varlen_ref(q, k, v, cq, ck, causal=causal, window_size=window, softcap=softcap, sinks=s)
    assert_close(o, ro, dtype, "o")
    assert_close(lse, rl, torch.float32, "lse", atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: f"q{c[0][:3]}k{(c[1] or c[0])[:3]}H{c[2]}/{c[3]}D{c[4]}")
def test_varlen_fp16(case, device):
    check(case, torch.float16, device)


def test_dense_wrapper_and_softmax_scale(device):
    q = torch.randn(2, 19, 4, 32, dtype=torch.float16, device=device)
    k = torch.randn(2, 23, 2, 32, dtype=torch.float16, device=device)
    v = torch.randn(2, 23, 2, 32, dtype=torch.float16, device=device)
    o = lk.flash_attn(q, k, v, causal=True, softmax_scale=0.3)
    for b in range(2):
        ref, _ = lk.testing.attention_ref(q[b], k[b], v[b], causal=True, softmax_scale=0.3)
        assert_close(o[b], ref, torch.float16)


def test_fused_qkv_views(device):
    T, Hq, Hkv, D = 29, 4, 2, 32
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, dtype=torch.float16, device=device)
    q = qkv[:, :Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
    assert not q.is_contiguous()
    cu = torch.tensor([0, 12, 29], dtype=torch.int32, device=device)
    o = lk.flash_attn_varlen(q, k, v, cu, cu, 17, 17, causal=True)
    ref, _ = flash_attn_varlen_ref(q, k, v, cu, cu, causal=True)
    assert_close(o, ref, torch.float16)


@pytest.mark.parametrize("tma", [0, 1])
@pytest.mark.parametrize("layout", ["packed", "fused_qkv", "heads_strided"])
def test_unmasked_loop_tma_and_pointer_loads(tma, layout, device, monkeypatch):
    # long sequences so most key blocks take the unmasked loop; TMA loads there where the layout allows
    from llmkernels.attention.prefill import _kv_descriptors
    from llmkernels.tuning import OVERRIDES

    if device.type == "cpu":
        monkeypatch.setitem(OVERRIDES, ("prefill", "interpret"), (16, 16, 4, 1, 1, tma))
    else:
        for key in ("float16/32/full", "float16/32/causal"):
            monkeypatch.setitem(OVERRIDES, ("prefill", key), (64, 16, 4, 2, 1, tma))
    lens, Hq, Hkv, D = [70, 3, 45], 4, 2, 32
    T = sum(lens)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).to(device)
    if layout == "packed":
        k, v = (torch.randn(T, Hkv, D, dtype=torch.float16, device=device) for _ in range(2))
    elif layout == "fused_qkv":
        qkv = torch.randn(T, (Hq + 2 * Hkv) * D, dtype=torch.float16, device=device)
        k = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
        v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
    else:  # heads 2 * D apart: no [tokens, heads * D] view, so no descriptor
        k, v = (torch.randn(T, Hkv, 2 * D, dtype=torch.float16, device=device)[:, :, :D] for _ in range(2))
    assert (_kv_descriptors(k, v, 16) is None) == (layout == "heads_strided")
    q = torch.randn(T, Hq, D, dtype=torch.float16, device=device)
    for causal in (False, True):
        out = poison(torch.empty_like(q))
        lk.flash_attn_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=causal, out=out)
        ref, _ = flash_attn_varlen_ref(q, k, v, cu, cu, causal=causal)
        assert_close(out, ref, torch.float16)


def test_kv_descriptors_need_a_power_of_two_head_dim(device):
    from llmkernels.attention.prefill import _kv_descriptors

    k = torch.randn(9, 2, 80, dtype=torch.float16, device=device)
    assert _kv_descriptors(k, k, 16) is None
    assert _kv_descriptors(k[:, :, :64], k[:, :, :64], 16) is None  # heads 80 apart
    k = torch.randn(9, 2, 64, dtype=torch.float16, device=device)
    assert len(_kv_descriptors(k, k, 16)) == 2


def test_all_queries_empty(device):
    q, k, v, cq, ck, _, _ = make([0, 0], [3, 0], 2, 1, 32, torch.float16, device)
    o, lse = lk.flash_attn_varlen(q, k, v, cq, ck, 0, 3, return_lse=True)
    assert o.shape == (0, 2, 32) and lse.shape == (0, 2)


def _inputs(device):
    return make([4, 5], [4, 5], 4, 2, 32, torch.float16, device)


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda a: a.update(q=a["q"].float()), TypeError, "q must have dtype"),
    (lambda a: a.update(k=a["k"].to(torch.bfloat16), v=a["v"].to(torch.bfloat16)), TypeError, "k must have q's"),
    (lambda a: a.update(k=a["k"][:, :1].expand(-1, 3, -1), v=a["v"][:, :1].expand(-1, 3, -1)), ValueError,
     "multiple of num_kv_heads"),
    (lambda a: a.update(cq=a["cq"].long()), TypeError, "cu_seqlens_q must have dtype"),
    (lambda a: a.update(cq=torch.tensor([0, 6, 4, 9], dtype=torch.int32)), ValueError, "non-decreasing"),
    (lambda a: a.update(ck=a["ck"][:2]), ValueError, "cu_seqlens_k must have shape"),
    (lambda a: a.update(cq=torch.tensor([0, 4, 8], dtype=torch.int32)), ValueError, "must equal the number"),
    (lambda a: a.update(q=torch.randn(9, 4, 48, dtype=torch.float16), k=torch.randn(9, 2, 48, dtype=torch.float16),
                        v=torch.randn(9, 2, 48, dtype=torch.float16)), ValueError, "head_dim must be one of"),
    (lambda a: a.update(window=(3,)), TypeError, "window_size"),
    (lambda a: a.update(window=(-2, 0)), ValueError, "window_size"),
    (lambda a: a.update(q=a["q"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "contiguous last dim"),
])
def test_bad_input(mutate, exc, match, device):
    q, k, v, cq, ck, mq, mk = _inputs(device)
    args = dict(q=q, k=k, v=v, cq=cq.to(device), ck=ck.to(device), window=(-1, -1))
    mutate(args)
    for name in ("q", "k", "v", "cq", "ck"):
        args[name] = args[name].to(device)
    with pytest.raises(exc, match=match):
        lk.flash_attn_varlen(args["q"], args["k"], args["v"], args["cq"], args["ck"], mq, mk,
                             window_size=args["window"])


def test_torch_compile_traces(device):
    if device.type != "cuda":
        pytest.skip("torch.compile of Triton ops is exercised on the GPU")
    q, k, v, cq, ck, mq, mk = make([17, 30], None, 4, 2, 64, torch.bfloat16, device)
    f = torch.compile(lambda q, k, v: lk.flash_attn_varlen(q, k, v, cq, ck, mq, mk, causal=True), fullgraph=True)
    ref, _ = flash_attn_varlen_ref(q, k, v, cq, ck, causal=True)
    assert_close(f(q, k, v), ref, torch.bfloat16)


GPU_CASES = [
    ([1000, 1, 2049, 0, 517], [1000, 1, 2049, 5, 600], 32, 8, 128, True, (-1, -1), 0.0, False),
    ([777, 2048], None, 16, 16, 64, False, (-1, -1), 0.0, False),
    ([1024], [1024], 8, 1, 256, True, (-1, -1), 0.0, False),
    ([1030, 333], None, 12, 4, 96, True, (256, -1), 0.0, True),
    ([500, 900], [700, 900], 8, 2, 192, False, (100, 100), 50.0, False),
    ([4096], None, 8, 8, 32, True, (-1, -1), 0.0, False),
    ([3000], [3000], 14, 2, 80, True, (-1, -1), 0.0, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"q{c[0][:2]}H{c[2]}/{c[3]}D{c[4]}c{int(c[5])}")
def test_varlen_gpu(case, dtype, device):
    check(case, dtype, device)


@pytest.mark.gpu
def test_batch_of_17_uneven_bf16(device):
    lens = [int(x) for x in torch.randint(1, 700, (17,))]
    check((lens, None, 8, 2, 128, True, (-1, -1), 0.0, False), torch.bfloat16, device)


@pytest.mark.gpu
def test_offsets_past_2_31_bytes(device):
    # q, k, v of 2**30 elements each (2 GiB in bf16): token offsets * strides pass 2**31 bytes
    T, H, D = 2 ** 30 // (16 * 128), 16, 128
    q = torch.randn(T, H, D, dtype=torch.bfloat16, device=device)
    cu = torch.tensor([0, T - 300, T], dtype=torch.int32, device=device)
    o = lk.flash_attn_varlen(q, q, q, cu, cu, T - 300, T - 300, causal=True, window_size=(64, 0))
    ref, _ = flash_attn_varlen_ref(q[T - 300:], q[T - 300:], q[T - 300:],
                                   torch.tensor([0, 300], dtype=torch.int32, device=device),
                                   torch.tensor([0, 300], dtype=torch.int32, device=device), causal=True,
                                   window_size=(64, 0))
    assert_close(o[T - 300:], ref, torch.bfloat16)


# --- the warp-specialized Gluon kernel (attention/prefill_ws.py): sm_90, head dims 64 and 128 ---------------------

WS_CASES = [
    ([1, 63, 64, 65, 127, 128, 129, 300, 1000], None, 8, 2, 128, True),
    ([1, 63, 64, 65, 127, 128, 129, 300, 1000], None, 8, 2, 128, False),
    ([5, 200, 0, 130], [300, 200, 7, 1000], 7, 1, 128, True),  # q_len != k_len, group 7, an empty sequence
    ([5, 200, 0, 130], [300, 200, 7, 1000], 7, 1, 128, False),
    ([40, 300], [20, 100], 4, 4, 64, True),  # q_len > k_len: the first queries see no key (o = 0, lse = -inf)
    ([2003], None, 4, 1, 64, False),
    ([5, 200, 0, 130, 333], [300, 200, 7, 1000, 333], 8, 2, 256, True),  # D=256
    ([5, 200, 0, 130, 333], [300, 200, 7, 1000, 333], 8, 2, 256, False),
]


def test_ws_config_reads_the_table(monkeypatch):
    from llmkernels.attention.prefill import ws_config
    from llmkernels.tuning import OVERRIDES

    monkeypatch.setitem(OVERRIDES, ("prefill", "bfloat16/128/causal/ws"), [128, 3])
    monkeypatch.setitem(OVERRIDES, ("prefill", "bfloat16/128/full/ws"), [0, 0])
    assert ws_config(torch.bfloat16, 128, True) == (128, 3, 0, 0, 0)
    assert ws_config(torch.bfloat16, 128, False) is None
    monkeypatch.setitem(OVERRIDES, ("prefill", "bfloat16/128/full/ws"), [128, 2, 1, 2])
    assert ws_config(torch.bfloat16, 128, False) == (128, 2, 1, 2, 0)
    monkeypatch.setitem(OVERRIDES, ("prefill", "float8_e4m3fn/128/full/ws"), [256, 2, 0, 0, 1])
    assert ws_config(torch.float8_e4m3fn, 128, False) == (256, 2, 0, 0, 1)
    # a hand-edited user table: refused, named (PERM is an fp8 option)
    for bad in ([128, 2, 1, 3], [128, 2, 2], [128, 2, 1, 1, 1], [128, 2, 1, 1, 0, 0]):
        monkeypatch.setitem(OVERRIDES, ("prefill", "bfloat16/128/full/ws"), bad)
        with pytest.raises(ValueError, match="bfloat16/128/full/ws"):
            ws_config(torch.bfloat16, 128, False)


@pytest.mark.parametrize("block_n, stages, head_dim, causal, overlap, persist", [
    (128, 2, 128, True, 0, 0), (64, 3, 64, False, 0, 0), (64, 2, 256, True, 0, 0),
    (128, 2, 128, True, 1, 0), (128, 3, 128, False, 1, 0), (128, 3, 64, False, 1, 0), (64, 2, 256, True, 1, 0),
    (128, 2, 128, True, 1, 2), (128, 2, 128, False, 1, 1), (128, 3, 64, True, 0, 2), (64, 2, 256, False, 1, 1)])
def test_ws_kernel_compiles_for_sm90_without_spills(block_n, stages, head_dim, causal, overlap, persist):
    # compiled for sm_90 on any machine (ptxas ships with Triton): catches a kernel that no longer builds, or one
    # that uses local memory (spills), where CI has no GPU
    call = f"prefill_ws.compile_sm90({block_n}, {stages}, {head_dim}, {causal}, overlap={overlap}, persist={persist})"
    got = sm90_compile_report(call, {"wgmma": "wgmma.mma_async", "setmaxnreg": "setmaxnreg", "local": ".local"})
    assert got == {"wgmma": True, "setmaxnreg": True, "local": False}
    assert sm90_spill_bytes(call) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case, config", [(c, cfg) for c in WS_CASES
                                          for cfg in ([(64, 2), (64, 2, 1), (64, 2, 1, 1)] if c[4] == 256 else
                                                      [(128, 2), (128, 3), (64, 3), (128, 2, 1), (128, 3, 1),
                                                       (128, 2, 1, 1), (64, 3, 0, 2)])],
                         ids=lambda c: f"q{c[0][:3]}H{c[2]}/{c[3]}D{c[4]}c{int(c[5])}" if len(c) == 6 else
                         "/".join(map(str, c)))
def test_ws_kernel_gpu(case, config, dtype, device, monkeypatch):
    # every tuning candidate for its head dim (D=256 fits only 64 keys x 2 stages in shared memory), one product
    # after the other and overlapped (a third field of 1), a program per tile and persistent (a fourth of 1)
    from llmkernels.attention import prefill, prefill_ws
    from llmkernels.tuning import OVERRIDES

    need_sm90()
    monkeypatch.setattr(prefill, "WS_MIN_WORK", 0)  # small test shapes would take the Triton kernel
    q_lens, k_lens, Hq, Hkv, D, causal = case
    key = f"{str(dtype).replace('torch.', '')}/{D}/{'causal' if causal else 'full'}/ws"
    monkeypatch.setitem(OVERRIDES, ("prefill", key), list(config))
    launches = spy(monkeypatch, prefill_ws, "launch_ws")
    check((q_lens, k_lens, Hq, Hkv, D, causal, (-1, -1), 0.0, False), dtype, device)
    assert launches, "the call did not take the Gluon kernel"


@pytest.mark.gpu
def test_ws_kernel_fused_qkv_views_and_fallbacks(device, monkeypatch):
    from llmkernels.attention import prefill, prefill_ws

    need_sm90()
    monkeypatch.setattr(prefill, "WS_MIN_WORK", 0)
    launches = spy(monkeypatch, prefill_ws, "launch_ws")
    T, Hq, Hkv, D = 333, 8, 2, 128
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, dtype=torch.bfloat16, device=device)
    q = qkv[:, :Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
    cu = torch.tensor([0, 130, 333], dtype=torch.int32, device=device)
    for kw in ({}, {"window_size": (64, -1)}, {"softcap": 20.0}):  # the last two take the Triton kernel
        n = len(launches)
        out = poison(torch.empty_like(q))
        lk.flash_attn_varlen(q, k, v, cu, cu, 203, 203, causal=True, out=out, **kw)
        ref, _ = flash_attn_varlen_ref(q, k, v, cu, cu, causal=True, **kw)
        assert_close(out, ref, torch.bfloat16)
        assert len(launches) == n + (0 if kw else 1)


# --- fp8 (e4m3) q / k / v with per-tensor descale factors ----------------------------------------------------------

def make_fp8(q_lens, k_lens, Hq, Hkv, D, device, tensors):
    """fp8 q/k/v and their descales: floats (tensors False), 1-element tensors (True) or per-head tensors
    ("heads"), with the dequantized float32 values."""
    q, k, v, cq, ck, mq, mk = make(q_lens, k_lens, Hq, Hkv, D, torch.float32, device)
    # the stored value times its descale is the value
    heads = (Hq, Hkv, Hkv) if tensors == "heads" else (1, 1, 1)
    scales = [(0.5 + torch.rand(n, device=device)) / 4 for n in heads]
    q8, k8, v8 = ((t / s[:, None]).to(torch.float8_e4m3fn) for t, s in zip((q, k, v), scales))
    ds = [s if tensors else s.item() for s in scales]
    deq = [t.float() * s[:, None] for t, s in zip((q8, k8, v8), scales)]
    return (q8, k8, v8), ds, deq, cq, ck, mq, mk


@pytest.mark.parametrize("tensors", [False, True, "heads"])
@pytest.mark.parametrize("case", [([37, 5], [37, 60], 4, 2, 64, True, (-1, -1), 0.0),
                                  ([70, 9], None, 7, 1, 32, False, (16, 4), 20.0)],
                         ids=["causal_gqa", "window_softcap_mqa"])
def test_fp8_inputs_with_descales(case, tensors, device):
    q_lens, k_lens, Hq, Hkv, D, causal, window, softcap = case
    (q8, k8, v8), ds, (q, k, v), cq, ck, mq, mk = make_fp8(q_lens, k_lens, Hq, Hkv, D, device, tensors)
    out = poison(torch.empty(q8.shape, dtype=torch.bfloat16, device=device))
    o, lse = lk.flash_attn_varlen(q8, k8, v8, cq, ck, mq, mk, causal=causal, window_size=window, softcap=softcap,
                                  return_lse=True, out=out, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2])
    assert o.dtype == torch.bfloat16 and o.data_ptr() == out.data_ptr()
    ro, rl = flash_attn_varlen_ref(q, k, v, cq, ck, causal=causal, window_size=window, softcap=softcap)
    assert_close(o, ro, torch.bfloat16, "o")
    assert_close(lse, rl, torch.float32, "lse", atol=2e-3, rtol=2e-3)


def test_fp8_descales_reach_the_kernel_as_given(device):
    # floats become one device tensor per value, made once and reused (no copy from the host per call); tensors
    # pass as they are (no gathering copy per call), per-head ones flagged; a bad value is still refused after a
    # good one was kept
    from llmkernels.attention.prefill import _descales

    q = torch.empty(3, 6, 32, device=device).to(torch.float8_e4m3fn)
    k = torch.empty(5, 2, 32, device=device).to(torch.float8_e4m3fn)
    a = _descales(q, k, True, 0.5, 2, None)
    assert all(t.device == q.device and t.dtype == torch.float32 for t in a[:3])
    assert [t.tolist() for t in a[:3]] == [[0.5], [2.0], [1.0]] and a[3] == 0
    b = _descales(q, k, True, 0.5, 2.0, 1.0)
    assert all(x is y for x, y in zip(a[:3], b[:3]))
    c = _descales(q, k, True, 0.25, 2.0, None)
    assert c[0] is not a[0] and c[0].tolist() == [0.25] and c[1] is a[1]
    with pytest.raises(ValueError, match="v_descale must be a positive float"):
        _descales(q, k, True, 0.5, 2.0, -1.0)
    with pytest.raises(ValueError, match="q_descale must be a positive float"):
        _descales(q, k, True, [0.5], 2.0, None)
    per_head = torch.full((6,), 3.0, device=device)
    one = torch.full((1,), 4.0, device=device)
    d = _descales(q, k, True, per_head, one, torch.arange(1.0, 3.0, device=device))
    assert d[0] is per_head and d[1].data_ptr() == one.data_ptr() and d[2].tolist() == [1.0, 2.0] and d[3] == 0b101
    strided = torch.arange(12.0, device=device)[::2]
    assert _descales(q, k, True, strided, None, None)[0].tolist() == strided.tolist()
    with pytest.raises(ValueError, match="k_descale"):
        _descales(q, k, True, None, torch.ones(3, device=device), None)


def test_fp8_bad_input(device):
    (q8, k8, v8), _, _, cq, ck, mq, mk = make_fp8([9], None, 2, 1, 32, device, False)
    qb = q8.to(torch.bfloat16)
    with pytest.raises(ValueError, match="q_descale apply to fp8"):
        lk.flash_attn_varlen(qb, qb, qb, cq, ck, mq, mk, q_descale=2.0)
    with pytest.raises(TypeError, match="k must have dtype in \\(float8_e4m3fn\\)"):
        lk.flash_attn_varlen(q8, qb, qb, cq, ck, mq, mk)
    with pytest.raises(ValueError, match="v_descale must be a positive float"):
        lk.flash_attn_varlen(q8, k8, v8, cq, ck, mq, mk, v_descale=-1.0)
    with pytest.raises(TypeError, match="out must have dtype in \\(bfloat16\\)"):
        lk.flash_attn_varlen(q8, k8, v8, cq, ck, mq, mk, out=torch.empty(q8.shape, device=device))
    with pytest.raises(ValueError, match="k_descale must have shape \\(1,\\)"):  # one per kv head (1), not per q head
        lk.flash_attn_varlen(q8, k8, v8, cq, ck, mq, mk, k_descale=torch.ones(2, device=device))
    with pytest.raises(TypeError, match="q_descale must have dtype in \\(float32\\)"):
        lk.flash_attn_varlen(q8, k8, v8, cq, ck, mq, mk, q_descale=torch.ones(2, device=device, dtype=torch.float16))


# fp8 tensor-core attention rounds P to e4m3 (3 mantissa bits) for the PV product: about 2% relative RMS error in o on
# random inputs (2.0-2.5% measured on the H200 against float64, emulated rounding agrees; bench/NOTES.md), and
# single elements of rows that see few keys off by up to ~6% of |v|: the fp8 row of the tolerance table, and an RMS
# bound that a wrong tile would break
def assert_fp8_pv_close(o, ref, bound=0.03):
    assert_close(o, ref, torch.float8_e4m3fn, "o")
    o, ref = o.double().cpu(), ref.double().cpu()
    ok = torch.isfinite(ref)
    rel_rms = ((o - ref)[ok].pow(2).mean() / ref[ok].pow(2).mean()).sqrt().item()
    assert rel_rms < bound, f"o: relative RMS error {rel_rms:.4f}"
    return rel_rms


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_inputs_gpu(causal, device, monkeypatch):
    from llmkernels.attention import prefill_ws

    launches = spy(monkeypatch, prefill_ws, "launch_ws")
    (q8, k8, v8), ds, (q, k, v), cq, ck, mq, mk = make_fp8([1000, 333, 4097], None, 8, 2, 128, device, True)
    out = poison(torch.empty(q8.shape, dtype=torch.bfloat16, device=device))
    lk.flash_attn_varlen(q8, k8, v8, cq, ck, mq, mk, causal=causal, out=out, q_descale=ds[0], k_descale=ds[1],
                         v_descale=ds[2])
    ro, _ = flash_attn_varlen_ref(q, k, v, cq, ck, causal=causal)
    if launches:
        assert_fp8_pv_close(out, ro)
    else:  # the Triton kernel widens to fp16: bf16's bound
        assert_close(out, ro, torch.bfloat16, "o")


@pytest.mark.parametrize("block_n, stages, head_dim, causal, overlap, persist, perm", [
    (128, 3, 128, True, 0, 0, 0), (256, 2, 128, False, 0, 0, 1), (64, 2, 256, True, 0, 0, 0),
    (128, 4, 64, True, 0, 0, 0), (128, 3, 128, False, 1, 0, 0), (64, 2, 256, False, 1, 0, 0),
    (128, 4, 64, True, 1, 0, 0), (256, 3, 128, False, 0, 1, 0), (128, 2, 128, True, 0, 2, 1),
    (128, 2, 256, False, 0, 0, 1), (128, 2, 256, True, 0, 2, 1), (128, 2, 64, True, 0, 2, 1),
    (64, 2, 256, True, 1, 1, 0)])
def test_ws_kernel_fp8_compiles_to_fp8_wgmma_without_spills(block_n, stages, head_dim, causal, overlap, persist,
                                                             perm):
    # both products on e4m3 tensor cores (V read as V^T tiles), no register spills (ptxas -v), with the row sums
    # on the tensor cores (the default). Not listed: causal D=128 with 256-key blocks spills 4 bytes with PERM,
    # 12 / 36 in a persistent program
    call = (f"prefill_ws.compile_sm90({block_n}, {stages}, {head_dim}, {causal}, 'fp8e4nv', {overlap}, "
            f"persist={persist}, perm={perm})")
    got = sm90_compile_report(call, {"qk": f"wgmma.mma_async.sync.aligned.m64n{block_n}k32.f32.e4m3.e4m3",
                                     "pv": f"wgmma.mma_async.sync.aligned.m64n{head_dim}k32.f32.e4m3.e4m3"})
    assert got == {"qk": True, "pv": True}
    assert sm90_spill_bytes(call) == 0


@pytest.mark.parametrize("block_n, stages, head_dim, causal, persist", [
    (256, 2, 128, False, 0), (128, 2, 64, True, 2), (128, 2, 256, False, 0)])
def test_ws_kernel_fp8_rowsum_compiles(block_n, stages, head_dim, causal, persist):
    # the row sums on the tensor cores (prefill_ws.FP8_ROWSUM): P times a [BLOCK_N, 8] tile of e4m3 ones, no
    # spills, and the ones stored as bytes 0x38 (a converted 1.0 left the upper half of each packed pair undefined)
    call = (f"prefill_ws.compile_sm90({block_n}, {stages}, {head_dim}, {causal}, 'fp8e4nv', 0, persist={persist}, "
            f"rowsum=True)")
    got = sm90_compile_report(call, {"sums": "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3"})
    assert got == {"sums": True}
    assert sm90_spill_bytes(call) == 0
    assert "0x38383838" in sm90_sass(call)


@pytest.mark.gpu
@pytest.mark.parametrize("case, config", [(c, cfg) for c in WS_CASES
                                          for cfg in ([(64, 2), (64, 3), (64, 2, 1), (128, 2, 0, 1)]
                                                      if c[4] == 256 else
                                                      [(128, 3), (256, 2), (128, 2, 1), (256, 3, 0, 1),
                                                       (128, 2, 1, 1)])],
                         ids=lambda c: f"q{c[0][:3]}H{c[2]}/{c[3]}D{c[4]}c{int(c[5])}" if len(c) == 6 else
                         "/".join(map(str, c)))
def test_ws_kernel_fp8_gpu(case, config, device, monkeypatch):
    # per-head descales, every tuning candidate's ring, V^T tiles over ragged sequences (the pad columns of V^T
    # must be zeros: poisoning them would show as NaN rows)
    _check_ws_fp8(case, config, device, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("case, config", [(c, cfg) for c in WS_CASES
                                          for cfg in ([(128, 2)] if c[4] == 256 else [(256, 2), (128, 2, 0, 2)])],
                         ids=lambda c: f"q{c[0][:3]}H{c[2]}/{c[3]}D{c[4]}c{int(c[5])}" if len(c) == 6 else
                         "/".join(map(str, c)))
@pytest.mark.parametrize("rowsum, perm", [(True, False), (False, True), (True, True)])
def test_ws_kernel_fp8_rowsum_gpu(case, config, rowsum, perm, device, monkeypatch):
    # the row sums on the tensor cores (prefill_ws.FP8_ROWSUM) and the keys in _p_operand's order (the table
    # entry's PERM), each alone and together, against both off on the same inputs: o as accurate (a sum carried in
    # fp8 wgmma's own accumulator fell 6% short at 4096 keys; the [2003] case shows it), the LSE exact where asked
    _check_ws_fp8(case, config, device, monkeypatch, variant=(rowsum, int(perm)))


def _check_ws_fp8(case, config, device, monkeypatch, variant=None):
    """variant (rowsum, perm): the same inputs run as configured with the row sums off first, then with
    prefill_ws.FP8_ROWSUM = rowsum and the table entry's PERM = perm; the error in o may exceed the first run's by
    a tenth at most (both within the fp8 RMS bound and a little). The row sums serve calls without an LSE alone:
    o is checked from such a call, the LSE from another."""
    from llmkernels.attention import prefill, prefill_ws
    from llmkernels.tuning import OVERRIDES

    need_sm90()
    monkeypatch.setattr(prefill, "WS_MIN_WORK", 0)
    q_lens, k_lens, Hq, Hkv, D, causal = case
    key = ("prefill", f"float8_e4m3fn/{D}/{'causal' if causal else 'full'}/ws")
    launches = spy(monkeypatch, prefill_ws, "launch_ws")
    (q8, k8, v8), ds, (q, k, v), cq, ck, mq, mk = make_fp8(q_lens, k_lens, Hq, Hkv, D, device, "heads")
    ro, rl = flash_attn_varlen_ref(q, k, v, cq, ck, causal=causal)
    bound = 0.035 if variant else 0.03
    runs = []
    for rowsum, perm in ([(False, 0), variant] if variant else [(prefill_ws.FP8_ROWSUM, None)]):
        monkeypatch.setattr(prefill_ws, "FP8_ROWSUM", rowsum)
        monkeypatch.setitem(OVERRIDES, key, list(config) if perm is None else [*config, 0, 0, 0][:4] + [perm])
        for return_lse in (False, True):
            launches.clear()
            out = poison(torch.empty(q8.shape, dtype=torch.bfloat16, device=device))
            got = lk.flash_attn_varlen(q8, k8, v8, cq, ck, mq, mk, causal=causal, out=out, return_lse=return_lse,
                                       q_descale=ds[0], k_descale=ds[1], v_descale=ds[2])
            assert launches, "the call did not take the Gluon kernel"
            if return_lse:
                assert_fp8_pv_close(got[0], ro, bound)
                assert_close(got[1], rl, torch.float32, "lse", atol=2e-3, rtol=2e-3)
            else:
                runs.append((got.clone(), assert_fp8_pv_close(got, ro, bound)))
    if variant:
        (o0, base), (o1, err) = runs
        assert err < base * 1.1, f"o: relative RMS error {err:.4f} with {variant}, {base:.4f} without"
        if variant[0]:  # o normalized by the sums of the rounded P: not the same bits
            assert not torch.equal(o0, o1), "the row sums on the tensor cores did not run"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("persist", [1, 2])
@pytest.mark.parametrize("programs", [1, 3, 7])
def test_ws_kernel_persistent_programs_loop_over_tiles(dtype, causal, persist, programs, device, monkeypatch):
    # a persistent grid of a few programs: each loops over many tiles (ragged sequences, tiles past a sequence's
    # end skipped, queries that see no key), the K/V ring's and Q's barrier phases carried from tile to tile;
    # tiles taken in turn (1) or claimed from a counter (2), which must be back at 0 for the next call
    from llmkernels.attention import prefill, prefill_ws
    from llmkernels.tuning import OVERRIDES

    need_sm90()
    monkeypatch.setattr(prefill, "WS_MIN_WORK", 0)
    monkeypatch.setattr(prefill_ws, "num_sms", lambda device=None: programs)
    launches = spy(monkeypatch, prefill_ws, "launch_ws")
    fp8 = dtype == torch.float8_e4m3fn
    D = 128
    name = "float8_e4m3fn" if fp8 else "bfloat16"
    monkeypatch.setitem(OVERRIDES, ("prefill", f"{name}/{D}/{'causal' if causal else 'full'}/ws"),
                        [256, 3, 0, persist] if fp8 else [128, 2, 1, persist])
    q_lens, k_lens = [300, 1, 0, 129, 700], [300, 40, 7, 128, 900]
    if fp8:
        (qx, kx, vx), ds, (q, k, v), cq, ck, mq, mk = make_fp8(q_lens, k_lens, 6, 2, D, device, "heads")
        kw = {"q_descale": ds[0], "k_descale": ds[1], "v_descale": ds[2]}
    else:
        q, k, v, cq, ck, mq, mk = make(q_lens, k_lens, 6, 2, D, dtype, device)
        qx, kx, vx, kw = q, k, v, {}
    out = torch.empty(qx.shape, dtype=torch.bfloat16, device=device)
    ro, rl = flash_attn_varlen_ref(q, k, v, cq, ck, causal=causal)
    for _ in range(2):  # twice: the second call starts from the counter the first left
        out = poison(out)
        o, lse = lk.flash_attn_varlen(qx, kx, vx, cq, ck, mq, mk, causal=causal, out=out, return_lse=True, **kw)
        if fp8:
            assert_fp8_pv_close(o, ro)
        else:
            assert_close(o, ro, dtype, "o")
        assert_close(lse, rl, torch.float32, "lse", atol=2e-3, rtol=2e-3)
    assert len(launches) == 2, "the calls did not take the Gluon kernel"
    if persist == 2:
        from llmkernels._runtime import split_counters

        assert split_counters(out.device, 1, "prefill tiles").item() == 0


def test_causal_tile_group_width_follows_the_kv_bytes():
    # pairs per group of claimed causal tiles: as many as keep their K/V within the L2 budget, 1..CAUSAL_TILE_GROUP
    from llmkernels.attention.prefill_ws import CAUSAL_TILE_GROUP, TILE_GROUP_L2_BYTES, tile_group

    assert (CAUSAL_TILE_GROUP, TILE_GROUP_L2_BYTES) == (8, 24 << 20)
    assert tile_group(16384, 1, 128, 2, 1) == 3  # bf16: 8 MiB of K/V per head
    assert tile_group(16384, 1, 128, 1, 1) == 6  # fp8: 4 MiB
    assert tile_group(4096, 1, 128, 2, 1) == 8  # 2 MiB: capped
    assert tile_group(8192, 1, 128, 2, 4) == 8  # GQA: a kv head's bytes over its 4 query heads
    assert tile_group(1 << 20, 2, 256, 2, 1) == 1  # 256 MiB per head: one pair
    assert tile_group(0, 3, 64, 2, 1) == 8


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [1, 5])
@pytest.mark.parametrize("tile_group", [1, 4, 7])
def test_ws_kernel_causal_tile_groups_cover_every_tile(programs, tile_group, device, monkeypatch):
    # causal tiles claimed from the counter in groups of (sequence, head) pairs, query blocks slowest: 30 pairs
    # leave a last group narrower than the others (except for groups of 1), ragged sequences skip tiles in every
    # group
    from llmkernels.attention import prefill, prefill_ws
    from llmkernels.tuning import OVERRIDES

    need_sm90()
    monkeypatch.setattr(prefill, "WS_MIN_WORK", 0)
    monkeypatch.setattr(prefill_ws, "num_sms", lambda device=None: programs)
    monkeypatch.setattr(prefill_ws, "CAUSAL_TILE_GROUP", tile_group)
    launches = spy(monkeypatch, prefill_ws, "launch_ws")
    monkeypatch.setitem(OVERRIDES, ("prefill", "bfloat16/128/causal/ws"), [128, 2, 1, 2])
    q, k, v, cq, ck, mq, mk = make([300, 1, 0, 129, 700], [300, 40, 7, 128, 900], 6, 2, 128, torch.bfloat16, device)
    ro, rl = flash_attn_varlen_ref(q, k, v, cq, ck, causal=True)
    o, lse = lk.flash_attn_varlen(q, k, v, cq, ck, mq, mk, causal=True, out=poison(torch.empty_like(q)),
                                  return_lse=True)
    assert_close(o, ro, torch.bfloat16, "o")
    assert_close(lse, rl, torch.float32, "lse", atol=2e-3, rtol=2e-3)
    assert len(launches) == 1, "the call did not take the Gluon kernel"


def _nan_buffers(monkeypatch, module):
    """module's torch.empty hands out buffers filled with e4m3 NaN bytes (unwritten elements show)."""
    real_empty = torch.empty

    def nan_empty(*args, **kw):
        t = real_empty(*args, **kw)
        t.view(torch.uint8).fill_(0x7F)
        return t

    monkeypatch.setattr(module.torch, "empty", nan_empty)


def test_fp8_transpose_v_aligns_sequences_and_zero_fills(device, monkeypatch):
    # V^T for the fp8 kernel: each sequence from a 16-byte aligned column (TMA refuses a misaligned innermost
    # start: an illegal instruction), the gaps zero (the last tile reads them). The buffer starts as NaN bytes.
    from llmkernels.attention import prefill_ws

    _nan_buffers(monkeypatch, prefill_ws)

    lens = [37, 0, 5, 16, 100]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).to(device)
    T, H, D = sum(lens), 3, 32
    v = torch.randn(T, H, D, device=device).to(torch.float8_e4m3fn)
    vt = prefill_ws.transpose_v(v, cu, max(lens))
    width = (T + 15) // 16 * 16 + 16 * len(lens)
    assert vt.shape == (H * D, width)
    want = torch.zeros(H * D, width, dtype=torch.uint8)
    starts = [(int(cu[b]) + 15) // 16 * 16 + 16 * b for b in range(len(lens) + 1)]
    for b, n in enumerate(lens):
        assert starts[b] % 16 == 0 and starts[b + 1] - starts[b] >= n
        want[:, starts[b]:starts[b] + n] = v[int(cu[b]):int(cu[b + 1])].cpu().permute(1, 2, 0).reshape(H * D, n).view(
            torch.uint8)
    assert torch.equal(vt.cpu().view(torch.uint8), want)


def test_fp8_transpose_v_permuted_keys(device, monkeypatch):
    # transpose_v(perm=True): sequences from 32-aligned columns, zero gaps, and within each group of 32 keys the
    # order _p_operand gives P, so that P' V^T' equals P V for every sequence (P' reordered as the kernel does)
    from llmkernels.attention import prefill_ws

    _nan_buffers(monkeypatch, prefill_ws)
    lens = [37, 0, 5, 32, 100, 1]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).to(device)
    T, H, D = sum(lens), 2, 16
    v = torch.randn(T, H, D, device=device).to(torch.float8_e4m3fn)
    vt = prefill_ws.transpose_v(v, cu, max(lens), perm=True).cpu()
    width = (T + 31) // 32 * 32 + 32 * len(lens)
    assert vt.shape == (H * D, width)
    vt = vt.float()
    assert torch.isfinite(vt).all()
    starts = [(int(cu[b]) + 31) // 32 * 32 + 32 * b for b in range(len(lens) + 1)]
    for b, n in enumerate(lens):
        span = starts[b + 1] - starts[b]
        assert starts[b] % 32 == 0 and span % 32 == 0 and span >= n
        seq = vt[:, starts[b]:starts[b + 1]]  # [H * D, span]: the sequence's keys (permuted), then zeros
        vs = v[int(cu[b]):int(cu[b + 1])].cpu().float().reshape(n, H * D)
        p = torch.rand(3, span)
        p[:, n:] = 0.0  # keys past the sequence are masked
        pp = p.reshape(3, span // 32, 2, 2, 4, 2).permute(0, 1, 2, 4, 3, 5).reshape(3, span)  # _p_operand's order
        torch.testing.assert_close(pp @ seq.T, p[:, :n] @ vs, rtol=1e-5, atol=1e-5)
        assert (seq.abs().sum(0) > 0).sum() <= n  # every other column is zero


@pytest.mark.parametrize("block_n, head_dim, causal", [(256, 128, False), (128, 64, True)])
def test_ws_kernel_fp8_permuted_keys_need_no_shuffles(block_n, head_dim, causal):
    # with V^T's and P's keys in _p_operand's order, P V's operand comes from the scores without shuffles
    def shuffles(perm):
        call = (f"prefill_ws.compile_sm90({block_n}, 2, {head_dim}, {causal}, 'fp8e4nv', 0, rowsum=True, "
                f"perm={perm})")
        assert sm90_spill_bytes(call) == 0
        return sm90_sass(call).count("SHFL")

    base, perm = shuffles(False), shuffles(True)
    assert perm * 3 < base, (base, perm)


@pytest.mark.gpu
def test_new_lengths_do_not_recompile(device, monkeypatch):
    # max_seqlen_q sets num_m_blocks (1, 16, 17 blocks here): it must not pick a new specialization of either kernel
    from llmkernels.attention import prefill
    from llmkernels.attention.prefill_kernel import flash_fwd_kernel

    kernels = [(flash_fwd_kernel, {"window_size": (1 << 20, -1)})]  # a window: the Triton kernel
    if torch.cuda.get_device_capability() == (9, 0):
        from llmkernels.attention.prefill_ws import flash_fwd_ws_kernel

        monkeypatch.setattr(prefill, "WS_MIN_WORK", 0)
        kernels.append((flash_fwd_ws_kernel, {}))
    for kernel, kw in kernels:
        counts = []
        for S in (100, 2048, 2100):
            q, k, v, cq, ck, mq, mk = make([S], None, 4, 2, 128, torch.bfloat16, device)
            lk.flash_attn_varlen(q, k, v, cq, ck, mq, mk, causal=True, **kw)
            counts.append(sum(len(c[0]) for c in kernel.device_caches.values()))
        assert counts[1] == counts[0] and counts[2] == counts[0], counts
