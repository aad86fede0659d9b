"""Timing, roofline measurements and the results file for ``python -m llmkernels.bench``.

Times are medians of CUDA-event timings after warm-up (``triton.testing.do_bench``, which also flushes L2 between
runs so memory-bound kernels are timed from HBM). The GPU's own ceilings (read bandwidth, copy bandwidth, bf16
matmul rate) are measured in the same run, so ratios never lean on datasheet numbers.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path

import torch


@dataclasses.dataclass
class Row:
    suite: str
    case: str
    metric: str  # "TB/s" | "TFLOP/s" | "tokens/s" | "us/step" (lower is better)
    value: float | None
    roofline_pct: float | None = None
    anchors: dict = dataclasses.field(default_factory=dict)
    time_ratio: dict = dataclasses.field(default_factory=dict)  # anchor time / our time (> 1: we are faster)
    note: str = ""


def time_ms(fn, *, warmup_ms: float = 25, rep_ms: float = 100, cuda_graph: bool = False) -> float:
    """Median milliseconds per call of ``fn`` (CUDA events; L2 flushed between calls unless cuda_graph)."""
    import triton.testing

    if cuda_graph:  # captured on the stream that ran fn first (time_graph_ms), where the per-stream counters of
        # split-K sums and claimed prefill tiles exist; a capture on a fresh stream takes the paths without them
        est = time_graph_ms([fn], reps=3, trials=1)
        return time_graph_ms([fn], reps=max(3, min(1000, int(rep_ms / 5 / max(est, 1e-3)))), trials=5)
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


L2_FLUSH_BYTES = 256 << 20  # rotate inputs over at least this much, several times the 50-60 MB L2 of H100/H200


def copies_for(nbytes: int, most: int = 16) -> int:
    """How many input copies a graph-timed case needs so that its working set overflows L2."""
    return max(1, min(most, -(-L2_FLUSH_BYTES // max(1, nbytes))))


def time_graph_ms(fns, *, reps: int = 20, trials: int = 5) -> float:
    """Median ms per call of the callables ``fns`` (each run once per replay), through a captured CUDA graph.

    Graph replay removes host launch overhead (as an engine's captured decode step does); rotating over ``fns``,
    which should touch different copies of the inputs, keeps the data out of L2.
    """
    fns = list(fns)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    # captured on the warm-up stream, as an engine captures its steps: the per-stream split-K / split-KV arrival
    # counters (_runtime.split_counters) exist there, so the kernels merge their own partials as they do in use
    with torch.cuda.graph(g, stream=s):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (reps * len(fns)))
    times.sort()
    return times[len(times) // 2]


def _read_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def read_sum(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        # Each program reads ITERS contiguous blocks with 16-byte vector loads and keeps one partial sum,
        # so the only traffic is the read itself.
        pid = tl.program_id(0)
        base = pid.to(tl.int64) * BLOCK * ITERS
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(ITERS):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))

    return read_sum


def measure_read_bandwidth(nbytes: int = 2 << 30) -> float:
    """TB/s of a streaming read of ``nbytes`` (best of a few block shapes and torch.sum)."""
    import triton

    x = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    n = x.numel()
    kernel = _read_kernel()
    best = float("inf")
    for block, iters, warps in ((2048, 8, 8), (4096, 4, 8), (1024, 16, 4)):
        grid = triton.cdiv(n, block * iters)
        out = torch.empty(grid, device="cuda", dtype=torch.float32)
        best = min(best, time_ms(lambda: kernel[(grid,)](x, out, n, BLOCK=block, ITERS=iters, num_warps=warps)))
    best = min(best, time_ms(lambda: x.sum(dtype=torch.float32)))
    return nbytes / (best * 1e-3) / 1e12


def measure_copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """TB/s of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e12


def measure_matmul_tflops(n: int = 8192) -> float:
    """bf16 TFLOP/s of an n x n x n product on random data through cuBLAS."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, rep_ms=300)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


@dataclasses.dataclass
class Context:
    """What every suite needs: the measured ceilings and the options of this run."""
    read_bw_TBps: float
    copy_bw_TBps: float
    matmul_TFLOPs: float
    quick: bool = False
    llama_cpp: str | None = None  # folder of a llama.cpp build (llama-bench, llama-batched-bench, llama-server)
    case_filter: str | None = None  # ``-k TEXT``: only the cases named with TEXT ran (the file updates some rows)

    def bw_pct(self, tbps: float | None) -> float | None:
        return None if tbps is None else 100.0 * tbps / self.read_bw_TBps


def git_commit() -> str:
    if os.environ.get("LLMK_COMMIT"):
        return os.environ["LLMK_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], stderr=subprocess.DEVNULL,
                                       cwd=Path(__file__).parent).decode().strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def tree_changed() -> bool:
    """Whether the tracked files differ from the commit git_commit names (a run of uncommitted code)."""
    if os.environ.get("LLMK_COMMIT"):
        return False
    try:
        out = subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"],
                                      stderr=subprocess.DEVNULL, cwd=Path(__file__).parent)
    except (OSError, subprocess.CalledProcessError):
        return False
    return bool(out.strip())


def write_results(rows: list[Row], ctx: Context, out_dir: str | Path, suites: list[str], path: Path | None = None
                  ) -> Path:
    """Write the results file (a new name from the time and suites, or ``path``: the same file rewritten as a run
    goes on, so a run stopped midway keeps the rows it measured)."""
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    doc = {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": git_commit(),
        **({"tree_changed": True} if tree_changed() else {}),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "read_bandwidth_TBps": round(ctx.read_bw_TBps, 4),
        "copy_bandwidth_TBps": round(ctx.copy_bw_TBps, 4),
        "bf16_matmul_TFLOPs": round(ctx.matmul_TFLOPs, 2),
        **({"case_filter": ctx.case_filter} if ctx.case_filter else {}),
        "rows": [{k: v for k, v in dataclasses.asdict(r).items() if k not in ("note", "time_ratio") or v}
                 for r in rows],
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    slug = gpu.replace("NVIDIA ", "").replace(" ", "-").lower()
    path = path or out_dir / f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{slug}-{'-'.join(suites)}.json"
    path.write_text(json.dumps(doc, indent=1))
    return path


def speedup(metric: str, ours: float, anchor: float) -> float:
    """How many times better ours is than the anchor: a rate over the anchor's, or for a time the anchor's over ours."""
    return anchor / ours if metric.startswith("us") else ours / anchor


def format_table(rows: list[Row]) -> str:
    """One table per suite: figure, each anchor's figure, ratio to it, percent of roofline."""
    out = []
    for suite in dict.fromkeys(r.suite for r in rows):
        srows = [r for r in rows if r.suite == suite]
        names = list(dict.fromkeys(a for r in srows for a in r.anchors))
        head = f"{'case':<46} {'metric':>7} {'ours':>9} {'%roof':>6}" + "".join(
            f" {n[:14]:>14} {'ratio':>6}" for n in names)
        out += [f"== {suite}", head, "-" * len(head)]
        for r in srows:
            val = "-" if r.value is None else f"{r.value:9.3f}"
            pct = "-" if r.roofline_pct is None else f"{r.roofline_pct:6.1f}"
            line = f"{r.case[:46]:<46} {r.metric:>7} {val:>9} {pct:>6}"
            for n in names:
                a = r.anchors.get(n)
                if a is None:
                    line += f" {'-':>14} {'-':>6}"
                else:
                    ratio = "-" if (r.value is None or not a) else f"{speedup(r.metric, r.value, a):6.2f}"
                    line += f" {a:14.3f} {ratio:>6}"
            if r.note:
                line += f"  # {r.note}"
            out.append(line)
        out.append("")
    return "\n".join(out)


def plot(results_path: str | Path, png_path: str | Path | None = None) -> Path:
    """Bar chart of a results file: our figure beside each anchor's, one panel per suite."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(Path(results_path).read_text())
    rows = doc["rows"]
    suites = list(dict.fromkeys(r["suite"] for r in rows))
    fig, axes = plt.subplots(len(suites), 1, figsize=(14, 4 * len(suites)), squeeze=False)
    for ax, suite in zip(axes[:, 0], suites):
        srows = [r for r in rows if r["suite"] == suite]
        names = ["ours"] + list(dict.fromkeys(a for r in srows for a in r["anchors"]))
        width = 0.8 / len(names)
        for j, name in enumerate(names):
            vals = [(r["value"] if name == "ours" else r["anchors"].get(name)) or 0.0 for r in srows]
            ax.bar([i + j * width for i in range(len(srows))], vals, width, label=name)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(srows))])
        ax.set_xticklabels([r["case"] for r in srows], rotation=60, ha="right", fontsize=7)
        ax.set_ylabel(srows[0]["metric"])
        ax.set_title(f"{suite} on {doc['gpu']} (read bw {doc['read_bandwidth_TBps']:.2f} TB/s)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    png_path = Path(png_path or Path(results_path).with_suffix(".png"))
    fig.savefig(png_path, dpi=110)
    return png_path
