"""The pure-jnp references of the KDA core, the oracles of the kernels beside them: the token-by-token
recurrence, the chunked (WY) scan, the decode step (and its two halves as the two-kernel step splits
it), and the pieces around the core the model and the kernels share (the short conv, the forget gate,
the L2 norm)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.linalg import solve_triangular

from pallas_kernels.common import HIGHEST

L2_EPS = 1e-6  # the model's L2-norm epsilon: one value for the references and the kernels


def causal_short_conv(x, weight, conv_state=None, segment_ids=None):
    """Depthwise causal conv over time, then SiLU, computed in the weight's dtype (fp32).

    x [B, T, *C]; weight [K, *C]; conv_state [B, *C, K]: the last K inputs before x (zeros if None),
    oldest first, as transformers keeps it; segment_ids None or [B, T] int: a token's window holds
    only the inputs of its own segment (the state's belong to the first token's). Returns (y [B, T, *C]
    in x.dtype, the new conv_state: the last K inputs of state + x, in x.dtype).
    """
    kernel = weight.shape[0]
    t = x.shape[1]
    if conv_state is None:
        history = jnp.zeros((x.shape[0], kernel, *x.shape[2:]), weight.dtype)
    else:
        history = jnp.moveaxis(conv_state, -1, 1).astype(weight.dtype)  # [B, K, *C]
    padded = jnp.concatenate([history, x.astype(weight.dtype)], axis=1)  # [B, K + T, *C]
    if segment_ids is not None:
        segments = jnp.concatenate([jnp.repeat(segment_ids[:, :1], kernel, axis=1), segment_ids], axis=1)
        own = [segments[:, 1 + j : 1 + j + t] == segment_ids for j in range(kernel)]
        expand = lambda m: m.reshape(*m.shape, *([1] * (x.ndim - 2)))  # noqa: E731
        y = sum(jnp.where(expand(own[j]), padded[:, 1 + j : 1 + j + t], 0.0) * weight[j] for j in range(kernel))
    else:
        y = sum(padded[:, 1 + j : 1 + j + t] * weight[j] for j in range(kernel))
    new_state = jnp.moveaxis(padded[:, t:], 1, -1).astype(x.dtype)
    return jax.nn.silu(y).astype(x.dtype), new_state


def forget_gate(f, dt_bias, a_log, *, lower_bound):
    """Per-channel log decay g [..., H, dk] in fp32 from the gate projection f [..., H * dk].

    lower_bound * sigmoid(exp(A_log) * (f + dt_bias)), one rate exp(A_log) per head shared by its
    channels; without a lower bound, -exp(A_log) * softplus(f + dt_bias).
    """
    heads = a_log.shape[0]
    f = f.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    f = f.reshape(*f.shape[:-1], heads, -1)
    rate = jnp.exp(a_log.astype(jnp.float32))[:, None]
    if lower_bound is not None:
        return lower_bound * jax.nn.sigmoid(rate * f)
    return -rate * jnp.where(f > 20.0, f, jnp.log1p(jnp.exp(f)))


def compute_dtype(x):
    """fp32, or fp64 for fp64 inputs (the references as float64 oracles)."""
    return jnp.promote_types(x.dtype, jnp.float32)


def l2_normalise(x):
    x = x.astype(compute_dtype(x))
    return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def check_scan_inputs(q, k, v, g, beta, initial_state, lengths=None, segment_ids=None):
    if q.ndim != 4 or q.shape != k.shape:
        raise ValueError(f"q and k must both be [B, T, H, dk], got {q.shape} and {k.shape}")
    b, t, h, dk = q.shape
    if v.ndim != 4 or v.shape[:3] != (b, t, h):
        raise ValueError(f"v must be [B, T, H, dv] = [{b}, {t}, {h}, dv], got {v.shape}")
    if g.shape != q.shape:
        raise ValueError(f"g must be [B, T, H, dk] = {q.shape}, got {g.shape}")
    if beta.shape != (b, t, h):
        raise ValueError(f"beta must be [B, T, H] = {(b, t, h)}, got {beta.shape}")
    if initial_state is not None and initial_state.shape != (b, h, dk, v.shape[-1]):
        raise ValueError(f"initial_state must be [B, H, dk, dv] = {(b, h, dk, v.shape[-1])}, got {initial_state.shape}")
    if lengths is not None and (lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer)):
        raise ValueError(f"lengths must be integer [B] = [{b}], got {lengths.dtype}{list(lengths.shape)}")
    if segment_ids is not None and (segment_ids.shape != (b, t) or not jnp.issubdtype(segment_ids.dtype, jnp.integer)):
        raise ValueError(f"segment_ids must be integer [B, T] = [{b}, {t}], got {segment_ids.dtype}{list(segment_ids.shape)}")
    if lengths is not None and not isinstance(lengths, jax.core.Tracer):  # values are known outside jit only
        values = np.asarray(lengths)
        if values.size and (values.min() < 0 or values.max() > t):
            raise ValueError(f"lengths must be in [0, T] = [0, {t}], got {values.tolist()}")


def _prepare(q, k, v, g, beta, initial_state, lengths):
    """The scan's inputs in its compute dtype (that of q): q and k L2-normalised (q scaled by dk^-0.5),
    tokens at or past `lengths` neither decaying nor writing, the state zeros if None."""
    dk = q.shape[-1]
    dtype = compute_dtype(q)
    q = l2_normalise(q) * dk**-0.5
    k = l2_normalise(k)
    g = g.astype(dtype)
    beta = beta.astype(dtype)
    if lengths is not None:
        valid = jnp.arange(q.shape[1])[None, :] < lengths[:, None]  # [B, T]
        g = jnp.where(valid[:, :, None, None], g, 0.0)
        beta = jnp.where(valid[:, :, None], beta, 0.0)
    state = (
        jnp.zeros((q.shape[0], q.shape[2], dk, v.shape[-1]), dtype)
        if initial_state is None
        else initial_state.astype(dtype)
    )
    return q, k, v.astype(dtype), g, beta, state


def segment_starts(segment_ids):
    """[B, T] bool: the tokens whose segment differs from the one before (never the first token,
    which continues the initial state)."""
    return jnp.concatenate([jnp.zeros_like(segment_ids[:, :1], jnp.bool_), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)


def kda_recurrent_reference(q, k, v, g, beta, initial_state=None, *, lengths=None, segment_ids=None):
    """Token-by-token KDA. q, k [B, T, H, dk], v [B, T, H, dv], g [B, T, H, dk] (log decay, fp32),
    beta [B, T, H], lengths [B] or None (all T valid), segment_ids [B, T] int or None: where a
    token's segment differs from the one before, the state is discarded first (packed sequences;
    the first token continues the initial state).
    Returns (o [B, T, H, dv] in q.dtype, final_state [B, H, dk, dv] fp32)."""
    check_scan_inputs(q, k, v, g, beta, initial_state, lengths, segment_ids)
    out_dtype = q.dtype
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, initial_state, lengths)
    starts = jnp.zeros(q.shape[:2], jnp.bool_) if segment_ids is None else segment_starts(segment_ids)

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t, start = xs
        s = jnp.where(start[:, None, None, None], 0.0, s) * jnp.exp(g_t)[..., None]
        predicted = jnp.einsum("bhk,bhkv->bhv", k_t, s, precision=HIGHEST)
        delta = (v_t - predicted) * b_t[..., None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        return s, jnp.einsum("bhk,bhkv->bhv", q_t, s, precision=HIGHEST)

    time_major = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, starts)]
    state, o = jax.lax.scan(step, state, time_major)
    return jnp.moveaxis(o, 0, 1).astype(out_dtype), state


def kda_chunk_scan_reference(q, k, v, g, beta, initial_state=None, *, chunk_size=64, lengths=None, segment_ids=None):
    """Chunked (WY) KDA, same arguments and results as `kda_recurrent_reference`.

    Within a chunk the delta rule's triangular system is solved exactly; chunks are scanned in
    order, carrying the fp32 state. Pairwise decays exp(G_i - G_j) are formed per channel (never
    as exp(G_i) * exp(-G_j), which overflows for gates near the lower bound). With segment_ids a
    chunk's pairs couple only within a segment, the carried state reaches only the tokens that
    continue its segment, and the chunk hands on the state of its last segment. Differentiated, each
    chunk's step is recomputed in the backward pass (`jax.checkpoint`): only the states between chunks
    are kept, not every chunk's [C, C, dk] pairwise decays (at T = 2048, H = 4, d = 64: 39 MB of
    temporaries for the gradient instead of 495, and 1.6x faster on a CPU).
    """
    check_scan_inputs(q, k, v, g, beta, initial_state, lengths, segment_ids)
    out_dtype = q.dtype
    b, t = q.shape[:2]
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, initial_state, lengths)
    c = chunk_size
    n_chunks = -(-t // c)
    pad = n_chunks * c - t
    # Each token's segment, the padding continuing the last one; [N, B, 1, C] as the heads share it.
    segments = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    segments = jnp.pad(segments, [(0, 0), (0, pad)], mode="edge").reshape(b, n_chunks, 1, c)

    chunks = functools.partial(to_chunks, chunk_size=c)
    i_idx = jnp.arange(c)[:, None]
    j_idx = jnp.arange(c)[None, :]
    eye = jnp.eye(c, dtype=jnp.float32)

    def step(carry, xs):
        s, state_segment = carry  # the state and the segment it belongs to [B, 1]
        q_c, k_c, v_c, g_c, b_c, seg = xs  # [B, H, C, d], beta [B, H, C], seg [B, 1, C]
        same = seg[..., :, None] == seg[..., None, :]  # [B, 1, C_i, C_j]
        causal, strictly_causal = same & (j_idx <= i_idx), same & (j_idx < i_idx)
        from_state = (seg == state_segment[..., None])[..., None].astype(jnp.float32)  # [B, 1, C, 1]
        cum, _, k_beta, lower, qk = chunk_pairs(q_c, k_c, g_c, b_c, causal, strictly_causal)
        # (I + L)^-1 applied to beta*v and to beta*k*exp(G): the WY representation of the chunk.
        u = solve_triangular(eye + lower, v_c * b_c[..., None], lower=True, unit_diagonal=True)
        w = solve_triangular(eye + lower, k_beta * jnp.exp(cum) * from_state, lower=True, unit_diagonal=True)
        v_new = u - jnp.einsum("bhck,bhkv->bhcv", w, s, precision=HIGHEST)
        o = jnp.einsum("bhck,bhkv->bhcv", q_c * jnp.exp(cum) * from_state, s, precision=HIGHEST)
        o = o + jnp.einsum("bhij,bhjv->bhiv", qk, v_new, precision=HIGHEST)
        last = cum[..., -1:, :]
        in_last = (seg == seg[..., -1:])[..., None].astype(jnp.float32)  # [B, 1, C, 1]: the last segment's tokens
        s = s * (jnp.exp(last)[..., 0, :, None] * from_state[..., -1:, :]) + jnp.einsum(
            "bhck,bhcv->bhkv", k_c * jnp.exp(last - cum) * in_last, v_new, precision=HIGHEST
        )
        return (s, seg[..., -1]), o

    xs = [chunks(x) for x in (q, k, v, g)] + [chunks(beta), jnp.moveaxis(segments, 1, 0)]
    (state, _), o = jax.lax.scan(jax.checkpoint(step), (state, segments[:, 0, :, 0]), xs)
    return from_chunks(o, t).astype(out_dtype), state


def to_chunks(x, chunk_size):
    """[B, T, H, ...] -> [N, B, H, C, ...], T padded with zeros to whole chunks."""
    b, t, h = x.shape[:3]
    n = -(-t // chunk_size)
    x = jnp.pad(x, [(0, 0), (0, n * chunk_size - t)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(b, n, chunk_size, h, *x.shape[3:])
    return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 3, 2)


def from_chunks(x, t):
    """`to_chunks`' inverse: [N, B, H, C, ...] -> [B, t, H, ...]."""
    n, b, h, c = x.shape[:4]
    x = jnp.moveaxis(jnp.moveaxis(x, 0, 1), 2, 3)
    return x.reshape(b, n * c, h, *x.shape[4:])[:, :t]


