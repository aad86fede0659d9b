"""The paged KV cache: ``store_kv`` (new K/V into their slots, fp8 quantization included) and page helpers."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import call_op, check_device, check_tensor

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@triton.jit
def _store_kv_kernel(K, V, KC, VC, SLOTS, K_SCALE, V_SCALE, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cp, stride_cs, stride_ch, stride_vcp, stride_vcs, stride_vch, page_size, fp8_max,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                     QUANT: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(SLOTS + t)
    if slot < 0:
        return
    page = slot // page_size
    off = slot % page_size
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    m = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(K + t.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=m)
    v = tl.load(V + t.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=m)
    if QUANT:
        # saturate instead of overflowing to NaN: fp8 e4m3fn has no infinity
        k = tl.clamp(k.to(tl.float32) / tl.load(K_SCALE), -fp8_max, fp8_max)
        v = tl.clamp(v.to(tl.float32) / tl.load(V_SCALE), -fp8_max, fp8_max)
    kc = KC + page * stride_cp + off * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    vc = VC + page * stride_vcp + off * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(kc, k.to(KC.dtype.element_ty), mask=m)
    tl.store(vc, v.to(VC.dtype.element_ty), mask=m)


def as_scale_tensor(name: str, scale, device) -> torch.Tensor | None:
    """A K/V scale given as float or 1-element tensor -> float32 tensor [1] on ``device`` (None stays None)."""
    if scale is None:
        return None
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"{name} must be a float or a 1-element tensor (per-tensor scale), got shape "
                             f"{tuple(scale.shape)}")
        return scale.reshape(1).to(device=device, dtype=torch.float32)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
        raise ValueError(f"{name} must be a positive float or a 1-element tensor, got {scale!r}")
    return torch.full((1,), float(scale), dtype=torch.float32, device=device)


def _store_kv_impl(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    T, H, D = k.shape
    if T == 0:
        return
    quant = k_cache.dtype in FP8_DTYPES
    _store_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale if quant else k, v_scale if quant else v,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), k_cache.shape[1], _FP8_MAX.get(k_cache.dtype, 0.0),
        NUM_HEADS=H, HEAD_DIM=D, BLOCK_H=triton.next_power_of_2(H), BLOCK_D=triton.next_power_of_2(D),
        QUANT=quant, num_warps=4)


_store_kv_op = torch.library.custom_op("llmkernels::store_kv", mutates_args=("k_cache", "v_cache"))(_store_kv_impl)


@_store_kv_op.register_fake
def _(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    return None


def store_kv(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None) -> None:
    """Write new keys/values into their cache slots.

    Args:
        k, v: [num_tokens, Hkv, D] fp16/bf16 (last dim contiguous).
        k_cache, v_cache: [num_pages, page_size, Hkv, D], of k's dtype or fp8 (float8_e4m3fn / float8_e5m2).
        slot_mapping: int64 [num_tokens]; slot = page * page_size + offset; -1 skips the token.
        k_scale, v_scale: for fp8 caches, the per-tensor scales (float or 1-element tensor): the cache holds
            K / k_scale and V / v_scale, saturated to the fp8 range.

    >>> store_kv(k, v, k_cache, v_cache, torch.tensor([5, 6, -1], device="cuda"))
    """
    dt = (torch.float16, torch.bfloat16)
    check_tensor("k", k, dtypes=dt, ndim=3, last_dim_contiguous=True)
    check_tensor("v", v, dtypes=(k.dtype,), shape=tuple(k.shape), last_dim_contiguous=True)
    check_tensor("k_cache", k_cache, dtypes=(k.dtype,) + FP8_DTYPES, ndim=4, last_dim_contiguous=True)
    check_tensor("v_cache", v_cache, dtypes=(k_cache.dtype,), shape=tuple(k_cache.shape), last_dim_contiguous=True)
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int64,), shape=(k.shape[0],))
    if tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        raise ValueError(f"k_cache's [Hkv, D] {tuple(k_cache.shape[2:])} must match k's {tuple(k.shape[1:])}")
    check_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    fp8 = k_cache.dtype in FP8_DTYPES
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError(f"k_scale and v_scale are required for an fp8 cache ({k_cache.dtype})")
    if not fp8 and (k_scale is not None or v_scale is not None):
        raise ValueError("k_scale/v_scale apply only to fp8 caches")
    from ._checks import _capturing

    if not _capturing() and k.shape[0]:
        cap = k_cache.shape[0] * k_cache.shape[1]
        if bool(((slot_mapping < -1) | (slot_mapping >= cap)).any()):
            bad = slot_mapping[(slot_mapping < -1) | (slot_mapping >= cap)][:4].tolist()
            raise ValueError(f"slot_mapping has slots outside [-1, {cap}) (num_pages * page_size): {bad}")
    call_op(_store_kv_op, _store_kv_impl, k, v, k_cache, v_cache, slot_mapping,
            as_scale_tensor("k_scale", k_scale, k.device),
                 as_scale_tensor("v_scale", v_scale, k.device))


def slots_for(page_table: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor, page_size: int):
    """slot_mapping for tokens at ``positions`` of sequences ``seq_ids``: page_table[seq, pos // ps] * ps + pos % ps."""
    pages = page_table[seq_ids.long(), (positions // page_size).long()].long()
    return pages * page_size + (positions % page_size).long()
