"""Quantized weights as data, GEMV over them, and GGUF files (runs on CPU too)."""
import os
import shutil
import tempfile

import torch

import llmkernels as lk

dev = "cuda" if torch.cuda.is_available() else "cpu"
N, K = (4096, 4096) if dev == "cuda" else (64, 512)

w = torch.randn(N, K) * 0.02
qt = lk.quantize(w, "q4_k").to(dev)              # GGUF blocks, byte for byte as llama.cpp writes them
qm = lk.quantize(w, "mlx", bits=4, group_size=64).to(dev)
print(qt.format, qt.shape, qt.data.shape, "rel. error",
      ((lk.dequantize(qt).cpu() - w).norm() / w.norm()).item())

x = torch.randn(1, K, dtype=torch.bfloat16, device=dev)
y = lk.gemv(x, qt)                               # [1, N]; any M, fastest for M <= 16
y8 = lk.gemv(x, qt, act_int8=True)               # activations rounded to int8 per block of 32, integer dots
ym = lk.gemv(x, qm)
ref = x.double() @ lk.dequantize(qt, dtype=torch.float64).to(dev).T
print("gemv rel. error", ((y.double() - ref).norm() / ref.norm()).item(),
      "act_int8", ((y8.double() - ref).norm() / ref.norm()).item())
g, u = torch.randn(2, 3, K, dtype=torch.bfloat16, device=dev)
h = lk.silu_mul_gemv(g, u, qt)                   # (silu(g) * u) @ W.T without forming the product
e = lk.embedding(torch.tensor([0, 5], device=dev), qt, dtype=torch.bfloat16)

tmp = tempfile.mkdtemp()
path = os.path.join(tmp, "weights.gguf")
lk.write_gguf(path, {"w": qt}, {"general.architecture": "llama"})   # GGUF files through the gguf package
tensors = lk.read_gguf(path)                     # {name: QuantizedTensor}, memory-mapped; .metadata
print(tensors["w"].format, torch.equal(tensors["w"].data, qt.data.cpu()))
del tensors
shutil.rmtree(tmp)