def chunk_pairs(q_c, k_c, g_c, b_c, causal, strictly_causal):
    """A chunk's pairwise terms ([B, H, C, d] inputs, beta [B, H, C]; masks [.., C_i, C_j]):
    (G = cumsum of g, the decays exp(G_i - G_j) [B, H, C_i, C_j, dk] (0 off `causal`), beta k,
    L = strict_tril(beta k_i . k_j decayed), A_qk = tril(q_i . k_j decayed)). The decays are formed
    per channel (never as exp(G_i) * exp(-G_j), which overflows for gates near the lower bound)."""
    cum = jnp.cumsum(g_c, axis=-2)
    decay = jnp.exp(jnp.where(causal[..., None], cum[..., :, None, :] - cum[..., None, :, :], -jnp.inf))
    k_beta = k_c * b_c[..., None]
    lower = jnp.where(strictly_causal, jnp.einsum("bhid,bhjd,bhijd->bhij", k_beta, k_c, decay, precision=HIGHEST), 0.0)
    qk = jnp.where(causal, jnp.einsum("bhid,bhjd,bhijd->bhij", q_c, k_c, decay, precision=HIGHEST), 0.0)
    return cum, decay, k_beta, lower, qk


def kda_decode_step_reference(qkv, conv_state, conv_weight, f, dt_bias, a_log, beta_logits, state, *, lower_bound):
    """One token per sequence, fused: conv-state update, SiLU, L2 norm, gate, beta, state update, output.

    qkv [B, 3, C] (the token's q, k, v projections before the conv), conv_state [B, 3, C, K],
    conv_weight [K, 3, C] fp32, f [B, C] (f_b(f_a(h)), before dt_bias), dt_bias [C], a_log [H],
    beta_logits [B, H] (b_proj(h)), state [B, H, dk, dv] fp32.
    Returns (o [B, H, dv] in qkv.dtype, new conv_state, new state).
    """
    heads = a_log.shape[0]
    y, conv_state = causal_short_conv(qkv[:, None], conv_weight, conv_state)
    q, k, v = (y[:, :, i].reshape(y.shape[0], 1, heads, -1) for i in range(3))
    g = forget_gate(f[:, None], dt_bias, a_log, lower_bound=lower_bound)
    beta = jax.nn.sigmoid(beta_logits.astype(jnp.float32))[:, None]
    o, state = kda_recurrent_reference(q, k, v, g, beta, state)
    return o[:, 0], conv_state, state


