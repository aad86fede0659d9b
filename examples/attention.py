"""Varlen prefill and paged decode attention, checked against the float64 references (runs on CPU too)."""
import torch

import llmkernels as lk
from llmkernels.testing.attention import flash_attn_varlen_ref, paged_attention_ref

dev = "cuda" if torch.cuda.is_available() else "cpu"   # CPU: Triton's interpreter, small sizes
big = dev == "cuda"
dtype = torch.bfloat16
Hq, Hkv, D = (32, 8, 128) if big else (4, 2, 64)

# varlen prefill: sequences concatenated along dim 0, cu_seqlens give their boundaries
lens = [200, 500] if big else [20, 37]
cu = torch.tensor([0, *lens], device=dev).cumsum(0).to(torch.int32)
q = torch.randn(sum(lens), Hq, D, dtype=dtype, device=dev)
k = torch.randn(sum(lens), Hkv, D, dtype=dtype, device=dev)
v = torch.randn(sum(lens), Hkv, D, dtype=dtype, device=dev)
o = lk.flash_attn_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True, window_size=(256, -1))
ref, _ = flash_attn_varlen_ref(q, k, v, cu, cu, causal=True, window_size=(256, -1))
print("prefill max |error|", (o.double() - ref).abs().max().item())

# paged KV cache [pages, page_size, Hkv, D]: write the tokens with store_kv, plan once per batch, attend per layer
page_size, num_pages = 16, 64
k_cache = torch.zeros(num_pages, page_size, Hkv, D, dtype=dtype, device=dev)
v_cache = torch.zeros_like(k_cache)
page_table = torch.randperm(num_pages, device=dev)[:2 * 32].view(2, 32).to(torch.int32)  # 2 sequences, 32 pages each
for b, L in enumerate(lens):
    pos = torch.arange(L, device=dev)
    slots = lk.kv_cache.slots_for(page_table, pos, torch.full_like(pos, b), page_size)  # page * page_size + offset
    lk.store_kv(k[cu[b]:cu[b + 1]], v[cu[b]:cu[b + 1]], k_cache, v_cache, slots)
seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
cu_q = torch.tensor([0, 1, 2], dtype=torch.int32, device=dev)          # one new query per sequence: decode
q_new = torch.randn(2, Hq, D, dtype=dtype, device=dev)
plan = lk.plan_paged_attention(cu_q, seq_lens, page_size, Hq, Hkv, D, q_dtype=dtype, kv_dtype=dtype)
print(plan.describe())                                                  # launches, tiles, split-KV and why
o = lk.paged_attention(q_new, k_cache, v_cache, page_table, seq_lens, cu_q, 1, plan=plan)
ref, _ = paged_attention_ref(q_new, k_cache, v_cache, page_table, seq_lens, cu_q)
print("decode max |error|", (o.double() - ref).abs().max().item())
