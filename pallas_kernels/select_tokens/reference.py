"""The pure-jnp reference of DSA's token selection, and the steps around the scores and the ranking
that the kernels' path shares (`select_with`): pools, visibility, expansion to tokens, the tail.

Memory is linear in T and in S: the reference scores and ranks QUERY_BLOCK queries at a time."""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.common import HIGHEST, map_query_blocks

QUERY_BLOCK = 256  # queries scored and ranked together by the reference
POOL_BLOCK = 64  # pools the scores kernels take a block: a pool-key cache of whole blocks is read in place


def pool_rows(keys: int, pool_size: int) -> int:
    """Rows of a pool-key cache over `keys` keys: its pools rounded up to whole POOL_BLOCKs, so that
    the scores kernels read it as it lies (a cache of any other width is copied into whole blocks at
    every call). The rows past the keys' pools are never valid."""
    return -(-(keys // pool_size) // POOL_BLOCK) * POOL_BLOCK


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
    # copies, but on the tensor cores at the bf16 rate (on the H200 an fp32 product is half of the
    # selection's time at 4096 tokens, 1.0 of 1.9 ms, and it grows with T * n_pools).
    exact = q_idx.dtype == pool_keys.dtype == jnp.bfloat16
    operands = (q_idx, pool_keys) if exact else (q_idx.astype(jnp.float32), pool_keys.astype(jnp.float32))
    dots = jnp.einsum(
        "bthd,bpd->bthp", *operands, precision=None if exact else HIGHEST, preferred_element_type=jnp.float32
    )
    scores = jnp.einsum(
        "bth,bthp->btp", head_weights.astype(jnp.float32), jax.nn.relu(dots * scale), precision=HIGHEST
    )
    return jnp.where(scores == 0, 0.0, scores)  # -0.0 -> +0.0, so ranking sees one zero


def visible_pools(first_key, query_positions, pool_size, n_pools):
    """[B, T]: how many pools (the first ones) end at or before each query's position."""
    return jnp.clip((query_positions - first_key[:, None] + 1) // pool_size, 0, n_pools).astype(jnp.int32)


class PackedPools(NamedTuple):
    """The pools of packed sequences (`packed_pools`): starts [B, NP] int32, each pool's first key (0
    past the last pool); valid [B, NP] bool; segment_start [B, S] int32, the first key of each key's
    segment; first_pool [B, S] int32, the number of that segment's first pool."""

    starts: jax.Array
    valid: jax.Array
    segment_start: jax.Array
    first_pool: jax.Array


def packed_pools(segment_ids, n_pools, pool_size):
    """Each segment (a run of one nonzero id in segment_ids [B, S]; 0 is padding) holds its own pools:
    P consecutive keys from the segment's first on, every complete one, numbered in order along the
    row. A lone sequence's pools are the usual ones: they start at its first valid key."""
    b, s = segment_ids.shape
    position = jnp.arange(s, dtype=jnp.int32)
    new = jnp.concatenate([jnp.ones((b, 1), jnp.bool_), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    segment_start = jax.lax.cummax(jnp.where(new, position, 0), axis=1)
    last = jnp.clip(position + pool_size - 1, 0, s - 1)
    opens = ((segment_ids > 0) & ((position - segment_start) % pool_size == 0) & (position + pool_size <= s)
             & (jnp.take_along_axis(segment_ids, jnp.broadcast_to(last, (b, s)), axis=1) == segment_ids))
    number = jnp.cumsum(opens, axis=1, dtype=jnp.int32) - opens  # pools opened before each key
    batch = jnp.arange(b)[:, None]
    starts = jnp.zeros((b, n_pools), jnp.int32).at[batch, jnp.where(opens, number, n_pools)].set(
        jnp.broadcast_to(position, (b, s)), mode="drop")
    valid = jnp.arange(n_pools) < jnp.sum(opens, axis=1, dtype=jnp.int32)[:, None]
    return PackedPools(starts, valid, segment_start, jnp.take_along_axis(number, segment_start, axis=1))


def candidate_scores_reference(q_idx, head_weights, pool_keys, pool_valid, visible):
    """[B, T, n_pools] fp32: `pool_scores` where pool p is a candidate for the query (valid, and
    p < visible[b, t]), else -inf. pool_valid [B, n_pools] bool; visible [B, T] int32."""
    candidate = pool_valid[:, None, :] & (jnp.arange(pool_keys.shape[1]) < visible[..., None])
    return jnp.where(candidate, pool_scores(q_idx, head_weights, pool_keys), -jnp.inf)


def top_pools_reference(scores, k):
    """The k best of each row of scores [B, T, n] (XLA's top-k: best first, ties to the lower index):
    (indices [B, T, k] int32, whether each is a candidate: a score above -inf)."""
    best, chosen = jax.lax.top_k(scores, k)
    return chosen, best > -jnp.inf


def _rank_pools(scores_fn, top_fn, q_idx, head_weights, pool_keys, key_valid, query_positions, n_select, pool_size, block):
    """The n_select best candidate pools of each query [B, T, n_select], and which of them are
    candidates (a query with fewer keeps some that are not: their scores are -inf), ranked `block`
    queries at a time."""
    n_pools = pool_keys.shape[1]
    pool_valid = pool_validity(key_valid, n_pools, pool_size)
    visible = visible_pools(first_valid_key(key_valid), query_positions, pool_size, n_pools)

    def rank(xs):
        q, w, seen = xs
        return top_fn(scores_fn(q, w, pool_keys, pool_valid, seen), n_select)

    return map_query_blocks(rank, (q_idx, head_weights, visible), (0, 0, 0), block)


def _select_packed(scores_fn, top_fn, block, q_idx, head_weights, pool_keys, segment_ids, query_positions, *,
                   index_topk, pool_size, select_tail):
    """`select_with` over packed sequences: a query's candidates are its own segment's pools, its tail
    the keys after the last of them."""
    b, t = q_idx.shape[:2]
    s = segment_ids.shape[-1]
    n_pools = pool_keys.shape[1]
    pools = packed_pools(segment_ids, n_pools, pool_size)
    at_query = lambda x: jnp.take_along_axis(x, jnp.clip(query_positions, 0, s - 1), axis=-1)  # noqa: E731
    start, first_pool = at_query(pools.segment_start), at_query(pools.first_pool)
    seen = jnp.maximum(query_positions - start + 1, 0)  # keys of its segment up to the query
    parts = []
    n_select = min(index_topk // pool_size, n_pools)
    if n_select > 0:
        def rank(xs):
            q, w, visible, first = xs
            scores = scores_fn(q, w, pool_keys, pools.valid, visible)
            return top_fn(jnp.where(jnp.arange(n_pools) >= first[..., None], scores, -jnp.inf), n_select)

        chosen, chosen_valid = map_query_blocks(
            rank, (q_idx, head_weights, first_pool + seen // pool_size, first_pool), (0, 0, 0, 0), block
        )
        first_keys = jnp.take_along_axis(pools.starts, chosen.reshape(b, -1), axis=1).reshape(chosen.shape)
        tokens = jnp.where(chosen_valid[..., None], first_keys[..., None] + jnp.arange(pool_size), -1)
        parts.append(tokens.reshape(b, t, n_select * pool_size))
    if select_tail and pool_size > 1:
        count = seen % pool_size
        offsets = jnp.arange(pool_size - 1, dtype=jnp.int32)
        parts.append(jnp.where(offsets < count[..., None], (start + seen - count)[..., None] + offsets, -1))
    return parts


def select_with(
    scores_fn, top_fn, block, q_idx, head_weights, pool_keys, key_valid, query_positions, *, index_topk, pool_size,
    select_tail, segment_ids=None,
):
    """The selection with `scores_fn` for the candidates' scores and `top_fn` for each row's best
    (references or kernels), `block` queries ranked at a time: `select_tokens_reference`'s result."""
    b, t = q_idx.shape[:2]
    if segment_ids is not None:
        parts = _select_packed(scores_fn, top_fn, block, q_idx, head_weights, pool_keys, segment_ids, query_positions,
                               index_topk=index_topk, pool_size=pool_size, select_tail=select_tail)
        return _finish(parts, key_valid, query_positions, index_topk + (pool_size - 1 if select_tail else 0))
    s = key_valid.shape[-1]
    n_pools = pool_keys.shape[1]
    width = index_topk + (pool_size - 1 if select_tail else 0)
    first_key = first_valid_key(key_valid)
    parts = []

    n_select = min(index_topk // pool_size, n_pools, s // pool_size)  # rows past the keys' pools: never valid
    if n_select > 0:
        chosen, chosen_valid = _rank_pools(
            scores_fn, top_fn, q_idx, head_weights, pool_keys, key_valid, query_positions, n_select, pool_size, block
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

    return _finish(parts, key_valid, query_positions, width)


def _finish(parts, key_valid, query_positions, width):
    """The selection's parts joined, padded with -1 to `width`, and -1 throughout for invalid queries."""
    b, t = query_positions.shape
    s = key_valid.shape[-1]
    indices = jnp.concatenate(parts, axis=-1) if parts else jnp.zeros((b, t, 0), jnp.int32)
    indices = jnp.pad(indices, [(0, 0), (0, 0), (0, width - indices.shape[-1])], constant_values=-1)
    query_valid = jnp.take_along_axis(key_valid, jnp.clip(query_positions, 0, s - 1), axis=-1)
    return jnp.where(query_valid[..., None], indices, -1).astype(jnp.int32)


def select_tokens_reference(
    q_idx, head_weights, pool_keys, key_valid, query_positions, *, index_topk, pool_size, select_tail=True,
    segment_ids=None,
):
    """q_idx [B, T, nh, hd]; head_weights [B, T, nh] (already scaled by nh^-0.5); pool_keys [B, NP, hd]
    (pool p starts at first_valid_key + p * pool_size; NP at most `pool_rows(S, pool_size)`, the rows
    past the keys' pools never valid); key_valid [B, S] bool; query_positions [B, T]
    int32, each query's index on the key axis. Returns int32 [B, T, index_topk (+ pool_size - 1 when
    select_tail)] of key indices, -1 padded.

    Memory is linear in T and in S: the pools are scored and ranked QUERY_BLOCK queries at a time (the
    [T, nh, NP] scores are never whole), and what a query sees comes from running counts of valid
    keys rather than a [T, S] mask (padding is a prefix or a suffix, so a pool whose keys are all
    valid is visible once its last key is).

    segment_ids None, or [B, S] int for packed sequences (0: padding, each nonzero id one run of
    keys, key_valid then their nonzero ones): each segment holds its own pools (`packed_pools`, the
    order pool_keys must follow), and a query ranks only its segment's pools and takes only its
    segment's tail."""
    return select_with(
        candidate_scores_reference, top_pools_reference, QUERY_BLOCK, q_idx, head_weights, pool_keys, key_valid, query_positions,
        index_topk=index_topk, pool_size=pool_size, select_tail=select_tail, segment_ids=segment_ids,
    )
