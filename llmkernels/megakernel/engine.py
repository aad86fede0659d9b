"""The one-kernel decode step inside the engine: which models and steps take it, and its CUDA graphs.

``prepare(model, device, spec)`` decides once per engine (``LLM(megakernel=...)``), before the KV cache takes the
free memory: None (the default) takes the step where it applies and is measured faster than the kernel-per-op step
(bf16 weights, the batch sizes of ``AUTO_BATCHES``, contexts up to ``AUTO_MAX_CONTEXT``); True takes it at every
decode step of the sizes it runs (1-8 sequences; q4_k: one) and raises ValueError naming what stands in the way when
it cannot; False never. ``attach`` then sets up ``OneKernelSteps`` over the runner's KV cache, and the runner sends
every decode step it takes to that batch size's ``OneKernelGraph.run``; every other step keeps the kernel-per-op
path.
"""
import warnings

import torch

from ..engine.runner import _Graph
from .schedule import build_decode_program
from .weights import share_stacks

# batch-1 bf16 steps of the Llama-3-8B shape in the engine on the H200 (bench/NOTES.md): the one-kernel step leads
# the kernel-per-op step by 21% at 640 cached tokens, 16% at 4096 and 7% at 8192 (its attention splits cost more
# per token)
AUTO_MAX_CONTEXT = 8192
# decode batch sizes the default takes the one-kernel step at: those where it led the kernel-per-op step on the
# Llama-3-8B shape (H100, bench/NOTES.md); LLM(megakernel=True) takes it at every size it runs
AUTO_BATCHES = tuple(range(1, 8))
# at batch > 1 the default also keeps the step's cached tokens (all sequences together) within this: its attention
# costs more per key than the kernel-per-op step's, and it led where the runs averaged 1152-4032 keys a step
AUTO_BATCH_MAX_KEYS = 4096


def why_not(model, device, spec: dict) -> str | None:
    """Why ``model`` on ``device`` under the engine's ``spec`` (LLM's settings) cannot take the one-kernel step
    (None: it can), checked without changing anything."""
    from ..attention.prefill import _gluon_hopper

    cfg, dev, mode = model.cfg, device, spec.get("megakernel")
    kv_dtype = spec.get("kv_dtype") or model.dtype
    if dev.type != "cuda":
        return "it runs on a CUDA GPU"
    if torch.cuda.get_device_capability(dev) != (9, 0) or not _gluon_hopper(dev.index or 0):
        return "it needs an sm_90 GPU with this Triton's Gluon kernels enabled"
    if model.backend != "triton" or getattr(model, "tp", None) is not None:
        return "it runs the triton backend on one GPU"
    if not spec.get("cuda_graphs"):
        return "it runs inside a CUDA graph (cuda_graphs=True)"
    if model.dtype != torch.bfloat16 or kv_dtype != torch.bfloat16:
        return f"it needs bf16 activations and a bf16 KV cache, got {model.dtype} and {kv_dtype}"
    from .fast import unsupported  # Gluon: imported only where this Triton's Gluon API is the one it is written for

    bad = unsupported(cfg)
    if model.padded or model.output_pad:
        bad.append("matrices padded at load")
    if model.rope_mscale != 1.0 or len(model.ropes) != 1:
        bad.append("a RoPE cos/sin factor or per-layer RoPE bases")
    if bad:
        return f"it does not run {', '.join(bad)}"
    fmts = {m.format for L in model.layers for m in (*L.qkv, L.wo, *L.gate_up, L.down)} | {model.output.format}
    if fmts == {"q4_k"} and not spec.get("act_int8"):
        return "its q4_k products take int8 activations: it needs act_int8=True"
    if fmts == {"q4_k"} and mode is None:
        return "q4_k: the kernel-per-op act_int8 step is faster (bench/NOTES.md)"
    if fmts not in ({"bf16"}, {"q4_k"}):
        return f"it reads every matrix in bf16 or every one in q4_k, the model has {', '.join(sorted(fmts))}"
    return None


