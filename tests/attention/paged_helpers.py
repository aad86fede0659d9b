"""Builds paged caches through store_kv for the paged-attention tests."""
import torch

import llmkernels as lk


def build(q_lens, k_lens, page_size, Hq, Hkv, D, *, dtype=torch.float16, kv_dtype=None, device="cpu", scales=None,
          extra_pages=3):
    """Random K/V for every sequence, written through store_kv into pages in shuffled order."""
    kv_dtype = kv_dtype or dtype
    B = len(q_lens)
    max_pages = max([-(-L // page_size) for L in k_lens] + [1]) + 1
    num_pages = B * max_pages + extra_pages
    page_table = torch.randperm(num_pages)[:B * max_pages].reshape(B, max_pages).to(torch.int32).to(device)
    k_cache = torch.zeros(num_pages, page_size, Hkv, D, dtype=kv_dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    ks, vs = scales if scales else (None, None)
    for b, L in enumerate(k_lens):
        k = torch.randn(L, Hkv, D, dtype=dtype, device=device)
        v = torch.randn(L, Hkv, D, dtype=dtype, device=device)
        pos = torch.arange(L, device=device)
        slots = lk.kv_cache.slots_for(page_table, pos, torch.full_like(pos, b), page_size)
        lk.store_kv(k, v, k_cache, v_cache, slots, k_scale=ks, v_scale=vs)
    cu_q = torch.tensor([0] + list(q_lens)).cumsum(0).to(torch.int32).to(device)
    seq_lens = torch.tensor(k_lens, dtype=torch.int32, device=device)
    q = torch.randn(int(cu_q[-1]), Hq, D, dtype=dtype, device=device)
    return q, k_cache, v_cache, page_table, seq_lens, cu_q


def tree_mask(q_lens, device, p=0.5):
    """A random speculative tree mask: each query sees itself, others at random."""
    total, mq = sum(q_lens), max(q_lens)
    mask = torch.rand(total, mq, device=device) < p
    start = 0
    for n in q_lens:
        for i in range(n):
            mask[start + i, i] = True
        start += n
    return mask
