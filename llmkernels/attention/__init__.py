"""Attention kernels: varlen prefill, paged decode/extend with split-KV, the combine step, and the planner."""
from .prefill import flash_attn, flash_attn_varlen

__all__ = ["flash_attn", "flash_attn_varlen"]
