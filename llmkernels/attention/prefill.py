"""Host side of varlen prefill attention: checks, config choice, launch, torch.library registration."""
from __future__ import annotations

import functools
import math

import torch
import triton

from .._checks import call_op, check_cu_seqlens, check_device, check_tensor, interpreter_mode
from .._runtime import gpu_name
from ..supported import gluon_supported
from ..tuning import OVERRIDES, lookup

HEAD_DIMS = (32, 64, 80, 96, 128, 192, 256)
_DTYPES = (torch.float16, torch.bfloat16)
FP8 = torch.float8_e4m3fn  # fp8 q/k/v (with descale factors); their output is bf16


def prefill_config(dtype: torch.dtype, head_dim: int, causal: bool) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, FOLD_SCALE, TMA) from the tuned table (GPU, dtype, head dim, causal).

    FOLD_SCALE 1 sends key blocks that every query sees through the loop with the scale folded into the exponent;
    TMA 1 loads that loop's K/V tiles through tensor descriptors where the layout allows (``_kv_descriptors``).
    Entries written before a field existed are shorter and mean 0 for it. Under the interpreter the table is not
    read; an ``OVERRIDES[("prefill", "interpret")]`` entry replaces the small default there (tests use it)."""
    if interpreter_mode():
        entry = OVERRIDES.get(("prefill", "interpret"), (32, 32, 4, 1, 1, 1))
    else:
        block_d = max(16, 1 << (head_dim - 1).bit_length())  # tuned per padded head dim: 80 and 96 use 128's entry
        name = "float16" if dtype == FP8 else str(dtype).replace("torch.", "")  # fp8 dots run in fp16
        key = f"{name}/{block_d}/{'causal' if causal else 'full'}"
        entry = lookup("prefill", gpu_name(), key)
        if entry is None:
            entry = (128, 64, 8, 3, 1) if head_dim <= 128 else (128, 64, 8, 2, 0)
    return tuple(entry) + (0,) * (6 - len(entry))


def ws_config(dtype: torch.dtype, head_dim: int, causal: bool) -> tuple[int, int, int, int, int] | None:
    """(BLOCK_N, STAGES, OVERLAP, PERSIST, PERM) of the warp-specialized Gluon kernel (prefill_ws.py) from the table
    key "<dtype>/<head dim>/<full|causal>/ws", or None where the entry is [0, 0] (the Triton kernel is faster
    there) or missing. OVERLAP 1 runs each block's softmax beside the previous block's PV product; PERSIST 1
    launches one program per SM that loops over the tiles round-robin, 2 one per SM that claims its next tile from a
    counter (0: a program per tile); PERM 1 (fp8 only) orders the keys of V^T and P alike so that P V's operand
    forms without shuffles. Missing trailing fields mean 0."""
    key = f"{str(dtype).replace('torch.', '')}/{head_dim}/{'causal' if causal else 'full'}/ws"
    entry = lookup("prefill", gpu_name(), key)
    if not entry or not entry[0]:
        return None
    entry = [int(x) for x in entry] + [0] * (5 - len(entry))
    if (len(entry) > 5 or entry[2] not in (0, 1) or entry[3] not in (0, 1, 2)
            or entry[4] not in ((0, 1) if dtype == FP8 else (0,))):
        raise ValueError(f"tuning entry prefill {key!r} must be [BLOCK_N, STAGES, OVERLAP (0 or 1), PERSIST (0, 1 or "
                         f"2), PERM (0, or 1 for fp8)], got {list(entry)}")
    return entry[0], entry[1], entry[2], entry[3], entry[4]


@functools.cache
def _gluon_hopper(device_index: int) -> bool:
    """True on an sm_90 GPU with a Triton that has Gluon's Hopper API (the Gluon kernel's wgmma, TMA and
    setmaxnreg are sm_90 code)."""
    if torch.cuda.get_device_capability(device_index) != (9, 0) or not gluon_supported():
        return False
    try:
        from . import prefill_ws  # noqa: F401
    except ImportError:
        return False
    return True


# The Gluon path costs more host time per call than the Triton kernel (H100 machine, S=512, 32 heads, eager: about
# 200 against 100 us, mostly Gluon's descriptor objects and launch), so it takes only calls with enough work to
# hide that: max_seqlen_q * max_seqlen_k * Hq >= WS_MIN_WORK (2^26: about 1450^2 tokens x 32 heads, some 60 us of
# GPU time). Tests set it to 0.
WS_MIN_WORK = 1 << 26


def _ws_eligible(q, D, left, right, causal, softcap, sinks, work) -> bool:
    """The Gluon kernel serves head dims 64, 128 and 256 (fp16, bf16 or fp8 e4m3) without a window, softcap or
    sinks, on sm_90 GPUs."""
    if (interpreter_mode() or not q.is_cuda or D not in (64, 128, 256) or q.dtype not in (*_DTYPES, FP8)
            or work < WS_MIN_WORK):
        return False
    if left >= 0 or (right >= 0 and not causal) or softcap > 0 or sinks is not None:
        return False
    return _gluon_hopper(q.device.index if q.device.index is not None else torch.cuda.current_device())


def _kv_descriptors(k: torch.Tensor, v: torch.Tensor, block_n: int):
    """TMA descriptors over K and V viewed as [tokens, kv heads * head dim] with [block_n, head dim] tiles, or None
    where that view does not exist or TMA cannot read it: heads not packed (stride(1) != head dim), a head dim that
    is not a power of two (the tile would reach into the next head), rows or base not 16-byte aligned, or a GPU
    before Hopper."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    D = k.shape[2]
    if D & (D - 1) or D < 16:
        return None
    if k.is_cuda and torch.cuda.get_device_capability(k.device)[0] < 9:
        return None
    descs = []
    for t in (k, v):
        row_bytes = t.stride(0) * t.element_size()
        if t.stride(2) != 1 or t.stride(1) != D or row_bytes % 16 or t.data_ptr() % 16 or t.shape[0] == 0:
            return None
        descs.append(TensorDescriptor(t, [t.shape[0], t.shape[1] * D], [t.stride(0), 1], [block_n, D]))
    return descs


