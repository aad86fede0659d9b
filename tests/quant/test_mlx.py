"""MLX affine format: bit packing, quantizer properties, round trips for every bits/group pair."""
import pytest
import torch

import llmkernels as lk
from llmkernels.quant.mlx import pack_bits, unpack_bits

PAIRS = [(b, g) for b in (2, 3, 4, 5, 6, 8) for g in (32, 64, 128)]


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_unpack_identity(bits):
    q = torch.randint(0, 1 << bits, (5, 96 if bits in (3, 5, 6) else 64))
    words = pack_bits(q, bits)
    assert words.dtype == torch.uint32 and words.shape == (5, q.shape[1] * bits // 32)
    assert torch.equal(unpack_bits(words, bits, q.shape[1]), q)


def test_pack_is_lsb_first_and_crosses_words():
    q = torch.zeros(1, 32, dtype=torch.int64)
    q[0, 10] = 0b111  # 3-bit value 10 sits at bits 30..32: two bits in word 0, one in word 1
    w = pack_bits(q, 3).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    assert int(w[0, 0]) == 0b11 << 30 and int(w[0, 1]) == 1
    q = torch.arange(8).reshape(1, 8).repeat(1, 4)
    w = pack_bits(q, 4).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    assert int(w[0, 0]) == 0x76543210


@pytest.mark.parametrize("bits,group", PAIRS)
def test_round_trip_error_bound(bits, group):
    N, K = 6, 256
    w = torch.randn(N, K)
    qt = lk.quantize(w, "mlx", bits=bits, group_size=group)
    assert qt.data.shape == (N, K * bits // 32) and qt.scales.shape == (N, K // group)
    assert qt.scales.dtype == torch.float16 and qt.biases.dtype == torch.float16
    w2 = lk.dequantize(qt)
    err = (w - w2).abs().reshape(N, K // group, group)
    s, b = qt.scales.float()[..., None], qt.biases.float()[..., None]
    code = (w.reshape(N, K // group, group) - b) / s
    covered = (code >= -0.5) & (code <= (1 << bits) - 0.5)
    # half a step where the grid covers the value; the nudge that puts 0.0 on the grid, and the scale's fp16
    # rounding (relative 2^-11, times up to 2^bits steps), can leave the far edge about one step outside it
    assert (err[covered] <= 0.5 * s.abs().expand_as(err)[covered] * (1 + 1e-4) + 1e-6).all()
    assert (err <= s.abs() * (1 + 2.0 ** (bits - 10)) + 1e-6).all()
    assert covered.float().mean() > 0.9


@pytest.mark.parametrize("bits,group", [(4, 64), (3, 32), (8, 128)])
def test_larger_magnitude_edge_is_exact(bits, group):
    w = torch.randn(4, 256)
    qt = lk.quantize(w, "mlx", bits=bits, group_size=group)
    w2 = lk.dequantize(qt).reshape(4, -1, group)
    wg = w.reshape(4, -1, group)
    idx = wg.abs().argmax(dim=-1, keepdim=True)
    edge_in, edge_out = wg.gather(-1, idx), w2.gather(-1, idx)
    # the edge is stored as the fp16 bias and decoded exactly to it
    assert torch.equal(edge_out.squeeze(-1), qt.biases.float())
    assert torch.allclose(edge_out, edge_in, rtol=1e-3, atol=0)


def test_bf16_scales_and_dtype_default():
    w = torch.randn(4, 128, dtype=torch.bfloat16)
    qt = lk.quantize(w, "mlx", bits=4, group_size=32)
    assert qt.scales.dtype == torch.bfloat16
    qt2 = lk.quantize(w.float(), "mlx", bits=4, group_size=32, scale_dtype=torch.bfloat16)
    assert qt2.biases.dtype == torch.bfloat16


@pytest.mark.parametrize("kw,match", [
    (dict(bits=7, group_size=64), "bits must be one of"),
    (dict(bits=4, group_size=48), "group_size must be one of"),
])
def test_bad_params(kw, match):
    with pytest.raises(ValueError, match=match):
        lk.quantize(torch.randn(4, 256), "mlx", **kw)


def test_k_not_multiple_of_group():
    with pytest.raises(ValueError, match="multiple of group_size"):
        lk.quantize(torch.randn(4, 96), "mlx", bits=4, group_size=64)
