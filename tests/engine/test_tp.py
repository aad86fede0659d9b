"""Tensor parallelism on the CPU: sharding as stored (no dequantization), and the engine at TP = 2 (and 4) over gloo
giving what it gives at TP = 1."""
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from llmkernels import dequantize, quantize
from llmkernels.engine import LLM, ModelConfigError, SamplingParams
from llmkernels.engine.config import ModelConfig
from llmkernels.engine.tp import local_pairs, plan_shards, shard_tensors, take_cols, take_rows
from llmkernels.quant.tensor import QuantizedTensor

PROMPTS = ["The quick brown fox", "Hello, world! How are you today?", "12345 東京"]
# big enough that O and down split on q4_k's 256-weight blocks at TP = 2: 8 heads x 64 = 512, FFN 1024
TP_MODEL = dict(hidden=512, heads=8, kv_heads=2, head_dim=64, ffn=1024)


@pytest.mark.parametrize("fmt", ["f32", "f16", "q8_0", "q4_k", "q6_k", "q5_0", "mlx"])
def test_shards_reassemble_the_whole(fmt):
    w = torch.randn(24, 512)
    qt = quantize(w, fmt, bits=4, group_size=64) if fmt == "mlx" else quantize(w, fmt)
    whole = dequantize(qt)
    rows = take_rows(qt, 5, 17)
    assert rows.shape == (12, 512) and torch.equal(dequantize(rows), whole[5:17])
    padded = take_rows(qt, 20, 24, pad_to=8)
    assert padded.shape == (8, 512) and torch.equal(dequantize(padded)[:4], whole[20:24])
    assert not dequantize(padded)[4:].any()  # zero rows decode to zeros in every format
    parts = [take_cols(qt, k, k + 256) for k in (0, 256)]
    assert torch.equal(torch.cat([dequantize(p) for p in parts], dim=1), whole)
    if fmt in ("q4_k", "q6_k", "q8_0"):
        with pytest.raises(ValueError, match="block boundaries"):
            take_cols(qt, 0, 16)


def _cfg(**kw):
    base = dict(arch="llama", n_layers=1, hidden=512, ffn=1024, n_heads=8, n_kv_heads=2, head_dim=64,
                vocab_size=500, rms_eps=1e-5, rope_theta=1e4, rope_style="interleaved", context_length=512)
    return ModelConfig(**{**base, **kw})


def test_shard_plan():
    shards = plan_shards(_cfg(), 4)
    assert [s.q_heads for s in shards] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [s.kv_heads for s in shards] == [(0, 1), (0, 1), (1, 2), (1, 2)]  # 2 KV heads on 4 ranks: replicated
    assert [s.ffn for s in shards] == [(0, 256), (256, 512), (512, 768), (768, 1024)]
    assert [s.vocab for s in shards][-1] == (375, 500) and shards[0].vocab_per_rank == 125
    assert [s.kv_heads for s in plan_shards(_cfg(n_kv_heads=8), 2)] == [(0, 4), (4, 8)]
    for kw, world, msg in [(dict(n_heads=6, n_kv_heads=6), 4, "query heads"),
                           (dict(n_heads=12, n_kv_heads=3), 2, "KV heads"),
                           (dict(ffn=1000), 3, "query heads"), (dict(n_heads=6, n_kv_heads=6, ffn=1000), 3, "FFN")]:
        with pytest.raises(ModelConfigError, match=msg):
            plan_shards(_cfg(**kw), world)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        plan_shards(_cfg(), 0)


