"""DSA token selection: score complete key pools per query, keep the best, expand them to tokens.

Pools start at the sequence's first valid key and hold `pool_size` consecutive keys; a pool is valid
when all its keys exist and are valid, and it is a candidate for a query when its last key is
visible to that query (causal and valid). For each query the best min(index_topk / pool_size,
n_pools) candidates are kept and expanded to their token indices; the query's incomplete tail
(the visible keys after its last complete pool) is appended raw; rows are padded with -1 to a fixed
width, and rows of invalid queries are all -1.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.query_blocks import map_query_blocks

HIGHEST = jax.lax.Precision.HIGHEST
QUERY_BLOCK = 256  # queries scored and ranked together


def first_valid_key(key_valid):
    """Index of each row's first valid key, or S when the row has none. key_valid [B, S] -> [B]."""
    s = key_valid.shape[-1]
    return jnp.where(key_valid.any(-1), jnp.argmax(key_valid, axis=-1), s).astype(jnp.int32)


def pool_token_indices(first_key, n_pools, pool_size):
    """[B, n_pools, pool_size] key indices of every pool (not bounds-checked)."""
    offsets = jnp.arange(n_pools * pool_size, dtype=jnp.int32).reshape(n_pools, pool_size)
    return first_key[:, None, None] + offsets


def pool_validity(key_valid, n_pools, pool_size):
    """[B, n_pools]: every key of the pool exists and is valid."""
    s = key_valid.shape[-1]
    idx = pool_token_indices(first_valid_key(key_valid), n_pools, pool_size)
    valid = jnp.take_along_axis(key_valid, jnp.clip(idx, 0, s - 1).reshape(idx.shape[0], -1), axis=-1)
    return ((idx < s) & valid.reshape(idx.shape)).all(-1)


def visible_key_counts(key_valid, query_positions):
    """[B, T]: the valid keys at or before each query's position (0 before the first key)."""
    s = key_valid.shape[-1]
    # Valid keys at or before each key, materialised: on the GPU, XLA expands a cumsum into a tree
    # of reduce-windows, and fused into the rows of selected tokens that use these counts, each
    # thread reading one walks the tree over the whole key axis again (the H200 HLO and timings in
    # bench/RESULTS.md: two such fusions of 0.02-0.04 ms each, for rows of 16 K int32s, in a decode step).
    valid_through = jax.lax.optimization_barrier(jnp.cumsum(key_valid, axis=-1, dtype=jnp.int32))
    return jnp.where(
        query_positions < 0, 0, jnp.take_along_axis(valid_through, jnp.clip(query_positions, 0, s - 1), axis=-1)
    )


def pool_scores(q_idx, head_weights, pool_keys):
    """score[b, t, p] = sum_h w[b, t, h] * relu(q[b, t, h] . pool_key[b, p] / sqrt(hd)), fp32."""
    scale = q_idx.shape[-1] ** -0.5
    # Products of bf16 values are exact in fp32: bf16 operands give the sums HIGHEST forms on fp32
    # copies, but on the tensor cores at the bf16 rate (on the H200 the fp32 product was half of
    # the selection's time at 4096 tokens, 1.0 of 1.9 ms, and it grows with T * n_pools).
    exact = q_idx.dtype == pool_keys.dtype == jnp.bfloat16
    operands = (q_idx, pool_keys) if exact else (q_idx.astype(jnp.float32), pool_keys.astype(jnp.float32))
    dots = jnp.einsum(
        "bthd,bpd->bthp", *operands, precision=None if exact else HIGHEST, preferred_element_type=jnp.float32
    )
    scores = jnp.einsum(
        "bth,bthp->btp", head_weights.astype(jnp.float32), jax.nn.relu(dots * scale), precision=HIGHEST
    )
    return jnp.where(scores == 0, 0.0, scores)  # -0.0 -> +0.0, so ranking sees one zero


