"""The codebook formats: iq4_nl, iq4_xs (16 non-uniform int8 levels) and mxfp4 (OCP MX: E2M1 levels, a power-of-two
block scale). Dequantizers match the ``gguf`` package bit for bit; the encoders are ours.

Encoders, per block (iq4_nl) or sub-block of 32 (iq4_xs): a grid of trial inverse scales around the one that maps the
largest-magnitude weight onto the codebook's end, each followed by nearest-level codes and the least-squares scale for
those codes (weights x^2, as without an importance matrix); the trial with the smallest weighted error wins. iq4_xs
then rounds its 8 sub-block scales to 6 bits against one fp16 scale and re-picks the codes. mxfp4's scale is the power
of two that puts the block's largest magnitude in [4, 8) of the doubled levels, its codes the nearest levels.
"""
from __future__ import annotations

import torch

from .formats import IQ4_VALUES, MXFP4_VALUES

TRIALS = 7  # trial inverse scales on each side of the end-mapping one
CHUNK = 1 << 15  # blocks per pass of an encoder (bounds its [blocks, trials, 32] temporaries)


def _levels(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 16] -> int64 [n, 32]: low nibbles (weights 0-15), then high nibbles (16-31)."""
    b = b.to(torch.int64)
    return torch.cat([b & 0xF, b >> 4], dim=1)


def _pack(q: torch.Tensor) -> torch.Tensor:
    """int [n, 32] codes -> uint8 [n, 16]: code i in the low nibble of byte i, code i + 16 in its high nibble."""
    q = q.to(torch.int32)
    return (q[:, :16] | (q[:, 16:] << 4)).to(torch.uint8)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent bytes -> float32 2^(e - 128) (half the block scale, for the doubled levels), subnormal below
    e = 2, as llama.cpp decodes them."""
    e = e.to(torch.int64)
    bits = torch.where(e < 2, 0x00200000 << e.clamp(max=1), (e - 1) << 23)
    return bits.to(torch.int32).view(torch.float32)


# --- dequantizers: uint8 [n, block_bytes] -> float32 [n, block_size] ------------------------------------------------

def deq_iq4_nl(b: torch.Tensor) -> torch.Tensor:
    d = b[:, 0:2].contiguous().view(torch.float16).float()
    return d * _levels(IQ4_VALUES, b.device)[_nibbles(b[:, 2:18])]


def deq_iq4_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = b[:, 0:2].contiguous().view(torch.float16).float()
    dl = (d * (unpack_iq4_xs_scales(b[:, 2:8]) - 32).float()).reshape(n, 8, 1)
    q = _nibbles(b[:, 8:136].reshape(n * 8, 16)).reshape(n, 8, 32)
    return (dl * _levels(IQ4_VALUES, b.device)[q]).reshape(n, 256)


def deq_mxfp4(b: torch.Tensor) -> torch.Tensor:
    return e8m0_half(b[:, 0:1]) * _levels(MXFP4_VALUES, b.device)[_nibbles(b[:, 1:17])]


