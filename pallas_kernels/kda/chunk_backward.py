"""The chunked KDA scan's backward pass, derived by hand in jnp: what `jax.vjp` of
`kda_chunk_scan_reference` computes, in the chunk-parallel form the backward kernels take, and the
Pallas scan's backward meanwhile.

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
chunk.

Only two recurrences are serial, two [C, d] x [d, d] products a chunk each: the states entering the
chunks ([B, H, N, dk, dv] fp32, the forward's if it kept them) and d S. Everything else runs over
many chunks at once, a run of up to GROUP_CHUNKS of them (of all sequences and heads) at a time: a
first pass gives the recurrences their inputs, a second recomputes each run's forward terms for its
gradients, so only one run's terms are ever live (each run prepares its own inputs, q and k
normalised, and hands back its gradients in the caller's dtypes). The pairwise scores and their
gradients never form the [C, C, dk] decays: the chunk's tokens are taken in blocks of 16 and each
block of pairs is one product of its rows and columns scaled by the two factors of exp(G_i - G_j) =
exp(G_i - G_r) exp(G_r - G_j). Below the diagonal blocks r is the column block's last token and both
factors are at most 1; inside a diagonal block r is its first token and the columns' factor is at
most exp(15 |g|): exact while every gate g >= -5, the kernels' bound (exp(75) times dk stays finite
in fp32).
"""

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

from pallas_kernels.common import HIGHEST
from pallas_kernels.kda.reference import _prepare, from_chunks, to_chunks

DECAY_BLOCK = 16  # columns whose decays share a reference token
# Chunks (of all sequences and heads) a group of the chunk-parallel passes takes: each fp32 [C, d]
# term of a group is 32 MiB at C = 64, d = 128.
GROUP_CHUNKS = 1024


def _einsum(spec, *xs):
    return jnp.einsum(spec, *xs, precision=HIGHEST)


