"""Run benchmark suites on a GPU; print one table per suite and write JSON to bench/results/.

    python -m llmkernels.bench                 # every suite
    python -m llmkernels.bench prefill decode  # some suites
    python -m llmkernels.bench llamacpp serve --llama-cpp DIR   # our engine and server beside llama.cpp's
    python -m llmkernels.bench --plot bench/results/FILE.json
    python -m llmkernels.bench --report        # bench/RESULTS.md from the committed files
"""
from __future__ import annotations

import argparse
import gc
import importlib
import sys
import traceback

from .suites import SUITES


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmkernels.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suites", nargs="*", help=f"suites to run (default: all): {', '.join(SUITES)}")
    p.add_argument("--out", default="bench/results", help="folder for the JSON results (default bench/results)")
    p.add_argument("--quick", action="store_true", help="fewer cases")
    p.add_argument("-k", "--case", metavar="TEXT", default=None,
                   help="run only the cases whose name contains TEXT (e.g. -k 70b); default: every case")
    p.add_argument("--llama-cpp", metavar="DIR", default=None,
                   help="folder of a llama.cpp build for the peer rows: llama-bench and llama-batched-bench for the "
                        "llamacpp suite, llama-server for the serve suite (default: $LLMK_LLAMA_CPP)")
    p.add_argument("--plot", metavar="RESULTS_JSON", help="draw a PNG chart of a results file and exit")
    p.add_argument("--report", action="store_true",
                   help="write bench/RESULTS.md from the newest results file of each GPU and suite, and exit")
    args = p.parse_args(argv)
    if args.case is not None and not args.case.strip():
        p.error("-k/--case needs a non-empty TEXT (part of a case name)")

    from .harness import Context, format_table, measure_copy_bandwidth, measure_matmul_tflops, \
        measure_read_bandwidth, plot, write_results

    if args.plot:
        print(plot(args.plot))
        return 0
    if args.report:
        from .report import write_report

        print(write_report(args.out, "bench/RESULTS.md"))
        return 0
    unknown = [s for s in args.suites if s not in SUITES]
    if unknown:
        p.error(f"unknown suite(s) {unknown}; known: {list(SUITES)}")
    import torch

    if not torch.cuda.is_available():
        print("python -m llmkernels.bench needs a CUDA GPU (timings through the interpreter mean nothing).",
              file=sys.stderr)
        return 2
    from tqdm import tqdm

    suites = args.suites or list(SUITES)
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    ctx = Context(read_bw_TBps=measure_read_bandwidth(), copy_bw_TBps=measure_copy_bandwidth(),
                  matmul_TFLOPs=measure_matmul_tflops(), quick=args.quick, llama_cpp=args.llama_cpp,
                  case_filter=args.case)
    print(f"measured: read {ctx.read_bw_TBps:.3f} TB/s, copy (read+write) {ctx.copy_bw_TBps:.3f} TB/s, "
          f"bf16 matmul {ctx.matmul_TFLOPs:.1f} TFLOP/s", flush=True)
    cases = []
    for name in suites:
        mod = importlib.import_module(SUITES[name])
        cases += [(name, case, thunk) for case, thunk in mod.cases(ctx) if args.case is None or args.case in case]
    if not cases:
        print(f"no case of {suites} has {args.case!r} in its name", file=sys.stderr)
        return 2
    rows, failures, path = [], 0, None
    for suite, case, thunk in tqdm(cases, desc="bench", unit="case", file=sys.stderr, mininterval=2):
        try:
            out = thunk()
            rows += out if isinstance(out, list) else [out]
        except Exception:  # one broken case must not hide the others' figures
            failures += 1
            print(f"\n[{suite}] {case} failed:\n{traceback.format_exc()}", file=sys.stderr)
        gc.collect()  # a case's objects in reference cycles (an LLM with its graphs) go now, not at some later case
        torch.cuda.empty_cache()
        if rows:  # after every case, so a run stopped by a time limit keeps what it measured
            path = write_results(rows, ctx, args.out, suites, path)
    print(format_table(rows))
    path = write_results(rows, ctx, args.out, suites, path)
    print(f"wrote {path}" + (f"  ({failures} case(s) failed)" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
