"""One synthetic Llama-3-8B-shaped model decoding several batches in turn, in one process (the engine bench's model).

    python bench/lab/engine_batches.py [q4_k|q8_0|bf16] [1,1,16,16,64,...]

For each batch size in the list: decode tokens/s after the prompts are prefilled, ms per step, graph replays and
preemptions. Shows what a first run at a batch size costs against later ones (the bench warms up each size).
"""
import sys

from llmkernels.bench.suites.engine import GEN, PROMPT, _decode_rate, llama3_8b_config, synthetic_model
from llmkernels.engine import LLM


def main():
    fmt = sys.argv[1] if len(sys.argv) > 1 else "q4_k"
    batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 1, 16, 16, 16, 64, 16]
    model = synthetic_model(fmt, llama3_8b_config())
    llm = LLM.from_model(model, max_num_seqs=64, max_model_len=PROMPT + GEN + 16, max_num_batched_tokens=2048)
    llm.capture_graphs([1, 16, 64])
    for batch in batches:
        g0, p0 = llm.stats.graph_steps, llm.scheduler.num_preemptions
        rate, wall, steps = _decode_rate(llm, batch)
        print(f"{fmt} batch {batch}: {rate:8.1f} tok/s, {1e3 * batch / rate:6.2f} ms/step, wall {wall:.2f} s, "
              f"steps {steps}, graph replays {llm.stats.graph_steps - g0}, preemptions "
              f"{llm.scheduler.num_preemptions - p0}", flush=True)


if __name__ == "__main__":
    main()
