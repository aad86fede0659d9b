"""Command line: ``python -m llmkernels {demo,formats,info,tune,generate,serve,convert}`` (also installed as
``llmkernels``).

Errors print one line on stderr and exit with status 2; ``--debug`` shows the traceback instead.
"""
from __future__ import annotations

import argparse
import sys

from .engine.convert import MIXES
from .quant.formats import GGUF_FORMATS

FORMATS = tuple(GGUF_FORMATS)


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m llmkernels", description="llmkernels command line",
                                formatter_class=_Formatter)
    p.add_argument("--debug", action="store_true", help="on an error, show the Python traceback")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    sub.add_parser("demo", help="run every kernel once against its reference (timed on a GPU)",
                   formatter_class=_Formatter)
    sub.add_parser("formats", help="print the quantized formats with their block layouts", formatter_class=_Formatter)
    i = sub.add_parser("info", help="print the GPU, the tuned-table entries in use and why, versions, kernel paths",
                       formatter_class=_Formatter)
    i.add_argument("--route", nargs=4, metavar=("FORMAT", "M", "N", "K"), default=None,
                   help="also print the GEMV route (kernel, config, rule) of an [M, K] x [N, K]^T product in FORMAT "
                        "(a GGUF format, or mlx4 / mlx8 with groups of 64) on this GPU")
    i.add_argument("--op", default="gemv", choices=("gemv", "silu_mul", "gate_up", "lanes"),
                   help="the product --route describes: gemv, silu_mul_gemv, gate_up_silu, gemv_lanes")
    i.add_argument("--dtype", default="fp16", choices=("fp16", "bf16", "fp32"), help="activation dtype for --route")
    i.add_argument("--act-int8", action="store_true", help="--route with act_int8=True")
    from .tuning.tune import build_parser as tune_parser

    tune_parser(sub.add_parser("tune", help="tune the kernels for this GPU into the user tuning folder",
                               formatter_class=_Formatter))
    g = sub.add_parser("generate", help="generate text with a GGUF model (llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3, "
                                        "qwen3moe, mixtral, gpt-oss)",
                       formatter_class=_Formatter)
    g.add_argument("model", help="path to a .gguf file")
    g.add_argument("--prompt", action="append", required=True, help="a prompt (repeat the flag for a batch)")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = all")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1 = off")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    g.add_argument("--chat", action="store_true",
                   help="each prompt is a user message rendered with the model's chat template; a harmony model's "
                        "(gpt-oss) reasoning goes to stderr, its reply to stdout")
    g.add_argument("--reasoning-effort", default=None, choices=("low", "medium", "high"),
                   help="with --chat: the chat template's reasoning_effort (gpt-oss)")
    g.add_argument("--device", default=None, choices=("cuda", "cpu"),
                   help="where to run (default: cuda when a GPU is visible, else cpu through Triton's interpreter)")
    g.add_argument("--backend", default="auto", choices=("auto", "triton", "torch"),
                   help="triton: llmkernels' kernels (the interpreter on the CPU: slow); torch: a pure-torch forward "
                        "(fast on the CPU); auto: triton on a GPU, torch on the CPU")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + generation (default: the model's context length, at most 8192)")
    g.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly")
    g.add_argument("--act-int8", action="store_true",
                   help="round activations to int8 at batch 1 for the q4_0/q8_0/q4_k/q5_k/q6_k projections (faster "
                        "decode, slightly different logits)")
    g.add_argument("--megakernel", default="auto", choices=("auto", "on", "off"),
                   help="decode up to 8 sequences with one persistent kernel per step (sm_90; auto: where it is faster)")
    g.add_argument("--stats", action="store_true",
                   help="print tokens/s, step counts and the decode path at the end (stderr)")
    _serve_parser(sub.add_parser("serve", help="serve a GGUF model over an OpenAI-compatible HTTP API",
                                 formatter_class=_Formatter))
    c = sub.add_parser("convert", help="convert a Hugging Face Llama/Mistral/Qwen2/Qwen3/Phi-3/Gemma 2/Gemma 3/Qwen3-MoE/"
                                       "Mixtral/gpt-oss checkpoint to GGUF",
                       formatter_class=_Formatter)
    c.add_argument("model_dir", help="checkpoint folder (config.json, *.safetensors, tokenizer.json)")
    c.add_argument("out", help="path of the .gguf file to write")
    c.add_argument("--format", default="f16", choices=FORMATS + tuple(MIXES),
                   help="format of the weight matrices; q4_k_m / q5_k_m are llama.cpp's Q4_K_M / Q5_K_M mixes")
    c.add_argument("--output-format", default=None, choices=FORMATS + tuple(MIXES),
                   help="format of the output (lm head) matrix (default: --format)")
    return p


def _serve_parser(s: argparse.ArgumentParser) -> None:
    import os

    s.add_argument("model", help="path to a .gguf file")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="TCP port")
    s.add_argument("--api-key", default=os.environ.get("LLMKERNELS_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every /v1 route (default: $LLMKERNELS_API_KEY; "
                        "none: open)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the file name without .gguf)")
    s.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja2 chat template replacing the GGUF's tokenizer.chat_template")
    s.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded together at most")
    s.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens computed per engine step")
    s.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + completion (default: the model's context length, at most 8192)")
    s.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting beyond --max-num-seqs before new ones get 503 with Retry-After")
    s.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8_e4m3", "fp8_e5m2"),
                   help="KV-cache storage: auto = the activation dtype; fp8 halves the cache")
    s.add_argument("--no-prefix-caching", action="store_true",
                   help="do not keep KV pages of finished requests for later prompts with the same prefix")
    s.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="processes (one per GPU) to split the model over; the server starts them")
    s.add_argument("--device", default=None, choices=("cuda", "cpu"),
                   help="where to run (default: cuda when a GPU is visible)")
    s.add_argument("--backend", default="auto", choices=("auto", "triton", "torch"),
                   help="triton: llmkernels' kernels; torch: a pure-torch forward (fast on the CPU); auto: triton on "
                        "a GPU, torch on the CPU")
    s.add_argument("--act-int8", action="store_true",
                   help="int8 activations at batch 1 for q4_0/q8_0/q4_k/q5_k/q6_k projections (faster decode)")
    s.add_argument("--megakernel", default="auto", choices=("auto", "on", "off"),
                   help="decode up to 8 sequences with one persistent kernel per step (sm_90; auto: where it is faster)")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of free GPU memory the KV cache may take, after the weights")
    s.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="server log level")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001  (the CLI's boundary: one line, not a traceback)
        if args.debug:
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"error: {type(e).__name__}: {msg}" if msg else f"error: {type(e).__name__}", file=sys.stderr)
        return 2