def test_shard_plan_moe():
    """MoE layers are expert-parallel: whole experts per rank (any format, any expert width), the router whole."""
    moe = dict(n_experts=6, n_experts_used=2, expert_ffn=96, ffn=300, n_heads=6, n_kv_heads=3)  # no FFN splits
    shards = plan_shards(_cfg(**moe), 3)
    assert [s.experts for s in shards] == [(0, 2), (2, 4), (4, 6)] and [s.ffn for s in shards] == [(0, 300)] * 3
    assert plan_shards(_cfg(), 2)[1].experts == (0, 0)
    with pytest.raises(ModelConfigError, match="tensor_parallel_size=2 does not divide the 5 experts"):
        plan_shards(_cfg(**dict(moe, n_experts=5, n_heads=8, n_kv_heads=2)), 2)
    E, F, H = 6, 64, 512
    stacks = {n: quantize(torch.randn(E * rows, cols), "q8_0") for n, rows, cols in
              (("ffn_gate_exps", F, H), ("ffn_up_exps", F, H), ("ffn_down_exps", H, F))}
    tensors = {f"blk.0.{n}.weight": QuantizedTensor("q8_0", (E, qt.shape[0] // E, qt.shape[1]),
                                                     qt.data.view(E, qt.shape[0] // E, -1))  # as a GGUF file holds it
               for n, qt in stacks.items()}
    tensors["blk.0.ffn_gate_inp.weight"] = torch.randn(E, H)
    part = shard_tensors(tensors, _cfg(**moe), shards[1])
    assert torch.equal(part["blk.0.ffn_gate_inp.weight"], tensors["blk.0.ffn_gate_inp.weight"])
    for name in stacks:
        whole, mine = tensors[f"blk.0.{name}.weight"], part[f"blk.0.{name}.weight"]
        assert mine.shape == (2, *whole.shape[1:])
        assert torch.equal(dequantize(mine), dequantize(whole)[2:4])


@pytest.mark.parametrize("world", [2, 4])
def test_local_pairs_sum_to_the_whole(world):
    """The MoE FFN summed over ranks, each with its experts and local_pairs' view of the routing, is the whole
    FFN; and a rank reads no expert for a token that the token does not choose there (or the first, when none)."""
    torch.manual_seed(0)
    T, E, k, H, F = 11, 8, 3, 16, 12
    x = torch.randn(T, H, dtype=torch.float64)
    G, U, D = torch.randn(E, F, H, dtype=torch.float64), torch.randn(E, F, H, dtype=torch.float64), \
        torch.randn(E, H, F, dtype=torch.float64)
    e = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, k, dtype=torch.float32)

    def ffn(w, e, G, U, D):
        out = torch.zeros(T, H, dtype=torch.float64)
        for t in range(T):
            for j in range(k):
                g, u = G[e[t, j]] @ x[t], U[e[t, j]] @ x[t]
                out[t] += w[t, j].double() * (D[e[t, j]] @ (torch.nn.functional.silu(g) * u))
        return out

    whole = ffn(w, e, G, U, D)
    parts = torch.zeros_like(whole)
    per = E // world
    for r in range(world):
        lo, hi = r * per, (r + 1) * per
        lw, le = local_pairs(w, e, lo, hi)
        assert le.dtype == e.dtype and lw.dtype == w.dtype and le.is_contiguous()
        assert ((le >= 0) & (le < per)).all()
        for t in range(T):
            mine = {int(x) - lo for x in e[t] if lo <= x < hi}
            assert set(le[t].tolist()) <= (mine or {0})
            assert torch.equal(lw[t] != 0, (e[t] >= lo) & (e[t] < hi))
        parts += ffn(lw, le, G[lo:hi], U[lo:hi], D[lo:hi])
    assert torch.allclose(parts, whole, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_moe_ffn_expert_parallel_on_the_kernels(fmt):
    """qgemv.moe_ffn per rank on its slice of GGUF-shaped stacks with local_pairs' routing, summed: the whole FFN
    (what the kernel backend's MoE layer does at TP > 1)."""
    from llmkernels.qgemv.moe import moe_ffn

    torch.manual_seed(1)
    T, E, k, H, F = 5, 4, 2, 256, 256
    x = torch.randn(T, H)
    stack = lambda rows, cols: QuantizedTensor(fmt, (E, rows, cols), quantize(  # noqa: E731
        torch.randn(E * rows, cols) * 0.05, fmt).data.view(E, rows, -1))
    G, U, D = stack(F, H), stack(F, H), stack(H, F)
    e = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, k)
    whole = moe_ffn(x, w, e, G, U, D, E)
    parts = sum(moe_ffn(x, *local_pairs(w, e, lo, lo + 2), *(take_rows(m, lo, lo + 2) for m in (G, U, D)), 2)
                for lo in (0, 2))
    assert (parts - whole).abs().max() <= 1e-4 * whole.abs().max()


def _run(path, tp, **kw):
    with LLM(path, progress=False, backend="torch", dtype=torch.float16, tensor_parallel_size=tp, **kw) as llm:
        ids = llm.tokenizer.encode(PROMPTS[1])
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        n = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, n=2))[0]
        return [o.token_ids for o in outs], [o.token_ids for o in n.outputs], llm.logits(ids)


