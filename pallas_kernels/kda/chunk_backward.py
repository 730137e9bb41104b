"""The chunked KDA scan's backward pass, derived by hand in jnp: what `jax.vjp` of
`kda_chunk_scan_reference` computes, in the chunked form the backward kernels will take, and the
Pallas scan's backward meanwhile (about 2x faster than the reference's autodiff on a CPU).

Per chunk (per head; C tokens, G the running sums of the gates inside the chunk, G_L its last row,
S the state entering the chunk), the forward is
    L = strict_tril(beta k_i . k_j exp(G_i - G_j)),  T = (I + L)^-1,
    u = T (beta v),  w = T (beta k exp(G)),  A = tril(q_i . k_j exp(G_i - G_j)),
    v' = u - w S,  o = (q exp(G)) S + A v',  S' = exp(G_L) S + (k exp(G_L - G))^T v'.
Given d o and d S' (the next chunk's d S, or the final state's cotangent):
    d v' = A^T d o + (k exp(G_L - G)) d S',
    d S = exp(G_L) d S' + (q exp(G))^T d o - w^T d v'          (the serial recurrence, backwards),
    d A = tril(d o v'^T),  d w = -d v' S^T,  d(q exp(G)) = d o S^T,  d(k exp(G_L - G)) = v' d S'^T,
    d T = d v' (beta v)^T + d w (beta k exp(G))^T,  d(beta v) = T^T d v',  d(beta k exp(G)) = T^T d w,
    d L = -strict_tril(T^T d T T^T),
and the pairwise terms pass d L and d A to q, beta k and k; each pair's decay exp(G_i - G_j) adds
its term's gradient to G_i and takes it from G_j; d g is the reverse running sum of d G inside the
chunk. A first pass recomputes the states entering the chunks (kept: [N, B, H, dk, dv] fp32); the
second walks the chunks backwards, recomputing each one's terms.
"""

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

from pallas_kernels.common import HIGHEST
from pallas_kernels.kda.reference import _prepare, chunk_pairs, from_chunks, to_chunks


def _einsum(spec, *xs):
    return jnp.einsum(spec, *xs, precision=HIGHEST)


def kda_chunk_scan_backward(q, k, v, g, beta, initial_state, d_o, d_state, *, chunk_size=64, lengths=None):
    """(d q, d k, d v, d g, d beta, d initial_state) of `kda_chunk_scan_reference(q, k, v, g, beta,
    initial_state, chunk_size=, lengths=)` for the cotangents d_o [B, T, H, dv] and d_state
    [B, H, dk, dv]: its `jax.vjp`, by the chunked backward above (no segment_ids). initial_state
    may be None (zeros; its gradient is then returned all the same). Each gradient in its input's
    dtype."""
    prepared, prepare_vjp = jax.vjp(lambda *x: _prepare(*x, lengths), q, k, v, g, beta,
                                    jnp.zeros((*q.shape[:1], q.shape[2], q.shape[3], v.shape[3]), jnp.float32)
                                    if initial_state is None else initial_state)
    grads = _backward(*prepared, d_o.astype(jnp.float32), d_state.astype(jnp.float32), chunk_size)
    return prepare_vjp(grads)


