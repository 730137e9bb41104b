"""Grouped GEMM of the MoE: each expert's rows times that expert's weight, on Hopper in Pallas Mosaic GPU.

The rows travel in a tiled layout: sorted by expert, each expert's rows starting a new tile of
`block_rows`, so that every tile belongs to one expert and the kernel needs no masked stores. The
padding rows' outputs carry no meaning; `expert_tiles` says where each real row sits. With
`block_rows = 1` the layout is the packed one (no padding): what the reference runs on where no
kernel is used.

Dispatch (`implementation`, `interpret`): as `pallas_kernels.common.pick_implementation` says, the
kernel for bf16 operands on a GPU (or in Pallas' interpreter with `interpret=True`), else the reference.

The bf16 kernel differentiates (`jax.grad`): the rows' gradient is the same kernel over the output's
cotangent with the weights read transposed, the weights' gradient `expert_outer_products` (a kernel
of its own); the reference differentiates through XLA's ragged dot.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.block_fp8 import BLOCK, FP8, blocks, in_blocks
from pallas_kernels.common import pick_implementation, sm_count
from pallas_kernels.moe_gemm.expert_outer_mosaic import BLOCK_K, OuterConfig, expert_outer_kernel
from pallas_kernels.moe_gemm.grouped_matmul_fp8_mosaic import Fp8GemmConfig, grouped_matmul_fp8_kernel
from pallas_kernels.moe_gemm.grouped_matmul_mosaic import GemmConfig, grouped_matmul_kernel
from pallas_kernels.moe_gemm.reference import (
    expert_outer_reference,
    grouped_matmul_fp8_reference,
    grouped_matmul_reference,
    used_tiles_per_expert,
)


class ExpertTiles(NamedTuple):
    """Where the rows sorted by expert sit in the tiled layout.

    slots [M] int32: each sorted row's position; tile_experts [T] int32: each tile's expert (tiles
    from `used_tiles` on are never computed); used_tiles [] int32.
    """

    slots: jax.Array
    tile_experts: jax.Array
    used_tiles: jax.Array


def max_tiles(rows: int, experts: int, block_rows: int) -> int:
    """Tiles the layout needs at most: each nonempty expert wastes less than one tile."""
    return max(1, (rows + min(experts, rows) * (block_rows - 1)) // block_rows)


def expert_tiles(group_sizes, rows: int, block_rows: int) -> ExpertTiles:
    """The tiled layout of `rows` rows sorted by expert, `group_sizes` [G] int32 rows per expert. Rows
    past the groups' total (sorted after them: no expert here) get a slot past the layout."""
    experts = group_sizes.shape[0]
    group_sizes = group_sizes.astype(jnp.int32)
    tiles_per_expert = -(-group_sizes // block_rows)
    tile_ends = jnp.cumsum(tiles_per_expert)
    first_tile = tile_ends - tiles_per_expert
    group_start = jnp.cumsum(group_sizes) - group_sizes
    expert_of_row = jnp.repeat(jnp.arange(experts, dtype=jnp.int32), group_sizes, total_repeat_length=rows)
    slots = first_tile[expert_of_row] * block_rows + jnp.arange(rows, dtype=jnp.int32) - group_start[expert_of_row]
    n_tiles = max_tiles(rows, experts, block_rows)
    slots = jnp.where(jnp.arange(rows) < group_start[-1] + group_sizes[-1], slots, n_tiles * block_rows)
    # Each tile's expert by comparing it with every expert's end: searchsorted's default bisection is
    # a rolled loop, on the GPU a while loop with a host round trip per step (7-9 a MoE layer).
    tiles = jnp.arange(n_tiles, dtype=jnp.int32)
    tile_experts = jnp.searchsorted(tile_ends, tiles, side="right", method="compare_all")
    return ExpertTiles(slots, jnp.minimum(tile_experts, experts - 1).astype(jnp.int32), tile_ends[-1])


def _check(x, weights, tile_experts, used_tiles, transposed=False):
    if x.ndim != 2 or weights.ndim != 3 or x.shape[1] != weights.shape[2 if transposed else 1]:
        expected = "[G, N, K] (transposed)" if transposed else "[G, K, N]"
        raise ValueError(f"grouped_matmul: x [M, K] and weights {expected} expected, got {x.shape} and {weights.shape}")
    if tile_experts.ndim != 1 or tile_experts.shape[0] == 0 or x.shape[0] % tile_experts.shape[0]:
        raise ValueError(
            f"grouped_matmul: tile_experts must be [T] with x's {x.shape[0]} rows a multiple of T, got {tile_experts.shape}"
        )
    if jnp.shape(used_tiles) != ():
        raise ValueError(f"grouped_matmul: used_tiles must be a scalar, got shape {jnp.shape(used_tiles)}")


def _kernel_unsupported(dtype, weights, config: GemmConfig, transposed=False):
    n, k = weights.shape[1:] if transposed else weights.shape[1:][::-1]
    if dtype != jnp.bfloat16 or weights.dtype != jnp.bfloat16:
        return f"bf16 x and weights needed, got {dtype} and {weights.dtype}"
    if k % config.block_k:
        return f"K = {k} must be a multiple of block_k = {config.block_k}"
    if n % config.block_cols:
        return f"N = {n} must be a multiple of block_cols = {config.block_cols}"
    return None


def plan(implementation, x, weights, *, rows: int, interpret=False):
    """(implementation, GemmConfig) for the grouped GEMMs of one MoE call: x [.., K] the tokens, weights
    the [G, K, N] operands the rows go through, `rows` tokens x experts per token.

    The reference runs on the packed layout (block_rows = 1). The kernel takes tiles of 128 rows when
    the experts average over 64 rows, else 64 (a tile reads its expert's whole weight either way), and
    256 columns a CTA where every N allows it, else 128.
    """
    experts = weights[0].shape[0]
    block_cols = 256 if all(w.shape[2] % 256 == 0 for w in weights) else 128
    config = GemmConfig(block_rows=128 if rows > 64 * experts else 64, block_cols=block_cols)
    picks = {
        pick_implementation(implementation, _kernel_unsupported(x.dtype, w, config), x.dtype, interpret=interpret)
        for w in weights
    }
    if picks == {"pallas"}:
        return "pallas", config
    return "reference", GemmConfig(block_rows=1)


def grouped_matmul(
    x, weights, tile_experts, used_tiles, *, implementation=None, config: GemmConfig = GemmConfig(), interpret=False,
    transposed=False,
):
    """x [T * block_rows, K] rows in the tiled layout of `expert_tiles`, weights [G, K, N],
    tile_experts [T] int32, used_tiles [] int32 -> [T * block_rows, N] in x.dtype (fp32 accumulation).

    Rows of tiles past `used_tiles` are not computed (zero from the reference, unwritten by the kernel).
    The kernel needs block_rows == config.block_rows. `interpret`: True or `plgpu.InterpretGPUParams`
    runs the kernel in Pallas' interpreter. transposed: weights come [G, N, K] and each row takes
    its expert's weight transposed (the rows' gradient of the forward, the weights read in place); the
    kernel's transposed form has no gradient of its own.
    """
    _check(x, weights, tile_experts, used_tiles, transposed)
    unsupported = _kernel_unsupported(x.dtype, weights, config, transposed)
    impl = pick_implementation(implementation, unsupported, x.dtype, interpret=interpret)
    if impl == "reference":
        w = jnp.swapaxes(weights, 1, 2) if transposed else weights
        return grouped_matmul_reference(x, w, tile_experts, used_tiles)
    if x.shape[0] != tile_experts.shape[0] * config.block_rows:
        raise ValueError(
            f"grouped_matmul: x must have T * block_rows = {tile_experts.shape[0]} * {config.block_rows} rows, got {x.shape[0]}"
        )
    if transposed:
        return grouped_matmul_kernel(x, weights, tile_experts.astype(jnp.int32), used_tiles, config=config,
                                     interpret=interpret, sms=_sms(interpret), transposed=True)
    return _grouped_matmul_kernel(x, weights, tile_experts.astype(jnp.int32), jnp.asarray(used_tiles), config, interpret)


def _sms(interpret):
    """One CTA per SM; two in the interpreter, so that its CPU threads still share the items out."""
    return 2 if interpret else sm_count()


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _grouped_matmul_kernel(x, weights, tile_experts, used_tiles, config, interpret):
    return grouped_matmul_kernel(x, weights, tile_experts, used_tiles, config=config, interpret=interpret,
                                 sms=_sms(interpret))


def _grouped_matmul_kernel_fwd(x, weights, tile_experts, used_tiles, config, interpret):
    out = _grouped_matmul_kernel(x, weights, tile_experts, used_tiles, config, interpret)
    return out, (x, weights, tile_experts, used_tiles)


def _grouped_matmul_kernel_bwd(config, interpret, residuals, d_out):
    """d_x = d_out W^T (the forward kernel, weights read transposed), zero past the used tiles (rows
    there reach no output); d_w = `expert_outer_products(x, d_out)`. Shapes the backward kernels do
    not take go through the reference's vjp."""
    x, weights, tile_experts, used_tiles = residuals
    experts, k, n = weights.shape
    d_x_config = GemmConfig(config.block_rows, 256 if k % 256 == 0 else 128, 64, config.stages)
    outer = OuterConfig(block_rows=config.block_rows)
    if _kernel_unsupported(d_out.dtype, weights, d_x_config, transposed=True) or _outer_unsupported(x, d_out, outer):
        _, vjp = jax.vjp(lambda x, w: grouped_matmul_reference(x, w, tile_experts, used_tiles), x, weights)
        return (*vjp(d_out), None, None)
    d_x = grouped_matmul(d_out, weights, tile_experts, used_tiles, implementation="pallas", config=d_x_config,
                         interpret=interpret, transposed=True)
    d_x = jnp.where(jnp.arange(x.shape[0])[:, None] < used_tiles * config.block_rows, d_x, 0)
    d_w = expert_outer_products(x, d_out, tile_experts, used_tiles, experts, implementation="pallas", config=outer,
                                interpret=interpret)
    return d_x, d_w.astype(weights.dtype), None, None


_grouped_matmul_kernel.defvjp(_grouped_matmul_kernel_fwd, _grouped_matmul_kernel_bwd)


def _outer_unsupported(x, y, config: OuterConfig):
    if x.dtype != jnp.bfloat16 or y.dtype != jnp.bfloat16:
        return f"bf16 x and y needed, got {x.dtype} and {y.dtype}"
    if config.block_rows not in (64, 128):
        return f"block_rows must be 64 or 128, got {config.block_rows}"
    if config.block_cols * config.block_rows > 128 * 128:  # two stages and the stores in shared memory
        return f"block_cols x block_rows must be at most 128 x 128, got {config.block_cols} x {config.block_rows}"
    if x.shape[1] % BLOCK_K or y.shape[1] % config.block_cols:
        return f"K = {x.shape[1]} must be a multiple of {BLOCK_K} and N = {y.shape[1]} of block_cols = {config.block_cols}"
    return None


def expert_outer_products(x, y, tile_experts, used_tiles, experts: int, *, implementation=None,
                          config: OuterConfig = OuterConfig(), interpret=False):
    """x [T * block_rows, K] and y [T * block_rows, N] in the tiled layout of `expert_tiles`,
    tile_experts [T] int32, used_tiles [] int32 -> [G = experts, K, N] in y.dtype: each expert's sum
    over its used tiles' rows of x_row (outer) y_row, in fp32 (the grouped GEMM's weight gradient,
    y the cotangent of its output). Experts without rows get zeros. The kernel needs block_rows ==
    config.block_rows; `implementation` and `interpret` as for `grouped_matmul`."""
    if x.ndim != 2 or y.ndim != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"expert_outer_products: x [M, K] and y [M, N] expected, got {x.shape} and {y.shape}")
    if tile_experts.ndim != 1 or tile_experts.shape[0] == 0 or x.shape[0] % tile_experts.shape[0]:
        raise ValueError(f"expert_outer_products: tile_experts must be [T] with x's {x.shape[0]} rows a multiple of T,"
                         f" got {tile_experts.shape}")
    impl = pick_implementation(implementation, _outer_unsupported(x, y, config), x.dtype, interpret=interpret)
    if impl == "reference":
        return expert_outer_reference(x, y, tile_experts, used_tiles, experts)
    if x.shape[0] != tile_experts.shape[0] * config.block_rows:
        raise ValueError(f"expert_outer_products: x must have T * block_rows = {tile_experts.shape[0]} *"
                         f" {config.block_rows} rows, got {x.shape[0]}")
    counts = used_tiles_per_expert(tile_experts, used_tiles, experts)
    return expert_outer_kernel(x, y, jnp.cumsum(counts) - counts, counts, experts=experts, config=config,
                               interpret=interpret, sms=_sms(interpret))


