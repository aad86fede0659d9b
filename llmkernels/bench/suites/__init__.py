"""Benchmark suites by name. Each module has ``cases(ctx) -> list[(name, thunk)]``; a thunk returns Rows."""
SUITES = {
    "anchors": "llmkernels.bench.suites.anchors",
}
