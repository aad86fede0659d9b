"""Mixture-of-experts GEMV for decode: every (token, chosen expert) pair in one launch, reading only the chosen
experts' weight rows.

GGUF stores an MoE layer's experts stacked, ``ffn_{gate,up,down}_exps`` [n_expert, N, K]; as a QuantizedTensor that
is [n_expert * N, K], expert e's matrix being rows e * N .. (e + 1) * N. A router picks ``top_k`` experts per token
(``moe_route``); the pairs (token, expert) are then rows of one grid: each program dequantizes a tile of its pair's
expert rows in registers (the generic kernel's ``dequant_tile``, so every GGUF format and MLX affine work) and
multiplies it with its token's activations. Experts that no token chose are never read. Gate and up can run fused
(``silu(x W_gate^T) * (x W_up^T)`` in one pass over both), so an MoE FFN is two launches plus the weighted sum.
q4_k, q5_k and q6_k pairs in the router's order (no token_ids) run the m1 kernel instead (qgemv/m1.py, its third grid
axis over the pairs, each reading its expert's rows; q4_k's gate and up fused as its GLU), with the block scales
factored out of the inner loop.

Batched decode and prefill have pairs that share experts, and a GEMV per pair would read a shared expert's weights
once per pair. There the pairs are grouped by expert instead (``group_pairs``: padded to whole blocks of pairs of one
expert, in one launch on the device, without a host sync) and each program multiplies one block's gathered
activation rows with a tile of its expert on the tensor cores, so each expert's weights are read once per block:
- ``route.moe_tc``: the tensor-core GEMV kernel (qgemv/tc.py, its MoE mode) for the formats it reads (q4_k, q5_k,
  q4_0, q8_0, MLX 4-bit; q6_k, iq4_nl, iq4_xs and mxfp4 with 16-byte aligned rows), taken once pairs would share
  experts 1.25 times on average, and from one pair for the formats without an m1 kernel (gpt-oss's mxfp4). Grids
  with few busy programs (one token's pairs) split K (``route.moe_tc_split``). In moe_ffn, and in moe_pairs with
  ``up``, gate and up run in one grid (the gate stack in the first half, up in the second) into one [pairs, 2F]
  buffer; moe_ffn's down product forms silu(gate) * up as it loads its activations;
- ``route.moe_grouped``: the other formats, tiles dequantized by ``dequant_tile`` (once pairs outnumber experts).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._checks import check_device, check_positive_int, check_tensor, interpreter_mode
from .._runtime import empty, num_sms
from ..quant.tensor import QuantizedTensor
from .common import _finish, _views
from .dequant import dequant_tile
from .m1 import launch_m1, m1_supports
from .tc import TAIL_FORMATS, launch_tc_moe, tc_supports
from . import route
from .ops import FORMAT_IDS, X_DTYPES, target


@triton.jit
def moe_gemv_kernel(X, EXPERT, TOKEN, W8, W16, WI8, WS, WB, V8, V16, VI8, VS, VB, Y,
                    N, K, E, stride_xm, stride_ym, row_bytes, scale_stride, nblocks,
                    FMT: tl.constexpr, NB: tl.constexpr, NSUB: tl.constexpr, SUB: tl.constexpr,
                    BLOCK_BYTES: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr, DUAL: tl.constexpr,
                    TOP_K: tl.constexpr, HAS_TOKEN: tl.constexpr):
    """Program (n tile, pair): Y[pair, rows] = X[t] . W[EXPERT[pair] * N + rows] (silu(. W) * (. V) with DUAL), t =
    TOKEN[pair], or pair // TOP_K without TOKEN (the router's pairs: each token's TOP_K in a row)."""
    BLOCK_K: tl.constexpr = NB * NSUB * SUB
    pid_n = tl.program_id(0)
    pair = tl.program_id(1).to(tl.int64)
    # ids were checked on the host; under CUDA-graph capture they cannot be, so stay inside the stack regardless
    e = tl.minimum(tl.maximum(tl.load(EXPERT + pair).to(tl.int64), 0), E - 1)
    if HAS_TOKEN:
        t = tl.load(TOKEN + pair).to(tl.int64)
    else:
        t = pair // TOP_K
    local = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = local < N
    rows = e * N + local.to(tl.int64)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for kb in range(0, nblocks, NB):
        blk = kb + tl.arange(0, NB)
        blk_ok = blk < nblocks
        kk = kb * (NSUB * SUB) + tl.arange(0, BLOCK_K)
        x = tl.load(X + t * stride_xm + kk, mask=kk < K, other=0.0).to(tl.float32)
        w = dequant_tile(W8, W16, WI8, WS, WB, row_bytes, rows, blk, row_ok, blk_ok, scale_stride, K,
                         FMT, NB, NSUB, SUB, BLOCK_BYTES, BITS).reshape(BLOCK_N, BLOCK_K)
        acc += w * x[None, :]
        if DUAL:
            w2 = dequant_tile(V8, V16, VI8, VS, VB, row_bytes, rows, blk, row_ok, blk_ok, scale_stride, K,
                              FMT, NB, NSUB, SUB, BLOCK_BYTES, BITS).reshape(BLOCK_N, BLOCK_K)
            acc2 += w2 * x[None, :]
    out = tl.sum(acc, axis=1)
    if DUAL:
        out = out / (1.0 + tl.exp(-out)) * tl.sum(acc2, axis=1)
    tl.store(Y + pair * stride_ym + local, out.to(Y.dtype.element_ty), mask=row_ok)


