"""The instruction stream of a decode step run as one persistent kernel (one program per SM), built on the host.

A decode step of a llama-family model at batch 1-8 becomes a list of instructions per SM. The kernel runs its SM's
list in order; an instruction waits until one counter in global memory reaches its target, does its work, then adds
one to a range of counters. The counters are zeroed before each step. Ops, per layer:

- QKV: rows [lo, hi) of one section (q, k or v) of the fused QKV weight, after the RMSNorm of the residual stream
  (recomputed by every tile: a few KB per sequence). Signals the counter of every KV group its rows belong to.
- ATTN: one KV head and one key split of one sequence (``split`` = sequence * splits + key split): RoPE on the
  group's query heads, attention over its split of the cache, written as a float32 partial with its log-sum-exp;
  the last split rotates the new token's K and stores it and its V into the cache first.
- MERGE: query heads [lo, hi) of one KV group, their splits merged into the attention output (one head per
  instruction where the SMs allow: a merge's partials are read on the step's critical path).
- O: rows of W_o over the attention output, added into the residual stream in place.
- GATEUP: the same rows of gate and up, after the RMSNorm (recomputed), as SiLU(gate) * up.
- DOWN: rows of W_down over the FFN activation, added into the residual stream in place.

A mixture-of-experts layer (Mixtral, Qwen3-MoE) has, instead of GATEUP and DOWN:

- ROUTER: rows of the router matrix (one per expert) after the RMSNorm (recomputed): the router logits.
- TOPK: every sequence's experts and weights: softmax over the logits, the top k, renormalized where the model
  says so (as qgemv.moe.moe_route).
- XGATEUP: rows of one routed expert's gate and up (the expert in slot ``split`` of each sequence's top k), after
  the RMSNorm, as SiLU(gate) * up.
- XDOWN: rows of W_down of every sequence's k experts, weighted and summed, added into the residual stream.

EMBED writes the batch's embedding rows into the residual stream first and LOGITS (rows of the output matrix after
the final RMSNorm) ends the step.

Instructions are numbered in one global order that respects every dependency, and each SM's list is sorted by it:
the unfinished instruction of lowest number has all its producers done and is at the head of its SM's list, so no
schedule built here can deadlock. ``check`` verifies that, and that every buffer access is ordered after the
accesses it conflicts with; ``simulate`` runs the lists against a cost model (weight bytes over each SM's share of
the bandwidth, a prefetch window that lets an SM stream its next instruction's weights before that instruction's
inputs are ready, a signal latency) to estimate a step and what it spends not streaming weights.
"""
from __future__ import annotations

import dataclasses
import heapq

import numpy as np

from ..engine.config import ModelConfig
from ..engine.convert import mix_format
from ..quant import GGUF_FORMATS

OPS = ("END", "EMBED", "QKV", "ATTN", "MERGE", "O", "GATEUP", "DOWN", "LOGITS", "ROUTER", "TOPK", "XGATEUP", "XDOWN")
OP = {name: i for i, name in enumerate(OPS)}
FIELDS = ("op", "layer", "lo", "hi", "split", "wait", "target", "sig_lo", "sig_hi")
ROW_GRANULE = 16  # GEMV tiles are multiples of this many rows


@dataclasses.dataclass(frozen=True)
class Instr:
    op: str
    layer: int
    lo: int  # first row (GEMV ops), KV head (ATTN), first query head (MERGE)
    hi: int  # end row, KV head + 1, or end query head
    split: int  # key split (ATTN), expert slot (XGATEUP), else 0
    wait: int  # counter to wait on; -1: none
    target: int  # the value it must reach
    sig_lo: int  # counters [sig_lo, sig_hi) get one each when done
    sig_hi: int
    nbytes: int  # bytes streamed from memory: weights, or the cache for ATTN (cost model only)
    order: int  # position in the global order


