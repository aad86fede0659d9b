"""Benchmark suites by name. Each module has ``cases(ctx) -> list[(name, thunk)]``; a thunk returns Rows."""
SUITES = {
    "anchors": "llmkernels.bench.suites.anchors",
    "prefill": "llmkernels.bench.suites.prefill",
    "decode": "llmkernels.bench.suites.decode",
    "gemv": "llmkernels.bench.suites.gemv",
    "engine": "llmkernels.bench.suites.engine",
    "llamacpp": "llmkernels.bench.suites.llamacpp",
    "serve": "llmkernels.bench.suites.serve",
    "tp": "llmkernels.bench.suites.tp",
    "families": "llmkernels.bench.suites.families",
}
