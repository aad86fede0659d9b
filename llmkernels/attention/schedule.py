"""Host-side schedules of the persistent Gluon decode kernel (paged_ws.py), in numpy and plain Python: which page
sizes TMA copies whole, the fp8 ring depth, and the balanced split's tables. The planner (plan.py) and the kernel's
launcher both read them; nothing here needs a GPU."""
from __future__ import annotations


def tma_pages(page_size: int) -> bool:
    """Whether the Gluon decode kernel copies whole pages with TMA (else it gathers rows with cp.async: GATHER in
    paged_ws.py)."""
    return page_size in (8, 16, 32) or page_size % 64 == 0


FP8_STAGES = 4  # fp8 caches, one consumer: the TMA ring; STAGES16 fp16 slots of widened tiles follow it
FP8_STAGES16 = 4
# the fp8 TMA ring of decode batches whose programs take several units each. H100, GQA 32/8, D 128, page 16
# (bench/NOTES.md; us, 4 / 6 slots): B=64 L=1024 56.1 / 55.0, B=64 L=8192 377.1 / 368.6, B=128 L=2048 198.6 /
# 195.6, but one unit per program loses: B=1 L=32768 (16 splits) 32.4 / 33.3, B=16 L=4096 52.8 / 54.1
FP8_STAGES_MULTI = 6
# consumer warp groups of the fp8 kernel for groups up to 8 (paged_ws.py: two take alternate key tiles; larger
# groups keep one), and their ring: two hold up to six slots at once; 8 measured faster (H200, GQA 32/8, page 16,
# B=64 L=8192: 299 us against 313 with 6)
FP8_CONSUMERS = 2
FP8_STAGES_PAIR = 8


def fp8_ring(units: int, programs: int, group: int = 8) -> int:
    """TMA ring slots for an fp8 cache when ``units`` (sequence, kv head, split) work units of ``group`` query heads
    go to ``programs``."""
    if FP8_CONSUMERS > 1 and group <= 8:
        return FP8_STAGES_PAIR
    return FP8_STAGES_MULTI if units > programs else FP8_STAGES


# a range boundary moves onto a unit boundary within this fraction of a share (see balanced_tables). H100, GQA 32/8,
# page 16 (bench/NOTES.md; us, snap 0.5 / 0.1): ragged B=8 1 x 32768 + 7 x 1024 keys 75 / 70, B=48 random
# 64..8192 312 / 295
SNAP = 0.1


def balanced_tables(tile_k_lens, num_kv_heads: int, programs: int, capacity: int, block_n: int = 64,
                    snap: float | None = None):
    """The balanced split's int32 table for decode tiles with kv lengths ``tile_k_lens`` (>= 1 each), ``programs``
    programs and room for ``capacity`` tiles, laid out as

    - CU_T [capacity + 1]: first global key tile of each decode tile (its kv heads one after another, n_i =
      ceil(len_i / block_n) key tiles each);
    - G0 [programs + 1]: program p takes global key tiles [G0[p], G0[p + 1]);
    - PSTART [programs]: the decode tile holding G0[p];
    - UFIRST, UPIECES [capacity * num_kv_heads]: per unit (decode tile * num_kv_heads + kv head), the first program
      that holds a piece of it and how many do (1: the unit is whole in one program).

    The ranges are equal shares of the T key tiles, except that a boundary within ``snap`` (default SNAP) of a
    share of a unit boundary moves onto it (with 0.5: units shorter than half a share are never cut, and a batch
    of equal units of about a share gets one per program)."""
    import numpy as np

    snap = SNAP if snap is None else snap
    lens = np.asarray(tile_k_lens, dtype=np.int64)
    n = -(-lens // block_n)
    cu_t = np.zeros(len(n) + 1, dtype=np.int64)
    np.cumsum(n * num_kv_heads, out=cu_t[1:])
    T = int(cu_t[-1])
    ub = (cu_t[:-1, None] + np.arange(num_kv_heads)[None, :] * n[:, None]).reshape(-1)  # unit starts
    ub_all = np.append(ub, T)
    P = max(1, min(programs, T))
    x = np.arange(P + 1, dtype=np.float64) * T / P
    i = np.clip(np.searchsorted(ub_all, x), 1, len(ub_all) - 1)
    lo_b, hi_b = ub_all[i - 1], ub_all[i]
    near = np.where(x - lo_b <= hi_b - x, lo_b, hi_b)
    bounds = np.where(np.abs(near - x) <= snap * T / P, near, np.floor(x)).astype(np.int64)
    bounds = np.unique(np.concatenate([[0], bounds, [T]]))
    used = len(bounds) - 1
    g0 = np.full(programs + 1, T, dtype=np.int64)
    g0[:used + 1] = bounds
    pstart = np.zeros(programs, dtype=np.int64)
    pstart[:used] = np.searchsorted(cu_t, bounds[:-1], side="right") - 1
    ue = np.append(ub[1:], T)  # unit ends
    p_first = np.searchsorted(bounds, ub, side="right") - 1
    pieces = np.searchsorted(bounds, ue - 1, side="right") - 1 - p_first + 1
    units = capacity * num_kv_heads
    out = np.zeros(capacity + 1 + 2 * programs + 1 + 2 * units, dtype=np.int64)
    out[:len(cu_t)] = cu_t
    out[capacity + 1:capacity + 2 + programs] = g0
    out[capacity + 2 + programs:capacity + 2 + 2 * programs] = pstart
    base = capacity + 2 + 2 * programs
    out[base:base + len(ub)] = p_first
    out[base + units:base + units + len(ub)] = pieces
    return out.astype(np.int32)


def balanced_table_size(capacity: int, num_kv_heads: int, programs: int) -> int:
    return capacity + 2 + 2 * programs + 2 * capacity * num_kv_heads
