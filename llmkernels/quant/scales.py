"""Bit packing shared by the GGUF codecs: the 6-bit scales of q4_k/q5_k, the 6-bit scales of q3_k, and the signed
absmax that the symmetric quantizers scale by."""
from __future__ import annotations

import torch


def signed_absmax(x: torch.Tensor) -> torch.Tensor:
    """The element with the largest magnitude (first one on ties), keeping its sign: [n, 1]."""
    return torch.gather(x, 1, x.abs().argmax(dim=1, keepdim=True))



def unpack_scales6(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_k/q5_k 12-byte scales -> (sc, m) int32 [n, 8] of 6 bits each.

    Bytes 0-3 hold sc[0..3] (low 6 bits) and the top 2 bits of sc[4..7]; bytes 4-7 the same for m;
    bytes 8-11 hold the low 4 bits of sc[4..7] (low nibble) and m[4..7] (high nibble).
    """
    s = s.to(torch.int32).reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 63, (md & 0xF) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def pack_scales6(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """Inverse of ``unpack_scales6``: int [n, 8] 6-bit values -> uint8 [n, 12]."""
    sc, mn = sc.to(torch.int32), mn.to(torch.int32)
    out = torch.zeros(sc.shape[0], 12, dtype=torch.int32, device=sc.device)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    return out.to(torch.uint8)


def unpack_scales_q3k(s: torch.Tensor) -> torch.Tensor:
    """q3_k 12-byte scales -> int32 [n, 16] in -32..31.

    Scale j's low 4 bits: byte j%8, nibble j//8; its top 2 bits: byte 8 + j%4, bits 2*(j//4).
    """
    s = s.to(torch.int32)
    low = torch.cat([s[:, :8] & 0xF, s[:, :8] >> 4], dim=-1)
    high = torch.cat([(s[:, 8:12] >> (2 * i)) & 3 for i in range(4)], dim=-1)
    return (low | (high << 4)) - 32


def pack_scales_q3k(l: torch.Tensor) -> torch.Tensor:
    """Inverse of ``unpack_scales_q3k``: int [n, 16] in 0..63 (offset by 32) -> uint8 [n, 12]."""
    l = l.to(torch.int32)
    out = torch.zeros(l.shape[0], 12, dtype=torch.int32, device=l.device)
    out[:, :8] = (l[:, :8] & 0xF) | ((l[:, 8:] & 0xF) << 4)
    hi = l >> 4
    for i in range(4):
        out[:, 8:12] |= hi[:, 4 * i:4 * i + 4] << (2 * i)
    return out.to(torch.uint8)