def select_tokens_reference(
    q_idx, head_weights, pool_keys, key_valid, query_positions, *, index_topk, pool_size, select_tail=True
):
    """q_idx [B, T, nh, hd]; head_weights [B, T, nh] (already scaled by nh^-0.5); pool_keys [B, NP, hd]
    (pool p starts at first_valid_key + p * pool_size); key_valid [B, S] bool; query_positions [B, T]
    int32, each query's index on the key axis. Returns int32 [B, T, index_topk (+ pool_size - 1 when
    select_tail)] of key indices, -1 padded.

    Memory is linear in T and in S: the pools are scored and ranked QUERY_BLOCK queries at a time (the
    [T, nh, NP] scores are never whole), and what a query sees comes from running counts of valid
    keys rather than a [T, S] mask (padding is a prefix or a suffix, so a pool whose keys are all
    valid is visible once its last key is)."""
    b, t = q_idx.shape[:2]
    s = key_valid.shape[-1]
    n_pools = pool_keys.shape[1]
    width = index_topk + (pool_size - 1 if select_tail else 0)
    first_key = first_valid_key(key_valid)
    parts = []

    n_select = min(index_topk // pool_size, n_pools)
    if n_select > 0:
        pool_valid = pool_validity(key_valid, n_pools, pool_size)
        pool_end = first_key[:, None] + (jnp.arange(n_pools) + 1) * pool_size - 1  # [B, NP]

        def rank(xs):
            q, w, positions = xs
            candidate = pool_valid[:, None, :] & (pool_end[:, None, :] <= positions[..., None])  # [B, block, NP]
            scores = jnp.where(candidate, pool_scores(q, w, pool_keys), -jnp.inf)
            _, chosen = jax.lax.top_k(scores, n_select)  # [B, block, n_select]
            return chosen, jnp.take_along_axis(candidate, chosen, axis=-1)

        chosen, chosen_valid = map_query_blocks(
            rank, (q_idx, head_weights, query_positions), (0, 0, -1), QUERY_BLOCK
        )
        tokens = first_key[:, None, None, None] + chosen[..., None] * pool_size + jnp.arange(pool_size)
        tokens = jnp.where(chosen_valid[..., None], tokens, -1)
        parts.append(tokens.reshape(b, t, n_select * pool_size))

    if select_tail and pool_size > 1:
        visible_count = visible_key_counts(key_valid, query_positions)
        tail_count = visible_count % pool_size
        offsets = jnp.arange(pool_size - 1, dtype=jnp.int32)
        tail = (first_key[:, None] + visible_count - tail_count)[..., None] + offsets
        tail_valid = jnp.take_along_axis(key_valid, jnp.clip(tail, 0, s - 1).reshape(b, -1), axis=-1).reshape(tail.shape)
        keep = (offsets < tail_count[..., None]) & (tail < s) & tail_valid & (tail <= query_positions[..., None])
        parts.append(jnp.where(keep, tail, -1))

    indices = jnp.concatenate(parts, axis=-1) if parts else jnp.zeros((b, t, 0), jnp.int32)
    indices = jnp.pad(indices, [(0, 0), (0, 0), (0, width - indices.shape[-1])], constant_values=-1)
    query_valid = jnp.take_along_axis(key_valid, jnp.clip(query_positions, 0, s - 1), axis=-1)
    return jnp.where(query_valid[..., None], indices, -1).astype(jnp.int32)


def select_tokens(q_idx, head_weights, pool_keys, key_valid, query_positions, *, index_topk, pool_size, select_tail=True):
    """Validated entry point; see `select_tokens_reference` for the arguments."""
    b, t, nh, hd = q_idx.shape
    s = key_valid.shape[-1] if key_valid.ndim == 2 else None
    if head_weights.shape != (b, t, nh):
        raise ValueError(f"head_weights must be [B, T, nh] = {(b, t, nh)}, got {head_weights.shape}")
    if pool_keys.ndim != 3 or pool_keys.shape[0] != b or pool_keys.shape[2] != hd:
        raise ValueError(f"pool_keys must be [B, n_pools, hd] = [{b}, n_pools, {hd}], got {pool_keys.shape}")
    if key_valid.shape != (b, s):
        raise ValueError(f"key_valid must be [B, S] with B = {b}, got {key_valid.shape}")
    if query_positions.shape != (b, t):
        raise ValueError(f"query_positions must be [B, T] = {(b, t)}, got {query_positions.shape}")
    if pool_size < 1 or index_topk % pool_size:
        raise ValueError(f"index_topk ({index_topk}) must be a positive multiple of pool_size ({pool_size})")
    if pool_keys.shape[1] * pool_size > s:
        raise ValueError(f"{pool_keys.shape[1]} pools of {pool_size} do not fit in {s} keys")
    return select_tokens_reference(
        q_idx, head_weights, pool_keys, key_valid, query_positions,
        index_topk=index_topk, pool_size=pool_size, select_tail=select_tail,
    )