def _check_fp8(x, x_scales, weights, weight_scales, tile_experts, used_tiles):
    if x.ndim != 2 or weights.ndim != 3 or x.shape[1] != weights.shape[2]:
        raise ValueError(f"grouped_matmul_fp8: x [M, K] and weights [G, N, K] expected, got {x.shape} and {weights.shape}")
    m, k = x.shape
    g, n, _ = weights.shape
    if x_scales.ndim != 2 or x_scales.shape[0] != m or x_scales.shape[1] not in (blocks(k), k):
        raise ValueError(f"grouped_matmul_fp8: x_scales must be [M, ceil(K / 128)] = {(m, blocks(k))} (or [M, K]),"
                         f" got {x_scales.shape}")
    if (weight_scales.ndim != 3 or weight_scales.shape[0] != g or weight_scales.shape[1] not in (blocks(n), n)
            or weight_scales.shape[2] not in (blocks(k), k)):
        raise ValueError(
            f"grouped_matmul_fp8: weight_scales must be [G, ceil(N / 128), ceil(K / 128)] = {(g, blocks(n), blocks(k))}"
            f" (or per element on N or K), got {weight_scales.shape}"
        )
    for name, a in (("x", x), ("weights", weights)):
        if a.dtype != FP8:
            raise ValueError(f"grouped_matmul_fp8: {name} must be {jnp.dtype(FP8)}, got {a.dtype}")
    _check(x, jnp.swapaxes(weights, 1, 2), tile_experts, used_tiles)


