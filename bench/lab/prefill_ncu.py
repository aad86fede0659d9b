"""One prefill-suite shape on the Gluon prefill kernel, eagerly, for Nsight Compute: where the loader and the two
consumers wait (fp8 D128 runs at about a third of its wgmma and exponential budgets; bench/NOTES.md). The fourth
call is the one to profile.

    PYTHONPATH=. ncu --clock-control none -k regex:flash_fwd_ws --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section SourceCounters -o rep \\
        python bench/lab/prefill_ncu.py fp8 4096 [CAUSAL [BLOCK_N STAGES OVERLAP PERSIST]]
    ncu --import rep.ncu-rep --page source --csv --print-source sass > sass.csv

dtype fp8 or bf16; 32 heads of 128, one sequence of S tokens; the table's config unless one is given.
"""
import sys

import torch

import llmkernels as lk
from llmkernels.attention import prefill
from llmkernels.bench.suites.prefill import dense_inputs
from llmkernels.tuning import OVERRIDES


def main():
    name, S = sys.argv[1], int(sys.argv[2])
    causal = len(sys.argv) > 3 and sys.argv[3] in ("1", "causal")
    dtype = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}[name]
    if len(sys.argv) > 4:
        key = f"{str(dtype).replace('torch.', '')}/128/{'causal' if causal else 'full'}/ws"
        OVERRIDES[("prefill", key)] = [int(x) for x in sys.argv[4:8]]
    print("config:", prefill.ws_config(dtype, 128, causal))
    q, k, v, cu = (t.to(dtype) if t.is_floating_point() else t for t in dense_inputs(1, 32, 32, S, 128))
    kw = {}
    if dtype != torch.bfloat16:
        ds = torch.ones(1, device="cuda")
        kw = {"q_descale": ds, "k_descale": ds, "v_descale": ds}
    for _ in range(5):
        lk.flash_attn_varlen(q, k, v, cu, cu, S, S, causal=causal, **kw)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
