"""megakernel_stream.py's chain (32 llama-8B-shaped layers of batch-1 GEMVs, a counter per op, a TMA loader running
across op boundaries) on q4_k weights with int8 activations, the arithmetic of the engine's act_int8 path: what the
one-kernel step's weight streaming reaches on the format its batch-1 target is set on.

Weights: the GGUF q4_k blocks as stored (``--layouts gguf``: each matrix seen by TMA as [N, blocks, 144] bytes, a
ring slot one [16, 2, 128] box of two super-blocks' code bytes of 16 rows and the [16, 2, 16] box of their headers:
d, dmin, the 12 bytes of 6-bit scales and mins), or split into two planes (``planes``: codes [N, K / 2], headers [N,
K / 16], slots of [16, 256] and [16, 32] boxes), the same bytes in all. Activations:
every program rounds the op's whole input to int8 per block of 32 (d = absmax / 127, s = d * sum q, as
qgemv.int8.quantize_act) into shared memory once per op, GLU applied first for the down products. Products: a
thread takes one 64-weight chunk (sub-blocks 2c and 2c + 1) of one row and super-block: its 8 code words masked to
low and high nibbles, 16 dp4a against the chunk's int8 words, then d * sc * dx * dot - dmin * mn * s per sub-block.

Every op's output is checked against dequantize(W) @ x' in float64, x' the int8 rounding of the kernel's own
input, and the same arithmetic is checked on the CPU (``--emulate``: the planes, the scale decoding and the
integer dots in torch, against gguf_codec's dequantization).

    PYTHONPATH=. python bench/lab/megakernel_stream_q4k.py [--layers 32] [--stages 16,24] [--warps 4,8] [--modes 0,1,2]
                                                           [--layouts gguf,planes]
                                                           [--configs "8,1,0,16;16,2,1,16"]  # warps,tpc,part,stages
    PYTHONPATH=. python bench/lab/megakernel_stream_q4k.py --emulate       # CPU
"""
import argparse
import itertools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from llmkernels.megakernel.fast import ring_barriers
from llmkernels.megakernel.q4k import int8_input_smem, q4k_copy, q4k_descriptors, q4k_step, stage_q
from megakernel_stream import FFN, HIDDEN, QKV, UP, _entry, _release, _wait_op, llama_ops, measure, tile_lists

ROWS_PER_WARP = 4  # a tile has 4 rows per compute warp over threads per chunk (the thread layout L4 below)


@gluon.jit
def _loader(dc_a, dc_b, dh_a, dh_b, c_smem, h_smem, ready, empty, LIST, n_my, STAGES: gl.constexpr,
            GGUF: gl.constexpr):
    """Each tile's slots in order (q4k_copy)."""
    c = 0
    _, row, K, _ = _entry(LIST, 0, n_my)
    for i in range(n_my):
        _, nrow, nK, _ = _entry(LIST, i + 1, n_my)
        for j in range(K // 512):
            s = c % STAGES
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), dc_a.block_type.nbytes + dh_a.block_type.nbytes)
            if K == UP:  # the down products' matrix
                q4k_copy(dc_b, dh_b, row, j, ready.index(s), c_smem.index(s), h_smem.index(s), GGUF)
            else:
                q4k_copy(dc_a, dh_a, row, j, ready.index(s), c_smem.index(s), h_smem.index(s), GGUF)
            c += 1
        row, K = nrow, nK


