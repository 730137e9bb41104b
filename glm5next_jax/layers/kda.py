"""Kimi Delta Attention sublayer: projections, short causal conv, forget gate, KDA core, gated norm.

p (torch weights transposed to [in, out]):
  qkv_proj [D, 3, C] (q, k, v; C = heads * head_dim), conv [K, 3, C] fp32 (depthwise, causal),
  f_a [D, dk], f_b [dk, C], dt_bias [C] fp32 (per channel), A_log [H] fp32 (per head),
  b_proj [D, H], g_a [D, dk], g_b [dk, C], o_norm [dk], o_proj [C, D].
"""

import jax
import jax.numpy as jnp

from pallas_kernels import kda as kda_core

from ..errors import InputError
from ..sharding import shard_mapped
from .common import inverse_rms, linear

TOKEN_HEADS = ("batch", "sequence", "kda_heads", None)  # q, k, v, g and the core's output [B, T, H, d]
STATE = ("batch", "kda_heads", None, None)


def gated_rms_norm(o, gate, weight, eps):
    """RMSNorm over head_dim, weighted, times sigmoid(gate); fp32 throughout, cast to o.dtype."""
    normed = o.astype(jnp.float32) * inverse_rms(o, eps)
    return (normed * weight.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(o.dtype)


def kda_inputs(p, h, config, conv_state=None, segment_ids=None):
    """The KDA core's inputs from the normalised hidden state h [B, T, D].

    conv_state [B, 3, C, K] holds the inputs before h (None: zeros); segment_ids [B, T] (packed
    sequences) keep each conv window within its segment. Returns (q, k, v [B, T, H, d],
    g [B, T, H, dk] fp32, beta [B, T, H], new conv_state).
    """
    heads, head_dim = config.linear_num_heads, config.linear_head_dim
    qkv, conv_state = kda_core.causal_short_conv(linear(h, p["qkv_proj"]), p["conv"], conv_state, segment_ids)
    q, k, v = (qkv[..., i, :].reshape(*qkv.shape[:-2], heads, head_dim) for i in range(3))
    beta = jax.nn.sigmoid(linear(h, p["b_proj"]))
    return q, k, v, gate_log_decay(p, h, config), beta, conv_state


def gate_log_decay(p, h, config):
    """The forget gate's per-channel log decay g [B, T, H, dk] (fp32) from h."""
    f = linear(linear(h, p["f_a"]), p["f_b"])
    return kda_core.forget_gate(f, p["dt_bias"], p["A_log"], lower_bound=config.linear_lower_bound)


def kda_output(p, h, o, config):
    """o_proj(gated RMSNorm of the core output o [B, T, H, dv], gated by g_b(g_a(h)))."""
    gate = linear(linear(h, p["g_a"]), p["g_b"]).reshape(o.shape)
    normed = gated_rms_norm(o, gate, p["o_norm"], config.rms_norm_eps)
    return linear(normed.reshape(*o.shape[:-2], -1), p["o_proj"])


def scan_implementation(config, implementation):
    """The chunked scan's implementation: the Pallas scan factors decays through reference tokens
    and is exact only for gates >= MIN_GATE, which the lower bound guarantees."""
    bounded = config.linear_lower_bound is not None and config.linear_lower_bound >= kda_core.MIN_GATE
    if bounded:
        return implementation
    if implementation == "pallas":
        raise InputError(
            f"the Pallas KDA scan needs gates bounded below by {kda_core.MIN_GATE}; this config's "
            f"linear_lower_bound is {config.linear_lower_bound}: use implementation='reference'"
        )
    return "reference"


def chunk_scan(q, k, v, g, beta, state, config, implementation, interpret, layout, segment_ids=None):
    """The chunked scan (state None: zeros; segment_ids: packed sequences, which the Pallas scan
    declines), on each device's batch rows and heads under a layout."""
    implementation = scan_implementation(config, implementation)
    if state is None:
        state = jnp.zeros((*q.shape[:1], *q.shape[2:], v.shape[-1]), jnp.float32)
    scan = lambda *args: kda_core.kda_chunk_scan(  # noqa: E731
        *args[:6], segment_ids=args[6] if len(args) > 6 else None, implementation=implementation, interpret=interpret
    )
    in_axes = (TOKEN_HEADS,) * 4 + (TOKEN_HEADS[:3], STATE) + ((("batch", "sequence"),) if segment_ids is not None else ())
    args = (q, k, v, g, beta, state) + ((segment_ids,) if segment_ids is not None else ())
    return shard_mapped(layout, scan, in_axes, (TOKEN_HEADS, STATE))(*args)


def kda_layer(p, h, config, padding_mask=None, implementation=None, interpret=False, layout=None, segment_ids=None):
    """Uncached KDA sublayer over a whole sequence. h [B, T, D]; padding_mask [B, T] zeroes pad rows.

    implementation: None (Pallas on GPU, else the reference), "reference" or "pallas"; interpret runs
    the kernels in Pallas' interpreter (`pallas_kernels.common.pick_implementation`); layout: the
    mesh (the scan runs on each device's rows and heads). segment_ids [B, T] (packed sequences, None:
    one a row): the conv windows and the recurrent state start afresh at each segment, the scan on
    the reference."""
    if padding_mask is not None:
        h = h * padding_mask[..., None].astype(h.dtype)
    q, k, v, g, beta, _ = kda_inputs(p, h, config, segment_ids=segment_ids)
    o, _ = chunk_scan(q, k, v, g, beta, None, config, implementation, interpret, layout, segment_ids)
    return kda_output(p, h, o, config)


def roll_conv_state(conv_state, x, n_new):
    """The last K conv inputs after appending the first n_new[b] tokens of x [B, T, 3, C] to each row."""
    kernel = conv_state.shape[-1]
    history = jnp.concatenate([jnp.moveaxis(conv_state, -1, 1), x.astype(conv_state.dtype)], axis=1)
    window = n_new[:, None] + jnp.arange(kernel)
    window = window.reshape(*window.shape, *([1] * (history.ndim - 2)))
    return jnp.moveaxis(jnp.take_along_axis(history, window, axis=1), 1, -1)


def kda_layer_cached(p, h, config, layer_cache, valid, implementation=None, interpret=False, layout=None):
    """KDA over new tokens appended to a live state. h [B, T, D]; valid [B, T] marks each row's new
    tokens (a prefix of the row). Padding rows neither decay nor update the state (g = 0, beta = 0),
    and the conv state keeps each row's own last K inputs. Returns (y, new layer cache)."""
    h = h * valid[..., None].astype(h.dtype)
    qkv = linear(h, p["qkv_proj"])
    conv_state = roll_conv_state(layer_cache["conv"], qkv, valid.sum(-1))
    heads, head_dim = config.linear_num_heads, config.linear_head_dim
    y, _ = kda_core.causal_short_conv(qkv, p["conv"], layer_cache["conv"])
    q, k, v = (y[..., i, :].reshape(*y.shape[:-2], heads, head_dim) for i in range(3))
    g = jnp.where(valid[..., None, None], gate_log_decay(p, h, config), 0.0)
    beta = jnp.where(valid[..., None], jax.nn.sigmoid(linear(h, p["b_proj"])), 0)
    o, state = chunk_scan(q, k, v, g, beta, layer_cache["state"], config, implementation, interpret, layout)
    return kda_output(p, h, o, config), {"conv": conv_state, "state": state}


def kda_layer_decode(p, h, config, layer_cache, implementation=None, interpret=False, layout=None):
    """One new token per sequence (h [B, 1, D]) through the fused decode step."""
    channels = ("batch", None, "kda_channels")
    step = lambda *args: kda_core.kda_decode_step(  # noqa: E731
        *args, lower_bound=config.linear_lower_bound, implementation=implementation, interpret=interpret
    )
    in_axes = (
        channels, channels + (None,), (None, None, "kda_channels"), ("batch", "kda_channels"), ("kda_channels",),
        ("kda_heads",), ("batch", "kda_heads"), STATE,
    )
    o, conv_state, state = shard_mapped(layout, step, in_axes, (("batch", "kda_heads", None), channels + (None,), STATE))(
        linear(h[:, 0], p["qkv_proj"]),
        layer_cache["conv"],
        p["conv"],
        linear(linear(h[:, 0], p["f_a"]), p["f_b"]),
        p["dt_bias"],
        p["A_log"],
        linear(h[:, 0], p["b_proj"]),
        layer_cache["state"],
    )
    return kda_output(p, h, o[:, None], config), {"conv": conv_state, "state": state}
