"""Grouped GEMM of the MoE: each expert's rows times that expert's weight, on Hopper in Pallas Mosaic GPU.

The rows travel in a tiled layout: sorted by expert, each expert's rows starting a new tile of
`block_rows`, so that every tile belongs to one expert and the kernel needs no masked stores. The
padding rows' outputs carry no meaning; `expert_tiles` says where each real row sits. With
`block_rows = 1` the layout is the packed one (no padding): what the reference runs on where no
kernel is used.

The kernel runs one CTA per SM, each walking its share of the (tile, column block) items, column
blocks fastest (the SMs at work at one time share a few tiles' rows and their experts' weight
columns in L2, so HBM sees each weight about once), and skipping tiles past the used ones. Per item,
two compute warpgroups split the columns and a third feeds them by TMA, pipelined over K
(`emit_pipeline_warp_specialized`). On the H200 this simple form was 2-6% faster than one pipeline
per SM across all its items over 64-row tiles in pairs (bench/RESULTS.md, twenty-third session).

Dispatch (`implementation`, `interpret`): as `pallas_kernels.common.pick_implementation` says, the
kernel for bf16 operands on a GPU (or in Pallas' interpreter with `interpret=True`), else the reference.
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import pick_implementation
from pallas_kernels.kda_chain import sm_count


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """The kernel's tiling: `block_rows` rows per tile (64 or 128: one or two wgmma row blocks),
    `block_cols` columns per CTA (split between the two compute warpgroups), `block_k` the pipelined
    slice of K, `stages` slices in flight."""

    block_rows: int = 128
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


def grouped_matmul_reference(x, weights, tile_experts, used_tiles):
    """x [T * block_rows, K] in the tiled layout, weights [G, K, N], tile_experts [T], used_tiles [] ->
    [T * block_rows, N] in x.dtype (fp32 accumulation); rows of unused tiles are zero."""
    block_rows = x.shape[0] // tile_experts.shape[0]
    used = (jnp.arange(tile_experts.shape[0]) < used_tiles).astype(jnp.int32)
    group_sizes = jnp.bincount(tile_experts, weights=used, length=weights.shape[0]).astype(jnp.int32) * block_rows
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


def _gemm_kernel(tile_experts_ref, used_ref, x_ref, w_ref, o_ref, *, config: GemmConfig, n_tiles: int):
    bm, bn, bk = config.block_rows, config.block_cols, config.block_k
    k, n = w_ref.shape[1:]
    col_blocks = n // bn
    wg_cols = bn // 2
    swizzle = plgpu.find_swizzle(bk * 16)
    operand = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))
    out_swizzle = plgpu.find_swizzle(wg_cols * 16)
    out_transforms = (plgpu.TilingTransform((8, out_swizzle // 2)), plgpu.SwizzleTransform(out_swizzle))

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k // bk,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((bm, bk), lambda kk: (0, kk), transforms=operand, memory_space=plgpu.SMEM),
                plgpu.BlockSpec((bk, bn), lambda kk: (kk, 0), transforms=operand, memory_space=plgpu.SMEM),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=config.stages,
            compute_context=context,
        )

    ignore = lambda *_, **__: None

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(ignore, ignore).get_allocations(x_ref, w_ref.at[0]),
        out_smem=plgpu.SMEM((2, bm, wg_cols), o_ref.dtype, transforms=out_transforms),
        collective_axes="wg",
    )
    def scope(allocations, out_smem):
        wg = lax.axis_index("wg")
        used_tiles = used_ref[0]

        @plgpu.nd_loop((n_tiles * col_blocks,), collective_axes="sm")
        def tile_loop(info):
            (index,) = info.index
            tile, col_block = index // col_blocks, index % col_blocks

            @pl.when(tile < used_tiles)
            def _():
                rows = pl.ds(tile * bm, bm)
                cols = pl.ds(col_block * bn, bn)

                def context(run_pipeline):
                    @functools.partial(pl.run_scoped, acc=plgpu.ACC((bm, wg_cols), jnp.float32))
                    def _(acc):
                        run_pipeline(acc)
                        # The previous tile's store from this buffer must be done reading it.
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        out_smem[wg] = acc[...].astype(out_smem.dtype)
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(
                            out_smem.at[wg], o_ref.at[rows, pl.ds(col_block * bn + wg * wg_cols, wg_cols)]
                        )

                def multiply(_, x_smem, w_smem, acc):
                    plgpu.wgmma(acc, x_smem, w_smem.at[:, pl.ds(wg * wg_cols, wg_cols)])
                    plgpu.wgmma_wait(0)
                    return acc

                pipeline(multiply, context)(
                    x_ref.at[rows, :], w_ref.at[tile_experts_ref[tile]].at[:, cols], allocations=allocations
                )

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _grouped_matmul_kernel(x, weights, tile_experts, used_tiles, *, config: GemmConfig, interpret: bool, sms: int):
    n_tiles = tile_experts.shape[0]
    kernel = plgpu.kernel(
        functools.partial(_gemm_kernel, config=config, n_tiles=n_tiles),
        out_type=jax.ShapeDtypeStruct((x.shape[0], weights.shape[2]), x.dtype),
        grid=(sms,),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=(interpret if isinstance(interpret, plgpu.InterpretGPUParams) else plgpu.InterpretGPUParams())
        if interpret else None,
        kernel_name="moe_grouped_matmul",
    )
    return kernel(tile_experts, jnp.reshape(used_tiles, (1,)).astype(jnp.int32), x, weights)


def grouped_matmul(
    x, weights, tile_experts, used_tiles, *, implementation=None, config: GemmConfig = GemmConfig(), interpret=False
):
    """x [T * block_rows, K] rows in the tiled layout of `expert_tiles`, weights [G, K, N],
    tile_experts [T] int32, used_tiles [] int32 -> [T * block_rows, N] in x.dtype (fp32 accumulation).

    Rows of tiles past `used_tiles` are not computed (zero from the reference, unwritten by the kernel).
    The kernel needs block_rows == config.block_rows. `interpret`: True or `plgpu.InterpretGPUParams`
    runs the kernel in Pallas' interpreter.
    """
    _check(x, weights, tile_experts, used_tiles)
    impl = pick_implementation(implementation, _kernel_unsupported(x.dtype, weights, config), x.dtype, interpret=interpret)
    if impl == "reference":
        return grouped_matmul_reference(x, weights, tile_experts, used_tiles)
    if x.shape[0] != tile_experts.shape[0] * config.block_rows:
        raise ValueError(
            f"grouped_matmul: x must have T * block_rows = {tile_experts.shape[0]} * {config.block_rows} rows, got {x.shape[0]}"
        )
    # One CTA per SM; two in the interpreter, so that its CPU threads still share the tiles out.
    sms = 2 if interpret else sm_count()
    return _grouped_matmul_kernel(
        x, weights, tile_experts.astype(jnp.int32), used_tiles, config=config, interpret=interpret, sms=sms
    )
