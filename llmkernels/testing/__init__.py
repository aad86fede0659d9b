"""Pure-torch references (the spec) and test helpers shared by tests and benchmarks.

References compute in float64 by default; never use a fast kernel as the oracle for another.
"""
from .attention import attention_ref, flash_attn_varlen_ref, paged_attention_ref, gather_pages
from .gemv import (embedding_ref, gemv_ref, i8_lane_positions, lane_positions, moe_gate_up_silu_ref, moe_gemv_ref,
                   silu_mul_gemv_ref)
from .tolerances import TOLERANCES, tolerance, assert_close, poison

__all__ = ["attention_ref", "flash_attn_varlen_ref", "paged_attention_ref", "gather_pages", "gemv_ref",
           "silu_mul_gemv_ref", "embedding_ref", "moe_gemv_ref", "moe_gate_up_silu_ref", "TOLERANCES", "tolerance", "assert_close", "poison"]
