"""The grouped GEMMs' pure-jnp references: XLA's ragged_dot over the same tiled layout, in bf16 or
fp32 operands and in block-scaled FP8 ones dequantized."""

import jax.numpy as jnp
from jax import lax

from pallas_kernels.block_fp8 import dequantize_blocks, dequantize_rows


def grouped_matmul_reference(x, weights, tile_experts, used_tiles):
    """x [T * block_rows, K] in the tiled layout, weights [G, K, N], tile_experts [T], used_tiles [] ->
    [T * block_rows, N] in x.dtype (fp32 accumulation); rows of unused tiles are zero."""
    block_rows = x.shape[0] // tile_experts.shape[0]
    used = (jnp.arange(tile_experts.shape[0]) < used_tiles).astype(jnp.int32)
    group_sizes = jnp.bincount(tile_experts, weights=used, length=weights.shape[0]).astype(jnp.int32) * block_rows
    out = lax.ragged_dot(x, weights, group_sizes, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


def grouped_matmul_fp8_reference(x, x_scales, weights, weight_scales, tile_experts, used_tiles, out_dtype=jnp.bfloat16):
    """The block-scaled FP8 product: x [T * block_rows, K] fp8 with x_scales [T * block_rows,
    ceil(K / 128)] (1 x 128 groups), weights [G, N, K] fp8 with weight_scales [G, ceil(N / 128),
    ceil(K / 128)] (128 x 128 blocks), tile_experts [T], used_tiles [] -> [T * block_rows, N] in
    out_dtype: both operands dequantized exactly in fp32, multiplied in fp32; rows of unused tiles are
    zero."""
    x = dequantize_rows(x, x_scales)
    w = jnp.swapaxes(dequantize_blocks(weights, weight_scales), 1, 2)
    return grouped_matmul_reference(x, w, tile_experts, used_tiles).astype(out_dtype)
