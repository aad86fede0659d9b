"""Host side of paged attention: checks, launches per plan, split-KV combine, torch.library registration."""
from __future__ import annotations

import torch
import triton

from .._checks import _capturing, _capturing_compile, call_op, check_device, check_tensor, interpreter_mode
from .._pdl import pdl_options, pdl_supported
from .._runtime import num_sms, split_counters
from ..kv_cache import FP8_DTYPES, as_scale_tensor
from .plan import PagedAttentionPlan, plan_paged_attention
from .prefill import _check_softcap, _check_window, check_attention_inputs, output_buffers


def _fp8_mode(kv_dtype) -> int:
    from .paged_kernel import FP8_E4M3_INT, FP8_E4M3_PTX, FP8_E5M2, FP8_OFF

    if kv_dtype == torch.float8_e5m2:
        return FP8_E5M2
    if kv_dtype == torch.float8_e4m3fn:
        return FP8_E4M3_INT if interpreter_mode() else FP8_E4M3_PTX
    return FP8_OFF


def _check_fp8_words(name, cache):
    """The kernel reads fp8 caches as aligned 16-byte vectors of 32-bit words: a view that breaks that is an error."""
    strides = cache.stride()[:3]
    if any(st % 16 for st in strides) or (not _capturing_compile() and cache.data_ptr() % 16):
        raise ValueError(f"{name}: an fp8 cache must start on a 16-byte boundary and have page, slot and head strides "
                         f"that are multiples of 16 elements; got strides {strides}"
                         + ("" if _capturing_compile() else f", data_ptr % 16 = {cache.data_ptr() % 16}"))


# PDL of the Gluon decode kernel (paged_decode_ws_kernel's PDL: 0 off, 1 wait, 2 wait and let the next launch) and
# of combine_kernel after it: mode 1 with combine's PDL measured fastest at batch 1 (bench/NOTES.md)
WS_PDL = 1
COMBINE_PDL = True


def _ws_decode_call(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, out, tiles, num_splits, ws_o, ws_lse,
                    scale, sms, balanced, k_scale=1.0, v_scale=1.0, maxnreg=None, mixed=False, softcap=0.0, left=-1):
    """The persistent Gluon decode kernel (paged_ws.py), its split partials merged by combine_kernel (the balanced
    split merges its cut units itself); False (nothing launched) where the caches have no TMA view (or, for page
    sizes it gathers by rows, a layout the gather cannot read). ``mixed``: a mixed batch's decodes (the Triton
    kernel runs beside them: fp8 keeps the smaller ring, 16-bit caches the ring of four slots refilled whole, which
    measured faster there than the V copies behind K). ``softcap``, ``left``: the call's soft cap and left window
    (a window runs the plan's split units: the balanced split's tables cover every key)."""
    from .paged_kernel import combine_kernel
    from .paged_ws import gather_caches, launch_decode_ws, page_descriptors
    from .schedule import fp8_ring, tma_pages

    gather = not tma_pages(k_cache.shape[1])  # other page sizes: rows gathered with cp.async
    descs = gather_caches(k_cache, v_cache) if gather else page_descriptors(k_cache, v_cache, 64)
    if descs is None:
        return False
    total_q, Hq, D = q.shape
    split = num_splits > 1
    pdl = pdl_supported(q.device) and not mixed
    if balanced and left < 0:
        # the balanced split merges the pieces of cut units with the counters; without them, the plan's split-KV
        counters = split_counters(q.device)
        if counters is not None and tiles[0].numel() * k_cache.shape[2] <= counters.numel():
            launch_decode_ws(q, descs, balanced[1], balanced[2], page_table, seq_lens, cu_seqlens_q, tiles[0],
                             tiles[2], k_cache.shape[0], k_cache.shape[1], 1, scale * 1.4426950408889634, sms,
                             out=out, counters=counters, balanced=(balanced[0], tiles[0].numel()), k_scale=k_scale,
                             v_scale=v_scale, maxnreg=maxnreg, gather=gather, pdl=WS_PDL if pdl else 0,
                             softcap=softcap)
            return True
    # split partials merge in combine_kernel, as the Triton kernel's: H100, bf16 page 16, graph-timed, B=1 L=32768
    # (16 splits) 54.0 us against 55.5 with the merge by the last split program, B=4 L=8192 53.2 against 54.9
    fp8 = k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    # fp8 TMA pages: schedule.fp8_ring's depth (two consumers; or one taking several units, counted at the plan's
    # tile capacity); the row gather (page sizes 1, 3, ...) keeps the default ring, which its tests cover
    deep = fp8 and not mixed and not gather
    stages = fp8_ring(tiles[0].numel() * k_cache.shape[2] * num_splits, sms, Hq // k_cache.shape[2]) if deep else None
    launch_decode_ws(q, descs, ws_o if split else out, ws_lse, page_table, seq_lens, cu_seqlens_q, tiles[0],
                     tiles[2], k_cache.shape[0], k_cache.shape[1], num_splits, scale * 1.4426950408889634, sms,
                     k_scale=k_scale, v_scale=v_scale, maxnreg=maxnreg, gather=gather, stages=stages,
                     pdl=WS_PDL if pdl else 0, consumers=1 if mixed else None, softcap=softcap, left=left,
                     lead=-1 if mixed else None)
    if split:
        cp = pdl and COMBINE_PDL
        combine_kernel[(total_q, Hq)](
            ws_o, ws_lse, out, out, q, ws_o.stride(0), ws_o.stride(1), ws_o.stride(2), ws_lse.stride(0),
            out.stride(0), out.stride(1), Hq, num_splits, SPLITS_P2=max(2, triton.next_power_of_2(num_splits)),
            HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)), HAS_SINK=False, WRITE_LSE=False, PDL=cp,
            num_warps=4, **pdl_options(cp))
    return True


