"""A reference executor of the one-kernel decode step's instruction lists (schedule.py), in Triton.

One persistent program per SM walks its list: waits (acquire loads, with a spin limit that records a hang instead of
wedging the GPU), runs the instruction, then signals (a CTA barrier and release atomics). This version is the
semantics, not the speed: weights as stored in the GGUF (f32, f16, bf16, q8_0, q4_k, q6_k: the q4_k_m mix)
dequantized in registers by the generic GEMV's ``dequant_tile``, plain loads, no prefetch across instructions,
interleaved or neox RoPE, QK-norm (Qwen3), llama-family layers without biases, soft caps or windows
(``unsupported`` names what a model has beyond that), dense or mixture-of-experts FFNs (Mixtral, Qwen3-MoE). It
checks what the instructions mean, step by step against the engine (tests/megakernel); the fast kernel is to run
the same lists.

The weights sit in one byte buffer (each matrix's GGUF rows, 16-byte aligned) described by a table int64
[layers + 1, 8, 3] of (byte offset, bytes per row, format id): per layer attn_q, attn_k, attn_v, ffn_gate, ffn_up,
attn_output, ffn_down and the router (a mixture-of-experts layer: the expert stacks ffn_gate_exps, ffn_up_exps,
ffn_down_exps in the FFN's places, expert e's rows after the e before it); the last row holds token_embd and
output.

Buffers are float32: the residual stream RESID [B, H], the fused QKV output [B, Nqkv], the attention splits'
partials PART_O [B, Hq, S, D] / PART_L [B, Hq, S], the attention output [B, Hq * D], the FFN activation [B, F] and
the logits [B, V]; with experts the router logits RLOGITS [B, E], each sequence's experts and weights ROUTE_I /
ROUTE_W [B, k] and the experts' activations XACT [B, k, expert FFN]. Each step's new token is at position
SEQ_LENS[b] - 1; ATTN's last split stores its rotated K and its V into the cache.
"""
import torch
import triton
import triton.language as tl

from ..qgemv.dequant import dequant_tile
from ..quant.tensor import dequantize
from ..qgemv.moe import route_top_k
from ..qgemv.ops import FORMAT_IDS
from .schedule import FIELDS, Program

NF = len(FIELDS)
NM = 8  # matrices per layer in the table
MAT_STRIDE = tl.constexpr(NM * 3)  # int64 fields per layer in the table


@triton.jit
def _rms_inv(X, H: tl.constexpr, eps, BLOCK_K: tl.constexpr):
    acc = tl.zeros([BLOCK_K], tl.float32)
    for k in range(0, H, BLOCK_K):
        offs = k + tl.arange(0, BLOCK_K)
        x = tl.load(X + offs, mask=offs < H, other=0.0)
        acc += x * x
    return 1.0 / tl.sqrt(tl.sum(acc, 0) / H + eps)


@triton.jit
def _qdot_fmt(W8, W16, WI8, off, row_bytes, rows, rmask, K, X, scale, NW, HAS_NORM: tl.constexpr,
              ROW_OUT: tl.constexpr, FMT: tl.constexpr, NB: tl.constexpr, NSUB: tl.constexpr, SUB: tl.constexpr,
              BB: tl.constexpr):
    """sum_k W[rows, k] * x[k] for one stored format (x = X * scale * NW when HAS_NORM, else X) -> float32.
    ROW_OUT: instead, the first row of ``rows`` dequantized into X (an embedding lookup)."""
    BLOCK_K: tl.constexpr = NB * NSUB * SUB
    nblocks = (K + NSUB * SUB - 1) // (NSUB * SUB)
    acc = tl.zeros([rows.shape[0], BLOCK_K], tl.float32)
    for kb in range(0, nblocks, NB):
        blk = kb + tl.arange(0, NB)
        kk = kb * (NSUB * SUB) + tl.arange(0, BLOCK_K)
        km = kk < K
        w = dequant_tile(W8 + off, W16 + off // 2, WI8 + off, W16, W16, row_bytes, rows.to(tl.int64), blk, rmask,
                         blk < nblocks, 0, K, FMT, NB, NSUB, SUB, BB, 0).reshape(rows.shape[0], BLOCK_K)
        if ROW_OUT:
            first = tl.arange(0, rows.shape[0]) == 0
            tl.store(X + kk, tl.sum(tl.where(first[:, None], w, 0.0), 0), mask=km)
        else:
            x = tl.load(X + kk, mask=km, other=0.0)
            if HAS_NORM:
                x = x * scale * tl.load(NW + kk, mask=km, other=0.0)
            acc += w * x[None, :]
    return tl.sum(acc, 1)


