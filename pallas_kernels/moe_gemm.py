"""Grouped GEMM of the MoE: each expert's rows times that expert's weight, on Hopper in Pallas Mosaic GPU.

The rows travel in a tiled layout: sorted by expert, each expert's rows starting a new tile of
`tile_rows`, so that every tile belongs to one expert and the kernel needs no masked stores. The
padding rows' outputs carry no meaning; `expert_tiles` says where each real row sits. The kernel
takes tiles of 64 rows (`TILE_ROWS`); with `tile_rows = 1` the layout is the packed one (no padding),
which is what the reference runs on where no kernel is used.

The kernel is persistent and warp-specialised: one CTA per SM walks its share of the (pair, column
block) items, column blocks fastest, where a pair is two consecutive tiles of one expert (or an
expert's last tile alone). A third warpgroup feeds a pipeline of `stages` slots by TMA (the pair's
128 rows and a [block_k, block_cols] block of its expert's weight), across items, so an item's
first loads are in flight while the previous item's result is stored; each of two compute
warpgroups multiplies one tile of the pair (a lone tile leaves the second idle). Tiles of 64 rows
waste half as many padding rows as tiles of 128 (at 8192 tokens x 8 of 288 experts: ~13% against
~28% of the rows), while the pair keeps a weight block's SMEM traffic per row that of 128.

Dispatch (`implementation`): None picks "pallas" on a GPU backend for bf16 operands, else
"reference"; "pallas" with `interpret=True` runs the kernel in Pallas' interpreter (CPU tests).
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

IMPLEMENTATIONS = (None, "reference", "pallas")
TILE_ROWS = 64  # rows of a tile in the kernel's layout: one wgmma row block


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """The kernel's tiling: `block_cols` columns of the weight per item, `block_k` the pipelined
    slice of K, `stages` slices in flight."""

    block_cols: int = 256
    block_k: int = 64
    stages: int = 3


class ExpertTiles(NamedTuple):
    """Where the rows sorted by expert sit in the tiled layout.

    slots [M] int32: each sorted row's position; tile_experts [T] int32: each tile's expert (tiles
    from `used_tiles` on are never computed); used_tiles [] int32.
    """

    slots: jax.Array
    tile_experts: jax.Array
    used_tiles: jax.Array


def max_tiles(rows: int, experts: int, tile_rows: int) -> int:
    """Tiles the layout needs at most: each nonempty expert wastes less than one tile."""
    return (rows + min(experts, rows) * (tile_rows - 1)) // tile_rows


def expert_tiles(group_sizes, rows: int, tile_rows: int) -> ExpertTiles:
    """The tiled layout of `rows` rows sorted by expert, `group_sizes` [G] int32 rows per expert."""
    experts = group_sizes.shape[0]
    group_sizes = group_sizes.astype(jnp.int32)
    tiles_per_expert = -(-group_sizes // tile_rows)
    tile_ends = jnp.cumsum(tiles_per_expert)
    first_tile = tile_ends - tiles_per_expert
    group_start = jnp.cumsum(group_sizes) - group_sizes
    expert_of_row = jnp.repeat(jnp.arange(experts, dtype=jnp.int32), group_sizes, total_repeat_length=rows)
    slots = first_tile[expert_of_row] * tile_rows + jnp.arange(rows, dtype=jnp.int32) - group_start[expert_of_row]
    n_tiles = max_tiles(rows, experts, tile_rows)
    tile_experts = jnp.searchsorted(tile_ends, jnp.arange(n_tiles, dtype=jnp.int32), side="right")
    return ExpertTiles(slots, jnp.minimum(tile_experts, experts - 1).astype(jnp.int32), tile_ends[-1])


def grouped_matmul_reference(x, weights, tile_experts, used_tiles):
    """x [T * tile_rows, K] in the tiled layout, weights [G, K, N], tile_experts [T], used_tiles [] ->
    [T * tile_rows, N] in x.dtype (fp32 accumulation); rows of unused tiles are zero."""
    tile_rows = x.shape[0] // tile_experts.shape[0]
    used = (jnp.arange(tile_experts.shape[0]) < used_tiles).astype(jnp.int32)
    group_sizes = jnp.bincount(tile_experts, weights=used, length=weights.shape[0]).astype(jnp.int32) * tile_rows
    out = lax.ragged_dot(x, weights, group_sizes, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


def _check(x, weights, tile_experts, used_tiles):
    if x.ndim != 2 or weights.ndim != 3 or x.shape[1] != weights.shape[1]:
        raise ValueError(f"grouped_matmul: x [M, K] and weights [G, K, N] expected, got {x.shape} and {weights.shape}")
    if tile_experts.ndim != 1 or tile_experts.shape[0] == 0 or x.shape[0] % tile_experts.shape[0]:
        raise ValueError(
            f"grouped_matmul: tile_experts must be [T] with x's {x.shape[0]} rows a multiple of T, got {tile_experts.shape}"
        )
    if jnp.shape(used_tiles) != ():
        raise ValueError(f"grouped_matmul: used_tiles must be a scalar, got shape {jnp.shape(used_tiles)}")


def _kernel_unsupported(dtype, weights, config: GemmConfig):
    k, n = weights.shape[1:]
    if dtype != jnp.bfloat16 or weights.dtype != jnp.bfloat16:
        return f"bf16 x and weights needed, got {dtype} and {weights.dtype}"
    if k % config.block_k:
        return f"K = {k} must be a multiple of block_k = {config.block_k}"
    if n % config.block_cols:
        return f"N = {n} must be a multiple of block_cols = {config.block_cols}"
    return None


def _pick(implementation, dtype, weights, config):
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    unsupported = _kernel_unsupported(dtype, weights, config)
    if implementation is None:
        return "pallas" if jax.default_backend() == "gpu" and unsupported is None else "reference"
    if implementation == "pallas" and unsupported is not None:
        raise ValueError(f"the grouped GEMM kernel does not support this call: {unsupported}")
    return implementation


def plan(implementation, x, weights, *, rows: int):
    """(implementation, tile_rows, GemmConfig) for the grouped GEMMs of one MoE call: x [.., K] the
    tokens, weights the [G, K, N] operands the rows go through, `rows` tokens x experts per token.

    The reference runs on the packed layout (tile_rows = 1), the kernel on tiles of `TILE_ROWS`, with
    256 weight columns an item where every N allows it, else 128.
    """
    block_cols = 256 if all(w.shape[2] % 256 == 0 for w in weights) else 128
    config = GemmConfig(block_cols=block_cols)
    picks = {_pick(implementation, x.dtype, w, config) for w in weights}
    if picks == {"pallas"}:
        return "pallas", TILE_ROWS, config
    return "reference", 1, config


def _pair_table(tile_experts, used_tiles, n_experts):
    """[3, P] int32: each pair's expert, first tile and tile count (1 or 2), P a bound on the pairs;
    and the number of pairs in use. A pair is two consecutive tiles of one expert (or its last alone)."""
    n_pairs = tile_experts.shape[0] // 2 + min(n_experts, tile_experts.shape[0])
    used = (jnp.arange(tile_experts.shape[0]) < used_tiles).astype(jnp.int32)
    tiles = jnp.bincount(tile_experts, weights=used, length=n_experts).astype(jnp.int32)
    first_tile = jnp.cumsum(tiles) - tiles
    pairs = (tiles + 1) // 2
    pair_ends = jnp.cumsum(pairs)
    pair = jnp.arange(n_pairs, dtype=jnp.int32)
    expert = jnp.minimum(jnp.searchsorted(pair_ends, pair, side="right"), n_experts - 1).astype(jnp.int32)
    within = pair - (pair_ends - pairs)[expert]
    first = first_tile[expert] + 2 * within
    count = jnp.clip(tiles[expert] - 2 * within, 0, 2)
    return jnp.stack([expert, first, count]).astype(jnp.int32), pair_ends[-1:]


def _gemm_kernel(
    pairs_ref, used_ref, x_ref, w_ref, o_ref, x_smem, w_smem, out_smem, loaded, consumed, *, config: GemmConfig, sms: int
):
    rows, bn, bk, stages = TILE_ROWS, config.block_cols, config.block_k, config.stages
    k, n = w_ref.shape[1:]
    col_blocks, k_steps = n // bn, k // bk
    sm, wg = lax.axis_index("sm"), lax.axis_index("wg")
    # This SM's items are (pair, column block) indices sm, sm + sms, ...: column blocks fastest, so the
    # SMs at work at one time share a few pairs' rows and their experts' weights in L2.
    my_items = lax.div(jnp.maximum(used_ref[0] * col_blocks - sm, 0) + sms - 1, sms)

    def item(i):
        index = sm + i * sms
        pair, col = lax.div(index, col_blocks), lax.rem(index, col_blocks)
        return pairs_ref[0, pair], pairs_ref[1, pair], pairs_ref[2, pair], col

    @pl.when(wg == 2)
    def _feed():
        @pl.loop(0, my_items)
        def _(i):
            expert, first, count, col = item(i)

            @pl.loop(0, k_steps)
            def _(kk):
                step = i * k_steps + kk
                slot = lax.rem(step, stages)

                @pl.when(step >= stages)
                def _():
                    plgpu.barrier_wait(consumed.at[slot])

                k_cols = pl.ds(kk * bk, bk)
                for tiles in (1, 2):  # the pair's rows, then the weight block: two arrivals either way

                    @pl.when(count == tiles)
                    def _():
                        plgpu.copy_gmem_to_smem(
                            x_ref.at[pl.ds(first * rows, tiles * rows), k_cols],
                            x_smem.at[slot, pl.ds(0, tiles * rows)],
                            loaded.at[slot],
                        )

                plgpu.copy_gmem_to_smem(
                    w_ref.at[expert, k_cols, pl.ds(col * bn, bn)], w_smem.at[slot], loaded.at[slot]
                )

        # Every slot's last release observed, so the barriers end in step with their waiters.
        steps = my_items * k_steps

        @pl.loop(jnp.maximum(steps - stages, 0), steps)
        def _(step):
            plgpu.barrier_wait(consumed.at[lax.rem(step, stages)])

    def multiply(i, first, col, tile, col_start, width):
        """This warpgroup's share of item i: the pair's tile `tile` times weight columns
        [col_start, col_start + width) of the block; every step's slot released to the feeder."""

        def accumulate(acc):
            @pl.loop(0, k_steps)
            def _(kk):
                step = i * k_steps + kk
                slot = lax.rem(step, stages)
                plgpu.barrier_wait(loaded.at[slot])
                plgpu.wgmma(acc, x_smem.at[slot, pl.ds(tile * rows, rows)], w_smem.at[slot, :, pl.ds(col_start, width)])
                plgpu.wgmma_wait(1)  # the previous step's product is done with its slot

                @pl.when(kk > 0)
                def _():
                    plgpu.barrier_arrive(consumed.at[lax.rem(step - 1, stages)])

            result = acc[...].astype(out_smem.dtype)  # waits for the last product
            plgpu.barrier_arrive(consumed.at[lax.rem(i * k_steps + k_steps - 1, stages)])
            return result

        result = pl.run_scoped(accumulate, plgpu.ACC((rows, width), jnp.float32))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous item's stores have read out_smem
        half = bn // 2  # out_smem holds a warpgroup's result in column halves, each contiguous for TMA
        for h in range(width // half):
            out_smem[wg, h] = result[:, h * half:(h + 1) * half]
        plgpu.commit_smem()
        for h in range(width // half):
            plgpu.copy_smem_to_gmem(
                out_smem.at[wg, h], o_ref.at[pl.ds((first + tile) * rows, rows), pl.ds(col * bn + col_start + h * half, half)]
            )

    @pl.when(wg < 2)
    def _compute():
        # A pair: each warpgroup multiplies one tile by the whole block. A lone tile: each multiplies
        # it by half the block's columns, so the item takes about half a pair's time.
        @pl.loop(0, my_items)
        def _(i):
            _, first, count, col = item(i)

            @pl.when(count == 2)
            def _():
                multiply(i, first, col, wg, 0, bn)

            @pl.when(count == 1)
            def _():
                multiply(i, first, col, 0, wg * (bn // 2), bn // 2)

        plgpu.wait_smem_to_gmem(0)


def _grouped_matmul_kernel(x, weights, tile_experts, used_tiles, *, config: GemmConfig, interpret: bool, sms: int):
    bn, bk, stages = config.block_cols, config.block_k, config.stages
    swizzle = plgpu.find_swizzle(bk * 16)
    operand = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))
    out_swizzle = plgpu.find_swizzle(bn // 2 * 16)
    out_transforms = (plgpu.TilingTransform((8, out_swizzle // 2)), plgpu.SwizzleTransform(out_swizzle))
    pairs, used_pairs = _pair_table(tile_experts, used_tiles, weights.shape[0])
    kernel = plgpu.kernel(
        functools.partial(_gemm_kernel, config=config, sms=sms),
        out_type=jax.ShapeDtypeStruct((x.shape[0], weights.shape[2]), x.dtype),
        grid=(sms,),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        scratch_types=(
            plgpu.SMEM((stages, 2 * TILE_ROWS, bk), x.dtype, transforms=operand),
            plgpu.SMEM((stages, bk, bn), x.dtype, transforms=operand),
            plgpu.SMEM((2, 2, TILE_ROWS, bn // 2), x.dtype, transforms=out_transforms),  # [warpgroup, column half]
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # loaded: a pair's rows and the weight block
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # consumed: by both compute warpgroups
        ),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=(interpret if isinstance(interpret, plgpu.InterpretGPUParams) else plgpu.InterpretGPUParams())
        if interpret else None,
        kernel_name="moe_grouped_matmul",
    )
    return kernel(pairs, used_pairs, x, weights)


def grouped_matmul(
    x, weights, tile_experts, used_tiles, *, implementation=None, config: GemmConfig = GemmConfig(), interpret=False
):
    """x [T * tile_rows, K] rows in the tiled layout of `expert_tiles`, weights [G, K, N],
    tile_experts [T] int32, used_tiles [] int32 -> [T * tile_rows, N] in x.dtype (fp32 accumulation).

    Rows of tiles past `used_tiles` are not computed (zero from the reference, unwritten by the
    kernel). The kernel takes tile_rows = TILE_ROWS. `interpret`: True or `plgpu.InterpretGPUParams`
    runs the kernel in Pallas' interpreter.
    """
    _check(x, weights, tile_experts, used_tiles)
    if _pick(implementation, x.dtype, weights, config) == "reference":
        return grouped_matmul_reference(x, weights, tile_experts, used_tiles)
    if x.shape[0] != tile_experts.shape[0] * TILE_ROWS:
        raise ValueError(
            f"grouped_matmul: the kernel needs x of T * {TILE_ROWS} = {tile_experts.shape[0] * TILE_ROWS} rows, "
            f"got {x.shape[0]}"
        )
    # One CTA per SM; two in the interpreter, so that its CPU threads still share the items out.
    sms = 2 if interpret else getattr(jax.devices()[0], "core_count", None) or 132
    return _grouped_matmul_kernel(
        x, weights, tile_experts.astype(jnp.int32), used_tiles, config=config, interpret=interpret, sms=sms
    )