@pytest.mark.parametrize("arch,fmt", [("llama", "q8_0"), ("llama", "q4_k"), ("qwen2", "q8_0"), ("qwen2", "q4_k"),
                                      ("qwen3", "q8_0"), ("qwen3", "q4_k"), ("phi3", "q8_0"), ("gemma2", "q4_k"),
                                      ("gemma3", "q8_0")])
def test_tp2_equals_tp1(model_files, arch, fmt):
    """Greedy tokens (forks included) and logits at TP = 2 as at TP = 1: the partial products are summed in float32
    before the activation dtype's rounding, so only the summation order differs."""
    _, path, _ = model_files(arch, fmt, **TP_MODEL)
    one, two = _run(path, 1), _run(path, 2)
    assert one[0] == two[0] and one[1] == two[1]
    assert (one[2] - two[2]).abs().max() <= 2e-3 * one[2].abs().max()


# Qwen3-MoE and Mixtral shapes whose attention splits like TP_MODEL's; experts of width 256 (q4_k's down reads whole
# blocks), 4 of them, 2 per token: 2 experts per rank at TP = 2, 1 at TP = 4
TP_MOE = dict(TP_MODEL, ffn=256, layers=2, experts=4, top_k=2)


@pytest.mark.parametrize("arch,fmt,tp", [("qwen3moe", "q8_0", 2), ("mixtral", "q4_k", 2), ("mixtral", "q8_0", 4)])
def test_tp_moe_equals_tp1(model_files, arch, fmt, tp):
    """Expert-parallel MoE layers: greedy tokens and logits at TP = 2 and 4 as at TP = 1."""
    _, path, _ = model_files(arch, fmt, **TP_MOE)
    one, many = _run(path, 1), _run(path, tp, page_size=4)
    assert one[0] == many[0] and one[1] == many[1]
    assert (one[2] - many[2]).abs().max() <= 2e-3 * one[2].abs().max()


def test_kernel_model_moe_layer_expert_parallel(model_files):
    """The kernel backend's MoE layer on each rank's shard (its experts, local_pairs' routing), summed over the
    ranks: the whole model's layer (the all-reduce's sum, without processes)."""
    from llmkernels.engine.model import Model
    from llmkernels.engine.tp import local_config
    from llmkernels.quant.gguf_io import read_gguf

    _, path, _ = model_files("qwen3moe", "q4_k", **TP_MOE)
    f = read_gguf(path)
    cfg = ModelConfig.from_gguf(f.metadata, f.keys())
    whole = Model(cfg, f, "cpu", torch.float32)
    x = torch.randn(6, cfg.hidden) * 0.5
    want = whole._moe(x, whole.layers[1])
    got = torch.zeros_like(want)
    for shard in plan_shards(cfg, 2, f):
        part = Model(local_config(cfg, shard), shard_tensors(f, cfg, shard), "cpu", torch.float32, tp=shard)
        assert part.local_experts == 2 and part.layers[1].moe[1].shape[0] == 2
        got += part._moe(x, part.layers[1])
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_tp4_replicates_kv_heads(model_files):
    _, path, _ = model_files("llama", "q8_0", **TP_MODEL)
    one, four = _run(path, 1, page_size=4), _run(path, 4, page_size=4)
    assert one[0] == four[0] and (one[2] - four[2]).abs().max() <= 2e-3 * one[2].abs().max()


def test_tp_errors(model_files):
    _, path, _ = model_files("llama", "q8_0", **TP_MODEL)
    with pytest.raises(ModelConfigError, match="does not divide the 8 query heads"):
        LLM(path, progress=False, backend="torch", tensor_parallel_size=3)
    _, small, _ = model_files("llama", "q4_k")  # 4 heads x 64: O would be cut every 128 weights
    with pytest.raises(ModelConfigError, match="not a multiple of its q4_k block of 256"):
        LLM(small, progress=False, backend="torch", tensor_parallel_size=2)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
            LLM(path, progress=False, backend="torch", tensor_parallel_size=bad)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs 2 GPUs"):
            LLM(path, progress=False, device="cuda", tensor_parallel_size=2)


