"""The online-softmax pieces shared by the prefill, extend and decode kernels.

Scores are kept in the log2 domain: qk_scale already holds softmax_scale * log2(e), so exp2 replaces exp (one
multiply folded into the scale instead of one per element). The running state per query row is
(m = max score so far, l = sum of exp2(s - m), acc = sum of exp2(s - m) * v); a new maximum rescales l and acc by
exp2(m_old - m_new). Rows that have seen no key yet keep m = -inf; the update guards against -inf - -inf.
"""
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # 1 / ln(2)
LN2 = 0.6931471805599453


@triton.jit
def tanh(x):
    # tanh through exp2, which both the compiler and the interpreter have: 1 - 2 / (exp(2x) + 1)
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def scale_scores(qk, qk_scale, softcap, SOFTCAP: tl.constexpr):
    """Raw q.k -> scores in the log2 domain; with SOFTCAP, softcap * tanh(s / softcap) applied in natural units.

    With SOFTCAP, ``qk_scale`` is the plain softmax scale and ``softcap`` the cap; the log2(e) factor is applied
    after the cap.
    """
    if SOFTCAP:
        s = qk * qk_scale
        return softcap * tanh(s / softcap) * 1.4426950408889634
    else:
        return qk * qk_scale


@triton.jit
def online_softmax_update(acc, l_i, m_i, s, v):
    """Fold one tile of scores s [M, N] (log2 domain, -inf where masked) and values v [N, D] into the state."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def online_softmax_update_full(acc, l_i, m_i, qk, qk_scale):
    """The state update for a tile every query sees in full, from raw scores qk [M, N] -> (p, acc rescaled, l, m);
    the caller adds p @ v to acc.

    The scale rides in the exponent's FMA (qk * scale - m). No -inf guard: every row sees every key of the tile, so
    the new maximum is finite, and an old maximum of -inf gives alpha = 0."""
    m_new = tl.maximum(m_i, tl.max(qk, axis=1) * qk_scale)
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    return p, acc, l_i, m_new


@triton.jit
def finalize(acc, l_i, m_i, sink_log2, HAS_SINK: tl.constexpr):
    """-> (o = acc / l, lse in natural log). A sink logit joins the denominator; rows with l = 0 give o = 0."""
    if HAS_SINK:
        m_fin = tl.maximum(m_i, sink_log2)
        corr = tl.exp2(m_i - m_fin)
        l_i = l_i * corr + tl.exp2(sink_log2 - m_fin)
        acc = acc * corr[:, None]
        m_i = m_fin
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    return o, lse


@triton.jit
def window_mask(q_pos, k_pos, k_len, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Which (query, key) pairs are visible: key inside the sequence and inside [p - left, p + right]."""
    ok = k_pos[None, :] < k_len
    if HAS_LEFT:
        ok = ok & (k_pos[None, :] >= q_pos[:, None] - left)
    if HAS_RIGHT:
        ok = ok & (k_pos[None, :] <= q_pos[:, None] + right)
    return ok


@triton.jit
def align_down(x, BLOCK: tl.constexpr):
    return (tl.maximum(x, 0) // BLOCK) * BLOCK


@triton.jit
def key_ranges(first_pos, last_pos, k_len, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Key range of a tile of queries at kv positions first_pos..last_pos -> (lo, full_lo, full_hi, hi).

    Keys outside [lo, hi) are seen by no query and never loaded; blocks inside [full_lo, full_hi) are seen by every
    query and take the path with no per-element mask; the rest of [lo, hi) is masked element by element.
    """
    hi = k_len
    if HAS_RIGHT:
        hi = tl.maximum(tl.minimum(hi, last_pos + right + 1), 0)
    lo = 0
    full_lo = 0
    if HAS_LEFT:
        lo = align_down(first_pos - left, BLOCK_N)
        # every query sees key j >= last_pos - left: round up to the next block
        full_lo = align_down(last_pos - left + BLOCK_N - 1, BLOCK_N)
    full_hi = align_down(k_len, BLOCK_N)
    if HAS_RIGHT:
        full_hi = tl.minimum(full_hi, align_down(first_pos + right + 1, BLOCK_N))
    return tl.minimum(lo, hi), full_lo, full_hi, hi
