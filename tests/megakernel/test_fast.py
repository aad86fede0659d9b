"""The one-kernel step's fast executor (megakernel/fast.py) and its place in the engine (megakernel/engine.py)."""
import os
import re
import subprocess
import sys

import pytest
import torch

from llmkernels.engine import LLM, ModelConfig, SamplingParams
from llmkernels.engine.config import rope_inv_freq
from llmkernels.megakernel import build_decode_program
from llmkernels.quant import read_gguf

# the smallest llama the fast step's tiles divide: hidden, ffn and heads * head_dim multiples of 512
SHAPE = dict(hidden=512, ffn=1024, heads=8, kv_heads=2, head_dim=64)


def _needs_gluon():
    from llmkernels.supported import GLUON_RANGE, gluon_supported

    if not gluon_supported():
        pytest.skip(f"the fast step is written against Triton {GLUON_RANGE[0]}'s Gluon API")


def _tiny(model_files, fmt, **kw):
    _, path, _ = model_files("llama", fmt, **SHAPE, **kw)
    f = read_gguf(path)
    return path, f, ModelConfig.from_gguf(f.metadata, f.keys())


def test_unsupported_names_what_the_fast_step_lacks(model_files):
    _needs_gluon()
    import dataclasses

    from llmkernels.megakernel.fast import unsupported

    _, _, cfg = _tiny(model_files, "f16")
    assert unsupported(cfg) == []
    assert unsupported(dataclasses.replace(cfg, rope_style="neox")) == ["neox RoPE"]
    assert "head_dim 256 (32, 64 or 128)" in unsupported(dataclasses.replace(cfg, head_dim=256))
    assert unsupported(dataclasses.replace(cfg, hidden=768)) == ["hidden 768 (a multiple of 512 up to 16384)"]


