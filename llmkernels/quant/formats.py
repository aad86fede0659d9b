"""Every weight format as data: block size, bytes per block and where each field sits inside a block.

GGUF layouts are the ones llama.cpp writes (ggml-common.h); byte offsets are within one block, little-endian.
A row of K weights is K / block_size blocks stored back to back.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    offset: int  # byte offset inside the block
    nbytes: int
    kind: str  # how to read it: "f16", "bf16", "f32", "u8", "i8", "u4x2", "u2x4", "bits", "scales6", "e8m0"


@dataclasses.dataclass(frozen=True)
class GGUFFormat:
    name: str
    ggml_type: int  # GGMLQuantizationType value in GGUF files
    block_size: int  # weights per block
    block_bytes: int
    fields: tuple[Field, ...]
    family: str  # "dense", "legacy" (32-weight blocks), "kquant" (256-weight super-blocks)
    description: str

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.block_bytes / self.block_size

    def field(self, name: str) -> Field:
        return next(f for f in self.fields if f.name == name)

    def bytes_per_row(self, k: int) -> int:
        return k // self.block_size * self.block_bytes


def _f(name, offset, nbytes, kind):
    return Field(name, offset, nbytes, kind)


GGUF_FORMATS: dict[str, GGUFFormat] = {f.name: f for f in [
    GGUFFormat("f32", 0, 1, 4, (_f("w", 0, 4, "f32"),), "dense", "IEEE float32"),
    GGUFFormat("f16", 1, 1, 2, (_f("w", 0, 2, "f16"),), "dense", "IEEE float16"),
    GGUFFormat("bf16", 30, 1, 2, (_f("w", 0, 2, "bf16"),), "dense", "bfloat16"),
    GGUFFormat("q4_0", 2, 32, 18, (_f("d", 0, 2, "f16"), _f("qs", 2, 16, "u4x2")), "legacy",
               "w = d * (q - 8); q 4-bit; byte i holds q[i] (low nibble) and q[i+16] (high)"),
    GGUFFormat("q4_1", 3, 32, 20, (_f("d", 0, 2, "f16"), _f("m", 2, 2, "f16"), _f("qs", 4, 16, "u4x2")), "legacy",
               "w = d * q + m; nibbles as q4_0"),
    GGUFFormat("q5_0", 6, 32, 22, (_f("d", 0, 2, "f16"), _f("qh", 2, 4, "bits"), _f("qs", 6, 16, "u4x2")), "legacy",
               "w = d * (q - 16); low 4 bits as q4_0, bit 4 of q[i] is bit i of the uint32 qh"),
    GGUFFormat("q5_1", 7, 32, 24, (_f("d", 0, 2, "f16"), _f("m", 2, 2, "f16"), _f("qh", 4, 4, "bits"),
                                   _f("qs", 8, 16, "u4x2")), "legacy", "w = d * q + m; bits as q5_0"),
    GGUFFormat("q8_0", 8, 32, 34, (_f("d", 0, 2, "f16"), _f("qs", 2, 32, "i8")), "legacy", "w = d * q; q int8"),
    GGUFFormat("q2_k", 10, 256, 84, (_f("scales", 0, 16, "u4x2"), _f("qs", 16, 64, "u2x4"), _f("d", 80, 2, "f16"),
                                     _f("dmin", 82, 2, "f16")), "kquant",
               "16 sub-blocks of 16: w = d*(sc&15)*q - dmin*(sc>>4); q 2-bit; qs byte l of 32-byte half h holds "
               "weights h*128 + s*32 + l at bits 2s"),
    GGUFFormat("q3_k", 11, 256, 110, (_f("hmask", 0, 32, "bits"), _f("qs", 32, 64, "u2x4"),
                                      _f("scales", 96, 12, "scales6"), _f("d", 108, 2, "f16")), "kquant",
               "16 sub-blocks of 16: w = d*(sc-32)*(q - 4*!hbit); 6-bit scales; hmask bit b of byte l is weight "
               "b*32 + l"),
    GGUFFormat("q4_k", 12, 256, 144, (_f("d", 0, 2, "f16"), _f("dmin", 2, 2, "f16"), _f("scales", 4, 12, "scales6"),
                                      _f("qs", 16, 128, "u4x2")), "kquant",
               "8 sub-blocks of 32: w = d*sc*q - dmin*m with 6-bit sc, m; qs byte l of 32-byte chunk j holds "
               "weights j*64 + l (low nibble) and j*64 + 32 + l (high)"),
    GGUFFormat("q5_k", 13, 256, 176, (_f("d", 0, 2, "f16"), _f("dmin", 2, 2, "f16"), _f("scales", 4, 12, "scales6"),
                                      _f("qh", 16, 32, "bits"), _f("qs", 48, 128, "u4x2")), "kquant",
               "as q4_k with a fifth bit: qh bit b of byte l is bit 4 of weight b*32 + l"),
    GGUFFormat("q6_k", 14, 256, 210, (_f("ql", 0, 128, "u4x2"), _f("qh", 128, 64, "u2x4"), _f("scales", 192, 16, "i8"),
                                      _f("d", 208, 2, "f16")), "kquant",
               "16 sub-blocks of 16: w = d*sc*(q - 32), int8 sc, 6-bit q = low 4 bits (ql) | 2 high bits (qh)"),
    GGUFFormat("iq4_nl", 20, 32, 18, (_f("d", 0, 2, "f16"), _f("qs", 2, 16, "u4x2")), "legacy",
               "w = d * IQ4_VALUES[q]: a non-linear 16-value codebook; nibbles as q4_0"),
    GGUFFormat("iq4_xs", 23, 256, 136, (_f("d", 0, 2, "f16"), _f("scales_h", 2, 2, "bits"),
                                        _f("scales_l", 4, 4, "u4x2"), _f("qs", 8, 128, "u4x2")), "kquant",
               "8 sub-blocks of 32: w = d*(ls-32)*IQ4_VALUES[q], 6-bit ls = nibble j of scales_l | bits 2j, 2j+1 "
               "of the uint16 scales_h << 4; sub-block j's 16 bytes of qs as q4_0's"),
    GGUFFormat("mxfp4", 39, 32, 17, (_f("e", 0, 1, "e8m0"), _f("qs", 1, 16, "u4x2")), "legacy",
               "OCP MX fp4: w = 2^(e-127) * E2M1[q] (e2m1: sign bit 3, magnitudes 0 .5 1 1.5 2 3 4 6); nibbles as "
               "q4_0"),
]}

# The codebooks, as llama.cpp's ggml-common.h holds them: IQ4_NL / IQ4_XS values (int8), and MXFP4's E2M1 values
# doubled (so they are integers; the block scale is then halved, 2^(e-128))
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)

GGML_TYPE_TO_FORMAT = {f.ggml_type: f.name for f in GGUF_FORMATS.values()}

MLX_BITS = (2, 3, 4, 5, 6, 8)
MLX_GROUP_SIZES = (32, 64, 128)


def format_table() -> str:
    """A readable table of the GGUF formats (name, block, bytes, bits per weight)."""
    lines = [f"{'format':<6} {'block':>5} {'bytes':>5} {'bpw':>6}  layout"]
    for f in GGUF_FORMATS.values():
        lines.append(f"{f.name:<6} {f.block_size:>5} {f.block_bytes:>5} {f.bits_per_weight:>6.4g}  {f.description}")
    return "\n".join(lines)