def _backward(q, k, v, g, beta, state, d_o, d_state, c):
    t = q.shape[1]
    xs = tuple(to_chunks(x, c) for x in (q, k, v, g, beta))
    i_idx, j_idx = jnp.arange(c)[:, None], jnp.arange(c)[None, :]
    causal, strictly_causal = j_idx <= i_idx, j_idx < i_idx
    eye = jnp.eye(c, dtype=jnp.float32)

    def chunk_terms(q_c, k_c, v_c, g_c, b_c):
        cum, decay, k_beta, lower, qk = chunk_pairs(q_c, k_c, g_c, b_c, causal, strictly_causal)
        inverse = solve_triangular(eye + lower, jnp.broadcast_to(eye, lower.shape), lower=True, unit_diagonal=True)
        beta_v, beta_k = v_c * b_c[..., None], k_beta * jnp.exp(cum)
        u, w = _einsum("bhij,bhjv->bhiv", inverse, beta_v), _einsum("bhij,bhjd->bhid", inverse, beta_k)
        return cum, decay, k_beta, inverse, beta_v, beta_k, u, w, qk

    def forward(s, x):  # the state entering each chunk
        k_c = x[1]
        cum, *_, u, w, _ = chunk_terms(*x)
        last = cum[..., -1:, :]
        v_new = u - _einsum("bhck,bhkv->bhcv", w, s)
        return s * jnp.exp(last)[..., 0, :, None] + _einsum("bhck,bhcv->bhkv", k_c * jnp.exp(last - cum), v_new), s

    _, states = jax.lax.scan(forward, state, xs)

    def backward(d_next, x):
        (q_c, k_c, v_c, g_c, b_c), s, d_o_c = x
        cum, decay, k_beta, inverse, beta_v, beta_k, u, w, qk = chunk_terms(q_c, k_c, v_c, g_c, b_c)
        last = cum[..., -1:, :]
        v_new = u - _einsum("bhck,bhkv->bhcv", w, s)
        k_last, q_gated = k_c * jnp.exp(last - cum), q_c * jnp.exp(cum)
        d_v_new = _einsum("bhij,bhiv->bhjv", qk, d_o_c) + _einsum("bhck,bhkv->bhcv", k_last, d_next)
        d_s = (jnp.exp(last)[..., 0, :, None] * d_next + _einsum("bhck,bhcv->bhkv", q_gated, d_o_c)
               - _einsum("bhck,bhcv->bhkv", w, d_v_new))
        d_qk = jnp.where(causal, _einsum("bhiv,bhjv->bhij", d_o_c, v_new), 0.0)
        d_w = -_einsum("bhcv,bhkv->bhck", d_v_new, s)
        d_q_gated = _einsum("bhcv,bhkv->bhck", d_o_c, s)
        d_k_last = _einsum("bhcv,bhkv->bhck", v_new, d_next)
        d_inverse = _einsum("bhiv,bhjv->bhij", d_v_new, beta_v) + _einsum("bhid,bhjd->bhij", d_w, beta_k)
        d_beta_v = _einsum("bhji,bhjv->bhiv", inverse, d_v_new)
        d_beta_k = _einsum("bhji,bhjd->bhid", inverse, d_w)
        d_lower = jnp.where(strictly_causal, -_einsum("bhki,bhkl,bhjl->bhij", inverse, d_inverse, inverse), 0.0)
        # The pairs: L_ij = sum_c (beta k)_ic k_jc decay_ijc and A_ij = sum_c q_ic k_jc decay_ijc.
        pair_terms = (_einsum("bhij,bhid,bhjd,bhijd->bhijd", d_lower, k_beta, k_c, decay)
                      + _einsum("bhij,bhid,bhjd,bhijd->bhijd", d_qk, q_c, k_c, decay))
        d_cum = pair_terms.sum(-2) - pair_terms.sum(-3)
        d_k_beta = _einsum("bhij,bhjd,bhijd->bhid", d_lower, k_c, decay) + d_beta_k * jnp.exp(cum)
        d_k = (_einsum("bhij,bhid,bhijd->bhjd", d_lower, k_beta, decay) + _einsum("bhij,bhid,bhijd->bhjd", d_qk, q_c, decay)
               + d_k_last * jnp.exp(last - cum) + d_k_beta * b_c[..., None])
        d_q = _einsum("bhij,bhjd,bhijd->bhid", d_qk, k_c, decay) + d_q_gated * jnp.exp(cum)
        d_cum = d_cum + d_q_gated * q_gated + d_beta_k * beta_k - d_k_last * k_last
        d_last = (d_k_last * k_last).sum(-2) + jnp.exp(last[..., 0, :]) * (s * d_next).sum(-1)
        d_cum = d_cum.at[..., -1, :].add(d_last)
        d_g = jnp.flip(jnp.cumsum(jnp.flip(d_cum, -2), -2), -2)
        d_beta = (d_beta_v * v_c).sum(-1) + (d_k_beta * k_c).sum(-1)
        return d_s, (d_q, d_k, d_beta_v * b_c[..., None], d_g, d_beta)

    d_state0, grads = jax.lax.scan(backward, d_state, (xs, states, to_chunks(d_o, c)), reverse=True)
    return (*(from_chunks(x, t) for x in grads), d_state0)