@triton.jit
def _qdot_q4k(W8, W16, off, row_bytes, rows, rmask, K, X, scale, NW, HAS_NORM: tl.constexpr, NB: tl.constexpr,
              STAGES: tl.constexpr):
    """q4_k rows . x with each block's 128 code bytes loaded as one contiguous [4, 32] run per row (16-byte vector
    loads; dequant_tile's index arithmetic hides that contiguity and loads them byte by byte). Block layout: d, dmin
    (fp16), 12 bytes of 6-bit scales and mins, then byte 32 j + l holds weight 64 j + l (low nibble) and 64 j + 32 + l
    (high nibble): sub-blocks 2 j and 2 j + 1. Scales apply per sub-block after the sums. STAGES > 1 lets Triton
    keep that many steps' bytes in flight (cp.async)."""
    nblocks = K // 256
    jj = tl.arange(0, 4)[None, None, :, None]
    ll = tl.arange(0, 32)[None, None, None, :]
    j3 = tl.arange(0, 4)[None, None, :]
    acc = tl.zeros([rows.shape[0]], tl.float32)
    for kb in tl.range(0, nblocks, NB, num_stages=STAGES):
        blk = kb + tl.arange(0, NB)
        ok3 = rmask[:, None, None] & (blk < nblocks)[None, :, None]  # [R, NB, 1]
        # matrices start 16-byte aligned and rows are whole 144-byte blocks: every block starts 16-byte aligned
        base = tl.multiple_of(off + rows.to(tl.int64)[:, None, None] * row_bytes + blk[None, :, None] * 144,
                              [16, 16, 16])
        qs = tl.load(W8 + base[:, :, :, None] + 16 + jj * 32 + ll, mask=ok3[:, :, :, None], other=0)
        e = (blk[None, :, None, None] * 256 + jj * 64 + ll)  # weight index of the low nibble, [1, NB, 4, 32]
        em = (blk < nblocks)[None, :, None, None] & (ll >= 0)
        x_lo = tl.load(X + e, mask=em, other=0.0)
        x_hi = tl.load(X + e + 32, mask=em, other=0.0)
        if HAS_NORM:
            x_lo = x_lo * scale * tl.load(NW + e, mask=em, other=0.0)
            x_hi = x_hi * scale * tl.load(NW + e + 32, mask=em, other=0.0)
        q_lo = (qs & 0xF).to(tl.float32)
        q_hi = (qs >> 4).to(tl.float32)
        # the block's first 16 bytes as 4 words (one vector load): d | dmin, then the 12 scale bytes
        hdr = tl.load(W8.to(tl.pointer_type(tl.int32)) + base // 4 + tl.arange(0, 4)[None, None, :],
                      mask=ok3, other=0)
        w02, w13 = tl.split(tl.reshape(hdr, [hdr.shape[0], hdr.shape[1], 2, 2]))
        w0, w2 = tl.split(w02)
        w1, w3 = tl.split(w13)
        d = (w0 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)[:, :, None]
        dmin = ((w0 >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)[:, :, None]
        for h in tl.static_range(2):  # sub-blocks 2 j (low nibbles) and 2 j + 1 (high)
            q = q_lo if h == 0 else q_hi
            x = x_lo if h == 0 else x_hi
            s = 2 * j3 + h  # [1, 1, 4]
            sh = 8 * (s % 4)
            b_a = (w1[:, :, None] >> sh) & 0xFF  # scale byte s % 4, then 4 + s % 4, then 8 + s % 4
            b_b = (w2[:, :, None] >> sh) & 0xFF
            b_c = (w3[:, :, None] >> sh) & 0xFF
            first = s < 4
            sc = tl.where(first, b_a & 63, (b_c & 0xF) | ((b_a >> 6) << 4)).to(tl.float32)
            mn = tl.where(first, b_b & 63, (b_c >> 4) | ((b_b >> 6) << 4)).to(tl.float32)
            qx = tl.sum(q * x, 3)  # [R, NB, 4]
            sx = tl.sum(x, 3)  # [1, NB, 4]
            acc += tl.sum(tl.sum(d * sc * qx - dmin * mn * sx, 2), 1)
    return acc


@triton.jit
def _qdot(W8, W16, WI8, MAT, rows, rmask, K, X, scale, NW, HAS_NORM: tl.constexpr, ROW_OUT: tl.constexpr = False,
          QNB: tl.constexpr = 1, VEC: tl.constexpr = False, STAGES: tl.constexpr = 1):
    """The same for matrix MAT (a row of the table: offset, bytes per row, format id), dispatched on its format.
    QNB: format blocks per loop step, in units of 256 weights (more bytes in flight per step, more registers).
    VEC: q4_k products through _qdot_q4k (vector loads, STAGES steps in flight)."""
    off = tl.load(MAT)
    row_bytes = tl.load(MAT + 1)
    fmt = tl.load(MAT + 2)
    if fmt == 10 and VEC and not ROW_OUT:  # q4_k
        acc = _qdot_q4k(W8, W16, off, row_bytes, rows, rmask, K, X, scale, NW, HAS_NORM, QNB, STAGES)
    elif fmt == 10:
        acc = _qdot_fmt(W8, W16, WI8, off, row_bytes, rows, rmask, K, X, scale, NW, HAS_NORM, ROW_OUT,
                        10, QNB, 8, 32, 144)
    elif fmt == 12:  # q6_k
        acc = _qdot_fmt(W8, W16, WI8, off, row_bytes, rows, rmask, K, X, scale, NW, HAS_NORM, ROW_OUT,
                        12, QNB, 16, 16, 210)
    elif fmt == 7:  # q8_0
        acc = _qdot_fmt(W8, W16, WI8, off, row_bytes, rows, rmask, K, X, scale, NW, HAS_NORM, ROW_OUT,
                        7, 8 * QNB, 1, 32, 34)
    elif fmt == 2:  # bf16
        acc = _qdot_fmt(W8, W16, WI8, off, row_bytes, rows, rmask, K, X, scale, NW, HAS_NORM, ROW_OUT,
                        2, 8 * QNB, 1, 32, 0)
    elif fmt == 0:  # f32 (routers)
        acc = _qdot_fmt(W8, W16, WI8, off, row_bytes, rows, rmask, K, X, scale, NW, HAS_NORM, ROW_OUT,
                        0, 8 * QNB, 1, 32, 0)
    else:  # f16
        acc = _qdot_fmt(W8, W16, WI8, off, row_bytes, rows, rmask, K, X, scale, NW, HAS_NORM, ROW_OUT,
                        1, 8 * QNB, 1, 32, 0)
    return acc


@triton.jit
def _rms_pair(xe, xo, W, ev, od, eps, D: tl.constexpr):
    """RMSNorm over a head of D held as its two RoPE halves xe, xo [.., D / 2] (at offsets ev, od), times W."""
    inv = 1.0 / tl.sqrt((tl.sum(xe * xe, -1, keep_dims=True) + tl.sum(xo * xo, -1, keep_dims=True)) / D + eps)
    return xe * inv * tl.load(W + ev), xo * inv * tl.load(W + od)


@triton.jit
def _gate_up(W8, W16, WI8, mats, first, lo, hi, X, inv, NW, OUT, H: tl.constexpr, BLOCK_R: tl.constexpr,
             QNB: tl.constexpr, VEC: tl.constexpr, STAGES: tl.constexpr):
    """OUT[r] = SiLU(gate[first + r] . x) * (up[first + r] . x) for rows r in [lo, hi), x = X * inv * NW (the
    layer's gate and up matrices, or an expert's rows of the stacks)."""
    for r0 in range(lo, hi, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        rm = rows < hi
        g = _qdot(W8, W16, WI8, mats + 9, first + rows, rm, H, X, inv, NW, True, QNB=QNB, VEC=VEC, STAGES=STAGES)
        u = _qdot(W8, W16, WI8, mats + 12, first + rows, rm, H, X, inv, NW, True, QNB=QNB, VEC=VEC, STAGES=STAGES)
        tl.store(OUT + rows, g / (1.0 + tl.exp(-g)) * u, mask=rm)


@triton.jit
def _attn_split(layer, h, split, QKV, KC, VC, PT, SEQ_LENS, INV_FREQ, PART_O, PART_L, QKN, num_pages, pages_per_seq,
                qk_scale, eps, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                S: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, GP: tl.constexpr, NEOX: tl.constexpr,
                QK_NORM: tl.constexpr):
    """RoPE pairs (2 i, 2 i + 1), or (i, i + D / 2) with NEOX, rotated by angle i; with QK_NORM each head of q and
    the new k RMS-normed first (QKN [layers, 2, D]: q's and k's weights), as the engine's rope_store."""
    G: tl.constexpr = HQ // HKV
    D2: tl.constexpr = D // 2
    NQKV: tl.constexpr = (HQ + 2 * HKV) * D
    gi = tl.arange(0, GP)
    ii = tl.arange(0, D2)
    ev = ii if NEOX else 2 * ii  # where each pair's two elements sit in a head
    od = ii + D2 if NEOX else 2 * ii + 1
    gm = gi < G
    inv = tl.load(INV_FREQ + ii)
    qn = QKN + layer * 2 * D
    b = split // S  # the unit's sequence and its key split there
    split = split % S
    n = tl.load(SEQ_LENS + b)
    pos = n - 1
    cos = tl.cos(pos.to(tl.float32) * inv)
    sin = tl.sin(pos.to(tl.float32) * inv)
    qrow = QKV + b * NQKV + (h * G + gi)[:, None] * D
    qe = tl.load(qrow + ev[None, :], mask=gm[:, None], other=0.0)
    qo = tl.load(qrow + od[None, :], mask=gm[:, None], other=0.0)
    if QK_NORM:
        qe, qo = _rms_pair(qe, qo, qn, ev[None, :], od[None, :], eps, D)
    q_e = (qe * cos[None, :] - qo * sin[None, :]) * qk_scale
    q_o = (qe * sin[None, :] + qo * cos[None, :]) * qk_scale
    cache_off = (layer.to(tl.int64) * num_pages) * PAGE * HKV * D + h * D
    if split == S - 1:  # the new token: K rotated, V as is, into its cache slot
        krow = QKV + b * NQKV + HQ * D + h * D
        ke = tl.load(krow + ev)
        ko = tl.load(krow + od)
        if QK_NORM:
            ke, ko = _rms_pair(ke, ko, qn + D, ev, od, eps, D)
        page = tl.load(PT + b * pages_per_seq + pos // PAGE)
        slot = cache_off + (page.to(tl.int64) * PAGE + pos % PAGE) * HKV * D
        tl.store(KC + slot + ev, (ke * cos - ko * sin).to(KC.dtype.element_ty))
        tl.store(KC + slot + od, (ke * sin + ko * cos).to(KC.dtype.element_ty))
        vrow = QKV + b * NQKV + (HQ + HKV) * D + h * D
        tl.store(VC + slot + ev, tl.load(vrow + ev).to(VC.dtype.element_ty))
        tl.store(VC + slot + od, tl.load(vrow + od).to(VC.dtype.element_ty))
        tl.debug_barrier()
    lo = split * n // S
    hi = (split + 1) * n // S
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc_e = tl.zeros([GP, D2], tl.float32)
    acc_o = tl.zeros([GP, D2], tl.float32)
    for k0 in range(lo, hi, BLOCK_N):
        keys = k0 + tl.arange(0, BLOCK_N)
        km = keys < hi
        page = tl.load(PT + b * pages_per_seq + keys // PAGE, mask=km, other=0)
        row = cache_off + (page.to(tl.int64) * PAGE + keys % PAGE) * HKV * D
        kp = KC + row[:, None]
        ke = tl.load(kp + ev[None, :], mask=km[:, None], other=0.0).to(tl.float32)
        ko = tl.load(kp + od[None, :], mask=km[:, None], other=0.0).to(tl.float32)
        s = tl.sum(q_e[:, None, :] * ke[None, :, :] + q_o[:, None, :] * ko[None, :, :], 2)  # [GP, BLOCK_N]
        s = tl.where(km[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        vp = VC + row[:, None]
        ve = tl.load(vp + ev[None, :], mask=km[:, None], other=0.0).to(tl.float32)
        vo = tl.load(vp + od[None, :], mask=km[:, None], other=0.0).to(tl.float32)
        acc_e = acc_e * alpha[:, None] + tl.sum(p[:, :, None] * ve[None, :, :], 1)
        acc_o = acc_o * alpha[:, None] + tl.sum(p[:, :, None] * vo[None, :, :], 1)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    has = l_i > 0
    den = tl.where(has, l_i, 1.0)
    base = ((b * HQ + h * G + gi) * S + split)
    tl.store(PART_O + base[:, None] * D + ev[None, :], acc_e / den[:, None], mask=gm[:, None])
    tl.store(PART_O + base[:, None] * D + od[None, :], acc_o / den[:, None], mask=gm[:, None])
    tl.store(PART_L + base, tl.where(has, m_i + tl.log(den), float("-inf")), mask=gm)


@triton.jit
def _merge(lo, hi, PART_O, PART_L, ATTN, B: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, S: tl.constexpr,
           SP: tl.constexpr):
    """Query heads [lo, hi): their S splits' partials merged by their log-sum-exps."""
    si = tl.arange(0, SP)
    di = tl.arange(0, D)
    for b in range(B):
        for g in range(lo, hi):
            hq = b * HQ + g
            lse = tl.load(PART_L + hq * S + si, mask=si < S, other=float("-inf"))
            m = tl.max(lse, 0)
            w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - m))
            o = tl.load(PART_O + (hq * S + si[:, None]) * D + di[None, :], mask=(si < S)[:, None], other=0.0)
            tl.store(ATTN + hq * D + di, tl.sum(o * w[:, None], 0) / tl.sum(w, 0))


@triton.jit
def decode_step_kernel(PROG, n_instr, COUNTERS, ERR, IDS, SEQ_LENS, PT, KC, VC, INV_FREQ, QKN,
                       W8, W16, WI8, MATS, NORMS, ONORM, n_layers,
                       RESID, QKV, PART_O, PART_L, ATTN, ACT, LOGITS, RLOGITS, ROUTE_W, ROUTE_I, XACT,
                       num_pages, pages_per_seq, eps, qk_scale, spin_limit,
                       B: tl.constexpr, H: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                       F: tl.constexpr, V: tl.constexpr, S: tl.constexpr, SP: tl.constexpr, PAGE: tl.constexpr,
                       GP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                       NF: tl.constexpr, QNB: tl.constexpr = 1, VEC: tl.constexpr = False,
                       STAGES: tl.constexpr = 1, E: tl.constexpr = 1, BLOCK_E: tl.constexpr = 1,
                       TOP_K: tl.constexpr = 1, BLOCK_TK: tl.constexpr = 1, FE: tl.constexpr = 1,
                       RENORM: tl.constexpr = True, NEOX: tl.constexpr = False, QK_NORM: tl.constexpr = False,
                       MOE: tl.constexpr = False):
    NQKV: tl.constexpr = (HQ + 2 * HKV) * D
    sm = tl.program_id(0)
    ok = 1
    for j in range(n_instr):
        p = PROG + (sm * n_instr + j) * NF
        op = tl.load(p)
        layer = tl.load(p + 1)
        lo = tl.load(p + 2)
        hi = tl.load(p + 3)
        split = tl.load(p + 4)
        wait = tl.load(p + 5)
        target = tl.load(p + 6)
        if (ok == 1) & (op != 0) & (wait >= 0):
            v = tl.atomic_add(COUNTERS + wait, 0, sem="acquire")
            spins = 0
            while (v < target) & (spins < spin_limit):
                v = tl.atomic_add(COUNTERS + wait, 0, sem="acquire")
                spins += 1
            if v < target:  # a schedule that cannot finish: the first program to give up says where; all stop
                if tl.atomic_cas(ERR, 0, 1) == 0:
                    tl.atomic_xchg(ERR + 1, sm * n_instr + j)
                ok = 0
        if (ok == 1) & (op != 0):
            rows0 = tl.arange(0, BLOCK_R)
            mats = MATS + layer * MAT_STRIDE  # this layer's matrices x (offset, bytes per row, format)
            if op == 1:  # EMBED
                for b in range(B):
                    tok = tl.load(IDS + b)
                    _qdot(W8, W16, WI8, MATS + n_layers * MAT_STRIDE, tok + tl.arange(0, 2), tl.arange(0, 2) < 1, H,
                          RESID + b * H, 1.0, ONORM, False, True)
            elif op == 2:  # QKV: rows of one section (q, k or v; tiles never straddle two)
                nw = NORMS + layer * 2 * H
                sec = (lo >= HQ * D).to(tl.int32) + (lo >= (HQ + HKV) * D).to(tl.int32)
                base = tl.where(sec == 0, 0, tl.where(sec == 1, HQ * D, (HQ + HKV) * D))
                for b in range(B):
                    inv = _rms_inv(RESID + b * H, H, eps, BLOCK_K)
                    for r0 in range(lo, hi, BLOCK_R):
                        rows = r0 + rows0
                        rm = rows < hi
                        acc = _qdot(W8, W16, WI8, mats + sec * 3, rows - base, rm, H, RESID + b * H, inv, nw, True,
                                    QNB=QNB, VEC=VEC, STAGES=STAGES)
                        tl.store(QKV + b * NQKV + rows, acc, mask=rm)
            elif op == 3:  # ATTN
                _attn_split(layer, lo, split, QKV, KC, VC, PT, SEQ_LENS, INV_FREQ, PART_O, PART_L, QKN, num_pages,
                            pages_per_seq, qk_scale, eps, HQ, HKV, D, S, PAGE, BLOCK_N, GP, NEOX, QK_NORM)
            elif op == 4:  # MERGE
                _merge(lo, hi, PART_O, PART_L, ATTN, B, HQ, D, S, SP)
            elif op == 5:  # O: the residual += W_o rows . attention
                for b in range(B):
                    for r0 in range(lo, hi, BLOCK_R):
                        rows = r0 + rows0
                        rm = rows < hi
                        acc = _qdot(W8, W16, WI8, mats + 15, rows, rm, HQ * D, ATTN + b * HQ * D, 1.0, ATTN, False,
                                    QNB=QNB, VEC=VEC, STAGES=STAGES)
                        r = RESID + b * H + rows
                        tl.store(r, tl.load(r, mask=rm, other=0.0) + acc, mask=rm)
            elif op == 6:  # GATEUP: SiLU(gate) * up
                nw = NORMS + layer * 2 * H + H
                for b in range(B):
                    inv = _rms_inv(RESID + b * H, H, eps, BLOCK_K)
                    _gate_up(W8, W16, WI8, mats, 0, lo, hi, RESID + b * H, inv, nw, ACT + b * F, H, BLOCK_R, QNB,
                             VEC, STAGES)
            elif op == 7:  # DOWN: the residual += W_down rows . activation
                for b in range(B):
                    for r0 in range(lo, hi, BLOCK_R):
                        rows = r0 + rows0
                        rm = rows < hi
                        acc = _qdot(W8, W16, WI8, mats + 18, rows, rm, F, ACT + b * F, 1.0, ACT, False, QNB=QNB,
                                    VEC=VEC, STAGES=STAGES)
                        r = RESID + b * H + rows
                        tl.store(r, tl.load(r, mask=rm, other=0.0) + acc, mask=rm)
            elif op == 8:  # LOGITS
                for b in range(B):
                    inv = _rms_inv(RESID + b * H, H, eps, BLOCK_K)
                    for r0 in range(lo, hi, BLOCK_R):
                        rows = r0 + rows0
                        rm = rows < hi
                        acc = _qdot(W8, W16, WI8, MATS + n_layers * MAT_STRIDE + 3, rows, rm, H, RESID + b * H, inv,
                                    ONORM, True, QNB=QNB, VEC=VEC, STAGES=STAGES)
                        tl.store(LOGITS + b * V + rows, acc, mask=rm)
            elif MOE:  # (constexpr) a mixture-of-experts model: dense builds leave these ops out
                if op == 9:  # ROUTER: rows of the router (one per expert) after the FFN's RMSNorm
                    nw = NORMS + layer * 2 * H + H
                    for b in range(B):
                        inv = _rms_inv(RESID + b * H, H, eps, BLOCK_K)
                        for r0 in range(lo, hi, BLOCK_R):
                            rows = r0 + rows0
                            rm = rows < hi
                            acc = _qdot(W8, W16, WI8, mats + 21, rows, rm, H, RESID + b * H, inv, nw, True, QNB=QNB,
                                        STAGES=STAGES)
                            tl.store(RLOGITS + b * E + rows, acc, mask=rm)
                elif op == 10:  # TOPK: every sequence's experts and weights
                    ee = tl.arange(0, BLOCK_E)
                    kk = tl.arange(0, BLOCK_TK)
                    for b in range(B):
                        z = tl.load(RLOGITS + b * E + ee, mask=ee < E, other=float("-inf"))
                        w, ids = route_top_k(z, ee < E, TOP_K, BLOCK_TK, RENORM)
                        tl.store(ROUTE_W + b * TOP_K + kk, w, mask=kk < TOP_K)
                        tl.store(ROUTE_I + b * TOP_K + kk, ids, mask=kk < TOP_K)
                elif op == 11:  # XGATEUP: SiLU(gate) * up of the expert in each sequence's slot ``split``
                    nw = NORMS + layer * 2 * H + H
                    for b in range(B):
                        inv = _rms_inv(RESID + b * H, H, eps, BLOCK_K)
                        e = tl.load(ROUTE_I + b * TOP_K + split)  # expert e's rows follow the e before it
                        _gate_up(W8, W16, WI8, mats, e * FE, lo, hi, RESID + b * H, inv, nw,
                                 XACT + (b * TOP_K + split) * FE, H, BLOCK_R, QNB, VEC, STAGES)
                elif op == 12:  # XDOWN: the residual += the weighted sum of the k experts' down rows
                    for b in range(B):
                        for r0 in range(lo, hi, BLOCK_R):
                            rows = r0 + rows0
                            rm = rows < hi
                            acc = tl.zeros([BLOCK_R], tl.float32)
                            for j in range(TOP_K):
                                e = tl.load(ROUTE_I + b * TOP_K + j)
                                y = _qdot(W8, W16, WI8, mats + 18, e * H + rows, rm, FE, XACT + (b * TOP_K + j) * FE,
                                          1.0, XACT, False, QNB=QNB, VEC=VEC, STAGES=STAGES)
                                acc += tl.load(ROUTE_W + b * TOP_K + j) * y
                            r = RESID + b * H + rows
                            tl.store(r, tl.load(r, mask=rm, other=0.0) + acc, mask=rm)
            tl.debug_barrier()  # every thread's stores issued before the release below
            sig_lo = tl.load(p + 7)
            sig_hi = tl.load(p + 8)
            for c in range(sig_lo, sig_hi):
                tl.atomic_add(COUNTERS + c, 1, sem="release")


MATRICES = ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up", "attn_output", "ffn_down", "ffn_gate_inp")
FORMATS = ("f32", "f16", "bf16", "q8_0", "q4_k", "q6_k")


def unsupported(cfg) -> list:
    """What the decode step does not run of ``cfg`` (empty: it runs the model): each a short phrase."""
    out = []
    checks = ((cfg.rope_style not in ("interleaved", "neox"), f"{cfg.rope_style} RoPE"), (cfg.qkv_bias, "QKV biases"),
              (cfg.fused, "fused QKV and gate/up tensors"),
              (cfg.post_norms, "post-norms"), (cfg.embed_scale != 1.0, "scaled embeddings"),
              (cfg.act != "silu", f"the {cfg.act} activation"), (cfg.attn_softcap > 0, "attention soft-capping"),
              (cfg.final_softcap > 0, "logit soft-capping"), (bool(cfg.sliding_window), "sliding windows"),
              (cfg.rope_scaling == "yarn", "YaRN RoPE scaling"), (cfg.attn_sinks, "attention sinks"),
              (cfg.o_bias or cfg.moe_bias, "O, router and expert biases"))
    for bad, what in checks:
        if bad:
            out.append(what)
    return out


def pack_weights(tensors, cfg, device) -> tuple:
    """(byte buffer, matrix table int64 [layers + 1, 8, 3], norms float32 [layers, 2, H], output norm float32 [H])
    from GGUF tensors (``name -> QuantizedTensor``, as ``read_gguf`` gives them; a missing output.weight is the
    tied embedding)."""
    L = cfg.n_layers
    moe = {"ffn_gate": "ffn_gate_exps", "ffn_up": "ffn_up_exps", "ffn_down": "ffn_down_exps"}
    names = [[f"blk.{i}.{moe.get(m, m) if cfg.n_experts else m}.weight"
              if cfg.n_experts or m != "ffn_gate_inp" else None for m in MATRICES] for i in range(L)]
    out = "output.weight" if "output.weight" in tensors.keys() else "token_embd.weight"
    names.append(["token_embd.weight", out] + [None] * (NM - 2))
    table = torch.zeros(L + 1, NM, 3, dtype=torch.int64)
    chunks, off = [], 0
    for i, row in enumerate(names):
        for j, name in enumerate(row):
            if name is None:
                continue
            qt = tensors[name]
            if qt.format not in FORMATS:
                raise ValueError(f"{name}: format {qt.format} is not one the decode step reads ({', '.join(FORMATS)})")
            rows = 1
            for n in qt.shape[:-1]:  # expert stacks [E, N, K]: E * N rows
                rows *= n
            data = qt.data.reshape(rows, -1).view(torch.uint8)
            table[i, j] = torch.tensor([off, data.shape[1], FORMAT_IDS[qt.format]])
            chunks.append(data.reshape(-1))
            pad = -data.numel() % 16  # every matrix 16-byte aligned (its f16 fields at even offsets)
            if pad:
                chunks.append(torch.zeros(pad, dtype=torch.uint8, device=data.device))
            off += data.numel() + pad
    buf = torch.cat([c.to(device) for c in chunks])

    def vec(name):
        t = tensors[name]
        return (t.float() if isinstance(t, torch.Tensor) else dequantize(t, torch.float32)).to(device)

    norms = torch.stack([torch.stack([vec(f"blk.{i}.attn_norm.weight"), vec(f"blk.{i}.ffn_norm.weight")])
                         for i in range(L)])
    return buf, table.to(device), norms, vec("output_norm.weight")


class DecodeStep:
    """Runs a Program (schedule.build_decode_program) over a model's GGUF tensors.

    ``tensors``: GGUF name -> QuantizedTensor (f16, bf16, q8_0, q4_k or q6_k matrices; norms in any format or as
    plain tensors), copied into one buffer on the caches' device. ``k_cache`` / ``v_cache``: [L, num_pages,
    page_size, Hkv, D], 16-bit.
    ``spin_limit``: polls of a counter before the step gives up and raises; ``block_r`` / ``block_k`` /
    ``num_warps``: the GEMV tiles' rows, the norm's K chunk, the warps per program; ``blocks_per_step``: 256-weight
    units of K per GEMV loop step (more bytes in flight per SM, more registers); ``vector_loads``: q4_k tiles load
    their code bytes as 16-byte vectors (``_qdot_q4k``) instead of through the generic dequantizer (measured 2.7x
    slower on the H200: the products then convert each tile to the activations' layout, bench/NOTES.md); ``stages``:
    GEMV loop steps whose loads Triton keeps in flight (its software pipelining; 1: none).

    A program's list may stand for a fraction of an SM: a Program built for 2 or 4 times the SM count runs that many
    programs per SM, all resident at once (they wait on each other), which keeps more loads in flight."""

    def __init__(self, prog: Program, cfg, tensors, k_cache, v_cache, inv_freq, *, batch: int,
                 spin_limit: int = 1 << 24, block_r: int = 16, block_k: int = 64, num_warps: int = 4,
                 blocks_per_step: int = 1, vector_loads: bool = False, stages: int = 1):
        if batch != prog.geometry["batch"]:
            raise ValueError(f"batch must be the program's ({prog.geometry['batch']}), got {batch}")
        missing = unsupported(cfg)
        if missing:
            raise ValueError(f"the decode step does not run {cfg.arch} models with {', '.join(missing)}")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            want = (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
            if t.dim() != 5 or (t.shape[0], t.shape[3], t.shape[4]) != want or t.dtype not in (torch.float16,
                                                                                             torch.bfloat16):
                raise ValueError(f"{name} must be a 16-bit [layers, pages, page size, kv heads, head dim] tensor with "
                                 f"layers, kv heads, head dim = {want}; got {t.dtype} {tuple(t.shape)}")
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        self.prog, self.cfg, self.batch = prog, cfg, batch
        self.kc, self.vc, self.inv_freq = k_cache, v_cache, inv_freq.float().contiguous()
        dev = k_cache.device
        self.w8, self.mats, self.norms, self.onorm = pack_weights(tensors, cfg, dev)
        self.table = torch.from_numpy(prog.encode()).to(dev)
        self.counters = torch.zeros(prog.num_counters, dtype=torch.int32, device=dev)
        self.err = torch.zeros(2, dtype=torch.int32, device=dev)
        B, H, D, S = batch, cfg.hidden, cfg.head_dim, prog.geometry["splits"]
        f32 = dict(dtype=torch.float32, device=dev)
        self.resid = torch.empty(B, H, **f32)
        self.qkv = torch.empty(B, (cfg.n_heads + 2 * cfg.n_kv_heads) * D, **f32)
        self.part_o = torch.empty(B, cfg.n_heads, S, D, **f32)
        self.part_l = torch.empty(B, cfg.n_heads, S, **f32)
        self.attn = torch.empty(B, cfg.n_heads * D, **f32)
        self.act = torch.empty(B, cfg.ffn, **f32)
        self.logits = torch.empty(B, cfg.vocab_size, **f32)
        E, k, FE = max(cfg.n_experts, 1), max(cfg.n_experts_used, 1), max(cfg.expert_ffn, 1)
        self.rlogits = torch.empty(B, E, **f32)
        self.route_w = torch.empty(B, k, **f32)
        self.route_i = torch.empty(B, k, dtype=torch.int32, device=dev)
        self.xact = torch.empty(B, k, FE, **f32)
        self.moe = dict(MOE=bool(cfg.n_experts), E=E, BLOCK_E=triton.next_power_of_2(E), TOP_K=k,
                        BLOCK_TK=triton.next_power_of_2(k), FE=FE, RENORM=bool(cfg.expert_norm),
                        NEOX=cfg.rope_style == "neox", QK_NORM=bool(cfg.qk_norm))
        self.qkn = torch.zeros(cfg.n_layers, 2, D, **f32)  # q's and k's RMSNorm weights per layer (QK-norm)
        if cfg.qk_norm:
            for i in range(cfg.n_layers):
                for j, name in enumerate(("attn_q_norm", "attn_k_norm")):
                    t = tensors[f"blk.{i}.{name}.weight"]
                    t = t if isinstance(t, torch.Tensor) else dequantize(t, torch.float32)
                    self.qkn[i, j] = t.float().to(dev)
        self.spin_limit = spin_limit
        if blocks_per_step not in (1, 2, 4):
            raise ValueError(f"blocks_per_step must be 1, 2 or 4, got {blocks_per_step!r}")
        if not isinstance(stages, int) or not 1 <= stages <= 8:
            raise ValueError(f"stages must be an int in 1..8, got {stages!r}")
        self.tiles = dict(BLOCK_R=block_r, BLOCK_K=block_k, num_warps=num_warps, QNB=blocks_per_step,
                          VEC=bool(vector_loads), STAGES=stages)

    def __call__(self, ids, seq_lens, page_table) -> torch.Tensor:
        """float32 logits [batch, vocab] of one decode step: ``ids`` int32 [batch] the new tokens, ``seq_lens``
        int32 [batch] cached tokens including them, ``page_table`` int32 [batch, pages per sequence]."""
        cfg, S = self.cfg, self.prog.geometry["splits"]
        dev = self.kc.device
        for name, t, ndim in (("ids", ids, 1), ("seq_lens", seq_lens, 1), ("page_table", page_table, 2)):
            if t.dtype != torch.int32 or t.dim() != ndim or t.shape[0] != self.batch or t.device != dev:
                raise ValueError(f"{name} must be an int32 tensor with {self.batch} rows and {ndim} dim(s) on {dev}; "
                                 f"got {t.dtype} {tuple(t.shape)} on {t.device}")
        if not (ids.is_contiguous() and seq_lens.is_contiguous() and page_table.is_contiguous()):
            raise ValueError("ids, seq_lens and page_table must be contiguous")
        self.counters.zero_()
        G = cfg.n_heads // cfg.n_kv_heads
        decode_step_kernel[(self.prog.num_sms,)](
            self.table, self.table.shape[1], self.counters, self.err, ids, seq_lens, page_table, self.kc, self.vc,
            self.inv_freq, self.qkn, self.w8, self.w8.view(torch.float16), self.w8.view(torch.int8), self.mats,
            self.norms, self.onorm, cfg.n_layers, self.resid, self.qkv, self.part_o, self.part_l, self.attn,
            self.act, self.logits, self.rlogits, self.route_w, self.route_i, self.xact, self.kc.shape[1],
            page_table.shape[1], cfg.rms_eps, (cfg.attn_scale or cfg.head_dim ** -0.5),
            self.spin_limit, B=self.batch, H=cfg.hidden, HQ=cfg.n_heads, HKV=cfg.n_kv_heads, D=cfg.head_dim,
            F=cfg.ffn, V=cfg.vocab_size, S=S, SP=triton.next_power_of_2(S), PAGE=self.kc.shape[2],
            GP=triton.next_power_of_2(G), BLOCK_N=16, NF=NF, **self.tiles, **self.moe)
        if int(self.err[0]):
            n = int(self.err[1])
            sm, j = divmod(n, self.table.shape[1])
            i = self.prog.lists[sm][j]
            raise RuntimeError(f"decode step: SM {sm} waited {self.spin_limit} polls at {i.op} layer {i.layer} "
                               f"[{i.lo}, {i.hi}) for counter {i.wait} ({self.prog.counter_names[i.wait]}) to "
                               f"reach {i.target}: the schedule cannot finish")
        return self.logits


def compile_sm90(batch: int = 1, hidden: int = 4096, heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
                 ffn: int = 14336, vocab: int = 128256, splits: int = 16, num_warps: int = 4, blocks_per_step: int = 1,
                 block_r: int = 16, vector_loads: bool = False, stages: int = 1, experts: int = 0, top_k: int = 0):
    """decode_step_kernel compiled for sm_90 without a GPU (set TRITON_INTERPRET=0 before importing llmkernels), for
    the Llama-3-8B shape by default (``experts`` > 0: Mixtral's, ``top_k`` of them per token, each ``ffn`` wide):
    for tests and for reading the code the compiler makes."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptrs = dict(PROG="*i32", COUNTERS="*i32", ERR="*i32", IDS="*i32", SEQ_LENS="*i32", PT="*i32", KC="*bf16",
                VC="*bf16", INV_FREQ="*fp32", QKN="*fp32", W8="*u8", W16="*fp16", WI8="*i8", MATS="*i64", NORMS="*fp32",
                ONORM="*fp32", RESID="*fp32", QKV="*fp32", PART_O="*fp32", PART_L="*fp32", ATTN="*fp32",
                ACT="*fp32", LOGITS="*fp32", RLOGITS="*fp32", ROUTE_W="*fp32", ROUTE_I="*i32", XACT="*fp32")
    consts = dict(B=batch, H=hidden, HQ=heads, HKV=kv_heads, D=head_dim, F=ffn, V=vocab, S=splits,
                  SP=triton.next_power_of_2(splits), PAGE=16, GP=triton.next_power_of_2(heads // kv_heads),
                  BLOCK_R=block_r, BLOCK_K=64, BLOCK_N=16, NF=NF, QNB=blocks_per_step, VEC=int(vector_loads),
                  STAGES=stages, E=max(experts, 1), BLOCK_E=triton.next_power_of_2(max(experts, 1)),
                  TOP_K=max(top_k, 1), BLOCK_TK=triton.next_power_of_2(max(top_k, 1)), FE=ffn if experts else 1,
                  RENORM=1, NEOX=0, QK_NORM=0, MOE=int(experts > 0))
    sig = {n: ptrs.get(n, "fp32" if n in ("eps", "qk_scale") else "i32") for n in decode_step_kernel.arg_names
           if n not in consts}
    sig.update({k: "constexpr" for k in consts})
    # as a launch specializes them: every buffer 16-byte aligned (what lets loads vectorize)
    attrs = {(decode_step_kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in ptrs}
    return triton.compile(ASTSource(decode_step_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps})