@gluon.jit
def _compute(c_smem, h_smem, xq_smem, xd_smem, ready, empty, LIST, n_my, OPS, ACT, CNT, ERR, act_stride, SPIN,
             STAGES: gl.constexpr, MODE: gl.constexpr, STEP: gl.constexpr, DOT: gl.constexpr,
             TPC: gl.constexpr = 1):
    """MODE 0: the chain; 1: slots freed as they land (the loader alone); 2: products without the counters.
    STEP: slots per barrier (K / 512 a multiple); DOT: _slot_dot's; TPC: threads per chunk."""
    # TPC threads per 64-weight chunk (8 // TPC code words each): a slot has 4 * warps // TPC rows
    W: gl.constexpr = gl.num_warps()
    if TPC == 1:
        L4: gl.constexpr = gl.BlockedLayout([1, 1, 1, 8], [4, 2, 4, 1], [W, 1, 1, 1], [3, 2, 1, 0])
    elif TPC == 2:
        L4: gl.constexpr = gl.BlockedLayout([1, 1, 1, 4], [4, 1, 4, 2], [W // 2, 2, 1, 1], [3, 2, 1, 0])
    else:
        L4: gl.constexpr = gl.BlockedLayout([1, 1, 1, 2], [4, 1, 2, 4], [W // 4, 2, 2, 1], [3, 2, 1, 0])
    R1: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L4)))
    ROWS: gl.constexpr = c_smem.shape[1]
    rows = gl.arange(0, ROWS, layout=R1)
    c = 0
    cur = -1
    done = 0
    op, _, K, out0 = _entry(LIST, 0, n_my)
    for i in range(n_my):
        nop, _, nK, nout0 = _entry(LIST, i + 1, n_my)
        glu = (K == UP).to(gl.int32)
        if op != cur:
            if (op > 0) & (MODE == 0):
                _wait_op(OPS, CNT, ERR, op, SPIN)
            if MODE != 1:
                stage_q(xq_smem, xd_smem, ACT + op.to(gl.int64) * act_stride, ACT, K, 0.0, glu * UP, False)
            cur = op
        acc = gl.zeros([ROWS, 2, 4, 1], gl.float32, L4)
        for kp in range(0, K // 512, STEP):  # STEP slots per step, one barrier for all
            acc, c = q4k_step(c_smem, h_smem, xq_smem, xd_smem, ready, empty, c, kp, acc, L4, STAGES, STEP, DOT,
                              MODE != 1)
        y = gl.sum(gl.sum(gl.sum(acc, axis=3), axis=2), axis=1)
        gl.store(ACT + (op + 1).to(gl.int64) * act_stride + out0 + rows, y.to(ACT.dtype.element_ty))
        done = _release(CNT, op, nop, done)
        op, K, out0 = nop, nK, nout0


@gluon.jit
def stream_q4k_kernel(dc_a, dc_b, dh_a, dh_b, LISTS, COUNTS, list_stride, OPS, ACT, CNT, ERR, act_stride, SPIN,
                      STAGES: gl.constexpr, CW: gl.constexpr = 4, MODE: gl.constexpr = 0,
                      GGUF: gl.constexpr = False, STEP: gl.constexpr = 2, DOT: gl.constexpr = 0,
                      TPC: gl.constexpr = 1, PART: gl.constexpr = 0, LW: gl.constexpr = 1,
                      LREGS: gl.constexpr = 40):
    """PART 0: the loader is the default partition (launch with num_warps=4) and the products a worker of CW
    warps; PART 1: the products are the default partition (launch with num_warps=CW) and the loader a worker of
    LW warps capped at LREGS registers, so the products may take more warps than a worker's register budget
    allows."""
    pid = gl.program_id(0)
    LIST = LISTS + pid * list_stride
    n_my = gl.load(COUNTS + pid)
    ROWS: gl.constexpr = dc_a.block_type.shape[0]  # 4 * CW
    if GGUF:
        c_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, ROWS, 2, 128], dc_a.layout)
        h_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, ROWS, 2, 16], dh_a.layout)
    else:
        c_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, ROWS, 256], dc_a.layout)
        h_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, ROWS, 32], dh_a.layout)
    xq_smem, xd_smem = int8_input_smem()
    ready, empty = ring_barriers(STAGES)
    if PART == 0:
        gl.warp_specialize([
            (_loader, (dc_a, dc_b, dh_a, dh_b, c_smem, h_smem, ready, empty, LIST, n_my, STAGES, GGUF)),
            (_compute, (c_smem, h_smem, xq_smem, xd_smem, ready, empty, LIST, n_my, OPS, ACT, CNT, ERR, act_stride,
                        SPIN, STAGES, MODE, STEP, DOT, TPC)),
        ], [CW], [232 if CW == 4 else 192])
    else:
        gl.warp_specialize([
            (_compute, (c_smem, h_smem, xq_smem, xd_smem, ready, empty, LIST, n_my, OPS, ACT, CNT, ERR, act_stride,
                        SPIN, STAGES, MODE, STEP, DOT, TPC)),
            (_loader, (dc_a, dc_b, dh_a, dh_b, c_smem, h_smem, ready, empty, LIST, n_my, STAGES, GGUF)),
        ], [LW], [LREGS])


def planes(blocks):
    """GGUF q4_k bytes [N, K / 256 * 144] -> (codes [N, K / 2], headers [N, K / 16]) uint8."""
    N = blocks.shape[0]
    b = blocks.view(N, -1, 144)
    return b[:, :, 16:].reshape(N, -1).contiguous(), b[:, :, :16].reshape(N, -1).contiguous()


