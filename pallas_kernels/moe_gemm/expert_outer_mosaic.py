"""The grouped GEMM's weight gradient on Hopper in Pallas Mosaic GPU: for each expert, the sum over
its rows of x_row (outer) y_row, x [T * block_rows, K] and y [T * block_rows, N] in the expert-tiled
row layout of `api.expert_tiles` -> [G, K, N].

An expert's tiles are consecutive, so each output block (expert, 128 rows of K, block_cols columns of
N) is one pipeline over that expert's tiles: a step loads a tile's rows of x and y by TMA and one
wgmma adds x_tile^T y_tile (x handed over transposed: the rows are the reduction) into fp32
registers, the two compute warpgroups taking 64 rows of K each. The CTAs walk the (expert, K block,
N block) items N blocks fastest, so the SMs at work at one time read one expert's tiles from L2.
An expert with no rows gets zeros. The sums run over every row of the expert's tiles: padding rows
contribute whatever x and y hold there (zeros where the layout was filled from zeros).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import ignore, warpgroup_kernel

BLOCK_K = 128  # rows of the output a CTA: 64 a compute warpgroup


@dataclasses.dataclass(frozen=True)
class OuterConfig:
    """`block_rows` the layout's tile (the reduction a step), `block_cols` columns of N a CTA,
    `stages` tiles in flight."""

    block_rows: int = 128
    block_cols: int = 128
    stages: int = 2


def _outer_kernel(first_tile_ref, tile_count_ref, x_ref, y_ref, o_ref, *, config: OuterConfig):
    bm, bn = config.block_rows, config.block_cols
    experts, k, n = o_ref.shape
    k_blocks, n_blocks = k // BLOCK_K, n // bn

    def transforms(cols):
        swizzle = plgpu.find_swizzle(cols * 16)
        return plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle)

    def pipeline(body, context, steps, first=0):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(steps,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((bm, BLOCK_K), lambda s: (first + s, 0), transforms=transforms(BLOCK_K),
                                memory_space=plgpu.SMEM),
                plgpu.BlockSpec((bm, bn), lambda s: (first + s, 0), transforms=transforms(bn), memory_space=plgpu.SMEM),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=config.stages,
            compute_context=context,
        )

    out_transforms = transforms(bn)

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(ignore, ignore, config.stages).get_allocations(x_ref, y_ref),
        out_smem=plgpu.SMEM((2, BLOCK_K // 2, bn), o_ref.dtype, transforms=out_transforms),
        collective_axes="wg",
    )
    def scope(allocations, out_smem):
        wg = lax.axis_index("wg")
        own = pl.ds(wg * (BLOCK_K // 2), BLOCK_K // 2)

        @plgpu.nd_loop((experts * k_blocks * n_blocks,), collective_axes="sm")
        def item_loop(info):
            (index,) = info.index
            expert, rest = index // (k_blocks * n_blocks), index % (k_blocks * n_blocks)
            k_block, n_block = rest // n_blocks, rest % n_blocks
            first, count = first_tile_ref[expert], tile_count_ref[expert]
            k_rows = pl.ds(k_block * BLOCK_K, BLOCK_K)
            n_cols = pl.ds(n_block * bn, bn)

            def store(acc):
                with jax.named_scope("store"):
                    # The previous item's store from this buffer must be done reading it.
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    out_smem[wg] = acc.astype(out_smem.dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(
                        out_smem.at[wg], o_ref.at[expert, pl.ds(k_block * BLOCK_K + wg * (BLOCK_K // 2), BLOCK_K // 2), n_cols]
                    )

            @pl.when((count == 0) & (wg < 2))  # the compute warpgroups' stores; the third has none
            def _():
                store(plgpu.layout_cast(jnp.zeros((BLOCK_K // 2, bn), jnp.float32), plgpu.Layout.WGMMA))

            @pl.when(count > 0)
            def _():
                def context(run_pipeline):
                    @functools.partial(pl.run_scoped, acc=plgpu.ACC((BLOCK_K // 2, bn), jnp.float32))
                    def _(acc):
                        run_pipeline(acc)
                        store(acc[...])

                def multiply(_, x_smem, y_smem, acc):
                    with jax.named_scope("multiply"):
                        plgpu.wgmma(acc, x_smem.at[:, own].transpose((1, 0)), y_smem)
                        plgpu.wgmma_wait(0)
                    return acc

                pipeline(multiply, context, count, first)(
                    x_ref.at[:, k_rows], y_ref.at[:, n_cols], allocations=allocations
                )

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def expert_outer_kernel(x, y, first_tile, tile_count, *, experts: int, config: OuterConfig, interpret, sms: int):
    """x [T * block_rows, K], y [T * block_rows, N], first_tile and tile_count [G] int32 (each expert's
    used tiles) -> [G, K, N] in y.dtype."""
    kernel = warpgroup_kernel(
        functools.partial(_outer_kernel, config=config),
        jax.ShapeDtypeStruct((experts, x.shape[1], y.shape[1]), y.dtype),
        name="moe_expert_outer", ctas=sms, interpret=interpret,
    )
    return kernel(first_tile, tile_count, x, y)
