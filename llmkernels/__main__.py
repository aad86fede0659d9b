"""Command line: ``python -m llmkernels demo`` | ``formats`` | ``generate MODEL.gguf --prompt ...`` |
``convert HF_DIR OUT.gguf --format q4_k``."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmkernels", description="llmkernels command line")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="run every kernel once against its reference (timed on a GPU)")
    sub.add_parser("formats", help="print the quantized formats with their block layouts")
    g = sub.add_parser("generate", help="generate text with a GGUF model (llama, mistral, qwen2, qwen3)")
    g.add_argument("model", help="path to a .gguf file")
    g.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--device", default=None, help="cuda (default when present) or cpu (Triton interpreter)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-cuda-graphs", action="store_true")
    g.add_argument("--act-int8", action="store_true",
                   help="round q4_0/q8_0/q4_k/q6_k activations to int8 at batch 1 (faster decode, other "
                   "logits)")
    g.add_argument("--stats", action="store_true", help="print tokens/s and step counts at the end")
    c = sub.add_parser("convert", help="convert a Hugging Face Llama/Mistral/Qwen2/Qwen3 checkpoint to GGUF")
    c.add_argument("model_dir")
    c.add_argument("out")
    c.add_argument("--format", default="f16",
                   help="GGUF format of the weight matrices (default f16), or q4_k_m / q5_k_m (llama.cpp's "
                        "Q4_K_M / Q5_K_M mixes)")
    c.add_argument("--output-format", default=None, help="format of the output matrix (default: --format)")
    args = p.parse_args(argv)
    import llmkernels  # noqa: F401  (selects the interpreter before triton loads when there is no GPU)

    if args.cmd == "demo":
        from .demo import main as demo

        return demo()
    if args.cmd == "formats":
        from .quant.formats import format_table

        print(format_table())
        return 0
    if args.cmd == "generate":
        return _generate(args)
    if args.cmd == "convert":
        from .engine.convert import convert_hf_to_gguf

        print(convert_hf_to_gguf(args.model_dir, args.out, args.format, output_format=args.output_format))
        return 0
    return 2


def _generate(args) -> int:
    import time

    from .engine import LLM, SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    except (TypeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    llm = LLM(args.model, device=args.device, max_model_len=args.max_model_len, cuda_graphs=not args.no_cuda_graphs,
              max_num_seqs=max(1, len(args.prompt)), act_int8=args.act_int8)
    t0 = time.perf_counter()
    if len(args.prompt) == 1:
        print(args.prompt[0], end="", flush=True)
        for piece in llm.stream(args.prompt[0], params):
            print(piece, end="", flush=True)
        print()
    else:
        for i, out in enumerate(llm.generate(args.prompt, params)):
            print(f"[{i}] {args.prompt[i]}{out.text}")
    dt = time.perf_counter() - t0
    if args.stats:
        st = llm.stats
        print(f"{st.decode_tokens + len(args.prompt)} tokens generated, {st.prefill_tokens} prompt tokens, "
              f"{st.steps} steps ({st.graph_steps} CUDA-graph replays), {dt:.2f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
