"""Norms and the projection every layer uses."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import block_fp8, moe_gemm

from ..lora import LoraWeight, lora_product
from ..params import Fp8Weight

# fp32 weights mean fp32 arithmetic (no TF32 on GPU); bf16 weights are unaffected by this setting.
PRECISION = jax.lax.Precision.HIGHEST


def linear(x, w):
    """x [..., in] times w [in, *out] -> [..., *out], in x's dtype; an `Fp8Weight` [*out, in] goes
    through `fp8_linear`; a `LoraWeight` adds its adapter's low-rank product to its base's."""
    if isinstance(w, LoraWeight):
        return linear(x, w.base) + lora_product(x, w)
    if isinstance(w, Fp8Weight):
        return fp8_linear(x, w)
    return jnp.tensordot(x, w, axes=1, precision=PRECISION).astype(x.dtype)


def fp8_linear(x, w: Fp8Weight, quantize_rows=block_fp8.quantize_rows):
    """W8A8, as the release runs: x's rows quantized per token in 1 x 128 groups (`quantize_rows`;
    `quantize_split_rows` where a mesh splits them), times the block-scaled weight [*out, in], fp32
    accumulation -> [..., *out] in x's dtype. `moe_gemm.matmul_fp8` (the FP8 kernel on a GPU) where
    the out dimensions flatten into whole blocks; else (gate and up each ending in a partial block, or
    scales per element where a mesh cut a block) the same product on the dequantized operands.
    Differentiated straight through the rounding (`straight_through`): d x = d y times the
    dequantized weight; the weight, frozen, gets no gradient."""
    k, out = x.shape[-1], w.weight.shape[:-1]

    def forward(x, w):
        x_q, x_s = quantize_rows(x.reshape(-1, k))
        in_blocks = (block_fp8.in_blocks(w.weight.shape[-2:], w.scale.shape[-2:])
                     and block_fp8.in_blocks((k,), x_s.shape[-1:]))
        if in_blocks and (len(out) == 1 or out[-1] % block_fp8.BLOCK == 0):
            weight, scale = w.weight.reshape(-1, k), w.scale.reshape(-1, w.scale.shape[-1])
            y = moe_gemm.matmul_fp8(x_q, x_s, weight, scale, out_dtype=x.dtype)
        else:
            weight = block_fp8.dequantize_blocks(w.weight, w.scale).reshape(-1, k)
            y = jnp.dot(block_fp8.dequantize_rows(x_q, x_s), weight.T, precision=PRECISION)
        return y.reshape(*x.shape[:-1], *out).astype(x.dtype)

    def backward(d_y, w):
        weight = block_fp8.dequantize_blocks(w.weight, w.scale).reshape(-1, k)
        d_x = jnp.dot(d_y.reshape(-1, weight.shape[0]).astype(jnp.float32), weight, precision=PRECISION)
        return d_x.reshape(x.shape).astype(x.dtype)

    return straight_through(forward, backward, x, w)


def straight_through(forward, backward, x, consts):
    """forward(x, consts), whose gradient in x is backward(d_y, consts), a linear map of the
    cotangent: how a W8A8 product passes gradients to its input (the product with the dequantized
    weight, straight through the rounding of x, and none through its kernel, which has none).
    consts (a pytree: the frozen weights, indices) get no gradient; forward and backward close over
    no arrays."""
    return _straight_through(forward, backward, x, consts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _straight_through(forward, backward, x, consts):
    return forward(x, consts)


def _no_gradient(c):
    return jnp.zeros_like(c) if jnp.issubdtype(c.dtype, jnp.inexact) else np.zeros(c.shape, jax.dtypes.float0)


_straight_through.defvjp(
    lambda forward, backward, x, consts: (forward(x, consts), consts),
    lambda forward, backward, consts, d_y: (backward(d_y, consts), jax.tree.map(_no_gradient, consts)),
)


def quantize_split_rows(x, axes):
    """`block_fp8.quantize_rows` of rows split over mesh `axes` (inside `shard_map`): x [..., k] holds
    columns [i k, (i + 1) k) of each row, i this device's index over `axes`. A 1 x 128 group that a
    device boundary cuts takes its amax over all its pieces (an all-reduce max of each device's
    partial amaxes, [..., groups]), so every column gets the scale and the code one device would give
    it. -> (e4m3 [..., k], float32 scales per column [..., k])."""
    k = x.shape[-1]
    x = x.astype(jnp.float32)
    group = (jax.lax.axis_index(axes) * k + jnp.arange(k)) // block_fp8.BLOCK
    groups = block_fp8.blocks(jax.lax.axis_size(axes) * k)
    amax = jnp.zeros(x.shape[:-1] + (groups,), jnp.float32).at[..., group].max(jnp.abs(x))
    scales = block_fp8.scales_of(jax.lax.pmax(amax, axes))[..., group]
    return block_fp8.encode(x, scales), scales


def inverse_rms(x, eps):
    """rsqrt(mean(x^2) + eps) over the last axis of x, in fp32 (keeps the axis, as 1)."""
    x32 = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def rms_norm(x, weight, eps):
    """x * rsqrt(mean(x^2) + eps) * weight, normalised in fp32 and cast back before the weight."""
    normed = x.astype(jnp.float32) * inverse_rms(x, eps)
    return weight * normed.astype(x.dtype)


def unweighted_rms_norm(x, eps):
    return x * inverse_rms(x, eps).astype(x.dtype)


def layer_norm(x, weight, bias, eps):
    """LayerNorm with a bias (the indexer's k_norm), statistics in fp32."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    normed = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (normed * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)