def decode_token_vectors_reference(qkv, conv_state, conv_weight, f, dt_bias, a_log, beta_logits, *, lower_bound):
    """The decode step's token side as the two-kernel step hands it on (`decode_fused_triton.token_vectors`'
    oracle): (vectors [B, H, 4, d] fp32: q normalised and scaled by dk^-0.5, sqrt(beta) k with k
    normalised, the decay exp(g), sqrt(beta) v; the new conv state). Arguments as
    `kda_decode_step_reference`, dk = dv = d.

    The delta rule S <- D S + beta k (v - k^T D S)^T is D S + k' (v' - k'^T D S)^T in k' = sqrt(beta) k
    and v' = sqrt(beta) v, so beta takes no vector of its own."""
    heads = a_log.shape[0]
    y, conv_state = causal_short_conv(qkv[:, None], conv_weight, conv_state)
    q, k, v = (y[:, 0, i].reshape(y.shape[0], heads, -1).astype(jnp.float32) for i in range(3))
    q, k = l2_normalise(q) * q.shape[-1] ** -0.5, l2_normalise(k)
    decay = jnp.exp(forget_gate(f, dt_bias, a_log, lower_bound=lower_bound))
    root_beta = jnp.sqrt(jax.nn.sigmoid(beta_logits.astype(jnp.float32)))[..., None]
    return jnp.stack([q, root_beta * k, decay, root_beta * v], axis=2), conv_state


def decode_update_reference(vectors, state, *, out_dtype):
    """One delta-rule step on the state from `decode_token_vectors_reference`'s vectors
    (`decode_update_mosaic.update_state`'s oracle): (o [B, H, dv] in out_dtype, the new state fp32)."""
    q, k, decay, v = (vectors[:, :, i] for i in range(4))
    state = state * decay[..., None]
    delta = v - jnp.einsum("bhk,bhkv->bhv", k, state, precision=HIGHEST)
    state = state + k[..., None] * delta[..., None, :]
    return jnp.einsum("bhk,bhkv->bhv", q, state, precision=HIGHEST).astype(out_dtype), state
