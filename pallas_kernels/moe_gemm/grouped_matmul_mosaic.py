"""The MoE's grouped GEMM on Hopper in Pallas Mosaic GPU, over the expert-tiled row layout of
`api.expert_tiles` (every tile one expert's rows).

The kernel runs one CTA per SM, each walking its share of the (tile, column block) items, column
blocks fastest, or with `tiles_fastest` an expert at a time, its column blocks in order and its
tiles fastest within each (`expert_item`: the CTAs reading one column block of the expert's weights
run side by side; the FP8 kernel's default, where ncu showed column blocks fastest reading about a
quarter of the weights twice from DRAM), and skipping tiles past the used ones. Per item,
two compute warpgroups split the columns and a third feeds them by TMA, pipelined over K
(`emit_pipeline_warp_specialized`). On the H200 this simple form is 2-6% faster than one pipeline
per SM across all its items over 64-row tiles in pairs (bench/RESULTS.md). With `transposed` the
weights come as [G, N, K] (K-major): the backward's rows times the forward's weights transposed,
read in place, the K-major weight block handed to wgmma as its transpose.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import ignore, warpgroup_kernel


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """The kernel's tiling: `block_rows` rows per tile (64 or 128: one or two wgmma row blocks),
    `block_cols` columns per CTA (split between the two compute warpgroups), `block_k` the pipelined
    slice of K, `stages` slices in flight; `tiles_fastest`: the items walk each expert's tiles
    fastest, column blocks next (module docstring)."""

    block_rows: int = 128
    block_cols: int = 256
    block_k: int = 64
    stages: int = 3
    tiles_fastest: bool = False


def expert_runs(tile_experts, used_tiles):
    """[2, T] int32: each tile's expert's first tile and its number of tiles below `used_tiles`
    (`tile_experts` is sorted: an expert's tiles are one run)."""
    tiles = jnp.arange(tile_experts.shape[0], dtype=jnp.int32)
    changes = tile_experts[1:] != tile_experts[:-1]
    first = lax.cummax(jnp.where(jnp.concatenate([jnp.ones((1,), bool), changes]), tiles, 0))
    last = lax.cummin(jnp.where(jnp.concatenate([changes, jnp.ones((1,), bool)]), tiles, tiles[-1]), reverse=True)
    return jnp.stack([first, jnp.minimum(last + 1, used_tiles) - first])


def expert_item(index, col_blocks, runs_ref):
    """(tile, column block) of item `index` below the used tiles' items, walked an expert at a time:
    its items hold the indices that column blocks fastest gives them, its tiles fastest within each
    column block. runs_ref: `expert_runs`."""
    tile = index // col_blocks
    first, count = runs_ref[0, tile], runs_ref[1, tile]
    local = index - first * col_blocks
    return first + lax.rem(local, count), lax.div(local, count)  # both non-negative


def _gemm_kernel(tile_experts_ref, *refs, config: GemmConfig, n_tiles: int, transposed):
    # `expert_runs` comes only where the items walk an expert's tiles fastest.
    runs_ref, used_ref, x_ref, w_ref, o_ref = refs if config.tiles_fastest else (None, *refs)
    bm, bn, bk = config.block_rows, config.block_cols, config.block_k
    n, k = w_ref.shape[1:] if transposed else w_ref.shape[1:][::-1]
    w_block, w_index = ((bn, bk), lambda kk: (0, kk)) if transposed else ((bk, bn), lambda kk: (kk, 0))
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
                plgpu.BlockSpec(w_block, w_index, transforms=operand, memory_space=plgpu.SMEM),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=config.stages,
            compute_context=context,
        )

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

            @pl.when(index < used_tiles * col_blocks)
            def _():
                if config.tiles_fastest:
                    tile, col_block = expert_item(index, col_blocks, runs_ref)
                else:
                    tile, col_block = index // col_blocks, index % col_blocks
                rows = pl.ds(tile * bm, bm)
                cols = pl.ds(col_block * bn, bn)

                def context(run_pipeline):
                    @functools.partial(pl.run_scoped, acc=plgpu.ACC((bm, wg_cols), jnp.float32))
                    def _(acc):
                        run_pipeline(acc)
                        with jax.named_scope("store"):
                            # The previous tile's store from this buffer must be done reading it.
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                            out_smem[wg] = acc[...].astype(out_smem.dtype)
                            plgpu.commit_smem()
                            plgpu.copy_smem_to_gmem(
                                out_smem.at[wg], o_ref.at[rows, pl.ds(col_block * bn + wg * wg_cols, wg_cols)]
                            )

                def multiply(_, x_smem, w_smem, acc):
                    own = pl.ds(wg * wg_cols, wg_cols)
                    with jax.named_scope("multiply"):
                        plgpu.wgmma(acc, x_smem, w_smem.at[own].transpose((1, 0)) if transposed else w_smem.at[:, own])
                        plgpu.wgmma_wait(0)
                    return acc

                expert_w = w_ref.at[tile_experts_ref[tile]]
                pipeline(multiply, context)(
                    x_ref.at[rows, :], expert_w.at[cols, :] if transposed else expert_w.at[:, cols],
                    allocations=allocations,
                )

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def grouped_matmul_kernel(
    x, weights, tile_experts, used_tiles, *, config: GemmConfig, interpret: bool, sms: int, transposed: bool = False
):
    """x [T * block_rows, K], weights [G, K, N] (or [G, N, K] `transposed`) -> [T * block_rows, N]."""
    n_tiles = tile_experts.shape[0]
    kernel = warpgroup_kernel(
        functools.partial(_gemm_kernel, config=config, n_tiles=n_tiles, transposed=transposed),
        jax.ShapeDtypeStruct((x.shape[0], weights.shape[1 if transposed else 2]), x.dtype),
        name="moe_grouped_matmul", ctas=sms, interpret=interpret,
    )
    used_tiles = jnp.reshape(used_tiles, (1,)).astype(jnp.int32)
    runs = [expert_runs(tile_experts, used_tiles[0])] if config.tiles_fastest else []
    return kernel(tile_experts, *runs, used_tiles, x, weights)
