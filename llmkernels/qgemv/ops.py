"""Host side of the quantized GEMV family: layouts per format, config choice, split-K, torch.library ops."""
from __future__ import annotations

import torch
import triton

from .._checks import call_op, check_device, check_tensor, interpreter_mode
from .._pdl import pdl_supported
from .._runtime import empty, gpu_name, has_tma, num_sms
from ..quant.formats import GGUF_FORMATS
from ..quant.tensor import QuantizedTensor
from ..tuning import lookup
from .common import _finish, _views, split_k  # noqa: F401  (split_k: part of ops' interface)

FORMAT_IDS = {"f32": 0, "f16": 1, "bf16": 2, "q4_0": 3, "q4_1": 4, "q5_0": 5, "q5_1": 6, "q8_0": 7, "q2_k": 8,
              "q3_k": 9, "q4_k": 10, "q5_k": 11, "q6_k": 12, "mlx": 13}
X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SMALL_M = 16  # one launch covers M <= 16 with each weight tile reused for every row
MID_M = 64  # up to here: M-blocks of 16 in the grid; beyond: dequantize once + cuBLAS
# f16/bf16 weights with activations of the same dtype go to cuBLAS from M = 2 (f32 stays on the kernel, whose float32
# products do not depend on torch's TF32 setting)
DENSE_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}
# the m1 kernel (up to 4 activation rows per program) serves each format up to this M; q4_k's covers
# silu_mul_gemv and the GLU, plain gemv takes the tensor cores earlier (bench/NOTES.md, GEMV routing)
M1_MAX_M = {"q4_k": 4, "q5_k": 8, "q6_k": 4, "mlx": 2}
# The tensor-core kernel (tc.py): gemv takes it from TC_FIRST_M rows up to MID_M, from TC_FIRST_M_LARGE on
# long or wide matrices (K >= TC_LONG_K or N >= TC_WIDE_N); silu_mul_gemv from TC_FIRST_M, past M1_MAX_M
# for the formats of TC_SILU_M1 (bench/NOTES.md, GEMV routing)
TC_FIRST_M = {"q4_0": 1, "q8_0": 1, "q6_k": 1, "q4_k": 2, "mlx4": 2, "q5_k": 3}
TC_FIRST_M_LARGE = {"mlx4": 1, "q5_k": 2}
TC_LONG_K = 8192
TC_WIDE_N = 32768
TC_SILU_M1 = ("q4_k", "mlx4")
TC_SILU = True  # silu_mul_gemv may take the tensor-core kernel (off: the m1 or planes kernel, for A/B labs)


def tc_first_m(name: str, N: int, K: int, silu: bool = False):
    """The first M at which gemv (or with ``silu``, silu_mul_gemv) of an [N, K] matrix in format ``name`` (GGUF
    name, or "mlx4") takes the tensor-core kernel, or None if it never does (see TC_FIRST_M)."""
    first = TC_FIRST_M.get(name)
    if first is None or (silu and not TC_SILU):
        return None
    if silu:
        return max(first, M1_MAX_M["mlx" if name.startswith("mlx") else name] + 1) if name in TC_SILU_M1 else first
    if K >= TC_LONG_K or N >= TC_WIDE_N:
        first = min(first, TC_FIRST_M_LARGE.get(name, first))
    return first
# (BLOCK_N, warps, stages, waves[, load one step ahead, register cap]) without a table entry; the table's
# "tc/<format>/m1" serves M = 1, "tc/<format>/silu" silu_mul_gemv, "tc/<format>" the rest
TC_DEFAULTS = {"q4_0": (64, 4, 1, 4), "q8_0": (128, 8, 1, 2), "q5_k": (64, 4, 1, 4, 0, 128),
               "q6_k": (64, 4, 1, 4, 0, 128)}