def test_fast_step_rejects_bad_arguments(model_files):
    _needs_gluon()
    import dataclasses

    from llmkernels.megakernel.fast import FastStep
    from llmkernels.megakernel.weights import stack_tensors

    _, f, cfg = _tiny(model_files, "bf16")
    prog = build_decode_program(cfg, "bf16", batch=1, context=16, num_sms=8)
    stacks = stack_tensors(cfg, f)
    shape = (cfg.n_layers, 4, 4, cfg.n_kv_heads, cfg.head_dim)
    kc, vc = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
    inv, _ = rope_inv_freq(cfg)
    args = (torch.ones(cfg.vocab_size, cfg.hidden), torch.ones(cfg.n_layers, 2, cfg.hidden), torch.ones(cfg.hidden),
            inv)
    with pytest.raises(ValueError, match="warps .* must be 4, 8 or 16, got 6"):
        FastStep(prog, cfg, stacks, *args, kc, vc, warps=6)
    with pytest.raises(ValueError, match="hold must be 0, 1, 2 or 3, got 4"):
        FastStep(prog, cfg, stacks, *args, kc, vc, hold=4)
    with pytest.raises(ValueError, match="diag must be 0..5, got -1"):
        FastStep(prog, cfg, stacks, *args, kc, vc, diag=-1)
    with pytest.raises(ValueError, match="kv_ring must be 0..8 for bf16 weights at head_dim 64, got 9"):
        FastStep(prog, cfg, stacks, *args, kc, vc, kv_ring=9)
    odd = torch.zeros(kc.numel() + 1, dtype=torch.bfloat16)[1:].view(shape)  # rows 2 bytes off 4-byte alignment
    with pytest.raises(ValueError, match="kv_ring=2: the caches' rows must start 4-byte aligned"):
        FastStep(prog, cfg, stacks, *args, odd, odd, kv_ring=2)
    FastStep(prog, cfg, stacks, *args, odd, odd, kv_ring=0)  # the register path takes any alignment
    fast = FastStep(prog, cfg, stacks, *args, kc, vc)
    step = (torch.ones(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), torch.zeros(1, 4, dtype=torch.int32))
    for bad, got in ((torch.zeros(3, dtype=torch.int32), "torch.int32 [3] on cpu"),
                     (torch.zeros(2, dtype=torch.int64), "torch.int64 [2] on cpu"), ([0, 0, 0], "list")):
        with pytest.raises(ValueError, match="out must be a contiguous int64 tensor of 3 elements .* got " + re.escape(got)):
            fast.launch(*step, out=bad)
    with pytest.raises(ValueError, match="stages must be 2..18, got 40"):
        FastStep(prog, cfg, stacks, *args, kc, vc, stages=40)
    with pytest.raises(ValueError, match="k_cache: a 16-bit"):
        FastStep(prog, cfg, stacks, *args, kc.float(), vc)
    with pytest.raises(ValueError, match="v_cache: a 16-bit"):
        FastStep(prog, cfg, stacks, *args, kc, vc[:, :2])
    with pytest.raises(ValueError, match="each layer's pages must be contiguous"):
        FastStep(prog, cfg, stacks, *args, kc.transpose(1, 2), vc.transpose(1, 2))
    q8 = stack_tensors(cfg, read_gguf(_tiny(model_files, "q8_0")[0]))
    with pytest.raises(ValueError, match="stacks: bf16 or q4_k WeightStacks expected, got q8_0"):
        FastStep(prog, cfg, q8, *args, kc, vc)
    prog2 = build_decode_program(cfg, "bf16", batch=2, context=16, num_sms=8)
    q4 = stack_tensors(cfg, read_gguf(_tiny(model_files, "q4_k")[0]))
    with pytest.raises(ValueError, match="prog: batch 2 takes bf16 weights .q4_k runs batch 1., got q4_k"):
        FastStep(prog2, cfg, q4, *args, kc, vc)
    with pytest.raises(ValueError, match="batch_mma: the tensor-core products at batch 2 take 4 compute warps"):
        FastStep(prog2, cfg, stacks, *args, kc, vc, warps=8, batch_mma=True)
    with pytest.raises(TypeError, match="batch_mma must be None, True or False, got int"):
        FastStep(prog2, cfg, stacks, *args, kc, vc, batch_mma=1)
    with pytest.raises(ValueError, match=r"resid16 \(batch > 1\) must be True or False, got True at batch 1"):
        FastStep(prog, cfg, stacks, *args, kc, vc, resid16=True)
    with pytest.raises(ValueError, match=r"resid16 \(batch > 1\) must be True or False, got 1 at batch 2"):
        FastStep(prog2, cfg, stacks, *args, kc, vc, resid16=1)
    r16 = FastStep(prog2, cfg, stacks, *args, kc, vc, resid16=True)
    assert r16.r16 and r16.resid.shape == (2, cfg.hidden) and r16.resid.untyped_storage().nbytes() == 2 * cfg.hidden * 6
    assert not FastStep(prog2, cfg, stacks, *args, kc, vc, warps=8).bmma  # batch 2: the CUDA cores by default
    prog3 = build_decode_program(cfg, "bf16", batch=3, context=16, num_sms=8)
    assert FastStep(prog3, cfg, stacks, *args, kc, vc).bmma  # batch 3 and up: the tensor cores
    with pytest.raises(ValueError, match="batch_mma: the tensor-core products at batch 3 take 4 compute warps"):
        FastStep(prog3, cfg, stacks, *args, kc, vc, warps=8)
    with pytest.raises(ValueError, match="prog: batch 3 stages 4096 columns of a bf16 input, hidden is 8192"):
        FastStep(prog3, dataclasses.replace(cfg, hidden=8192), stacks, *args, kc, vc)
    prog5 = build_decode_program(cfg, "bf16", batch=5, context=16, num_sms=8)
    with pytest.raises(ValueError, match="prog: batch 5 stages 4096 columns of a bf16 input, hidden is 8192"):
        FastStep(prog5, dataclasses.replace(cfg, hidden=8192), stacks, *args, kc, vc, batch_mma=False)
    with pytest.raises(ValueError, match="stages must be an even number in 2..24, got 15"):
        FastStep(prog, cfg, q4, *args, kc, vc, warps=16, stages=15)
    fast2 = FastStep(prog2, cfg, stacks, *args, kc, vc)
    two = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"ids must be an int32 tensor of shape \[2\], got torch.int32 \[1\]"):
        fast2.launch(step[0], two, torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"seq_lens must be an int32 tensor of shape \[2\], got torch.int64"):
        fast2.launch(two, two.long(), torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"page_table must be an int32 \[2, pages\] tensor with contiguous rows"):
        fast2.launch(two, two, torch.zeros(4, 2, dtype=torch.int32).t())
    with pytest.raises(ValueError, match=r"page_table must be an int32 \[1, pages\]"):
        fast.launch(*step[:2], torch.zeros(2, 4, dtype=torch.int32))  # batch 1 takes one row


