"""Host side of the quantized GEMV family: layouts per format, config choice, split-K, torch.library ops."""
from __future__ import annotations

import torch
import triton

from .._checks import call_op, check_device, check_tensor, interpreter_mode
from .._pdl import pdl_supported
from .._runtime import empty, gpu_name, has_tma, num_sms
from ..quant.tensor import QuantizedTensor
from . import route
from .common import _finish, _views, split_k, split_outputs  # noqa: F401  (split_k: part of ops' interface)
from .dequant import FORMAT_IDS  # noqa: F401  (the kernels' FMT of each format, imported from here)

X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def target(device) -> route.Target:
    """The routing target of tensors on ``device``: the tuned tables' GPU name, the interpreter, TMA."""
    return route.Target(gpu_name(device), interpreter_mode(), has_tma(device))


def operands(op: str, x, x2, data, data2, scales, biases, fmt: str, bits: int, K: int) -> route.Operands:
    """The facts about the tensors' memory that routes depend on (see route.Operands)."""
    from .m1 import m1_x_ok

    return route.Operands(
        aligned=data.data_ptr() % 16 == 0, contiguous=data.is_contiguous(),
        dense_rows=data.shape[-1] == K * x.element_size(),
        up_aligned=data2 is None or data2.data_ptr() % 16 == 0,
        m1_x=m1_x_ok(x, x2 if op == "silu_mul" else None, fmt, bits),
        tc_scales=scales is None or (scales.stride(-1) == 1 and biases.stride(-1) == 1
                                     and scales.stride(0) == biases.stride(0)),
        rows16=data.shape[-1] * data.element_size() % 16 == 0)


def _launch_i8_lanes(xq, ds, data, N, K, out_dtype, fmt="q4_k", config=None):
    """q4_k, q5_k or q6_k, one activation row rounded to int8 in i8 lane order (xq, ds): int8.py's lane kernels."""
    from .int8 import launch_i8_lanes

    t = target(xq.device)
    config = config or route.i8_lanes_config(t, fmt, N, K)
    y = launch_i8_lanes(xq, ds, data, N, K, config, num_sms(xq.device), not t.interpreter, out_dtype,
                        pdl=pdl_supported(xq.device), fmt=fmt)
    return _finish(y, out_dtype)


def _launch_lanes(x, xl, data, N, K, config, up=None):
    """The q4_k m1 kernel over xl, x in lane order (m1.lane_order); with ``up``, silu(x W^T) * (x up^T)."""
    from .m1 import launch_m1

    y = launch_m1(xl, data, "q4_k", N, K, config, num_sms(x.device), unpack=1 if interpreter_mode() else 2,
                  pdl=pdl_supported(x.device), x_perm=True, up=up)
    return _finish(y, x.dtype)


