"""A/B of tuned-table entries in the engine: decode tokens/s of a families-suite model (or the engine suite's
Llama-3-8B shape, ``llama3-8b``) with the shipped tables and with entries overridden, alternating in one process
(routes rebound and graphs recaptured per setting).

    PYTHONPATH=. python bench/lab/table_ab.py gemma2-9b '{"gemv": {"lanes/q4_k": [2, 1, 4, 3, 8, 1, 2]}}' [batch] [rounds]
"""
import json
import sys
import tempfile

import torch

from llmkernels.bench.harness import measure_read_bandwidth
from llmkernels.bench.suites.engine import _decode_rate
from llmkernels.bench.suites.families import _load, family_gguf
from llmkernels.bench.suites.llamacpp import synthetic_gguf
from llmkernels.tuning import OVERRIDES


def main():
    what = sys.argv[1]
    entries = json.loads(sys.argv[2])
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    bw = measure_read_bandwidth() * 1e12
    with tempfile.TemporaryDirectory() as tmp:
        llm = _load(synthetic_gguf(tmp) if what == "llama3-8b" else family_gguf(tmp, what), (batch,))
    bound = bw / llm.model.decode_bytes_per_token()
    print(f"{torch.cuda.get_device_name()} {what} batch {batch}: bound {bound:.0f} tokens/s at {bw / 1e12:.3f} TB/s",
          flush=True)
    for r in range(rounds):
        for name, over in (("shipped", {}), ("override", entries)):
            OVERRIDES.clear()
            for table, kv in over.items():
                for key, entry in kv.items():
                    OVERRIDES[(table, key)] = entry
            llm.model.bind_routes()
            llm.runner.release_graphs()
            llm.capture_graphs([batch])
            _decode_rate(llm, batch)
            rate = _decode_rate(llm, batch)[0]
            print(f"round {r} {name:8s}: {rate:8.1f} tokens/s ({100 * rate / bound:.1f}% of the bound)", flush=True)
    OVERRIDES.clear()


if __name__ == "__main__":
    main()