def test_fast_step_compiles_for_sm90_without_a_gpu():
    """Both formats compile for sm_90 (ptxas from the Triton wheel) within the shared memory of an SM (bf16 with 4
    compute warps, at batch 3 with 8 on the CUDA cores with the residual's bf16 copy and at batch 8 on the tensor
    cores; q4_k with 8, and with
    16 as the default partition beside a one-warp loader), the loader's hold
    (on by default) is one barrier wait that hold=0 leaves out, a timing-only build with no weight reads issues no
    TMA copy."""
    _needs_gluon()
    code = ("import sys, json; from llmkernels.megakernel.fast import compile_sm90; "
            "ks = [compile_sm90('bf16', 4), compile_sm90('q4_k', 8, hold=2), compile_sm90('bf16', 4, diag=3), "
            "compile_sm90('bf16', 4, hold=0), compile_sm90('q4_k', 16), compile_sm90('bf16', 8, batch=3, "
            "batch_mma=False, resid16=True), compile_sm90('bf16', 4, batch=8)]; "
            "sys.stdout.write(json.dumps([[k.metadata.shared, len(k.asm['cubin']) > 0, "
            "k.asm['ptx'].count('mbarrier.try_wait'), 'cp.async.bulk.tensor' in k.asm['ptx']] for k in ks]))")
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    import json

    bf, q, diag, free, q16, b3, b8 = json.loads(r.stdout)
    assert bf[1] and q[1] and diag[1] and free[1] and q16[1] and q16[3] and q16[0] <= 227 * 1024
    assert b3[1] and b3[3] and b3[0] <= 227 * 1024 and b8[1] and b8[3] and b8[0] <= 227 * 1024
    assert bf[2] == free[2] + 1
    assert bf[3] and q[3] and not diag[3]
    assert 128 * 1024 < bf[0] <= 227 * 1024 and q[0] <= 227 * 1024


def test_engine_describes_its_decode_path_on_the_cpu(model_files):
    path, _, _ = _tiny(model_files, "bf16")
    llm = LLM(path, progress=False)
    assert "decode steps: kernel per op (the one-kernel step: it runs on a CUDA GPU)" in llm.describe()
    with pytest.raises(ValueError, match="megakernel=True: the one-kernel decode step cannot run this model: it runs "
                                         "on a CUDA GPU"):
        LLM(path, progress=False, megakernel=True)
    with pytest.raises(TypeError, match="megakernel must be None, True or False, got str"):
        LLM(path, progress=False, megakernel="on")
    with pytest.raises(ValueError, match="megakernel=True runs on one GPU"):
        LLM(path, progress=False, megakernel=True, tensor_parallel_size=2)
    assert "kernel per op (megakernel=False)" in LLM(path, progress=False, megakernel=False).describe()


