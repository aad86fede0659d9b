"""Command line: ``python -m llmkernels demo`` | ``formats``."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmkernels", description="llmkernels command line")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="run every kernel once against its reference (timed on a GPU)")
    sub.add_parser("formats", help="print the quantized formats with their block layouts")
    args = p.parse_args(argv)
    import llmkernels  # noqa: F401  (selects the interpreter before triton loads when there is no GPU)

    if args.cmd == "demo":
        from .demo import main as demo

        return demo()
    if args.cmd == "formats":
        from .quant.formats import format_table

        print(format_table())
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