def _check_window(window_size) -> tuple[int, int]:
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    if any(w < -1 for w in window_size):
        raise ValueError(f"window_size entries must be >= 0 or -1 (unbounded), got {tuple(window_size)}")
    return int(window_size[0]), int(window_size[1])


def _check_softcap(softcap) -> None:
    if softcap < 0 or not math.isfinite(softcap):
        raise ValueError(f"softcap must be >= 0 and finite, got {softcap}")


def output_buffers(q, out, return_lse, out_dtype=None):
    """(out [T, Hq, D] of q's dtype (or out_dtype), checked or allocated; lse float32 [T, Hq], or an empty
    placeholder)."""
    T, Hq, D = q.shape
    out_dtype = out_dtype or q.dtype
    if out is None:
        out = torch.empty(T, Hq, D, dtype=out_dtype, device=q.device)
    else:
        check_tensor("out", out, dtypes=(out_dtype,), shape=(T, Hq, D), last_dim_contiguous=True)
    lse = torch.empty(T if return_lse else 0, Hq, dtype=torch.float32, device=q.device)
    return out, lse


def check_attention_inputs(q, k, v, *, sinks=None, kv_dtypes=_DTYPES, q_name="q", k_name="k", v_name="v",
                           q_dtypes=_DTYPES):
    """Shared checks for q [T, Hq, D] and k/v [..., Hkv, D]: dtypes, head counts, head dim, devices, last-dim strides."""
    check_tensor(q_name, q, dtypes=q_dtypes, last_dim_contiguous=True)
    check_tensor(k_name, k, dtypes=kv_dtypes, last_dim_contiguous=True)
    check_tensor(v_name, v, dtypes=kv_dtypes, last_dim_contiguous=True)
    if q.dim() != 3:
        raise ValueError(f"{q_name} must be [total_q, num_q_heads, head_dim], got shape {tuple(q.shape)}")
    if k.dtype != v.dtype:
        raise TypeError(f"{k_name} and {v_name} must have one dtype, got {k.dtype} and {v.dtype}")
    if kv_dtypes == _DTYPES and k.dtype != q.dtype:
        raise TypeError(f"{k_name} must have {q_name}'s dtype {q.dtype}, got {k.dtype}")
    Hq, D = q.shape[1], q.shape[2]
    Hkv = k.shape[-2]
    if k.shape[-1] != D or v.shape[-1] != D:
        raise ValueError(f"head dims differ: {q_name} {D}, {k_name} {k.shape[-1]}, {v_name} {v.shape[-1]}")
    if v.shape != k.shape:
        raise ValueError(f"{v_name} must have {k_name}'s shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"num_q_heads ({Hq}) must be a multiple of num_kv_heads ({Hkv}) (Hq % Hkv == 0)")
    if sinks is not None:
        check_tensor("sinks", sinks, dtypes=(torch.float32,), shape=(Hq,))
    check_device(**{q_name: q, k_name: k, v_name: v, "sinks": sinks})
    return Hq, Hkv, D


def _launch_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, out, lse, causal, softmax_scale, left, right,
                    softcap, sinks, descales=None, max_seqlen_k=None):
    total_q, Hq, D = q.shape
    Hkv = k.shape[1]
    batch = cu_seqlens_q.shape[0] - 1
    if total_q == 0 or max_seqlen_q == 0:
        if lse is not None:
            lse.fill_(float("-inf"))
        return
    if causal:
        right = 0 if right < 0 else min(right, 0)
    softcap = float(softcap)
    scale = softmax_scale if softmax_scale is not None else D ** -0.5
    work = max_seqlen_q * (max_seqlen_k if max_seqlen_k is not None else max_seqlen_q) * Hq
    ws = ws_config(q.dtype, D, causal) if _ws_eligible(q, D, left, right, causal, softcap, sinks, work) else None
    if ws is not None:
        from .prefill_ws import launch_ws, ws_descriptors

        descs = ws_descriptors(q, k, v, ws[0], cu_seqlens_k,
                               max_seqlen_k if max_seqlen_k is not None else max_seqlen_q, perm=ws[4])
        if descs is not None:  # None: heads not packed or rows not 16-byte aligned; the Triton kernel takes it
            launch_ws(descs, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, Hq, Hq // Hkv,
                      scale * 1.4426950408889634, causal, *ws, descales=descales)
            return
    BLOCK_M, BLOCK_N, num_warps, num_stages, fold, tma = prefill_config(q.dtype, D, causal)
    BLOCK_D = max(16, triton.next_power_of_2(D))
    qk_scale = scale if softcap > 0 else scale * 1.4426950408889634
    num_m = triton.cdiv(max_seqlen_q, BLOCK_M)
    grid = (num_m * batch * Hq,)
    # the descriptors serve only the unmasked loop, which runs when the scale is folded and there is no softcap
    descs = _kv_descriptors(k, v, BLOCK_N) if tma and fold and softcap <= 0 and q.dtype != FP8 else None
    from .prefill_kernel import flash_fwd_kernel

    flash_fwd_kernel[grid](
        q, k, v, out, lse if lse is not None else out, sinks if sinks is not None else out,
        cu_seqlens_q, cu_seqlens_k, *(descs or (None, None)),
        *(descales if descales is not None else (cu_seqlens_q, cu_seqlens_q, cu_seqlens_q, 0)),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        Hq, Hq // Hkv, num_m, qk_scale, softcap, left, right,
        HEAD_DIM=D, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, SOFTCAP=softcap > 0, HAS_SINK=sinks is not None,
        WRITE_LSE=lse is not None, FOLD_SCALE=fold, USE_TMA=descs is not None, FP8=q.dtype == FP8,
        num_warps=num_warps, num_stages=num_stages)


