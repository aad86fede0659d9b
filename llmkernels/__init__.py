"""llmkernels: readable Triton kernels for LLM inference (attention, paged KV cache, quantized GEMV, GGUF formats).

On a machine with no CUDA device, importing llmkernels (before triton) selects Triton's interpreter, so the kernels
run on CPU tensors: slow, for tests and study.
"""
import os as _os

from ._runtime import configure as _configure

_configure()
if _os.environ.get("LLMKERNELS_ANY_TRITON", "0") == "0":
    from .supported import require_supported_triton as _require_supported_triton

    _require_supported_triton()
if _os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    from ._interpreter import fix_interpreter as _fix_interpreter

    _fix_interpreter()  # the interpreter multiplies bf16 bit patterns as integers otherwise

from .attention import (PagedAttentionPlan, flash_attn, flash_attn_varlen, paged_attention,  # noqa: E402
                        plan_paged_attention)
from .qgemv import embedding, gate_up_silu, gemv, silu_mul_gemv  # noqa: E402
from .kv_cache import store_kv  # noqa: E402
from .quant import (GGUFError, QuantizedTensor, dequantize, quantize, read_gguf, write_gguf)  # noqa: E402

__version__ = "0.1.0"

__all__ = ["flash_attn", "flash_attn_varlen", "paged_attention", "plan_paged_attention", "PagedAttentionPlan",
           "store_kv", "gemv", "silu_mul_gemv", "gate_up_silu", "embedding", "GGUFError", "QuantizedTensor",
           "dequantize", "quantize", "read_gguf", "write_gguf"]