class OneKernelGraph(_Graph):
    """The one-kernel step of ``fast.batch`` sequences in a CUDA graph fed through fixed buffers (the pinned
    uploads of runner.DecodeGraph).

    At batch 1 the step writes its greedy token and error flag straight into pinned host memory (``out_host``),
    and takes the previous step's token from the device when it is fed back, so a look-ahead step needs no copy on
    the stream besides the upload; at batch > 1 it writes the error flag there and the sampler takes the argmax.
    Two graphs, used in turn with the two upload sets, write two host slots: a slot is read before the step two
    later overwrites it.

    Building one runs the step once outside the capture (to compile and warm it up) with every sequence at one
    cached token in page 0; that page's K and V are kept and put back, so a graph can be built while sequences
    hold the page."""

    def __init__(self, runner, fast, max_context: int | None):
        dev = runner.device
        B = self.batch = fast.batch
        self.fast, self.max_context = fast, max_context
        P = self.P = runner.max_pages_per_seq
        self._pinned(2 * B + B * P, 0, dev)
        self.ids, self.lens, self.table = self.dev32[:B], self.dev32[B:2 * B], self.dev32[2 * B:].view(B, P)
        self.lens.fill_(1)
        self.out_host = torch.zeros(2, 3, dtype=torch.int64).pin_memory()  # per graph: token, error flag
        page0 = runner.kv_cache[:, :, 0].clone()
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            fast.launch(self.ids, self.lens, self.table)
        torch.cuda.current_stream(dev).wait_stream(s)
        runner.kv_cache[:, :, 0].copy_(page0)
        msg = fast.error()
        if msg:
            raise RuntimeError(msg)
        self.graphs = []
        for t in range(2):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s):
                fast.launch(self.ids, self.lens, self.table, self.out_host[t])
            self.graphs.append(g)
        self.graph = self.graphs[0]
        self.greedy_host = None

    def run(self, step, ids_dev=None) -> torch.Tensor:
        """Launch the step; afterwards, at batch 1, ``greedy_host`` (int64 [1], pinned) holds its greedy token once
        the GPU is past it. A step that gave up (the spin limit) raises at a later one: read without waiting for the
        GPU."""
        failed = self.out_host[:, 1].nonzero()
        if len(failed):
            raise RuntimeError(self.fast.error(self.out_host[int(failed[0, 0]), 1:]))
        B = self.batch
        host32, host64 = self._host()
        h = host32.numpy()
        h[:] = 0
        h[:B], h[B:2 * B] = step.ids, step.seq_lens
        h[2 * B:].reshape(B, self.P)[:, :len(step.page_table[0])] = step.page_table
        fed = ids_dev is not None and ids_dev.data_ptr() == self.fast.token.data_ptr()
        if fed:  # batch 1, the previous step's greedy token: the step reads it on the device (an id below 0)
            h[0] = -1
        self._upload(host32, host64)
        if ids_dev is not None and not fed:  # sampled after the previous step, still on the device
            self.ids.copy_(ids_dev.view(-1)[:B])
        self.graphs[self.turn].replay()
        self.greedy_host = self.out_host[self.turn, :1] if B == 1 else None
        return self.fast.logits