def _fp8_kernel_unsupported(weights, config: Fp8GemmConfig, out_dtype, x_scales=None, weight_scales=None):
    n, k = weights.shape[1:]
    if x_scales is not None and not (in_blocks((k,), x_scales.shape[1:]) and in_blocks((n, k), weight_scales.shape[1:])):
        return "its scales are per element on an axis (a mesh cut a block): the kernel takes one scale a block"
    if jnp.dtype(out_dtype) != jnp.bfloat16:
        return f"the kernel writes bf16, {jnp.dtype(out_dtype)} asked for"
    if config.block_rows not in (64, 128):
        return f"block_rows must be 64 or 128, got {config.block_rows}"
    if config.block_cols not in (BLOCK, 2 * BLOCK):
        return f"block_cols must be {BLOCK} or {2 * BLOCK}, got {config.block_cols}"
    if k % BLOCK or n % config.block_cols:
        return f"N = {n} must be a multiple of block_cols = {config.block_cols} and K = {k} of {BLOCK} (whole scale blocks)"
    if config.cluster not in (1, 2) or n // config.block_cols % config.cluster:
        return f"cluster must be 1 or 2 and divide N / block_cols = {n // config.block_cols}, got {config.cluster}"
    return None


def plan_fp8(implementation, weights, *, rows: int, interpret=False, out_dtype=jnp.bfloat16):
    """(implementation, Fp8GemmConfig) for the block-scaled FP8 grouped GEMMs of one call (weights
    [G, N, K]): 128-row tiles when the groups average over 64 rows and such tiles still give every
    SM 8 items of the narrowest GEMM, else 64-row ones (on the H100, a dense 8192 x 4096 -> 512
    product ran 2x faster in 64-row tiles, 256 items; 4096 -> 4096, 2048 items, 14% slower).
    CTAs run alone, their loads running on from item to item: on the H100 at 8192 tokens that beat
    clusters of two sharing rows, with or without overlapped items, by 2-4%."""
    experts = weights[0].shape[0]
    items = max_tiles(rows, experts, 128) * min(w.shape[1] for w in weights) // BLOCK
    config = Fp8GemmConfig(block_rows=128 if rows > 64 * experts and items >= 8 * sm_count() else 64)
    picks = {
        pick_implementation(implementation, _fp8_kernel_unsupported(w, config, out_dtype), out_dtype, interpret=interpret)
        for w in weights
    }
    if picks == {"pallas"}:
        return "pallas", config
    return "reference", Fp8GemmConfig(block_rows=1)