def _descales(q, k, fp8, q_descale, k_descale, v_descale):
    """(q's, k's, v's descale as float32 tensors on q's device, heads) for fp8 inputs, else None; descales with
    fp16/bf16 inputs are an error (they would be ignored). Each is a float, a 1-element tensor (per tensor) or a
    tensor with one value per head ([Hq] for q, [Hkv] for k and v); bit 0 / 1 / 2 of heads is set where q's /
    k's / v's is per head. The kernels read the tensors as given (no gathering copy per call)."""
    given = {n: d for n, d in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))
             if d is not None}
    if not fp8:
        if given:
            raise ValueError(f"{', '.join(given)} apply to fp8 (float8_e4m3fn) inputs only, got {q.dtype} q")
        return None
    from ..kv_cache import as_scale_tensor

    out, heads = [], 0
    for i, (n, count) in enumerate((("q_descale", q.shape[1]), ("k_descale", k.shape[-2]),
                                    ("v_descale", k.shape[-2]))):
        d = given.get(n, 1.0)
        if isinstance(d, torch.Tensor) and d.numel() != 1:  # per head
            check_tensor(n, d, dtypes=(torch.float32,), shape=(count,))
            check_device(q=q, **{n: d})
            if d.stride(0) != 1:
                d = d.contiguous()
            heads |= 1 << i
        elif isinstance(d, (int, float)) and not isinstance(d, bool):
            # one device tensor per value, made by a fill (a copy from the host would wait for the stream), kept
            # unless made inside a capture (it would live in the graph's private pool)
            t = _FLOAT_DESCALES.get((q.device, d))
            if t is None:
                t = as_scale_tensor(n, d, q.device)  # checks the value
                if len(_FLOAT_DESCALES) < 64 and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
                    _FLOAT_DESCALES[q.device, d] = t
            d = t
        else:  # a 1-element tensor (per tensor), or refused with the expected types named
            d = as_scale_tensor(n, d, q.device)
        out.append(d)
    return (*out, heads)


