"""Varlen prefill attention for Hopper (sm_90), written in Gluon: warp-specialized and fed by TMA.

The Triton kernel (prefill_kernel.py) runs the two matmuls and the softmax of a key block one after the other in
every warp, and its two warp groups meet at a barrier each step (the cp.async buffers), so little overlaps: it
reaches about half the tensor-core peak. Here the work of one program (a 128-row query block of one (sequence,
head), same grid order as the Triton kernel) is split between partitions of warps that meet only at mbarriers:

- the loader (the default partition, 4 warps, one thread issues the copies): both 64-row halves of Q, then K and V
  tiles of the key range into a ring of STAGES slots. ``k_ready[s]`` / ``v_ready[s]`` complete when the TMA bytes of
  slot s have landed; ``kv_empty[s]`` / ``kv_empty[STAGES + s]`` when both consumers are done reading its K / V tile.
- two consumers, one warp group each (64 query rows): S = Q K^T with wgmma from shared memory, the online softmax in
  registers, O += P V with P from registers. The groups run independently, so one's softmax overlaps the other's
  matmuls. With OVERLAP (a table field) each group also keeps its own tensor cores busy during its softmax: block
  j's S and block j - 1's PV product are issued together, and block j's softmax runs while the PV product does
  (``_overlapped_step``). ``setmaxnreg`` gives the consumers 240 registers each and the loader the rest.

Key blocks every row of the 128-row block sees take a loop with no mask and no -inf guard; the rest (sequence end,
causal diagonal) are masked. A tile near a sequence end reads rows of the next sequence (or TMA's zero fill past the
last one); they are masked out of the scores, and their V rows are multiplied by p = 0.

fp8 e4m3 inputs run both products on fp8 wgmma, which reads its B operand K-major only: S = Q K^T reads K tiles as
the 16-bit path does, P V reads [D, BLOCK_N] tiles of V^T, a transposed copy made before the launch
(``transpose_v``), and P is rounded to e4m3 in registers. Descales (per tensor or per head) join the score scale and
the output.

Scope (``_ws_eligible`` and ``ws_config`` in prefill.py): head dim 64, 128 or 256, fp16/bf16/fp8 e4m3, no window,
softcap or sinks, Q/K/V with packed heads whose rows are 16-byte aligned (``ws_descriptors``). The Triton kernel
serves everything else, and the interpreter.
"""
import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ._gluon import LN2, row_descriptor, smem_layout, tile_desc_type
from ._gluon import compile_sm90 as _compile_sm90
from .._runtime import num_sms, split_counters


