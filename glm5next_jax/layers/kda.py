"""Kimi Delta Attention sublayer: projections, short causal conv, forget gate, KDA core, gated norm.

p (torch weights transposed to [in, out]):
  qkv_proj [D, 3, C] (q, k, v; C = heads * head_dim), conv [K, 3, C] fp32 (depthwise, causal),
  f_a [D, dk], f_b [dk, C], dt_bias [C] fp32 (per channel), A_log [H] fp32 (per head),
  b_proj [D, H], g_a [D, dk], g_b [dk, C], o_norm [dk], o_proj [C, D].
"""

import jax
import jax.numpy as jnp

from pallas_kernels import kda as kda_core

from .common import linear


def causal_conv(x, weight, conv_state=None):
    """Depthwise causal conv over time, then SiLU, in the weight's dtype (fp32), returned in x.dtype.

    x [B, T, *C]; weight [K, *C]; conv_state [B, K-1, *C] holds the inputs before x (zeros if None).
    Returns (y [B, T, *C], new conv_state [B, K-1, *C]: the last K-1 inputs, state included).
    """
    kernel = weight.shape[0]
    history = (
        jnp.zeros((x.shape[0], kernel - 1, *x.shape[2:]), weight.dtype)
        if conv_state is None
        else conv_state.astype(weight.dtype)
    )
    padded = jnp.concatenate([history, x.astype(weight.dtype)], axis=1)
    t = x.shape[1]
    y = sum(padded[:, j : j + t] * weight[j] for j in range(kernel))
    return jax.nn.silu(y).astype(x.dtype), padded[:, t:]


def forget_gate(p, h, config):
    """Per-channel log decay g [B, T, H, dk] in fp32: lower_bound * sigmoid(exp(A_log) * (f + dt_bias)).

    Without a lower bound: -exp(A_log) * softplus(f + dt_bias).
    """
    heads, head_dim = config.linear_num_heads, config.linear_head_dim
    f = linear(linear(h, p["f_a"]), p["f_b"]).astype(jnp.float32) + p["dt_bias"].astype(jnp.float32)
    f = f.reshape(*f.shape[:-1], heads, head_dim)
    rate = jnp.exp(p["A_log"].astype(jnp.float32))[:, None]  # one rate per head, shared by its channels
    if config.linear_lower_bound is not None:
        return config.linear_lower_bound * jax.nn.sigmoid(rate * f)
    return -rate * jnp.where(f > 20.0, f, jnp.log1p(jnp.exp(f)))


def gated_rms_norm(o, gate, weight, eps):
    """RMSNorm over head_dim, weighted, times sigmoid(gate); fp32 throughout, cast to o.dtype."""
    o32 = o.astype(jnp.float32)
    normed = o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + eps)
    return (normed * weight.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(o.dtype)


def kda_inputs(p, h, config, conv_state=None):
    """The KDA core's inputs from the normalised hidden state h [B, T, D].

    Returns (q, k, v [B, T, H, d], g [B, T, H, dk] fp32, beta [B, T, H], new conv_state).
    """
    heads, head_dim = config.linear_num_heads, config.linear_head_dim
    qkv, conv_state = causal_conv(linear(h, p["qkv_proj"]), p["conv"], conv_state)
    q, k, v = (qkv[..., i, :].reshape(*qkv.shape[:-2], heads, head_dim) for i in range(3))
    beta = jax.nn.sigmoid(linear(h, p["b_proj"]))
    return q, k, v, forget_gate(p, h, config), beta, conv_state


def kda_output(p, h, o, config):
    """o_proj(gated RMSNorm of the core output o [B, T, H, dv], gated by g_b(g_a(h)))."""
    gate = linear(linear(h, p["g_a"]), p["g_b"]).reshape(o.shape)
    normed = gated_rms_norm(o, gate, p["o_norm"], config.rms_norm_eps)
    return linear(normed.reshape(*o.shape[:-2], -1), p["o_proj"])


def kda_layer(p, h, config, padding_mask=None):
    """Uncached KDA sublayer over a whole sequence. h [B, T, D]; padding_mask [B, T] zeroes pad rows."""
    if padding_mask is not None:
        h = h * padding_mask[..., None].astype(h.dtype)
    q, k, v, g, beta, _ = kda_inputs(p, h, config)
    o, _ = kda_core.kda_chunk_scan(q, k, v, g, beta)
    return kda_output(p, h, o, config)