def unpack_iq4_xs_scales(s: torch.Tensor) -> torch.Tensor:
    """The 6 scale bytes of an iq4_xs super-block (uint16 scales_h, 4 bytes scales_l) -> int32 [n, 8] in 0..63."""
    s = s.to(torch.int32)
    h = s[:, 0] | (s[:, 1] << 8)
    j = torch.arange(8, device=s.device)
    lo = (s[:, 2 + j // 2] >> (4 * (j % 2))) & 0xF
    return lo | (((h[:, None] >> (2 * j)) & 3) << 4)


def pack_iq4_xs_scales(ls: torch.Tensor) -> torch.Tensor:
    """Inverse of ``unpack_iq4_xs_scales``: int [n, 8] in 0..63 -> uint8 [n, 6]."""
    ls = ls.to(torch.int64)
    j = torch.arange(8, device=ls.device)
    h = ((ls >> 4) << (2 * j)).sum(1)
    lo = ls & 0xF
    out = torch.stack([h & 0xFF, h >> 8, *(lo[:, 2 * i] | (lo[:, 2 * i + 1] << 4) for i in range(4))], dim=1)
    return out.to(torch.uint8)


# --- encoders: float32 [n, block_size] -> uint8 [n, block_bytes] ------------------------------------------------------

def _nearest(v: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Index of the level (ascending) nearest each value of v."""
    return torch.bucketize(v, (levels[1:] + levels[:-1]) / 2)


def fit_codebook(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of 32 (float32 [n, 32]) -> (scale float32 [n], codes int64 [n, 32]) with x ~ scale * IQ4_VALUES[codes]:
    the trial search of the module docstring."""
    lv = _levels(IQ4_VALUES, x.device)
    w = x * x
    big = torch.gather(x, 1, x.abs().argmax(dim=1, keepdim=True))  # [n, 1], the signed largest magnitude
    steps = torch.arange(-TRIALS, TRIALS + 1, device=x.device, dtype=torch.float32)
    inv = torch.where(big != 0, (lv[0] + steps) / torch.where(big != 0, big, 1.0), 0.0)  # [n, trials]
    q = _nearest(inv[:, :, None] * x[:, None, :], lv)  # [n, trials, 32]
    L = lv[q]
    sqx = (w[:, None, :] * L * x[:, None, :]).sum(-1)
    sq2 = (w[:, None, :] * L * L).sum(-1)
    score = torch.where(sq2 > 0, sqx * sqx / torch.where(sq2 > 0, sq2, 1.0), 0.0)  # error = sum w x^2 - score
    best = score.argmax(dim=1)
    rows = torch.arange(x.shape[0], device=x.device)
    scale = torch.where(sq2[rows, best] > 0, sqx[rows, best] / sq2[rows, best].clamp_min(1e-30), 0.0)
    return scale, q[rows, best]


def _chunked(fn):
    def run(x):
        return torch.cat([fn(x[i:i + CHUNK]) for i in range(0, x.shape[0], CHUNK)]) if x.shape[0] else fn(x)
    return run


@_chunked
def enc_iq4_nl(x: torch.Tensor) -> torch.Tensor:
    scale, q = fit_codebook(x)
    return torch.cat([scale.to(torch.float16).reshape(-1, 1).view(torch.uint8), _pack(q)], dim=1)


@_chunked
def enc_iq4_xs(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    sub = x.reshape(n * 8, 32)
    scale, _ = fit_codebook(sub)
    scale = scale.reshape(n, 8)
    big = torch.gather(scale, 1, scale.abs().argmax(dim=1, keepdim=True))[:, 0]
    d = (-big / 32).to(torch.float16)  # the largest sub-block scale maps to level -32
    df = d.float()
    inv = torch.where(df != 0, 1.0 / torch.where(df != 0, df, 1.0), 0.0)
    ls = torch.round(scale * inv[:, None]).clamp(-32, 31)
    dl = (df[:, None] * ls).reshape(n * 8, 1)
    inv_dl = torch.where(dl != 0, 1.0 / torch.where(dl != 0, dl, 1.0), 0.0)
    q = _nearest(sub * inv_dl, _levels(IQ4_VALUES, x.device))
    return torch.cat([d.reshape(-1, 1).view(torch.uint8), pack_iq4_xs_scales(ls.to(torch.int64) + 32),
                      _pack(q).reshape(n, 128)], dim=1)


@_chunked
def enc_mxfp4(x: torch.Tensor) -> torch.Tensor:
    amax = x.abs().max(dim=1, keepdim=True).values
    _, ex = torch.frexp(amax)  # amax = m 2^ex, m in [0.5, 1): floor(log2 amax) = ex - 1
    e = torch.where(amax > 0, ex.to(torch.int64) - 1 - 2 + 127, 0).clamp(0, 254)
    err = (e8m0_half(e)[:, :, None] * _levels(MXFP4_VALUES, x.device) - x[:, :, None]).abs()
    return torch.cat([e.to(torch.uint8), _pack(err.argmin(dim=-1))], dim=1)


DEQUANTIZERS = {"iq4_nl": deq_iq4_nl, "iq4_xs": deq_iq4_xs, "mxfp4": deq_mxfp4}
ENCODERS = {"iq4_nl": enc_iq4_nl, "iq4_xs": enc_iq4_xs, "mxfp4": enc_mxfp4}