def _run(r: route.Route, op, x, x2, data, scales, biases, data2, scales2, biases2, fmt, N, K, bits, group_size):
    """Carry out route ``r`` (route.choose) for operation ``op``."""
    M = x.shape[0]
    interp = interpreter_mode()
    sms = num_sms(x.device)
    silu_x2 = x2 if op == "silu_mul" else None
    if r.kernel == "cublas":
        return x @ data.view(x.dtype).T
    if r.kernel == "dequant":  # dequantize once with the embedding kernel, then one cuBLAS product
        a = x if silu_x2 is None else torch.nn.functional.silu(x.float()).mul_(x2.float()).to(x.dtype)
        w = _launch_embedding(torch.arange(N, device=x.device), data, scales, biases, fmt, N, K, bits,
                              group_size, x.dtype)
        if op == "gate_up":
            w2 = _launch_embedding(torch.arange(N, device=x.device), data2, scales2, biases2, fmt, N, K, bits,
                                   group_size, x.dtype)
            return (torch.nn.functional.silu((a @ w.T).float()) * (a @ w2.T).float()).to(x.dtype)
        return a @ w.T
    if r.kernel == "lanes":
        from .m1 import lane_order

        xl = lane_order(x, pdl_supported(x.device)) if r.lane_copy else x2
        return _launch_lanes(x, xl, data, N, K, r.config, up=data2 if op == "gate_up" else None)
    if r.kernel == "glu":  # both projections' rows in one thread (m1 GLU)
        from .m1 import launch_m1

        y = launch_m1(x, data, "q4_k", N, K, r.config, sms, unpack=1 if interp else 2, pdl=pdl_supported(x.device),
                      up=data2)
        return _finish(y, x.dtype)
    if r.kernel in ("i8", "i8_lanes"):  # x (or silu(x) * x2) rounded to int8 per block of 32
        from .int8 import launch_i8, quantize_act

        xq, ds = quantize_act(x, silu_x2, lanes=r.kernel == "i8_lanes")
        if r.kernel == "i8_lanes":
            return _launch_i8_lanes(xq, ds, data, N, K, x.dtype, fmt, r.config)
        return _finish(launch_i8(xq, ds, data, fmt, N, K, r.config, sms, not interp, x.dtype), x.dtype)
    if r.kernel == "tc":  # tensor cores (tc.py): all M rows in one program (16, 32 or 64 of them)
        from .tc import launch_tc, tc_order

        config, xt = r.config, None
        if r.xt:
            xt = tc_order(x, fmt)
            if xt is None:  # under CUDA-graph capture before the permutation reached the device: x as it lies
                config = route.tc_config(target(x.device), route.tc_name(fmt, 4), M, False)
        y = launch_tc(x, data, N, K, config, sms, 1 if interp else 2, scales, biases, group_size, fmt=fmt,
                      x2=silu_x2, xt=xt)
        return _finish(y, x.dtype)
    if r.kernel == "m1":  # scales factored out of the products (m1.py)
        from .m1 import launch_m1

        y = launch_m1(x, data, fmt, N, K, r.config, sms, unpack=1 if interp else 2, scales=scales, biases=biases,
                      bits=bits, group_size=group_size, x2=silu_x2, pdl=pdl_supported(x.device))
        return _finish(y, x.dtype)
    row_bytes = data.shape[-1] * data.element_size()
    nsub, sub, block_bytes, nblocks, family = route.layout(fmt, K, group_size)
    m_pad = 1 if M == 1 else route.SMALL_M
    grid_m = triton.cdiv(M, m_pad)
    w8, w16, wi8 = _views(data)
    ws = scales if scales is not None else w16
    wb = biases if biases is not None else w16
    if r.kernel == "planes":
        from .planes import gemv_planes_kernel

        C, U, P, BS, BB, _ = route.planes_layout(fmt, bits, group_size)
        block_n, nb, warps, stages = r.config
        programs_n = triton.cdiv(N, block_n)
        split, per_split = split_k(programs_n * grid_m, nblocks, nb, sms)
        y = empty(split, M, N, dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
        gemv_planes_kernel[(programs_n, split, grid_m)](
            x, x2 if x2 is not None else x, w8, w16, wi8, ws, wb, y, M, N, K, x.stride(0),
            x2.stride(0) if x2 is not None else 0, y.stride(0), y.stride(1), row_bytes,
            scales.stride(0) if scales is not None else 0, nblocks, per_split,
            FMT=FORMAT_IDS[fmt], NB=nb, C=C, U=U, P=P, BS=BS, BLOCK_BYTES=BB, BITS=bits or 0, BLOCK_N=block_n,
            M_PAD=m_pad, SILU_X=op == "silu_mul", num_warps=warps, num_stages=stages)
        return _finish(y, x.dtype)
    # the generic kernel, every format and operation
    block_n, nb, warps, stages = r.config
    programs_n = triton.cdiv(N, block_n)
    # the fused gate/up mode applies silu to whole sums, so it never splits K
    split, per_split = split_k(programs_n * grid_m, nblocks, nb, sms, waves=0 if op == "gate_up" else 2)
    y, part, counters = split_outputs(M, x.dtype, x.device, N, split, programs_n * grid_m,
                                      fixup=N * K <= route.GENERIC_FIXUP_MAX_WEIGHTS)
    if data2 is not None:
        v8, v16, vi8 = _views(data2)
        vs = scales2 if scales2 is not None else v16
        vb = biases2 if biases2 is not None else v16
    else:
        v8, v16, vi8, vs, vb = w8, w16, wi8, ws, wb
    from .kernels import gemv_kernel

    gemv_kernel[(programs_n, split, grid_m)](
        x, x2 if x2 is not None else x, w8, w16, wi8, ws, wb, v8, v16, vi8, vs, vb, y, part,
        counters if counters is not None else y, M, N, K, x.stride(0), x2.stride(0) if x2 is not None else 0,
        y.stride(0), y.stride(1), row_bytes, scales.stride(0) if scales is not None else 0, nblocks, per_split, split,
        FMT=FORMAT_IDS[fmt], NB=nb, NSUB=nsub, SUB=sub, BLOCK_BYTES=block_bytes, BITS=bits or 0, BLOCK_N=block_n,
        M_PAD=m_pad, SILU_X=op == "silu_mul", DUAL=op == "gate_up", FIXUP=counters is not None, num_warps=warps,
        num_stages=stages)
    return _finish(y, x.dtype)


def _qt_args(qt: QuantizedTensor):
    return qt.data, qt.scales, qt.biases, qt.format, qt.shape[0], qt.shape[1], qt.bits or 0, qt.group_size or 0


def _gemv_impl(x: torch.Tensor, x2: torch.Tensor | None, data: torch.Tensor, scales: torch.Tensor | None,
               biases: torch.Tensor | None, data2: torch.Tensor | None, scales2: torch.Tensor | None,
               biases2: torch.Tensor | None, fmt: str, N: int, K: int, bits: int, group_size: int,
               mode: int, act: int) -> torch.Tensor:
    op = route.OPS[mode]
    r = route.choose(op, fmt, x.shape[0], N, K, x.dtype, bool(act), bits=bits, group_size=group_size,
                     operands=operands(op, x, x2, data, data2, scales, biases, fmt, bits, K), target=target(x.device))
    if op == "lanes" and r.kernel != "lanes":  # gemv_lanes where the lane kernel does not apply: x_lanes unused
        op, x2 = "gemv", None
    return _run(r, op, x, x2, data, scales, biases, data2, scales2, biases2, fmt, N, K, bits, group_size)


def route_table(qt: QuantizedTensor, dtype: torch.dtype, ops=("gemv", "lanes", "silu_mul")) -> dict:
    """Every route of ``qt`` with activations of ``dtype``, chosen now: {(op, act_int8): (the Route at M = 1, 2, ...,
    MID_M, and the one for every M > MID_M)}, with activations assumed laid out as gemv's own checks want them (as
    the engine's are). A caller that holds a weight for long (the engine) chooses once, at load, and carries the
    routes out with ``run_route``; the ``route.override`` blocks active at this call apply."""
    data, scales, biases, fmt, N, K, bits, group_size = _qt_args(qt)
    t = target(data.device)
    x = torch.empty(1, K, dtype=dtype, device=data.device)  # a fresh row: laid out as every kernel wants it
    o = operands("gemv", x, None, data, None, scales, biases, fmt, bits, K)
    return {(op, act): tuple(route.choose(op, fmt, M, N, K, dtype, act, bits=bits, group_size=group_size,
                                          operands=o, target=t) for M in range(1, route.MID_M + 2))
            for op in ops for act in (False, True)}


# K multiple that gives each format 16-byte aligned rows the tensor-core kernel reads (q4_0 / q8_0 also need whole
# 256-weight steps)
PAD_K_MULTIPLE = {"q6_k": 2048, "q4_0": 256, "q8_0": 256}


def tc_padding(qt: QuantizedTensor, dtype: torch.dtype) -> int | None:
    """A K to pad ``qt``'s rows to (with zero blocks, quant.tensor.pad_k) so that its batch-1 gemv takes the
    tensor-core kernel, or None. Matrices of route.PAD_MIN_WEIGHTS or more qualify whose rows that kernel cannot
    read as stored: q6_k with K not a multiple of 2048 (210-byte blocks: rows not 16-byte aligned; a Q4_K_M file's
    V and down in Gemma 2 and Qwen2), q4_0 / q8_0 with K not a multiple of 256 (gpt-oss's K = 2880). The kernels
    that read them as stored are slower (q6_k: the generic kernel, 1.0-1.5x at M = 1 and 3-7x at M = 64 on the
    H200; q8_0 [5120, 2880]: bit planes; bench/NOTES.md); the padding adds (multiple - K % multiple) / K to the
    bytes read. Never under the interpreter."""
    data, scales, biases, fmt, N, K, bits, group_size = _qt_args(qt)
    t = target(data.device)
    step = PAD_K_MULTIPLE.get(fmt)
    if step is None or K % step == 0 or t.interpreter or N * K < route.PAD_MIN_WEIGHTS:
        return None
    Kp = -(-K // step) * step
    o = operands("gemv", torch.empty(1, Kp, dtype=dtype, device=data.device), None, data, None, None, None, fmt, 0,
                 Kp)
    return Kp if route.choose("gemv", fmt, 1, N, Kp, dtype, operands=o, target=t).kernel == "tc" else None


def table_route(table: dict, op: str, M: int, act_int8: bool = False) -> route.Route:
    """The route of ``route_table``'s ``table`` for ``op`` at M activation rows."""
    return table[(op, act_int8)][min(M, route.MID_M + 1) - 1]


def run_route(r: route.Route, op: str, x: torch.Tensor, qt: QuantizedTensor, x2=None) -> torch.Tensor:
    """Carry out a route of ``route_table`` with no checks and no choice: x [M, K] contiguous in the table's dtype;
    ``x2``: silu_mul's up, "lanes"' x in lane order, or for the ``i8_lanes`` kernel x already rounded, (q, ds) as
    int8.quantize_act(x, lanes=True) gives them."""
    data, scales, biases, fmt, N, K, bits, group_size = _qt_args(qt)
    if r.kernel == "i8_lanes" and isinstance(x2, tuple):
        return _launch_i8_lanes(*x2, data, N, K, x.dtype, fmt, r.config)
    if op == "lanes" and r.kernel != "lanes":  # x in lane order, but this product reads x as it lies
        op, x2 = "gemv", None
    return _run(r, op, x, x2, data, scales, biases, None, None, None, fmt, N, K, bits, group_size)


_gemv_op = torch.library.custom_op("llmkernels::quant_gemv", mutates_args=())(_gemv_impl)


@_gemv_op.register_fake
def _(x, x2, data, scales, biases, data2, scales2, biases2, fmt, N, K, bits, group_size, mode, act):
    return x.new_empty(x.shape[0], N)


def _launch_embedding(ids, data, scales, biases, fmt, N, K, bits, group_size, dtype):
    n = ids.numel()
    out = empty(n, K, dtype=dtype, device=ids.device)
    if n == 0:
        return out
    row_bytes = data.shape[-1] * data.element_size()
    nsub, sub, block_bytes, nblocks, _ = route.layout(fmt, K, group_size)
    nb = max(1, (64 if interpreter_mode() else 256) // (nsub * sub))
    block_i = 16 if interpreter_mode() else 8
    w8, w16, wi8 = _views(data)
    from .kernels import embedding_kernel

    embedding_kernel[(triton.cdiv(n, block_i), triton.cdiv(nblocks, nb))](
        ids.reshape(-1), w8, w16, wi8, scales if scales is not None else w16, biases if biases is not None else w16,
        out, n, K, N, row_bytes, scales.stride(0) if scales is not None else 0, nblocks, out.stride(0),
        FMT=FORMAT_IDS[fmt], NB=nb, NSUB=nsub, SUB=sub, BLOCK_BYTES=block_bytes, BITS=bits or 0, BLOCK_I=block_i,
        num_warps=4)
    return out


def _embedding_impl(ids: torch.Tensor, data: torch.Tensor, scales: torch.Tensor | None, biases: torch.Tensor | None,
                  fmt: str, N: int, K: int, bits: int, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    return _launch_embedding(ids, data, scales, biases, fmt, N, K, bits, group_size, dtype)


_embedding_op = torch.library.custom_op("llmkernels::quant_embedding", mutates_args=())(_embedding_impl)


@_embedding_op.register_fake
def _(ids, data, scales, biases, fmt, N, K, bits, group_size, dtype):
    return ids.new_empty(ids.numel(), K, dtype=dtype)


def _check_qt(name: str, qt, x=None):
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"{name} must be a QuantizedTensor (llmkernels.quantize), got {type(qt).__name__}")
    if len(qt.shape) != 2:
        raise ValueError(f"{name} must be a 2-D weight [N, K], got logical shape {tuple(qt.shape)}")


def _check_x(name: str, x, K: int) -> torch.Tensor:
    check_tensor(name, x, dtypes=X_DTYPES, last_dim_contiguous=True)
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"{name} must be [M, K={K}] (K = the weight's input dim), got shape {tuple(x.shape)}")
    x2 = x.reshape(-1, K)
    if x2.shape[0] == 0:
        raise ValueError(f"{name} has M = 0 rows (shape {tuple(x.shape)}); gemv needs at least one")
    return x2


def _check_act(act_int8) -> int:
    if not isinstance(act_int8, bool):
        raise TypeError(f"act_int8 must be a bool, got {type(act_int8).__name__}")
    return int(act_int8)


def gemv(x: torch.Tensor, qt: QuantizedTensor, act_int8: bool = False) -> torch.Tensor:
    """y = x @ dequantize(qt).T with the weights dequantized in registers (read once from memory).

    Args:
        x: [M, K] (or [..., K]) fp16/bf16 (fp32 accepted), last dim contiguous.
        qt: QuantizedTensor [N, K] in any GGUF format or MLX affine.
        act_int8: allow rounding x to int8 per block of 32 (scale absmax / 127, like llama.cpp's q8_1
            activations) for integer dot products, where that measured faster: q4_0, q8_0, q4_k, q5_k and q6_k at
            M = 1 (route.I8_MAX_M), with fp16/bf16 x and K a multiple of 256 (2048 for q6_k). The rounding costs
            about 1/254 of each block's absmax per element. Other cases compute exactly as without it.
    Returns [M, N] (or [..., N]) in x's dtype. The kernel is chosen by ``qgemv.route.choose`` (its docstring lists
    the rules; ``python -m llmkernels info --route FORMAT M N K`` prints the choice): up to M = 64 one launch reads
    each weight once (q4_0, q8_0 and q6_k on the tensor cores from M = 1, q4_k and MLX 4-bit from M = 2, q5_k from
    M = 3); beyond, it dequantizes once and calls cuBLAS. f16/bf16 weights with x of the same dtype go to cuBLAS
    from M = 2.

    >>> qt = llmkernels.quantize(torch.randn(4096, 4096), "q4_k").cuda()
    >>> y = gemv(torch.randn(1, 4096, dtype=torch.float16, device="cuda"), qt)
    """
    _check_qt("qt", qt)
    N, K = qt.shape
    x2 = _check_x("x", x, K)
    check_device(x=x, qt_data=qt.data)
    act = _check_act(act_int8)
    y = call_op(_gemv_op, _gemv_impl, x2, None, *_qt_args(qt)[:3], None, None, None, *_qt_args(qt)[3:], 0, act)
    return y.reshape(*x.shape[:-1], N)


def gemv_lanes(x: torch.Tensor, x_lanes: torch.Tensor, qt: QuantizedTensor) -> torch.Tensor:
    """gemv(x, qt) for a caller that also has x in lane order (``x_lanes`` = m1.lane_order(x), or written so by the
    kernel that produced x, as the engine's RMSNorm and SiLU kernels do). q4_k at M = 1 then reads the activations
    as whole lines (see m1.lane_pos); every other case computes gemv(x, qt) and ignores x_lanes.

    x: [M, K] fp16/bf16/fp32; x_lanes: [M, m1.lanes_width(K)], x's dtype.
    """
    from .m1 import lanes_width

    _check_qt("qt", qt)
    N, K = qt.shape
    x2 = _check_x("x", x, K)
    check_tensor("x_lanes", x_lanes, dtypes=(x.dtype,), last_dim_contiguous=True)
    if tuple(x_lanes.shape) != (x2.shape[0], lanes_width(K)):
        raise ValueError(f"x_lanes must be [M, {lanes_width(K)}] for x of shape {tuple(x.shape)}, got "
                         f"{tuple(x_lanes.shape)}")
    check_device(x=x, x_lanes=x_lanes, qt_data=qt.data)
    y = call_op(_gemv_op, _gemv_impl, x2, x_lanes, *_qt_args(qt)[:3], None, None, None, *_qt_args(qt)[3:], 3, 0)
    return y.reshape(*x.shape[:-1], N)


def _gemv_i8_impl(xq: torch.Tensor, ds: torch.Tensor, data: torch.Tensor, N: int, K: int,
                  out_dtype: torch.dtype, fmt: str) -> torch.Tensor:
    return _launch_i8_lanes(xq, ds, data, N, K, out_dtype, fmt)


_gemv_i8_op = torch.library.custom_op("llmkernels::quant_gemv_i8_lanes", mutates_args=())(_gemv_i8_impl)


@_gemv_i8_op.register_fake
def _(xq, ds, data, N, K, out_dtype, fmt):
    return xq.new_empty(1, N, dtype=out_dtype)


def gemv_i8_lanes(xq: torch.Tensor, ds: torch.Tensor, qt: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
    """gemv(x, qt, act_int8=True) for a caller that has x already rounded to int8 in i8 lane order: (xq, ds) =
    int8.quantize_act(x, lanes=True), or written so by the kernel that produced x (the engine's RMSNorm). q4_k or
    q5_k (K a multiple of 256) or q6_k (K a multiple of 2048), 16-byte aligned contiguous data, one activation row.

    xq: int8 [1, m1.lanes_width(K)]; ds: float32 [1, K / 32, 2] (scale d, d * sum q per block of 32). Returns
    [1, N] in ``out_dtype`` (fp16/bf16/fp32).
    """
    from .int8 import i8_lanes_supports
    from .m1 import lanes_width

    _check_qt("qt", qt)
    N, K = qt.shape
    if not i8_lanes_supports(qt.data, qt.format, K):
        raise ValueError(f"gemv_i8_lanes needs q4_k or q5_k weights with K a multiple of 256 or q6_k with K a "
                         f"multiple of 2048, contiguous and 16-byte aligned, got {qt.format} [{N}, {K}]")
    check_tensor("xq", xq, dtypes=(torch.int8,), last_dim_contiguous=True)
    check_tensor("ds", ds, dtypes=(torch.float32,))
    if tuple(xq.shape) != (1, lanes_width(K)) or tuple(ds.shape) != (1, K // 32, 2) or not ds.is_contiguous():
        raise ValueError(f"xq must be [1, {lanes_width(K)}] and ds a contiguous [1, {K // 32}, 2] for K = {K}, got "
                         f"{tuple(xq.shape)} and {tuple(ds.shape)}")
    if out_dtype not in X_DTYPES:
        raise TypeError(f"out_dtype must be one of {X_DTYPES}, got {out_dtype}")
    check_device(xq=xq, ds=ds, qt_data=qt.data)
    return call_op(_gemv_i8_op, _gemv_i8_impl, xq, ds, qt.data, N, K, out_dtype, qt.format)


def silu_mul_gemv(gate: torch.Tensor, up: torch.Tensor, qt: QuantizedTensor, act_int8: bool = False) -> torch.Tensor:
    """(silu(gate) * up) @ dequantize(qt).T, the product formed while loading (never written to memory).

    gate, up: [M, K] fp16/bf16 of one shape; qt: [N, K] (the down projection). Returns [M, N] in gate's dtype.
    act_int8: as in gemv (the product is formed in float32 and rounded to int8 per block of 32, written as int8).

    >>> y = silu_mul_gemv(gate, up, w_down)
    """
    _check_qt("qt", qt)
    N, K = qt.shape
    g2 = _check_x("gate", gate, K)
    u2 = _check_x("up", up, K)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate and up must match, got {tuple(gate.shape)}/{gate.dtype} and "
                         f"{tuple(up.shape)}/{up.dtype}")
    check_device(gate=gate, up=up, qt_data=qt.data)
    act = _check_act(act_int8)
    y = call_op(_gemv_op, _gemv_impl, g2, u2, *_qt_args(qt)[:3], None, None, None, *_qt_args(qt)[3:], 1, act)
    return y.reshape(*gate.shape[:-1], N)


def gate_up_silu(x: torch.Tensor, qt_gate: QuantizedTensor, qt_up: QuantizedTensor) -> torch.Tensor:
    """silu(x @ W_gate.T) * (x @ W_up.T) in one pass over both weight matrices.

    x: [M, K] fp16/bf16; qt_gate, qt_up: [N, K] of one format. Returns [M, N] in x's dtype.

    >>> h = gate_up_silu(x, w_gate, w_up)
    """
    _check_qt("qt_gate", qt_gate)
    _check_qt("qt_up", qt_up)
    if (qt_gate.format, qt_gate.shape, qt_gate.bits, qt_gate.group_size) != \
            (qt_up.format, qt_up.shape, qt_up.bits, qt_up.group_size):
        raise ValueError(f"qt_gate and qt_up must share format and shape, got {qt_gate!r} and {qt_up!r}")
    N, K = qt_gate.shape
    x2 = _check_x("x", x, K)
    check_device(x=x, qt_gate=qt_gate.data, qt_up=qt_up.data)
    y = call_op(_gemv_op, _gemv_impl, x2, None, qt_gate.data, qt_gate.scales, qt_gate.biases, qt_up.data,
                qt_up.scales, qt_up.biases,
                 *_qt_args(qt_gate)[3:], 2, 0)
    return y.reshape(*x.shape[:-1], N)


def embedding(ids: torch.Tensor, qt: QuantizedTensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Rows of dequantize(qt) picked by ids: int32/int64 ids of any shape -> [*ids.shape, K] in ``dtype``.

    Ids outside [0, N) raise ValueError (checked on the host unless inside CUDA-graph capture).

    >>> e = embedding(torch.tensor([[1, 5, 7]], device="cuda"), tok_embd)
    """
    _check_qt("qt", qt)
    check_tensor("ids", ids, dtypes=(torch.int32, torch.int64))
    if dtype not in X_DTYPES:
        raise TypeError(f"dtype must be one of {X_DTYPES}, got {dtype}")
    check_device(ids=ids, qt_data=qt.data)
    N, K = qt.shape
    from .._checks import _capturing

    if ids.numel() and not _capturing():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= N:
            raise ValueError(f"ids must be in [0, {N}) (rows of qt), got values in [{lo}, {hi}]")
    out = call_op(_embedding_op, _embedding_impl, ids.reshape(-1).contiguous(), qt.data, qt.scales, qt.biases,
                  qt.format, N, K,
                        qt.bits or 0, qt.group_size or 0, dtype)
    return out.reshape(*ids.shape, K)
