"""The one-kernel decode step's weight streaming, measured alone: a persistent Gluon kernel (one program per SM)
runs a llama-shaped chain of batch-1 bf16 GEMVs (per layer QKV [6144, 4096], O [4096, 4096], gate/up [28672,
4096], down [4096, 14336]; each op's input the previous op's output, the down's input SiLU(gate) * up) with real
dependencies: a counter per op in global memory, released by every finished tile and polled (acquire) by the
programs that start the next op. A loader partition streams each program's weight tiles with TMA into a ring of
shared-memory slots in the program's tile order, across op boundaries (it never waits on a counter), so the next
op's first tiles are in flight while the compute warps wait for the op before to finish.

Beside it, in the same process: the same chain as cuBLAS GEMVs (torch.mv, SiLU-mul between) replayed from a CUDA
graph, and the read bandwidth. Every op's output is checked against float32 products of the kernel's own inputs.

    PYTHONPATH=. python bench/lab/megakernel_stream.py [--layers 32] [--rows 16] [--stages 16] [--warps 4,8]
                                                  [--modes 0,1,2] [--contig 0,1] [--contig-stages 32] [--xs 1,0]

``--xs 1``: each op's input staged in shared memory once per op (float32, GLU applied), the products' input chunks
then read from there, not from L2 through loop-carried registers.
"""
import argparse

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from llmkernels.megakernel.fast import ring_barriers

COLS = 256  # weight columns per ring slot: one unswizzled TMA box of [rows, 256] bf16
SUB = 8  # CONTIG: 256-wide pieces of a weight row per box
BK = gl.constexpr(COLS)
OPF = gl.constexpr(8)  # int32 fields per op: desc (0 A, 1 B), first row, rows, K, GLU input, tiles, 0, 0
HIDDEN, QKV, FFN = 4096, 6144, 14336  # (host side)
UP = gl.constexpr(FFN)


@gluon.jit
def _entry(LIST, i, n_my):
    """Tile i of this program's list: (op, first weight row in its stacked matrix, K, first output row); zeros
    past the list (loaded a tile ahead, so no tile waits on the chain list -> table)."""
    ok = i < n_my
    e = LIST + 4 * i
    return (gl.load(e, mask=ok, other=-1), gl.load(e + 1, mask=ok, other=0), gl.load(e + 2, mask=ok, other=0),
            gl.load(e + 3, mask=ok, other=0))


@gluon.jit
def _loader(desc_a, desc_b, w_smem, ready, empty, LIST, n_my, STAGES: gl.constexpr, ROWS: gl.constexpr,
            CONTIG: gl.constexpr):
    """The weight boxes of this program's tiles in order: [ROWS, 256] column blocks of the tile's rows, or with
    CONTIG [SUB, 256] boxes of the matrix viewed as [rows * K / 256, 256], i.e. each tile's bytes front to back."""
    SUB: gl.constexpr = desc_a.block_type.shape[0]
    c = 0
    _, row, K, _ = _entry(LIST, 0, n_my)
    for i in range(n_my):
        _, nrow, nK, _ = _entry(LIST, i + 1, n_my)
        if CONTIG:
            v0 = row * (K // BK)
            n = ROWS * (K // BK) // SUB
        else:
            v0 = row
            n = K // BK
        for j in range(n):
            s = c % STAGES
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), desc_a.block_type.nbytes)
            if CONTIG:
                at = [v0 + j * SUB, 0]
            else:
                at = [v0, j * BK]
            if K == UP:  # the down products' matrix
                tma.async_copy_global_to_shared(desc_b, at, ready.index(s), w_smem.index(s))
            else:
                tma.async_copy_global_to_shared(desc_a, at, ready.index(s), w_smem.index(s))
            c += 1
        row, K = nrow, nK


