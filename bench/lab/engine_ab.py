"""A/B of an engine switch read from the environment (LLMK_PDL, LLMK_I8NORM): batch decode tokens/s of the synthetic
Llama-3-8B, the variable set to 0 and 1 alternately, twice each, in one process.

    python bench/lab/engine_ab.py LLMK_I8NORM [formats, e.g. q4_k,q8_0+i8] [batches, e.g. 1,16]
    python bench/lab/engine_ab.py LLMK_L2PF=0,100000 ...   (other values than 0 and 1, alternating)
"""
import gc
import os
import sys

import torch

from llmkernels.bench.suites.engine import GEN, PROMPT, _decode_rate, llama3_8b_config, synthetic_model
from llmkernels.engine import LLM


def main():
    var, _, vals = sys.argv[1].partition("=")
    vals = vals.split(",") if vals else ["0", "1"]
    fmts = sys.argv[2].split(",") if len(sys.argv) > 2 else ["q4_k"]
    batches = [int(b) for b in sys.argv[3].split(",")] if len(sys.argv) > 3 else [1]
    for fmt in fmts:
        model = synthetic_model(fmt.replace("+i8", ""), llama3_8b_config())
        for value in vals * 2:
            os.environ[var] = value
            llm = LLM.from_model(model, max_num_seqs=max(batches), max_model_len=PROMPT + GEN + 16,
                                 num_pages=max(batches) * 48 + 8, act_int8=fmt.endswith("+i8"), progress=False)
            res = []
            for b in batches:
                _decode_rate(llm, b)  # warm-up at this batch size (graph capture)
                rate, _, _ = _decode_rate(llm, b)
                res.append(f"b{b} {rate:8.1f} tok/s ({1e3 * b / rate:.3f} ms/step)")
            print(f"{fmt:10s} {var}={value}: " + "; ".join(res), flush=True)
            del llm
            gc.collect()
            torch.cuda.empty_cache()
        del model
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