# the register cap (a config's sixth field) applies up to this M: with 32 or 64 rows per program it spills
TC_CAP_MAX_M = {"q5_k": 16, "q6_k": 32}
# From TC_XT_MIN_M rows on, gemv hands the tensor-core kernel x in its k order (tc.tc_order) and the kernel
# reads each step's x tile by TMA (sm_90+): from 32 rows on x's traffic outweighs the weights'. Its K split
# keeps the grid within TC_XT_WAVES programs per SM; q8_0 keeps the register path at 64 rows (bench/NOTES.md)
TC_XT = True
TC_XT_MIN_M = 17
TC_XT_WAVES = {32: 4, 64: 2}
TC_XT_NOT_64 = ("q8_0",)
# with act_int8: the integer dot-product kernels (int8.py) up to this M per format, where they beat the exact
# kernels (bench/NOTES.md, GEMV routing); beyond it they read the weights once per two rows and lose
I8_MAX_M = {"q4_0": 1, "q8_0": 1, "q4_k": 1, "q5_k": 1, "q6_k": 1}
# (R, warps, waves, stages[, KT]) of the int8 lane kernels without an "i8lanes/<key>" table entry; q6_k
# with K >= I8_Q6_LONG_K takes "q6_k/long" (a second K split pays on long rows only)
I8_LANES_DEFAULTS = {"q4_k": (1, 4, 2, 1), "q5_k": (1, 4, 1, 1), "q6_k": (1, 4, 2, 1, 4),
                     "q6_k/long": (1, 4, 4, 1, 4)}
I8_Q6_LONG_K = 8192
# q4_k at M = 1 reads activations in lane order (m1.lane_order); gemv copies x into lane order itself for
# matrices of at least this many weights, where the lane kernel pays back the copy's launch
LANES_MIN_WEIGHTS = 1 << 25
LANES_DEFAULT = (2, 1, 4, 3, 8, 1, 1)  # (R, NB, warps, stages, KT, H, waves) when the table has no "lanes/q4_k"
# fused silu_mul_gemv, q4_k, M = 1, large matrices: twice the rows per thread and lanes over half chunks,
# three programs per SM (table key "m1/q4_k/silu_large"; not tuned, so not in the table)
SILU_LARGE_DEFAULT = (8, 1, 4, 3, 4, 2, 3)  # (R, NB, warps, stages, KT, H, waves); not tuned, so not in the table


def _layout(fmt: str, K: int, row_bytes: int, group_size: int | None):
    """(NSUB, SUB, BLOCK_BYTES, nblocks, family) of a format: how a row splits into blocks and sub-blocks."""
    if fmt == "mlx":
        return 1, group_size, 0, K // group_size, "mlx"
    f = GGUF_FORMATS[fmt]
    if f.family == "dense":
        return 1, 32, 0, triton.cdiv(K, 32), "dense"
    if f.family == "legacy":
        return 1, 32, f.block_bytes, K // 32, "legacy"
    nsub, sub = (8, 32) if fmt in ("q4_k", "q5_k") else (16, 16)
    return nsub, sub, f.block_bytes, K // 256, "kquant"


def _interpreter_config(N: int, nb_small: int):
    """Small tiles exercise the masks of small test shapes; model-sized matrices (N >= 128) take large tiles,
    because the interpreter's cost is per program and per loop step, not per element."""
    return (16, nb_small, 4, 1) if N < 128 else (64, 4 * nb_small, 4, 1)


