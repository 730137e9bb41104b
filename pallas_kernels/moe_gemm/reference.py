"""The grouped GEMM's pure-jnp reference: XLA's ragged_dot over the same tiled layout."""

import jax.numpy as jnp
from jax import lax


def grouped_matmul_reference(x, weights, tile_experts, used_tiles):
    """x [T * block_rows, K] in the tiled layout, weights [G, K, N], tile_experts [T], used_tiles [] ->
    [T * block_rows, N] in x.dtype (fp32 accumulation); rows of unused tiles are zero."""
    block_rows = x.shape[0] // tile_experts.shape[0]
    used = (jnp.arange(tile_experts.shape[0]) < used_tiles).astype(jnp.int32)
    group_sizes = jnp.bincount(tile_experts, weights=used, length=weights.shape[0]).astype(jnp.int32) * block_rows
    out = lax.ragged_dot(x, weights, group_sizes, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return out.astype(x.dtype)
