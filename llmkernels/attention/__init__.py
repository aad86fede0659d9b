"""Attention kernels: varlen prefill, paged decode/extend with split-KV, the combine step, and the planner."""
from .paged import paged_attention
from .plan import PagedAttentionPlan, plan_paged_attention
from .prefill import flash_attn, flash_attn_varlen

__all__ = ["flash_attn", "flash_attn_varlen", "paged_attention", "plan_paged_attention", "PagedAttentionPlan"]
