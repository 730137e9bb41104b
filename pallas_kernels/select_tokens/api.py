"""DSA token selection: score complete key pools per query, keep the best, expand them to tokens.

Pools start at the sequence's first valid key and hold `pool_size` consecutive keys; a pool is valid
when all its keys exist and are valid, and it is a candidate for a query when its last key is
visible to that query (causal and valid). For each query the best min(index_topk / pool_size,
n_pools) candidates are kept and expanded to their token indices; the query's incomplete tail
(the visible keys after its last complete pool) is appended raw; rows are padded with -1 to a fixed
width, and rows of invalid queries are all -1.

The candidates' scores (every query against every pool, the work that grows as T x T) have two
implementations behind `select_tokens`:
- `candidate_scores_reference` (`reference`): jnp, any device; its [T, nh, n_pools] fp32 products are whole for
  a block of QUERY_BLOCK queries;
- Pallas kernels (GPU, bf16 queries and pool keys) that sum the heads' relu'd products in registers,
  so only the [T, n_pools] scores reach HBM, and skip a block of pools that no query of a block sees
  yet: `candidate_scores_triton` (Triton, the default) or `candidate_scores_mosaic` (Mosaic GPU,
  wgmma; `backend="mosaic"`).
The ranking likewise: XLA's top-k (`top_pools_reference`, a sort of each whole row on the GPU), or
with the kernels a Pallas kernel that finds each row's k-th best score bit by bit and keeps what
reaches it (`top_pools_triton`: the same set, ties to the lower index as XLA's, in the row's order).
The scores agree up to the order of fp32 sums, so a near-tie at the k-th place may rank otherwise.
"""

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import pick_implementation
from pallas_kernels.select_tokens import candidate_scores_mosaic, candidate_scores_triton
from pallas_kernels.select_tokens.reference import (
    POOL_BLOCK,
    QUERY_BLOCK,
    pool_rows,
    select_tokens_reference,
    select_with,
    top_pools_reference,
)
from pallas_kernels.select_tokens.top_pools_triton import MAX_TOP_POOLS, top_pools_kernel

# With the kernel, queries ranked together: as many as keep a block's fp32 scores within 64 MB.
KERNEL_BLOCK_SCORES = 1 << 24


BACKENDS = ("triton", "mosaic")


def _kernel_unsupported(q_idx, pool_keys, backend):
    if backend == "mosaic":
        return candidate_scores_mosaic.unsupported(q_idx, pool_keys)
    if q_idx.dtype != jnp.bfloat16 or pool_keys.dtype != jnp.bfloat16:
        return f"q_idx and pool_keys must be bf16, got {q_idx.dtype} and {pool_keys.dtype}"
    if q_idx.shape[-1] not in candidate_scores_triton.KERNEL_HEAD_DIMS:
        return f"the index head dim must be one of {candidate_scores_triton.KERNEL_HEAD_DIMS}, got {q_idx.shape[-1]}"
    return None


def select_tokens(
    q_idx, head_weights, pool_keys, key_valid, query_positions, *, index_topk, pool_size, select_tail=True,
    segment_ids=None, implementation=None, backend="triton", interpret=False,
):
    """The arguments and result as `select_tokens_reference`'s (with the kernels, each row's pools in
    their order rather than best first). `implementation`: None (the scores and top-k kernels on GPU
    for bf16 q_idx and pool keys, else the reference), "reference" or "pallas"; `interpret` runs the
    kernels in Pallas' interpreter. `backend`: the scores kernel's, "triton" or "mosaic". segment_ids:
    packed sequences, as `select_tokens_reference` takes them (the kernels' scores masked to each
    query's own segment's pools before the ranking)."""
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
    if pool_keys.shape[1] > pool_rows(s, pool_size):
        raise ValueError(f"{pool_keys.shape[1]} pools of {pool_size} do not fit in {s} keys (at most "
                         f"pool_rows = {pool_rows(s, pool_size)}: the keys' pools in whole blocks of {POOL_BLOCK})")
    if segment_ids is not None and segment_ids.shape != (b, s):
        raise ValueError(f"segment_ids must be [B, S] = {(b, s)}, got {segment_ids.shape}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    kw = dict(index_topk=index_topk, pool_size=pool_size, select_tail=select_tail, segment_ids=segment_ids)
    unsupported = _kernel_unsupported(q_idx, pool_keys, backend)
    if pick_implementation(implementation, unsupported, q_idx.dtype, interpret=interpret) == "reference":
        return select_tokens_reference(q_idx, head_weights, pool_keys, key_valid, query_positions, **kw)
    block = max(QUERY_BLOCK, KERNEL_BLOCK_SCORES // max(pool_keys.shape[1], 1) // QUERY_BLOCK * QUERY_BLOCK)
    kernels = candidate_scores_mosaic if backend == "mosaic" else candidate_scores_triton
    scores = functools.partial(kernels.candidate_scores_kernel, interpret=interpret)
    fits = pl.next_power_of_2(pool_keys.shape[1]) <= MAX_TOP_POOLS
    top = functools.partial(top_pools_kernel, interpret=interpret) if fits else top_pools_reference
    return select_with(scores, top, block, q_idx, head_weights, pool_keys, key_valid, query_positions, **kw)
