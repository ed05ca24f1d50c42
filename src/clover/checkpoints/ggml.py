"""ggml's quantized block formats -> integer levels and per-group scales (`decode`).

Every format we read stores a weight as an integer level q times a per-group scale, plus a
per-group offset for the affine ones: w = q * scale (+ low). We decode that form, not only
the floats, because it is what our int4 kernel takes: a 4-bit format with groups of 32
(Q4_0, Q4_1, and Q4_K, whose 256-value super-blocks are eight affine 4-bit sub-blocks of 32
with scale d * sc and offset -dmin * m) maps onto it level for level, with no second
rounding (`Levels.int4`). Wider formats (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0) dequantize to floats.

Bit layouts (llama.cpp's `ggml-common.h`; each block's fields in order, little-endian):
- Q4_0  [d f16 | qs 16 B]: value j = low nibble of qs[j], value j+16 = high nibble; w = d (q - 8)
- Q4_1  [d f16 | m f16 | qs 16 B]: as Q4_0; w = d q + m
- Q5_0  [d f16 | qh u32 | qs 16 B]: as Q4_0, bit j of qh is bit 4 of value j; w = d (q - 16)
- Q5_1  [d f16 | m f16 | qh u32 | qs 16 B]: as Q5_0; w = d q + m
- Q8_0  [d f16 | qs 32 x i8]: w = d q
- Q4_K  [d f16 | dmin f16 | scales 12 B | qs 128 B], 256 values in 8 sub-blocks of 32; the
  6-bit scale sc and min m of sub-block s: for s < 4 the low 6 bits of bytes s and s + 4;
  for s >= 4 the nibbles of byte s + 4 (low: sc, high: m) with the top two bits of bytes
  s - 4 (sc) and s (m) above them. qs chunk c (32 bytes) holds sub-block 2c in its low
  nibbles and 2c + 1 in its high nibbles. w = (d sc) q - (dmin m)
- Q5_K  [d | dmin | scales 12 B | qh 32 B | qs 128 B]: as Q4_K; bit s of qh[l] is bit 4 of
  value l of sub-block s
- Q6_K  [ql 128 B | qh 64 B | scales 16 x i8 | d f16], two halves of 128 values; in half h,
  value l + 32k (l < 32, k < 4) has its low nibble in ql[64h + l + 32 (k % 2)] (low nibble
  for k < 2, high for k >= 2) and its top two bits at bits 2k of qh[32h + l]; q - 32, and
  sub-blocks of 16 values with scale d * scales[i]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from clover.errors import CloverError

QK_K = 256
# type name -> (values per block, bytes per block)
BLOCKS = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q4_K": (QK_K, 144),
    "Q5_K": (QK_K, 176),
    "Q6_K": (QK_K, 210),
}
FLOATS = {"F32": np.float32, "F16": np.float16}
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # 4-bit levels in groups of 32: our int4 layout


@dataclass
class Levels:
    """w = q * scale (+ low), per group of `group` consecutive values along a row.

    q: int16 [rows, cols]; scale, low: float32 [rows, cols // group] (low None: symmetric)."""

    q: np.ndarray
    scale: np.ndarray
    low: np.ndarray | None
    group: int

    def dequantize(self) -> np.ndarray:
        """-> float32 [rows, cols], the same float operations as llama.cpp's dequantizer."""
        rows, cols = self.q.shape
        q = self.q.reshape(rows, cols // self.group, self.group).astype(np.float32)
        w = self.scale[..., None] * q
        if self.low is not None:
            w = w + self.low[..., None]
        return w.reshape(rows, cols)

    def int4(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(q in 0..15 [rows, cols], scale, low [rows, cols / 32]) when these levels are 4-bit
        groups of 32 as they stand, else None."""
        if self.group != 32 or self.low is None:
            return None
        if self.q.size and (int(self.q.min()) < 0 or int(self.q.max()) > 15):
            return None
        return self.q, self.scale, self.low


def _f16(b: np.ndarray) -> np.ndarray:
    """bytes [n, 2] -> float32 [n, 1]."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """bytes [n, m] -> [n, 2m]: all low nibbles, then all high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _bits(qh: np.ndarray, count: int) -> np.ndarray:
    """little-endian u32 bytes [n, 4] -> bits [n, count] (bit j of the word at j)."""
    word = np.ascontiguousarray(qh).view("<u4").astype(np.uint32)  # [n, 1]
    return ((word >> np.arange(count, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K packed 6-bit scales [n, 12] -> (sc, m), each [n, 8]."""
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=1)
    m = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc, m


def _q4_0(b: np.ndarray) -> tuple:
    d = _f16(b[:, 0:2])
    return _nibbles(b[:, 2:18]), d, -8 * d


def _q4_1(b: np.ndarray) -> tuple:
    return _nibbles(b[:, 4:20]), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _q5_0(b: np.ndarray) -> tuple:
    q = _nibbles(b[:, 6:22]) | (_bits(b[:, 2:6], 32) << 4)
    return q.astype(np.int16) - 16, _f16(b[:, 0:2]), None


def _q5_1(b: np.ndarray) -> tuple:
    q = _nibbles(b[:, 8:24]) | (_bits(b[:, 4:8], 32) << 4)
    return q, _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _q8_0(b: np.ndarray) -> tuple:
    return np.ascontiguousarray(b[:, 2:34]).view(np.int8), _f16(b[:, 0:2]), None


def _k_affine(b: np.ndarray, qh: np.ndarray | None, qs: np.ndarray) -> tuple:
    """Q4_K / Q5_K: levels [n, 256], scale and low [n, 8]."""
    n = b.shape[0]
    sc, m = _k_scales(b[:, 4:16])
    chunks = qs.reshape(n, 4, 1, 32)
    q = np.concatenate([chunks & 0x0F, chunks >> 4], axis=2).reshape(n, 8, 32)
    if qh is not None:  # bit s of qh[l]: bit 4 of value l of sub-block s
        q = q | (((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4)
    scale = _f16(b[:, 0:2]) * sc.astype(np.float32)
    low = -(_f16(b[:, 2:4]) * m.astype(np.float32))
    return q.reshape(n, QK_K), scale, low


def _q4_k(b: np.ndarray) -> tuple:
    return _k_affine(b, None, b[:, 16:144])


def _q5_k(b: np.ndarray) -> tuple:
    return _k_affine(b, b[:, 16:48], b[:, 48:176])


def _q6_k(b: np.ndarray) -> tuple:
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 64)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    low4 = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # [n, 2, 128]: value l + 32k of a half
    high2 = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3
    q = (low4 | (high2.reshape(n, 2, 128) << 4)).astype(np.int16) - 32
    scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    return q.reshape(n, QK_K), _f16(b[:, 208:210]) * scales, None


DECODERS = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}


def decode(data: np.ndarray, type_name: str, rows: int, cols: int) -> Levels | np.ndarray:
    """A tensor's raw data ([rows, cols] in ggml order: cols contiguous) -> Levels for a
    quantized type, float32 [rows, cols] for a float one."""
    if type_name in FLOATS:
        return np.asarray(data).view(FLOATS[type_name]).reshape(rows, cols).astype(np.float32)
    if type_name == "BF16":
        raw = np.asarray(data).view(np.uint16).astype(np.uint32) << 16
        return raw.view(np.float32).reshape(rows, cols)
    if type_name not in DECODERS:
        raise CloverError(f"GGUF type {type_name} is not supported (supported: "
                          f"{', '.join([*FLOATS, 'BF16', *DECODERS])})")  # fmt: skip
    per, size = BLOCKS[type_name]
    if cols % per:
        raise CloverError(f"{type_name} rows of {cols} values are not whole blocks of {per}")
    blocks = np.asarray(data).view(np.uint8).reshape(-1, size)
    if blocks.shape[0] != rows * cols // per:
        raise CloverError(
            f"{type_name} data holds {blocks.shape[0]} blocks, not {rows * cols // per}"
        )
    q, scale, low = DECODERS[type_name](blocks)
    group = per // scale.shape[1]
    q = q.astype(np.int16).reshape(rows, cols)
    scale = scale.reshape(rows, cols // group)
    low = None if low is None else low.reshape(rows, cols // group)
    return Levels(q, scale, low, group)
