"""DSA token selection: score complete key pools per query, keep the best, expand them to tokens.

Pools start at the sequence's first valid key and hold `pool_size` consecutive keys; a pool is valid
when all its keys exist and are valid, and it is a candidate for a query when its last key is
visible to that query (causal and valid). For each query the best min(index_topk / pool_size,
n_pools) candidates are kept and expanded to their token indices; the query's incomplete tail
(the visible keys after its last complete pool) is appended raw; rows are padded with -1 to a fixed
width, and rows of invalid queries are all -1.

The candidates' scores (every query against every pool, the work that grows as T x T) have two
implementations behind `select_tokens`:
- `candidate_scores_reference`: jnp, any device; its [T, nh, n_pools] fp32 products are whole for
  a block of QUERY_BLOCK queries;
- a Pallas kernel (Triton backend, GPU, bf16 queries and pool keys): one program per (block of
  queries, block of pools) sums the heads' relu'd products in registers, so only the [T, n_pools]
  scores reach HBM, and a block of pools that no query of the block sees yet is not multiplied.
The ranking likewise: XLA's top-k (`top_pools_reference`, a sort of each whole row on the GPU), or
with the kernels a Pallas kernel that finds each row's k-th best score bit by bit and keeps what
reaches it (`top_pools_kernel`: the same set, ties to the lower index as XLA's, in the row's order).
The scores agree up to the order of fp32 sums, so a near-tie at the k-th place may rank otherwise.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import pick_implementation
from pallas_kernels.query_blocks import map_query_blocks

HIGHEST = jax.lax.Precision.HIGHEST
QUERY_BLOCK = 256  # queries scored and ranked together by the reference
# With the kernel, queries ranked together: as many as keep a block's fp32 scores within 64 MB.
KERNEL_BLOCK_SCORES = 1 << 24
KERNEL_HEAD_DIMS = (16, 32, 64, 128, 256)
# Pools a kernel program scores: on the H200 64 took the scores 0.091 -> 0.069 ms at 4096 tokens and
# 0.729 -> 0.710 at 16384 against 128 (32 queries, or 16, were slower; bench/RESULTS.md).
BLOCK_POOLS = 64
MAX_BLOCK_QUERIES = 64  # queries a kernel program scores (fewer, down to 16, for shorter blocks)
MIN_BLOCK_QUERIES = 16  # fewer queries: one query a program, its heads as the product's rows
FEW_QUERIES_BLOCK_POOLS = 64  # then more programs, each with less to do (decode's grid is small)
MAX_TOP_POOLS = 32768  # the top-k kernel's widest row (a row is in registers); wider rows: XLA's top-k


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


def visible_pools(first_key, query_positions, pool_size, n_pools):
    """[B, T]: how many pools (the first ones) end at or before each query's position."""
    return jnp.clip((query_positions - first_key[:, None] + 1) // pool_size, 0, n_pools).astype(jnp.int32)


def candidate_scores_reference(q_idx, head_weights, pool_keys, pool_valid, visible):
    """[B, T, n_pools] fp32: `pool_scores` where pool p is a candidate for the query (valid, and
    p < visible[b, t]), else -inf. pool_valid [B, n_pools] bool; visible [B, T] int32."""
    candidate = pool_valid[:, None, :] & (jnp.arange(pool_keys.shape[1]) < visible[..., None])
    return jnp.where(candidate, pool_scores(q_idx, head_weights, pool_keys), -jnp.inf)


def _candidate_scores_kernel(q_ref, w_ref, keys_ref, valid_ref, visible_ref, out_ref, *, scale, block_q, block_p):
    """One block of queries against one block of pools, the heads' products summed in registers."""
    pb, tb, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    tokens, pools = pl.ds(tb * block_q, block_q), pl.ds(pb * block_p, block_p)
    visible = visible_ref[b, tokens]
    pool = pb * block_p + lax.broadcasted_iota(jnp.int32, (block_q, block_p), 1)
    candidate = (valid_ref[b, pools][None, :] != 0) & (pool < visible[:, None])
    seen = pb * block_p < jnp.max(visible)  # some query of the block sees a pool of this block

    @pl.when(seen)
    def _():
        keys = keys_ref[b, pools, :]

        def head(h, acc):
            dots = jnp.dot(q_ref[b, tokens, h, :], keys.T, preferred_element_type=jnp.float32)
            return acc + w_ref[b, tokens, h][:, None] * jnp.maximum(dots * scale, 0.0)

        acc = lax.fori_loop(0, q_ref.shape[2], head, jnp.zeros((block_q, block_p), jnp.float32))
        out_ref[b, tokens, pools] = jnp.where(candidate, jnp.where(acc == 0, 0.0, acc), -jnp.inf)

    @pl.when(jnp.logical_not(seen))
    def _():
        out_ref[b, tokens, pools] = jnp.full((block_q, block_p), -jnp.inf, jnp.float32)


def _few_queries_kernel(q_ref, w_ref, keys_ref, valid_ref, visible_ref, out_ref, *, scale, block_p):
    """One query against one block of pools, its heads as the product's rows (one product, where the
    queries' form would pad the query to 16 rows and loop over the heads): decode steps."""
    pb, t, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    pools = pl.ds(pb * block_p, block_p)
    pool = pb * block_p + lax.broadcasted_iota(jnp.int32, (block_p,), 0)
    candidate = (valid_ref[b, pools] != 0) & (pool < visible_ref[b, t])
    dots = jnp.dot(q_ref[b, t], keys_ref[b, pools, :].T, preferred_element_type=jnp.float32)  # [heads, pools]
    scores = jnp.sum(w_ref[b, t][:, None] * jnp.maximum(dots * scale, 0.0), axis=0)
    out_ref[b, t, pools] = jnp.where(candidate, jnp.where(scores == 0, 0.0, scores), -jnp.inf)


def candidate_scores_kernel(q_idx, head_weights, pool_keys, pool_valid, visible, *, interpret=False):
    """`candidate_scores_reference` as one Pallas (Triton) launch; bf16 q_idx and pool_keys, hd in
    KERNEL_HEAD_DIMS. Queries, heads and pools are padded to whole blocks (padded queries see no
    pool; padded heads weigh 0). Fewer than 16 queries take the heads as the product's rows (on the
    H200 at batch 8 over 4096 cached, the queries' form took 0.022 ms, twice XLA's product and sum)."""
    b, t, nh, hd = q_idx.shape
    n_pools = pool_keys.shape[1]
    few = t < MIN_BLOCK_QUERIES
    block_q = 1 if few else min(MAX_BLOCK_QUERIES, pl.next_power_of_2(t))
    block_p = FEW_QUERIES_BLOCK_POOLS if few else BLOCK_POOLS
    heads = max(16, pl.next_power_of_2(nh)) if few else nh  # a product's rows: a power of two >= 16
    pad_t, pad_p = -t % block_q, -n_pools % block_p
    q = jnp.pad(q_idx, [(0, 0), (0, pad_t), (0, heads - nh), (0, 0)])
    w = jnp.pad(head_weights.astype(jnp.float32), [(0, 0), (0, pad_t), (0, heads - nh)])
    keys = jnp.pad(pool_keys, [(0, 0), (0, pad_p), (0, 0)])
    valid = jnp.pad(pool_valid.astype(jnp.int32), [(0, 0), (0, pad_p)])
    visible = jnp.pad(visible.astype(jnp.int32), [(0, 0), (0, pad_t)])
    if few:
        kernel = functools.partial(_few_queries_kernel, scale=hd**-0.5, block_p=block_p)
    else:
        kernel = functools.partial(_candidate_scores_kernel, scale=hd**-0.5, block_q=block_q, block_p=block_p)
    scores = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, t + pad_t, n_pools + pad_p), jnp.float32),
        grid=((n_pools + pad_p) // block_p, (t + pad_t) // block_q, b),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="candidate_pool_scores",
    )(q, w, keys, valid, visible)
    return scores[:, :t, :n_pools]