@gluon.jit
def _wait_op(OPS, CNT, ERR, op, SPIN):
    """Until every tile of op - 1 is released (acquire loads of its counter); a wait that never ends records
    which op in ERR and goes on (wrong results, no hang)."""
    need = gl.load(OPS + (op - 1) * OPF + 5)
    v = gl.atomic_add(CNT + op - 1, 0, sem="acquire")
    n = 0
    while (v < need) & (n < SPIN):
        v = gl.atomic_add(CNT + op - 1, 0, sem="acquire")
        n += 1
    if v < need:
        gl.atomic_max(ERR, op + 1)


@gluon.jit
def _release(CNT, op, nop, done):
    """A tile of ``op`` done here: one release per op and program (a release's fence costs microseconds under
    load), after its last tile (the next is of ``nop``) -> the tiles still to release."""
    done += 1
    if nop != op:
        gl.thread_barrier()  # every warp's stores come before the one-thread release
        gl.atomic_add(CNT + op, done, sem="release")
        done = 0
    return done


@gluon.jit
def _x_chunk(row, kc, K, glu, layout: gl.constexpr):
    """Columns [256 kc, 256 (kc + 1)) of an op's input, float32 (zero past K): its ACT row, or SiLU(first K) *
    (next K) of it (K = UP: only the down products take the GLU)."""
    offs = kc * BK + gl.arange(0, BK, layout=layout)
    m = gl.full([BK], 0, gl.int32, layout) + kc * BK < K  # whole chunks: one condition, so the loads vectorize
    a = gl.load(row + offs, mask=m, other=0.0).to(gl.float32)
    if glu != 0:
        u = gl.load(row + UP + offs, mask=m, other=0.0).to(gl.float32)
        a = a / (1.0 + gl.exp(-a)) * u
    return a


