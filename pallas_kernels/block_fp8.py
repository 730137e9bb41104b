"""Block-scaled FP8 (e4m3), as GLM-5.3's release stores its weights and as its runtime quantizes
activations: weights in 128 x 128 blocks, activations per token in 1 x 128 groups, each block
holding `value = fp8 * scale` with `scale = amax / 448` (448 is e4m3's largest finite value).

Scales are float32 and cover the trailing axes in whole blocks: a dimension that is not a multiple
of 128 ends in a partial block, which has a scale of its own. An all-zero block gets the smallest
normal float32 as its scale (its values stay exact zeros, nothing divides by zero).

A scale axis as long as its data axis holds one scale per element along it, each its block's
(`expand_scales`): the form a device keeps where a mesh cuts a block, so that its slice of the scales
is its slice of the data's. The (de)quantizers here and the GEMMs' references take either form.
"""

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 128
FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
_TINY = float(np.finfo(np.float32).tiny)


def blocks(n: int) -> int:
    """Blocks of BLOCK that cover n (the last one partial when n is not a multiple)."""
    return -(-n // BLOCK)


def _padded(x, axes):
    pad = [(0, 0)] * x.ndim
    for axis in axes:
        pad[axis] = (0, blocks(x.shape[axis]) * BLOCK - x.shape[axis])
    return jnp.pad(x, pad)


def expand_scales(scales, shape, axes):
    """Scales per element of `shape` along `axes`: each block's repeated over its elements (an axis
    already per element, as long as the data's, is kept)."""
    for axis in axes:
        if scales.shape[axis] != shape[axis]:
            scales = jnp.repeat(scales, BLOCK, axis=axis)[(slice(None),) * axis + (slice(0, shape[axis]),)]
    return scales


def in_blocks(data_shape, scale_shape) -> bool:
    """Whether the scales of data [..., N, K] (or [..., K]: pass one axis of each) are one per block on
    every scaled axis, as the kernels take them (not per element on any)."""
    return all(s == blocks(n) for n, s in zip(data_shape, scale_shape))


def scales_of(amax):
    """The scales of blocks whose largest magnitude is amax: amax / 448 by true division (XLA would
    turn a division by a constant into a product with its rounded reciprocal; the barrier hides the
    constant), the smallest normal float32 for an all-zero block."""
    return jnp.maximum(amax / jax.lax.optimization_barrier(jnp.full(amax.shape, FP8_MAX, jnp.float32)), _TINY)


def encode(x, expanded_scales):
    """e4m3 codes of x / scale (scales given per element)."""
    return jnp.clip(x / expanded_scales, -FP8_MAX, FP8_MAX).astype(FP8)


def _quantize(x, axes, exact):
    x = jnp.asarray(x, jnp.float32)
    padded = _padded(x, axes)
    # [..., blocks, BLOCK] on each quantized axis, the amax over the BLOCK axes
    shape, reduce = [], []
    for axis, n in enumerate(padded.shape):
        if axis in axes:
            shape += [n // BLOCK, BLOCK]
            reduce.append(len(shape) - 1)
        else:
            shape.append(n)
    amax = jnp.abs(padded.reshape(shape)).max(axis=tuple(reduce))
    scales = scales_of(amax)
    # XLA turns a division by a broadcast into a product with the divisor's rounded reciprocal. The
    # codes are of the true quotient where `exact` (the expanded scales materialised), else of the
    # product, within an fp32 ulp of it: a code moves only where x / scale is that close to the
    # midpoint of two e4m3 values.
    expanded = expand_scales(scales, x.shape, axes)
    if exact:
        expanded = jax.lax.optimization_barrier(expanded)
    return encode(x, expanded), scales


def quantize_rows(x):
    """x [..., K] -> (fp8 [..., K], scales [..., ceil(K / 128)] fp32): 1 x 128 groups along K. The
    activations' quantizer, on the forward's path: its codes are x times 1 / scale (see _quantize)."""
    return _quantize(x, (x.ndim - 1,), exact=False)


def dequantize_rows(q, scales):
    """The float32 values of `quantize_rows`' output (scales per group or per element)."""
    return q.astype(jnp.float32) * expand_scales(scales, q.shape, (q.ndim - 1,))


def quantize_blocks(w):
    """w [..., N, K] -> (fp8 [..., N, K], scales [..., ceil(N / 128), ceil(K / 128)] fp32): 128 x 128
    blocks over the last two axes (torch's [out, in] layout, as the release stores them); codes of
    the true quotient w / scale, jitted or not."""
    return _quantize(w, (w.ndim - 2, w.ndim - 1), exact=True)


def dequantize_blocks(q, scales):
    """The float32 values of `quantize_blocks`' output (scales per block or per element on each axis)."""
    return q.astype(jnp.float32) * expand_scales(scales, q.shape, (q.ndim - 2, q.ndim - 1))
