"""Block-scaled FP8: the quantizers, eager and jitted, against a block-by-block numpy construction
(partial blocks, zero blocks, leading axes), and the dequantized values within e4m3's rounding of the
originals."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import block_fp8


def numpy_quantize(x, block_shape):
    """(q, scales) of x [..., *block_axes] block by block: scale = amax / 448, q = x / scale rounded
    to e4m3 (nearest, ties to even); a zero block's scale is float32's smallest normal."""
    lead, trail = x.shape[: x.ndim - len(block_shape)], x.shape[x.ndim - len(block_shape):]
    grid = tuple(-(-n // b) for n, b in zip(trail, block_shape))
    q = np.zeros(x.shape, ml_dtypes.float8_e4m3fn)
    scales = np.zeros(lead + grid, np.float32)
    for index in np.ndindex(*lead, *grid):
        head, cell = index[: len(lead)], index[len(lead):]
        region = head + tuple(slice(c * b, (c + 1) * b) for c, b in zip(cell, block_shape))
        amax = np.abs(x[region]).max()
        scale = np.float32(amax / np.float32(448)) if amax > 0 else np.finfo(np.float32).tiny
        scales[index] = scale
        q[region] = (x[region] / scale).astype(ml_dtypes.float8_e4m3fn)
    return q, scales


def spread_values(rng, shape):
    """Normal values whose 128-wide groups differ in size by up to 2^12, with some exact zeros."""
    x = rng.standard_normal(shape).astype(np.float32) * np.exp2(rng.integers(-6, 6, shape[:-1] + (1,)))
    x[rng.random(shape) < 0.05] = 0
    return x


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("shape", [(3, 200, 300), (128, 128), (1, 64)])
def test_quantize_blocks_matches_numpy_block_by_block(shape, jit):
    rng = np.random.default_rng(0)
    w = spread_values(rng, shape)
    w = np.array(jnp.asarray(w, jnp.bfloat16).astype(jnp.float32))  # bf16 values: many exact ties
    w[..., :128, 128:256] = 0  # a zero block (where the shape has one)
    q, scales = (jax.jit if jit else lambda f: f)(block_fp8.quantize_blocks)(jnp.asarray(w))
    want_q, want_scales = numpy_quantize(w, (128, 128))
    assert q.dtype == jnp.float8_e4m3fn and scales.dtype == jnp.float32
    assert scales.shape == shape[:-2] + (-(-shape[-2] // 128), -(-shape[-1] // 128))
    np.testing.assert_array_equal(np.asarray(scales), want_scales)
    np.testing.assert_array_equal(np.asarray(q).astype(np.float32), want_q.astype(np.float32))
    back = np.asarray(block_fp8.dequantize_blocks(q, scales))
    # e4m3 keeps 3 mantissa bits: half a step is 2^-4 of a value; below 2^-6 (its smallest normal)
    # the step is fixed, 2^-9 of the block's scale * 448 / 448.
    step = np.maximum(np.abs(w) * 2.0**-4, block_fp8.dequantize_blocks(jnp.ones_like(q), scales) * 2.0**-9)
    assert np.all(np.abs(back - w) <= step)
    assert np.all(back[w == 0] == 0)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("shape", [(5, 7, 300), (64, 128), (2, 1)])
def test_quantize_rows_matches_numpy_group_by_group(shape, jit):
    rng = np.random.default_rng(1)
    x = spread_values(rng, shape)
    x[..., 0, :] = 0  # a zero row: every group of it a zero block
    x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    q, scales = (jax.jit if jit else lambda f: f)(block_fp8.quantize_rows)(jnp.asarray(x))
    want_q, want_scales = numpy_quantize(x, (128,))
    assert scales.shape == shape[:-1] + (-(-shape[-1] // 128),)
    np.testing.assert_array_equal(np.asarray(scales), want_scales)
    # Jitted, the codes are x times 1 / scale: a code apart from the quotient's only where x / scale
    # is within an fp32 ulp or two of the midpoint between the two codes.
    got, want = np.asarray(q).astype(np.float32), want_q.astype(np.float32)
    apart = got != want
    quotient = x / np.repeat(want_scales, 128, -1)[..., : shape[-1]]
    midway = (got + want) / 2
    assert np.all(np.abs(quotient - midway)[apart] <= 2.0**-22 * np.abs(midway[apart])), quotient[apart]
    assert apart.sum() <= (1e-2 * x.size if jit else 0)
    assert np.all(np.asarray(block_fp8.dequantize_rows(q, scales))[..., 0, :] == 0)


def test_values_on_the_grid_come_back_exactly():
    """fp8 values times power-of-two scales are quantized to themselves (amax / 448 is that scale
    where each block holds +-448)."""
    rng = np.random.default_rng(2)
    q = rng.standard_normal((256, 384)).astype(ml_dtypes.float8_e4m3fn)
    q[::128, ::128] = 448  # each block's amax
    scales = np.exp2(rng.integers(-20, 4, (2, 3))).astype(np.float32)
    w = q.astype(np.float32) * np.repeat(np.repeat(scales, 128, 0), 128, 1)
    got_q, got_scales = block_fp8.quantize_blocks(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(got_scales), scales)
    np.testing.assert_array_equal(np.asarray(block_fp8.dequantize_blocks(got_q, got_scales)), w)


@pytest.mark.parametrize("shape", [(3, 200, 300), (130, 64)])
def test_scales_per_element_dequantize_as_their_blocks(shape):
    """`expand_scales` on either or both axes: dequantize_blocks of the same codes gives the same values
    (a per-element axis is kept as it is, expanding twice changes nothing); `in_blocks` tells the forms
    apart."""
    q, scales = block_fp8.quantize_blocks(spread_values(np.random.default_rng(7), shape))
    want = np.asarray(block_fp8.dequantize_blocks(q, scales))
    n, k = q.ndim - 2, q.ndim - 1
    assert block_fp8.in_blocks(q.shape[-2:], scales.shape[-2:])
    for axes in [(n,), (k,), (n, k)]:
        per_element = block_fp8.expand_scales(scales, q.shape, axes)
        assert all(per_element.shape[a] == q.shape[a] for a in axes)
        assert not block_fp8.in_blocks(q.shape[-2:], per_element.shape[-2:])
        np.testing.assert_array_equal(block_fp8.expand_scales(per_element, q.shape, axes), per_element)
        np.testing.assert_array_equal(np.asarray(block_fp8.dequantize_blocks(q, per_element)), want)
    rows_q, rows_s = block_fp8.quantize_rows(spread_values(np.random.default_rng(8), shape))
    np.testing.assert_array_equal(
        np.asarray(block_fp8.dequantize_rows(rows_q, block_fp8.expand_scales(rows_s, rows_q.shape, (k,)))),
        np.asarray(block_fp8.dequantize_rows(rows_q, rows_s)),
    )

