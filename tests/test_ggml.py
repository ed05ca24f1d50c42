"""ggml block decoders (clover.checkpoints.ggml) against the gguf package's reference
dequantizer (their packing for the kernels: tests/test_packed.py)."""

import numpy as np
import pytest
from gguf.quants import dequantize

from clover.checkpoints import ggml
from clover.errors import CloverError
from tests.gguf_files import QT, random_blocks


@pytest.mark.parametrize("kind", sorted(ggml.BLOCKS))
def test_decoders_match_the_reference_bit_for_bit(kind):
    rows, cols = 5, 2 * ggml.BLOCKS[kind][0]
    data = random_blocks(kind, rows, cols)
    levels = ggml.decode(data, kind, rows, cols)
    ref = dequantize(data, QT[kind]).reshape(rows, cols)
    assert np.array_equal(levels.dequantize(), ref)
    assert (levels.int4() is not None) == (kind in ggml.INT4_TYPES)


def test_float_types_and_bad_input():
    w = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    assert np.array_equal(ggml.decode(w.astype(np.float16), "F16", 3, 8), w.astype(np.float16))
    bf16 = (w.view(np.uint32) >> 16).astype(np.uint16)
    want = dequantize(bf16.view(np.uint8), QT.BF16).reshape(3, 8)
    assert np.array_equal(ggml.decode(bf16, "BF16", 3, 8), want)
    with pytest.raises(CloverError, match="IQ2_XS is not supported"):
        ggml.decode(w, "IQ2_XS", 3, 8)
    with pytest.raises(CloverError, match="not whole blocks"):
        ggml.decode(random_blocks("Q4_K", 1, 256), "Q4_K", 2, 128)


def test_q4_k_sub_blocks_are_affine_4bit_groups_of_32():
    """Q4_K: eight sub-blocks of 32 values, each scale d * sc and offset -dmin * m."""
    data = random_blocks("Q4_K", 2, 512)
    q, scale, low = ggml.decode(data, "Q4_K", 2, 512).int4()
    assert q.shape == (2, 512) and scale.shape == low.shape == (2, 16)
    assert q.min() >= 0 and q.max() <= 15 and (low <= 0).all()  # low = -dmin * m, dmin > 0
    w = q.reshape(2, 16, 32) * scale[..., None] + low[..., None]
    assert np.array_equal(w.reshape(2, 512), dequantize(data, QT.Q4_K).reshape(2, 512))