@triton.jit
def _dot_wt(x, w, acc, DOT_F32: tl.constexpr):
    """acc + x @ w^T; DOT_F32: fp32 operands at IEEE precision (fp32 activations, and the interpreter, whose bf16
    dot is wrong), else in x's dtype on the tensor cores."""
    if DOT_F32:
        return tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w.to(x.dtype)), acc)


@triton.jit
def moe_grouped_kernel(X, PAIRS, BLOCK_EXPERT, TOKEN, W8, W16, WI8, WS, WB, V8, V16, VI8, VS, VB, Y,
                       N, K, E, stride_xm, stride_ym, row_bytes, scale_stride, nblocks,
                       FMT: tl.constexpr, NB: tl.constexpr, NSUB: tl.constexpr, SUB: tl.constexpr,
                       BLOCK_BYTES: tl.constexpr, BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       DUAL: tl.constexpr, DOT_F32: tl.constexpr, TOP_K: tl.constexpr, HAS_TOKEN: tl.constexpr):
    """Program (n tile, block b): for the pairs p of block b, all of expert BLOCK_EXPERT[b] (-1: an unused block),
    Y[p, rows] = X[t] . W[e * N + rows] (silu(. W) * (. V) with DUAL), t = TOKEN[p] or p // TOP_K."""
    BLOCK_K: tl.constexpr = NB * NSUB * SUB
    pid_n = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    e_raw = tl.load(BLOCK_EXPERT + b).to(tl.int64)
    e = tl.minimum(tl.maximum(e_raw, 0), E - 1)
    pairs = tl.load(PAIRS + b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pair_ok = pairs >= 0
    if HAS_TOKEN:
        t = tl.load(TOKEN + pairs, mask=pair_ok, other=0).to(tl.int64)
    else:
        t = tl.where(pair_ok, pairs, 0) // TOP_K
    local = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = local < N
    rows = e * N + local.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    steps = tl.where(e_raw >= 0, nblocks, 0)  # an unused block reads nothing
    for kb in range(0, steps, NB):
        blk = kb + tl.arange(0, NB)
        blk_ok = blk < nblocks
        kk = kb * (NSUB * SUB) + tl.arange(0, BLOCK_K)
        x = tl.load(X + t[:, None] * stride_xm + kk[None, :], mask=pair_ok[:, None] & (kk[None, :] < K), other=0.0)
        w = dequant_tile(W8, W16, WI8, WS, WB, row_bytes, rows, blk, row_ok, blk_ok, scale_stride, K,
                         FMT, NB, NSUB, SUB, BLOCK_BYTES, BITS).reshape(BLOCK_N, BLOCK_K)
        acc = _dot_wt(x, w, acc, DOT_F32)
        if DUAL:
            w2 = dequant_tile(V8, V16, VI8, VS, VB, row_bytes, rows, blk, row_ok, blk_ok, scale_stride, K,
                              FMT, NB, NSUB, SUB, BLOCK_BYTES, BITS).reshape(BLOCK_N, BLOCK_K)
            acc2 = _dot_wt(x, w2, acc2, DOT_F32)
    if DUAL:
        acc = acc / (1.0 + tl.exp(-acc)) * acc2
    tl.store(Y + pairs[:, None] * stride_ym + local[None, :], acc.to(Y.dtype.element_ty),
             mask=pair_ok[:, None] & row_ok[None, :])


@triton.jit
def moe_align_kernel(EXPERT, PAIRS, BLOCK_EXPERT, CURSOR, P, E, n_blocks, BLOCK_M: tl.constexpr,
                     BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, CHUNK_P: tl.constexpr):
    """One program: the pairs' experts counted, each expert's slots padded to whole blocks of BLOCK_M, blocks given
    their owners (-1 past the last expert's) and slots filled with -1, then each pair written to a free slot of its
    expert (an atomic cursor per expert: the order within an expert varies, and no product depends on it)."""
    ex = tl.arange(0, BLOCK_E)
    ch = tl.arange(0, CHUNK)
    cp = tl.arange(0, CHUNK_P)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for p0 in range(0, P, CHUNK_P):
        p = p0 + cp
        # ids from the router are in range; clamped anyway, so that every pair gets a slot
        e = tl.minimum(tl.maximum(tl.load(EXPERT + p, mask=p < P, other=0), 0), E - 1)
        counts += tl.histogram(e, BLOCK_E, mask=p < P)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(CURSOR + ex, ends - padded)  # each expert's first slot
    for s0 in range(0, n_blocks * BLOCK_M, CHUNK_P):
        s = s0 + cp
        tl.store(PAIRS + s, -1, mask=s < n_blocks * BLOCK_M)
    for b0 in range(0, n_blocks, CHUNK):
        b = b0 + ch
        # a block belongs to the first expert whose padded slots end past its first slot
        owner = tl.sum((ends[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(BLOCK_EXPERT + b, tl.where(owner < E, owner, -1), mask=b < n_blocks)
    tl.debug_barrier()  # cursors and the -1 fill before any pair lands (other threads own those slots)
    for p0 in range(0, P, CHUNK_P):
        p = p0 + cp
        e = tl.minimum(tl.maximum(tl.load(EXPERT + p, mask=p < P, other=0), 0), E - 1)
        slot = tl.atomic_add(CURSOR + e, 1, mask=p < P, sem="relaxed")
        tl.store(PAIRS + slot, p, mask=p < P)


def group_pairs(expert_ids: torch.Tensor, num_experts: int, block_m: int):
    """The pairs grouped by expert and padded to whole blocks of ``block_m`` pairs of one expert (in any order
    within an expert), in one launch on the device and without a host sync, so inside CUDA graphs too (the block
    count is its upper bound). Returns (pairs int32 [blocks * block_m], -1 in the padding; block_expert int32
    [blocks], -1 for blocks past the last expert's)."""
    dev = expert_ids.device
    P = expert_ids.shape[0]
    blocks = -(-P // block_m) + min(num_experts, P)
    pairs = empty(blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = empty(blocks, dtype=torch.int32, device=dev)
    if P:
        block_e = max(16, triton.next_power_of_2(num_experts))
        cursor = empty(block_e, dtype=torch.int32, device=dev)
        moe_align_kernel[(1,)](expert_ids.contiguous(), pairs, block_expert, cursor, P, num_experts, blocks,
                               BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=max(16, min(1024, 16384 // block_e)),
                               CHUNK_P=1024, num_warps=8)
    return pairs, block_expert


@triton.jit
def moe_route_kernel(LOGITS, W, IDS, E, stride_l, BLOCK_E: tl.constexpr, TOP_K: tl.constexpr,
                     BLOCK_K: tl.constexpr, RENORM: tl.constexpr, BIAS=None):
    """Program t: softmax over token t's E router logits (plus BIAS [E], each sum rounded to the logits' dtype),
    its TOP_K largest (first index among ties) with their probabilities, renormalized
    to sum to 1 with RENORM."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    z = tl.load(LOGITS + t * stride_l + offs, mask=ok, other=float("-inf"))
    if BIAS is not None:
        z = (z.to(tl.float32) + tl.load(BIAS + offs, mask=ok, other=0.0).to(tl.float32)).to(LOGITS.dtype.element_ty)
    z = z.to(tl.float32)
    w, ids = route_top_k(z, ok, TOP_K, BLOCK_K, RENORM)
    ks = tl.arange(0, BLOCK_K)
    tl.store(W + t * TOP_K + ks, w, mask=ks < TOP_K)
    tl.store(IDS + t * TOP_K + ks, ids, mask=ks < TOP_K)


@triton.jit
def route_top_k(z, ok, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, RENORM: tl.constexpr):
    """One token's routing from its router logits z [BLOCK_E] (ok: the real experts): softmax, the TOP_K largest
    (first index among ties) -> (weights float32 [BLOCK_K], experts int32 [BLOCK_K]), renormalized with RENORM.
    Shared with the one-kernel decode step (megakernel/kernel.py)."""
    BLOCK_E: tl.constexpr = z.shape[0]
    offs = tl.arange(0, BLOCK_E)
    p = tl.exp(z - tl.max(z, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(ok, p, -2.0)  # padding ranks below a taken expert (-1), which ranks below every probability
    ks = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        m = tl.max(p, axis=0)
        i = tl.min(tl.where(p == m, offs, BLOCK_E), axis=0)
        w = tl.where(ks == j, m, w)
        ids = tl.where(ks == j, i, ids)
        p = tl.where(offs == i, -1.0, p)
    if RENORM:
        w = w / tl.sum(w, axis=0)
    return w, ids


@triton.jit
def moe_combine_kernel(Y, WEIGHTS, OUT, H, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (token t, h tile): OUT[t] = sum_j WEIGHTS[t, j] * Y[t * TOP_K + j], in float32."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = h < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        wj = tl.load(WEIGHTS + t * TOP_K + j)
        acc += wj * tl.load(Y + (t * TOP_K + j) * H + h, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + t * H + h, acc.to(OUT.dtype.element_ty), mask=ok)


def _route_torch(router_logits: torch.Tensor, top_k: int, renormalize: bool, bias=None):
    if bias is not None:
        router_logits = (router_logits.float() + bias.float()).to(router_logits.dtype)
    p = torch.softmax(router_logits.float(), dim=-1)
    w, ids = torch.topk(p, top_k, dim=-1, sorted=True)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids.to(torch.int32)


def _route_fused(router_logits: torch.Tensor, top_k: int, renormalize: bool, bias=None):
    """moe_route in one launch (moe_route_kernel)."""
    T, E = router_logits.shape
    w = empty(T, top_k, dtype=torch.float32, device=router_logits.device)
    ids = empty(T, top_k, dtype=torch.int32, device=router_logits.device)
    if T:
        logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
        moe_route_kernel[(T,)](logits, w, ids, E, logits.stride(0), BLOCK_E=triton.next_power_of_2(E),
                               TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), RENORM=renormalize,
                               BIAS=bias, num_warps=1 if E <= 256 else 4)
    return w, ids


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool = True, bias: torch.Tensor | None = None):
    """The experts of each token and their weights: softmax over all experts, the ``top_k`` largest, renormalized
    to sum to 1 when ``renormalize`` (Mixtral, whose softmax over the top-k logits is the same thing, and Qwen3-MoE
    with ``norm_topk_prob``). router_logits: [T, n_expert]; ``bias`` (gpt-oss's router bias): float [n_expert],
    added to every row first, each sum taken in float32 and rounded to the logits' dtype. Returns (weights float32 [T, top_k], experts int32
    [T, top_k]), largest weight first (tied experts: the lowest index first on a GPU, torch.topk's order on the
    CPU). On a GPU it is one launch."""
    check_tensor("router_logits", router_logits, ndim=2)
    if not router_logits.is_floating_point():
        raise TypeError(f"router_logits must be a float tensor, got {router_logits.dtype}")
    check_positive_int("top_k", top_k)
    if top_k > router_logits.shape[1]:
        raise ValueError(f"top_k ({top_k}) must be at most the number of experts ({router_logits.shape[1]})")
    if bias is not None:
        check_tensor("bias", bias, dtypes=(torch.float16, torch.bfloat16, torch.float32),
                     shape=(router_logits.shape[1],))
        check_device(router_logits=router_logits, bias=bias)
        bias = bias.contiguous()
    if router_logits.is_cuda:  # one launch in place of softmax, top-k, renormalization and casts
        return _route_fused(router_logits, top_k, renormalize, bias)
    return _route_torch(router_logits, top_k, renormalize, bias)


def _check_stack(name: str, qt, num_experts: int) -> int:
    """N, the rows of one expert, of experts stacked as [num_experts * N, K] or [num_experts, N, K]."""
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"{name} must be a QuantizedTensor (llmkernels.quantize), got {type(qt).__name__}")
    if len(qt.shape) == 3 and qt.shape[0] == num_experts and qt.data.is_contiguous():
        return qt.shape[1]
    if len(qt.shape) != 2 or qt.shape[0] % num_experts:
        raise ValueError(f"{name} must be the experts stacked as [num_experts * N, K] or [num_experts, N, K] with "
                         f"num_experts = {num_experts}, got logical shape {tuple(qt.shape)}")
    return qt.shape[0] // num_experts


def _check_ids(expert_ids, token_ids, num_experts: int, num_tokens: int):
    check_tensor("expert_ids", expert_ids, dtypes=(torch.int32, torch.int64), ndim=1)
    if token_ids is None:
        if expert_ids.shape[0] != num_tokens:
            raise ValueError(f"without token_ids, x must have one row per pair: expert_ids has {expert_ids.shape[0]} "
                             f"pairs, x has {num_tokens} rows")
    if token_ids is not None:
        check_tensor("token_ids", token_ids, dtypes=(torch.int32, torch.int64), shape=(expert_ids.shape[0],))
    capturing = expert_ids.is_cuda and torch.cuda.is_current_stream_capturing()
    if not capturing and expert_ids.numel():  # one host copy each; skipped under graph capture
        lo, hi = int(expert_ids.min()), int(expert_ids.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"expert_ids must lie in [0, {num_experts}), got values in [{lo}, {hi}]")
        if token_ids is not None:
            lo, hi = int(token_ids.min()), int(token_ids.max())
            if lo < 0 or hi >= num_tokens:
                raise ValueError(f"token_ids must lie in [0, {num_tokens}) (rows of x), got values in [{lo}, {hi}]")
    return expert_ids.contiguous(), token_ids.contiguous() if token_ids is not None else None


def _stack_views(qt) -> tuple:
    """(W8, W16, WI8, WS, WB) kernel arguments of a stack: its bytes viewed three ways, its scales and biases (the
    16-bit view stands in for those a format lacks)."""
    w8, w16, wi8 = _views(qt.data)
    return (w8, w16, wi8, qt.scales if qt.scales is not None else w16, qt.biases if qt.biases is not None else w16)


def _tc_reads(x, qt) -> bool:
    """Whether the tensor-core kernel reads this stack with x's dtype (tc.tc_supports; K whole 256-weight steps but for
    the formats it masks the last step of)."""
    return (qt.shape[-1] % 256 == 0 or qt.format in TAIL_FORMATS) and tc_supports(x, qt.data, qt.format, qt.bits or 0, qt.group_size or 0,
                                                   qt.shape[-1], qt.scales, qt.biases)


def _tc_products(x, qt, qt_up, N, num_experts, groups, P, token_ids, top_k, x2=None):
    """[P, N] (with qt_up: [P, 2N], the up products in the second half) on the tensor cores, pairs grouped by expert
    (``groups``: (pairs, block_expert, block_m) from group_pairs)."""
    pairs, block_expert, block_m = groups
    K = qt.shape[-1]
    t = target(x.device)
    config = route.moe_tc_config(t, route.tc_name(qt.format, qt.bits or 0), block_m, x2 is not None, N)
    unpack = 1 if interpreter_mode() else 2
    mlx = qt.format == "mlx"
    kw = dict(fmt=qt.format, token_ids=token_ids, x2=x2, group_size=qt.group_size or 0)
    if qt_up is None or not mlx:  # one launch for both stacks (GGUF: the blocks carry their scales)
        tiles = triton.cdiv(N, config[0]) * (2 if qt_up is not None else 1)
        split = route.moe_tc_split(tiles * min(P, num_experts), -(-K // 256), num_sms(x.device), t.interpreter)
        y = launch_tc_moe(x, qt.data, N, K, config, P, pairs, block_expert, block_m, top_k, num_experts, unpack,
                          up=qt_up.data if qt_up is not None else None, scales=qt.scales, biases=qt.biases,
                          split=split, **kw)
        return _finish(y, x.dtype) if y.dim() == 3 else y  # partials where K split (at most its steps)
    y = empty(P, 2 * N, dtype=x.dtype, device=x.device)
    for half, q in ((y[:, :N], qt), (y[:, N:], qt_up)):
        launch_tc_moe(x, q.data, N, K, config, P, pairs, block_expert, block_m, top_k, num_experts, unpack, y=half,
                      scales=q.scales, biases=q.biases, **kw)
    return y


def _groups(expert_ids, num_experts: int):
    block_m = route.moe_tc_rows(expert_ids.shape[0], num_experts)
    return group_pairs(expert_ids, num_experts, block_m) + (block_m,)


def _silu_mul(gu, N: int):
    return (torch.nn.functional.silu(gu[:, :N].float()) * gu[:, N:].float()).to(gu.dtype)


def _launch(x, qt, qt_up, N, num_experts, expert_ids, token_ids, top_k=1, groups=None):
    """The pairs' products; ``token_ids`` None: pair p reads row p // top_k of x. ``groups``: _groups of the ids,
    if made already."""
    P = expert_ids.shape[0]
    per_pair_m1 = route.moe_m1(qt.format, qt_up is not None, x.dtype)
    if (P and route.moe_tc(P, num_experts, per_pair_m1) and _tc_reads(x, qt)
            and (qt_up is None or _tc_reads(x, qt_up))):
        y = _tc_products(x, qt, qt_up, N, num_experts, groups or _groups(expert_ids, num_experts), P, token_ids,
                         top_k)
        return y if qt_up is None else _silu_mul(y, N)
    if P and route.moe_grouped(P, num_experts):
        return _launch_grouped(x, qt, qt_up, N, num_experts, expert_ids, token_ids,
                               empty(P, N, dtype=x.dtype, device=x.device), top_k)
    if P and token_ids is None and per_pair_m1 and m1_supports(
            x, qt.data, qt.format) and (qt_up is None or qt_up.data.data_ptr() % 16 == 0):
        config = route.moe_m1_config(target(x.device), qt.format, N, qt.shape[-1], qt_up is not None)
        return launch_m1(x, qt.data, qt.format, N, qt.shape[-1], config, 0, 1 if interpreter_mode() else 2,
                         up=qt_up.data if qt_up is not None else None, experts=expert_ids, top_k=top_k,
                         n_experts=num_experts)[0]
    y = empty(P, N, dtype=x.dtype, device=x.device)
    if P == 0:
        return y
    K = qt.shape[-1]
    data = qt.data
    row_bytes = data.shape[-1] * data.element_size()
    nsub, sub, block_bytes, nblocks, _ = route.layout(qt.format, K, qt.group_size)
    block_n, nb, warps, stages = route.moe_config(target(x.device), qt.format, N, K, qt.bits or 0, qt.group_size or 0)
    views = _stack_views(qt) + (_stack_views(qt_up) if qt_up is not None else _stack_views(qt))
    moe_gemv_kernel[(triton.cdiv(N, block_n), P)](
        x, expert_ids, token_ids if token_ids is not None else expert_ids, *views, y,
        N, K, num_experts, x.stride(0), y.stride(0), row_bytes,
        qt.scales.stride(-2) if qt.scales is not None else 0, nblocks,
        FMT=FORMAT_IDS[qt.format], NB=nb, NSUB=nsub, SUB=sub, BLOCK_BYTES=block_bytes, BITS=qt.bits or 0,
        BLOCK_N=block_n, DUAL=qt_up is not None, TOP_K=top_k, HAS_TOKEN=token_ids is not None, num_warps=warps,
        num_stages=1 if interpreter_mode() else stages)
    return y


def _launch_grouped(x, qt, qt_up, N, num_experts, expert_ids, token_ids, y, top_k=1):
    K = qt.shape[-1]
    data = qt.data
    nsub, sub, block_bytes, nblocks, _ = route.layout(qt.format, K, qt.group_size)
    block_m, block_n, nb, warps = route.moe_grouped_config(target(x.device), nsub * sub, expert_ids.shape[0],
                                                            num_experts)
    pairs, block_expert = group_pairs(expert_ids, num_experts, block_m)
    views = _stack_views(qt) + (_stack_views(qt_up) if qt_up is not None else _stack_views(qt))
    moe_grouped_kernel[(triton.cdiv(N, block_n), block_expert.shape[0])](
        x, pairs, block_expert, token_ids if token_ids is not None else pairs, *views, y,
        N, K, num_experts, x.stride(0), y.stride(0), data.shape[-1] * data.element_size(),
        qt.scales.stride(-2) if qt.scales is not None else 0, nblocks,
        FMT=FORMAT_IDS[qt.format], NB=nb, NSUB=nsub, SUB=sub, BLOCK_BYTES=block_bytes, BITS=qt.bits or 0,
        BLOCK_M=block_m, BLOCK_N=block_n, DUAL=qt_up is not None,
        DOT_F32=interpreter_mode() or x.dtype == torch.float32, TOP_K=top_k, HAS_TOKEN=token_ids is not None,
        num_warps=warps, num_stages=1)
    return y


def _check_x(x, K: int):
    check_tensor("x", x, dtypes=X_DTYPES, ndim=2, last_dim_contiguous=True)
    if x.shape[1] != K:
        raise ValueError(f"x must be [tokens, K={K}] (K = the experts' input dim), got shape {tuple(x.shape)}")


def moe_gemv(x: torch.Tensor, qt: QuantizedTensor, num_experts: int, expert_ids: torch.Tensor,
             token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """y[p] = x[token_ids[p]] @ W_{expert_ids[p]}^T for every pair p, W_e being rows e * N .. (e + 1) * N of ``qt``.

    Args:
        x: [T, K] fp16/bf16/fp32 activations.
        qt: the experts stacked, [num_experts * N, K] or [num_experts, N, K] (GGUF's ``ffn_*_exps`` as read), any
            GGUF format or MLX affine.
        num_experts: how many matrices ``qt`` stacks.
        expert_ids: int32/int64 [P], the expert of each pair; token_ids: int32/int64 [P], the row of x of each
            pair (default: pair p reads row p, as the down projection does with one row per pair).
    Returns [P, N] in x's dtype.

    >>> w, e = moe_route(router_logits, top_k=2)                       # [T, 2] each
    >>> tok = torch.arange(T, device=x.device).repeat_interleave(2)
    >>> h = moe_gate_up_silu(x, gate_exps, up_exps, 8, e.flatten(), tok)  # [T * 2, F]
    >>> y = (moe_gemv(h, down_exps, 8, e.flatten()).view(T, 2, -1) * w[..., None]).sum(1)
    """
    check_positive_int("num_experts", num_experts)
    N = _check_stack("qt", qt, num_experts)
    _check_x(x, qt.shape[-1])
    check_device(x=x, qt_data=qt.data, expert_ids=expert_ids)
    expert_ids, token_ids = _check_ids(expert_ids, token_ids, num_experts, x.shape[0])
    return _launch(x, qt, None, N, num_experts, expert_ids, token_ids)


_ONE_TOKEN_SLOTS = {}  # (pairs, block_m, device) -> pair b in slot 0 of block b, -1 elsewhere


def pair_groups(expert_ids: torch.Tensor, num_experts: int, one_token: bool = False) -> tuple:
    """The pairs of ``expert_ids`` [P] grouped by expert as the tensor-core MoE kernel reads them, for calls of
    ``moe_pairs(..., groups=)`` over the same ids (one grouping launch for several products). ``one_token``: each
    pair a block of its own, with no launch (a constant slot table, made outside CUDA-graph capture): right for
    any ids, and as cheap to read as a grouping where they are distinct, as one token's top k are."""
    check_positive_int("num_experts", num_experts)
    e = check_tensor("expert_ids", expert_ids, dtypes=(torch.int32, torch.int64), ndim=1).contiguous()
    if not one_token:
        return _groups(e, num_experts)
    P = e.shape[0]
    block_m = route.moe_tc_rows(P, num_experts)
    key = (P, block_m, e.device)
    slots = _ONE_TOKEN_SLOTS.get(key)
    if slots is None:
        if e.is_cuda and torch.cuda.is_current_stream_capturing():  # no allocation to keep from a graph's pool
            return _groups(e, num_experts)
        slots = torch.full((P, block_m), -1, dtype=torch.int32, device=e.device)
        slots[:, 0] = torch.arange(P, dtype=torch.int32, device=e.device)
        slots = _ONE_TOKEN_SLOTS.setdefault(key, slots.reshape(-1))
    return slots, e.to(torch.int32), block_m


def _check_groups(groups, P: int, num_experts: int) -> None:
    """pair_groups' output for P pairs (so the kernel's slots name pairs of this call only)."""
    ok = isinstance(groups, tuple) and len(groups) == 3 and isinstance(groups[2], int)
    if ok:
        pairs, block_expert, block_m = groups
        blocks = block_expert.shape[0]
        ok = (pairs.shape == (blocks * block_m,) and block_m == route.moe_tc_rows(P, num_experts)
              and blocks in (P, -(-P // block_m) + min(num_experts, P)))
    if not ok:
        raise ValueError(f"groups must be pair_groups(expert_ids, {num_experts}) for these {P} pairs")


def moe_pairs(x: torch.Tensor, qt: QuantizedTensor, num_experts: int, expert_ids: torch.Tensor,
              top_k: int = 1, up: QuantizedTensor | None = None, groups: tuple | None = None) -> torch.Tensor:
    """moe_gemv for ids that moe_route made, without its host-side range checks (no synchronisation, so it runs
    inside CUDA graphs): pair p reads row p // top_k of x. Returns [P, N] in x's dtype; with ``up`` (a stack of
    qt's shape and format) [P, 2N], the up products in columns N .. 2N - 1, both stacks read in one launch where
    the tensor-core kernel reads them (an activation of the caller's own in between, as gpt-oss's clamped SwiGLU).
    ``groups``: ``pair_groups(expert_ids, num_experts)``, where the tensor-core kernel takes the products."""
    N = _check_stack("qt", qt, num_experts)
    e = expert_ids.contiguous()
    if groups is not None:
        _check_groups(groups, e.shape[0], num_experts)
    if up is None:
        return _launch(x, qt, None, N, num_experts, e, None, top_k, groups)
    if _check_stack("up", up, num_experts) != N or up.shape != qt.shape or (up.format, up.bits, up.group_size) != (
            qt.format, qt.bits, qt.group_size):
        raise ValueError(f"up must have qt's shape {tuple(qt.shape)} and format {qt.format}, got {tuple(up.shape)} "
                         f"{up.format}")
    P = e.shape[0]
    if (P and route.moe_tc(P, num_experts, route.moe_m1(qt.format, True, x.dtype)) and _tc_reads(x, qt)
            and _tc_reads(x, up)):
        return _tc_products(x, qt, up, N, num_experts, groups or _groups(e, num_experts), P, None, top_k)
    return torch.cat([_launch(x, q, None, N, num_experts, e, None, top_k) for q in (qt, up)], 1)


def moe_gate_up_silu(x: torch.Tensor, qt_gate: QuantizedTensor, qt_up: QuantizedTensor, num_experts: int,
                     expert_ids: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x[t] @ G_e^T) * (x[t] @ U_e^T) for every pair (t, e) = (token_ids[p], expert_ids[p]): both stacked
    matrices read in one pass. ``qt_gate`` and ``qt_up``: [num_experts * F, K] or [num_experts, F, K] in the same
    format. Returns [P, F] in x's dtype."""
    check_positive_int("num_experts", num_experts)
    F = _check_stack("qt_gate", qt_gate, num_experts)
    if _check_stack("qt_up", qt_up, num_experts) != F or qt_up.shape[-1] != qt_gate.shape[-1]:
        raise ValueError(f"qt_up must have qt_gate's shape {tuple(qt_gate.shape)}, got {tuple(qt_up.shape)}")
    if (qt_up.format, qt_up.bits, qt_up.group_size) != (qt_gate.format, qt_gate.bits, qt_gate.group_size):
        raise ValueError(f"qt_gate and qt_up must share a format, got {qt_gate.format} and {qt_up.format}")
    _check_x(x, qt_gate.shape[-1])
    check_device(x=x, qt_gate_data=qt_gate.data, qt_up_data=qt_up.data, expert_ids=expert_ids)
    expert_ids, token_ids = _check_ids(expert_ids, token_ids, num_experts, x.shape[0])
    return _launch(x, qt_gate, qt_up, F, num_experts, expert_ids, token_ids)


def moe_ffn(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate: QuantizedTensor,
            up: QuantizedTensor, down: QuantizedTensor, num_experts: int, *, combine: bool = True):
    """A mixture-of-experts SwiGLU FFN: out[t] = sum_j weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t) with
    e = experts[t, j] (``moe_route``'s outputs). Two MoE GEMV launches and the weighted sum; no host
    synchronisation, so it runs inside CUDA graphs (the ids are not range-checked here: moe_route makes them).
    gate, up: [E, F, K] (or [E * F, K]); down: [E, K, F]. Returns [T, K] in x's dtype, or with ``combine=False``
    the sum left to the caller: (the pairs' products [T * top_k, K] in x's dtype, token t's in rows t * top_k ..,
    and the weights as float32 [T, top_k]), which ``moe_combine`` or the engine's add_rmsnorm (``x_weights``) sum
    in float32 and round to x's dtype."""
    T, k = experts.shape
    e = experts.reshape(-1).contiguous()  # token t's experts are pairs t * k .. t * k + k - 1
    F = _check_stack("gate", gate, num_experts)
    H = _check_stack("down", down, num_experts)
    P = e.shape[0]
    if (P and route.moe_tc(P, num_experts, route.moe_m1(gate.format, True, x.dtype)) and _tc_reads(x, gate)
            and _tc_reads(x, up)
            and (gate.format, gate.bits, gate.group_size) == (up.format, up.bits, up.group_size)):
        # the pairs grouped once for both products; silu(gate) * up formed as the down product loads it
        groups = pair_groups(e, num_experts, one_token=T == 1)
        gu = _tc_products(x, gate, up, F, num_experts, groups, P, None, k)
        if _tc_reads(gu, down):
            y = _tc_products(gu[:, :F], down, None, H, num_experts, groups, P, None, 1, x2=gu[:, F:])
        else:
            y = _launch(_silu_mul(gu, F), down, None, H, num_experts, e, None)
    else:
        y = _unfused_products(x, e, gate, up, down, num_experts, F, H, k)
    if not combine:
        return y, weights.float().contiguous()
    return moe_combine(y, weights)


def moe_combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * y[t * top_k + j] in float32, rounded to y's dtype: the weighted sum of
    ``moe_ffn(..., combine=False)``'s products [T * top_k, H] with its weights [T, top_k]."""
    T, k = weights.shape
    H = y.shape[1]
    out = empty(T, H, dtype=y.dtype, device=y.device)
    if T:
        block_h = min(1024, triton.next_power_of_2(H))
        moe_combine_kernel[(T, triton.cdiv(H, block_h))](y, weights.float().contiguous(), out, H, TOP_K=k,
                                                         BLOCK_H=block_h, num_warps=4)
    return out


def _unfused_products(x, e, gate, up, down, num_experts, F, H, k):
    """moe_ffn's down products [P, H] by the per-pair or grouped kernels (the gate/up product first)."""
    if (gate.format, gate.bits, gate.group_size) == (up.format, up.bits, up.group_size):
        h = _launch(x, gate, up, F, num_experts, e, None, k)
    else:
        g = _launch(x, gate, None, F, num_experts, e, None, k).float()
        h = (g * torch.sigmoid(g) * _launch(x, up, None, F, num_experts, e, None, k).float()).to(x.dtype)
    return _launch(h, down, None, H, num_experts, e, None)