@dataclasses.dataclass
class Program:
    """Per-SM instruction lists of one decode step and the counters they use."""
    num_sms: int
    lists: list  # [num_sms] lists of Instr, each sorted by order
    num_counters: int
    counter_names: list  # what each counter counts, for messages
    weight_bytes: int
    kv_bytes: int
    geometry: dict  # group, head_dim, splits, q_rows, kv_rows, batch

    @property
    def instructions(self) -> list:
        return sorted((i for lst in self.lists for i in lst), key=lambda i: i.order)

    def encode(self) -> np.ndarray:
        """int32 [num_sms, longest list + 1, len(FIELDS)]: each SM's list, ended by an END row (all zeros)."""
        n = max(len(lst) for lst in self.lists) + 1
        out = np.zeros((self.num_sms, n, len(FIELDS)), np.int32)
        for s, lst in enumerate(self.lists):
            for j, i in enumerate(lst):
                out[s, j] = (OP[i.op], i.layer, i.lo, i.hi, i.split, i.wait, i.target, i.sig_lo, i.sig_hi)
        return out


def matrix_bytes(cfg: ModelConfig, fmt: str) -> dict:
    """{(op section, layer): bytes per row} for the weights of ``cfg`` in ``fmt`` (a GGUF format or a mix such as
    q4_k_m); GATEUP counts gate and up together."""
    H, D, F = cfg.hidden, cfg.head_dim, cfg.ffn

    def row(name, layer, k):
        gname = f"blk.{layer}.{name}.weight" if layer >= 0 else name
        return GGUF_FORMATS[mix_format(fmt, gname, cfg.n_layers)].bytes_per_row(k)

    out = {("logits", -1): row("output.weight", -1, H), ("embed", -1): row("token_embd.weight", -1, H)}
    for li in range(cfg.n_layers):
        out[("q", li)] = row("attn_q", li, H)
        out[("k", li)] = row("attn_k", li, H)
        out[("v", li)] = row("attn_v", li, H)
        out[("o", li)] = row("attn_output", li, cfg.n_heads * D)
        if cfg.n_experts:  # one expert's rows; the router stays float32 in a GGUF (convert.py)
            out[("router", li)] = GGUF_FORMATS["f32"].bytes_per_row(H)
            out[("xgateup", li)] = row("ffn_gate_exps", li, H) + row("ffn_up_exps", li, H)
            out[("xdown", li)] = row("ffn_down_exps", li, cfg.expert_ffn)
        else:
            out[("gateup", li)] = row("ffn_gate", li, H) + row("ffn_up", li, H)
            out[("down", li)] = row("ffn_down", li, F)
    return out