class OneKernelSteps:
    """The runner's one-kernel steps: a graph per batch size in ``batches``, each built at its first step (or by
    ``build``) over one set of weight stacks and the runner's KV cache, for programs scheduled for ``context``
    cached tokens on ``sms`` SMs. A batch size whose graph fails to build goes to the kernel-per-op step from then
    on, with a RuntimeWarning, unless ``strict`` (LLM(megakernel=True)): then the error is raised."""

    def __init__(self, runner, stacks, batches, max_context: int | None, context: int, sms: int, strict: bool = False,
                 max_batch_keys: int | None = None):
        self.runner, self.stacks, self.batches, self.max_context = runner, stacks, tuple(batches), max_context
        self.context, self.sms, self.strict, self.max_batch_keys = context, sms, strict, max_batch_keys
        self.graphs = {}

    def program(self, batch: int):
        return build_decode_program(self.runner.model.cfg, self.stacks.format, batch=batch, context=self.context,
                                    num_sms=self.sms)

    def _build(self, batch: int) -> OneKernelGraph:
        from .fast import FastStep

        r = self.runner
        fast = FastStep.from_model(r.model, self.program(batch), self.stacks, r.kv_cache[:, 0], r.kv_cache[:, 1],
                                   warps=4 if self.stacks.format == "bf16" else 8)
        return OneKernelGraph(r, fast, self.max_context)

    def graph(self, batch: int) -> OneKernelGraph | None:
        g = self.graphs.get(batch)
        if g is None and batch in self.batches:
            try:
                g = self.graphs[batch] = self._build(batch)
            except Exception as e:  # noqa: BLE001  (by default the step is an option: that size runs kernel per op)
                if self.strict:
                    raise
                self.batches = tuple(b for b in self.batches if b != batch)
                warnings.warn(f"llmkernels: the one-kernel step at batch {batch} did not start ({type(e).__name__}: "
                              f"{e}); decode steps of {batch} sequences run kernel per op", RuntimeWarning,
                              stacklevel=2)
        return g

    def build(self, sizes=None) -> None:
        for b in sizes or self.batches:
            self.graph(b)

    def takes(self, step) -> OneKernelGraph | None:
        """The graph that runs ``step`` (a decode step), or None: the kernel-per-op step runs it."""
        n, lens = len(step.ids), step.seq_lens
        if (n not in self.batches or (self.max_context is not None and max(lens) > self.max_context)
                or (n > 1 and self.max_batch_keys is not None and sum(lens) > self.max_batch_keys)):
            return None
        return self.graph(n)


def prepare(model, device, spec: dict):
    """(stacks or None, a line for LLM.describe when None): where ``spec["megakernel"]`` and the model allow, the
    model's matrices move into the stacks (weights.share_stacks; before any graph is captured and before the KV
    cache is sized, as filling a stack needs its bytes free for a moment)."""
    mode = spec.get("megakernel")
    if mode is False:
        return None, "kernel per op (megakernel=False)"
    reason = why_not(model, device, spec)
    if reason is not None:
        if mode is True:
            raise ValueError(f"megakernel=True: the one-kernel decode step cannot run this model: {reason}")
        return None, f"kernel per op (the one-kernel step: {reason})"
    return share_stacks(model), None


def attach(runner, stacks, mode) -> str:
    """Set up the runner's one-kernel steps over ``stacks`` (prepare's) and its KV cache, building the batch-1 graph
    now; returns what decode steps run, in a line."""
    from .fast import MAX_BATCH, batch_reason

    cfg, fmt = runner.model.cfg, stacks.format
    want = AUTO_BATCHES if mode is None else range(1, MAX_BATCH + 1)
    batches = [b for b in want if batch_reason(cfg, fmt, b) is None]
    limit = AUTO_MAX_CONTEXT if mode is None else None
    sms = torch.cuda.get_device_properties(runner.device).multi_processor_count
    steps = OneKernelSteps(runner, stacks, batches, limit, min(runner.max_model_len, 4096), sms, strict=mode is True,
                           max_batch_keys=AUTO_BATCH_MAX_KEYS if mode is None else None)
    steps.graphs[1] = steps._build(1)  # now: a failure here leaves the whole engine on the kernel-per-op step
    prog = steps.graphs[1].fast.prog
    runner.one_kernel = steps
    upto = f"up to {limit} cached tokens" if limit else "at every context"
    if mode is None and batches != [1]:
        upto += f" ({AUTO_BATCH_MAX_KEYS} in all at batch > 1)"
    seqs = "one sequence" if batches == [1] else f"{_sizes(batches)} sequences"
    return (f"one-kernel step ({fmt} weights, {steps.sms} SMs, {len(prog.counter_names)} counters, "
            f"{sum(map(len, prog.lists))} instructions at batch 1) for {seqs} {upto}; kernel per op otherwise")


def _sizes(batches) -> str:
    """1, 2, 3, 4 -> '1-4'; 1, 2 -> '1 or 2'."""
    b = list(batches)
    if len(b) == 1:
        return str(b[0])
    if len(b) > 2 and b == list(range(b[0], b[-1] + 1)):
        return f"{b[0]}-{b[-1]}"
    return ", ".join(map(str, b[:-1])) + f" or {b[-1]}"
