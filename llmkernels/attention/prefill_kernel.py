"""Varlen FlashAttention forward (Triton): one program per (query block, query head) of one sequence.

Q tiles stream over K/V tiles with the online softmax; the score matrix never leaves registers. Key blocks are cut
into three ranges: blocks that some query cannot see (window left edge, causal diagonal, sequence end) take the
masked path, blocks every query sees take a path with no per-element mask, and blocks no query sees are not loaded.
"""
import triton
import triton.language as tl

from ._softmax import (finalize, key_ranges, online_softmax_update, online_softmax_update_full, scale_scores,
                       window_mask)


@triton.jit
def _load_rows(base, pos, stride, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows pos of a [len, D] slab, all in range; only padded head-dim columns are masked."""
    ptrs = base + pos[:, None] * stride + offs_d[None, :]
    if BLOCK_D != HEAD_DIM:
        return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _prefill_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, q_pos, k_len, start, end,
                   qk_scale, softcap, left, right, offs_n, offs_d,
                   MASKED: tl.constexpr, SOFTCAP: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    d_ok = offs_d[None, :] < HEAD_DIM
    for start_n in range(start, end, BLOCK_N):
        k_pos = start_n + offs_n
        if MASKED:
            ld_mask = (k_pos[:, None] < k_len) & d_ok
            k = tl.load(k_base + k_pos[:, None] * stride_kt + offs_d[None, :], mask=ld_mask, other=0.0)
        else:  # every key of the block is in range: only padded head-dim columns are masked
            k = _load_rows(k_base, k_pos, stride_kt, offs_d, HEAD_DIM, BLOCK_D)
        k = k.to(q.dtype)  # (fp8 inputs: q is fp16 already, and e4m3 -> fp16 is exact)
        s = scale_scores(tl.dot(q, tl.trans(k)), qk_scale, softcap, SOFTCAP)
        if MASKED:
            s = tl.where(window_mask(q_pos, k_pos, k_len, left, right, HAS_LEFT, HAS_RIGHT), s, float("-inf"))
            # masked-off V rows must be 0, not garbage: p is 0 there, but 0 * NaN would poison the sum
            v = tl.load(v_base + k_pos[:, None] * stride_vt + offs_d[None, :], mask=ld_mask, other=0.0)
        else:
            v = _load_rows(v_base, k_pos, stride_vt, offs_d, HEAD_DIM, BLOCK_D)
        acc, l_i, m_i = online_softmax_update(acc, l_i, m_i, s, v.to(q.dtype))
    return acc, l_i, m_i


@triton.jit
def _prefill_full(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, start, end, qk_scale, offs_n, offs_d,
                  desc_k, desc_v, k_row0, k_col0,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr):
    """Blocks [start, end) that every query sees in full, without softcap: no mask, no -inf guard, and the scale
    folded into the exponent's FMA (345 instead of 378 instructions per 64-key step, SASS sm_90).

    USE_TMA loads the K/V tiles through tensor descriptors over the [tokens, kv heads * head dim] view (TMA on
    Hopper): no per-thread address arithmetic and no cp.async bookkeeping. Only these blocks use them: they lie
    wholly inside the sequence, so a tile never reaches into the next sequence's rows."""
    for start_n in range(start, end, BLOCK_N):
        if USE_TMA:
            k = desc_k.load([k_row0 + start_n, k_col0])
        else:
            k = _load_rows(k_base, start_n + offs_n, stride_kt, offs_d, HEAD_DIM, BLOCK_D)
        p, acc, l_i, m_i = online_softmax_update_full(acc, l_i, m_i, tl.dot(q, tl.trans(k.to(q.dtype))), qk_scale)
        if USE_TMA:
            v = desc_v.load([k_row0 + start_n, k_col0])
        else:
            v = _load_rows(v_base, start_n + offs_n, stride_vt, offs_d, HEAD_DIM, BLOCK_D)
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc)
    return acc, l_i, m_i