@gluon.jit
def _stage_x(x_smem, row, K, glu, layout: gl.constexpr):
    """The op's whole input, float32 (GLU applied), into x_smem ([64, 256], one 256-wide chunk per row) in pieces
    of 16 chunks: each piece's loads are issued together, so an op pays one L2 round trip per piece instead of one
    per product step."""
    X3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    xs = x_smem._reinterpret(gl.float32, [4, 16, BK], X3)
    r = gl.arange(0, 16, layout=gl.SliceLayout(1, layout))
    k = gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
    nk = K // BK
    gl.thread_barrier()  # every warp is past its reads of the op before
    for p in range(0, nk, 16):
        offs = (p + r)[:, None] * BK + k[None, :]
        m = (p + r < nk)[:, None] & (k < BK)[None, :]
        a = gl.load(row + offs, mask=m, other=0.0).to(gl.float32)
        if glu != 0:
            u = gl.load(row + UP + offs, mask=m, other=0.0).to(gl.float32)
            a = a / (1.0 + gl.exp(-a)) * u
        xs.index(p // 16).store(a)
    gl.thread_barrier()  # the whole input is in shared memory before any warp reads it


@gluon.jit
def _compute(w_smem, x_smem, ready, empty, LIST, n_my, OPS, ACT, CNT, ERR, act_stride, SPIN, ROWS: gl.constexpr,
             STAGES: gl.constexpr, MODE: gl.constexpr, XS: gl.constexpr):
    """MODE 0: the chain. 1: slots freed as they land, no products and no input loads (what the loader alone
    streams in this structure). 2: products without waiting on the counters (no op boundaries). XS: the op's
    input staged in shared memory once per op (_stage_x), not from L2 through loop-carried registers."""
    L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])  # [ROWS, 256]: warps by rows
    XK: gl.constexpr = gl.SliceLayout(0, L)
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, L))
    c = 0
    cur = -1
    done = 0  # tiles of op cur finished here and not yet released
    xrow = ACT
    x0 = gl.zeros([BK], gl.float32, XK)
    x1 = x0
    x2 = x0
    x3 = x0
    op, _, K, out0 = _entry(LIST, 0, n_my)
    for i in range(n_my):
        nop, _, nK, nout0 = _entry(LIST, i + 1, n_my)
        glu = (K == UP).to(gl.int32)
        if op != cur:
            if (op > 0) & (MODE == 0):  # every tile of the op before: its output is this op's input
                _wait_op(OPS, CNT, ERR, op, SPIN)
            xrow = ACT + op.to(gl.int64) * act_stride
            if XS:
                if MODE != 1:
                    _stage_x(x_smem, xrow, K, glu, L)
            else:
                # the input's 256-column chunks come from L2 four chunks ahead of their products, across the
                # op's tiles here (the last chunks of a tile prefetch the next tile's first)
                x0 = _x_chunk(xrow, 0, K, glu, XK)
                x1 = _x_chunk(xrow, 1, K, glu, XK)
                x2 = _x_chunk(xrow, 2, K, glu, XK)
                x3 = _x_chunk(xrow, 3, K, glu, XK)
            cur = op
        nk = K // BK  # even (K is 4096 or 14336): two slots per step, one barrier for both
        acc = gl.zeros([ROWS, BK], gl.float32, L)
        for kc in range(0, nk, 2):
            a4 = kc + 4
            a4 = gl.where(a4 >= nk, a4 - nk, a4)
            if (MODE == 1) | XS:
                x4 = x0
                x5 = x1
            else:
                x4 = _x_chunk(xrow, a4, K, glu, XK)
                x5 = _x_chunk(xrow, a4 + 1, K, glu, XK)
            if XS:  # ahead of the waits: they do not depend on the slots
                x0 = x_smem.index(kc).load(XK)
                x1 = x_smem.index(kc + 1).load(XK)
            s0 = c % STAGES
            s1 = (c + 1) % STAGES
            mbarrier.wait(ready.index(s0), (c // STAGES) & 1)
            mbarrier.wait(ready.index(s1), ((c + 1) // STAGES) & 1)
            if MODE == 1:
                mbarrier.arrive(empty.index(s0), count=1)
                mbarrier.arrive(empty.index(s1), count=1)
            else:
                w0 = w_smem.index(s0).load(L).to(gl.float32)
                w1 = w_smem.index(s1).load(L).to(gl.float32)
                gl.thread_barrier()  # every warp has its piece of both slots in registers
                mbarrier.arrive(empty.index(s0), count=1)
                mbarrier.arrive(empty.index(s1), count=1)
                acc += w0 * x0[None, :] + w1 * x1[None, :]
            if not XS:
                x0, x1, x2, x3 = x2, x3, x4, x5
            c += 2
        y = gl.sum(acc, axis=1)
        gl.store(ACT + (op + 1).to(gl.int64) * act_stride + out0 + rows, y.to(ACT.dtype.element_ty))
        done = _release(CNT, op, nop, done)
        op, K, out0 = nop, nK, nout0


@gluon.jit
def _x_block(row, q, glu, layout: gl.constexpr, SUB: gl.constexpr):
    """Rows [SUB q, SUB (q + 1)) of an op's input viewed as [K / 256, 256], float32 (see _x_chunk)."""
    r = gl.arange(0, SUB, layout=gl.SliceLayout(1, layout))
    k = gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
    offs = (q * SUB + r)[:, None] * BK + k[None, :]
    a = gl.load(row + offs).to(gl.float32)
    if glu != 0:
        u = gl.load(row + UP + offs).to(gl.float32)
        a = a / (1.0 + gl.exp(-a)) * u
    return a


@gluon.jit
def _compute_contig(w_smem, x_smem, ready, empty, LIST, n_my, OPS, ACT, CNT, ERR, act_stride, SPIN,
                    ROWS: gl.constexpr, STAGES: gl.constexpr, MODE: gl.constexpr, XS: gl.constexpr):
    """The products of CONTIG tiles: each slot is SUB 256-wide pieces of one weight row (K / 256 / SUB slots a
    row), its input pieces from L2 two slots ahead (XS: from shared memory, staged once per op); a row's dot is
    summed after its last slot. MODE as _compute."""
    SUB: gl.constexpr = w_smem.shape[1]
    L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])  # [SUB, 256]
    XB: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    xb = x_smem._reinterpret(gl.float32, [64 // SUB, SUB, BK], XB)
    c = 0
    cur = -1
    done = 0
    xrow = ACT
    x0 = gl.zeros([SUB, BK], gl.float32, L)
    x1 = x0
    op, _, K, out0 = _entry(LIST, 0, n_my)
    for i in range(n_my):
        nop, _, nK, nout0 = _entry(LIST, i + 1, n_my)
        glu = (K == UP).to(gl.int32)
        spr = K // BK // SUB  # slots per weight row
        if op != cur:
            if (op > 0) & (MODE == 0):  # every tile of the op before: its output is this op's input
                _wait_op(OPS, CNT, ERR, op, SPIN)
            xrow = ACT + op.to(gl.int64) * act_stride
            if XS:
                if MODE != 1:
                    _stage_x(x_smem, xrow, K, glu, L)
            else:
                x0 = _x_block(xrow, 0, glu, L, SUB)
                x1 = _x_block(xrow, 1 % spr, glu, L, SUB)
            cur = op
        acc = gl.zeros([SUB, BK], gl.float32, L)
        for j in range(ROWS * spr):
            if (MODE == 1) | XS:
                x2 = x0
            else:
                x2 = _x_block(xrow, (j + 2) % spr, glu, L, SUB)
            if XS:
                x0 = xb.index(j % spr).load(L)
            s = c % STAGES
            mbarrier.wait(ready.index(s), (c // STAGES) & 1)
            if MODE == 1:
                mbarrier.arrive(empty.index(s), count=1)
            else:
                w = w_smem.index(s).load(L).to(gl.float32)
                gl.thread_barrier()
                mbarrier.arrive(empty.index(s), count=1)
                acc += w * x0
            if j % spr == spr - 1:  # the row's last slot: its dot
                gl.store(ACT + (op + 1).to(gl.int64) * act_stride + out0 + j // spr,
                         gl.sum(gl.sum(acc, axis=1), axis=0).to(ACT.dtype.element_ty))
                acc = gl.zeros([SUB, BK], gl.float32, L)
            if not XS:
                x0, x1 = x1, x2
            c += 1
        done = _release(CNT, op, nop, done)
        op, K, out0 = nop, nK, nout0


@gluon.jit
def stream_kernel(desc_a, desc_b, LISTS, COUNTS, list_stride, OPS, ACT, CNT, ERR, act_stride, SPIN,
                  ROWS: gl.constexpr, STAGES: gl.constexpr, CW: gl.constexpr = 4, MODE: gl.constexpr = 0,
                  CONTIG: gl.constexpr = False, XS: gl.constexpr = False):
    """CW: the compute partition's warps (one per scheduler leaves every load's latency exposed); MODE: see
    _compute; CONTIG: the descriptors view each stacked matrix as [rows * K / 256, 256] and a tile streams front to
    back (_compute_contig); XS: each op's input staged in shared memory (64 KB of float32)."""
    pid = gl.program_id(0)
    LIST = LISTS + pid * list_stride
    n_my = gl.load(COUNTS + pid)
    w_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, desc_a.block_type.shape[0], BK], desc_a.layout)
    ready, empty = ring_barriers(STAGES)
    if XS:  # one 256-wide float32 chunk per row (the rank-1 layout is each row's)
        x_smem = gl.allocate_shared_memory(gl.float32, [64, BK], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    else:
        x_smem = w_smem
    if CONTIG:
        gl.warp_specialize([
            (_loader, (desc_a, desc_b, w_smem, ready, empty, LIST, n_my, STAGES, ROWS, CONTIG)),
            (_compute_contig, (w_smem, x_smem, ready, empty, LIST, n_my, OPS, ACT, CNT, ERR, act_stride, SPIN, ROWS,
                               STAGES, MODE, XS)),
        ], [CW], [232 if CW == 4 else 192])
    else:
        gl.warp_specialize([
            (_loader, (desc_a, desc_b, w_smem, ready, empty, LIST, n_my, STAGES, ROWS, CONTIG)),
            (_compute, (w_smem, x_smem, ready, empty, LIST, n_my, OPS, ACT, CNT, ERR, act_stride, SPIN, ROWS, STAGES,
                        MODE, XS)),
        ], [CW], [232 if CW == 4 else 192])


def layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)


def llama_ops(layers, per_a):
    """The chain's ops (matrix 0 or 1, first row in its stacked matrix, rows, K, GLU input): per layer QKV, O and
    gate/up in matrix 0 (per_a rows a layer), down in matrix 1."""
    ops = []
    for li in range(layers):
        a0 = li * per_a
        ops += [(0, a0, QKV, HIDDEN, 0), (0, a0 + QKV, HIDDEN, HIDDEN, 0), (0, a0 + QKV + HIDDEN, 2 * FFN, HIDDEN, 0),
                (1, li * HIDDEN, HIDDEN, FFN, 1)]
    return ops


def tile_lists(ops, rows, programs, device):
    """The op table (OPS: the tiles of each op, which its counter reaches) and each program's tile list in op order
    ((op, weight row, K, output row) per tile; tiles dealt round-robin, each op's first program rotated on)."""
    lists = [[] for _ in range(programs)]
    rot = 0
    table = []
    for o, (d, r0, n, k, glu) in enumerate(ops):
        tiles = n // rows
        for j in range(tiles):
            lists[(j + rot) % programs].append((o, r0 + j * rows, k, j * rows))
        rot = (rot + tiles) % programs
        table.append([d, r0, n, k, glu, tiles, 0, 0])
    width = max(len(x) for x in lists)
    lt = torch.zeros(programs, width, 4, dtype=torch.int32)
    for p, x in enumerate(lists):
        if x:
            lt[p, :len(x)] = torch.tensor(x, dtype=torch.int32)
    return (torch.tensor(table, dtype=torch.int32, device=device), lt.to(device),
            torch.tensor([len(x) for x in lists], dtype=torch.int32, device=device))


def build(layers, rows, programs, device="cuda"):
    """Stacked bf16 weights (A: QKV, O, gate/up per layer; B: down), the ops and their tile lists."""
    per_a = QKV + HIDDEN + 2 * FFN
    wa = torch.randn(layers * per_a, HIDDEN, device=device, dtype=torch.bfloat16) / HIDDEN ** 0.5
    wb = torch.randn(layers * HIDDEN, FFN, device=device, dtype=torch.bfloat16) / FFN ** 0.5
    ops = llama_ops(layers, per_a)
    return (wa, wb, ops) + tile_lists(ops, rows, programs, device)


def measure(name, run, err, ops, act, nbytes, bw, product, check=True):
    """Run a chain once (a launch that fails is reported: None), stop on a timed-out wait ("stop"), with ``check``
    compare every op (an int: the first ``check``) with ``product(matrix, first row, rows, x)`` of its own input x
    (GLU applied), then time it."""
    from llmkernels.bench.harness import time_graph_ms

    try:
        run()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - a lab: shared memory and the like, reported
        print(f"{name}: {type(e).__name__} {str(e)[:300]}", flush=True)
        return None
    if err.item():
        print(f"{name}: a wait timed out at op {err.item() - 1}", flush=True)
        return "stop"
    worst = float("nan")
    n_check = len(ops) if check is True else int(check)
    for o, (d, r0, n, k, glu) in enumerate(ops[:n_check]):
        x = act[o, :k].float()
        if glu:
            x = torch.nn.functional.silu(x) * act[o, k:2 * k].float()
        ref = product(d, r0, n, x)
        e = ((act[o + 1, :n].double() - ref).abs().max() / ref.abs().max()).item()
        worst = e if o == 0 else max(worst, e)
    ms = time_graph_ms([run], reps=5)
    print(f"{name}: {ms * 1e3:.1f} us per chain of {len(ops)} GEMVs, {nbytes / ms / 1e9:.3f} TB/s = "
          f"{100 * nbytes / ms / 1e9 / bw:.1f}% of read bandwidth; worst op error {worst:.1e} of its largest output",
          flush=True)
    return ms


def main():
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from llmkernels._runtime import num_sms
    from llmkernels.bench.harness import measure_read_bandwidth, time_graph_ms

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rows", default="16")
    ap.add_argument("--stages", default="16")
    ap.add_argument("--warps", default="4,8", help="the compute partition's warps")
    ap.add_argument("--modes", default="0,1,2", help="stream_kernel's MODE (1 and 2 are timed, not checked)")
    ap.add_argument("--contig", default="0,1", help="0: [rows, 256] column boxes; 1: tiles front to back")
    ap.add_argument("--contig-stages", default="32", help="ring slots (of [8, 256]) with --contig 1")
    ap.add_argument("--xs", default="1,0", help="1: each op's input staged in shared memory")
    args = ap.parse_args()
    bw = measure_read_bandwidth()
    P = num_sms()
    print(f"read bandwidth {bw:.3f} TB/s, {P} SMs", flush=True)
    for rows in [int(x) for x in args.rows.split(",")]:
        wa, wb, ops, table, lists, counts = build(args.layers, rows, P)
        nbytes = (wa.numel() + wb.numel()) * 2
        act_stride = 2 * FFN
        act = torch.zeros(len(ops) + 1, act_stride, device="cuda", dtype=torch.bfloat16)
        act[0, :HIDDEN] = torch.randn(HIDDEN, device="cuda")
        cnt = torch.zeros(len(ops), dtype=torch.int32, device="cuda")
        err = torch.zeros(1, dtype=torch.int32, device="cuda")
        descs = {0: (TensorDescriptor(wa, list(wa.shape), [HIDDEN, 1], [rows, COLS], layout()),
                     TensorDescriptor(wb, list(wb.shape), [FFN, 1], [rows, COLS], layout()))}
        va, vb = wa.view(-1, COLS), wb.view(-1, COLS)
        descs[1] = (TensorDescriptor(va, list(va.shape), [COLS, 1], [SUB, COLS], layout()),
                    TensorDescriptor(vb, list(vb.shape), [COLS, 1], [SUB, COLS], layout()))
        configs = [(ct, int(x), int(y), int(z), int(xs)) for xs in args.xs.split(",")
                   for ct in (int(v) for v in args.contig.split(","))
                   for x in (args.contig_stages if ct else args.stages).split(",")
                   for y in args.warps.split(",") for z in args.modes.split(",")]
        for contig, stages, cw, mode, xs in configs:
            if mode == 1 and xs and "0" in args.xs.split(","):
                continue  # MODE 1 reads no input: the same kernel either way
            da, db = descs[contig]
            name = (f"rows {rows} {'front to back' if contig else 'column boxes'} stages {stages} warps {cw} "
                    f"mode {mode} x {'smem' if xs else 'L2'}")

            def run():
                cnt.zero_()
                stream_kernel[(P,)](da, db, lists, counts, lists.stride(0), table, act, cnt, err, act_stride,
                                    1 << 20, ROWS=rows, STAGES=stages, CW=cw, MODE=mode, CONTIG=bool(contig),
                                    XS=bool(xs), num_warps=4)
            # every op against float32 products of the kernel's own input row
            if measure(name, run, err, ops, act, nbytes, bw,
                       lambda d, r0, n, x, w=(wa, wb): w[d][r0:r0 + n].float() @ x, check=mode == 0) == "stop":
                return
        # the anchor: the same chain as cuBLAS GEMVs, graph-replayed
        xs = [act[0, :HIDDEN].clone()]
        outs = [torch.empty(n, device="cuda", dtype=torch.bfloat16) for (_, _, n, _, _) in ops]
        views = [(wa if d == 0 else wb)[r0:r0 + n] for (d, r0, n, _, _) in ops]

        def chain():
            x = xs[0]
            for o, (d, r0, n, k, glu) in enumerate(ops):
                if glu:
                    x = torch.nn.functional.silu(x[:k]) * x[k:2 * k]
                else:
                    x = x[:k]
                torch.mv(views[o], x, out=outs[o])
                x = outs[o]
        ms = time_graph_ms([chain], reps=5)
        print(f"cuBLAS GEMVs (torch.mv) in a CUDA graph: {ms * 1e3:.1f} us, {100 * nbytes / ms / 1e9 / bw:.1f}% of "
              f"read bandwidth", flush=True)
        views.clear()
        del wa, wb
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
