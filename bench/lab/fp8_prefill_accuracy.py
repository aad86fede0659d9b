"""fp8 prefill's accuracy per option on the GPU test cases and one long row: the relative RMS error of o and the
LSE's largest and mean signed error against the float64 reference of the dequantized inputs, with the row sums on
the tensor cores off and on (``prefill_ws.FP8_ROWSUM``; the LSE comes from a second call, which sums in float32)
and the keys permuted or not (the table entry's PERM). A sum that drifts shows as a negative mean LSE error on
long rows.

    PYTHONPATH=. python bench/lab/fp8_prefill_accuracy.py
"""
import torch

import llmkernels as lk
from llmkernels.attention import prefill, prefill_ws
from llmkernels.testing import flash_attn_varlen_ref
from llmkernels.tuning import OVERRIDES
from tests.attention.test_prefill import make_fp8

CASES = [  # (q_lens, k_lens, Hq, Hkv, D, causal), table entry
    (([2003], None, 4, 1, 64, False), [256, 2]),
    (([1, 63, 64, 65, 127, 128, 129, 300, 1000], None, 8, 2, 128, True), [256, 2]),
    (([5, 200, 0, 130, 333], [300, 200, 7, 1000, 333], 8, 2, 256, True), [128, 2]),
    (([4096], None, 8, 8, 128, False), [256, 2]),
]


def main():
    prefill.WS_MIN_WORK = 0
    print(torch.cuda.get_device_name(), flush=True)
    for (q_lens, k_lens, Hq, Hkv, D, causal), config in CASES:
        key = ("prefill", f"float8_e4m3fn/{D}/{'causal' if causal else 'full'}/ws")
        torch.manual_seed(0)
        (q8, k8, v8), ds, (q, k, v), cq, ck, mq, mk = make_fp8(q_lens, k_lens, Hq, Hkv, D, "cuda", "heads")
        ro, rl = (t.double().cpu() for t in flash_attn_varlen_ref(q, k, v, cq, ck, causal=causal))
        kw = dict(causal=causal, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2])
        for rowsum, perm in ((False, 0), (True, 0), (False, 1), (True, 1)):
            prefill_ws.FP8_ROWSUM = rowsum
            OVERRIDES[key] = config[:4] + [0] * (4 - len(config)) + [perm]
            o = lk.flash_attn_varlen(q8, k8, v8, cq, ck, mq, mk, **kw).double().cpu()
            lse = lk.flash_attn_varlen(q8, k8, v8, cq, ck, mq, mk, return_lse=True, **kw)[1].double().cpu()
            ok = torch.isfinite(ro)
            rel = ((o - ro)[ok].pow(2).mean() / ro[ok].pow(2).mean()).sqrt().item()
            d = (lse - rl)[torch.isfinite(rl)]
            print(f"{str(q_lens)[:14]:14} D{D} {'causal' if causal else 'full'} {config}: rowsum {int(rowsum)} perm "
                  f"{perm}: o rel rms {rel:.4f}, lse max {d.abs().max():.4f} mean {d.mean():+.5f}", flush=True)
        OVERRIDES.pop(key, None)


if __name__ == "__main__":
    main()