# (device, float) -> the float32 [1] device tensor _descales made for that descale
_FLOAT_DESCALES: dict = {}


def _flash_attn_varlen_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          cu_seqlens_k: torch.Tensor, max_seqlen_q: int, out: torch.Tensor, lse: torch.Tensor,
                          write_lse: bool, causal: bool, softmax_scale: float, left: int, right: int, softcap: float,
                          sinks: torch.Tensor | None, q_descale: torch.Tensor | None, k_descale: torch.Tensor | None,
                          v_descale: torch.Tensor | None, descale_heads: int, max_seqlen_k: int) -> None:
    descales = None if q_descale is None else (q_descale, k_descale, v_descale, descale_heads)
    _launch_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, out, lse if write_lse else None, causal,
                    softmax_scale, left, right, softcap, sinks, descales, max_seqlen_k)


_flash_attn_varlen_op = torch.library.custom_op("llmkernels::flash_attn_varlen_out",
                                                mutates_args=("out", "lse"))(_flash_attn_varlen_impl)


@_flash_attn_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, out, lse, write_lse, causal, softmax_scale, left, right,
      softcap, sinks, q_descale, k_descale, v_descale, descale_heads, max_seqlen_k):
    return None


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *, causal=False,
                      softmax_scale=None, window_size=(-1, -1), softcap=0.0, sinks=None, return_lse=False, out=None,
                      q_descale=None, k_descale=None, v_descale=None):
    """Attention over concatenated variable-length sequences (prefill), FlashAttention style.

    Args:
        q: [total_q, Hq, D] fp16/bf16; k, v: [total_k, Hkv, D], same dtype, Hq % Hkv == 0. Views with a
            contiguous last dim are fine (e.g. slices of one fused QKV projection).
        cu_seqlens_q, cu_seqlens_k: int32 [batch+1] prefix sums of the query and key lengths. Their values are
            checked on the host (a sync) the first time each tensor is seen and after in-place writes through
            torch; values written by a custom kernel are not seen, and capture / compile tracing skips the check.
        max_seqlen_q, max_seqlen_k: the longest query / key length (host ints; they size the grid).
        causal: query i of a sequence sits at kv position k_len - q_len + i and sees keys j <= that position.
        softmax_scale: default D ** -0.5.
        window_size: (left, right); the query at position p sees p - left <= j <= p + right; -1 is unbounded.
        softcap: > 0 maps scaled scores s to softcap * tanh(s / softcap).
        sinks: float32 [Hq], one extra logit per head in the softmax denominator (no value).
        return_lse: also return float32 [total_q, Hq], the natural-log sum of exp of the scaled scores
            (sink included); -inf for a query that sees nothing.
        out: optional [total_q, Hq, D] output buffer of q's dtype (bf16 for fp8 inputs).
        q_descale, k_descale, v_descale: with fp8 (``torch.float8_e4m3fn``) q, k and v, which hold q / q_descale
            and so on: per-tensor factors (floats or 1-element float32 tensors, default 1.0) or per-head float32
            tensors ([Hq] for q, [Hkv] for k and v). The output is bf16. On sm_90 both products run on fp8 tensor
            cores, with the softmax probabilities rounded to e4m3 (about 2% relative RMS error in o, see
            bench/NOTES.md); elsewhere they are widened to fp16.

    Returns o [total_q, Hq, D] (and lse). D in (32, 64, 80, 96, 128, 192, 256).

    >>> q = torch.randn(7, 4, 64, dtype=torch.float16, device="cuda")
    >>> k = v = torch.randn(9, 2, 64, dtype=torch.float16, device="cuda")
    >>> cu_q = torch.tensor([0, 3, 7], dtype=torch.int32, device="cuda")
    >>> cu_k = torch.tensor([0, 4, 9], dtype=torch.int32, device="cuda")
    >>> o = flash_attn_varlen(q, k, v, cu_q, cu_k, 4, 5, causal=True)
    """
    fp8 = isinstance(q, torch.Tensor) and q.dtype == FP8
    Hq, Hkv, D = check_attention_inputs(q, k, v, sinks=sinks, q_dtypes=(*_DTYPES, FP8),
                                        kv_dtypes=(FP8,) if fp8 else _DTYPES)
    descales = _descales(q, k, fp8, q_descale, k_descale, v_descale)
    if k.dim() != 3:
        raise ValueError(f"k must be [total_k, num_kv_heads, head_dim], got shape {tuple(k.shape)}")
    if D not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {D}")
    for name, val in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 0:
            raise TypeError(f"{name} must be a non-negative int, got {val!r}")
    check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total=q.shape[0], max_len=("max_seqlen_q", max_seqlen_q))
    check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, batch=cu_seqlens_q.shape[0] - 1, total=k.shape[0],
                     max_len=("max_seqlen_k", max_seqlen_k))
    check_device(q=q, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    left, right = _check_window(window_size)
    _check_softcap(softcap)
    out, lse = output_buffers(q, out, return_lse, torch.bfloat16 if fp8 else None)
    scale = float(softmax_scale) if softmax_scale is not None else D ** -0.5
    call_op(_flash_attn_varlen_op, _flash_attn_varlen_impl, q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
            out, lse, bool(return_lse), bool(causal), scale, left, right, float(softcap), sinks,
            *(descales if descales is not None else (None, None, None, 0)), int(max_seqlen_k))
    return (out, lse) if return_lse else out


def flash_attn(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, sinks=None,
               return_lse=False, out=None, q_descale=None, k_descale=None, v_descale=None):
    """Dense batched attention: q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] -> o [B, Sq, Hq, D] (lse [B, Sq, Hq]).

    A convenience over ``flash_attn_varlen`` with equal lengths; same keyword arguments.

    >>> o = flash_attn(torch.randn(2, 128, 8, 64, dtype=torch.bfloat16, device="cuda"),
    ...                torch.randn(2, 128, 2, 64, dtype=torch.bfloat16, device="cuda"),
    ...                torch.randn(2, 128, 2, 64, dtype=torch.bfloat16, device="cuda"), causal=True)
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=4)
    B, Sq, Hq, D = q.shape
    Sk = k.shape[1]
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"q, k, v must share the batch dim, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    cu_q = torch.arange(0, (B + 1) * Sq, Sq, dtype=torch.int32, device=q.device)
    cu_k = torch.arange(0, (B + 1) * Sk, Sk, dtype=torch.int32, device=q.device)
    out_flat = None if out is None else out.view(B * Sq, Hq, D)
    res = flash_attn_varlen(q.reshape(B * Sq, Hq, D), k.reshape(B * Sk, *k.shape[2:]),
                            v.reshape(B * Sk, *v.shape[2:]), cu_q, cu_k, Sq, Sk, causal=causal,
                            softmax_scale=softmax_scale, window_size=window_size, softcap=softcap, sinks=sinks,
                            return_lse=return_lse, out=out_flat, q_descale=q_descale, k_descale=k_descale,
                            v_descale=v_descale)
    if return_lse:
        return res[0].view(B, Sq, Hq, D), res[1].view(B, Sq, Hq)
    return res.view(B, Sq, Hq, D)