def tile_rows(sections: list, num_sms: int, granule: int = ROW_GRANULE) -> int:
    """Rows per tile for an op over ``sections`` [(rows, bytes per row)]: the multiple of ``granule`` that leaves
    the fewest bytes to the busiest of ``num_sms`` SMs when the tiles are dealt in waves (ties: the larger tile,
    fewer instructions)."""
    widest = max(b for _, b in sections)
    longest = max(n for n, _ in sections)
    best, best_cost = granule, None
    for t in range(granule, -(-longest // granule) * granule + 1, granule):
        tiles = sum(-(-n // t) for n, _ in sections)
        cost = -(-tiles // num_sms) * t * widest
        if best_cost is None or cost <= best_cost:
            best, best_cost = t, cost
    return best


def build_decode_program(cfg: ModelConfig, fmt: str, *, batch: int = 1, context: int = 4096, num_sms: int = 132,
                         num_splits: int | None = None, kv_bytes_per_elem: int = 2, bandwidth: float = 4.49e12,
                         prefetch_bytes: int = 128 << 10, signal_latency: float = 1e-6) -> Program:
    """The instruction lists of one decode step of ``cfg`` in weight format ``fmt`` at ``batch`` sequences of
    ``context`` cached tokens, for ``num_sms`` SMs.

    ``num_splits``: key splits per KV head and sequence (default: enough that the ATTN instructions of all the
    sequences fill the SMs, so a larger batch splits each sequence's keys fewer ways). SMs are
    assigned greedily in the global order, each instruction to the SM that can finish it first under the cost model
    of ``simulate`` (``bandwidth``, ``prefetch_bytes``, ``signal_latency``)."""
    if not isinstance(batch, int) or not 1 <= batch <= 8:
        raise ValueError(f"batch must be 1..8 for the one-kernel decode step, got {batch!r}")
    for name, v in (("num_sms", num_sms), ("context", context)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be None or an int >= 1, got {num_splits!r}")
    try:
        for li in range(cfg.n_layers):
            for name in ("attn_q", "attn_v", "ffn_down_exps" if cfg.n_experts else "ffn_down"):
                GGUF_FORMATS[mix_format(fmt, f"blk.{li}.{name}.weight", cfg.n_layers)]
        GGUF_FORMATS[mix_format(fmt, "output.weight", cfg.n_layers)]
    except KeyError:
        raise ValueError(f"fmt must be a GGUF format or a mix such as q4_k_m, got {fmt!r}") from None
    Hkv, G, D = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
    S = num_splits or max(1, num_sms // (Hkv * batch))
    # query heads per MERGE: the fewest (a divisor of the group) that keep the merges within the SMs
    mh = next(d for d in range(1, G + 1) if G % d == 0 and cfg.n_heads // d <= max(num_sms, Hkv))
    rb = matrix_bytes(cfg, fmt)
    names, instrs = [], []

    def counter(name):
        names.append(name)
        return len(names) - 1

    def add(op, layer, lo, hi, wait, target, sig_lo, sig_hi, nbytes, split=0):
        instrs.append(Instr(op, layer, lo, hi, split, wait, target, sig_lo, sig_hi, int(nbytes), len(instrs)))

    def gemv(op, layer, sections, wait, target, signals, granule=ROW_GRANULE):
        """Tiles over sections [(name, first row, rows, bytes per row)]; ``signals(name, lo, hi)`` -> counter
        range. Returns the counters' expected counts {counter: tiles signalling it}."""
        t = tile_rows([(n, b) for _, _, n, b in sections], num_sms, granule)
        counts = {}
        for name, base, n, b in sections:
            for r in range(0, n, t):
                lo, hi = signals(name, r, min(n, r + t))
                add(op, layer, base + r, base + min(n, r + t), wait, target, lo, hi, (min(n, r + t) - r) * b)
                for c in range(lo, hi):
                    counts[c] = counts.get(c, 0) + 1
        return counts

    def moe(li, wait, target):
        """ROUTER tiles, one TOPK, XGATEUP tiles per expert slot, XDOWN tiles -> (counter, target) of the layer's
        end. A batch's sequences may route to different experts: the cost model counts each one's rows."""
        k, Fe = cfg.n_experts_used, cfg.expert_ffn
        r_done, t_done, gu_done, down_done = (counter(f"layer {li} {n}") for n in ("router", "topk", "xgateup",
                                                                                   "xdown"))
        # the router is small and on the critical path: rows spread over every SM, not 16-row tiles
        n_r = gemv("ROUTER", li, [("router", 0, cfg.n_experts, rb[("router", li)])], wait, target,
                   lambda *a: (r_done, r_done + 1), granule=1)
        add("TOPK", li, 0, batch, r_done, n_r[r_done], t_done, t_done + 1, 0)
        t = tile_rows([(Fe, rb[("xgateup", li)])] * k, num_sms)
        n_gu = 0
        for j in range(k):
            for r in range(0, Fe, t):
                hi = min(Fe, r + t)
                add("XGATEUP", li, r, hi, t_done, 1, gu_done, gu_done + 1, batch * (hi - r) * rb[("xgateup", li)],
                    split=j)
                n_gu += 1
        n_down = gemv("XDOWN", li, [("xdown", 0, cfg.hidden, batch * k * rb[("xdown", li)])], gu_done, n_gu,
                      lambda *a: (down_done, down_done + 1))
        return down_done, n_down[down_done]

    embed_done = counter("embed")
    add("EMBED", -1, 0, cfg.hidden, -1, 0, embed_done, embed_done + 1, batch * rb[("embed", -1)])
    wait, target = embed_done, 1
    kv_total = 0
    for li in range(cfg.n_layers):
        qkv = [counter(f"layer {li} qkv group {h}") for h in range(Hkv)]
        part = [counter(f"layer {li} attn head {h} splits") for h in range(Hkv)]
        attn, o_done = counter(f"layer {li} attn"), counter(f"layer {li} o")
        q_rows, kv_rows = cfg.n_heads * D, Hkv * D

        def group_range(name, lo, hi):  # KV groups whose rows [lo, hi) of a section touch
            per = G * D if name == "q" else D
            return qkv[0] + lo // per, qkv[0] + (hi - 1) // per + 1

        counts = gemv("QKV", li, [("q", 0, q_rows, rb[("q", li)]), ("k", q_rows, kv_rows, rb[("k", li)]),
                                  ("v", q_rows + kv_rows, kv_rows, rb[("v", li)])], wait, target, group_range)
        for h in range(Hkv):
            keys = context * D * 2 * kv_bytes_per_elem
            for u in range(batch * S):  # sequence u // S, its key split u % S
                kv = keys * (u % S + 1) // S - keys * (u % S) // S
                kv_total += kv
                add("ATTN", li, h, h + 1, qkv[h], counts[qkv[h]], part[h], part[h] + 1, kv, split=u)
        for q0 in range(0, cfg.n_heads, mh):
            add("MERGE", li, q0, q0 + mh, part[q0 // G], batch * S, attn, attn + 1, batch * mh * S * (D + 1) * 4)
        n_o = gemv("O", li, [("o", 0, cfg.hidden, rb[("o", li)])], attn, cfg.n_heads // mh,
                   lambda *a: (o_done, o_done + 1))
        if cfg.n_experts:
            wait, target = moe(li, o_done, n_o[o_done])
            continue
        gu_done, down_done = counter(f"layer {li} gateup"), counter(f"layer {li} down")
        n_gu = gemv("GATEUP", li, [("gateup", 0, cfg.ffn, rb[("gateup", li)])], o_done, n_o[o_done],
                    lambda *a: (gu_done, gu_done + 1))
        n_down = gemv("DOWN", li, [("down", 0, cfg.hidden, rb[("down", li)])], gu_done, n_gu[gu_done],
                      lambda *a: (down_done, down_done + 1))
        wait, target = down_done, n_down[down_done]
    done = counter("logits")
    gemv("LOGITS", -1, [("logits", 0, cfg.vocab_size, rb[("logits", -1)])], wait, target,
         lambda *a: (done, done + 1))
    weight_bytes = sum(i.nbytes for i in instrs if i.op not in ("ATTN", "MERGE"))
    geo = dict(group=G, head_dim=D, splits=S, q_rows=cfg.n_heads * D, kv_rows=Hkv * D, batch=batch,
               expert_ffn=cfg.expert_ffn)
    prog = Program(num_sms, [[] for _ in range(num_sms)], len(names), names, weight_bytes, kv_total, geo)
    _assign(prog, instrs, bandwidth, prefetch_bytes, signal_latency)
    return prog


# Time an instruction takes beyond its bytes: ATTN and MERGE are chains of dependent loads and reductions, not
# streams (H200 traces at 512 cached tokens: an ATTN split 5 us after its wait, a MERGE 1 us), so that a second
# one on an SM that looks free is not taken as cheap
RUN_LATENCY = {"ATTN": 5e-6, "MERGE": 1e-6}


def _cost(i: Instr, free: float, ready: float, per_sm_bw: float, prefetch: int, latency: float) -> float:
    """When instruction ``i`` finishes on an SM free at ``free`` whose inputs are ready at ``ready`` (plus the
    signal's ``latency``): its bytes stream from ``free``, up to ``prefetch`` of them before the inputs arrive
    (weights, and the cache's older keys, do not depend on this step's producers; MERGE's partials do, and which
    expert's rows an XGATEUP streams is what its TOPK input decides), plus its RUN_LATENCY."""
    t = i.nbytes / per_sm_bw + RUN_LATENCY.get(i.op, 0.0)
    early = 0.0 if i.op in ("MERGE", "XGATEUP") else min(i.nbytes, prefetch) / per_sm_bw
    return max(free + t, ready + latency + t - early)


def _assign(prog: Program, instrs: list, bandwidth: float, prefetch: int, latency: float) -> None:
    per_sm = bandwidth / prog.num_sms
    free = [(0.0, s) for s in range(prog.num_sms)]  # a heap of (time the SM is free, SM)
    reach = {}  # counter -> the time it reached its count so far
    for i in instrs:
        ready = reach.get(i.wait, 0.0) if i.wait >= 0 else 0.0
        # the earliest-free SM finishes first (every SM has the same bandwidth share)
        t_free, s = heapq.heappop(free)
        end = _cost(i, t_free, ready, per_sm, prefetch, latency)
        heapq.heappush(free, (end, s))
        prog.lists[s].append(i)
        for c in range(i.sig_lo, i.sig_hi):
            reach[c] = max(reach.get(c, 0.0), end)


def check(prog: Program, hazards: bool = True) -> None:
    """Raise ValueError naming the first instruction that breaks a rule: every counter's target equals the number of
    instructions signalling it, producers come before their consumers in the global order, each SM's list follows
    that order, every op covers its rows (or heads and splits) exactly once, and (``hazards``) every conflicting
    pair of buffer accesses is ordered by the dependencies. The hazard pass compares pairs of accesses (quadratic
    in the instructions: seconds for a few layers of an 8B model, which repeat the whole model's patterns)."""
    instrs = prog.instructions
    if [i.order for i in instrs] != list(range(len(instrs))):
        raise ValueError("instruction numbers must be 0..n-1, each once")
    for s, lst in enumerate(prog.lists):
        if any(a.order >= b.order for a, b in zip(lst, lst[1:])):
            raise ValueError(f"SM {s}'s list is not in the global order")
    signals = {}
    for i in instrs:
        for c in range(i.sig_lo, i.sig_hi):
            signals.setdefault(c, []).append(i)
    for i in instrs:
        if i.wait < 0:
            continue
        prod = signals.get(i.wait, [])
        if len(prod) != i.target:
            raise ValueError(f"{_name(i)} waits for counter {i.wait} ({prog.counter_names[i.wait]}) to reach "
                             f"{i.target}, but {len(prod)} instructions signal it")
        late = [p for p in prod if p.order >= i.order]
        if late:
            raise ValueError(f"{_name(i)} waits on {_name(late[0])}, which comes after it in the global order")
    _check_coverage(instrs)
    if hazards:
        _check_hazards(instrs, signals, prog.geometry)


def _name(i: Instr) -> str:
    extra = f" split {i.split}" if i.op == "ATTN" else f" slot {i.split}" if i.op == "XGATEUP" else ""
    return f"{i.op} layer {i.layer} [{i.lo}, {i.hi})" + extra + f" (#{i.order})"


def _check_coverage(instrs: list) -> None:
    spans = {}
    for i in instrs:
        spans.setdefault((i.op, i.layer, i.split), []).append((i.lo, i.hi))
    for (op, layer, split), lst in spans.items():
        lst.sort()
        if lst[0][0] != 0 or any(a[1] != b[0] for a, b in zip(lst, lst[1:])):
            raise ValueError(f"{op} layer {layer}{f' split {split}' if op == 'ATTN' else ''}: its tiles "
                             f"{lst[:4]}... leave a gap or overlap")
    splits = {}
    for i in instrs:
        if i.op == "ATTN":
            splits.setdefault((i.layer, i.lo), set()).add(i.split)
    for (layer, h), ss in splits.items():
        if ss != set(range(len(ss))):
            raise ValueError(f"ATTN layer {layer} head {h}: splits {sorted(ss)} are not 0..n-1")


def _accesses(i: Instr, geo: dict) -> list:
    """[(buffer, "r" or "w", [(lo, hi), ...])] of instruction ``i``. Rows are those of the fused QKV output for
    ``qkv``, KV heads for each layer's cache and for ``attn``, (head, sequence, split) slots for ``part``, rows of
    the hidden, FFN or vocab dimension elsewhere; GEMV ops read their whole input vector. ATTN reads its group's q
    rows and its head's k and v rows; a sequence's last split stores its new token's K and V into a slot no other
    split reads (``new ...``, per head and sequence)."""
    G, D, S, qr, kvr = geo["group"], geo["head_dim"], geo["splits"], geo["q_rows"], geo["kv_rows"]
    U = S * geo["batch"]  # ATTN units per KV head
    whole = [(0, 1 << 40)]
    own = [(i.lo, i.hi)]
    if i.op == "EMBED":
        return [("resid", "w", whole)]
    if i.op == "QKV":
        return [("resid", "r", whole), ("qkv", "w", own)]
    if i.op == "ATTN":
        h = i.lo
        out = [("qkv", "r", [(h * G * D, (h + 1) * G * D), (qr + h * D, qr + (h + 1) * D),
                             (qr + kvr + h * D, qr + kvr + (h + 1) * D)]),
               (f"cache {i.layer}", "r", own), ("part", "w", [(h * U + i.split, h * U + i.split + 1)])]
        seq = h * geo["batch"] + i.split // S
        return out + ([(f"new {i.layer}", "w", [(seq, seq + 1)])] if i.split % S == S - 1 else [])
    if i.op == "MERGE":  # query heads [lo, hi) of KV head lo // G
        return [("part", "r", [(i.lo // G * U, (i.lo // G + 1) * U)]), ("attn", "w", own)]
    if i.op == "O":
        return [("attn", "r", whole), ("resid", "r", own), ("resid", "w", own)]
    if i.op == "GATEUP":
        return [("resid", "r", whole), ("act", "w", own)]
    if i.op == "DOWN":
        return [("act", "r", whole), ("resid", "r", own), ("resid", "w", own)]
    if i.op == "ROUTER":
        return [("resid", "r", whole), ("rlogits", "w", own)]
    if i.op == "TOPK":
        return [("rlogits", "r", whole), ("route", "w", whole)]
    if i.op == "XGATEUP":
        fe = geo["expert_ffn"]
        slot = [(i.split * fe + i.lo, i.split * fe + i.hi)]
        return [("resid", "r", whole), ("route", "r", whole), ("xact", "w", slot)]
    if i.op == "XDOWN":
        return [("xact", "r", whole), ("route", "r", whole), ("resid", "r", own), ("resid", "w", own)]
    return [("resid", "r", whole), ("logits", "w", own)]  # LOGITS


def _check_hazards(instrs: list, signals: dict, geo: dict) -> None:
    """Every two accesses to overlapping rows of one buffer, one of them a write, by different instructions: the
    later one (in the global order) must depend on the earlier, transitively (ancestors kept as bitsets)."""
    anc = []
    for i in instrs:
        a = 0
        if i.wait >= 0:
            for p in signals[i.wait]:
                a |= anc[p.order] | (1 << p.order)
        anc.append(a)
    seen = {}  # buffer -> [(instr, mode, slices)]
    for i in instrs:
        acc = _accesses(i, geo)
        for buf, mode, sl in acc:
            for j, m, sj in seen.get(buf, []):
                if j is i or (mode == "r" and m == "r") or (anc[i.order] >> j.order) & 1:
                    continue
                if any(a < d and c < b for a, b in sl for c, d in sj):
                    raise ValueError(f"{_name(i)} {'writes' if mode == 'w' else 'reads'} {buf} where "
                                     f"{_name(j)} {'wrote' if m == 'w' else 'read'}, without depending on it")
        for buf, mode, sl in acc:
            seen.setdefault(buf, []).append((i, mode, sl))


def simulate(prog: Program, *, bandwidth: float = 4.49e12, prefetch_bytes: int = 128 << 10,
             signal_latency: float = 1e-6) -> dict:
    """Run the per-SM lists in order against the cost model (see _cost); raise RuntimeError naming the stuck SMs
    if they deadlock. -> {"time": seconds, "weight_time": weight bytes / bandwidth, "busy": per-SM seconds
    streaming, "fraction": weight_time / time}."""
    per_sm = bandwidth / prog.num_sms
    head = [0] * prog.num_sms
    free = [0.0] * prog.num_sms
    count = [0] * prog.num_counters
    reach = [0.0] * prog.num_counters
    busy = [0.0] * prog.num_sms
    left = sum(len(lst) for lst in prog.lists)
    while left:
        moved = False
        for s, lst in enumerate(prog.lists):
            while head[s] < len(lst):
                i = lst[head[s]]
                if i.wait >= 0 and count[i.wait] < i.target:
                    break
                ready = reach[i.wait] if i.wait >= 0 else 0.0
                end = _cost(i, free[s], ready, per_sm, prefetch_bytes, signal_latency)
                busy[s] += i.nbytes / per_sm
                free[s] = end
                for c in range(i.sig_lo, i.sig_hi):
                    count[c] += 1
                    reach[c] = max(reach[c], end)
                head[s] += 1
                left -= 1
                moved = True
        if not moved:
            stuck = [f"SM {s} at {_name(lst[head[s]])} waiting on {prog.counter_names[lst[head[s]].wait]} "
                     f"({count[lst[head[s]].wait]}/{lst[head[s]].target})"
                     for s, lst in enumerate(prog.lists) if head[s] < len(lst)]
            raise RuntimeError(f"the schedule deadlocks: {'; '.join(stuck[:3])}")
    t = max(free)
    wt = prog.weight_bytes / bandwidth
    return {"time": t, "weight_time": wt, "busy": busy, "fraction": wt / t}


def describe(prog: Program, sim: dict | None = None) -> str:
    """Per op: instructions, rows per tile and bytes; with ``simulate``'s result, the estimated step."""
    lines = [f"one-kernel decode step: {sum(len(lst) for lst in prog.lists)} instructions on {prog.num_sms} SMs, "
             f"{prog.num_counters} counters; weights {prog.weight_bytes / 1e9:.3f} GB, KV cache "
             f"{prog.kv_bytes / 1e9:.3f} GB"]
    by_op = {}
    for i in prog.instructions:
        n, rows, nbytes = by_op.get(i.op, (0, set(), 0))
        rows.add(i.hi - i.lo)
        by_op[i.op] = (n + 1, rows, nbytes + i.nbytes)
    for op in OPS[1:]:
        if op in by_op:
            n, rows, nbytes = by_op[op]
            unit = "heads" if op in ("ATTN", "MERGE") else "rows"
            lines.append(f"  {op:<6} {n:>6} instructions, {unit} per instruction {sorted(rows)[-3:]}, "
                         f"{nbytes / 1e6:.1f} MB")
    if sim is not None:
        lines.append(f"  estimate: {sim['time'] * 1e6:.0f} us per step, weights alone {sim['weight_time'] * 1e6:.0f} "
                     f"us ({100 * sim['fraction']:.1f}% of the weight-bandwidth bound)")
    return "\n".join(lines)
