"""The lightning indexer's training signal, as DeepSeek-V3.2 trains its indexer: per query, the KL
divergence from the main attention's distribution over pools to the indexer's.

The target of a query: each head's softmax over the query's allowed keys (fp32), summed over the
heads, summed over each pool's P tokens, kept on the target pools and normalised to 1 there. A pool's
target is thus the attention mass of its P tokens; tokens outside every complete pool (the tail,
which the selection appends whole, and the keys before the first pool) have no pool and no target.
- stage "dense" (the warm-up): the allowed keys are every key the query sees (causal, not padding),
  the target pools every candidate (a valid pool whose last token it sees);
- stage "sparse": the allowed keys are the query's selection (what the layer attends over), the
  target pools the selected pools.
The indexer's distribution: the softmax of its pool scores (`pool_scores`, the selection's ranking)
over the same target pools. A query without a target pool (fewer than P visible keys, padding)
counts for nothing.

Everything that forms the target, and the indexer's inputs (h, q_resid), is detached: the loss's
gradient reaches the indexer's parameters alone, and the main model's gradients are the same with
it and without it. The target is the layer's own attention: a "shared" layer reuses the selection
and adds nothing to it.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.common import HIGHEST, map_query_blocks
from pallas_kernels.select_tokens import packed_pools, pool_scores

from .common import linear, rms_norm
from .dsa import indexer_head_weights, indexer_keys, indexer_queries, latent_query, pool_keys

STAGES = ("dense", "sparse")
QUERY_BLOCK = 128  # queries whose [B, H, block, S] attention probabilities are formed together


def pool_targets(q_lat, latents, allowed, target_pools, pool_tokens, scale):
    """[B, Q, NP] fp32: each query's attention mass on each target pool, normalised over them (rows
    without a target pool: zeros). q_lat [B, Q, H, R]; latents [B, S, R]; allowed [B, Q, S] bool;
    target_pools [B, Q, NP] bool; pool_tokens [B, NP, P] key indices of each pool (in range)."""
    b, q, _ = allowed.shape
    logits = jnp.einsum("bqhr,bsr->bhqs", q_lat.astype(jnp.float32), latents.astype(jnp.float32),
                        precision=HIGHEST) * scale
    seen = allowed.any(-1)[:, None, :, None]
    probs = jax.nn.softmax(jnp.where(allowed[:, None] & seen, logits, jnp.where(seen, -jnp.inf, 0.0)), axis=-1)
    mass = jnp.sum(jnp.where(allowed[:, None], probs, 0.0), axis=1)  # [B, Q, S]
    flat = pool_tokens.reshape(b, 1, -1)
    pooled = jnp.take_along_axis(mass, jnp.broadcast_to(flat, (b, q, flat.shape[-1])), axis=-1)
    pooled = jnp.where(target_pools, pooled.reshape(b, q, *pool_tokens.shape[1:]).sum(-1), 0.0)
    total = pooled.sum(-1, keepdims=True)
    return pooled / jnp.where(total > 0, total, 1.0)


def kl_to_indexer(target, scores):
    """[B, Q]: sum_p target_p (log target_p - log softmax(scores)_p) over the pools where target_p > 0,
    the softmax over the pools where `scores` is finite (the target pools)."""
    has = target > 0
    log_indexer = jax.nn.log_softmax(jnp.where(jnp.isfinite(scores), scores, -jnp.inf), axis=-1)
    terms = target * (jnp.log(jnp.where(has, target, 1.0)) - jnp.where(has, log_indexer, 0.0))
    return jnp.sum(jnp.where(has, terms, 0.0), axis=-1)


def indexer_kl(p, h, key_valid, indices, config, stage, segment_ids=None):
    """The mean over queries with a target of the KL from the layer's attention to its indexer, fp32 [].

    p: a full DSA layer's parameters (the absorbed form, with "indexer"); h [B, T, D] its input;
    key_valid [B, T] bool; indices [B, T, W] the layer's selection (`dsa_layer`'s); stage "dense" or
    "sparse" (module docstring); segment_ids [B, T]: packed sequences (each query's keys and pools
    those of its own segment)."""
    if stage not in STAGES:
        raise ValueError(f"indexer loss stage must be one of {STAGES}, got {stage!r}")
    main = jax.lax.stop_gradient({name: v for name, v in p.items() if name != "indexer"})
    ip, h = p["indexer"], jax.lax.stop_gradient(h)
    b, t = key_valid.shape
    size = config.index_kpool
    n_pools = t // size
    if n_pools == 0:
        return jnp.float32(0.0)
    segments = key_valid.astype(jnp.int32) if segment_ids is None else segment_ids
    pools = packed_pools(segments, n_pools, size)  # a lone sequence's: from its first valid key
    q_resid = rms_norm(linear(h, main["q_a_proj"]), main["q_a_norm"], config.rms_norm_eps)
    latents = rms_norm(linear(h, main["kv_a_proj"]), main["kv_a_norm"], config.rms_norm_eps)
    k_idx, gate = indexer_keys(ip, h)
    keys = pool_keys(k_idx, gate, ip["ape"], pools.starts)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    pool_tokens = jnp.clip(pools.starts[..., None] + jnp.arange(size, dtype=jnp.int32), 0, t - 1)
    seen = positions - pools.segment_start + 1  # keys of its segment up to each query

    def block(xs):
        q_lat, q_idx, weights, first, visible, segment, selection, pos, real = xs
        pool_number = jnp.arange(n_pools)
        candidates = (pools.valid[:, None] & (pool_number >= first[..., None]) & (pool_number < visible[..., None])
                      & real[..., None])
        allowed = (key_valid[:, None] & (segments[:, None] == segment[..., None]) & (jnp.arange(t) <= pos[..., None])
                   & real[..., None])
        if stage == "sparse":
            rows = jnp.arange(selection.shape[1])[None, :, None]
            chosen = jnp.zeros(allowed.shape, jnp.bool_).at[
                jnp.arange(b)[:, None, None], rows, jnp.where(selection < 0, t, selection)].set(True, mode="drop")
            allowed = allowed & chosen
            # A candidate pool is selected whole or not at all: its first token says which.
            first_tokens = jnp.broadcast_to(pools.starts[:, None, :], candidates.shape)
            candidates = candidates & jnp.take_along_axis(chosen, first_tokens, axis=-1)
        target = jax.lax.stop_gradient(
            pool_targets(q_lat, latents, allowed, candidates, pool_tokens, config.qk_head_dim**-0.5)
        )
        scores = jnp.where(candidates, pool_scores(q_idx, weights, keys), -jnp.inf)
        return kl_to_indexer(target, scores), target.sum(-1) > 0

    xs = (
        latent_query(main, q_resid, config),
        indexer_queries(ip, q_resid, config),
        indexer_head_weights(ip, h),
        pools.first_pool,
        pools.first_pool + seen // size,
        segments,
        indices,
        positions,
        key_valid,  # a real query is a real token
    )
    kl, has = map_query_blocks(block, xs, (0, 0, 0, 0, 0, -1, -1, -1, False), QUERY_BLOCK)
    return jnp.sum(jnp.where(has, kl, 0.0)) / jnp.maximum(jnp.sum(has), 1)
