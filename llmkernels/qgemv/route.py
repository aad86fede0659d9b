"""Which kernel computes a quantized product, and with which config: every GEMV routing rule, in one place.

``choose`` is a pure function of the product (operation, format, M, N, K, activation dtype, act_int8), a few facts
about the operands' memory (``Operands``) and the target (``Target``: the GPU's table name, the interpreter, TMA).
It returns a ``Route``; the launchers in ops.py only carry it out. The rules, in the order ``choose`` applies them:

1. ``cublas``: f16/bf16 weights with activations of their dtype, M >= 2 (plain gemv): cuBLAS on the weights as
   they lie.
2. ``dequant``: M > MID_M: the weights dequantized once, then one cuBLAS product.
3. ``lanes``: q4_k at M = 1 with activations in lane order (given by gemv_lanes, or copied by gemv itself for
   matrices of at least LANES_MIN_WEIGHTS weights); with gate_up, both projections in one pass.
4. ``glu``: gate_up on q4_k up to M1_MAX_M rows: a gate and an up row per thread (the m1 kernel).
5. ``i8`` / ``i8_lanes``: with act_int8, up to I8_MAX_M rows: activations rounded to int8, integer dot products
   (the lane kernels at M = 1 where they read the format).
6. ``tc``: the tensor-core kernel from tc_first_m rows up to MID_M (x in k order, read by TMA, from TC_XT_MIN_M).
7. ``m1``: q4_k, q5_k, q6_k and MLX 4/8-bit up to M1_MAX_M rows: scales factored out of the products.
8. ``planes``: q4_0, q8_0, q4_k and MLX 2/4/8-bit: the bit-plane kernel.
9. ``generic``: every format and operation.

Measurements behind the thresholds: bench/NOTES.md, "GEMV routing". Experiments change routes through
``override`` (a context manager), never by assigning this module's constants.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..quant.formats import GGUF_FORMATS
from ..tuning import lookup

OPS = ("gemv", "silu_mul", "gate_up", "lanes")  # y = x W^T; silu(x) * x2 then W; silu(x G^T) * (x U^T); x in lanes
KERNELS = ("cublas", "dequant", "lanes", "glu", "i8", "i8_lanes", "tc", "m1", "planes", "generic")
# qgemv.moe: a GEMV per (token, expert) pair (the m1 kernel where it reads the format, else the generic one); pairs
# grouped by expert
MOE_KERNELS = ("moe_gemv", "moe_m1", "moe_grouped", "moe_tc")
# MoE products whose pairs choose each of their experts this many times on average (for uniformly random choices)
# run on the tensor cores, pairs grouped by expert (moe_tc), where the kernel reads the format; fewer, a GEMV per
# pair (bench/NOTES.md: Qwen3-30B-A3B's shapes, 1.13 per expert at 4 tokens 0.86x, 1.58 at 16 tokens 1.32x)
MOE_TC_MIN_REUSE = 1.25
# the down product's config (N = hidden, K = the expert FFN, 768 in Qwen3-30B-A3B: few steps per program) without a
# table entry: wider tiles, 8 warps (bench/lab/moe_lab.py sweep: 4-21% faster than the dense entries there)
MOE_TC_DOWN = {"q4_k": (128, 8, 1, 1, 0, 128), "q6_k": (128, 8, 1, 1, 0, 128)}
# small MoE grids (few pairs) split K: up to this many ways, until MOE_TC_WAVES busy programs per SM, each split
# at least MOE_TC_MIN_STEPS 256-weight steps (moe_tc_split)
MOE_TC_MAX_SPLIT = 4
MOE_TC_WAVES = 2
MOE_TC_MIN_STEPS = 3

SMALL_M = 16  # one launch covers M <= 16 with each weight tile reused for every row
MID_M = 64  # up to here: M-blocks of 16 in the grid; beyond: dequantize once + cuBLAS
# f16/bf16 weights with activations of the same dtype go to cuBLAS from M = 2 (f32 stays on the kernel, whose float32
# products do not depend on torch's TF32 setting)
DENSE_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}
# the m1 kernel (up to 4 activation rows per program) serves each format up to this M; q4_k's covers
# silu_mul_gemv and the GLU, plain gemv takes the tensor cores earlier
M1_MAX_M = {"q4_k": 4, "q5_k": 8, "q6_k": 4, "mlx": 2}
# The tensor-core kernel: gemv takes it from TC_FIRST_M rows up to MID_M, from TC_FIRST_M_LARGE on long or wide
# matrices (K >= TC_LONG_K or N >= TC_WIDE_N); silu_mul_gemv from TC_FIRST_M, past M1_MAX_M for TC_SILU_M1
TC_FIRST_M = {"q4_0": 1, "q8_0": 1, "q6_k": 1, "q4_k": 2, "mlx4": 2, "q5_k": 3, "iq4_nl": 1, "iq4_xs": 1, "mxfp4": 1}
TC_FIRST_M_LARGE = {"mlx4": 1, "q5_k": 2}
TC_LONG_K = 8192
TC_WIDE_N = 32768
TC_SILU_M1 = ("q4_k", "mlx4")
# (BLOCK_N, warps, stages, waves[, load one step ahead, register cap]) without a table entry; the table's
# "tc/<format>/m1" serves M = 1, "tc/<format>/silu" silu_mul_gemv, "tc/<format>" the rest
TC_DEFAULTS = {"q4_0": (64, 4, 1, 4), "q8_0": (128, 8, 1, 2), "q5_k": (64, 4, 1, 4, 0, 128),
               "q6_k": (64, 4, 1, 4, 0, 128)}
# the register cap (a config's sixth field) applies up to this M: with 32 or 64 rows per program it spills
TC_CAP_MAX_M = {"q5_k": 16, "q6_k": 32}
# From TC_XT_MIN_M rows on, plain gemv hands the tensor-core kernel x in its k order (read by TMA): from 32 rows
# on x's traffic outweighs the weights'. Its K split keeps the grid within TC_XT_WAVES programs per SM; q8_0 keeps
# the register path at 64 rows
TC_XT_MIN_M = 17
TC_XT_WAVES = {32: 4, 64: 2}
TC_XT_NOT_64 = ("q8_0",)
# with act_int8: the integer dot-product kernels up to this M per format, where they beat the exact kernels;
# beyond it they read the weights once per two rows and lose
I8_MAX_M = {"q4_0": 1, "q8_0": 1, "q4_k": 1, "q5_k": 1, "q6_k": 1}
I8_FORMATS = ("q4_0", "q8_0", "q4_k")  # gemv_i8_kernel (K a multiple of 256)
# (R, warps, waves, stages[, KT]) of the int8 lane kernels without an "i8lanes/<key>" table entry; q6_k with
# K >= I8_Q6_LONG_K takes "q6_k/long" (a second K split pays on long rows only)
I8_LANES_DEFAULTS = {"q4_k": (1, 4, 2, 1), "q5_k": (1, 4, 1, 1), "q6_k": (1, 4, 2, 1, 4),
                     "q6_k/long": (1, 4, 4, 1, 4)}
I8_Q6_LONG_K = 8192
# q4_k at M = 1 reads activations in lane order; gemv copies x into lane order itself for matrices of at least this
# many weights, where the lane kernel pays back the copy's launch
LANES_MIN_WEIGHTS = 1 << 25
# the engine pads q6_k matrices of at least this many weights whose K is not a multiple of 2048 (ops.tc_padding)
PAD_MIN_WEIGHTS = 1 << 22
# the generic kernel sums its own split-K partials for matrices up to this many weights (a router: the second launch
# is most of its time); larger ones keep the separate sum, which measured faster than the in-kernel sum for the
# tensor-core kernel's q6_k downs at M = 1 (bench/NOTES.md)
GENERIC_FIXUP_MAX_WEIGHTS = 1 << 20
LANES_DEFAULT = (2, 1, 4, 3, 8, 1, 1)  # (R, NB, warps, stages, KT, H, waves) when the table has no "lanes/q4_k"
# fused silu_mul_gemv, q4_k, M = 1, large matrices: twice the rows per thread and lanes over half chunks, three
# programs per SM (table key "m1/q4_k/silu_large")
SILU_LARGE_DEFAULT = (8, 1, 4, 3, 4, 2, 3)
M1_FORMATS = ("q4_k", "q5_k", "q6_k")  # and MLX 4/8-bit (m1.M1_LAYOUTS)


@dataclass(frozen=True)
class Target:
    """Where a product runs: ``gpu`` keys the tuned tables; the interpreter takes fixed tiles (small ones below 128
    rows, large ones above); ``tma``: the tensor-core kernel may read x by TMA."""
    gpu: str
    interpreter: bool = False
    tma: bool = True


@dataclass(frozen=True)
class Operands:
    """What a route needs of the tensors beyond their shapes (ops.operands computes it): weight data 16-byte aligned
    and contiguous; f16/bf16 weights whose rows are K elements of x's dtype; gate_up's up weights 16-byte aligned;
    x (and silu_mul's x2) laid out as the m1 kernel loads them; MLX scales and biases as the tensor-core kernel
    reads them; rows (the data's last dim) a multiple of 16 bytes."""
    aligned: bool = True
    contiguous: bool = True
    dense_rows: bool = True
    up_aligned: bool = True
    m1_x: bool = True
    tc_scales: bool = True
    rows16: bool = True


@dataclass(frozen=True)
class Route:
    """A kernel and its config. ``lane_copy``: gemv copies x into lane order first (kernel ``lanes``); ``xt``: x is
    handed to the tensor-core kernel in k order; ``rule`` names the rule that chose it."""
    kernel: str
    config: tuple = ()
    lane_copy: bool = False
    xt: bool = False
    rule: str = ""


@dataclass(frozen=True)
class Query:
    op: str
    fmt: str
    M: int
    N: int
    K: int
    dtype: torch.dtype
    act_int8: bool
    bits: int
    group_size: int


_OVERRIDES: list = []  # (fn, excluded kernels), innermost last


@contextlib.contextmanager
def override(fn=None, *, exclude=()):
    """Within the block, ``choose`` never picks a kernel in ``exclude`` (it falls through to the next rule), and
    ``fn(query, route) -> Route | None`` may replace its answer (a Query and the Route the table chose). For A/B
    experiments and tuning, e.g. the m1 kernel's configs where the tensor cores would serve:
    ``with route.override(exclude={"tc"}): ...``; or x never read by TMA:
    ``route.override(lambda q, r: dataclasses.replace(r, xt=False, config=...) if r.xt else None)``. ``exclude``
    takes MOE_KERNELS too (``moe_grouped``)."""
    _OVERRIDES.append((fn, frozenset(exclude)))
    try:
        yield
    finally:
        _OVERRIDES.pop()


def _excluded() -> frozenset:
    return frozenset().union(*(ex for _, ex in _OVERRIDES)) if _OVERRIDES else frozenset()


def tc_name(fmt: str, bits: int) -> str:
    return fmt if fmt != "mlx" else f"mlx{bits}"


def tc_first_m(name: str, N: int, K: int, silu: bool = False):
    """The first M at which gemv (or with ``silu``, silu_mul_gemv) of an [N, K] matrix in format ``name`` (GGUF
    name, or "mlx4") takes the tensor-core kernel, or None if it never does."""
    first = TC_FIRST_M.get(name)
    if first is None:
        return None
    if silu:
        return max(first, M1_MAX_M["mlx" if name.startswith("mlx") else name] + 1) if name in TC_SILU_M1 else first
    if K >= TC_LONG_K or N >= TC_WIDE_N:
        first = min(first, TC_FIRST_M_LARGE.get(name, first))
    return first


def tc_reads(fmt: str, bits: int, group_size: int, K: int, dtype) -> bool:
    """Whether the tensor-core kernel reads the format at this K with activations of ``dtype``: q4_k, q5_k, q6_k (K
    a multiple of 2048: 16-byte aligned rows of 210-byte blocks), q4_0 and q8_0 (K a multiple of 256), MLX 4-bit
    (group 32/64/128, K a multiple of 256), iq4_nl and mxfp4 (any K) and iq4_xs (K a multiple of 256), the last
    three on 16-byte aligned rows (Operands.rows16); fp16/bf16 activations."""
    if dtype not in (torch.float16, torch.bfloat16):
        return False
    if fmt in ("iq4_nl", "mxfp4"):
        return True
    if fmt == "iq4_xs":
        return K % 256 == 0
    if fmt in ("q4_k", "q5_k"):
        return True
    if fmt == "q6_k":
        return K % 2048 == 0
    if fmt in ("q4_0", "q8_0"):
        return K % 256 == 0
    return fmt == "mlx" and bits == 4 and group_size in (32, 64, 128) and K % 256 == 0


def m1_reads(fmt: str, bits: int) -> bool:
    """Whether the m1 kernel has a layout for the format."""
    return fmt in M1_FORMATS or (fmt == "mlx" and bits in (4, 8))


def i8_reads(fmt: str, K: int, M: int) -> tuple[bool, bool]:
    """(the generic int8 kernel reads it, the int8 lane kernels read it at this M)."""
    lanes = M == 1 and fmt in ("q4_k", "q5_k", "q6_k") and K % (2048 if fmt == "q6_k" else 256) == 0
    return fmt in I8_FORMATS and K % 256 == 0, lanes


def planes_layout(fmt: str, bits: int, group_size: int):
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


def layout(fmt: str, K: int, group_size: int | None):
    """(NSUB, SUB, BLOCK_BYTES, nblocks, family) of a format: how a row splits into blocks and sub-blocks."""
    if fmt == "mlx":
        return 1, group_size, 0, K // group_size, "mlx"
    f = GGUF_FORMATS[fmt]
    if f.family == "dense":
        return 1, 32, 0, -(-K // 32), "dense"
    if f.family == "legacy":
        return 1, 32, f.block_bytes, K // 32, "legacy"
    nsub, sub = (8, 32) if fmt in ("q4_k", "q5_k", "iq4_xs") else (16, 16)
    return nsub, sub, f.block_bytes, K // 256, "kquant"


def lanes_apply(M: int, dtype, fmt: str, K: int, act_int8: bool = False, aligned: bool = True) -> bool:
    """Whether a product of M activation rows of ``dtype`` runs the lane-order kernel: q4_k (16-byte aligned blocks),
    M = 1, fp16/bf16, K a multiple of 256, unless act_int8 sends it to the int8 kernel."""
    return (fmt == "q4_k" and M == 1 and not (act_int8 and M <= I8_MAX_M.get(fmt, 0))
            and dtype in (torch.float16, torch.bfloat16) and K % 256 == 0 and aligned)


# under the interpreter, matrices with fewer rows take small tiles (their masks tested), larger ones large tiles
INTERPRETER_SMALL_N = 128


# --- configs ----------------------------------------------------------------------------------------------------
def _interpreter_config(N: int, nb_small: int):
    """Small tiles exercise the masks of small test shapes; model-sized matrices (N >= 128) take large tiles,
    because the interpreter's cost is per program and per loop step, not per element."""
    return (16, nb_small, 4, 1) if N < INTERPRETER_SMALL_N else (64, 4 * nb_small, 4, 1)


def generic_config(t: Target, fmt: str, M: int, N: int, K: int, bits: int, group_size: int) -> tuple:
    """(BLOCK_N, NB, num_warps, num_stages) of the generic kernel from the tuned table, keyed on format family and M
    class; f32 weights (twice the bytes of the f16 tiles the table was tuned with) halve the K extent."""
    nsub, sub, _, _, family = layout(fmt, K, group_size)
    sub_k = nsub * sub
    if t.interpreter:
        cfg = _interpreter_config(N, max(1, 64 // sub_k))
    else:
        if family == "mlx" and bits and 32 % bits:
            family = "mlx_odd"  # 3/5/6-bit: two word loads per weight; pipelining them overflows shared memory
        entry = lookup("gemv", t.gpu, f"{family}/{'m1' if M == 1 else 'm16'}")
        cfg = tuple(entry) if entry is not None else (
            (32 if M == 1 else 64), max(1, 256 // sub_k), 4, 1 if family == "mlx_odd" else 3)
    if fmt == "f32":
        cfg = (cfg[0], max(1, cfg[1] // 2)) + tuple(cfg[2:])
    return cfg


def planes_config(t: Target, fmt: str, M: int, N: int, bits: int, nb_default: int) -> tuple:
    """(BLOCK_N, NB, num_warps, num_stages) for the planes kernel from the tuned table."""
    if t.interpreter:
        return _interpreter_config(N, max(1, nb_default // 4))
    entry = lookup("gemv", t.gpu, f"planes/{tc_name(fmt, bits)}/{'m1' if M == 1 else 'm16'}")
    return tuple(entry) if entry is not None else ((32 if M == 1 else 64), nb_default, 4, 3)


def m1_key(name: str, M: int) -> str:
    """The tuned-table key of the m1 kernel's config for format ``name`` ('q4_k', 'mlx4', 'mlx8') at M rows: one per
    M class, since M = 1, 2 and 3-4 (run as 4 rows per program) favour different tiles."""
    return f"m1/{name}" + ("" if M == 1 else "/m2" if M == 2 else "/m4")


def m1_config(t: Target, name: str, M: int, small: bool = False) -> tuple:
    """The m1 kernel's config for format ``name`` at M rows: the tuned table's M-class entry, else its M = 1 entry
    (the interpreter: the smallest tile with ``small``, else a large one, its cost being per program and op). q6_k
    takes at least 2 threads per chunk."""
    if t.interpreter:
        cfg = (1, 1, 1, 1) if small else (8, 1, 16, 1)
    else:
        cfg = tuple(lookup("gemv", t.gpu, m1_key(name, M)) or lookup("gemv", t.gpu, f"m1/{name}") or (4, 1, 4, 3))
    if name == "q6_k" and (len(cfg) < 6 or cfg[5] < 2):
        cfg = cfg[:4] + (cfg[4] if len(cfg) > 4 else 1, 2) + cfg[6:]
    return cfg


def lanes_config(t: Target, N: int, glu: bool) -> tuple:
    """The lane-order kernel's config (GLU needs an even R: two weight rows per output)."""
    if t.interpreter:
        return (2 if glu else 1, 1, 1, 1, 8) if N < INTERPRETER_SMALL_N else (8, 1, 16, 1, 8)
    config = tuple(lookup("gemv", t.gpu, "lanes/q4_k") or LANES_DEFAULT)
    return config if not glu or config[0] % 2 == 0 else LANES_DEFAULT


def i8_lanes_config(t: Target, fmt: str, N: int, K: int) -> tuple:
    """(R, warps, waves, stages[, KT]) of the int8 lane kernels."""
    if t.interpreter:  # q6_k programs take 8 / KT rows per warp and R; 128-row tiles for model-sized matrices
        small = N < (64 if fmt == "q6_k" else INTERPRETER_SMALL_N)
        if fmt == "q6_k":
            return (1, 1, 1, 1, 2) if small else (4, 16, 1, 1, 4)
        return (1, 1, 1, 1) if small else (8, 16, 1, 1)
    key = "q6_k/long" if fmt == "q6_k" and K >= I8_Q6_LONG_K else fmt
    return tuple(lookup("gemv", t.gpu, f"i8lanes/{key}") or I8_LANES_DEFAULTS[key])


def i8_config(t: Target, fmt: str, N: int, K: int) -> tuple:
    """(R, GP, warps, stages) of the generic int8 kernel, per size class (the best config of one class loses up to
    1.4x on another)."""
    if t.interpreter:
        return (2, 4, 1, 1) if N < INTERPRETER_SMALL_N else (2, 4, 16, 1)
    size = "wide" if N >= 32768 else ("large" if N * K > 32 * 2**20 else "small")
    return tuple(lookup("gemv", t.gpu, f"i8/{fmt}/{size}") or (1, 4, 4, 3))


def tc_config(t: Target, name: str, M: int, silu: bool, xt_rows: int = 0, N: int = 0) -> tuple:
    """(BLOCK_N, warps, stages, waves[, ahead, register cap]) of the tensor-core kernel; ``xt_rows`` (32 or 64):
    x read by TMA, whose table entry or K split takes over. The interpreter takes 128-row tiles for N >= 128 (N = 0:
    unknown, 16)."""
    if t.interpreter:
        return (16, 4, 1, 2) if N < INTERPRETER_SMALL_N else (128, 4, 1, 2)
    config = tuple((M == 1 and lookup("gemv", t.gpu, f"tc/{name}/m1"))
                   or (silu and lookup("gemv", t.gpu, f"tc/{name}/silu"))
                   or lookup("gemv", t.gpu, f"tc/{name}") or TC_DEFAULTS.get(name, (64, 4, 1, 4)))
    if len(config) > 5 and M > TC_CAP_MAX_M.get(name, MID_M):
        config = config[:5]  # no register cap
    if xt_rows:
        config = tuple(lookup("gemv", t.gpu, f"tc/{name}/xt{xt_rows}")
                       or config[:3] + (TC_XT_WAVES[xt_rows],) + config[4:])
    return config


def tc_rows(M: int) -> int:
    """The rows one tensor-core program holds: 16, 32 or 64."""
    return 16 if M <= 16 else (32 if M <= 32 else 64)


# --- mixture of experts -----------------------------------------------------------------------------------------
def moe_grouped(pairs: int, num_experts: int) -> bool:
    """Whether an MoE product of ``pairs`` (token, expert) pairs runs grouped by expert (qgemv.moe's tensor-core
    kernel, each chosen expert's weights read once per block of its pairs) instead of a GEMV per pair: once some
    expert has two pairs, the per-pair GEMV reads its weights twice. A byte count, not a measured crossover."""
    excluded = _excluded()
    if "moe_grouped" in excluded or "moe_gemv" in excluded:
        return "moe_grouped" not in excluded
    return pairs > num_experts


def moe_tc(pairs: int, num_experts: int, per_pair_m1: bool = True) -> bool:
    """Whether MoE products of ``pairs`` pairs run on the tensor-core kernel, pairs grouped by expert (where it
    reads the format): each chosen expert's weights read once per block of up to 32 of its pairs, where a GEMV per
    pair reads them once per pair. Taken once pairs would share experts MOE_TC_MIN_REUSE times on average if drawn
    at random, and at any count where the per-pair GEMV would not be the m1 kernel (``per_pair_m1`` false: the
    generic kernel, which moved 0.26 TB/s over gpt-oss's mxfp4 experts, bench/NOTES.md)."""
    excluded = _excluded()
    if "moe_tc" in excluded or pairs < 1:
        return False
    if {"moe_gemv", "moe_grouped"} <= excluded or not per_pair_m1:
        return True
    if pairs < 2:
        return False
    distinct = num_experts * (1.0 - (1.0 - 1.0 / num_experts) ** pairs)
    return pairs >= MOE_TC_MIN_REUSE * distinct


def moe_tc_config(t: Target, name: str, block_m: int, silu: bool, N: int = 0) -> tuple:
    """The tensor-core kernel's config for MoE products of N rows per expert: the table's ``moe_tc/<format>[/silu]``
    entry, else for the down product (``silu``: silu(gate) * up formed as it loads) of the K-quants MOE_TC_DOWN, else
    tc_config's."""
    key = f"moe_tc/{name}" + ("/silu" if silu else "")
    entry = None if t.interpreter else lookup("gemv", t.gpu, key)
    if entry is not None:
        return tuple(entry)
    if silu and not t.interpreter and name in MOE_TC_DOWN:
        return MOE_TC_DOWN[name]
    return tc_config(t, name, block_m, silu, N=N)


def moe_tc_split(programs: int, steps: int, sms: int, interpreter: bool = False) -> int:
    """K splits of the tensor-core MoE products whose grid has about ``programs`` busy programs (output tiles x
    experts with pairs) for ``steps`` 256-weight steps per row: up to MOE_TC_MAX_SPLIT, until the busy programs
    reach MOE_TC_WAVES per SM (a one-token product reads only top_k experts: gpt-oss's down, 45 tiles x 4 experts,
    leaves most of 132 SMs a single program), each split keeping MOE_TC_MIN_STEPS steps. 1 under the interpreter."""
    if interpreter or programs <= 0 or programs >= MOE_TC_WAVES * sms:
        return 1
    return max(1, min(MOE_TC_MAX_SPLIT, -(-MOE_TC_WAVES * sms // programs), steps // MOE_TC_MIN_STEPS))


def moe_tc_rows(pairs: int, num_experts: int) -> int:
    """Slots per block of one expert's pairs in the tensor-core MoE kernel (its M_PAD): 16 or 32, by the mean pairs
    per expert (padding wastes less). Not 64: the configs were measured up to 32 rows (bench/NOTES.md)."""
    return min(32, tc_rows(-(-pairs // max(1, min(pairs, num_experts)))))


def moe_m1(fmt: str, dual: bool, dtype: torch.dtype) -> bool:
    """Whether the per-pair MoE GEMV runs the m1 kernel over the stacked experts (q4_k, q5_k, q6_k with fp16/bf16
    activations; gate and up fused only for q4_k, as its GLU) rather than the generic kernel, whose dequantized tiles
    moved about 0.7 TB/s at Qwen3-30B-A3B's expert shapes (bench/NOTES.md)."""
    if "moe_m1" in _excluded():
        return False
    return fmt in M1_FORMATS and (not dual or fmt == "q4_k") and dtype in (torch.float16, torch.bfloat16)


def moe_m1_config(t: Target, fmt: str, N: int, K: int, glu: bool) -> tuple:
    """The m1 kernel's config for MoE pairs: the table's ``moe_m1/<format>`` entry (``python -m llmkernels tune
    moe``), else the dense M = 1 entry; GLU takes an even R, and the lanes along K are no more than an expert's
    blocks (K = 768 is 3 super-blocks)."""
    entry = None if t.interpreter else lookup("gemv", t.gpu, f"moe_m1/{fmt}")
    small = t.interpreter and N < INTERPRETER_SMALL_N
    config = tuple(entry) if entry is not None else m1_config(t, fmt, 1, small=small)
    if glu and config[0] % 2:  # a gate and an up row per thread
        config = (config[0] + 1,) + config[1:]
    if len(config) > 4:
        kt, nblocks = config[4], layout(fmt, K, 0)[3]
        while kt > 1 and nblocks < kt:
            kt //= 2
        config = config[:4] + (kt,) + config[5:]
    return config


def moe_config(t: Target, fmt: str, N: int, K: int, bits: int, group_size: int) -> tuple:
    """(BLOCK_N, NB, num_warps, num_stages) of the per-pair MoE GEMV: the table's ``moe/<family>`` entry (``python -m
    llmkernels tune moe``), else the generic kernel's M = 1 config, each pair being a GEMV of one row."""
    family = layout(fmt, K, group_size)[4]
    entry = None if t.interpreter else lookup("gemv", t.gpu, f"moe/{family}")
    cfg = tuple(entry) if entry is not None else generic_config(t, fmt, 1, N, K, bits, group_size)
    if family == "kquant" and cfg[0] < 16:
        # 8-row tiles gave wrong q4_k gate/up products on the H200 (tune moe's check caught them in the table)
        cfg = (16,) + cfg[1:]
    return cfg


def moe_grouped_config(t: Target, block_weights: int, pairs: int, num_experts: int) -> tuple:
    """(BLOCK_M, BLOCK_N, NB, warps) of the grouped MoE kernel. ``block_weights``: weights per format block; NB of
    them make a K step of at least 128. BLOCK_M follows the mean pairs per expert (padding wastes less); BLOCK_N
    keeps a dequantized tile at 8192 weights. Untuned."""
    nb = max(1, 128 // block_weights)
    bk = nb * block_weights
    if t.interpreter:
        return 16, 16, nb, 4
    mean = pairs / num_experts
    return (16 if mean <= 16 else 32 if mean <= 32 else 64), max(16, 8192 // bk), nb, 4


# --- the table --------------------------------------------------------------------------------------------------
def choose(op: str, fmt: str, M: int, N: int, K: int, dtype: torch.dtype, act_int8: bool = False, *, bits: int = 0,
           group_size: int = 0, operands: Operands = Operands(), target: Target = Target("default")) -> Route:
    """The route of one product (see the module docstring for the rules, in order)."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if fmt not in GGUF_FORMATS and fmt != "mlx":
        raise ValueError(f"fmt must be a GGUF format or 'mlx', got {fmt!r}")
    if min(M, N, K) < 1:
        raise ValueError(f"M, N and K must be positive, got M={M}, N={N}, K={K}")
    q = Query(op, fmt, M, N, K, dtype, act_int8, bits or 0, group_size or 0)
    excluded = _excluded()
    route = _choose(q, operands, target, excluded)
    for fn, _ in _OVERRIDES:
        if fn is not None:
            route = fn(q, route) or route
    return route


def _choose(q: Query, o: Operands, t: Target, excluded: frozenset) -> Route:
    op, fmt, M, N, K, dtype, bits, gs = q.op, q.fmt, q.M, q.N, q.K, q.dtype, q.bits, q.group_size
    ok = lambda k: k not in excluded  # noqa: E731
    if op == "lanes" and (not ok("lanes") or not lanes_apply(M, dtype, fmt, K, q.act_int8, o.aligned)):
        op = "gemv"  # gemv_lanes where the lane kernel does not apply: plain gemv, x_lanes ignored
    if (ok("cublas") and op == "gemv" and M >= 2 and DENSE_DTYPES.get(fmt) == dtype and o.dense_rows):
        return Route("cublas", rule="f16/bf16 weights in x's dtype, M >= 2")
    if M > MID_M and ok("dequant"):
        return Route("dequant", rule=f"M > {MID_M}")
    if ok("lanes"):
        if op == "lanes":
            return Route("lanes", lanes_config(t, N, False), rule="q4_k, M = 1, x given in lane order")
        if (op == "gemv" and N * K >= LANES_MIN_WEIGHTS
                and lanes_apply(M, dtype, fmt, K, q.act_int8, o.aligned)):
            return Route("lanes", lanes_config(t, N, False), lane_copy=True,
                         rule=f"q4_k, M = 1, N * K >= {LANES_MIN_WEIGHTS}")
    if op == "gate_up" and fmt == "q4_k" and dtype != torch.float32 and M <= M1_MAX_M["q4_k"] and o.up_aligned \
            and o.aligned and o.m1_x:
        if (ok("lanes") and N * K >= LANES_MIN_WEIGHTS and lanes_apply(M, dtype, fmt, K, False, o.aligned)):
            return Route("lanes", lanes_config(t, N, True), lane_copy=True,
                         rule="gate_up, q4_k, M = 1, large: both projections in lane order")
        config = (2, 1, 1, 1) if t.interpreter and N < INTERPRETER_SMALL_N else m1_config(t, "q4_k", M)
        if ok("glu") and config[0] % 2 == 0:
            return Route("glu", config, rule=f"gate_up, q4_k, M <= {M1_MAX_M['q4_k']}: m1 GLU")
    if q.act_int8 and op != "gate_up" and M <= I8_MAX_M.get(fmt, 0) and dtype != torch.float32:
        generic_i8, lanes_i8 = i8_reads(fmt, K, M)
        if lanes_i8 and o.aligned and o.contiguous and ok("i8_lanes"):
            return Route("i8_lanes", i8_lanes_config(t, fmt, N, K), rule="act_int8, M = 1: int8 lane kernel")
        if generic_i8 and o.aligned and o.contiguous and ok("i8"):
            return Route("i8", i8_config(t, fmt, N, K), rule=f"act_int8, M <= {I8_MAX_M[fmt]}: int8 kernel")
    name = tc_name(fmt, bits)
    first = tc_first_m(name, N, K, op == "silu_mul") if op in ("gemv", "silu_mul") else None
    if (ok("tc") and first is not None and first <= M <= MID_M and tc_reads(fmt, bits, gs, K, dtype) and o.aligned
            and (fmt != "mlx" or o.tc_scales) and (fmt not in ("iq4_nl", "iq4_xs", "mxfp4") or o.rows16)):
        name = fmt if fmt != "mlx" else "mlx4"
        rows = tc_rows(M)
        xt = (op == "gemv" and M >= TC_XT_MIN_M and K % 256 == 0 and not (rows == 64 and name in TC_XT_NOT_64)
              and t.tma)
        return Route("tc", tc_config(t, name, M, op == "silu_mul", rows if xt and not t.interpreter else 0, N), xt=xt,
                     rule=f"tensor cores from M = {first}")
    if (ok("m1") and m1_reads(fmt, bits) and M <= M1_MAX_M[fmt] and op in ("gemv", "silu_mul") and o.aligned
            and o.m1_x):
        small = t.interpreter and N < INTERPRETER_SMALL_N
        if op == "silu_mul" and fmt == "q4_k" and M == 1 and N * K >= LANES_MIN_WEIGHTS and not t.interpreter:
            config = tuple(lookup("gemv", t.gpu, "m1/q4_k/silu_large") or SILU_LARGE_DEFAULT)
        else:
            config = m1_config(t, tc_name(fmt, bits), M, small=small)
        return Route("m1", config, rule=f"M <= {M1_MAX_M[fmt]}: scales factored out (m1)")
    planes = planes_layout(fmt, bits, gs)
    if ok("planes") and planes is not None and op != "gate_up":
        return Route("planes", planes_config(t, fmt, M, N, bits, planes[5]), rule="bit planes")
    return Route("generic", generic_config(t, fmt, M, N, K, bits, gs), rule="every format")