def top_pools_reference(scores, k):
    """The k best of each row of scores [B, T, n] (XLA's top-k: best first, ties to the lower index):
    (indices [B, T, k] int32, whether each is a candidate: a score above -inf)."""
    best, chosen = jax.lax.top_k(scores, k)
    return chosen, best > -jnp.inf


def _top_pools_kernel(scores_ref, chosen_ref, valid_ref, *, k):
    """One row: the k-th best score found bit by bit (the largest threshold that at least k scores
    reach, on integer keys that order as the floats do; or the first that exactly k reach), then
    every score above it and the first of those equal to it, written in the row's order by their
    running count."""
    t, b = pl.program_id(0), pl.program_id(1)
    x = scores_ref[b, t, :]
    bits = lax.bitcast_convert_type(x, jnp.int32)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: the magnitude bits flipped

    def next_bit(carry):  # from the sign bit down; the sign bit's flip is int32's minimum
        i, threshold, _ = carry
        candidate = threshold ^ jnp.left_shift(jnp.int32(1), 31 - i)
        reached = jnp.sum((key >= candidate).astype(jnp.int32))
        return i + 1, jnp.where(reached >= k, candidate, threshold), reached == k

    # Done as soon as exactly k keys reach the threshold: they are the k best whatever its lower bits
    # (the remaining passes would only raise it to the k-th key itself).
    start = (jnp.int32(0), jnp.int32(-(2**31)), jnp.bool_(False))
    _, threshold, _ = lax.while_loop(lambda carry: (carry[0] < 32) & ~carry[2], next_bit, start)
    above = key > threshold
    equal = (key == threshold).astype(jnp.int32)
    chosen = above | ((equal == 1) & (jnp.cumsum(equal) - equal < k - jnp.sum(above.astype(jnp.int32))))
    index = lax.broadcasted_iota(jnp.int32, x.shape, 0)
    before = jnp.cumsum(chosen.astype(jnp.int32)) - chosen.astype(jnp.int32)
    # Exactly k are chosen: they go to slots 0..k-1; the rest to k.. in order, so that no two lanes
    # share a slot (the interpreter writes masked lanes too); the caller keeps the first k.
    slot = jnp.where(chosen, before, k + index - before)
    pltriton.store(chosen_ref.at[b, t, slot], index, mask=chosen)
    pltriton.store(valid_ref.at[b, t, slot], (x > -jnp.inf).astype(jnp.int32), mask=chosen)