def test_one_kernel_steps_choose_and_fall_back():
    """Which decode steps OneKernelSteps sends to a one-kernel graph (batch sizes, the per-sequence context limit,
    the default's key budget at batch > 1), graphs built once per size, and a size whose build fails: the default
    warns and sends that size to the kernel-per-op step from then on; strict (megakernel=True) raises."""
    from types import SimpleNamespace

    from llmkernels.megakernel.engine import OneKernelSteps

    def step(*lens):
        return SimpleNamespace(ids=[1] * len(lens), seq_lens=list(lens))

    built = []

    def build(b):
        built.append(b)
        if b == 3:
            raise RuntimeError("no room")
        return f"graph {b}"

    steps = OneKernelSteps(None, None, (1, 2, 3, 4), 8192, 4096, 132, max_batch_keys=4096)
    steps._build = build
    assert steps.takes(step(8192)) == "graph 1" and steps.takes(step(8193)) is None
    assert steps.takes(step(2000, 2000)) == "graph 2" and steps.takes(step(2000, 2097)) is None
    assert steps.takes(step(5, 5, 5, 5, 5)) is None  # batch 5 is not one of the sizes
    with pytest.warns(RuntimeWarning, match=r"one-kernel step at batch 3 did not start \(RuntimeError: no room\); "
                                            r"decode steps of 3 sequences run kernel per op"):
        assert steps.takes(step(9, 9, 9)) is None
    assert steps.batches == (1, 2, 4) and steps.takes(step(9, 9, 9)) is None
    steps.build([1, 2, 4, 16])
    assert built == [1, 2, 3, 4] and sorted(steps.graphs) == [1, 2, 4]
    strict = OneKernelSteps(None, None, (1, 2, 3), None, 4096, 132, strict=True)
    strict._build = build
    assert strict.takes(step(100000, 100000, 100000, 100000)) is None  # batch 4: not a size
    with pytest.raises(RuntimeError, match="no room"):
        strict.takes(step(9, 9, 9))


# --- on the GPU -------------------------------------------------------------------------------------------------

def _poisoned_caches(cfg, shape, engine_layout):
    """(reference K, reference V, fast K, fast V): NaN caches of ``shape``; with ``engine_layout`` the fast step's K
    and V of a layer side by side, as the engine's cache (a layer stride of two caches)."""
    nan = dict(dtype=torch.bfloat16, device="cuda")
    ref_k, ref_v = torch.full(shape, float("nan"), **nan), torch.full(shape, float("nan"), **nan)
    if engine_layout:
        kv = torch.full((cfg.n_layers, 2, *shape[1:]), float("nan"), **nan)
        return ref_k, ref_v, kv[:, 0], kv[:, 1]
    return ref_k, ref_v, torch.full(shape, float("nan"), **nan), torch.full(shape, float("nan"), **nan)


def _fill_keys(refs, fasts, pages, n):
    """The same random keys and values at positions before ``n`` in the pages ``pages`` of both cache pairs (NaN
    past them)."""
    rows = pages.long()
    L, _, page, Hkv, D = refs[0].shape
    for ref_c, c in zip(refs, fasts):
        old = torch.randn(L, len(rows) * page, Hkv, D, dtype=torch.bfloat16, device="cuda")
        old[:, n:] = float("nan")
        ref_c[:, rows] = old.view(L, len(rows), page, Hkv, D)
        c[:, rows] = ref_c[:, rows]


