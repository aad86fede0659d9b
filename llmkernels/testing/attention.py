"""Dense attention references in float64: masks, sliding window, soft cap, sinks, GQA, varlen and paged gather.

Semantics (shared/DESIGN.md): a sequence's queries are its last q_len kv positions, so query i sits at kv position
k_len - q_len + i. A query that sees no key and has no sink gets output 0 and LSE -inf.
"""
from __future__ import annotations

import math

import torch


def attention_ref(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, sinks=None,
                  visible=None, dtype=torch.float64):
    """One sequence. q [Sq, Hq, D], k/v [Sk, Hkv, D] -> (o [Sq, Hq, D], lse [Sq, Hq]) in ``dtype``.

    ``visible``: optional bool [Sq, Sk] ANDed with the causal/window rules.
    """
    Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[0], k.shape[1]
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    q, k, v = (t.to(dtype) for t in (q, k, v))
    group = Hq // Hkv
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    q_pos = torch.arange(Sq, device=q.device) + (Sk - Sq)
    k_pos = torch.arange(Sk, device=q.device)
    mask = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device)
    if causal:
        mask &= k_pos[None, :] <= q_pos[:, None]
    left, right = window_size
    if left >= 0:
        mask &= k_pos[None, :] >= q_pos[:, None] - left
    if right >= 0:
        mask &= k_pos[None, :] <= q_pos[:, None] + right
    if visible is not None:
        mask &= visible.to(q.device)
    s = s.masked_fill(~mask[None], -math.inf)
    if sinks is not None:
        sink = sinks.to(dtype).view(Hq, 1, 1).expand(Hq, Sq, 1)
        lse = torch.logsumexp(torch.cat([s, sink], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(s, dim=-1)
    p = torch.where(torch.isinf(lse)[..., None], torch.zeros_like(s), torch.exp(s - lse[..., None]))
    o = torch.einsum("hqk,khd->qhd", p, v)
    return o, lse.transpose(0, 1).contiguous()


def flash_attn_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, softmax_scale=None,
                          window_size=(-1, -1), softcap=0.0, sinks=None, dtype=torch.float64):
    """q [total_q, Hq, D], k/v [total_k, Hkv, D] -> (o [total_q, Hq, D], lse [total_q, Hq]) in ``dtype``."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    o = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=dtype, device=q.device)
    lse = torch.full((q.shape[0], q.shape[1]), -math.inf, dtype=dtype, device=q.device)
    for b in range(len(cq) - 1):
        qs, qe, ks, ke = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if qe == qs:
            continue
        o[qs:qe], lse[qs:qe] = attention_ref(q[qs:qe], k[ks:ke], v[ks:ke], causal=causal, softmax_scale=softmax_scale,
                                             window_size=window_size, softcap=softcap, sinks=sinks, dtype=dtype)
    return o, lse


def _scale_value(s):
    if s is None:
        return 1.0
    return float(s) if not isinstance(s, torch.Tensor) else float(s.reshape(-1)[0])


def gather_pages(cache, page_table_row, length, scale=None, dtype=torch.float64):
    """The first ``length`` tokens of one sequence from a paged cache [num_pages, page_size, Hkv, D], dequantized."""
    page_size = cache.shape[1]
    n_pages = -(-length // page_size)
    pages = page_table_row[:n_pages].long()
    dense = cache[pages].reshape(n_pages * page_size, *cache.shape[2:])[:length]
    return dense.to(dtype) * _scale_value(scale)


def paged_attention_ref(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, *, causal=True, softmax_scale=None,
                        window_size=(-1, -1), softcap=0.0, sinks=None, k_scale=None, v_scale=None, custom_mask=None,
                        dtype=torch.float64):
    """Gathers each sequence's pages into dense K/V and runs ``attention_ref``.

    q [total_q, Hq, D]; caches [num_pages, page_size, Hkv, D]; page_table int32 [batch, max_pages];
    seq_lens int32 [batch]; cu_seqlens_q int32 [batch+1]; custom_mask bool [total_q, max_seqlen_q] or None.
    Returns (o [total_q, Hq, D], lse [total_q, Hq]) in ``dtype``.
    """
    cq, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    o = torch.zeros(q.shape[0], q.shape[1], v_cache.shape[-1], dtype=dtype, device=q.device)
    lse = torch.full((q.shape[0], q.shape[1]), -math.inf, dtype=dtype, device=q.device)
    for b in range(len(cq) - 1):
        qs, qe, L = cq[b], cq[b + 1], lens[b]
        q_len = qe - qs
        if q_len == 0:
            continue
        k = gather_pages(k_cache, page_table[b], L, k_scale, dtype)
        v = gather_pages(v_cache, page_table[b], L, v_scale, dtype)
        visible = None
        use_causal = causal
        if custom_mask is not None:
            ctx = L - q_len
            visible = torch.ones(q_len, L, dtype=torch.bool, device=q.device)
            visible[:, ctx:] = custom_mask[qs:qe, :q_len].to(q.device)
            use_causal = False
        o[qs:qe], lse[qs:qe] = attention_ref(q[qs:qe], k, v, causal=use_causal, softmax_scale=softmax_scale,
                                             window_size=window_size, softcap=softcap, sinks=sinks, visible=visible,
                                             dtype=dtype)
    return o, lse