def _config(family: str, M: int, sub_k: int, bits: int = 0, N: int = 0):
    """(BLOCK_N, NB, num_warps, num_stages) from the tuned table, keyed on GPU, format family and M class."""
    if interpreter_mode():
        return _interpreter_config(N, max(1, 64 // sub_k))
    if family == "mlx" and bits and 32 % bits:
        family = "mlx_odd"  # 3/5/6-bit: two word loads per weight; pipelining them overflows shared memory
    key = f"{family}/{'m1' if M == 1 else 'm16'}"
    entry = lookup("gemv", gpu_name(), key)
    if entry is not None:
        return tuple(entry)
    stages = 1 if family == "mlx_odd" else 3
    return (32 if M == 1 else 64), max(1, 256 // sub_k), 4, stages


def _planes_layout(fmt: str, bits: int, group_size: int):
    """(C, U, P, block size, block bytes, default NB) for formats with a planes kernel, else None."""
    if fmt == "q4_0":
        return 1, 16, 2, 32, 18, 8
    if fmt == "q8_0":
        return 1, 32, 1, 32, 34, 8
    if fmt == "q4_k":
        return 4, 32, 2, 256, 144, 1
    if fmt == "mlx" and bits in (2, 4, 8):
        per_word = 32 // bits
        return 1, group_size // per_word, per_word, group_size, 0, max(1, 256 // group_size)
    return None


def _planes_config(fmt: str, M: int, nb_default: int, bits: int, N: int = 0):
    """(BLOCK_N, NB, num_warps, num_stages) for the planes kernel from the tuned table."""
    if interpreter_mode():
        return _interpreter_config(N, max(1, nb_default // 4))
    name = fmt if fmt != "mlx" else f"mlx{bits}"
    entry = lookup("gemv", gpu_name(), f"planes/{name}/{'m1' if M == 1 else 'm16'}")
    if entry is not None:
        return tuple(entry)
    return (32 if M == 1 else 64), nb_default, 4, 3


def m1_key(name: str, M: int) -> str:
    """The tuned-table key of the m1 kernel's config for format ``name`` ('q4_k', 'mlx4', 'mlx8') at M rows: one per
    M class, since M = 1, 2 and 3-4 (run as 4 rows per program) favour different tiles."""
    return f"m1/{name}" + ("" if M == 1 else "/m2" if M == 2 else "/m4")


def _m1_config(name: str, M: int, N: int, small: bool = False) -> tuple:
    """The m1 kernel's config for format ``name`` at M rows: the tuned table's M-class entry, else its M = 1 entry
    (the interpreter: a small fixed tile, the smallest with ``small``). q6_k takes at least 2 threads per chunk
    (see m1.M1_LAYOUTS)."""
    if interpreter_mode():
        cfg = (1, 1, 1, 1) if small else (2, 1, 4, 1)
    else:
        cfg = tuple(lookup("gemv", gpu_name(), m1_key(name, M)) or lookup("gemv", gpu_name(), f"m1/{name}")
                    or (4, 1, 4, 3))
    if name == "q6_k" and (len(cfg) < 6 or cfg[5] < 2):
        cfg = cfg[:4] + (cfg[4] if len(cfg) > 4 else 1, 2) + cfg[6:]
    return cfg


def _launch_i8_lanes(xq, ds, data, N, K, out_dtype, fmt="q4_k"):
    """q4_k, q5_k or q6_k, one activation row rounded to int8 in i8 lane order (xq, ds): int8.py's lane kernels."""
    from .int8 import launch_i8_lanes

    interp = interpreter_mode()
    key = "q6_k/long" if fmt == "q6_k" and K >= I8_Q6_LONG_K else fmt
    if interp:  # q6_k programs take 8 / KT rows per warp and R
        small = N < (64 if fmt == "q6_k" else 128)
        if fmt == "q6_k":
            config = (1, 1, 1, 1, 2) if small else (1, 4, 1, 1, 4)
        else:
            config = (1, 1, 1, 1) if small else (2, 4, 1, 1)
    else:
        config = tuple(lookup("gemv", gpu_name(), f"i8lanes/{key}") or I8_LANES_DEFAULTS[key])
    y = launch_i8_lanes(xq, ds, data, N, K, config, num_sms(xq.device), not interp, out_dtype,
                        pdl=pdl_supported(xq.device), fmt=fmt)
    return _finish(y, out_dtype)


def _launch_i8(x, x2, data, fmt, N, K):
    """gemv with x (or silu(x) * x2) rounded to int8 per block of 32, through int8.py's kernels."""
    from .int8 import i8_lanes_supports, launch_i8, quantize_act

    interp = interpreter_mode()
    if x.shape[0] == 1 and i8_lanes_supports(data, fmt, K):
        xq, ds = quantize_act(x, x2, lanes=True)
        return _launch_i8_lanes(xq, ds, data, N, K, x.dtype, fmt)
    xq, ds = quantize_act(x, x2)
    if interp:
        config = (2, 4, 1, 1) if N < 128 else (2, 4, 4, 1)
    else:
        # three size classes (tuning.tune gemv_i8, bench/lab/i8_lab.py: on an H100 the best config of one class loses
        # up to 1.4x on another)
        size = "wide" if N >= 32768 else ("large" if N * K > 32 * 2**20 else "small")
        config = tuple(lookup("gemv", gpu_name(), f"i8/{fmt}/{size}") or (1, 4, 4, 3))
    y = launch_i8(xq, ds, data, fmt, N, K, config, num_sms(x.device), not interp, x.dtype)
    return _finish(y, x.dtype)


def lanes_apply(M: int, dtype: torch.dtype, data: torch.Tensor, fmt: str, K: int, act: int = 0) -> bool:
    """Whether gemv of M activation rows of ``dtype`` with these weights runs the lane-order kernel: q4_k (with the
    16-byte aligned blocks the m1 kernel reads), M = 1, fp16/bf16, unless ``act`` (act_int8) sends it to the int8
    kernel."""
    return (fmt == "q4_k" and M == 1 and not (act and M <= I8_MAX_M.get(fmt, 0))
            and dtype in (torch.float16, torch.bfloat16) and K % 256 == 0 and data.data_ptr() % 16 == 0)


def _lanes_config(N: int, glu: bool):
    """The lane-order kernel's config (GLU needs an even R: two weight rows per output)."""
    if interpreter_mode():
        return (2 if glu else 1, 1, 1, 1, 8) if N < 128 else (2, 1, 4, 1, 8)
    config = tuple(lookup("gemv", gpu_name(), "lanes/q4_k") or LANES_DEFAULT)
    return config if not glu or config[0] % 2 == 0 else LANES_DEFAULT


def _launch_lanes(x, xl, data, N, K, up=None):
    """The q4_k m1 kernel over xl, x in lane order (m1.lane_order); with ``up``, silu(x W^T) * (x up^T)."""
    from .m1 import launch_m1

    y = launch_m1(xl, data, "q4_k", N, K, _lanes_config(N, up is not None), num_sms(x.device),
                  unpack=1 if interpreter_mode() else 2, pdl=pdl_supported(x.device), x_perm=True, up=up)
    return _finish(y, x.dtype)


def _launch_glu(x, data, up, N, K):
    """silu(x W^T) * (x up^T) for q4_k at M <= M1_MAX_M through the m1 kernel (GLU: both rows of an output in one
    thread), or None where it does not apply (then the generic dual kernel runs)."""
    from .m1 import lane_order, launch_m1, m1_supports

    M = x.shape[0]
    if not (M <= M1_MAX_M["q4_k"] and up.data_ptr() % 16 == 0 and m1_supports(x, data, "q4_k")):
        return None
    if N * K >= LANES_MIN_WEIGHTS and lanes_apply(M, x.dtype, data, "q4_k", K):
        return _launch_lanes(x, lane_order(x, pdl_supported(x.device)), data, N, K, up=up)
    interp = interpreter_mode()
    config = (2, 1, 1, 1) if interp and N < 128 else _m1_config("q4_k", M, N)
    if config[0] % 2:
        return None
    y = launch_m1(x, data, "q4_k", N, K, config, num_sms(x.device), unpack=1 if interp else 2,
                  pdl=pdl_supported(x.device), up=up)
    return _finish(y, x.dtype)


def _launch_gemv(x, x2, data, scales, biases, data2, scales2, biases2, fmt, N, K, bits, group_size, mode, act=0):
    M = x.shape[0]
    if mode == 3:  # x2: x in lane order (_gemv_impl has checked that the lane kernel applies)
        return _launch_lanes(x, x2, data, N, K)
    if mode == 0 and N * K >= LANES_MIN_WEIGHTS and lanes_apply(M, x.dtype, data, fmt, K, act):
        from .m1 import lane_order

        return _launch_lanes(x, lane_order(x, pdl_supported(x.device)), data, N, K)
    if mode == 2 and fmt == "q4_k" and x.dtype != torch.float32:  # both projections' rows in one thread (m1 GLU)
        y = _launch_glu(x, data, data2, N, K)
        if y is not None:
            return y
    if act == 1 and mode != 2 and M <= I8_MAX_M.get(fmt, 0) and x.dtype != torch.float32:
        from .int8 import i8_lanes_supports, i8_supports

        if i8_supports(data, fmt, K) or (M == 1 and i8_lanes_supports(data, fmt, K)):
            return _launch_i8(x, x2 if mode == 1 else None, data, fmt, N, K)
    row_bytes = data.shape[-1] * data.element_size()
    nsub, sub, block_bytes, nblocks, family = _layout(fmt, K, row_bytes, group_size)
    m_pad = 1 if M == 1 else SMALL_M
    grid_m = triton.cdiv(M, m_pad)
    sms = num_sms(x.device)
    out_dtype = x.dtype
    w8, w16, wi8 = _views(data)
    ws = scales if scales is not None else w16
    wb = biases if biases is not None else w16
    m1_fmt = fmt in ("q4_k", "q5_k", "q6_k") or (fmt == "mlx" and bits in (4, 8))
    first = tc_first_m(fmt if fmt != "mlx" else f"mlx{bits}", N, K, mode == 1) if mode != 2 else None
    if first is not None and first <= M <= MID_M:
        # tensor cores (tc.py): all M rows in one program (16, 32 or 64 of them), each weight read once
        from .tc import launch_tc, tc_order, tc_rows, tc_supports

        if tc_supports(x, data, fmt, bits, group_size, K, scales, biases):
            interp = interpreter_mode()
            name = fmt if fmt != "mlx" else "mlx4"
            if interp:
                config = (16, 4, 1, 2)
            else:
                gpu = gpu_name()
                config = tuple((M == 1 and lookup("gemv", gpu, f"tc/{name}/m1"))
                               or (mode == 1 and lookup("gemv", gpu, f"tc/{name}/silu"))
                               or lookup("gemv", gpu, f"tc/{name}") or TC_DEFAULTS.get(name, (64, 4, 1, 4)))
                if len(config) > 5 and M > TC_CAP_MAX_M.get(name, MID_M):
                    config = config[:5]  # no register cap
            xt = None
            rows = tc_rows(M)
            if TC_XT and mode == 0 and M >= TC_XT_MIN_M and K % 256 == 0 and not (
                    rows == 64 and name in TC_XT_NOT_64) and has_tma(x.device):
                xt = tc_order(x, fmt)
                if xt is not None and not interp:
                    config = tuple(lookup("gemv", gpu_name(), f"tc/{name}/xt{rows}")
                                   or config[:3] + (TC_XT_WAVES[rows],) + config[4:])
            y = launch_tc(x, data, N, K, config, sms, 1 if interp else 2, scales, biases, group_size, fmt=fmt,
                          x2=x2 if mode == 1 else None, xt=xt)
            return _finish(y, out_dtype)
    if m1_fmt and M <= M1_MAX_M[fmt] and mode != 2:  # scales factored out of the products (m1.py)
        from .m1 import launch_m1, m1_supports

        silu_x2 = x2 if mode == 1 else None  # silu_mul_gemv: silu(x) * x2 formed in the kernel's loads
        if m1_supports(x, data, fmt, bits, group_size, K, x2=silu_x2):
            interp = interpreter_mode()
            config = _m1_config(fmt if fmt != "mlx" else f"mlx{bits}", M, N, small=interp and N < 128)
            if silu_x2 is not None and fmt == "q4_k" and M == 1 and N * K >= LANES_MIN_WEIGHTS and not interp:
                config = tuple(lookup("gemv", gpu_name(), "m1/q4_k/silu_large") or SILU_LARGE_DEFAULT)
            y = launch_m1(x, data, fmt, N, K, config, sms, unpack=1 if interp else 2, scales=scales, biases=biases,
                          bits=bits, group_size=group_size, x2=silu_x2, pdl=pdl_supported(x.device))
            return _finish(y, out_dtype)
    planes = _planes_layout(fmt, bits, group_size)
    if planes is not None and mode != 2:
        from .planes import gemv_planes_kernel

        C, U, P, BS, BB, nb_p = planes
        block_n_p, nb_p, warps_p, stages_p = _planes_config(fmt, M, nb_p, bits, N)
        programs_n = triton.cdiv(N, block_n_p)
        split, per_split = split_k(programs_n * grid_m, nblocks, nb_p, sms)
        y = empty(split, M, N, dtype=torch.float32 if split > 1 else out_dtype, device=x.device)
        gemv_planes_kernel[(programs_n, split, grid_m)](
            x, x2 if x2 is not None else x, w8, w16, wi8, ws, wb, y, M, N, K, x.stride(0),
            x2.stride(0) if x2 is not None else 0, y.stride(0), y.stride(1), row_bytes,
            scales.stride(0) if scales is not None else 0, nblocks, per_split,
            FMT=FORMAT_IDS[fmt], NB=nb_p, C=C, U=U, P=P, BS=BS, BLOCK_BYTES=BB, BITS=bits or 0, BLOCK_N=block_n_p,
            M_PAD=m_pad, SILU_X=mode == 1, num_warps=warps_p, num_stages=stages_p)
        return _finish(y, out_dtype)
    # the generic kernel, every format and mode
    block_n, nb, warps, stages = _config(family, M, nsub * sub, bits, N)
    if fmt == "f32":  # twice the bytes of the f16 tiles the table was tuned with: halve the K extent
        nb = max(1, nb // 2)
    programs_n = triton.cdiv(N, block_n)
    # the fused gate/up mode applies silu to whole sums, so it never splits K
    split, per_split = split_k(programs_n * grid_m, nblocks, nb, sms, waves=0 if mode == 2 else 2)
    y = empty(split, M, N, dtype=torch.float32 if split > 1 else out_dtype, device=x.device)
    if data2 is not None:
        v8, v16, vi8 = _views(data2)
        vs = scales2 if scales2 is not None else v16
        vb = biases2 if biases2 is not None else v16
    else:
        v8, v16, vi8, vs, vb = w8, w16, wi8, ws, wb
    from .kernels import gemv_kernel

    gemv_kernel[(programs_n, split, grid_m)](
        x, x2 if x2 is not None else x, w8, w16, wi8, ws, wb, v8, v16, vi8, vs, vb, y,
        M, N, K, x.stride(0), x2.stride(0) if x2 is not None else 0, y.stride(0), y.stride(1), row_bytes,
        scales.stride(0) if scales is not None else 0, nblocks, per_split,
        FMT=FORMAT_IDS[fmt], NB=nb, NSUB=nsub, SUB=sub, BLOCK_BYTES=block_bytes, BITS=bits or 0, BLOCK_N=block_n,
        M_PAD=m_pad, SILU_X=mode == 1, DUAL=mode == 2, num_warps=warps, num_stages=stages)
    return _finish(y, out_dtype)


def _qt_args(qt: QuantizedTensor):
    return qt.data, qt.scales, qt.biases, qt.format, qt.shape[0], qt.shape[1], qt.bits or 0, qt.group_size or 0


def _gemv_impl(x: torch.Tensor, x2: torch.Tensor | None, data: torch.Tensor, scales: torch.Tensor | None,
             biases: torch.Tensor | None, data2: torch.Tensor | None, scales2: torch.Tensor | None,
             biases2: torch.Tensor | None, fmt: str, N: int, K: int, bits: int, group_size: int,
             mode: int, act: int) -> torch.Tensor:
    M = x.shape[0]
    if mode == 3 and not lanes_apply(M, x.dtype, data, fmt, K):  # gemv_lanes where the lane kernel does not apply
        mode, x2 = 0, None
    if mode == 0 and M >= 2 and DENSE_DTYPES.get(fmt) == x.dtype and data.shape[-1] == K * x.element_size():
        # weights stored in x's dtype: cuBLAS on them as they lie (faster than the dense kernel from M = 2: 1.02-1.3x
        # less time at M = 2..16 on an H100, bench file 20261122-185140, f16 rows; M = 1 stays on the kernel)
        return x @ data.view(x.dtype).T
    if M > MID_M:  # large M: dequantize once with the embedding kernel, then one cuBLAS product
        a = x if mode != 1 else torch.nn.functional.silu(x.float()).mul_(x2.float()).to(x.dtype)
        w = _launch_embedding(torch.arange(N, device=x.device), data, scales, biases, fmt, N, K, bits,
                              group_size, x.dtype)
        if mode == 2:
            w2 = _launch_embedding(torch.arange(N, device=x.device), data2, scales2, biases2, fmt, N, K, bits,
                                   group_size, x.dtype)
            return (torch.nn.functional.silu((a @ w.T).float()) * (a @ w2.T).float()).to(x.dtype)
        return a @ w.T
    return _launch_gemv(x, x2, data, scales, biases, data2, scales2, biases2, fmt, N, K, bits, group_size, mode,
                        act)


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
    nsub, sub, block_bytes, nblocks, _ = _layout(fmt, K, row_bytes, group_size)
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
            activations) for integer dot products, where that measured faster: q4_0, q8_0 and q4_k at M = 1, with
            fp16/bf16 x and K a multiple of 256. The rounding costs about 1/254 of each block's absmax per element.
            Other cases compute exactly as without it.
    Returns [M, N] (or [..., N]) in x's dtype. Fastest for M <= 16 (one launch, tiles reused across rows); up to
    M = 64 it launches M-blocks of 16 (q4_k and MLX 4-bit from M = 3, q4_0 and q8_0 from M = 1: all rows in one
    tensor-core program); beyond, it dequantizes once and calls cuBLAS. f16/bf16 weights with x of the same dtype
    go to cuBLAS from M = 2.

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