def grouped_matmul_fp8(
    x, x_scales, weights, weight_scales, tile_experts, used_tiles, *, implementation=None,
    config: Fp8GemmConfig = Fp8GemmConfig(), interpret=False, out_dtype=jnp.bfloat16,
):
    """Block-scaled FP8 (W8A8) grouped GEMM: x [T * block_rows, K] e4m3 rows in the tiled layout of
    `expert_tiles` with x_scales [T * block_rows, ceil(K / 128)] fp32 (1 x 128 groups), weights
    [G, N, K] e4m3 (torch's [out, in]) with weight_scales [G, ceil(N / 128), ceil(K / 128)] fp32
    (128 x 128 blocks), tile_experts [T] int32, used_tiles [] int32 -> [T * block_rows, N] in out_dtype.

    The kernel takes N and K in whole blocks of 128, block_rows == config.block_rows and writes bf16;
    its rows of tiles past `used_tiles` are unwritten (zero from the reference). The reference also
    takes scales per element on K (x_scales [M, K], weight_scales [G, *, K]) or N (weight_scales
    [G, N, *]), as a device holds them where a mesh cuts a block. `interpret` as for `grouped_matmul`.
    """
    _check_fp8(x, x_scales, weights, weight_scales, tile_experts, used_tiles)
    impl = pick_implementation(
        implementation, _fp8_kernel_unsupported(weights, config, out_dtype, x_scales, weight_scales), out_dtype,
        interpret=interpret,
    )
    if impl == "reference":
        return grouped_matmul_fp8_reference(x, x_scales, weights, weight_scales, tile_experts, used_tiles, out_dtype)
    if x.shape[0] != tile_experts.shape[0] * config.block_rows:
        raise ValueError(
            f"grouped_matmul_fp8: x must have T * block_rows = {tile_experts.shape[0]} * {config.block_rows} rows,"
            f" got {x.shape[0]}"
        )
    sms = 2 if interpret else sm_count()
    return grouped_matmul_fp8_kernel(
        x, x_scales.T, weights, weight_scales.astype(jnp.float32), tile_experts.astype(jnp.int32), used_tiles,
        config=config, interpret=interpret, sms=sms,
    )