def _ref_and_fast(f, cfg, fmt, splits, engine_layout, context=0, **kw):
    """The reference executor and a fast step on one Program, each with its own NaN-poisoned cache over the same
    scattered pages; ``context`` > 0: both caches hold the same random keys and values at positions before it."""
    from llmkernels.megakernel.fast import FastStep
    from llmkernels.megakernel.kernel import DecodeStep

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    prog = build_decode_program(cfg, fmt, batch=1, context=max(16, context), num_sms=sms, num_splits=splits)
    page = 4 if not context else 16
    pages = 4 if not context else -(-(context + 16) // page)
    shape = (cfg.n_layers, pages + 3, page, cfg.n_kv_heads, cfg.head_dim)
    ref_k, ref_v, kc, vc = _poisoned_caches(cfg, shape, engine_layout)
    table = torch.randperm(pages + 3)[:pages].view(1, pages).to(torch.int32).cuda()
    if context:
        _fill_keys((ref_k, ref_v), (kc, vc), table[0], context)
    inv, _ = rope_inv_freq(cfg)
    ref = DecodeStep(prog, cfg, f, ref_k, ref_v, inv.cuda(), batch=1)
    return ref, FastStep.from_tensors(prog, cfg, f, kc, vc, inv.cuda(), **kw), table


def _steps_agree(ref, fast, fmt, cfg, table, positions):
    """Every step at ``positions`` (0-based, in order): the fast step's logits against the reference's, its own
    argmax against torch.argmax of its logits, its counters back to zero."""
    ids = torch.randint(1, cfg.vocab_size, (len(positions),), dtype=torch.int32)
    for t, pos in enumerate(positions):
        args = (ids[t:t + 1].cuda(), torch.full((1,), pos + 1, dtype=torch.int32, device="cuda"), table)
        want = ref(*args).clone()
        fast.logits.fill_(float("nan"))
        fast.token.fill_(-1)
        got = fast(*args)
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < (1e-3 if fmt == "bf16" else 5e-2), f"position {pos}: {err:.3g} of the largest logit"
        if fmt == "bf16":
            assert got.argmax() == want.argmax(), f"position {pos}"
        assert fast.token.item() == got.argmax().item(), f"position {pos}"
        assert fast.out.tolist() == [fast.token.item(), 0, 0], f"position {pos}"  # the step's own copy
        assert fast.counters.eq(0).all() and fast.aux[:3].tolist() == [-(1 << 63), 0, 0], f"position {pos}"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, warps, splits, engine_layout, hold",
                         [("bf16", 4, 2, False, 1), ("bf16", 4, 3, True, 1), ("bf16", 8, 2, True, 1),
                          ("q4_k", 8, 3, True, 1), ("q4_k", 4, 2, False, 1), ("bf16", 4, 3, True, 0),
                          ("bf16", 4, 2, False, 2), ("q4_k", 8, 2, True, 2), ("bf16", 4, 2, True, 3),
                          ("q4_k", 16, 3, True, 1), ("bf16", 16, 2, True, 1)])
def test_gpu_fast_step_matches_the_reference_executor(model_files, fmt, warps, splits, engine_layout, hold):
    """Every step's logits against the reference executor (kernel.py) on the same Program, each with its own
    NaN-poisoned cache and the same scattered pages: bf16 within 1e-3 of the largest logit and the same greedy
    token; q4_k (its products take int8 activations, the reference float32 ones) within 5e-2. The step's own
    argmax equals torch.argmax of its logits, and it leaves its counters zero for the next step."""
    _, f, cfg = _tiny(model_files, fmt)
    ref, fast, table = _ref_and_fast(f, cfg, fmt, splits, engine_layout, warps=warps, hold=hold)
    _steps_agree(ref, fast, fmt, cfg, table, range(13))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, splits, engine_layout, warps, kv_ring",
                         [("bf16", 2, True, 4, None), ("bf16", 3, False, 8, None), ("bf16", 3, True, 4, 0),
                          ("bf16", 2, False, 4, 3), ("q4_k", 3, True, 8, None), ("q4_k", 2, False, 4, None),
                          ("q4_k", 3, True, 16, None)])
def test_gpu_fast_step_long_splits(model_files, fmt, splits, engine_layout, warps, kv_ring):
    """Splits of many blocks of 32 keys (about 600 cached keys over 2-3 splits, each warp's online softmax over
    its keys of every block, merged at the end) against the reference executor, at four consecutive
    positions: bf16 with its blocks through the cp.async ring (the default, and 3 slots: the ring wraps at
    another point) and one block ahead in registers (kv_ring=0)."""
    _, f, cfg = _tiny(model_files, fmt)
    ctx = 600
    ref, fast, table = _ref_and_fast(f, cfg, fmt, splits, engine_layout, context=ctx, warps=warps, kv_ring=kv_ring)
    _steps_agree(ref, fast, fmt, cfg, table, [ctx, ctx + 1, ctx + 2, ctx + 3])