def kda_chunk_scan_backward(q, k, v, g, beta, initial_state, d_o, d_state, *, chunk_size=64, lengths=None,
                            states=None, state_gradients=None):
    """(d q, d k, d v, d g, d beta, d initial_state) of `kda_chunk_scan_reference(q, k, v, g, beta,
    initial_state, chunk_size=, lengths=)` for the cotangents d_o [B, T, H, dv] and d_state
    [B, H, dk, dv]: its `jax.vjp`, by the chunked backward above (no segment_ids; gates >= -5;
    chunk_size a multiple of 16). initial_state may be None (zeros; its gradient is then returned
    all the same). `states`: the states entering the chunks [B, H, N, dk, dv] fp32 as the forward
    computed them, else recomputed (`chunk_states_reference`). `state_gradients`: the serial
    backward recurrence, `state_gradients_reference` (the default) or its kernel
    (`backward_chain_mosaic.state_gradients`). Each gradient in its input's dtype."""
    if chunk_size % DECAY_BLOCK:
        raise ValueError(f"chunk_size must be a multiple of {DECAY_BLOCK}, got {chunk_size}")
    b, t = q.shape[:2]
    n = -(-t // chunk_size)
    raw = tuple(jnp.pad(x, [(0, 0), (0, n * chunk_size - t)] + [(0, 0)] * (x.ndim - 2)) for x in (q, k, v, g, beta, d_o))
    lengths = jnp.full((b,), t, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
    state = jnp.zeros((b, q.shape[2], q.shape[3], v.shape[3]), jnp.float32) if initial_state is None else initial_state
    grads, d_state0 = _backward(raw, lengths, state.astype(jnp.float32), d_state.astype(jnp.float32), chunk_size,
                                states, state_gradients or state_gradients_reference)
    return (*(x[:, :t] for x in grads), d_state0.astype(state.dtype))


def _block_scales(g):
    """The factored decays of a chunk with gates g [.., C, d], its tokens in blocks of 16: below the
    diagonal blocks, through each column block b's last token e (below[b] [.., C - 16 (b + 1), d]:
    exp(G_i - G_e) for the rows past the block; cols_off [.., nb, 16, d]: exp(G_e - G_j) for the
    block's tokens j: both at most 1); inside a diagonal block, through its first token s (rows_diag
    exp(G_i - G_s), at most 1; cols_diag exp(G_s - G_j), at most exp(15 |g|)). Each exponent is summed
    from the gates between the two tokens, never as a difference of the chunk's running sums (which
    grow to 64 |g| and would lose its low bits)."""
    c = g.shape[-2]
    blocks = _blocks(g)
    since_first = jnp.cumsum(blocks.at[..., 0, :].set(0.0), axis=-2)
    below = [jnp.exp(jnp.cumsum(g[..., top:, :], axis=-2)) for top in range(DECAY_BLOCK, c, DECAY_BLOCK)]
    return dict(below=below, cols_off=jnp.exp(_to_last(blocks)), rows_diag=jnp.exp(since_first),
                cols_diag=jnp.exp(-since_first))


def _to_last(g):
    """[.., C, d] -> G_L - G_i: the sum of the gates after token i, summed from the end."""
    after = jnp.flip(jnp.cumsum(jnp.flip(g[..., 1:, :], -2), -2), -2)
    return jnp.concatenate([after, jnp.zeros_like(g[..., :1, :])], axis=-2)


def _blocks(x):
    return x.reshape(*x.shape[:-2], x.shape[-2] // DECAY_BLOCK, DECAY_BLOCK, x.shape[-1])


def _off_factors(x, y, scales, b):
    """Column block b's rows below it and its columns, scaled by their decays' factors."""
    top = (b + 1) * DECAY_BLOCK
    return x[..., top:, :] * scales["below"][b], _blocks(y)[..., b, :, :] * scales["cols_off"][..., b, :, :]


def _decayed_scores(x, y, scales):
    """[.., C_i, C_j]: sum_d x_id y_jd exp(G_id - G_jd) for j at or below i (above: zero or finite, for
    the caller's mask), a strip of 16 columns at a time. x, y [.., C, d]; scales from `_block_scales`."""
    c = x.shape[-2]
    diag = _einsum("...aid,...ajd->...aij", _blocks(x) * scales["rows_diag"], _blocks(y) * scales["cols_diag"])
    strips = []
    for b in range(c // DECAY_BLOCK):
        parts = [jnp.zeros((*x.shape[:-2], b * DECAY_BLOCK, DECAY_BLOCK), x.dtype), diag[..., b, :, :]]
        if (b + 1) * DECAY_BLOCK < c:
            parts.append(_einsum("...id,...jd->...ij", *_off_factors(x, y, scales, b)))
        strips.append(jnp.concatenate(parts, axis=-2))
    return jnp.concatenate(strips, axis=-1)


def _decayed_scores_vjp(d_scores, x, y, scales):
    """The gradients (d x, d y, d G) of `_decayed_scores`' masked sum for d_scores [.., C, C] zero where
    the mask drops a pair: d G takes each pair's term at its row and gives it back at its column."""
    nb = x.shape[-2] // DECAY_BLOCK
    x_diag, y_diag = _blocks(x) * scales["rows_diag"], _blocks(y) * scales["cols_diag"]
    d_diag = jnp.stack([d_scores[..., b * DECAY_BLOCK:(b + 1) * DECAY_BLOCK, b * DECAY_BLOCK:(b + 1) * DECAY_BLOCK]
                        for b in range(nb)], axis=-3)  # [.., nb, 16, 16]
    d_x_diag = _einsum("...aij,...ajd->...aid", d_diag, y_diag)
    d_y_diag = _einsum("...aij,...aid->...ajd", d_diag, x_diag)
    d_x = (d_x_diag * scales["rows_diag"]).reshape(x.shape)
    d_cum_rows = (d_x_diag * x_diag).reshape(x.shape)
    d_y_off, d_cum_off = [], []
    for b in range(nb - 1):
        top = (b + 1) * DECAY_BLOCK
        x_off, y_off = _off_factors(x, y, scales, b)
        d_strip = d_scores[..., top:, b * DECAY_BLOCK:top]
        d_x_off = _einsum("...ij,...jd->...id", d_strip, y_off)
        d_y_off_b = _einsum("...ij,...id->...jd", d_strip, x_off)
        d_x = d_x.at[..., top:, :].add(d_x_off * scales["below"][b])
        d_cum_rows = d_cum_rows.at[..., top:, :].add(d_x_off * x_off)
        d_y_off.append(d_y_off_b * scales["cols_off"][..., b, :, :])
        d_cum_off.append(d_y_off_b * y_off)
    zeros = [jnp.zeros_like(y[..., :DECAY_BLOCK, :])]  # the last block has no rows below it
    d_y = (d_y_diag * scales["cols_diag"]).reshape(y.shape) + jnp.concatenate(d_y_off + zeros, axis=-2)
    d_cum = d_cum_rows - (d_y_diag * y_diag).reshape(y.shape) - jnp.concatenate(d_cum_off + zeros, axis=-2)
    return d_x, d_y, d_cum


def _chunk_terms(q, k, v, g, beta):
    """Every chunk's forward terms at once (inputs [.., C, d], beta [.., C])."""
    c = q.shape[-2]
    cum = jnp.cumsum(g, axis=-2)
    scales = _block_scales(g)
    causal = jnp.tril(jnp.ones((c, c), jnp.bool_))
    strictly_causal = jnp.tril(causal, -1)
    k_beta = k * beta[..., None]
    lower = jnp.where(strictly_causal, _decayed_scores(k_beta, k, scales), 0.0)
    qk = jnp.where(causal, _decayed_scores(q, k, scales), 0.0)
    eye = jnp.eye(c, dtype=jnp.float32)
    inverse = solve_triangular(eye + lower, jnp.broadcast_to(eye, lower.shape), lower=True, unit_diagonal=True)
    beta_v, beta_k = v * beta[..., None], k_beta * jnp.exp(cum)
    u, w = _einsum("...ij,...jv->...iv", inverse, beta_v), _einsum("...ij,...jd->...id", inverse, beta_k)
    to_last = jnp.exp(_to_last(g))
    return dict(cum=cum, scales=scales, k_beta=k_beta, qk=qk, inverse=inverse, beta_v=beta_v, beta_k=beta_k, u=u,
                w=w, decay=jnp.exp(cum[..., -1, :]), to_last=to_last, k_last=k * to_last, q_gated=q * jnp.exp(cum),
                causal=causal, strictly_causal=strictly_causal)


def chunk_states_reference(w, u, k_last, decay, state):
    """The states entering the chunks [B, H, N, dk, dv] from each chunk's w, u [B, H, N, C, d],
    k exp(G_L - G) and exp(G_L) [B, H, N, dk], and the initial state [B, H, dk, dv]: the forward's
    serial recurrence S' = exp(G_L) S + (k exp(G_L - G))^T (u - w S)."""

    def step(s, x):
        w_n, u_n, k_last_n, decay_n = x
        v_new = u_n - _einsum("...ck,...kv->...cv", w_n, s)
        return s * decay_n[..., None] + _einsum("...ck,...cv->...kv", k_last_n, v_new), s

    _, states = jax.lax.scan(step, state, tuple(jnp.moveaxis(x, 2, 0) for x in (w, u, k_last, decay)))
    return jnp.moveaxis(states, 0, 2)


def state_gradients_reference(d_v_local, d_s_local, w, k_last, decay, d_state):
    """The backward's serial recurrence, from the last chunk: d v' = d v_local + (k exp(G_L - G)) d S',
    d S = exp(G_L) d S' + d S_local - w^T d v'. Chunk-major inputs ([B, H, N, C, dv], [B, H, N, dk, dv],
    w and k exp(G_L - G) [B, H, N, C, dk], exp(G_L) [B, H, N, dk]) and the final state's cotangent
    [B, H, dk, dv]; returns (d v' [B, H, N, C, dv], the d S' each chunk received [B, H, N, dk, dv],
    the initial state's d S [B, H, dk, dv])."""

    def step(d_next, x):
        d_v_local_n, d_s_local_n, w_n, k_last_n, decay_n = x
        d_v_new = d_v_local_n + _einsum("...ck,...kv->...cv", k_last_n, d_next)
        d_s = decay_n[..., None] * d_next + d_s_local_n - _einsum("...ck,...cv->...kv", w_n, d_v_new)
        return d_s, (d_v_new, d_next)

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (d_v_local, d_s_local, w, k_last, decay))
    d_state0, (d_v_new, d_next) = jax.lax.scan(step, d_state, xs, reverse=True)
    return jnp.moveaxis(d_v_new, 0, 2), jnp.moveaxis(d_next, 0, 2), d_state0


def _chunked(x, c):
    """[B, T, H, ...] -> [B, H, N, C, ...]."""
    return jnp.moveaxis(to_chunks(x, c), 0, 2)


def _groups(n_chunks, heads):
    """How many groups the chunk-parallel passes take the N chunks in (a divisor of N): the fewest
    that hold at most GROUP_CHUNKS chunks of all sequences and heads each."""
    for groups in range(1, n_chunks + 1):
        if n_chunks % groups == 0 and heads * n_chunks // groups <= GROUP_CHUNKS:
            return groups
    return n_chunks


def _over_groups(fn, token_xs, chunk_xs, groups, c, *, out_tokens):
    """fn(token slices, chunk slices, first token) over `groups` equal runs of chunks, one after
    another: token_xs [B, T, ..] sliced on T by whole chunks of c tokens, chunk_xs [B, H, N, ..] on N;
    fn's results (token-major [B, T, ..] if out_tokens, else chunk-major [B, H, N, ..]) joined into
    arrays of all chunks. A run's temporaries are all that is live."""
    if groups == 1:
        return fn(token_xs, chunk_xs, 0)
    size = token_xs[0].shape[1] // c // groups

    def take(i):
        return (tuple(jax.lax.dynamic_slice_in_dim(x, i * size * c, size * c, axis=1) for x in token_xs),
                tuple(jax.lax.dynamic_slice_in_dim(x, i * size, size, axis=2) for x in chunk_xs), i * size * c)

    axis = 1 if out_tokens else 2
    stacked = jax.lax.map(lambda i: fn(*take(i)), jnp.arange(groups))  # [groups, .., run, ..]
    return jax.tree.map(lambda y: jnp.moveaxis(y, 0, axis).reshape(*y.shape[1:axis + 1], -1, *y.shape[axis + 2:]),
                        stacked)


def _prepared(raw, lengths, start):
    """A run of tokens' inputs (q, k, v, g, beta as the caller gave them, from token `start`) as the
    scan uses them (`_prepare`: fp32, q and k normalised, tokens past each length inert)."""
    return _prepare(*raw, None, lengths - start)[:5]


def _serial_inputs(raw, c, lengths, start, with_u):
    """What the serial recurrences take from a run of chunks (the caller's q, k, v, g, beta and d o,
    token-major), chunk-major."""
    q_c, k_c, v_c, g_c, b_c, d_o_c = (_chunked(x, c) for x in (*_prepared(raw[:5], lengths, start),
                                                                raw[5].astype(jnp.float32)))
    f = _chunk_terms(q_c, k_c, v_c, g_c, b_c)
    terms = dict(w=f["w"], k_last=f["k_last"], decay=f["decay"],
                 d_v_local=_einsum("...ij,...iv->...jv", f["qk"], d_o_c),
                 d_s_local=_einsum("...ck,...cv->...kv", f["q_gated"], d_o_c))
    return dict(terms, u=f["u"]) if with_u else terms


def _run_gradients(raw, chunk_xs, c, lengths, start):
    """A run of chunks' (d q, d k, d v, d g, d beta), token-major in the caller's dtypes, from its
    inputs as the caller gave them (token-major), the states entering its chunks, its d v' and the d S'
    each chunk received (chunk-major)."""
    prepared, prepare_vjp = jax.vjp(lambda *x: _prepared(x, lengths, start), *raw[:5])
    return prepare_vjp(_chunk_gradients((*prepared, raw[5].astype(jnp.float32)), chunk_xs, c))


def _chunk_gradients(xs, chunk_xs, c):
    """(d q, d k, d v, d g, d beta) of the prepared inputs, token-major, of a run of chunks: its forward
    terms recomputed."""
    q_c, k_c, v_c, g_c, b_c, d_o_c = (_chunked(x, c) for x in xs)
    states, d_v_new, d_next = chunk_xs
    f = _chunk_terms(q_c, k_c, v_c, g_c, b_c)
    inverse, beta_v, beta_k, k_beta, cum = f["inverse"], f["beta_v"], f["beta_k"], f["k_beta"], f["cum"]
    k_last, q_gated = f["k_last"], f["q_gated"]
    v_new = f["u"] - _einsum("...ck,...kv->...cv", f["w"], states)
    d_qk = jnp.where(f["causal"], _einsum("...iv,...jv->...ij", d_o_c, v_new), 0.0)
    d_w = -_einsum("...cv,...kv->...ck", d_v_new, states)
    d_q_gated = _einsum("...cv,...kv->...ck", d_o_c, states)
    d_k_last = _einsum("...cv,...kv->...ck", v_new, d_next)
    d_inverse = _einsum("...iv,...jv->...ij", d_v_new, beta_v) + _einsum("...id,...jd->...ij", d_w, beta_k)
    d_beta_v = _einsum("...ji,...jv->...iv", inverse, d_v_new)
    d_beta_k = _einsum("...ji,...jd->...id", inverse, d_w)
    d_lower = jnp.where(f["strictly_causal"],
                        -_einsum("...ki,...kl,...jl->...ij", inverse, d_inverse, inverse), 0.0)
    d_k_beta_pairs, d_k_lower, d_cum_lower = _decayed_scores_vjp(d_lower, k_beta, k_c, f["scales"])
    d_q_pairs, d_k_qk, d_cum_qk = _decayed_scores_vjp(d_qk, q_c, k_c, f["scales"])
    d_k_beta = d_k_beta_pairs + d_beta_k * jnp.exp(cum)
    d_k = d_k_lower + d_k_qk + d_k_last * f["to_last"] + d_k_beta * b_c[..., None]
    d_q = d_q_pairs + d_q_gated * jnp.exp(cum)
    d_cum = d_cum_lower + d_cum_qk + d_q_gated * q_gated + d_beta_k * beta_k - d_k_last * k_last
    d_last = (d_k_last * k_last).sum(-2) + f["decay"] * (states * d_next).sum(-1)
    d_cum = d_cum.at[..., -1, :].add(d_last)
    d_g = jnp.flip(jnp.cumsum(jnp.flip(d_cum, -2), -2), -2)
    d_beta = (d_beta_v * v_c).sum(-1) + (d_k_beta * k_c).sum(-1)
    grads = (d_q, d_k, d_beta_v * b_c[..., None], d_g, d_beta)
    return tuple(from_chunks(jnp.moveaxis(x, 2, 0), xs[0].shape[1]) for x in grads)


def _backward(raw, lengths, state, d_state, c, states, state_gradients):
    """(the gradients of the caller's q, k, v, g, beta over whole chunks, d initial state) from the
    caller's inputs and d o padded to whole chunks (`raw`)."""
    b, t, h = raw[0].shape[:3]
    n = t // c
    groups = _groups(n, b * h)
    s = _over_groups(lambda x, _, start: _serial_inputs(x, c, lengths, start, with_u=states is None), raw, (),
                     groups, c, out_tokens=False)
    if states is None:
        states = chunk_states_reference(s["w"], s["u"], s["k_last"], s["decay"], state)
    d_v_new, d_next, d_state0 = state_gradients(s["d_v_local"], s["d_s_local"], s["w"], s["k_last"], s["decay"],
                                                d_state)
    grads = _over_groups(lambda x, y, start: _run_gradients(x, y, c, lengths, start), raw, (states, d_v_new, d_next),
                         groups, c, out_tokens=True)
    return grads, d_state0
