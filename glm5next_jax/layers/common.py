"""Norms and the projection every layer uses."""

import jax
import jax.numpy as jnp

# fp32 weights mean fp32 arithmetic (no TF32 on GPU); bf16 weights are unaffected by this setting.
PRECISION = jax.lax.Precision.HIGHEST


def linear(x, w):
    """x [..., in] times w [in, *out] -> [..., *out], in x's dtype."""
    return jnp.tensordot(x, w, axes=1, precision=PRECISION).astype(x.dtype)


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
