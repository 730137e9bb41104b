"""The grouped GEMMs' pure-jnp references: XLA's ragged_dot over the same tiled layout, in bf16 or
fp32 operands and in block-scaled FP8 ones dequantized."""

import jax.numpy as jnp
from jax import lax

from pallas_kernels.block_fp8 import dequantize_blocks, dequantize_rows


def used_tiles_per_expert(tile_experts, used_tiles, experts):
    """[G] int32: how many of the used tiles each expert has (its tiles are consecutive)."""
    used = (jnp.arange(tile_experts.shape[0]) < used_tiles).astype(jnp.int32)
    return jnp.bincount(tile_experts, weights=used, length=experts).astype(jnp.int32)


def grouped_matmul_reference(x, weights, tile_experts, used_tiles):
    """x [T * block_rows, K] in the tiled layout, weights [G, K, N], tile_experts [T], used_tiles [] ->
    [T * block_rows, N] in x.dtype (fp32 accumulation); rows of unused tiles are zero."""
    block_rows = x.shape[0] // tile_experts.shape[0]
    group_sizes = used_tiles_per_expert(tile_experts, used_tiles, weights.shape[0]) * block_rows
    out = lax.ragged_dot(x, weights, group_sizes, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


def expert_outer_reference(x, y, tile_experts, used_tiles, experts):
    """x [T * block_rows, K], y [T * block_rows, N] in the tiled layout, tile_experts [T], used_tiles
    [] -> [G, K, N] in y.dtype: for each expert the sum over its used tiles' rows of x_row (outer)
    y_row, in fp32 (the grouped GEMM's weight gradient with y its output's cotangent)."""
    block_rows = x.shape[0] // tile_experts.shape[0]
    group_sizes = used_tiles_per_expert(tile_experts, used_tiles, experts) * block_rows
    rows_contracted = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
    )
    out = lax.ragged_dot_general(
        x, y, group_sizes, rows_contracted, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )
    return out.astype(y.dtype)


def grouped_matmul_fp8_reference(x, x_scales, weights, weight_scales, tile_experts, used_tiles, out_dtype=jnp.bfloat16):
    """The block-scaled FP8 product: x [T * block_rows, K] fp8 with x_scales [T * block_rows,
    ceil(K / 128)] (1 x 128 groups), weights [G, N, K] fp8 with weight_scales [G, ceil(N / 128),
    ceil(K / 128)] (128 x 128 blocks), tile_experts [T], used_tiles [] -> [T * block_rows, N] in
    out_dtype: both operands dequantized exactly in fp32, multiplied in fp32; rows of unused tiles are
    zero."""
    x = dequantize_rows(x, x_scales)
    w = jnp.swapaxes(dequantize_blocks(weights, weight_scales), 1, 2)
    return grouped_matmul_reference(x, w, tile_experts, used_tiles).astype(out_dtype)
