"""Block-scaled FP8 (e4m3), as GLM-5.3's release stores its weights and as its runtime quantizes
activations: weights in 128 x 128 blocks, activations per token in 1 x 128 groups, each block
holding `value = fp8 * scale` with `scale = amax / 448` (448 is e4m3's largest finite value).

Scales are float32 and cover the trailing axes in whole blocks: a dimension that is not a multiple
of 128 ends in a partial block, which has a scale of its own. An all-zero block gets the smallest
normal float32 as its scale (its values stay exact zeros, nothing divides by zero).
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


def _expand(scales, shape, axes):
    """Each scale repeated over its block of `shape` on `axes`, cut to `shape`."""
    for axis in axes:
        scales = jnp.repeat(scales, BLOCK, axis=axis)
    return scales[tuple(slice(0, n) for n in shape)]


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
    # XLA turns a division by a constant or by a broadcast into a product with the divisor's rounded
    # reciprocal. The scale is a true division, as the release's quantizer does (the barrier hides
    # the constant); so are the codes where `exact` (the expanded scales materialised), else the
    # product, within an fp32 ulp of the quotient: a code moves only where x / scale is that close
    # to the midpoint of two e4m3 values.
    scales = jnp.maximum(amax / jax.lax.optimization_barrier(jnp.full(amax.shape, FP8_MAX, jnp.float32)), _TINY)
    expanded = _expand(scales, x.shape, axes)
    if exact:
        expanded = jax.lax.optimization_barrier(expanded)
    q = jnp.clip(x / expanded, -FP8_MAX, FP8_MAX).astype(FP8)
    return q, scales


def quantize_rows(x):
    """x [..., K] -> (fp8 [..., K], scales [..., ceil(K / 128)] fp32): 1 x 128 groups along K. The
    activations' quantizer, on the forward's path: its codes are x times 1 / scale (see _quantize)."""
    return _quantize(x, (x.ndim - 1,), exact=False)


def dequantize_rows(q, scales):
    """The float32 values of `quantize_rows`' output."""
    return q.astype(jnp.float32) * _expand(scales, q.shape, (q.ndim - 1,))


def quantize_blocks(w):
    """w [..., N, K] -> (fp8 [..., N, K], scales [..., ceil(N / 128), ceil(K / 128)] fp32): 128 x 128
    blocks over the last two axes (torch's [out, in] layout, as the release stores them); codes of
    the true quotient w / scale, jitted or not."""
    return _quantize(w, (w.ndim - 2, w.ndim - 1), exact=True)


def dequantize_blocks(q, scales):
    """The float32 values of `quantize_blocks`' output."""
    return q.astype(jnp.float32) * _expand(scales, q.shape, (q.ndim - 2, q.ndim - 1))
