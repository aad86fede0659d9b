"""``python -m llmkernels info``: what this machine runs and why (GPU, tuned-table entries, versions, kernel paths)."""
from __future__ import annotations

import platform


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001  (not installed, or installed without metadata)
        return "not installed"


def kernel_paths(capability, gluon: bool) -> list[str]:
    """Which kernel families this GPU (capability, or None for the interpreter) and Triton enable."""
    from .supported import GLUON_RANGE, check_triton_version

    lines = []
    if capability is None:
        lines.append("  Triton interpreter on the CPU (no CUDA device): every kernel runs, slowly; bf16 dots and "
                     "arithmetic are widened to fp32 by llmkernels' interpreter fix")
        return lines
    sm90 = capability == (9, 0)
    note = check_triton_version()
    if sm90 and gluon:
        state = "enabled"
    elif not sm90:
        state = "off (needs sm_90): the portable Triton kernels run instead"
    else:
        state = (f"off: this Triton's Gluon API is not the one they are written against (Triton "
                 f"{GLUON_RANGE[0][0]}.{GLUON_RANGE[0][1]}); the portable Triton kernels run instead")
    lines.append(f"  Gluon warp-specialized prefill and persistent paged decode (sm_90): {state}")
    from .megakernel.engine import AUTO_BATCH_MAX_KEYS, AUTO_BATCHES, AUTO_MAX_CONTEXT, _sizes

    one = (f"enabled by default for {_sizes(AUTO_BATCHES)} sequences up to {AUTO_MAX_CONTEXT} cached tokens "
           f"({AUTO_BATCH_MAX_KEYS} in all at batch > 1) on llama-family models with every matrix in bf16 "
           f"(LLM(megakernel=True): 1-8 sequences at every context, and one with q4_k and act_int8)"
           if sm90 and gluon else state.split(":")[0])
    lines.append(f"  one-kernel decode step (Gluon, sm_90): {one}")
    lines.append(f"  TMA loads (prefill K/V tiles, GEMV activations from 17 rows): "
                 f"{'enabled' if capability[0] >= 9 else 'off (needs sm_90+)'}")
    lines.append(f"  programmatic dependent launch: {'enabled' if capability[0] >= 9 else 'off (needs sm_90+)'}")
    lines.append("  Triton kernels for prefill, paged attention and every GEMV format: enabled")
    if note:
        lines.append(f"  note: {note}")
    return lines


def info_lines() -> list[str]:
    import torch

    from . import __version__
    from ._checks import interpreter_mode
    from .tuning import describe, family_of, user_dir

    lines = [f"llmkernels {__version__}"]
    lines.append(f"python {platform.python_version()}, torch {torch.__version__}, triton {_version('triton')}, "
                 f"numpy {_version('numpy')}, gguf {_version('gguf')}")
    cuda = torch.cuda.is_available() and not interpreter_mode()
    if cuda:
        name = torch.cuda.get_device_name()
        cap = torch.cuda.get_device_capability()
        props = torch.cuda.get_device_properties(0)
        family = family_of(cap)
        lines.append(f"GPU: {name} (sm_{cap[0]}{cap[1]}, {props.multi_processor_count} SMs, "
                     f"{props.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}")
        lines.append(f"tuned tables (search order: user folder {user_dir()}, exact GPU \"{name}\", family "
                     f"\"{family}\", \"default\"):")
        lines += describe(name, family)
        from .attention.prefill import _gluon_hopper

        gluon = cap == (9, 0) and _gluon_hopper(torch.cuda.current_device())
        lines.append("kernel paths:")
        lines += kernel_paths(cap, gluon)
    else:
        lines.append("GPU: none visible to torch")
        lines.append("tuned tables: not used (the interpreter runs small fixed tiles)")
        lines.append("kernel paths:")
        lines += kernel_paths(None, False)
    return lines


def route_line(fmt: str, M: int, N: int, K: int, op: str = "gemv", dtype: str = "fp16", act_int8: bool = False) -> str:
    """The GEMV route (qgemv.route.choose) of one product on this machine's GPU (or the interpreter), in a line."""
    import torch

    from ._checks import interpreter_mode
    from ._runtime import gpu_name, has_tma
    from .qgemv import route
    from .quant.formats import GGUF_FORMATS

    bits = {"mlx4": 4, "mlx8": 8}.get(fmt, 0)
    if fmt not in GGUF_FORMATS and not bits:
        raise ValueError(f"--route format must be a GGUF format or mlx4 / mlx8, got {fmt!r}")
    if min(M, N, K) < 1:
        raise ValueError(f"--route M, N, K must be positive, got {M} {N} {K}")
    target = route.Target(gpu_name(), interpreter_mode(), has_tma())
    r = route.choose(op, "mlx" if bits else fmt, M, N, K, {"fp16": torch.float16, "bf16": torch.bfloat16,
                     "fp32": torch.float32}[dtype], act_int8, bits=bits, group_size=64 if bits else 0, target=target)
    extra = (", x copied into lane order" if r.lane_copy else "") + (", x in k order by TMA" if r.xt else "")
    return (f"route of {op} {fmt} M={M} N={N} K={K} {dtype}{' act_int8' if act_int8 else ''} on {target.gpu}: "
            f"{r.kernel} {r.config}{extra} ({r.rule})")
