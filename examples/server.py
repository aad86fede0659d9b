"""The OpenAI-compatible server on a tiny random Llama checkpoint, called with the official ``openai`` client and with
plain HTTP (runs on CPU too). From a shell the same server is ``python -m llmkernels serve model.gguf --port 8000``.
"""
import os
import shutil
import socket
import tempfile
import threading
import time

import httpx
import uvicorn
from openai import OpenAI

from llmkernels.engine import LLM, convert_hf_to_gguf
from llmkernels.server import build_app
from llmkernels.testing.tiny_models import make_checkpoint   # needs transformers (the test extra)

tmp = tempfile.mkdtemp()
make_checkpoint(tmp, "llama", layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, vocab=384)
path = convert_hf_to_gguf(tmp, os.path.join(tmp, "model-q8_0.gguf"), "q8_0", progress=False)

# what `python -m llmkernels serve PATH --api-key sk-local --served-model-name model` runs, on a free port
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
url = f"http://127.0.0.1:{sock.getsockname()[1]}"
app = build_app(LLM(path, max_model_len=256, progress=False), model_name="model", api_key="sk-local")
server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
while not server.started:
    time.sleep(0.05)

client = OpenAI(base_url=f"{url}/v1", api_key="sk-local")       # url = "http://127.0.0.1:8000"
messages = [{"role": "user", "content": "Hello!"}]
r = client.chat.completions.create(model="model", messages=messages, max_tokens=16)
print(r.choices[0].message.content, r.usage.prompt_tokens, r.usage.completion_tokens)
for chunk in client.completions.create(model="model", prompt="The quick brown fox", max_tokens=16, stream=True):
    print(chunk.choices[0].text, end="", flush=True)
r = client.completions.create(model="model", prompt="Paged attention", max_tokens=4, n=2, seed=1, logprobs=2,
                              stop=["\n"])
print([c.text for c in r.choices], r.choices[0].logprobs.top_logprobs[0])
print(httpx.get(f"{url}/metrics").text.count("llmkernels_"), "metric lines")   # Prometheus text

server.should_exit = True
shutil.rmtree(tmp)
