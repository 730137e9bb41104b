"""Grouped GEMM of the MoE: rows sorted by expert, each group multiplied by its expert's weight."""

import jax
import jax.numpy as jnp


def grouped_matmul(rows, weights, group_sizes):
    """rows [M, K] sorted by group, weights [G, K, N], group_sizes [G] int32 summing to M -> [M, N].

    Accumulates in fp32 and returns rows.dtype.
    """
    if rows.ndim != 2 or weights.ndim != 3 or rows.shape[1] != weights.shape[1]:
        raise ValueError(f"grouped_matmul: rows [M, K] and weights [G, K, N] expected, got {rows.shape} and {weights.shape}")
    if group_sizes.shape != (weights.shape[0],):
        raise ValueError(f"grouped_matmul: group_sizes must be [{weights.shape[0]}], got {group_sizes.shape}")
    out = jax.lax.ragged_dot(
        rows, weights, group_sizes, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )
    return out.astype(rows.dtype)
