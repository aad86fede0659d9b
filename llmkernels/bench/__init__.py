"""``python -m llmkernels.bench [suite ...]``: kernels against anchors and the GPU's measured ceilings."""
from .harness import Context, Row, format_table, plot, time_ms, write_results

__all__ = ["Context", "Row", "format_table", "plot", "time_ms", "write_results"]
