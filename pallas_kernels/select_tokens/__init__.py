"""DSA's token selection (`api`): pool scores in Triton (`candidate_scores_triton`) or Mosaic GPU
(`candidate_scores_mosaic`), the ranking in Triton (`top_pools_triton`), or their references
(`reference`), and the pool and tail bookkeeping they share."""

from pallas_kernels.select_tokens.api import select_tokens
from pallas_kernels.select_tokens.reference import (
    POOL_BLOCK,
    PackedPools,
    candidate_scores_reference,
    first_valid_key,
    packed_pools,
    pool_rows,
    pool_scores,
    pool_token_indices,
    pool_validity,
    select_tokens_reference,
    top_pools_reference,
    visible_key_counts,
    visible_pools,
)

__all__ = [
    "POOL_BLOCK",
    "PackedPools",
    "packed_pools",
    "candidate_scores_reference",
    "first_valid_key",
    "pool_rows",
    "pool_scores",
    "pool_token_indices",
    "pool_validity",
    "select_tokens",
    "select_tokens_reference",
    "top_pools_reference",
    "visible_key_counts",
    "visible_pools",
]