@pytest.mark.gpu
@pytest.mark.parametrize("batch, warps, mma, splits, engine_layout, context, resid16",
                         [(2, 4, True, 2, True, 40, False), (3, 4, True, 3, False, 600, False),
                          (8, 4, True, 2, True, 70, False), (2, 4, False, 2, False, 40, False),
                          (8, 4, False, 3, True, 70, False), (4, 8, False, 3, True, 40, False),
                          (5, 8, False, 2, False, 300, False), (8, 4, True, 2, True, 70, True),
                          (3, 8, False, 3, False, 40, True)])
def test_gpu_fast_step_batches_match_the_reference_executor(model_files, batch, warps, mma, splits, engine_layout,
                                                            context, resid16):
    """Batch 2-8 (bf16 weights; the products take their inputs rounded to bf16, the reference float32 ones), on
    the tensor cores and on the CUDA cores, with and without the residual's bf16 copy: each sequence of its own
    length (context - 7 b cached keys before the step, in scattered pages of one shared pool, NaN past them)
    against the reference executor on the same Program at four consecutive positions, within 2e-2 of the largest
    logit; batches the products pad (3, 5) included."""
    from llmkernels.megakernel.fast import FastStep
    from llmkernels.megakernel.kernel import DecodeStep

    _, f, cfg = _tiny(model_files, "bf16")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    prog = build_decode_program(cfg, "bf16", batch=batch, context=context + 4, num_sms=sms, num_splits=splits)
    page = 16
    pages = -(-(context + 8) // page)
    shape = (cfg.n_layers, batch * pages + 3, page, cfg.n_kv_heads, cfg.head_dim)
    ref_k, ref_v, kc, vc = _poisoned_caches(cfg, shape, engine_layout)
    table = torch.randperm(shape[1])[:batch * pages].view(batch, pages).to(torch.int32).cuda()
    lens = [context - 7 * b for b in range(batch)]
    for b, n in enumerate(lens):
        _fill_keys((ref_k, ref_v), (kc, vc), table[b], n)
    inv, _ = rope_inv_freq(cfg)
    ref = DecodeStep(prog, cfg, f, ref_k, ref_v, inv.cuda(), batch=batch)
    fast = FastStep.from_tensors(prog, cfg, f, kc, vc, inv.cuda(), warps=warps, batch_mma=mma, resid16=resid16)
    for t in range(4):
        ids = torch.randint(1, cfg.vocab_size, (batch,), dtype=torch.int32, device="cuda")
        seq_lens = torch.tensor([n + 1 + t for n in lens], dtype=torch.int32, device="cuda")
        want = ref(ids, seq_lens, table).clone()
        fast.logits.fill_(float("nan"))
        got = fast(ids, seq_lens, table)
        assert got.shape == want.shape == (batch, cfg.vocab_size)
        err = ((got - want).abs().amax(1) / want.abs().amax(1)).max().item()
        assert err < 2e-2, f"step {t}: {err:.3g} of the largest logit"
        assert fast.counters.eq(0).all(), f"step {t}"


@pytest.mark.gpu
def test_gpu_fast_step_argmax_takes_ties_and_nan_as_torch(model_files):
    """The step's own argmax at a tie (an output row copied onto an earlier one: the same logit bits) takes the
    first row, and a NaN logit (an output row of NaN) wins over every number, as torch.argmax."""
    _, f, cfg = _tiny(model_files, "bf16")
    _, fast, table = _ref_and_fast(f, cfg, "bf16", 2, False)
    one = torch.ones(1, dtype=torch.int32, device="cuda")  # the first position: no older keys
    args = (one * 7, one, table)
    top = int(fast(*args).argmax())
    out = fast.stacks.a.view(torch.bfloat16)[int(fast.mt[-1, 0]):][:cfg.vocab_size]  # the output matrix's rows
    j = int(torch.randint(0, top, ())) if top else None
    if j is not None:
        out[j] = out[top]
        got = fast(*args)
        assert got[0, j] == got[0, top] and fast.token.item() == j == got.argmax().item()
    k = (top + 1 + int(torch.randint(0, cfg.vocab_size - 1, ()))) % cfg.vocab_size
    out[k] = float("nan")
    got = fast(*args)
    assert got[0, k].isnan() and fast.token.item() == k == got.argmax().item()


@pytest.mark.gpu
def test_gpu_fast_step_hang_guard(model_files):
    """A schedule that cannot finish (one wait for a count no instruction reaches) ends with an error naming the
    instruction, and the GPU stays usable."""
    _, f, cfg = _tiny(model_files, "bf16")
    _, fast, table = _ref_and_fast(f, cfg, "bf16", 2, False, spin_limit=1 << 12)
    prog = fast.prog
    sm = next(s for s, lst in enumerate(prog.lists) if any(i.op == "O" for i in lst))
    j = next(j for j, i in enumerate(prog.lists[sm]) if i.op == "O")
    fast.table[sm, j, 6] = 1 << 20  # the wait's target
    args = (torch.ones(1, dtype=torch.int32, device="cuda"), torch.ones(1, dtype=torch.int32, device="cuda"), table)
    with pytest.raises(RuntimeError, match=r"SM \d+ gave up at \w+ layer -?\d+ .* waiting for counter \d+"):
        fast(*args)
    assert fast.out[1:].tolist() == fast.err.tolist() and fast.out[1].item() == 1
    assert torch.ones(4, device="cuda").sum().item() == 4


def _greedy(llm, prompt, n):
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)
    return llm.generate([prompt], sp)[0].outputs[0]


