"""Record which kernel launcher (with its config and flags) every public GEMV entry point reaches, over a grid of
formats, shapes, M and activation dtypes, without running a kernel: each launcher is replaced by a recorder. Run it
at two commits and compare the files to show that a change of the routing code changed no route.

    python bench/lab/route_record.py gpu routes.json      # as an sm_90 GPU named "NVIDIA H200" (table configs, TMA)
    python bench/lab/route_record.py interp routes.json   # as the interpreter (its small fixed tiles)
    python bench/lab/route_record.py compare a.json b.json

CPU only; the launchers' names (m1.launch_m1, tc.launch_tc, int8.launch_i8 / launch_i8_lanes, the planes and
generic kernels, ops._launch_embedding) are what it hooks.
"""
import itertools
import json
import sys

import torch

if sys.argv[1] == "compare":
    a, b = (json.load(open(p)) for p in sys.argv[2:4])
    strip = lambda v: [x for x in v if x[0] != "error"]  # noqa: E731  (the fake outputs do not reshape)
    diff = [k for k in a if strip(a[k]) != strip(b.get(k, []))]
    print(f"{len(a)} calls, {len(diff)} with another route")
    for k in diff[:20]:
        print(k, a[k], b.get(k))
    sys.exit(1 if diff else 0)
import llmkernels as lk  # noqa: E402
from llmkernels.qgemv import int8, kernels, m1, ops, planes, tc  # noqa: E402
from llmkernels.quant.tensor import QuantizedTensor  # noqa: E402

MODS = [ops, m1, tc, int8]
try:
    from llmkernels.qgemv import route

    MODS.append(route)
except ImportError:  # before the routing table existed
    pass
INTERP = sys.argv[1] == "interp"
for mod in MODS:  # the target: a GPU's tables and TMA, or the interpreter
    for name, fn in (("interpreter_mode", lambda: INTERP), ("num_sms", lambda device=None: 132),
                     ("pdl_supported", lambda device=None: False), ("has_tma", lambda device=None: not INTERP)):
        if hasattr(mod, name):
            setattr(mod, name, fn)
    if hasattr(mod, "gpu_name") and not INTERP:
        mod.gpu_name = lambda device=None: "NVIDIA H200"
    if hasattr(mod, "_finish"):
        mod._finish = lambda y, dtype: y
REC = []
KWARGS = ("NB", "BLOCK_N", "num_warps", "num_stages", "SILU_X", "DUAL", "M_PAD")
FLAGS = ("up", "x_perm", "xt", "x2", "unpack", "fmt")


class FakeKernel:
    """Stands in for a @triton.jit kernel: kernel[grid](...) records its constexprs."""

    def __init__(self, name):
        self.name = name

    def __getitem__(self, grid):
        return lambda *a, **kw: REC.append((self.name, {k: v for k, v in kw.items() if k in KWARGS}))


def fake_launcher(name, n_arg):
    """Stands in for a launcher: records its config (the first tuple argument) and flags, returns zeros [M, N]."""
    def launch(*a, **kw):
        cfg = [v for v in a if isinstance(v, tuple)]
        flags = {k: (v if isinstance(v, (int, bool, str)) else v is not None) for k, v in kw.items() if k in FLAGS}
        REC.append((name, {"config": cfg[0] if cfg else None, **flags}))
        return torch.zeros(a[0].shape[0], a[n_arg])
    return launch


planes.gemv_planes_kernel = FakeKernel("planes")
kernels.gemv_kernel = FakeKernel("generic")
m1.launch_m1 = fake_launcher("m1", 3)
tc.launch_tc = fake_launcher("tc", 2)
int8.launch_i8 = fake_launcher("i8", 4)
int8.launch_i8_lanes = fake_launcher("i8_lanes", 3)
m1.lane_order = lambda x, *a, **k: x
tc.tc_order = lambda x, fmt: x
int8.quantize_act = lambda x, x2=None, lanes=False: (x, x)


def _dequant(ids, data, scales, biases, fmt, N, K, bits, gs, dtype):
    REC.append(("dequant", {}))
    return torch.zeros(N, K, dtype=dtype)


ops._launch_embedding = _dequant


def weights(fmt, N, K, bits=0, gs=0):
    """A QuantizedTensor of shape [N, K] (zeros: routes do not read values)."""
    one = lk.quantize(torch.randn(1, K), fmt, **({"bits": bits, "group_size": gs} if fmt == "mlx" else {}))
    like = lambda t: torch.zeros(N, *t.shape[1:], dtype=t.dtype) if t is not None else None  # noqa: E731
    return QuantizedTensor(one.format, (N, K), like(one.data), like(one.scales), like(one.biases), one.bits,
                           one.group_size)


FMTS = [(f, 0, 0) for f in ("f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k",
                            "q5_k", "q6_k")] + [("mlx", 4, 32), ("mlx", 4, 64), ("mlx", 4, 128), ("mlx", 8, 64),
                                                ("mlx", 3, 64), ("mlx", 2, 64)]
SHAPES = [(64, 512), (4096, 4096), (4096, 14336), (33000, 2048), (256, 2304)]
MS = [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65]
OPS = {
    "gemv": lambda x, qt: ops.gemv(x, qt),
    "gemv_i8": lambda x, qt: ops.gemv(x, qt, act_int8=True),
    "silu": lambda x, qt: ops.silu_mul_gemv(x, x.clone(), qt),
    "silu_i8": lambda x, qt: ops.silu_mul_gemv(x, x.clone(), qt, act_int8=True),
    "gate_up": lambda x, qt: ops.gate_up_silu(x, qt, qt),
    "lanes": lambda x, qt: ops.gemv_lanes(x, torch.zeros(x.shape[0], m1.lanes_width(x.shape[1]), dtype=x.dtype),
                                          qt),
}
out = {}
for (fmt, bits, gs), (N, K) in itertools.product(FMTS, SHAPES):
    if (fmt == "mlx" and K % gs) or (fmt in ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k") and K % 256):
        continue
    qt = weights(fmt, N, K, bits, gs)
    for M, dt in itertools.product(MS, [torch.float16, torch.bfloat16, torch.float32]):
        x = torch.zeros(M, K, dtype=dt)
        for op, call in OPS.items():
            REC.clear()
            try:
                call(x, qt)
                r = [list(t) for t in REC] or [["cublas", {}]]
            except Exception as e:  # noqa: BLE001  (the fake outputs need not reshape: what was launched counts)
                r = [list(t) for t in REC] + [["error", type(e).__name__ + str(e)[:80]]]
            out[f"{fmt}{bits or ''}g{gs}/{N}x{K}/M{M}/{str(dt)[6:]}/{op}"] = r
json.dump(out, open(sys.argv[2], "w"), indent=0, sort_keys=True, default=str)
print(len(out), "calls recorded")