def test_a_dead_rank_fails_the_engine_with_a_message(model_files):
    _, path, _ = model_files("llama", "q8_0", **TP_MODEL)
    llm = LLM(path, progress=False, backend="torch", dtype=torch.float16, tensor_parallel_size=2)
    try:
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2))
        proc = llm._peers.procs[0]
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=30)
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1 exited"):
            llm.generate([PROMPTS[1]], SamplingParams(max_tokens=2))
    finally:
        llm.close()
    assert llm._peers is None


def test_tp_sharded_sizes(model_files):
    """Each rank holds its share: rank 0's weights are half the model's, its cache has half the KV heads."""
    _, path, _ = model_files("qwen2", "q8_0", **TP_MODEL)
    one = LLM(path, progress=False, backend="torch")
    with LLM(path, progress=False, backend="torch", tensor_parallel_size=2) as two:
        assert two.cfg == one.cfg and two.model.cfg == dataclasses.replace(one.cfg, n_heads=4, n_kv_heads=1, ffn=512)
        assert two.kv_cache.shape[-2] == 1 and one.kv_cache.shape[-2] == 2
        assert abs(two.model.weight_bytes * 2 - one.model.weight_bytes) <= 0.02 * one.model.weight_bytes


def _margins(llm, outs):
    """For each output, the top-2 logit gap at each of its greedy steps (teacher-forced on its own tokens)."""
    gaps = []
    for o in outs:
        lg = llm.logits(o.prompt_token_ids + o.token_ids[:-1])[len(o.prompt_token_ids) - 1:]
        top = lg.topk(2, dim=-1).values
        gaps.append((top[:, 0] - top[:, 1]).cpu())
    return gaps


def _gpu_run(path, tp, graphs=True):
    with LLM(path, progress=False, tensor_parallel_size=tp, cuda_graphs=graphs, num_splits=2,
             max_num_batched_tokens=64, max_graph_batch=4) as llm:
        ids = llm.tokenizer.encode(PROMPTS[1] * 8)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outs = llm.generate([PROMPTS[0], PROMPTS[1] * 8, PROMPTS[2]], params)
        outs.append(llm.generate([PROMPTS[1] * 8 + PROMPTS[0]], params)[0])  # one sequence: the prompt-chunk graphs
        n = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, n=2))[0]
        why = llm.model._all_reduce.why if tp > 1 else ""
        return ([o.token_ids for o in outs], [o.token_ids for o in n.outputs], llm.logits(ids).cpu(),
                llm.stats.graph_steps, why, _margins(llm, outs) if tp == 1 else None)


def _gpu_run_fresh(path, tp, mode):
    """``_gpu_run`` in a new process with LLMK_ALLREDUCE=mode: torch rendezvouses symmetric memory once per
    process (allreduce.engine_mode), and each symm case needs its own."""
    root = str(Path(__file__).resolve().parents[2])
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "res.pt")
        code = (f"import sys, torch; sys.path.insert(0, {root!r}); from tests.engine.test_tp import _gpu_run; "
                f"torch.save(_gpu_run({str(path)!r}, {tp}), {out!r})")
        res = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, LLMK_ALLREDUCE=mode),
                             capture_output=True, text=True, timeout=400, check=False)
        assert res.returncode == 0, res.stderr[-4000:]
        return torch.load(out, weights_only=False)


def assert_same_greedy(want, got, gaps, tol):
    """Greedy tokens agree up to the end, or up to a step where the reference's top two logits were within ``tol``
    (a near tie that a different summation order may break the other way; the tokens after it are free)."""
    for w, g, gap in zip(want, got, gaps):
        j = next((i for i, (a, b) in enumerate(zip(w, g)) if a != b), None)
        assert len(w) == len(g) and (j is None or gap[j] <= tol), (w, g, j, gap.tolist())


_TP1 = {}