def top_pools_kernel(scores, k, *, interpret=False):
    """`top_pools_reference`'s set of indices in one Pallas (Triton) launch, a program a row, in the
    row's order rather than best first; rows of up to MAX_TOP_POOLS scores (padded to a power of two).
    XLA sorts each whole row (on the H200, 73 of 88 ms of the selection at 65536 tokens)."""
    b, t, n = scores.shape
    width = pl.next_power_of_2(n)
    scores = jnp.pad(scores, [(0, 0), (0, 0), (0, width - n)], constant_values=-jnp.inf)
    chosen, valid = pl.pallas_call(
        functools.partial(_top_pools_kernel, k=k),
        out_shape=(jax.ShapeDtypeStruct((b, t, width), jnp.int32),) * 2,
        grid=(t, b),
        compiler_params=pltriton.CompilerParams(num_warps=min(16, max(4, width // 1024))),
        interpret=interpret,
        name="top_pools",
    )(scores)
    return chosen[..., :k], valid[..., :k] == 1


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


def _select(scores_fn, top_fn, block, q_idx, head_weights, pool_keys, key_valid, query_positions, *, index_topk, pool_size, select_tail):
    b, t = q_idx.shape[:2]
    s = key_valid.shape[-1]
    n_pools = pool_keys.shape[1]
    width = index_topk + (pool_size - 1 if select_tail else 0)
    first_key = first_valid_key(key_valid)
    parts = []

    n_select = min(index_topk // pool_size, n_pools)
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

    indices = jnp.concatenate(parts, axis=-1) if parts else jnp.zeros((b, t, 0), jnp.int32)
    indices = jnp.pad(indices, [(0, 0), (0, 0), (0, width - indices.shape[-1])], constant_values=-1)
    query_valid = jnp.take_along_axis(key_valid, jnp.clip(query_positions, 0, s - 1), axis=-1)
    return jnp.where(query_valid[..., None], indices, -1).astype(jnp.int32)


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
    return _select(
        candidate_scores_reference, top_pools_reference, QUERY_BLOCK, q_idx, head_weights, pool_keys, key_valid, query_positions,
        index_topk=index_topk, pool_size=pool_size, select_tail=select_tail,
    )


def _kernel_unsupported(q_idx, pool_keys):
    if q_idx.dtype != jnp.bfloat16 or pool_keys.dtype != jnp.bfloat16:
        return f"q_idx and pool_keys must be bf16, got {q_idx.dtype} and {pool_keys.dtype}"
    if q_idx.shape[-1] not in KERNEL_HEAD_DIMS:
        return f"the index head dim must be one of {KERNEL_HEAD_DIMS}, got {q_idx.shape[-1]}"
    return None


def select_tokens(
    q_idx, head_weights, pool_keys, key_valid, query_positions, *, index_topk, pool_size, select_tail=True,
    implementation=None, interpret=False,
):
    """The arguments and result as `select_tokens_reference`'s (with the kernels, each row's pools in
    their order rather than best first). `implementation`: None (the scores and top-k kernels on GPU
    for bf16 q_idx and pool keys, else the reference), "reference" or "pallas"; `interpret` runs the
    kernels in Pallas' interpreter."""
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
    kw = dict(index_topk=index_topk, pool_size=pool_size, select_tail=select_tail)
    if pick_implementation(implementation, _kernel_unsupported(q_idx, pool_keys), q_idx.dtype, interpret=interpret) == "reference":
        return select_tokens_reference(q_idx, head_weights, pool_keys, key_valid, query_positions, **kw)
    block = max(QUERY_BLOCK, KERNEL_BLOCK_SCORES // max(pool_keys.shape[1], 1) // QUERY_BLOCK * QUERY_BLOCK)
    scores = functools.partial(candidate_scores_kernel, interpret=interpret)
    fits = pl.next_power_of_2(pool_keys.shape[1]) <= MAX_TOP_POOLS
    top = functools.partial(top_pools_kernel, interpret=interpret) if fits else top_pools_reference
    return _select(scores, top, block, q_idx, head_weights, pool_keys, key_valid, query_positions, **kw)