def _run(args) -> int:
    import llmkernels  # noqa: F401  (selects the interpreter before triton loads when there is no GPU)

    if args.cmd == "demo":
        from .demo import main as demo

        return demo()
    if args.cmd == "formats":
        from .quant.formats import format_table

        print(format_table())
        return 0
    if args.cmd == "info":
        from .info import info_lines, route_line

        print("\n".join(info_lines()))
        if args.route:
            fmt, *dims = args.route
            try:
                M, N, K = (int(v) for v in dims)
            except ValueError:
                raise ValueError(f"--route needs FORMAT M N K with integer M, N, K, got {args.route}") from None
            print(route_line(fmt, M, N, K, args.op, args.dtype, args.act_int8))
        return 0
    if args.cmd == "tune":
        from .tuning.tune import run

        return run(args)
    if args.cmd == "generate":
        return _generate(args)
    if args.cmd == "serve":
        return _serve(args)
    if args.cmd == "convert":
        import os

        from .engine.convert import convert_hf_to_gguf

        if not os.path.isdir(args.model_dir):
            raise FileNotFoundError(f"model_dir {args.model_dir!r} is not a folder")
        print(convert_hf_to_gguf(args.model_dir, args.out, args.format, output_format=args.output_format))
        return 0
    return 2


_MEGAKERNEL = {"auto": None, "on": True, "off": False}  # --megakernel -> LLM's megakernel


def _generate(args) -> int:
    import os
    import time

    import torch

    from .engine import LLM, SamplingParams

    if not os.path.isfile(args.model):
        raise FileNotFoundError(f"model {args.model!r} is not a file")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA GPU on this machine (use --device cpu)")
    if args.reasoning_effort and not args.chat:
        raise ValueError("--reasoning-effort is a chat template variable: it needs --chat")
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    llm = LLM(args.model, device=args.device, max_model_len=args.max_model_len, cuda_graphs=not args.no_cuda_graphs,
              max_num_seqs=max(1, len(args.prompt)), act_int8=args.act_int8, backend=args.backend,
              megakernel=_MEGAKERNEL[args.megakernel])
    t0 = time.perf_counter()
    if args.chat:
        effort = {"reasoning_effort": args.reasoning_effort} if args.reasoning_effort else None
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params, chat_template_kwargs=effort)
        for i, out in enumerate(outs):
            tag = f"[{i}] " if len(outs) > 1 else ""
            if out.reasoning_content:
                print(f"{tag}(reasoning) {out.reasoning_content}", file=sys.stderr)
            print(f"{tag}{out.text}")
    elif len(args.prompt) == 1:
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
        print(llm.describe(), file=sys.stderr)
    return 0


def _serve(args) -> int:
    import logging
    import os

    import torch

    from .server import serve

    if not os.path.isfile(args.model):
        raise FileNotFoundError(f"model {args.model!r} is not a file")
    if args.chat_template is not None and not os.path.isfile(args.chat_template):
        raise FileNotFoundError(f"--chat-template {args.chat_template!r} is not a file")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA GPU on this machine (use --device cpu)")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    serve(args.model, host=args.host, port=args.port, api_key=args.api_key, served_model_name=args.served_model_name,
          chat_template=args.chat_template, max_queue=args.max_queue, log_level=args.log_level, device=args.device,
          backend=args.backend, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
          max_model_len=args.max_model_len, kv_cache_dtype=args.kv_cache_dtype,
          enable_prefix_caching=not args.no_prefix_caching, tensor_parallel_size=args.tensor_parallel_size,
          act_int8=args.act_int8, gpu_memory_utilization=args.gpu_memory_utilization,
          megakernel=_MEGAKERNEL[args.megakernel])
    return 0


if __name__ == "__main__":
    sys.exit(main())
