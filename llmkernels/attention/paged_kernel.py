"""Paged attention (Triton): decode, extend and mixed batches over a paged KV cache.

One program handles one tile of one sequence for one KV head and one KV split. A tile packs BLOCK_Q query tokens
times the GROUP query heads that share the KV head into the rows of one matrix (row r = token r // GROUP, head
r % GROUP), so each K/V page is read once per KV head whatever the group size. Rows past the last token or past
BLOCK_Q * GROUP are padding, computed and never stored.

Keys are addressed through the page table a tile at a time: when BLOCK_N divides the page size a tile lies in one
page (one table lookup per tile); otherwise each key row looks up its page (one lookup per token, shared by the D
elements of the row).
"""
import triton
import triton.language as tl

from .._pdl import pdl_trigger, pdl_wait
from ._softmax import align_down, finalize, key_ranges, online_softmax_update, scale_scores, window_mask


# fp8 caches are read as 32-bit words of four values and converted in the registers they were loaded into; the dot
# then reads fp16 from shared memory (ldmatrix) instead of gathering single fp8 bytes, which took 2.5x the shared
# memory loads per key (SASS, sm_90). FP8 modes: 0 = not fp8; 1 = e4m3 through integer ops (the interpreter);
# 2 = e4m3 through cvt.rn.f16x2.e4m3x2 (the GPU); 3 = e5m2 (its byte is the top byte of an fp16).
FP8_OFF, FP8_E4M3_INT, FP8_E4M3_PTX, FP8_E5M2 = 0, 1, 2, 3
# e4m3 bytes -> fp16 through integer ops: sign to bit 15, exponent and mantissa to bits 7-13. That is the value /
# 2^8 (fp16's exponent bias is 8 more than e4m3's; subnormals land on fp16 subnormals), so the kernel folds 2^8
# into the K and V scales.
E4M3_INT_SCALE = tl.constexpr(256.0)
_E4M3X4_TO_F16 = tl.constexpr("{ .reg .b16 lo, hi; .reg .b32 a, b; mov.b32 {lo, hi}, $4; "
                              "cvt.rn.f16x2.e4m3x2 a, lo; cvt.rn.f16x2.e4m3x2 b, hi; "
                              "mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }")


@triton.jit
def _byte_to_f16(w, k: tl.constexpr, FP8: tl.constexpr):
    b = (w >> (8 * k)) & 0xFF
    if FP8 == 3:
        bits = b << 8
    else:
        bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _words_to_f16(w, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr):
    """[BLOCK_N, BLOCK_D // 4] int32 words of fp8 bytes (little-endian) -> [BLOCK_N, BLOCK_D] fp16."""
    if FP8 == 2:
        e0, e1, e2, e3 = tl.inline_asm_elementwise(_E4M3X4_TO_F16, "=h,=h,=h,=h,r", [w],
                                                   dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                                   is_pure=True, pack=1)
    else:
        e0 = _byte_to_f16(w, 0, FP8)
        e1 = _byte_to_f16(w, 1, FP8)
        e2 = _byte_to_f16(w, 2, FP8)
        e3 = _byte_to_f16(w, 3, FP8)
    # join(join(e0, e2), join(e1, e3))[n, c, j, i] = e_{2j+i}: flattened, element 4c + 2j + i is byte 2j + i of word c
    return tl.reshape(tl.join(tl.join(e0, e2), tl.join(e1, e3)), [BLOCK_N, BLOCK_D])


