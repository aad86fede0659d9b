"""The one-kernel decode step's schedule (llmkernels.megakernel) under its cost model: the estimated fraction of
the weight-bandwidth bound for Llama-3-8B shapes, by format and batch, and how it depends on the prefetch window
and the latency of a counter's signal. A design aid for the kernel, not a measurement.

    PYTHONPATH=. python bench/lab/megakernel_model.py
"""
from llmkernels.bench.suites.engine import llama3_8b_config
from llmkernels.megakernel import build_decode_program, describe, simulate

BW = 4.49e12  # the H200's measured read bandwidth


def main():
    cfg = llama3_8b_config()
    prog = build_decode_program(cfg, "q4_k_m", batch=1, context=512, bandwidth=BW)
    print(describe(prog, simulate(prog, bandwidth=BW)), flush=True)
    print("\nfraction of the bound: format, batch, context | prefetch (KB) x signal latency (us)")
    grid = [(p, lat) for p in (0, 32, 128, 200) for lat in (0.5, 1.0, 2.0)]
    print("                      " + " ".join(f"{p:>4}/{lat:<3}" for p, lat in grid))
    for fmt in ("q4_k_m", "q4_k", "q8_0", "bf16"):
        for batch, ctx in ((1, 512), (1, 8192), (8, 512)):
            fr = []
            for p, lat in grid:
                prog = build_decode_program(cfg, fmt, batch=batch, context=ctx, bandwidth=BW,
                                            prefetch_bytes=p << 10, signal_latency=lat * 1e-6)
                fr.append(simulate(prog, bandwidth=BW, prefetch_bytes=p << 10, signal_latency=lat * 1e-6)["fraction"])
            print(f"{fmt:>7} B{batch} L{ctx:<5}   " + " ".join(f"{100 * f:8.1f}" for f in fr), flush=True)


if __name__ == "__main__":
    main()
