"""Quantized GEMV / small-M GEMM and embedding lookup (Triton): weights dequantized in registers, read once.

Each program owns BLOCK_N output rows (weight rows) and one split of K, streams the weight blocks of its rows,
and reuses each dequantized tile for all M activation rows. M == 1 multiplies and sums in float32 on the CUDA cores
(the reduction along K is deferred to the end); M > 1 feeds the tile to the tensor cores with tl.dot. With FIXUP the
K splits of a tile sum their own partials (the last to arrive adds them), so a small split product (a MoE router)
needs no second launch.
"""
import triton
import triton.language as tl

from .common import store_tile
from .dequant import dequant_tile


@triton.jit
def _load_x(X, X2, m, m_ok, kk, k_ok, stride_xm, stride_x2m, SILU_X: tl.constexpr):
    x = tl.load(X + m[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    if SILU_X:  # the down projection's input silu(gate) * up, formed here and never written to memory
        g = x.to(tl.float32)
        u = tl.load(X2 + m[:, None] * stride_x2m + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        x = (g / (1.0 + tl.exp(-g)) * u.to(tl.float32)).to(X.dtype.element_ty)
    return x


@triton.jit
def gemv_kernel(X, X2, W8, W16, WI8, WS, WB, V8, V16, VI8, VS, VB, Y, PART, COUNT,
                M, N, K, stride_xm, stride_x2m, stride_ys, stride_ym, row_bytes, scale_stride, nblocks,
                blocks_per_split, split,
                FMT: tl.constexpr, NB: tl.constexpr, NSUB: tl.constexpr, SUB: tl.constexpr,
                BLOCK_BYTES: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr, M_PAD: tl.constexpr,
                SILU_X: tl.constexpr, DUAL: tl.constexpr, FIXUP: tl.constexpr = False):
    """Y [split, M, N] gets each split's sums (float32 partials when split > 1), or with FIXUP Y [1, M, N] the
    whole product: the split programs of a tile store float32 partials in PART [split, M, N] and count their arrival
    in COUNT (zero on entry, see _runtime.split_counters); the last sums them in split order, writes Y and resets
    the counter."""
    BLOCK_K: tl.constexpr = NB * NSUB * SUB
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < N
    m = pid_m * M_PAD + tl.arange(0, M_PAD)
    m_ok = m < M
    kb_start = pid_k * blocks_per_split
    kb_end = tl.minimum(kb_start + blocks_per_split, nblocks)
    if M_PAD == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
    for kb in range(kb_start, kb_end, NB):
        blk = kb + tl.arange(0, NB)
        blk_ok = blk < kb_end
        kk = kb * (NSUB * SUB) + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        x = _load_x(X, X2, m, m_ok, kk, k_ok, stride_xm, stride_x2m, SILU_X)
        w = dequant_tile(W8, W16, WI8, WS, WB, row_bytes, rows, blk, row_ok, blk_ok, scale_stride, K,
                         FMT, NB, NSUB, SUB, BLOCK_BYTES, BITS).reshape(BLOCK_N, BLOCK_K)
        if M_PAD == 1:
            acc += w * x.to(tl.float32)
        else:
            acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
        if DUAL:
            w2 = dequant_tile(V8, V16, VI8, VS, VB, row_bytes, rows, blk, row_ok, blk_ok, scale_stride, K,
                              FMT, NB, NSUB, SUB, BLOCK_BYTES, BITS).reshape(BLOCK_N, BLOCK_K)
            if M_PAD == 1:
                acc2 += w2 * x.to(tl.float32)
            else:
                acc2 = tl.dot(w2.to(x.dtype), tl.trans(x), acc2)
    if M_PAD == 1:
        out = tl.sum(acc, axis=1)[:, None]
        out2 = tl.sum(acc2, axis=1)[:, None]
    else:
        out = acc
        out2 = acc2
    if DUAL:  # gate/up fused: silu(x W_gate^T) * (x W_up^T)
        out = out / (1.0 + tl.exp(-out)) * out2
    store_tile(out, rows, m, row_ok[:, None] & m_ok[None, :], Y, PART, COUNT, M, N, pid_k, split,
               pid_m * tl.num_programs(0) + pid_n, stride_ys, stride_ym, FIXUP)


@triton.jit
def embedding_kernel(IDS, W8, W16, WI8, WS, WB, OUT, n_ids, K, num_rows, row_bytes, scale_stride, nblocks,
                     stride_out,
                     FMT: tl.constexpr, NB: tl.constexpr, NSUB: tl.constexpr, SUB: tl.constexpr,
                     BLOCK_BYTES: tl.constexpr, BITS: tl.constexpr, BLOCK_I: tl.constexpr):
    BLOCK_K: tl.constexpr = NB * NSUB * SUB
    pid_i = tl.program_id(0)
    pid_k = tl.program_id(1)
    idx = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    idx_ok = idx < n_ids
    rows = tl.load(IDS + idx, mask=idx_ok, other=0).to(tl.int64)
    row_ok = idx_ok & (rows >= 0) & (rows < num_rows)
    blk = pid_k * NB + tl.arange(0, NB)
    w = dequant_tile(W8, W16, WI8, WS, WB, row_bytes, rows, blk, row_ok, blk < nblocks, scale_stride, K,
                     FMT, NB, NSUB, SUB, BLOCK_BYTES, BITS).reshape(BLOCK_I, BLOCK_K)
    kk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(OUT + idx.to(tl.int64)[:, None] * stride_out + kk[None, :], w.to(OUT.dtype.element_ty),
             mask=idx_ok[:, None] & (kk[None, :] < K))


def compile_sm90(fmt: str, m_pad: int = 1, dual: bool = False, block_n: int = 32, nb: int = 0, warps: int = 4):
    """gemv_kernel compiled for sm_90 without a GPU (TRITON_INTERPRET=0 set before importing llmkernels) for a GGUF
    format at M_PAD ``m_pad`` (1: the CUDA-core sums; more: tl.dot), ``dual`` the fused gate/up build: for the tests
    and for reading the code the compiler makes."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from . import route
    from .dequant import FORMAT_IDS

    nsub, sub, block_bytes, _, family = route.layout(fmt, 4096, None)
    sig = {"X": "*fp16", "X2": "*fp16", "W16": "*fp16", "V16": "*fp16", "Y": "*fp16", "PART": "*fp32", "COUNT": "*i32"}
    sig.update({n: "*u8" for n in ("W8", "WI8", "WS", "WB", "V8", "VI8", "VS", "VB")})
    sig.update({n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_x2m", "stride_ys", "stride_ym", "row_bytes",
                                   "scale_stride", "nblocks", "blocks_per_split", "split")})
    consts = dict(FMT=FORMAT_IDS[fmt], NB=nb or (1 if family == "kquant" else 4), NSUB=nsub, SUB=sub,
                  BLOCK_BYTES=block_bytes, BITS=0, BLOCK_N=block_n, M_PAD=m_pad, SILU_X=False, DUAL=dual, FIXUP=True)
    sig.update({n: "constexpr" for n in consts})
    return triton.compile(ASTSource(gemv_kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": 2})
