"""The codebook formats (iq4_nl, iq4_xs, mxfp4): encoders against the gguf package's decoder and quantizer, their
error, degenerate blocks, and the scale packing."""
import numpy as np
import pytest
import torch

import llmkernels as lk
from llmkernels.quant import iquants
from llmkernels.quant.kquants import absmax_baseline

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
CODEBOOKS = ["iq4_nl", "iq4_xs", "mxfp4"]

# Relative RMS error measured on 256 x 4096 weights; tests allow 10% above it. (q4_0 on the same: 0.086 / 0.115,
# q4_k 0.072 / 0.085.)
MEASURED_REL_ERR = {("iq4_nl", "gauss"): 0.0763, ("iq4_xs", "gauss"): 0.0768, ("mxfp4", "gauss"): 0.1149,
                    ("iq4_nl", "heavy"): 0.0933, ("iq4_xs", "heavy"): 0.0952, ("mxfp4", "heavy"): 0.1345}


def decoded_by_gguf(qt):
    return torch.from_numpy(gguf.quants.dequantize(qt.data.numpy(), T[qt.format.upper()]).reshape(qt.shape).copy())


def sample(dist, shape):
    return torch.randn(shape) if dist == "gauss" else torch.distributions.StudentT(3.0).sample(shape)


@pytest.mark.parametrize("fmt", CODEBOOKS)
@pytest.mark.parametrize("dist", ["gauss", "heavy"])
def test_encoder_error(fmt, dist):
    w = sample(dist, (64, 1024))
    qt = lk.quantize(w, fmt)
    w2 = decoded_by_gguf(qt)
    assert torch.equal(w2, lk.dequantize(qt))
    err = float((w - w2).norm() / w.norm())
    assert err < 1.1 * MEASURED_REL_ERR[(fmt, dist)], err
    if fmt != "mxfp4":  # a search over scales beats rounding against the absmax at the same bits and block
        assert err < float((w - absmax_baseline(w, 4, 32)).norm() / w.norm())


@pytest.mark.parametrize("dist", ["gauss", "heavy", "with_zero_blocks"])
def test_mxfp4_equals_gguf_quantizer(dist):
    w = sample("heavy" if dist == "heavy" else "gauss", (9, 320)) * 0.03
    if dist == "with_zero_blocks":
        w[:, :64] = 0.0
        w[3] = 1.5
    ours = lk.quantize(w, "mxfp4").data.numpy()
    assert np.array_equal(ours, gguf.quants.quantize(w.numpy(), T.MXFP4).reshape(ours.shape))


@pytest.mark.parametrize("fmt", CODEBOOKS)
def test_degenerate_blocks(fmt):
    w = torch.randn(5, 512)
    w[0] = 0.0
    w[1] = 2.0
    w[2, :256] = -1e-3
    w[3, 5] = 100.0  # one outlier
    w[4, :32] = 1e-30  # below fp16's range: the block decodes to zeros, not NaN
    qt = lk.quantize(w, fmt)
    out = lk.dequantize(qt)
    assert torch.isfinite(out).all() and out[0].abs().max() == 0 and out[4, :32].abs().max() < 1e-20
    assert torch.equal(out, decoded_by_gguf(qt))
    assert torch.allclose(out[1], torch.full((512,), 2.0), rtol=0.02)  # a constant row comes back near itself
    assert abs(out[3, 5].item() - 100.0) < 10.0


def test_fit_codebook_beats_its_first_trial():
    """The chosen (scale, codes) has the smallest x^2-weighted error of the trials, the end-mapping one included."""
    x = torch.randn(200, 32)
    scale, q = iquants.fit_codebook(x)
    lv = torch.tensor(lk.quant.formats.IQ4_VALUES, dtype=torch.float32)
    err = ((x - scale[:, None] * lv[q]) ** 2 * x * x).sum(1)
    big = torch.gather(x, 1, x.abs().argmax(1, keepdim=True))
    q0 = iquants._nearest(x * (lv[0] / big), lv)
    L0 = lv[q0]
    s0 = (x * x * L0 * x).sum(1) / (x * x * L0 * L0).sum(1)
    err0 = ((x - s0[:, None] * L0) ** 2 * x * x).sum(1)
    assert (err <= err0 * (1 + 1e-5)).all()


def test_iq4_xs_scale_packing_round_trips():
    ls = torch.randint(0, 64, (100, 8))
    packed = iquants.pack_iq4_xs_scales(ls)
    assert packed.shape == (100, 6) and packed.dtype == torch.uint8
    assert torch.equal(iquants.unpack_iq4_xs_scales(packed), ls.to(torch.int32))


def test_e8m0_half_matches_gguf_for_every_byte():
    e = torch.arange(256, dtype=torch.uint8)
    ref = gguf.quants.MXFP4.e8m0_to_fp32_half(e.numpy().astype(np.uint8))
    assert np.array_equal(iquants.e8m0_half(e).numpy().view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("fmt,K,match", [("iq4_xs", 288, "multiple of iq4_xs's block size 256"),
                                         ("iq4_nl", 100, "multiple of iq4_nl's block size 32"),
                                         ("mxfp4", 100, "multiple of mxfp4's block size 32")])
def test_bad_shapes_and_values_refused(fmt, K, match):
    with pytest.raises(ValueError, match=match):
        lk.quantize(torch.randn(4, K), fmt)
    with pytest.raises(ValueError, match="NaN"):
        lk.quantize(torch.full((4, 256), float("nan")), fmt)
    with pytest.raises(ValueError, match="needs"):
        lk.QuantizedTensor.from_raw(torch.zeros(10, dtype=torch.uint8), fmt, (4, 256))
