"""Quantized GEMV for decode: every GGUF format and MLX affine, small-M batching, fused SiLU, embedding lookup, and
the mixture-of-experts GEMV (only the chosen experts' rows read)."""
from .moe import moe_gate_up_silu, moe_gemv, moe_route
from .ops import embedding, gate_up_silu, gemv, silu_mul_gemv

__all__ = ["embedding", "gate_up_silu", "gemv", "silu_mul_gemv", "moe_gemv", "moe_gate_up_silu", "moe_route"]