def _agrees_with_kernel_per_op(ref_llm, prompt, out, top=0.1, worst=0.2, mean=0.03):
    """Each greedy token of ``out`` (with logprobs), scored by the kernel-per-op path on the same prefix
    (LLM.logits), is that path's top choice or within ``top`` of its top log-probability (the kernel-per-op step
    rounds activations to bf16 between kernels, the one-kernel step keeps more of them in float32, so at a near tie
    the two may part); the chosen tokens' log-probabilities agree within ``worst``, ``mean`` on average."""
    lp = torch.log_softmax(ref_llm.logits(prompt + out.token_ids[:-1])[len(prompt) - 1:].float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(out.token_ids)[:, None].to(lp.device)).squeeze(1)
    gap = lp.max(dim=1).values - chosen
    assert gap.max().item() < top, f"token {gap.argmax().item()} is {gap.max().item():.3f} below the top choice"
    d = (chosen.cpu() - torch.tensor([x[0] for x in out.logprobs])).abs()
    assert d.max().item() < worst and d.mean().item() < mean, \
        f"log-probabilities: max {d.max():.3f}, mean {d.mean():.3f}"


@pytest.mark.gpu
def test_gpu_engine_takes_the_one_kernel_step(model_files):
    """LLM(megakernel=True) decodes one sequence through the one-kernel step (CUDA graph replays), 256 greedy
    tokens that agree with the kernel-per-op path's scores; the default (megakernel=None) takes the one-kernel
    step for bf16."""
    path, _, cfg = _tiny(model_files, "bf16")
    prompt = torch.randint(1, cfg.vocab_size, (9,)).tolist()
    ref_llm = LLM(path, progress=False, megakernel=False)
    llm = LLM(path, progress=False, megakernel=True)
    assert "one-kernel step (bf16 weights" in llm.describe() and "for 1-8 sequences at every context" in llm.describe()
    replays = llm.stats.graph_steps
    out = _greedy(llm, prompt, 256)
    assert llm.stats.graph_steps - replays >= 255
    _agrees_with_kernel_per_op(ref_llm, prompt, out)
    assert "one-kernel step (bf16 weights" in LLM(path, progress=False).describe()


