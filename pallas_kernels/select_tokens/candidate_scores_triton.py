"""The candidates' scores on the GPU, in Pallas' Triton backend: one program per (block of queries,
block of pools) sums the heads' relu'd products in registers, so only the [T, n_pools] scores reach
HBM, and a block of pools that no query of the block sees yet is not multiplied."""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.select_tokens.reference import POOL_BLOCK

KERNEL_HEAD_DIMS = (16, 32, 64, 128, 256)
# Pools a kernel program scores: on the H200, 64 pools a program: 0.069 ms against 0.091 ms at 128 at
# 4096 tokens, 0.710 against 0.729 at 16384 (32 queries a program, or 16, are slower; bench/RESULTS.md).
BLOCK_POOLS = POOL_BLOCK
MAX_BLOCK_QUERIES = 64  # queries a kernel program scores (fewer, down to 16, for shorter blocks)
MIN_BLOCK_QUERIES = 16  # fewer queries: one query a program, its heads as the product's rows
FEW_QUERIES_BLOCK_POOLS = POOL_BLOCK  # then more programs, each with less to do (decode's grid is small)


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
    H200 at batch 8 over 4096 cached, the queries' form takes 0.022 ms, twice XLA's product and sum)."""
    b, t, nh, hd = q_idx.shape
    n_pools = pool_keys.shape[1]
    few = t < MIN_BLOCK_QUERIES
    block_q = 1 if few else min(MAX_BLOCK_QUERIES, pl.next_power_of_2(t))
    block_p = FEW_QUERIES_BLOCK_POOLS if few else BLOCK_POOLS
    heads = max(16, pl.next_power_of_2(nh)) if few else nh  # a product's rows: a power of two >= 16
    pad_t, pad_p = -t % block_q, -n_pools % block_p
    q = jnp.pad(q_idx, [(0, 0), (0, pad_t), (0, heads - nh), (0, 0)])
    w = jnp.pad(head_weights.astype(jnp.float32), [(0, 0), (0, pad_t), (0, heads - nh)])
    # A cache of whole blocks (`reference.pool_rows`) is read in place; another is copied whole.
    keys = jnp.pad(pool_keys, [(0, 0), (0, pad_p), (0, 0)]) if pad_p else pool_keys
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
