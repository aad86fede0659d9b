import sys, torch
from llmkernels.attention import flash_attn_varlen
S = int(sys.argv[1]); causal = sys.argv[2] == "1"
q, k, v = (torch.randn(S, 32, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
cu = torch.tensor([0, S], dtype=torch.int32, device="cuda")
for _ in range(3):
    flash_attn_varlen(q, k, v, cu, cu, S, S, causal=causal)
torch.cuda.synchronize()