@pytest.mark.gpu
def test_gpu_engine_one_kernel_batches(model_files):
    """Three sequences of different lengths decoded together (then two, then one, as they finish) through the
    one-kernel step at batch 3, 2 and 1: every sequence's greedy tokens agree with the kernel-per-op path's
    scores (the graphs of batch 3 and 2 are built while the sequences hold their pages, page 0 among them); the
    graphs of those sizes were built, capture_graphs builds others ahead of time, and eight at once agree too."""
    path, _, cfg = _tiny(model_files, "bf16")
    # under a page each: no prefix-cache hit when they run again
    prompts = [torch.randint(1, cfg.vocab_size, (n,)).tolist() for n in (9, 14, 4)]
    ref_llm = LLM(path, progress=False, megakernel=False)
    llm = LLM(path, progress=False, megakernel=True)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)
                                  for n in (40, 24, 12)])
    assert sorted(llm.runner.one_kernel.graphs) == [1, 2, 3]
    for p, o in zip(prompts, outs):
        _agrees_with_kernel_per_op(ref_llm, p, o.outputs[0], mean=0.05)
    # without logprobs the steps run one ahead, fed the sampled ids on the device: the same tokens
    ahead = llm.stats.ahead_steps
    again = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                                   for n in (40, 24, 12)])
    assert llm.stats.ahead_steps - ahead >= 30
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    llm.capture_graphs([4, 8])
    assert sorted(llm.runner.one_kernel.graphs) == [1, 2, 3, 4, 8]
    eight = [torch.randint(1, cfg.vocab_size, (5 + 3 * i,)).tolist() for i in range(8)]
    steps = llm.stats.graph_steps
    outs = llm.generate(eight, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0))
    assert llm.stats.graph_steps - steps >= 9
    for p, o in zip(eight, outs):
        _agrees_with_kernel_per_op(ref_llm, p, o.outputs[0], mean=0.05)


@pytest.mark.gpu
def test_gpu_engine_one_kernel_look_ahead(model_files):
    """Greedy decoding without logprobs runs a step ahead: each token is read from the pinned slot the step writes
    and fed back to the next step on the device. The tokens equal those of steps run one at a time (logprobs on);
    an error flag a step left in its slot raises RuntimeError at the next step."""
    path, _, cfg = _tiny(model_files, "bf16")
    prompt = torch.randint(1, cfg.vocab_size, (7,)).tolist()
    llm = LLM(path, progress=False, megakernel=True)
    ahead = llm.stats.ahead_steps
    sp = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    got = llm.generate([prompt], sp)[0].outputs[0].token_ids
    assert llm.stats.ahead_steps - ahead >= 40
    assert got == _greedy(llm, prompt, 48).token_ids
    llm.runner.one_kernel.graphs[1].out_host[1, 1] = 1  # as a step whose wait ran past the spin limit leaves it
    with pytest.raises(RuntimeError, match="one-kernel decode step: SM 0 gave up"):
        llm.generate([prompt], sp)


def test_info_says_when_the_engine_takes_the_one_kernel_step():
    from llmkernels.info import kernel_paths
    from llmkernels.megakernel.engine import AUTO_BATCH_MAX_KEYS, AUTO_BATCHES, AUTO_MAX_CONTEXT, _sizes

    on = [line for line in kernel_paths((9, 0), True) if "one-kernel decode step" in line]
    assert on == [f"  one-kernel decode step (Gluon, sm_90): enabled by default for {_sizes(AUTO_BATCHES)} sequences "
                  f"up to {AUTO_MAX_CONTEXT} cached tokens ({AUTO_BATCH_MAX_KEYS} in all at batch > 1) on "
                  f"llama-family models with every matrix in bf16 "
                  f"(LLM(megakernel=True): 1-8 sequences at every context, and one with q4_k and act_int8)"]
    assert _sizes([1, 2]) == "1 or 2" and _sizes(range(1, 9)) == "1-8" and _sizes([1, 2, 4]) == "1, 2 or 4"
    assert _sizes([1]) == "1"
    assert "  one-kernel decode step (Gluon, sm_90): off (needs sm_90)" in kernel_paths((8, 0), False)