@pytest.mark.gpu
@pytest.mark.parametrize("tp,mode", [(2, "nccl"), (2, "symm"), (4, "nccl"), (4, "symm")])
def test_gpu_tp_equals_tp1(model_files, monkeypatch, tp, mode):
    """On tp GPUs (NCCL, all-reduce by NCCL or symmetric memory, CUDA graphs for decode and prompt chunks): logits
    as on one GPU, and greedy tokens too except after a near tie (the ranks round their bf16 partial sums before
    adding them; q4_k and a q8_0 model whose 2 KV heads are replicated at TP = 4)."""
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    monkeypatch.setenv("LLMK_ALLREDUCE", mode)
    for fmt in ("q4_k", "q8_0"):
        kw = dict(TP_MODEL, hidden=1024, heads=8, kv_heads=2, head_dim=128, ffn=2048)
        _, path, _ = model_files("llama", fmt, **kw)
        if path not in _TP1:  # one GPU's answers, shared by every (tp, mode) case
            _TP1[path] = _gpu_run(path, 1)
        one, many = _TP1[path], (_gpu_run_fresh(path, tp, mode) if mode == "symm" else _gpu_run(path, tp))
        assert many[3] > 0 and ("symmetric" in many[4]) == (mode == "symm")
        scale = one[2].abs().max()
        # bf16 logits: a few units in the last place of the largest (measured on 2 H200s: 0.19 at 18.4, 3 units)
        assert (one[2] - many[2]).abs().max() <= 3e-2 * scale
        assert_same_greedy(one[0], many[0], one[5], 2e-2 * scale)
        assert_same_greedy(one[1], many[1], [one[5][0]] * 2, 2e-2 * scale)  # n=2 greedy: PROMPTS[0]'s steps


@pytest.mark.gpu
def test_gpu_second_symm_engine_in_a_process(model_files):
    """In one process: a symm engine, then a second symm engine refused at construction (no worker started, no
    hang), then an auto engine that takes NCCL and says why."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _, path, _ = model_files("llama", "q8_0", **dict(TP_MODEL, hidden=1024, heads=8, kv_heads=2, head_dim=128,
                                                       ffn=2048))
    root = str(Path(__file__).resolve().parents[2])
    code = f"""
import os, sys, torch
sys.path.insert(0, {root!r})
from llmkernels.engine import LLM, SamplingParams
kw = dict(progress=False, tensor_parallel_size=2, max_num_batched_tokens=64, max_graph_batch=4)
p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
os.environ["LLMK_ALLREDUCE"] = "symm"
with LLM({str(path)!r}, **kw) as llm:
    first = llm.generate(["Hello"], p)[0].token_ids
    assert "symmetric" in llm.model._all_reduce.why
try:
    LLM({str(path)!r}, **kw)
    raise SystemExit("a second symm engine was built")
except RuntimeError as e:
    assert "earlier engine in this process" in str(e), e
os.environ["LLMK_ALLREDUCE"] = "auto"
with LLM({str(path)!r}, **kw) as llm:
    assert llm.generate(["Hello"], p)[0].token_ids == first
    assert "earlier engine in this process" in llm.model._all_reduce.why, llm.model._all_reduce.why
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-4000:]