@triton.jit
def _load_kv(cache, pt_row, start_n, offs_n, offs_d, d_ok, k_len, stride_p, stride_s, head_off, dtype,
             PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
             MASKED: tl.constexpr, FP8: tl.constexpr):
    """One [BLOCK_N, BLOCK_D] K or V tile in the dot's dtype (fp16 for fp8 caches).

    The fp8 word loads assume a 16-byte aligned cache and strides that are multiples of 16 (paged_attention checks)."""
    if FP8 != 0:
        offs_w = tl.arange(0, BLOCK_D // 4)  # 32-bit words of four fp8 values
        w_ok = offs_w < HEAD_DIM // 4
        words = tl.multiple_of(cache.to(tl.pointer_type(tl.int32)), 16)
        w = _load_kv_tile(words, pt_row, start_n, offs_n, offs_w, w_ok, k_len, tl.multiple_of(stride_p // 4, 4),
                          tl.multiple_of(stride_s // 4, 4), tl.multiple_of(head_off // 4, 4), PAGE_SIZE, BLOCK_N,
                          BLOCK_D // 4, HEAD_DIM // 4, MASKED)
        return _words_to_f16(w, BLOCK_N, BLOCK_D, FP8)
    else:
        return _load_kv_tile(cache, pt_row, start_n, offs_n, offs_d, d_ok, k_len, stride_p, stride_s, head_off,
                             PAGE_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM, MASKED).to(dtype)


@triton.jit
def _load_kv_tile(cache, pt_row, start_n, offs_n, offs_d, d_ok, k_len, stride_p, stride_s, head_off,
                  PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                  MASKED: tl.constexpr):
    k_pos = start_n + offs_n
    if PAGE_SIZE % BLOCK_N == 0:
        page = tl.load(pt_row + start_n // PAGE_SIZE).to(tl.int64)
        row_off = page * stride_p + ((start_n % PAGE_SIZE) + offs_n) * stride_s
    else:
        in_range = k_pos < k_len
        page = tl.load(pt_row + k_pos // PAGE_SIZE, mask=in_range, other=0).to(tl.int64)
        row_off = page * stride_p + (k_pos % PAGE_SIZE) * stride_s
    ptrs = cache + head_off + row_off[:, None] + offs_d[None, :]
    if MASKED:
        return tl.load(ptrs, mask=(k_pos[:, None] < k_len) & d_ok[None, :], other=0.0)
    elif BLOCK_D != HEAD_DIM:
        return tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _paged_inner(acc, l_i, m_i, q, K, V, pt_row, start, end, k_len, q_pos, q_tok, ctx, MASK, stride_mask,
                 stride_kp, stride_ks, k_head_off, stride_vp, stride_vs, v_head_off, qk_scale, softcap, left, right,
                 offs_n, offs_d, d_ok,
                 MASKED: tl.constexpr, CUSTOM_MASK: tl.constexpr, SOFTCAP: tl.constexpr, HAS_LEFT: tl.constexpr,
                 HAS_RIGHT: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 HEAD_DIM: tl.constexpr, FP8: tl.constexpr):
    for start_n in range(start, end, BLOCK_N):
        k = _load_kv(K, pt_row, start_n, offs_n, offs_d, d_ok, k_len, stride_kp, stride_ks, k_head_off,
                     q.dtype, PAGE_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM, MASKED, FP8)
        s = scale_scores(tl.dot(q, tl.trans(k)), qk_scale, softcap, SOFTCAP)
        if MASKED:
            k_pos = start_n + offs_n
            ok = window_mask(q_pos, k_pos, k_len, left, right, HAS_LEFT, HAS_RIGHT)
            if CUSTOM_MASK:
                # among the new tokens the tree mask replaces the causal rule; cached keys stay visible
                new = k_pos[None, :] >= ctx
                col = tl.where(new, k_pos[None, :] - ctx, 0)
                tree = tl.load(MASK + q_tok[:, None] * stride_mask + col, mask=new & ok, other=1)
                ok = ok & (tree != 0)
            s = tl.where(ok, s, float("-inf"))
        v = _load_kv(V, pt_row, start_n, offs_n, offs_d, d_ok, k_len, stride_vp, stride_vs, v_head_off,
                     q.dtype, PAGE_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM, MASKED, FP8)
        acc, l_i, m_i = online_softmax_update(acc, l_i, m_i, s, v)
    return acc, l_i, m_i


@triton.jit
def paged_attn_kernel(Q, K, V, O, LSE, SINKS, K_SCALE, V_SCALE, MASK, PAGE_TABLE, SEQ_LENS, CU_Q,
                      TILE_SEQ, TILE_Q, NUM_TILES,
                      stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                      stride_os, stride_ot, stride_oh, stride_ls, stride_pt, stride_mask,
                      num_heads, qk_scale, softcap, left, right, k_scale_val, v_scale_val, num_splits,
                      GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                      HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                      HAS_SINK: tl.constexpr, CUSTOM_MASK: tl.constexpr, SCALE_PTRS: tl.constexpr,
                      WRITE_LSE: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr = 0):
    """O / LSE are the outputs, or with split-KV this split's partials, which combine_kernel merges. PDL (see
    _pdl.py): 1, programs wait for the previous kernel first and the next one launches when they exit; 2, it may
    launch once their key loops are done (paged.py says when)."""
    tile = tl.program_id(0)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    pdl_wait(PDL > 0)
    if tile >= tl.load(NUM_TILES):
        return
    b = tl.load(TILE_SEQ + tile)
    t0 = tl.load(TILE_Q + tile)
    q_start = tl.load(CU_Q + b)
    q_len = tl.load(CU_Q + b + 1) - q_start
    k_len = tl.load(SEQ_LENS + b)
    ctx = k_len - q_len

    offs_r = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    tok = t0 + offs_r // GROUP
    head = hk * GROUP + offs_r % GROUP
    row_ok = (offs_r < BLOCK_Q * GROUP) & (tok < q_len)
    q_tok = q_start + tok  # row of the query in [total_q]
    mask_row = tl.where(row_ok, q_tok, q_start)  # padding rows read the tree mask of a real row, never past it
    q_ptrs = Q + q_tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if FP8 != 0:
        # fp8 -> fp16 is one instruction per pair on Hopper, fp8 -> bf16 is not: with an fp8 cache the dots run in
        # fp16 (q and p fit its range: |q| < 65504 and 0 <= p <= 1), and K/V convert straight to it
        q = q.to(tl.float16)

    if SCALE_PTRS:
        k_scale_val = tl.load(K_SCALE).to(tl.float32)
        v_scale_val = tl.load(V_SCALE).to(tl.float32)
    if FP8 == 1:  # the integer e4m3 -> fp16 conversion yields value / 2^8
        k_scale_val = k_scale_val * E4M3_INT_SCALE
        v_scale_val = v_scale_val * E4M3_INT_SCALE
    qk_scale = qk_scale * k_scale_val  # K * k_scale: the scale factors out of the dot product

    q_pos = ctx + tok
    last_tok = tl.minimum(t0 + BLOCK_Q, q_len) - 1
    first_pos = ctx + t0
    last_pos = ctx + last_tok
    lo, full_lo, full_hi, hi = key_ranges(first_pos, last_pos, k_len, left, right, HAS_LEFT, HAS_RIGHT, BLOCK_N)
    if CUSTOM_MASK:  # the tree mask applies among the new tokens: only keys before them skip the mask
        full_hi = tl.minimum(full_hi, align_down(ctx, BLOCK_N))
    # this split's share of [lo, hi): boundaries depend only on this sequence and num_splits (a runtime value, so a
    # new split count does not compile a new kernel)
    chunk = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_N) * BLOCK_N
    s_lo = tl.minimum(lo + split * chunk, hi)
    s_hi = tl.minimum(s_lo + chunk, hi)
    mid_lo = tl.minimum(tl.maximum(full_lo, s_lo), s_hi)
    mid_hi = tl.minimum(tl.maximum(full_hi, mid_lo), s_hi)

    pt_row = PAGE_TABLE + b.to(tl.int64) * stride_pt
    k_head_off = hk * stride_kh
    v_head_off = hk * stride_vh
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc, l_i, m_i = _paged_inner(acc, l_i, m_i, q, K, V, pt_row, s_lo, mid_lo, k_len, q_pos, mask_row, ctx, MASK,
                                 stride_mask, stride_kp, stride_ks, k_head_off, stride_vp, stride_vs, v_head_off,
                                 qk_scale, softcap, left, right, offs_n, offs_d, d_ok, True, CUSTOM_MASK, SOFTCAP,
                                 HAS_LEFT, HAS_RIGHT, PAGE_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM, FP8)
    acc, l_i, m_i = _paged_inner(acc, l_i, m_i, q, K, V, pt_row, mid_lo, mid_hi, k_len, q_pos, mask_row, ctx, MASK,
                                 stride_mask, stride_kp, stride_ks, k_head_off, stride_vp, stride_vs, v_head_off,
                                 qk_scale, softcap, left, right, offs_n, offs_d, d_ok, False, CUSTOM_MASK, SOFTCAP,
                                 HAS_LEFT, HAS_RIGHT, PAGE_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM, FP8)
    acc, l_i, m_i = _paged_inner(acc, l_i, m_i, q, K, V, pt_row, mid_hi, s_hi, k_len, q_pos, mask_row, ctx, MASK,
                                 stride_mask, stride_kp, stride_ks, k_head_off, stride_vp, stride_vs, v_head_off,
                                 qk_scale, softcap, left, right, offs_n, offs_d, d_ok, True, CUSTOM_MASK, SOFTCAP,
                                 HAS_LEFT, HAS_RIGHT, PAGE_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM, FP8)
    pdl_trigger(PDL == 2)
    sink_log2 = 0.0
    if HAS_SINK:
        sink_log2 = tl.load(SINKS + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    o, lse = finalize(acc, l_i, m_i, sink_log2, HAS_SINK)
    o = o * v_scale_val
    o_ptrs = O + split * stride_os + q_tok.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh \
        + offs_d[None, :]
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if WRITE_LSE:
        tl.store(LSE + split * stride_ls + q_tok.to(tl.int64) * num_heads + head, lse, mask=row_ok)


@triton.jit
def combine_kernel(PO, PLSE, O, LSE, SINKS, stride_ps, stride_pt, stride_ph, stride_ls, stride_ot, stride_oh,
                   num_heads, num_splits, SPLITS_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, HAS_SINK: tl.constexpr, WRITE_LSE: tl.constexpr, PDL: tl.constexpr = 0):
    """Merge split-KV partials of one (query, head): o = sum_i exp(lse_i - m) o_i / sum_i exp(lse_i - m), all
    splits in one load. A second launch, not a merge by the last split program: on an H100 (GQA 32/8, bf16, page
    16, graph-timed) batch 1 at 541 keys over 17 splits took 9.5 us this way against 15.5 with that merge (two
    serial L2 round trips per split) and 15.0 with a vectorized one; the Llama-3-8B q4_k engine ran batch 1 at 358
    against 332 tokens/s (bench/NOTES.md). PDL: waits for the attention kernel, lets the next launch."""
    pdl_wait(PDL)
    pdl_trigger(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    lse = tl.load(PLSE + offs_s * stride_ls + t * num_heads + h, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, axis=0)
    if HAS_SINK:
        sink = tl.load(SINKS + h).to(tl.float32)
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)
    denom = tl.sum(w, axis=0)
    if HAS_SINK:
        denom += tl.exp(sink - m_safe)
    po = tl.load(PO + offs_s[:, None] * stride_ps + t * stride_pt + h * stride_ph + offs_d[None, :],
                 mask=s_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    empty = denom == 0.0
    denom_safe = tl.where(empty, 1.0, denom)
    o = tl.sum(po * w[:, None], axis=0) / denom_safe
    tl.store(O + t * stride_ot + h * stride_oh + offs_d, o.to(O.dtype.element_ty), mask=offs_d < HEAD_DIM)
    if WRITE_LSE:
        tl.store(LSE + t * num_heads + h, tl.where(empty, float("-inf"), m_safe + tl.log(denom_safe)))