def matmul_fp8(x, x_scales, weight, weight_scale, *, implementation=None, config=None, interpret=False,
               out_dtype=jnp.bfloat16):
    """A dense block-scaled FP8 product: x [M, K] e4m3 with x_scales [M, ceil(K / 128)], weight [N, K]
    e4m3 with weight_scale [ceil(N / 128), ceil(K / 128)] -> [M, N] in out_dtype. The grouped GEMM over
    one group, the rows padded to whole tiles (config None: `plan_fp8`'s, 64 rows up to 64, else 128).
    Scales per element (see `grouped_matmul_fp8`) go to the reference unless the kernel is asked for."""
    m = x.shape[0]
    if implementation is None and not (in_blocks(x.shape[1:], x_scales.shape[1:])
                                       and in_blocks(weight.shape, weight_scale.shape)):
        implementation = "reference"
    implementation, planned = plan_fp8(implementation, (weight[None],), rows=m, interpret=interpret, out_dtype=out_dtype)
    config = planned if config is None or implementation == "reference" else config
    block_rows = config.block_rows
    tiles = -(-m // block_rows)
    pad = tiles * block_rows - m
    out = grouped_matmul_fp8(
        jnp.pad(x, [(0, pad), (0, 0)]), jnp.pad(x_scales, [(0, pad), (0, 0)], constant_values=1.0), weight[None],
        weight_scale[None], jnp.zeros((tiles,), jnp.int32), jnp.int32(tiles),
        implementation=implementation, config=config, interpret=interpret, out_dtype=out_dtype,
    )
    return out[:m]