def _fused_rank(rank, world, init, H, dtype_name):
    """One rank of test_gpu_fused_all_reduce_norm (asserts; a failing rank fails the spawn)."""
    import torch.distributed as dist

    from llmkernels.engine.allreduce import AllReduce
    from llmkernels.engine.kernels import add_rmsnorm
    from llmkernels.engine.parallel import SAFE_ENV

    os.environ.update(SAFE_ENV)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
    dev, dtype = torch.device("cuda", rank), getattr(torch, dtype_name)
    f = AllReduce(None, dev, dtype, "symm", hidden=H).fused
    assert f is not None and f.world == world and f.rank == rank
    g = torch.Generator().manual_seed(0)  # the same inputs on every rank; each takes its own partial

    def case(T):
        parts, r0 = torch.randn(world, T, H, generator=g), torch.randn(T, H, generator=g)
        w = torch.randn(H, generator=g)
        ps = parts.to(dtype)
        s = ps[0].float()
        for q in range(1, world):  # in rank order, as the kernel sums
            s = s + ps[q].float()
        h = (r0.to(dtype).float() + s.to(dtype).float()).to(dtype)
        hf = h.double()
        y = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype).double() * w.double()
        return ps[rank].to(dev), r0.to(dtype).to(dev), w.to(dev), h, y

    def check(y, res, h, want):
        assert torch.equal(res.cpu(), h), (res.cpu() - h).abs().max()
        assert (y.double().cpu() - want).abs().max() <= 2e-2 * want.abs().max()
        every = [torch.empty_like(y) for _ in range(world)]
        dist.all_gather(every, y.contiguous())
        assert all(torch.equal(e, every[0]) for e in every)  # the ranks' residual streams stay identical

    for T in (1, 3, f.rows, 5, 1, 2, f.rows - 1):  # each row's count moves with the calls that include it
        x, res, w, h, want = case(T)
        out = torch.full((T, H), float("nan"), dtype=dtype, device=dev)
        check(add_rmsnorm(x, w, 1e-6, residual=res, out=out, peers=f), res, h, want)
    # captured once, replayed with new inputs: the counts live on the device, so replays keep the ranks in step
    T = 4
    x, res, w = (torch.zeros(T, H, dtype=dtype, device=dev), torch.zeros(T, H, dtype=dtype, device=dev),
                 torch.zeros(H, dtype=dtype, device=dev))
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        add_rmsnorm(x, w, 1e-6, residual=res.clone(), peers=f)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        y = add_rmsnorm(x, w, 1e-6, residual=res, peers=f)
    for _ in range(3):
        nx, nres, nw, h, want = case(T)
        x.copy_(nx), res.copy_(nres), w.copy_(nw)
        graph.replay()
        torch.cuda.synchronize()
        check(y, res, h, want)
    with pytest.raises(ValueError, match="peers sums"):
        add_rmsnorm(torch.zeros(f.rows + 1, H, dtype=dtype, device=dev), w, 1e-6, peers=f)
    torch.cuda.synchronize()
    dist.barrier()
    graph.reset()
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("H,dtype", [(4096, "bfloat16"), (1000, "float16")])
def test_gpu_fused_all_reduce_norm(H, dtype):
    """add_rmsnorm with ``peers`` on 2 GPUs: the sum of the ranks' partials (in rank order), the residual add and the
    norm, equal to the float64 reference; the same bits on both ranks; row counts moving
    across batches of different sizes; replays of a captured graph; outputs poisoned before the call."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from llmkernels.engine.parallel import _free_port

    root = str(Path(__file__).resolve().parents[2])
    code = (f"import sys, torch.multiprocessing as mp; sys.path.insert(0, {root!r}); "
            f"from tests.engine.test_tp import _fused_rank; "
            f"mp.spawn(_fused_rank, args=(2, 'tcp://127.0.0.1:{_free_port()}', {H}, {dtype!r}), nprocs=2)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, check=False)
    assert res.returncode == 0, res.stderr[-4000:]


def test_engine_mode_after_a_symm_rendezvous(monkeypatch):
    from llmkernels.engine import allreduce
    from llmkernels.engine.allreduce import AllReduce, engine_mode

    monkeypatch.delenv("LLMK_ALLREDUCE", raising=False)
    assert engine_mode() == ("auto", "") and engine_mode("symm") == ("symm", "")
    monkeypatch.setattr(allreduce, "_symm_used", True)
    mode, note = engine_mode()
    assert mode == "nccl" and "earlier engine in this process" in note
    assert engine_mode("nccl") == ("nccl", "")
    with pytest.raises(RuntimeError, match="LLMK_ALLREDUCE=symm: symmetric memory was set up by an earlier engine"):
        engine_mode("symm")
    monkeypatch.setenv("LLMK_ALLREDUCE", "symm")
    with pytest.raises(RuntimeError, match="one engine per process"):
        engine_mode()
    assert note in AllReduce(None, torch.device("cpu"), torch.bfloat16, mode, note).why


def test_all_reduce_mode_is_checked(monkeypatch):
    from llmkernels.engine.allreduce import AllReduce

    with pytest.raises(ValueError, match="LLMK_ALLREDUCE must be auto, nccl or symm, got 'fast'"):
        AllReduce(None, torch.device("cpu"), torch.bfloat16, mode="fast")
    monkeypatch.setenv("LLMK_ALLREDUCE", "ring")
    with pytest.raises(ValueError, match="got 'ring'"):
        AllReduce(None, torch.device("cpu"), torch.bfloat16)
