"""Manifold-constrained hyper-connections (mHC): `hc_mult` residual streams around each sublayer.

mapping() derives the per-token pre/post/comb weights from the streams (fp32), collapse() mixes the
streams into the sublayer input, expand() writes the sublayer output back into the streams.
"""

import jax
import jax.numpy as jnp

from .common import PRECISION, inverse_rms, unweighted_rms_norm


def mapping(p, streams, config):
    """p: fn [H*D, (2+H)*H], base [(2+H)*H], scale [3] (all fp32); streams [B, T, H, D].

    Returns pre [B, T, H], post [B, T, H], comb [B, T, H, H] (fp32); comb is doubly stochastic
    after the Sinkhorn iterations: rows index the input stream, columns the output stream.
    """
    n, eps = config.hc_mult, config.hc_eps
    mixed = _normed_projection(streams.reshape(*streams.shape[:-2], -1), p["fn"].astype(jnp.float32), config.rms_norm_eps)
    base = p["base"].astype(jnp.float32)
    scale = p["scale"].astype(jnp.float32)
    pre = jax.nn.sigmoid(mixed[..., :n] * scale[0] + base[:n]) + eps
    post = 2.0 * jax.nn.sigmoid(mixed[..., n : 2 * n] * scale[1] + base[n : 2 * n])
    comb_logits = mixed[..., 2 * n :] * scale[2] + base[2 * n :]
    comb = jax.nn.softmax(comb_logits.reshape(*comb_logits.shape[:-1], n, n), axis=-1) + eps
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)

    def sinkhorn_step(_, c):
        c = c / (c.sum(axis=-1, keepdims=True) + eps)
        return c / (c.sum(axis=-2, keepdims=True) + eps)

    def sinkhorn(c, unroll):
        return jax.lax.fori_loop(0, config.hc_sinkhorn_iters - 1, sinkhorn_step, c, unroll=unroll)

    # Off the CPU, unrolled: there a rolled loop is a while loop with a host round trip per iteration
    # (8 mappings x 19 such trips are most of a small model's decode step on the H200), and XLA fuses
    # the unrolled iterations. On the CPU the loop is free and unrolling doubles the compile time.
    comb = jax.lax.platform_dependent(comb, cpu=lambda c: sinkhorn(c, False), default=lambda c: sinkhorn(c, True))
    # The three are computed apart from their consumers: fused into expand's and the projection's
    # element-wise code, the unrolled Sinkhorn chain grows XLA:GPU fusions whose tiling priority
    # fusion searches again at every step (the decode step's compile on an H200 target: 398 s, 44 s
    # with the barrier; bench/RESULTS.md). They are [B, T, H(, H)]: tiny.
    return jax.lax.optimization_barrier((pre, post, comb))


def _normed_projection(flat, fn, eps):
    """unweighted_rms_norm(flat in fp32) @ fn, fp32. For bf16 streams as (flat @ fn) / rms: fn as three
    bf16 pieces that sum to it exactly, so that each product is exact and only the fp32 sums round
    (what an fp32 product of the normed rows gives, up to the order of roundings), without the
    normed rows written out in fp32 for a HIGHEST product (on the H200 at 16384 tokens, hidden 2048,
    that pair takes 0.43 ms a call: 8x the bf16 streams' read)."""
    if flat.dtype != jnp.bfloat16:
        return jnp.einsum("...i,io->...o", unweighted_rms_norm(flat.astype(jnp.float32), eps), fn, precision=PRECISION)
    pieces, rest = [], fn
    for _ in range(3):  # 8 significant bits each, fp32's 24 in all
        pieces.append(rest.astype(jnp.bfloat16))
        rest = rest - pieces[-1].astype(jnp.float32)
    parts = jnp.einsum("...i,io->...o", flat, jnp.concatenate(pieces, axis=-1), preferred_element_type=jnp.float32)
    n = fn.shape[-1]
    return (parts[..., :n] + parts[..., n : 2 * n] + parts[..., 2 * n :]) * inverse_rms(flat, eps)


def collapse(pre, streams):
    """Sublayer input: sum_h pre_h * X_h, in fp32, cast to the streams' dtype."""
    return jnp.sum(pre[..., None] * streams.astype(jnp.float32), axis=-2).astype(streams.dtype)


def expand(post, comb, y, streams):
    """X'_j = post_j * y + sum_i comb[i, j] * X_i, in the streams' dtype."""
    dtype = streams.dtype
    # Four products a channel summed in fp32, as a dot with fp32 accumulation would; written out, XLA
    # fuses it into one pass over the streams (as a dot, on the H200 a GEMM fusion at 3x the streams'
    # memory time: 0.38 ms a call at 16384 tokens, hidden 2048).
    weights = comb.astype(dtype).astype(jnp.float32)[..., None]  # [..., i, j, 1]
    mixed = jnp.sum(weights * streams.astype(jnp.float32)[..., :, None, :], axis=-3).astype(dtype)
    return post.astype(dtype)[..., None] * y[..., None, :] + mixed