@gluon.jit
def _load_k(desc_k, k_smem, k_ready, kv_empty, row, k_col, r, STAGES: gl.constexpr):
    """K rows row.. into ring use r (slot r % STAGES, once that slot's previous K is read)."""
    s = r % STAGES
    # a fresh barrier counts as having completed the phase before its first: the first pass does not wait
    mbarrier.wait(kv_empty.index(s), ((r // STAGES) & 1) ^ 1)
    mbarrier.expect(k_ready.index(s), desc_k.block_type.nbytes)
    tma.async_copy_global_to_shared(desc_k, [row, k_col], k_ready.index(s), k_smem.index(s))


@gluon.jit
def _load_v(desc_v, v_smem, v_ready, kv_empty, row, k_col, r, STAGES: gl.constexpr, VT: gl.constexpr):
    s = r % STAGES
    mbarrier.wait(kv_empty.index(STAGES + s), ((r // STAGES) & 1) ^ 1)
    mbarrier.expect(v_ready.index(s), desc_v.block_type.nbytes)
    if VT:  # V^T [kv heads * D, tokens]: the tile is [D, BLOCK_N] at the head's rows, keys from column row
        tma.async_copy_global_to_shared(desc_v, [k_col, row], v_ready.index(s), v_smem.index(s))
    else:
        tma.async_copy_global_to_shared(desc_v, [row, k_col], v_ready.index(s), v_smem.index(s))


@gluon.jit
def _tile(t, CU_Q, CU_K, num_heads, num_m_blocks, num_tiles, tile_group, BLOCK_M: gl.constexpr,
          BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, LPT: gl.constexpr = False):
    """Work tile t: (sequence, query head, 128-row query block), query blocks fastest (K/V of one head stay in L2
    across its query blocks), the last (heaviest causal) block of a head first. LPT (causal): (sequence, head)
    pairs in groups of tile_group, within a group query blocks slowest, heaviest first, so tiles handed out in order
    (claimed from a counter, or by the hardware's block scheduler) end with the lightest and no program is left
    with a heavy one at the end; the group's K/V stay in L2. -> b, h, the block's first row m0, the sequence's
    q_start, q_len, k_start, k_len, and its key blocks: n_blocks in all, the first n_full of them seen whole by
    every row."""
    if LPT:
        num_bh = num_tiles // num_m_blocks
        g = t // (tile_group * num_m_blocks)
        w = t - g * (tile_group * num_m_blocks)
        width = gl.minimum(num_bh - g * tile_group, tile_group)
        mi = w // width
        pid_bh = g * tile_group + w - mi * width
    else:
        pid_bh = t // num_m_blocks
        mi = t % num_m_blocks
    m0 = (num_m_blocks - 1 - mi) * BLOCK_M
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    q_start = gl.load(CU_Q + b)
    q_len = gl.load(CU_Q + b + 1) - q_start
    k_start = gl.load(CU_K + b)
    k_len = gl.load(CU_K + b + 1) - k_start
    hi = k_len
    full_hi = k_len
    if CAUSAL:
        first_pos = m0 + k_len - q_len
        last_pos = gl.minimum(m0 + BLOCK_M, q_len) - 1 + k_len - q_len
        hi = gl.maximum(gl.minimum(k_len, last_pos + 1), 0)
        full_hi = gl.maximum(gl.minimum(full_hi, first_pos + 1), 0)
    n_blocks = (hi + BLOCK_N - 1) // BLOCK_N
    n_full = full_hi // BLOCK_N
    return b, h, m0, q_start, q_len, k_start, k_len, n_blocks, n_full


@gluon.jit
def _loader_tile(desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty,
                 tile_id, CU_Q, CU_K, num_heads, group, num_m_blocks, num_tiles, tile_group, t, r, qi,
                 CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                 VT: gl.constexpr, DYNAMIC: gl.constexpr, PERM_K: gl.constexpr = False, LPT: gl.constexpr = False):
    """Tile t (the program's qi-th): Q once both consumers are done with the previous tile's (DYNAMIC: t written
    to tile_id for them first), then K_j and V_j into ring uses r, r + 1, ... -> the ring uses and tiles so far."""
    HALF: gl.constexpr = desc_q.block_type.shape[0]
    b, h, m0, q_start, q_len, k_start, k_len, n_blocks, n_full = _tile(t, CU_Q, CU_K, num_heads, num_m_blocks,
                                                                      num_tiles, tile_group, 2 * HALF, BLOCK_N, CAUSAL,
                                                                      LPT)
    if m0 < q_len:
        mbarrier.wait(q_empty, (qi & 1) ^ 1)
        if DYNAMIC:
            _write_tile(tile_id, t)
        mbarrier.expect(q_ready, 2 * desc_q.block_type.nbytes)  # releases the tile id to the consumers
        tma.async_copy_global_to_shared(desc_q, [q_start + m0, h * HEAD_DIM], q_ready, q_smem.index(0))
        tma.async_copy_global_to_shared(desc_q, [q_start + m0 + HALF, h * HEAD_DIM], q_ready, q_smem.index(1))
        k_col = (h // group) * HEAD_DIM
        v_row = k_start
        if VT:  # the sequence's first V^T column (v_col0)
            ALIGN: gl.constexpr = 32 if PERM_K else 16
            v_row = (k_start + ALIGN - 1) // ALIGN * ALIGN + ALIGN * b
        for j in range(n_blocks):
            _load_k(desc_k, k_smem, k_ready, kv_empty, k_start + j * BLOCK_N, k_col, r + j, STAGES)
            _load_v(desc_v, v_smem, v_ready, kv_empty, v_row + j * BLOCK_N, k_col, r + j, STAGES, VT)
        r += n_blocks
        qi += 1
    return r, qi


@gluon.jit
def _write_tile(tile_id, t):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    tile_id.store(gl.full([1], t, gl.int32, layout))


@gluon.jit
def _read_tile(tile_id):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    return gl.max(tile_id.load(layout), axis=0)


@gluon.jit
def _loader(desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, tile_id,
            CU_Q, CU_K, TILES, num_heads, group, num_m_blocks, num_tiles, tile_group, CAUSAL: gl.constexpr,
            BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, VT: gl.constexpr,
            PERSIST: gl.constexpr, PERM_K: gl.constexpr = False, LPT: gl.constexpr = False):
    """Q, then K and V tiles into the ring, tile after tile. The ring's use count runs on across a persistent
    program's tiles, so the next tile's Q and first K/V tiles load while the consumers finish this one.
    kv_empty[s] frees K slot s and kv_empty[STAGES + s] V slot s: a K tile is refilled once its S is computed,
    before the same block's PV product (measured 3-9% faster with the overlapped consumers than one barrier per
    slot). PERSIST 1 takes tiles pid, pid + programs, ...; PERSIST 2 claims each next tile from the counter
    TILES (one atomic per tile, so a program that ends early takes more), hands its id to the consumers through
    tile_id, and after the last claim hands them -1; the launch's last claim (the counter at num_tiles +
    programs - 1) sets the counter back to 0 for the next launch."""
    if PERSIST == 2:
        r = 0
        qi = 0
        t = gl.atomic_add(TILES, 1)
        while t < num_tiles:
            r, qi = _loader_tile(desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                                 kv_empty, tile_id, CU_Q, CU_K, num_heads, group, num_m_blocks, num_tiles,
                                 tile_group, t, r, qi, CAUSAL, BLOCK_N, HEAD_DIM, STAGES, VT, True, PERM_K, LPT)
            t = gl.atomic_add(TILES, 1)
        if t == num_tiles + gl.num_programs(0) - 1:
            gl.atomic_xchg(TILES, 0)
        mbarrier.wait(q_empty, (qi & 1) ^ 1)
        _write_tile(tile_id, -1)
        mbarrier.arrive(q_ready, count=1)
    elif PERSIST:
        r = 0
        qi = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            r, qi = _loader_tile(desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                                 kv_empty, tile_id, CU_Q, CU_K, num_heads, group, num_m_blocks, num_tiles,
                                 tile_group, t, r, qi, CAUSAL, BLOCK_N, HEAD_DIM, STAGES, VT, False, PERM_K, LPT)
    else:
        _loader_tile(desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty,
                     tile_id, CU_Q, CU_K, num_heads, group, num_m_blocks, num_tiles, tile_group, gl.program_id(0),
                     gl.to_tensor(0), gl.to_tensor(0), CAUSAL, BLOCK_N, HEAD_DIM, STAGES, VT, False, PERM_K, LPT)


@gluon.jit
def _softmax(qk, m_i, l_i, key0, qk_scale, q_pos, k_len, s_layout: gl.constexpr, MASKED: gl.constexpr,
             CAUSAL: gl.constexpr, P_SHIFT: gl.constexpr, SUM: gl.constexpr = True):
    """The online softmax of one block's raw scores qk (keys key0.., masked at k_len and causally at q_pos), in the
    log2 domain: p, the new row maximum and sum, and alpha, the factor that rescales what came before. SUM False:
    l_i comes back as it came (the caller sums p on the tensor cores, _step's ROWSUM)."""
    BLOCK_N: gl.constexpr = qk.shape[1]
    if MASKED:
        k_pos = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        ok = k_pos[None, :] < k_len
        if CAUSAL:
            ok = ok & (k_pos[None, :] <= q_pos[:, None])
        sc = gl.where(ok, qk * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = gl.exp2(sc - (m_safe - P_SHIFT)[:, None])
        alpha = gl.exp2(m_i - m_safe)
    else:  # every row sees every key: the new maximum is finite, the scale rides in the exponent's FMA
        m_new = gl.maximum(m_i, gl.max(qk, axis=1) * qk_scale)
        p = gl.exp2(qk * qk_scale - (m_new - P_SHIFT)[:, None])
        alpha = gl.exp2(m_i - m_new)
    if SUM:
        l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_i, alpha


@gluon.jit
def _p_operand(p, dtype: gl.constexpr, o_layout: gl.constexpr, PERM_K: gl.constexpr = False):
    """p as the register A operand of the PV product (32 bits of operand per register). PERM_K (fp8): the keys
    of each group of 32 reordered (key 16 hi + 8 i1 + 2 q + i0 to position 16 hi + 4 q + 2 i1 + i0, as
    transpose_v(perm=True) orders V^T's columns), so that each thread's scores already are its operand bytes:
    no shuffles between the accumulator's layout and the operand's."""
    K_WIDTH: gl.constexpr = 4 if dtype.primitive_bitwidth == 8 else 2
    p = p.to(dtype)
    if PERM_K:
        R: gl.constexpr = p.shape[0]
        N: gl.constexpr = p.shape[1]
        p = gl.reshape(gl.permute(gl.reshape(p, [R, N // 32, 2, 2, 4, 2]), [0, 1, 2, 4, 3, 5]), [R, N])
    return gl.convert_layout(p, gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=K_WIDTH))


@gluon.jit
def _qk(q, k_smem, k_ready, j, s_layout: gl.constexpr, STAGES: gl.constexpr):
    """Issue S = Q K^T for ring use j once its K tile has landed (asynchronous: wait on the result)."""
    HALF: gl.constexpr = q.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    mbarrier.wait(k_ready.index(j % STAGES), (j // STAGES) & 1)
    return warpgroup_mma(q, k_smem.index(j % STAGES).permute((1, 0)), gl.zeros([HALF, BLOCK_N], gl.float32, s_layout),
                         use_acc=False, is_async=True)


@gluon.jit
def _pv(p_op, v_smem, v_ready, acc, j, STAGES: gl.constexpr):
    """Issue O += P V for ring use j once its V tile has landed (asynchronous). fp8 V tiles are V^T ([D, BLOCK_N],
    keys contiguous): fp8 wgmma reads its B operand K-major only."""
    VT: gl.constexpr = v_smem.dtype.primitive_bitwidth == 8
    mbarrier.wait(v_ready.index(j % STAGES), (j // STAGES) & 1)
    if VT:
        acc = warpgroup_mma(p_op, v_smem.index(j % STAGES).permute((1, 0)), acc, is_async=True)
    else:
        acc = warpgroup_mma(p_op, v_smem.index(j % STAGES), acc, is_async=True)
    return acc


@gluon.jit
def _step(q, k_smem, v_smem, k_ready, v_ready, kv_empty, acc, l_i, m_i, j, key0, qk_scale, q_pos, k_len,
          s_layout: gl.constexpr, o_layout: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr,
          STAGES: gl.constexpr, P_SHIFT: gl.constexpr, ones_smem=None, ROWSUM: gl.constexpr = False,
          PERM_K: gl.constexpr = False):
    """One key block from ring use j, one product after the other: S = Q K^T, online softmax, O = O * alpha + P V.
    ROWSUM (fp8): l_i is a [rows, 8] accumulator and the row sums come from the tensor cores, P times the
    [BLOCK_N, 8] ones of ones_smem, beside P V: no add per score in the softmax, and the sums are those of the
    e4m3 P that P V reads."""
    qk = _qk(q, k_smem, k_ready, j, s_layout, STAGES)
    qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
    mbarrier.arrive(kv_empty.index(j % STAGES), count=1)  # K slot: S is done
    p, m_i, l_i, alpha = _softmax(qk, m_i, l_i, key0, qk_scale, q_pos, k_len, s_layout, MASKED, CAUSAL, P_SHIFT,
                                  not ROWSUM)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p_op = _p_operand(p, k_smem.dtype, o_layout, PERM_K)
    acc = _pv(p_op, v_smem, v_ready, acc, j, STAGES)
    if ROWSUM:
        l_layout: gl.constexpr = l_i.type.layout
        l_i = l_i * gl.convert_layout(alpha, gl.SliceLayout(1, l_layout))[:, None]
        l_op = gl.convert_layout(p_op, gl.DotOperandLayout(operand_index=0, parent=l_layout, k_width=4))
        # each block's sums from a zeroed accumulator, added in float32 here: fp8 wgmma's own adds keep too few
        # bits to carry a sum over thousands of keys (sums fell 6% short at 4096 keys)
        l_blk = warpgroup_mma(l_op, ones_smem.permute((1, 0)), gl.zeros(l_i.shape, gl.float32, l_layout),
                              use_acc=False, is_async=True)
        acc, l_blk = warpgroup_mma_wait(num_outstanding=0, deps=(acc, l_blk))
        l_i = l_i + l_blk
    else:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(kv_empty.index(STAGES + j % STAGES), count=1)
    return acc, l_i, m_i


@gluon.jit
def _overlapped_step(q, k_smem, v_smem, k_ready, v_ready, kv_empty, acc, p_lo, l_i, m_i, j, key0, qk_scale, q_pos,
                     k_len, s_layout: gl.constexpr, o_layout: gl.constexpr, MASKED: gl.constexpr,
                     CAUSAL: gl.constexpr, STAGES: gl.constexpr, P_SHIFT: gl.constexpr,
                     PERM_K: gl.constexpr = False):
    """Block j's S = Q K^T and block j - 1's O += P V issued together; block j's softmax runs while the tensor
    cores do the PV product, and O is rescaled once it is done. p_lo (block j - 1's P in the input dtype, in the
    scores' layout: converted to the PV operand here, where the fp8 conversion costs fewest byte permutes) comes in,
    block j's goes out."""
    qk = _qk(q, k_smem, k_ready, j, s_layout, STAGES)
    acc = _pv(_p_operand(p_lo, k_smem.dtype, o_layout, PERM_K), v_smem, v_ready, acc, j - 1, STAGES)
    qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk,))  # groups complete in order: S is ready, PV may run on
    mbarrier.arrive(kv_empty.index(j % STAGES), count=1)  # K slot: S is done
    p, m_i, l_i, alpha = _softmax(qk, m_i, l_i, key0, qk_scale, q_pos, k_len, s_layout, MASKED, CAUSAL, P_SHIFT)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(kv_empty.index(STAGES + (j - 1) % STAGES), count=1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    return acc, p.to(k_smem.dtype), l_i, m_i


@gluon.jit
def _consumer_tile(q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, O, LSE, QD, KD, VD,
                   ds_heads, CU_Q, CU_K, stride_ot, stride_oh, num_heads, group, num_m_blocks, num_tiles, tile_group,
                   t, r, qi, qk_scale,
                   CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, HALF_ID: gl.constexpr, BLOCK_N: gl.constexpr,
                   HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, OVERLAP: gl.constexpr, WAIT_Q: gl.constexpr,
                   ones_smem, ROWSUM: gl.constexpr, PERM_K: gl.constexpr, LPT: gl.constexpr = False):
    """Tile t (the program's qi-th) from ring use r: this consumer's 64 query rows of it -> the ring uses and
    tiles so far. WAIT_Q 0: the caller has waited for its Q already (it read the tile's id after that wait)."""
    HALF: gl.constexpr = q_smem.shape[1]
    FP8: gl.constexpr = k_smem.dtype.primitive_bitwidth == 8
    KW: gl.constexpr = 256 // k_smem.dtype.primitive_bitwidth  # wgmma's K per instruction
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, KW])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, KW])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    # fp8: P is rounded to e4m3 for the PV product, taken as 2^P_SHIFT * p (<= 256, inside e4m3's range) so that
    # small probabilities keep their mantissa instead of falling into e4m3's subnormals; the row sums carry the
    # same factor and it cancels in O / l
    P_SHIFT: gl.constexpr = 8.0 if FP8 else 0.0
    b, h, m0, q_start, q_len, k_start, k_len, n_blocks, n_full = _tile(t, CU_Q, CU_K, num_heads, num_m_blocks,
                                                                      num_tiles, tile_group, 2 * HALF, BLOCK_N, CAUSAL,
                                                                      LPT)
    if m0 < q_len:
        hk = h // group
        scale = qk_scale
        if FP8:  # descales: bit i of ds_heads set where q's (0), k's (1), v's (2) has one value per head
            scale = qk_scale * gl.load(QD + h * (ds_heads & 1)) * gl.load(KD + hk * ((ds_heads >> 1) & 1))
        r0 = m0 + HALF_ID * HALF
        q_pos = r0 + gl.arange(0, HALF, layout=row_s) + (k_len - q_len)  # bottom-right aligned kv positions
        m_i = gl.full([HALF], float("-inf"), gl.float32, row_s)
        if ROWSUM:
            l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, 8, KW])
            l_i = gl.zeros([HALF, 8], gl.float32, l_layout)
        else:
            l_i = gl.zeros([HALF], gl.float32, row_s)
        acc = gl.zeros([HALF, HEAD_DIM], gl.float32, o_layout)
        q = q_smem.index(HALF_ID)
        if WAIT_Q:
            mbarrier.wait(q_ready, qi & 1)
        if OVERLAP:
            if n_blocks > 0:  # block 0 through the masked softmax (any block may), then one block behind on PV
                qk = warpgroup_mma_wait(num_outstanding=0, deps=(_qk(q, k_smem, k_ready, r, s_layout, STAGES),))
                mbarrier.arrive(kv_empty.index(r % STAGES), count=1)
                p, m_i, l_i, alpha = _softmax(qk, m_i, l_i, 0, scale, q_pos, k_len, s_layout, True, CAUSAL,
                                              P_SHIFT)
                p_lo = p.to(k_smem.dtype)
                for j in range(1, n_full):
                    acc, p_lo, l_i, m_i = _overlapped_step(q, k_smem, v_smem, k_ready, v_ready, kv_empty, acc,
                                                          p_lo, l_i, m_i, r + j, j * BLOCK_N, scale, q_pos,
                                                          k_len, s_layout, o_layout, False, CAUSAL, STAGES,
                                                          P_SHIFT, PERM_K)
                for j in range(gl.maximum(n_full, 1), n_blocks):
                    acc, p_lo, l_i, m_i = _overlapped_step(q, k_smem, v_smem, k_ready, v_ready, kv_empty, acc,
                                                          p_lo, l_i, m_i, r + j, j * BLOCK_N, scale, q_pos,
                                                          k_len, s_layout, o_layout, True, CAUSAL, STAGES,
                                                          P_SHIFT, PERM_K)
                mbarrier.arrive(q_empty, count=1)  # every S of the tile is done: Q may be refilled
                acc = _pv(_p_operand(p_lo, k_smem.dtype, o_layout, PERM_K), v_smem, v_ready, acc,
                          r + n_blocks - 1, STAGES)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(kv_empty.index(STAGES + (r + n_blocks - 1) % STAGES), count=1)
            else:
                mbarrier.arrive(q_empty, count=1)
        else:
            for j in range(n_full):
                acc, l_i, m_i = _step(q, k_smem, v_smem, k_ready, v_ready, kv_empty, acc, l_i, m_i, r + j,
                                      j * BLOCK_N, scale, q_pos, k_len, s_layout, o_layout, False, CAUSAL, STAGES,
                                      P_SHIFT, ones_smem, ROWSUM, PERM_K)
            for j in range(n_full, n_blocks):
                acc, l_i, m_i = _step(q, k_smem, v_smem, k_ready, v_ready, kv_empty, acc, l_i, m_i, r + j,
                                      j * BLOCK_N, scale, q_pos, k_len, s_layout, o_layout, True, CAUSAL, STAGES,
                                      P_SHIFT, ones_smem, ROWSUM, PERM_K)
            mbarrier.arrive(q_empty, count=1)
            if ROWSUM:  # every column of the [rows, 8] product holds the row sum
                l_i = gl.convert_layout(gl.max(l_i, axis=1), row_s)
        r += n_blocks
        qi += 1

        empty = l_i == 0.0  # a query that sees no key: o = 0, lse = -inf
        l_safe = gl.where(empty, 1.0, l_i)
        o = acc / gl.convert_layout(l_safe, row_o)[:, None]
        if FP8:
            o = o * gl.load(VD + hk * ((ds_heads >> 2) & 1))
        rows = r0 + gl.arange(0, HALF, layout=row_o)
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        o_ptrs = O + (q_start + rows).to(gl.int64)[:, None] * stride_ot + h * stride_oh + cols[None, :]
        gl.store(o_ptrs, o.to(O.dtype.element_ty), mask=(rows < q_len)[:, None])
        if WRITE_LSE:
            rows_s = r0 + gl.arange(0, HALF, layout=row_s)
            lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe) - P_SHIFT) * LN2)
            gl.store(LSE + (q_start + rows_s).to(gl.int64) * num_heads + h, lse, mask=rows_s < q_len)
    return r, qi


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, tile_id, O, LSE, QD, KD, VD,
              ds_heads, CU_Q, CU_K, stride_ot, stride_oh, num_heads, group, num_m_blocks, num_tiles, tile_group,
              qk_scale, CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, HALF_ID: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, OVERLAP: gl.constexpr, PERSIST: gl.constexpr,
              ones_smem, ROWSUM: gl.constexpr, PERM_K: gl.constexpr, LPT: gl.constexpr = False):
    if PERSIST == 2:  # tiles as the loader claims them: each one's id comes with its Q, -1 after the last
        r = 0
        qi = 0
        mbarrier.wait(q_ready, 0)
        t = _read_tile(tile_id)
        while t >= 0:
            r, qi = _consumer_tile(q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, O, LSE,
                                   QD, KD, VD, ds_heads, CU_Q, CU_K, stride_ot, stride_oh, num_heads, group,
                                   num_m_blocks, num_tiles, tile_group, t, r, qi, qk_scale, CAUSAL, WRITE_LSE, HALF_ID,
                                   BLOCK_N, HEAD_DIM, STAGES, OVERLAP, False, ones_smem, ROWSUM, PERM_K, LPT)
            mbarrier.wait(q_ready, qi & 1)
            t = _read_tile(tile_id)
    elif PERSIST:
        r = 0
        qi = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            r, qi = _consumer_tile(q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, O, LSE,
                                   QD, KD, VD, ds_heads, CU_Q, CU_K, stride_ot, stride_oh, num_heads, group,
                                   num_m_blocks, num_tiles, tile_group, t, r, qi, qk_scale, CAUSAL, WRITE_LSE, HALF_ID,
                                   BLOCK_N, HEAD_DIM, STAGES, OVERLAP, True, ones_smem, ROWSUM, PERM_K, LPT)
    else:
        _consumer_tile(q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, O, LSE, QD, KD, VD,
                       ds_heads, CU_Q, CU_K, stride_ot, stride_oh, num_heads, group, num_m_blocks, num_tiles,
                       tile_group,
                       gl.program_id(0), gl.to_tensor(0), gl.to_tensor(0), qk_scale, CAUSAL, WRITE_LSE, HALF_ID,
                       BLOCK_N, HEAD_DIM, STAGES, OVERLAP, True, ones_smem, ROWSUM, PERM_K, LPT)


# follow max_seqlen_q and the lengths: a new length never recompiles
@gluon.jit(do_not_specialize=["num_m_blocks", "num_tiles", "tile_group"])
def flash_fwd_ws_kernel(desc_q, desc_k, desc_v, O, LSE, QD, KD, VD, ds_heads, CU_Q, CU_K, TILES, stride_ot,
                        stride_oh, num_heads, group, num_m_blocks, num_tiles, tile_group, qk_scale,
                        CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                        STAGES: gl.constexpr, OVERLAP: gl.constexpr, PERSIST: gl.constexpr,
                        ROWSUM: gl.constexpr = False, ONES_LAYOUT: gl.constexpr = None, PERM_K: gl.constexpr = False,
                        LPT: gl.constexpr = False):
    """A program takes tile pid (``_tile``), or with PERSIST (a grid of one program per SM) tiles one after
    another: pid, pid + programs, ... (1) or as claimed from the counter TILES (2, ``_loader``). Then the loader
    loads the next tile's Q once this one's last S is computed, and its K/V tiles as ring slots free, while the
    consumers finish this tile. ROWSUM (fp8, OVERLAP 0): the row sums on the tensor cores (_step), from a
    [8, BLOCK_N] tile of ones in shared memory (ONES_LAYOUT). PERM_K (fp8): V^T from transpose_v(perm=True),
    P's keys in the same order (_p_operand). LPT: _tile's order of causal tiles."""
    HALF: gl.constexpr = desc_q.block_type.shape[0]
    dtype: gl.constexpr = desc_k.dtype
    VT: gl.constexpr = dtype.primitive_bitwidth == 8  # fp8: V comes transposed (ws_descriptors)
    V_ROWS: gl.constexpr = desc_v.block_type.shape[0]
    V_COLS: gl.constexpr = desc_v.block_type.shape[1]
    q_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], desc_q.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], desc_k.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, V_ROWS, V_COLS], desc_v.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # both consumers' last S done
    tile_id = gl.allocate_shared_memory(gl.int32, [1], gl.SwizzledSharedLayout(1, 1, 1, [0]))  # PERSIST 2
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())  # K slots, V slots
    mbarrier.init(q_ready, count=1)
    mbarrier.init(q_empty, count=2)  # one arrival per consumer
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)
        mbarrier.init(kv_empty.index(STAGES + i), count=2)
    if ROWSUM:
        gl.static_assert(VT and not OVERLAP, "ROWSUM is built for fp8 without OVERLAP")
        ones_smem = gl.allocate_shared_memory(dtype, [8, BLOCK_N], ONES_LAYOUT)
        ones_layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
        # e4m3 1.0 is the byte 0x38, stored as bytes: a converted constant came out with its upper half
        # undefined (sm_90, ptxas merged the packed conversion with an unrelated register)
        ones_smem.store(gl.full([8, BLOCK_N], 0x38, gl.int8, ones_layout).to(dtype, bitcast=True))
        fence_async_shared()  # the tile is read by wgmma (the async proxy)
    else:
        ones_smem = tile_id

    gl.warp_specialize([
        (_loader, (desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty,
                   tile_id, CU_Q, CU_K, TILES, num_heads, group, num_m_blocks, num_tiles, tile_group, CAUSAL, BLOCK_N,
                   HEAD_DIM, STAGES, VT, PERSIST, PERM_K, LPT)),
        (_consumer, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, tile_id, O, LSE,
                     QD, KD, VD, ds_heads, CU_Q, CU_K, stride_ot, stride_oh, num_heads, group, num_m_blocks,
                     num_tiles, tile_group,
                     qk_scale, CAUSAL, WRITE_LSE, 0, BLOCK_N, HEAD_DIM, STAGES, OVERLAP, PERSIST, ones_smem,
                     ROWSUM, PERM_K, LPT)),
        (_consumer, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, tile_id, O, LSE,
                     QD, KD, VD, ds_heads, CU_Q, CU_K, stride_ot, stride_oh, num_heads, group, num_m_blocks,
                     num_tiles, tile_group,
                     qk_scale, CAUSAL, WRITE_LSE, 1, BLOCK_N, HEAD_DIM, STAGES, OVERLAP, PERSIST, ones_smem,
                     ROWSUM, PERM_K, LPT)),
    ], [4, 4], [240, 240])


