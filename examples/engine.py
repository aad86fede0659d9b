"""The engine on a tiny random Llama checkpoint: convert to GGUF, generate, stream, score (runs on CPU too).

With a real model, skip the checkpoint: ``LLM("Llama-3.1-8B-Q4_K_M.gguf")``."""
import os
import shutil
import tempfile

from llmkernels.engine import LLM, SamplingParams, convert_hf_to_gguf
from llmkernels.testing.tiny_models import make_checkpoint   # needs transformers (the test extra)

tmp = tempfile.mkdtemp()
make_checkpoint(tmp, "llama", layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, vocab=384)
path = convert_hf_to_gguf(tmp, os.path.join(tmp, "model-q8_0.gguf"), "q8_0", progress=False)

llm = LLM(path, max_num_seqs=4, progress=False)          # weights stay in their GGUF formats
outs = llm.generate(["The quick brown fox", "Hello, world!"],
                    SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=6))
print(outs[0].text, outs[0].finish_reason)               # finish_reason: "stop" or "length"
for piece in llm.stream("Paged attention", SamplingParams(temperature=0, max_tokens=4)):
    print(piece, end="", flush=True)
scores = llm.logits("Some text")                         # float32 [tokens, vocab] next-token logits
print("\n", tuple(scores.shape))
out = llm.generate("The quick brown fox", SamplingParams(n=3, seed=2, max_tokens=6, logprobs=2, stop=["."]))[0]
print([c.text for c in out.outputs], out.outputs[0].logprobs[0])  # 3 completions sharing the prompt's KV pages
reply = llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(max_tokens=8))[0]   # the GGUF's chat template
print(reply.text, reply.num_cached_tokens)               # prompt tokens served from the prefix cache
shutil.rmtree(tmp)
