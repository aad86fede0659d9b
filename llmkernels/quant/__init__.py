"""Quantized weight formats: the registry (data), pure-torch quantize/dequantize (the spec), QuantizedTensor, GGUF I/O."""
from .formats import GGUF_FORMATS, MLX_BITS, MLX_GROUP_SIZES, GGUFFormat, format_table
from .gguf_io import GGUFError, GGUFFile, GGUFMetadata, read_gguf, write_gguf
from .tensor import FORMATS, QuantizedTensor, dequantize, quantize

__all__ = ["GGUF_FORMATS", "MLX_BITS", "MLX_GROUP_SIZES", "GGUFFormat", "format_table", "GGUFError", "GGUFFile",
           "GGUFMetadata", "read_gguf", "write_gguf", "FORMATS", "QuantizedTensor", "dequantize", "quantize"]
