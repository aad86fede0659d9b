"""A/B in the engine: the tensor-core GEMV kernel's split-K partials summed in the kernel (fixup, the default) or by a
second launch, at batch 1, where the lab measured the second launch faster on the q6_k downs and V
(`bench/lab/q6k_blocks_lab.py --routed`). Decode tokens/s of a model, the two settings alternating, twice each, in one
process (the engine re-captures its graphs per LLM).

    PYTHONPATH=. python bench/lab/splitk_ab.py [q4_k_m | gemma2-9b | qwen3-30b-a3b ...] [batches, e.g. 1,4]
"""
import gc
import sys
import tempfile

import torch

from llmkernels.bench.suites.engine import _decode_rate, llama3_8b_config, synthetic_model
from llmkernels.bench.suites.families import FAMILIES, _load, family_gguf
from llmkernels.engine import LLM
from llmkernels.qgemv import tc

REAL = tc.launch_tc


def _second_launch(x, *a, **kw):
    """launch_tc with its partials left for ops._finish's sum kernel at M = 1."""
    if x.shape[0] == 1 and kw.get("xt") is None:
        kw["fixup"] = False
    return REAL(x, *a, **kw)


def _engine(what: str, batch: int, tmp: str):
    if what in FAMILIES:
        return _load(family_gguf(tmp, what), (batch,))
    return LLM.from_model(synthetic_model(what, llama3_8b_config()), max_num_seqs=batch, max_model_len=1024,
                          progress=False)


def main():
    whats = sys.argv[1].split(",") if len(sys.argv) > 1 else ["q4_k_m"]
    batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1]
    with tempfile.TemporaryDirectory() as tmp:
        for what in whats:
            for b in batches:
                for mode in ("in the kernel", "second launch") * 2:
                    tc.launch_tc = REAL if mode == "in the kernel" else _second_launch
                    llm = _engine(what, b, tmp)
                    _decode_rate(llm, b)  # warm-up (graph capture)
                    rate, _, _ = _decode_rate(llm, b)
                    print(f"{what} batch {b}, split-K sums {mode}: {rate:8.1f} tokens/s ({1e3 * b / rate:.3f} ms "
                          f"per step)", flush=True)
                    del llm
                    gc.collect()
                    torch.cuda.empty_cache()
    tc.launch_tc = REAL


if __name__ == "__main__":
    main()
