"""Quantized GEMV for decode: every GGUF format and MLX affine, small-M batching, fused SiLU, embedding lookup."""
from .ops import embedding, gate_up_silu, gemv, silu_mul_gemv

__all__ = ["embedding", "gate_up_silu", "gemv", "silu_mul_gemv"]