def _launch_all(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, out, lse, write_lse, tiles, configs,
                num_splits, ws_o, ws_lse, causal, scale, left, right, softcap, sinks, k_scale, v_scale, k_scale_f,
                v_scale_f, custom_mask, ws_decode=False, balanced=(), ws_maxnreg=0):
    if q.shape[0] == 0:
        return
    launches = range(len(configs) // 6)
    side = None
    # one query per sequence at its last position: a right window edge never hides a key; the rest it cannot take
    if ws_decode and sinks is None and custom_mask is None and not write_lse:
        mixed = len(configs) // 6 > 1  # the plan's long tiles (mixed batch) run on the Triton kernel beside it
        if mixed:
            side = _side_stream(q.device)
            side.wait_stream(torch.cuda.current_stream(q.device))
        if _ws_decode_call(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, out, tiles, num_splits, ws_o,
                           ws_lse, scale, num_sms(q.device), balanced, k_scale if k_scale is not None else k_scale_f,
                           v_scale if v_scale is not None else v_scale_f, ws_maxnreg or None, mixed, softcap,
                           left):
            if not mixed:
                return
            if num_splits > 1:
                raise RuntimeError("a mixed plan on the Gluon decode kernel must not split KV")
            launches = range(1, len(configs) // 6)
        else:
            side = None
    if side is not None:
        with torch.cuda.stream(side):
            _launch_triton(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, out, lse, write_lse, tiles,
                           configs, num_splits, ws_o, ws_lse, causal, scale, left, right, softcap, sinks, k_scale,
                           v_scale, k_scale_f, v_scale_f, custom_mask, launches)
        torch.cuda.current_stream(q.device).wait_stream(side)
        return
    _launch_triton(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, out, lse, write_lse, tiles, configs,
                   num_splits, ws_o, ws_lse, causal, scale, left, right, softcap, sinks, k_scale, v_scale, k_scale_f,
                   v_scale_f, custom_mask, launches)


_SIDE_STREAMS: dict = {}


def _side_stream(device) -> torch.cuda.Stream:
    """A second stream per device for the long tiles of a mixed batch (made once, reused by every call)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SIDE_STREAMS:
        _SIDE_STREAMS[idx] = torch.cuda.Stream(device=idx)
    return _SIDE_STREAMS[idx]


def _launch_triton(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, out, lse, write_lse, tiles, configs,
                   num_splits, ws_o, ws_lse, causal, scale, left, right, softcap, sinks, k_scale, v_scale, k_scale_f,
                   v_scale_f, custom_mask, launches):
    """The Triton kernel over the plan's launches ``launches`` (indices), then the split-KV merge."""
    from .paged_kernel import combine_kernel, paged_attn_kernel

    total_q, Hq, D = q.shape
    Hkv, page_size = k_cache.shape[2], k_cache.shape[1]
    if causal and custom_mask is None:
        right = 0 if right < 0 else min(right, 0)
    split = num_splits > 1
    o_buf, lse_buf = (ws_o, ws_lse) if split else (out, lse)
    qk_scale = scale if softcap > 0 else scale * 1.4426950408889634
    scale_ptrs = k_scale is not None
    mask = custom_mask.view(torch.uint8) if custom_mask is not None else q
    # PDL: wait for the previous kernel (1); with split-KV over few programs (batch-1 decode), also let the next
    # kernel (combine_kernel) launch once the key loops are done (2). At B=16 (fp8, page 1, back-to-back calls) 2
    # took 79.8 us against 62.5 (bench/NOTES.md)
    pdl = 0
    if pdl_supported(q.device):
        pdl = 2 if split and 2 * max(configs[5::6]) * Hkv <= num_sms(q.device) else 1
    for i in launches:
        block_q, block_m, block_n, warps, stages, cap = configs[6 * i:6 * i + 6]
        tile_seq, tile_q, num_tiles = tiles[3 * i:3 * i + 3]
        paged_attn_kernel[(cap, Hkv, num_splits)](
            q, k_cache, v_cache, o_buf, lse_buf, sinks if sinks is not None else q,
            k_scale if scale_ptrs else q, v_scale if scale_ptrs else q, mask, page_table, seq_lens,
            cu_seqlens_q, tile_seq, tile_q, num_tiles,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            o_buf.stride(0) if split else 0, o_buf.stride(-3), o_buf.stride(-2),
            lse_buf.stride(0) if split else 0, page_table.stride(0),
            custom_mask.stride(0) if custom_mask is not None else 0,
            Hq, qk_scale, softcap, left, right, k_scale_f, v_scale_f, num_splits,
            GROUP=Hq // Hkv, HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_Q=block_q,
            BLOCK_M=block_m, BLOCK_N=block_n, PAGE_SIZE=page_size,
            HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, SOFTCAP=softcap > 0,
            HAS_SINK=sinks is not None and not split, CUSTOM_MASK=custom_mask is not None,
            SCALE_PTRS=scale_ptrs, WRITE_LSE=split or write_lse, FP8=_fp8_mode(k_cache.dtype), PDL=pdl,
            num_warps=warps, num_stages=stages, **pdl_options(pdl > 0))
    if split:
        combine_kernel[(total_q, Hq)](
            ws_o, ws_lse, out, lse, sinks if sinks is not None else q,
            ws_o.stride(0), ws_o.stride(1), ws_o.stride(2), ws_lse.stride(0), out.stride(0), out.stride(1), Hq,
            num_splits, SPLITS_P2=max(2, triton.next_power_of_2(num_splits)), HEAD_DIM=D,
            BLOCK_D=max(16, triton.next_power_of_2(D)), HAS_SINK=sinks is not None, WRITE_LSE=write_lse,
            PDL=pdl > 0, num_warps=4, **pdl_options(pdl > 0))


def _paged_attention_impl(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                        seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                        write_lse: bool, tiles: list[torch.Tensor], configs: list[int], num_splits: int,
                        ws_o: torch.Tensor | None, ws_lse: torch.Tensor | None, causal: bool, scale: float,
                        left: int, right: int, softcap: float, sinks: torch.Tensor | None,
                        k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, k_scale_f: float,
                        v_scale_f: float, custom_mask: torch.Tensor | None, ws_decode: bool,
                        balanced: list[torch.Tensor], ws_maxnreg: int) -> None:
    _launch_all(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, out, lse, write_lse, tiles, configs,
                num_splits, ws_o, ws_lse, causal, scale, left, right, softcap, sinks, k_scale, v_scale, k_scale_f,
                v_scale_f, custom_mask, ws_decode, balanced, ws_maxnreg)


_paged_attention_op = torch.library.custom_op("llmkernels::paged_attention_out",
                                              mutates_args=("out", "lse"))(_paged_attention_impl)


@_paged_attention_op.register_fake
def _(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, out, lse, write_lse, tiles, configs, num_splits,
      ws_o, ws_lse, causal, scale, left, right, softcap, sinks, k_scale, v_scale, k_scale_f, v_scale_f, custom_mask,
      ws_decode, balanced, ws_maxnreg):
    return None


def _validate_pages(page_table, seq_lens, cu_seqlens_q, num_pages, page_size, total_q, max_seqlen_q):
    """Checks that cost a device sync (skipped inside CUDA-graph capture and torch.compile)."""
    max_pages = page_table.shape[1]
    lens = seq_lens.long()
    if bool((lens > max_pages * page_size).any()):
        b = int(torch.nonzero(lens > max_pages * page_size)[0])
        raise ValueError(f"seq_lens[{b}] = {int(lens[b])} needs more than the page table's {max_pages} pages of "
                         f"{page_size}")
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    if int(cu_seqlens_q[-1]) != total_q:
        raise ValueError(f"cu_seqlens_q[-1] = {int(cu_seqlens_q[-1])} must equal q's {total_q} tokens")
    if bool((q_lens > lens).any()) or bool((q_lens < 0).any()):
        b = int(torch.nonzero((q_lens > lens) | (q_lens < 0))[0])
        raise ValueError(f"sequence {b}: q_len {int(q_lens[b])} must be in [0, seq_lens[{b}] = {int(lens[b])}]")
    if q_lens.numel() and int(q_lens.max()) > max_seqlen_q:
        raise ValueError(f"max_seqlen_q is {max_seqlen_q} but cu_seqlens_q holds a sequence of {int(q_lens.max())} "
                         "queries: it must be at least the longest q_len")
    used = torch.arange(max_pages, device=page_table.device)[None, :] < ((lens + page_size - 1) // page_size)[:, None]
    bad = used & ((page_table < 0) | (page_table >= num_pages))
    if bool(bad.any()):
        b, i = (int(x) for x in torch.nonzero(bad)[0])
        raise ValueError(f"page_table[{b}, {i}] = {int(page_table[b, i])} is outside [0, num_pages = {num_pages})")


def paged_attention(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, max_seqlen_q: int, *, causal=True,
                    softmax_scale=None, window_size=(-1, -1), softcap=0.0, sinks=None, k_scale=None, v_scale=None,
                    custom_mask=None, num_splits=0, plan: PagedAttentionPlan | None = None, return_lse=False,
                    out=None, validate=True):
    """Attention of new queries over a paged KV cache: decode, extend and mixed batches in one call.

    The new tokens' K/V must already be in the cache (``store_kv``) and counted by ``seq_lens``.

    Args:
        q: [total_q, Hq, D] fp16/bf16, last dim contiguous (may be a view of a fused QKV output).
        k_cache, v_cache: [num_pages, page_size, Hkv, D], q's dtype or fp8 (then k_scale/v_scale are needed).
        page_table: int32 [batch, max_pages_per_seq]; seq_lens: int32 [batch]; cu_seqlens_q: int32 [batch+1].
        max_seqlen_q: the longest q_len (host int).
        causal, softmax_scale, window_size, softcap, sinks: as in ``flash_attn_varlen``; queries are the last
            q_len positions of their sequence.
        k_scale, v_scale: fp8 caches hold K / k_scale and V / v_scale (float or 1-element tensor).
        custom_mask: bool [total_q, max_seqlen_q]; row r (query i of sequence b), column j: sees the j-th new token
            of b. Cached positions stay visible; it replaces the causal rule among new tokens.
        num_splits: 0 = the plan chooses split-KV; a fixed count gives batch-invariant results.
        plan: from ``plan_paged_attention`` (made here when None, which costs a host sync per call).
        validate: check page ids and lengths against the cache (a device sync; skipped during CUDA-graph capture
            and torch.compile tracing, where the caller guarantees them).

    Returns o [total_q, Hq, D] in q's dtype (and lse float32 [total_q, Hq] if return_lse).

    >>> store_kv(k_new, v_new, k_cache, v_cache, slot_mapping)
    >>> o = paged_attention(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, max_seqlen_q=1)
    """
    kv_dtypes = (q.dtype,) + FP8_DTYPES if isinstance(q, torch.Tensor) else None
    Hq, Hkv, D = check_attention_inputs(q, k_cache, v_cache, sinks=sinks, kv_dtypes=kv_dtypes, k_name="k_cache",
                                        v_name="v_cache")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_pages, page_size, Hkv, D], got shape {tuple(k_cache.shape)}")
    batch = seq_lens.shape[0] if isinstance(seq_lens, torch.Tensor) else None
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), ndim=1)
    check_tensor("page_table", page_table, dtypes=(torch.int32,), ndim=2, last_dim_contiguous=True)
    check_tensor("cu_seqlens_q", cu_seqlens_q, dtypes=(torch.int32,), shape=(batch + 1,))
    if page_table.shape[0] != batch:
        raise ValueError(f"page_table must have {batch} rows (one per sequence), got shape {tuple(page_table.shape)}")
    check_device(q=q, k_cache=k_cache, page_table=page_table, seq_lens=seq_lens, cu_seqlens_q=cu_seqlens_q,
                 custom_mask=custom_mask)
    if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int) or max_seqlen_q < 0:
        raise TypeError(f"max_seqlen_q must be a non-negative int, got {max_seqlen_q!r}")
    fp8 = k_cache.dtype in FP8_DTYPES
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError(f"k_scale and v_scale are required with an fp8 cache ({k_cache.dtype})")
    if fp8:
        _check_fp8_words("k_cache", k_cache)
        _check_fp8_words("v_cache", v_cache)
    if custom_mask is not None:
        check_tensor("custom_mask", custom_mask, dtypes=(torch.bool,), ndim=2, last_dim_contiguous=True)
        if custom_mask.shape[0] != q.shape[0] or custom_mask.shape[1] < max_seqlen_q:
            raise ValueError(f"custom_mask must be [total_q={q.shape[0]}, >= max_seqlen_q={max_seqlen_q}], got "
                             f"{tuple(custom_mask.shape)}")
    left, right = _check_window(window_size)
    _check_softcap(softcap)
    if validate and not _capturing():
        _validate_pages(page_table, seq_lens, cu_seqlens_q, k_cache.shape[0], k_cache.shape[1], q.shape[0],
                        max_seqlen_q)
    if plan is None:
        plan = plan_paged_attention(cu_seqlens_q, seq_lens, k_cache.shape[1], Hq, Hkv, D, q_dtype=q.dtype,
                                    kv_dtype=k_cache.dtype, num_splits=num_splits, device=q.device)
    else:
        got = (plan.page_size, plan.num_q_heads, plan.num_kv_heads, plan.head_dim, plan.q_dtype, plan.kv_dtype)
        want = (k_cache.shape[1], Hq, Hkv, D, q.dtype, k_cache.dtype)
        if got != want:
            raise ValueError(f"plan was made for (page_size, Hq, Hkv, D, q_dtype, kv_dtype) = {got}, call has {want}")
        if plan.workspace_o is not None and plan.workspace_o.shape[1] < q.shape[0]:
            raise ValueError(f"plan's workspace holds {plan.workspace_o.shape[1]} tokens, q has {q.shape[0]}")
    out, lse = output_buffers(q, out, return_lse)
    ks = vs = None
    ks_f = vs_f = 1.0
    if fp8:
        if isinstance(k_scale, torch.Tensor) or isinstance(v_scale, torch.Tensor):
            ks, vs = as_scale_tensor("k_scale", k_scale, q.device), as_scale_tensor("v_scale", v_scale, q.device)
        else:
            as_scale_tensor("k_scale", k_scale, "cpu"), as_scale_tensor("v_scale", v_scale, "cpu")  # value checks
            ks_f, vs_f = float(k_scale), float(v_scale)
    tiles = [t for ln in plan.launches for t in (ln.tile_seq, ln.tile_q, ln.num_tiles)]
    configs = [c for ln in plan.launches for c in ln.config()]
    scale = float(softmax_scale) if softmax_scale is not None else D ** -0.5
    call_op(_paged_attention_op, _paged_attention_impl, q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q,
            out, lse, bool(return_lse), tiles,
                        configs, plan.num_splits, plan.workspace_o, plan.workspace_lse, bool(causal), scale, left,
                        right, float(softcap), sinks, ks, vs, ks_f, vs_f, custom_mask, bool(plan.ws_decode),
                        list(plan.balanced or []), int(plan.ws_maxnreg))
    return (out, lse) if return_lse else out