def round_int8(x):
    """x [K] float32 -> (q int8 [K], d [K / 32], s [K / 32]) as qgemv.int8.quantize_act rounds it."""
    xb = x.view(-1, 32)
    amax = xb.abs().amax(1)
    d = amax / 127
    inv = torch.where(amax > 0, 127 / torch.where(amax > 0, amax, torch.ones_like(amax)), torch.zeros_like(amax))
    v = xb * inv[:, None]
    q = torch.where(v >= 0, torch.floor(v + 0.5), -torch.floor(0.5 - v))
    return q.to(torch.int8).view(-1), d, d * q.sum(1)


def emulate(codes, hdr, x):
    """The kernel's arithmetic in torch (float64): planes and x [K] -> y [N]. Checks the layout and the scale
    decoding on the CPU."""
    from llmkernels.quant.scales import unpack_scales6

    N = codes.shape[0]
    q, dx, sx = round_int8(x.float())
    nb = codes.shape[1] // 128
    h = hdr.view(N, nb, 16)
    d = h[:, :, 0:2].contiguous().view(torch.float16).double()  # [N, nb, 1]
    dmin = h[:, :, 2:4].contiguous().view(torch.float16).double()
    sc, mn = unpack_scales6(h[:, :, 4:16].reshape(-1, 12))
    sc, mn = sc.view(N, nb, 8).double(), mn.view(N, nb, 8).double()
    cb = codes.view(N, nb, 4, 32).to(torch.int64)
    nib = torch.stack([cb & 0xF, cb >> 4], dim=3).view(N, nb, 8, 32)  # sub-block 2c + p
    dots = (nib * q.view(nb, 8, 32).to(torch.int64)).sum(-1).double()  # the integer dots [N, nb, 8]
    dxv, sxv = dx.view(nb, 8).double(), sx.view(nb, 8).double()
    return (d * sc * dxv * dots - dmin * mn * sxv).sum((1, 2))


def scales_v2(hdr):
    """_slot_dot's DOT 1 scale and min decoding in torch: header bytes [n, 16] -> (sc, mn) [n, 8] int64."""
    w = hdr.contiguous().view(torch.int32).to(torch.int64)  # [n, 4] words, sign-extended as the kernel's int32
    w1, w2, w3 = w[:, 1:2], w[:, 2:3], w[:, 3:4]
    sc, mn = [], []
    for c in range(4):
        first = c < 2
        sh = 16 * (c % 2)
        m_a, m_b = (63, 0) if first else (0xF, 0x30)
        ta = (w1 if first else w3) >> sh
        tc = (w2 if first else w3 >> 4) >> sh
        t1, t2 = (w1 >> 2) >> sh, (w2 >> 2) >> sh
        sc += [(ta & m_a) | (t1 & m_b), ((ta >> 8) & m_a) | ((t1 >> 8) & m_b)]
        mn += [(tc & m_a) | (t2 & m_b), ((tc >> 8) & m_a) | ((t2 >> 8) & m_b)]
    return torch.cat(sc, 1), torch.cat(mn, 1)