@triton.jit
def v_col0(k_start, b, ALIGN: tl.constexpr = 16):
    """The first V^T column of sequence b: TMA wants a tile's innermost start 16-byte aligned, so each sequence
    starts at a multiple of ALIGN (16, or 32 for keys permuted in groups of 32), after at least the previous one's
    tokens (ceilA(x) - ceilA(y) + A > x - y)."""
    return (k_start + ALIGN - 1) // ALIGN * ALIGN + ALIGN * b


@triton.jit
def _transpose_v_kernel(V, VT, CU_K, stride_vt, stride_vh, width, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr,
                        PERM: tl.constexpr = False):
    """Sequence b's v rows [T, kv heads, D] (bytes) -> columns v_col0(b) .. v_col0(b + 1) of vt [kv heads * D,
    width]: its tokens, then zeros up to the next sequence (the kernel's last tile reads them; p is 0 there, and 0
    times a NaN byte pattern would not be). PERM: sequences 32-aligned, and within each group of 32 keys key
    16 hi + 8 i1 + 2 q + i0 goes to column 16 hi + 4 q + 2 i1 + i0 (``_p_operand``'s order)."""
    c = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    b = tl.program_id(1)
    h = tl.program_id(2)
    k_start = tl.load(CU_K + b)
    k_len = tl.load(CU_K + b + 1) - k_start
    ALIGN: tl.constexpr = 32 if PERM else 16
    col0 = v_col0(k_start, b, ALIGN)
    n = v_col0(k_start + k_len, b + 1, ALIGN) - col0
    if tl.program_id(0) * BLOCK_T < n:
        d = tl.arange(0, HEAD_DIM)
        key = c
        if PERM:  # column 16 hi + 4 q + 2 i1 + i0 of a group holds its key 16 hi + 8 i1 + 2 q + i0; permuting the
            # rows read (not the columns written) keeps the store contiguous along the keys, so it vectorizes
            y = c % 32
            key = c - y + (y // 16) * 16 + ((y // 2) % 2) * 8 + ((y // 4) % 4) * 2 + y % 2
        tile = tl.load(V + (k_start + key).to(tl.int64)[:, None] * stride_vt + h * stride_vh + d[None, :],
                       mask=(key < k_len)[:, None], other=0)
        dst = VT + (h * HEAD_DIM + d).to(tl.int64)[:, None] * width + (col0 + c)[None, :]
        tl.store(dst, tl.trans(tile), mask=(c < n)[None, :])


def transpose_v(v, cu_k, max_seqlen_k, perm=False):
    """fp8 v [T, kv heads, D] -> V^T [kv heads * D, ceilA(T) + A * batch], keys contiguous (the layout fp8 wgmma
    reads its B operand in), sequence b from column ``v_col0`` on (A = 16; with ``perm`` 32, the keys of each
    group of 32 in ``_p_operand``'s order); a copy."""
    T, H, D = v.shape
    batch = cu_k.shape[0] - 1
    align = 32 if perm else 16
    width = (T + align - 1) // align * align + align * batch
    vt = torch.empty(H * D, width, dtype=v.dtype, device=v.device)
    # a sequence spans at most its length + 2 align - 1 columns
    grid = (triton.cdiv(max_seqlen_k + 2 * align - 1, 64), batch, H)
    _transpose_v_kernel[grid](v.view(torch.uint8), vt.view(torch.uint8), cu_k, v.stride(0), v.stride(1), width,
                              HEAD_DIM=D, BLOCK_T=64, PERM=perm, num_warps=4)
    return vt


def ws_descriptors(q, k, v, block_n, cu_k=None, max_seqlen_k=0, perm=0):
    """Gluon TMA descriptors over Q, K, V viewed as [tokens, heads * D] (64-row Q tiles, block_n-row K/V tiles),
    or None where that view does not exist: heads not packed, rows or base not 16-byte aligned, or no tokens.
    fp8: V is read as V^T (``transpose_v`` over cu_k, a copy) in [D, block_n] tiles, its keys in _p_operand's
    order where perm (launch_ws must get the same perm)."""
    D = q.shape[2]
    descs = []
    for t in (q, k, v):
        if (t.stride(2) != 1 or t.stride(1) != D or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16
                or t.shape[0] == 0):
            return None
    for t, rows in ((q, 64), (k, block_n)):
        descs.append(row_descriptor(t, [t.shape[0], t.shape[1] * D], t.stride(0), rows))
    if v.dtype == torch.float8_e4m3fn:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        vt = transpose_v(v, cu_k, max_seqlen_k, perm=bool(perm))
        descs.append(TensorDescriptor(vt, list(vt.shape), [vt.shape[1], 1], [D, block_n],
                                      smem_layout(D, block_n, v.dtype)))
    else:
        descs.append(row_descriptor(v, [v.shape[0], v.shape[1] * D], v.stride(0), block_n))
    return descs


# fp8 without OVERLAP and without an LSE: the softmax's row sums on the tensor cores (see _step), which frees the
# consumers' adds at head dim 128, where the exponentials and the fp8 wgmma are about equally fast. They sum the
# e4m3-rounded P that P V reads (o normalized consistently), so an LSE from them could be off by log(1 + 2^-4) on
# rows with few keys: calls that ask for the LSE sum the float32 P
FP8_ROWSUM = True

# Causal tiles claimed from the counter (PERSIST 2) in groups of up to this many (sequence, head) pairs, query
# blocks slowest within a group, heaviest first (_tile's LPT; 0: each head's blocks together), so the last claims
# are the lightest tiles; as many pairs as keep their K/V within TILE_GROUP_L2_BYTES (the group's K/V is read by
# all of its tiles at once). Not for a static round-robin (PERSIST 0 and 1), whose programs it loads unevenly.
CAUSAL_TILE_GROUP = 8
TILE_GROUP_L2_BYTES = 24 << 20


def tile_group(k_tokens: int, batch: int, head_dim: int, elem_bytes: int, group: int) -> int:
    """Pairs per group of claimed causal tiles: K/V bytes of one (sequence, query head) pair at the mean key
    length (a kv head's over its group of query heads), as many as TILE_GROUP_L2_BYTES holds, 1..CAUSAL_TILE_GROUP."""
    pair = max(1, k_tokens // max(batch, 1) * head_dim * 2 * elem_bytes // group)
    return max(1, min(CAUSAL_TILE_GROUP, TILE_GROUP_L2_BYTES // pair))


def launch_ws(descs, out, lse, cu_q, cu_k, max_seqlen_q, num_heads, group, qk_scale, causal, block_n, stages,
              overlap=0, persist=0, perm=0, descales=None):
    """Launch flash_fwd_ws_kernel over descriptors from ``ws_descriptors``; qk_scale includes log2(e); descales
    (fp8): (q's, k's, v's float32 descale tensors, heads), each tensor one value or one per head, heads' bit 0 / 1
    / 2 set where q's / k's / v's is per head (``prefill._descales``). persist 0: one program per tile; 1: one
    program per SM looping over the tiles, pid, pid + programs, ...; 2: the same, each program claiming its next
    tile from a counter (the stream's, ``split_counters(..., purpose="prefill tiles")``; 1 where there is none,
    under a capture that has not made it). perm (fp8): V^T's keys permuted (ws_descriptors' perm)."""
    D = out.shape[2]
    num_m = triton.cdiv(max_seqlen_q, 128)
    batch = cu_q.shape[0] - 1
    num_tiles = num_m * batch * num_heads
    tiles = cu_q  # unused unless persist == 2
    if persist == 2:
        tiles = split_counters(out.device, 1, "prefill tiles")
        if tiles is None:
            tiles, persist = cu_q, 1
    grid = min(num_tiles, num_sms(out.device)) if persist else num_tiles
    fp8 = descs[1].base.dtype == torch.float8_e4m3fn
    rowsum = FP8_ROWSUM and fp8 and not overlap and lse is None
    lpt = bool(causal) and persist == 2 and CAUSAL_TILE_GROUP > 0
    k = descs[1].base
    groups = tile_group(k.shape[0], batch, D, k.element_size(), group) if lpt else 1
    flash_fwd_ws_kernel[(grid,)](
        *descs, out, lse if lse is not None else out, *(descales if descales is not None else (cu_q, cu_q, cu_q, 0)),
        cu_q, cu_k, tiles,
        out.stride(0), out.stride(1), num_heads, group, num_m, num_tiles, groups, qk_scale, CAUSAL=bool(causal),
        WRITE_LSE=lse is not None, BLOCK_N=block_n, HEAD_DIM=D, STAGES=stages, OVERLAP=bool(overlap),
        PERSIST=int(persist), ROWSUM=rowsum, ONES_LAYOUT=smem_layout(8, block_n, torch.float8_e4m3fn) if rowsum else None,
        PERM_K=bool(perm) and fp8, LPT=lpt, num_warps=4)


def compile_sm90(block_n=128, stages=2, head_dim=128, causal=False, dtype="fp16", overlap=False, persist=0,
                 rowsum=None, perm=0, lpt=None):
    """flash_fwd_ws_kernel compiled for sm_90 without a GPU (see _gluon.compile_sm90); dtype "fp16", "bf16" or
    "fp8e4nv" (V^T tiles, bf16 output). With the row sums (fp8 without OVERLAP, by default) the build writes no
    LSE, as launched."""
    fp8 = dtype == "fp8e4nv"
    kv_desc = tile_desc_type(dtype, block_n, head_dim)
    sig = {"desc_q": tile_desc_type(dtype, 64, head_dim), "desc_k": kv_desc,
           "desc_v": tile_desc_type(dtype, head_dim, block_n) if fp8 else kv_desc, "O": "*bf16" if fp8 else f"*{dtype}",
           "LSE": "*fp32", "QD": "*fp32", "KD": "*fp32", "VD": "*fp32", "ds_heads": "i32", "CU_Q": "*i32",
           "CU_K": "*i32", "TILES": "*i32", "stride_ot": "i32", "stride_oh": "i32",
           "num_heads": "i32", "group": "i32", "num_m_blocks": "i32", "num_tiles": "i32", "tile_group": "i32",
           "qk_scale": "fp32"}
    rowsum = FP8_ROWSUM and fp8 and not overlap if rowsum is None else rowsum
    perm = bool(perm) and fp8
    # as launched: the row sums serve calls without an LSE
    consts = {"CAUSAL": int(causal), "WRITE_LSE": int(not rowsum), "BLOCK_N": block_n, "HEAD_DIM": head_dim, "STAGES": stages,
              "OVERLAP": int(overlap), "PERSIST": int(persist), "ROWSUM": int(rowsum),
              "ONES_LAYOUT": smem_layout(8, block_n, torch.float8_e4m3fn) if rowsum else None, "PERM_K": int(perm),
              "LPT": bool(causal and persist == 2 and CAUSAL_TILE_GROUP > 0) if lpt is None else lpt}
    return _compile_sm90(flash_fwd_ws_kernel, sig, consts)
