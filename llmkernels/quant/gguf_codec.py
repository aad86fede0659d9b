"""GGUF block formats in pure torch: dequantizers for every type and quantizers for the dense and legacy types
(kquants.py and iquants.py encode the others).

Each function takes blocks as uint8 [n_blocks, block_bytes] (or floats [n_blocks, block_size]) on any device.
The float32 arithmetic follows llama.cpp's reference order (d * q + m, not fused), so results equal the ``gguf``
package's numpy dequantizer bit for bit. Layout facts live in ``formats.py``.
"""
from __future__ import annotations

import torch

from . import iquants
from .formats import GGUF_FORMATS
from .kquants import KQUANT_ENCODERS
from .scales import signed_absmax, unpack_scales6, unpack_scales_q3k


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """Field of 2 bytes at ``offset`` read as float16 -> float32 [n, 1]."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).float()


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> int32 [..., 2, n]: low nibbles then high nibbles."""
    b = b.to(torch.int32)
    return torch.stack([b & 0xF, b >> 4], dim=-2)


def _crumbs(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> int32 [..., 4, n]: 2-bit fields at shifts 0, 2, 4, 6."""
    b = b.to(torch.int32)
    return torch.stack([(b >> s) & 3 for s in (0, 2, 4, 6)], dim=-2)


def _bits(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> int32 [..., 8, n]: bit s of byte l at [s, l]."""
    b = b.to(torch.int32)
    return torch.stack([(b >> s) & 1 for s in range(8)], dim=-2)


def _qh32(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The 4-byte qh of q5_0/q5_1 -> int32 [n, 32]: bit i is bit 4 of weight i."""
    qh = blocks[:, offset:offset + 4].to(torch.int64)
    word = qh[:, 0] | (qh[:, 1] << 8) | (qh[:, 2] << 16) | (qh[:, 3] << 24)
    return ((word[:, None] >> torch.arange(32, device=blocks.device)) & 1).to(torch.int32)


# --- dequantizers: uint8 [n, block_bytes] -> float32 [n, block_size] ------------------------------------------------

def _deq_f32(b):
    return b.contiguous().view(torch.float32)


def _deq_f16(b):
    return b.contiguous().view(torch.float16).float()


def _deq_bf16(b):
    return (b.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


def _deq_q4_0(b):
    q = _nibbles(b[:, 2:18]).reshape(-1, 32)
    return _f16(b, 0) * (q - 8).float()


def _deq_q4_1(b):
    q = _nibbles(b[:, 4:20]).reshape(-1, 32)
    return _f16(b, 0) * q.float() + _f16(b, 2)


def _deq_q5_0(b):
    q = _nibbles(b[:, 6:22]).reshape(-1, 32) | (_qh32(b, 2) << 4)
    return _f16(b, 0) * (q - 16).float()


def _deq_q5_1(b):
    q = _nibbles(b[:, 8:24]).reshape(-1, 32) | (_qh32(b, 4) << 4)
    return _f16(b, 0) * q.float() + _f16(b, 2)


def _deq_q8_0(b):
    return b[:, 2:34].contiguous().view(torch.int8).float() * _f16(b, 0)


def _deq_q2_k(b):
    n = b.shape[0]
    sc = b[:, :16].to(torch.int32)
    dl = (_f16(b, 80) * (sc & 0xF).float()).reshape(n, 16, 1)
    ml = (_f16(b, 82) * (sc >> 4).float()).reshape(n, 16, 1)
    q = _crumbs(b[:, 16:80].reshape(n, 2, 32)).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, 256)


def _deq_q3_k(b):
    n = b.shape[0]
    dl = (_f16(b, 108) * unpack_scales_q3k(b[:, 96:108]).float()).reshape(n, 16, 1)
    ql = _crumbs(b[:, 32:96].reshape(n, 2, 32)).reshape(n, 16, 16)
    hbit = _bits(b[:, 0:32].reshape(n, 1, 32)).reshape(n, 16, 16)
    q = (ql - ((hbit ^ 1) << 2)).float()
    return (dl * q).reshape(n, 256)


def _deq_q4_k(b):
    n = b.shape[0]
    sc, mn = unpack_scales6(b[:, 4:16])
    d = (_f16(b, 0) * sc.float()).reshape(n, 8, 1)
    dm = (_f16(b, 2) * mn.float()).reshape(n, 8, 1)
    q = _nibbles(b[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32).float()
    return (d * q - dm).reshape(n, 256)


def _deq_q5_k(b):
    n = b.shape[0]
    sc, mn = unpack_scales6(b[:, 4:16])
    d = (_f16(b, 0) * sc.float()).reshape(n, 8, 1)
    dm = (_f16(b, 2) * mn.float()).reshape(n, 8, 1)
    ql = _nibbles(b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    qh = _bits(b[:, 16:48].reshape(n, 1, 32)).reshape(n, 8, 32)
    q = (ql | (qh << 4)).float()
    return (d * q - dm).reshape(n, 256)


def _deq_q6_k(b):
    n = b.shape[0]
    ql = _nibbles(b[:, 0:128].reshape(n, 2, 64)).reshape(n, 8, 32)
    qh = _crumbs(b[:, 128:192].reshape(n, 2, 32)).reshape(n, 8, 32)
    q = ((ql | (qh << 4)) - 32).reshape(n, 16, 16).float()
    d = (_f16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    return (d * q).reshape(n, 256)


DEQUANTIZERS = {
    "f32": _deq_f32, "f16": _deq_f16, "bf16": _deq_bf16, "q4_0": _deq_q4_0, "q4_1": _deq_q4_1, "q5_0": _deq_q5_0,
    "q5_1": _deq_q5_1, "q8_0": _deq_q8_0, "q2_k": _deq_q2_k, "q3_k": _deq_q3_k, "q4_k": _deq_q4_k,
    "q5_k": _deq_q5_k, "q6_k": _deq_q6_k, **iquants.DEQUANTIZERS,
}


def dequantize_blocks(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """uint8 [n_blocks, block_bytes] -> float32 [n_blocks, block_size]."""
    return DEQUANTIZERS[fmt](blocks)


# --- quantizers for dense and legacy formats: float32 [n, block_size] -> uint8 [n, block_bytes] ------------------------
# These replicate llama.cpp's reference quantizers (and so the gguf package's) operation for operation.

def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).reshape(-1, 1).view(torch.uint8)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """int [n, 32] -> uint8 [n, 16]: q[i] low nibble, q[i+16] high nibble."""
    q = q.to(torch.int32)
    return ((q[:, :16] & 0xF) | ((q[:, 16:] & 0xF) << 4)).to(torch.uint8)


def _pack_qh32(q: torch.Tensor) -> torch.Tensor:
    """int [n, 32] -> uint8 [n, 4]: bit 4 of q[i] as bit i of a little-endian uint32."""
    hb = ((q.to(torch.int64) >> 4) & 1) << torch.arange(32, device=q.device)
    word = hb.sum(-1)
    return torch.stack([(word >> (8 * i)) & 0xFF for i in range(4)], dim=-1).to(torch.uint8)


def _inv(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / d)


def _q_f32(x):
    return x.contiguous().view(torch.uint8)


def _q_f16(x):
    return x.to(torch.float16).contiguous().view(torch.uint8)


def _q_bf16(x):
    n = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    is_nan = (n & 0x7FFFFFFF) > 0x7F800000
    n = torch.where(is_nan, (n & 0xFFFF0000) | (64 << 16), n)  # quiet NaN
    n = (n + (0x7FFF + ((n >> 16) & 1))) >> 16  # round to nearest even
    return n.to(torch.int32).to(torch.int16).view(torch.uint8).reshape(x.shape[0], -1)


def _q_q4_0(x):
    d = signed_absmax(x) / -8
    q = torch.trunc(x * _inv(d) + 8.5).clamp(0, 15)
    return torch.cat([_f16_bytes(d), _pack_nibbles(q)], dim=1)


def _q_q4_1(x):
    mx, mn = x.max(dim=1, keepdim=True).values, x.min(dim=1, keepdim=True).values
    d = (mx - mn) / 15
    q = torch.trunc((x - mn) * _inv(d) + 0.5).clamp(0, 15)
    return torch.cat([_f16_bytes(d), _f16_bytes(mn), _pack_nibbles(q)], dim=1)


def _q_q5_0(x):
    d = signed_absmax(x) / -16
    q = torch.trunc(x * _inv(d) + 16.5).clamp(0, 31).to(torch.int32)
    return torch.cat([_f16_bytes(d), _pack_qh32(q), _pack_nibbles(q)], dim=1)


def _q_q5_1(x):
    mx, mn = x.max(dim=1, keepdim=True).values, x.min(dim=1, keepdim=True).values
    d = (mx - mn) / 31
    q = torch.trunc((x - mn) * _inv(d) + 0.5).clamp(0, 31).to(torch.int32)
    return torch.cat([_f16_bytes(d), _f16_bytes(mn), _pack_qh32(q), _pack_nibbles(q)], dim=1)


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """C's roundf: halves go away from zero (torch.round goes to even)."""
    a = v.abs()
    f = torch.floor(a)
    return torch.sign(v) * (f + torch.floor(2 * (a - f)))


def _q_q8_0(x):
    d = x.abs().max(dim=1, keepdim=True).values / 127
    q = _round_half_away(x * _inv(d)).to(torch.int8)
    return torch.cat([_f16_bytes(d), q.view(torch.uint8)], dim=1)


QUANTIZERS = {"f32": _q_f32, "f16": _q_f16, "bf16": _q_bf16, "q4_0": _q_q4_0, "q4_1": _q_q4_1, "q5_0": _q_q5_0,
              "q5_1": _q_q5_1, "q8_0": _q_q8_0}


def quantize_blocks(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """float32 [n_blocks, block_size] -> uint8 [n_blocks, block_bytes]."""
    if fmt in QUANTIZERS:
        out = QUANTIZERS[fmt](x)
    else:
        out = {**KQUANT_ENCODERS, **iquants.ENCODERS}[fmt](x)
    assert out.shape[1] == GGUF_FORMATS[fmt].block_bytes, (fmt, out.shape)
    return out