def check_emulation():
    from llmkernels.quant import dequantize
    from llmkernels.testing.random_weights import random_qtensor

    torch.manual_seed(0)
    worst = 0.0
    for N, K in ((48, 4096), (40, 14336), (16, 512)):
        qt = random_qtensor("q4_k", N, K, "cpu", scale=1.0 / (324 * K ** 0.5))
        codes, hdr = planes(qt.data)
        x = torch.randn(K)
        q, dx, _ = round_int8(x)
        xr = (q.view(-1, 32).double() * dx.double()[:, None]).view(-1)
        ref = dequantize(qt, dtype=torch.float32).double() @ xr
        got = emulate(codes, hdr, x)
        e = ((got - ref).abs().max() / ref.abs().max()).item()
        worst = max(worst, e)
        print(f"[{N}, {K}]: emulated kernel arithmetic vs dequantize(W) @ x': {e:.1e} of the largest output")
    assert worst < 1e-6, worst
    from llmkernels.quant.scales import unpack_scales6
    hdr = torch.randint(0, 256, (4096, 16), dtype=torch.uint8)
    want = unpack_scales6(hdr[:, 4:16])
    got = scales_v2(hdr)
    same = all(torch.equal(g, w.to(torch.int64).view(g.shape)) for g, w in zip(got, want))
    verdict = "equal to" if same else "DIFFERENT FROM"
    print(f"_slot_dot's DOT 1 scale and min decoding on 4096 random headers: {verdict} "
          f"unpack_scales6")
    assert same
    return worst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--stages", default="16,24", help="ring slots of 4.5 KB per 16 rows (8 warps, 24: too much)")
    ap.add_argument("--warps", default="4,8", help="compute warps; a tile has 4 rows per warp")
    ap.add_argument("--modes", default="0,1,2", help="stream_q4k_kernel's MODE (1 and 2 are timed, not checked)")
    ap.add_argument("--layouts", default="gguf,planes", help="gguf: the blocks as stored; planes: codes, headers")
    ap.add_argument("--step", default="2", help="comma-separated: slots per barrier (2 or 4)")
    ap.add_argument("--dot", default="0", help="comma-separated: _slot_dot's DOT (1: fewer instructions)")
    ap.add_argument("--check-ops", type=int, default=8, help="mode 0 checks the chain's first N ops")
    ap.add_argument("--configs", default="", help="';'-separated warps,tpc,part,stages (threads per chunk, "
                    "stream_q4k_kernel's PART): replaces --warps and --stages, e.g. '8,1,0,16;16,2,1,16'")
    ap.add_argument("--emulate", action="store_true", help="check the arithmetic in torch on the CPU and stop")
    args = ap.parse_args()
    if args.emulate:
        check_emulation()
        return
    from llmkernels._runtime import num_sms
    from llmkernels.bench.harness import measure_read_bandwidth
    from llmkernels.quant import dequantize
    from llmkernels.quant.tensor import QuantizedTensor
    from llmkernels.testing.random_weights import random_qtensor

    bw = measure_read_bandwidth()
    P = num_sms()
    print(f"read bandwidth {bw:.3f} TB/s, {P} SMs", flush=True)
    per_a = QKV + HIDDEN + 2 * FFN
    wa = random_qtensor("q4_k", args.layers * per_a, HIDDEN, "cuda", scale=1.0 / (324 * HIDDEN ** 0.5)).data
    wb = random_qtensor("q4_k", args.layers * HIDDEN, FFN, "cuda", scale=1.0 / (324 * FFN ** 0.5)).data
    nbytes = wa.numel() + wb.numel()
    ops = llama_ops(args.layers, per_a)
    act_stride = 2 * FFN
    act = torch.zeros(len(ops) + 1, act_stride, device="cuda", dtype=torch.bfloat16)
    act[0, :HIDDEN] = torch.randn(HIDDEN, device="cuda")
    cnt = torch.zeros(len(ops), dtype=torch.int32, device="cuda")
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    def product(d, r0, n, x):  # dequantize(W) @ x', x' the int8 rounding of the op's input
        blocks = (wa if d == 0 else wb)[r0:r0 + n]
        w = dequantize(QuantizedTensor("q4_k", (n, x.numel()), blocks), dtype=torch.float32)
        q, dx, _ = round_int8(x)
        return w.double() @ (q.view(-1, 32).double() * dx.double()[:, None]).view(-1)
    for lay in args.layouts.split(","):
        gguf = lay == "gguf"
        ma, mb = (wa, wb) if gguf else (planes(wa), planes(wb))
        if args.configs:
            configs = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";")]
        else:
            configs = [(int(w), 1, 0, int(st)) for w in args.warps.split(",") for st in args.stages.split(",")]
        for cw, tpc, part, stages in configs:
            rows = ROWS_PER_WARP * cw // tpc
            table, lists, counts = tile_lists(ops, rows, P, "cuda")
            (dc_a, dh_a), (dc_b, dh_b) = q4k_descriptors(ma, rows, gguf), q4k_descriptors(mb, rows, gguf)
            for mode, step, dot in itertools.product(*(map(int, a.split(",")) for a in
                                                       (args.modes, args.step, args.dot))):
                name = (f"q4_k {lay} rows {rows} stages {stages} warps {cw} tpc {tpc} part {part} step {step} "
                        f"dot {dot} mode {mode}")

                def run():
                    cnt.zero_()
                    stream_q4k_kernel[(P,)](dc_a, dc_b, dh_a, dh_b, lists, counts, lists.stride(0), table, act,
                                            cnt, err, act_stride, 1 << 20, STAGES=stages, CW=cw, MODE=mode,
                                            GGUF=gguf, STEP=step, DOT=dot, TPC=tpc, PART=part,
                                            num_warps=cw if part else 4)
                if measure(name, run, err, ops, act, nbytes, bw, product,
                           check=args.check_ops if mode == 0 else 0) == "stop":
                    return
        del ma, mb


if __name__ == "__main__":
    main()