# num_m_blocks follows max_seqlen_q: not specialized (== 1, divisible by 16), so a new length never recompiles
@triton.jit(do_not_specialize=["num_m_blocks"])
def flash_fwd_kernel(Q, K, V, O, LSE, SINKS, CU_Q, CU_K, DESC_K, DESC_V, QD, KD, VD, ds_heads,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                     num_heads, group, num_m_blocks, qk_scale, softcap, left, right,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                     HAS_SINK: tl.constexpr, WRITE_LSE: tl.constexpr, FOLD_SCALE: tl.constexpr,
                     USE_TMA: tl.constexpr, FP8: tl.constexpr = 0):
    """FP8: q, k, v are e4m3 holding values / descale; QD, KD, VD -> their float32 descales, one value, or one per
    head where bit 0 / 1 / 2 of ds_heads is set (q's per query head, k's and v's per kv head). They are widened to
    fp16 where loaded (exact), the dots run in fp16, q_descale * k_descale joins the score scale and v_descale the output."""
    # One grid axis, query blocks fastest: the programs that run at the same time share a (sequence, head), and the
    # heads of one KV group are neighbours, so K/V tiles are read from DRAM once and then hit L2 for the other query
    # blocks. (Heads fastest, as before, spread the resident programs over all heads: at S=16384 the L2 hit rate was
    # 18% and DRAM ran at 79% of its bandwidth.) Within a head, query blocks go from the last one, whose causal
    # work is the largest, so heavy programs start first.
    pid = tl.program_id(0)
    pid_bh = pid // num_m_blocks
    pid_m = num_m_blocks - 1 - pid % num_m_blocks
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    q_start = tl.load(CU_Q + b)
    q_len = tl.load(CU_Q + b + 1) - q_start
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:
        return
    k_start = tl.load(CU_K + b)
    k_len = tl.load(CU_K + b + 1) - k_start
    hk = h // group

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < q_len
    d_ok = offs_d < HEAD_DIM
    q_ptrs = Q + (q_start + offs_m).to(tl.int64)[:, None] * stride_qt + h * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    v_descale = 1.0
    if FP8:
        q = q.to(tl.float16)
        qk_scale = qk_scale * tl.load(QD + h * (ds_heads & 1)) * tl.load(KD + hk * ((ds_heads >> 1) & 1))
        v_descale = tl.load(VD + hk * ((ds_heads >> 2) & 1))
    k_base = K + k_start.to(tl.int64) * stride_kt + hk * stride_kh
    v_base = V + k_start.to(tl.int64) * stride_vt + hk * stride_vh

    # bottom-right alignment: query i sits at kv position k_len - q_len + i
    q_pos = offs_m + (k_len - q_len)
    first_pos = m0 + k_len - q_len
    last_pos = tl.minimum(m0 + BLOCK_M, q_len) - 1 + k_len - q_len
    lo, full_lo, full_hi, hi = key_ranges(first_pos, last_pos, k_len, left, right, HAS_LEFT, HAS_RIGHT, BLOCK_N)
    mid_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    mid_hi = tl.minimum(tl.maximum(full_hi, mid_lo), hi)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if HAS_LEFT:  # without a left window edge this range is empty; not compiling it saves its shared memory
        acc, l_i, m_i = _prefill_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, q_pos, k_len, lo,
                                       mid_lo, qk_scale, softcap, left, right, offs_n, offs_d, True, SOFTCAP, HAS_LEFT,
                                       HAS_RIGHT, HEAD_DIM, BLOCK_D, BLOCK_N)
    if SOFTCAP or not FOLD_SCALE:
        acc, l_i, m_i = _prefill_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, q_pos, k_len, mid_lo,
                                       mid_hi, qk_scale, softcap, left, right, offs_n, offs_d, False, SOFTCAP,
                                       HAS_LEFT, HAS_RIGHT, HEAD_DIM, BLOCK_D, BLOCK_N)
    else:
        acc, l_i, m_i = _prefill_full(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, mid_lo, mid_hi,
                                      qk_scale, offs_n, offs_d, DESC_K, DESC_V, k_start, hk * HEAD_DIM, HEAD_DIM,
                                      BLOCK_D, BLOCK_N, USE_TMA)
    acc, l_i, m_i = _prefill_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, q_pos, k_len, mid_hi, hi,
                                   qk_scale, softcap, left, right, offs_n, offs_d, True, SOFTCAP, HAS_LEFT, HAS_RIGHT,
                                   HEAD_DIM, BLOCK_D, BLOCK_N)
    sink_log2 = 0.0
    if HAS_SINK:
        sink_log2 = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
    o, lse = finalize(acc, l_i, m_i, sink_log2, HAS_SINK)
    if FP8:
        o = o * v_descale
    o_ptrs = O + (q_start + offs_m).to(tl.int64)[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if WRITE_LSE:
        tl.store(LSE + (q_start + offs_m).to(tl.int64) * num_heads + h, lse, mask=row_ok)
