"""Building an engine's parts from a GGUF file: the model (or a tensor-parallel rank's shard of it) and the model
runner with its KV cache. ``LLM`` and the tensor-parallel worker processes (parallel.py) both build through here."""
from __future__ import annotations

import dataclasses
import warnings

import torch

from ..quant.gguf_io import read_gguf
from .config import ModelConfig
from .model import Model, expect_shapes
from .runner import EXTEND_TOKENS, ModelRunner, kv_bytes_per_page, pages_that_fit
from .scheduler import pages_for
from .torch_model import TorchModel
from .tp import local_config, shard_tensors


def load_model(f, device, spec: dict, progress: bool, shard=None) -> Model:
    """The model of GGUF file ``f`` (on a tensor-parallel rank: its shard) on ``device``."""
    cfg = ModelConfig.from_gguf(f.metadata, f.keys())
    progress_fn = None
    if progress:
        from tqdm.auto import tqdm

        progress_fn = tqdm
    tensors, mcfg = f, cfg
    if shard is not None and shard.active:
        shard = dataclasses.replace(shard, allreduce=tuple(spec.get("allreduce", ("auto", ""))))
        expect_shapes(cfg, f)  # the whole file first: errors name the file's tensors, not a shard's
        tensors, mcfg = shard_tensors(f, cfg, shard), local_config(cfg, shard)
    model_cls = TorchModel if spec["backend"] == "torch" else Model
    model = model_cls(mcfg, tensors, device, spec["dtype"], progress=progress_fn, tp=shard)
    model.full_cfg = cfg
    return model


def build_runner(model: Model, device, spec: dict) -> ModelRunner:
    """The KV cache and step runner for ``model``: as many pages as asked, or as fit (every tensor-parallel rank
    takes the smallest count any rank can hold)."""
    cfg = getattr(model, "full_cfg", model.cfg)
    stacks, path = None, "kernel per op"
    if "megakernel" in spec:  # the stacks first: filling one needs its bytes free
        from ..megakernel.engine import prepare

        stacks, path = prepare(model, device, spec)
    page_size = spec["page_size"]
    max_model_len = int(spec["max_model_len"] or min(cfg.context_length, 8192))
    kv_dtype = spec["kv_dtype"] or model.dtype
    num_pages = spec["num_pages"]
    if num_pages is None:
        num_pages = spec["max_num_seqs"] * pages_for(max_model_len, page_size)
        if device.type == "cuda":
            num_pages = min(num_pages, pages_that_fit(model.cfg, device, page_size, kv_dtype,
                                                      spec["max_num_batched_tokens"],
                                                      spec["gpu_memory_utilization"]))
        else:
            num_pages = min(num_pages, 4096)
        tp = getattr(model, "tp", None)
        if tp is not None:
            import torch.distributed as dist

            n = torch.tensor([num_pages], dtype=torch.int64, device=device if device.type == "cuda" else "cpu")
            dist.all_reduce(n, op=dist.ReduceOp.MIN, group=tp.group)
            num_pages = int(n.item())
        if num_pages < pages_for(min(max_model_len, 16 * page_size), page_size):
            raise MemoryError(f"only {num_pages} KV-cache pages fit ({kv_bytes_per_page(model.cfg, page_size, kv_dtype)}"
                              f" bytes each); lower max_model_len or free GPU memory")
    runner = ModelRunner(model, page_size=page_size, num_pages=num_pages, max_model_len=max_model_len,
                         kv_dtype=kv_dtype, cuda_graphs=spec["cuda_graphs"],
                         max_graph_batch=min(spec["max_graph_batch"], spec["max_num_seqs"]),
                         num_splits=spec["num_splits"], act_int8=spec["act_int8"],
                         max_extend_graph=next((t for t in EXTEND_TOKENS if t >= spec["max_num_batched_tokens"]),
                                               EXTEND_TOKENS[-1]))
    if stacks is not None:
        from ..megakernel.engine import attach

        try:
            path = attach(runner, stacks, spec.get("megakernel"))
        except Exception as e:  # noqa: BLE001  (by default the step is an option: the engine runs without it)
            if spec.get("megakernel") is True:
                raise
            runner.one_kernel = None
            path = f"kernel per op (the one-kernel step did not start: {type(e).__name__}: {e})"
            warnings.warn(f"llmkernels: {path}", RuntimeWarning, stacklevel=2)
    runner.decode_path = path
    return runner


def build_worker(path: str, shard, device, spec: dict) -> ModelRunner:
    """A tensor-parallel rank other than 0: its shard of the model and its KV cache (tp.worker_main runs it)."""
    f = read_gguf(path)
    model = load_model(f, torch.device(device), spec, False, shard)
    return build_runner(model, torch.device(device), spec)
