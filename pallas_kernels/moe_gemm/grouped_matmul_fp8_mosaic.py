"""The MoE's grouped GEMM with block-scaled FP8 operands (W8A8) on Hopper in Pallas Mosaic GPU, over
the expert-tiled row layout of `api.expert_tiles`.

Rows come quantized in 1 x 128 groups (a scale per row and 128 columns of K), weights in 128 x 128
blocks, both e4m3 and K-major (wgmma takes 8-bit operands only K-major; the release stores weights
[out, in], which is K-major already). Each 128-wide slice of K is one wgmma into a fresh
accumulator, which is then scaled by its rows' scales times its weight block's scale and added to
the running sum in float32 registers: Hopper's FP8 wgmma accumulates with reduced precision, so no
product runs longer than one scale block (DeepGEMM's scheme).

A CTA computes a [block_rows, block_cols] output tile, one or two weight-scale blocks wide; its two
compute warpgroups split the rows (128-row tiles) or the columns (64-row tiles), each holding its
running sum a scale block at a time beside the fresh product of one scale block (at most 64 x 128).
A third warpgroup feeds them by TMA. The CTAs walk
their share of the (tile, column block) items an expert at a time, its column blocks in order and
its tiles fastest within each (`tiles_fastest`), so that the CTAs reading one column block of an
expert's weights run side by side and all but the first find it in L2 (walked column blocks
fastest, as the bf16 kernel does, an expert's tiles read its weights apart in time and about a
quarter of the weights come from DRAM twice: the kernel is bound by memory). With
`overlap_items` the feeding warpgroup runs on into the next item's first K slices while the compute
warpgroups finish and store the current one (a pipeline of pipelines: no fill and drain between
items). In clusters of two, the CTAs of a cluster take neighbouring column blocks of one tile and
its rows come to both by one TMA multicast: a quarter less traffic from L2 a step. With `pingpong` the
two compute warpgroups take turns issuing their products (a rendezvous after each issue, the second
warpgroup one turn behind), so that one's product runs on the tensor cores while the other scales
and adds its last one (the schedule of CUTLASS's ping-pong kernels).

With `rescale` the running sum stays in the wgmma accumulators for the whole of K, in units of the
current step's scale: before each product the accumulator is multiplied by the previous step's
scale over this one's (a zero scale, whose product is zero, keeps the previous unit), and the last
unit is applied at the store. That needs half the registers of promotion, so a warpgroup holds 64 x
256 (two scale blocks, each its own product) without spilling, but each addition of a product then
runs at the tensor cores' FP8 accumulation precision (on an H100: 1.6-2.8x promotion's error).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.block_fp8 import BLOCK
from pallas_kernels.common import ignore, warpgroup_kernel
from pallas_kernels.moe_gemm.grouped_matmul_mosaic import expert_item, expert_runs

_WGMMA = plgpu.Layout.WGMMA
_ROW = _WGMMA.reduce(1)
_OPERAND = (plgpu.TilingTransform((8, BLOCK)), plgpu.SwizzleTransform(BLOCK))  # a 128-byte row: one K slice


@dataclasses.dataclass(frozen=True)
class Fp8GemmConfig:
    """`block_rows` rows per tile (64 or 128); `block_cols` columns a CTA (128 or 256: one or two
    scale blocks); `stages` K slices in flight; `cluster` CTAs (1 or 2) sharing each tile's rows
    (N / block_cols must then be even); `overlap_items`: loads run on from one item into the next
    where K / 128 is a multiple of `stages` (or at most `stages`), else each item fills and drains
    its own pipeline; `pingpong`: the compute warpgroups issue their products in turn; `profile`:
    None or (ranges, directory), a trace of each call's scopes per warpgroup (`warpgroup_kernel`; the
    compute warpgroups' scopes: "scales" (loading a step's row and block scales), "issue" (the
    product; with `rescale` the products and their wait), "await" (its wait), "promote" (scale and
    add; with `rescale` the scales and the accumulators' rescaling), "store"). `rescale`: the running
    sum rescaled in the accumulators instead of promoted (module docstring). `tiles_fastest`: the items
    walk each expert's tiles fastest, column blocks next; else column blocks fastest (module
    docstring). K goes 128 a step: one
    scale block."""

    block_rows: int = 128
    block_cols: int = BLOCK
    stages: int = 4
    cluster: int = 1
    overlap_items: bool = True
    pingpong: bool = False
    rescale: bool = False
    tiles_fastest: bool = True
    profile: tuple[int, str] | None = None


def operand_pipeline(config, steps, body, context, state=None):
    """The warp-specialized pipeline of an item's K slices: rows [block_rows, 128] (multicast to a
    cluster), weights [block_cols, 128] and the rows' scales of one K block a step, `stages` in flight,
    fed by the third warpgroup to the two compute warpgroups running `body` in `context`."""
    bm, bn = config.block_rows, config.block_cols
    shared = ("cluster",) if config.cluster > 1 else ()  # the rows' copies are multicast to the cluster
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(steps,),
        memory_registers=40,
        in_specs=[
            plgpu.BlockSpec((bm, BLOCK), lambda kk: (0, kk), transforms=_OPERAND, memory_space=plgpu.SMEM,
                            collective_axes=shared),
            plgpu.BlockSpec((bn, BLOCK), lambda kk: (0, kk), transforms=_OPERAND, memory_space=plgpu.SMEM),
            plgpu.BlockSpec((None, bm), lambda kk: (kk, 0), memory_space=plgpu.SMEM, collective_axes=shared),
        ],
        wg_axis="wg",
        num_compute_wgs=2,
        max_concurrent_steps=config.stages,
        compute_context=context,
        pipeline_state=state,
    )


def walk_items(item, config, steps, sm, mine, ctas):
    """item(index, pipeline state) for this CTA's items sm, sm + ctas, ... (`mine` of them): with
    `overlap_items` (where K / 128 allows) one pipeline of pipelines, each item's loads running on into
    the next's; else each item its own pipeline."""
    if not (config.overlap_items and steps % min(config.stages, steps) == 0):
        pl.loop(0, mine)(lambda i: item(sm + i * ctas, None))
        return

    # One item alone needs both the prologue and the final drain: a pipeline by itself.
    pl.when(mine == 1)(lambda: item(sm, None))

    @pl.when(mine > 1)
    def _():
        @pl.loop(0, mine)
        def _(i):
            state = jnp.where(i == 0, plgpu.PipelinePipeline.START, plgpu.PipelinePipeline.STEADY)
            item(sm + i * ctas, jnp.where(i == mine - 1, plgpu.PipelinePipeline.STOP, state))


def _kernel(tile_experts_ref, runs_ref, used_ref, w_scales_ref, x_ref, x_scales_ref, w_ref, o_ref, *, config, ctas, interpret):
    bm, bn = config.block_rows, config.block_cols
    k, n = x_ref.shape[1], w_ref.shape[1]
    col_groups = n // bn // config.cluster  # items a tile: a column block for each CTA of a cluster
    steps = k // BLOCK
    split_rows = bm == 2 * 64  # else the warpgroups split the columns of a 64-row tile
    wg_m, wg_n = (64, bn) if split_rows else (bm, bn // 2)
    parts = max(wg_n // BLOCK, 1)  # a warpgroup's columns in scale blocks, each its own product
    part_n = wg_n // parts
    out_swizzle = plgpu.find_swizzle(wg_n * 16)
    out_transforms = (plgpu.TilingTransform((8, out_swizzle // 2)), plgpu.SwizzleTransform(out_swizzle))

    pipeline = functools.partial(operand_pipeline, config, steps)

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(ignore, ignore).get_allocations(x_ref, w_ref.at[0], x_scales_ref),
        out_smem=plgpu.SMEM((2, wg_m, wg_n), o_ref.dtype, transforms=out_transforms),
        turns=plgpu.Barrier(num_arrivals=2),
        collective_axes="wg",
    )
    def scope(allocations, out_smem, turns):
        wg = lax.axis_index("wg")

        def take_turns():  # both compute warpgroups meet: the one a turn ahead may issue again
            plgpu.barrier_arrive(turns)
            plgpu.barrier_wait(turns)

        wg_rows = pl.ds(wg * 64, 64) if split_rows else pl.ds(0, bm)
        wg_cols = pl.ds(0, bn) if split_rows else pl.ds(wg * wg_n, wg_n)
        # This CTA's items: sm, sm + ctas, ... below the used tiles' count.
        sm = lax.axis_index("sm")
        items = used_ref[0] * col_groups
        mine = jnp.maximum(items - sm + ctas - 1, 0) // ctas

        def item(index, state):
            if config.tiles_fastest:
                tile, col_group = expert_item(index, col_groups, runs_ref)
            else:
                tile, col_group = index // col_groups, index % col_groups
            col_block = col_group * config.cluster + lax.axis_index("cluster")
            expert = tile_experts_ref[tile]
            rows = pl.ds(tile * bm, bm)
            cols = pl.ds(col_block * bn, bn)

            def weight_scales(kk):  # each part's weight block scale at K step kk (from global memory)
                return tuple(w_scales_ref[expert, (col_block * bn + wg_cols.start + h * part_n) // BLOCK, kk]
                             for h in range(parts))

            zeros = plgpu.layout_cast(jnp.zeros((wg_m, part_n), jnp.float32), _WGMMA)

            def context(run_pipeline):
                if config.pingpong:  # turns balanced within an item (pipelines may sync the warpgroups)
                    pl.when(wg == 1)(take_turns)  # the second warpgroup starts a turn behind ...
                # The carry holds the sums and the next step's weight scales, loaded a step ahead.
                if config.rescale:  # the sums, each in its rows' unit, and the units applied at the end
                    ones = plgpu.layout_cast(jnp.ones((wg_m,), jnp.float32), _ROW)
                    (accs, units), _ = run_pipeline((((zeros,) * parts, (ones,) * parts), weight_scales(0)))
                    accs = [acc * lax.broadcast_in_dim(unit, acc.shape, [0]) for acc, unit in zip(accs, units)]
                else:
                    accs, _ = run_pipeline(((zeros,) * parts, weight_scales(0)))
                if config.pingpong:
                    pl.when(wg == 0)(take_turns)  # ... and the first ends with the turn it is owed
                with jax.named_scope("store"):
                    # The previous tile's store from this buffer must be done reading it.
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    for h, acc in enumerate(accs):
                        out_smem.at[wg, :, pl.ds(h * part_n, part_n)][...] = acc.astype(out_smem.dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(
                        out_smem.at[wg],
                        o_ref.at[pl.ds(tile * bm + wg_rows.start, wg_m), pl.ds(col_block * bn + wg_cols.start, wg_n)],
                    )

            def step_scales(kk, x_scales_smem, w_scales):
                """Each part's scales at step kk (rows' times the weight block's) and the weight scales of
                step kk + 1 (a load whose latency the step hides)."""
                with jax.named_scope("scales"):
                    w_next = weight_scales(jnp.minimum(kk + 1, steps - 1))
                    row_scales = plgpu.load(x_scales_smem.at[wg_rows], layout=_ROW, optimized=False)
                    return [row_scales * w for w in w_scales], w_next

            def rescale_and_multiply(indices, x_smem, w_smem, x_scales_smem, carry):
                (accs, units), w_scales = carry
                step, w_next = step_scales(*indices, x_scales_smem, w_scales)
                with jax.named_scope("promote"):
                    scales = [jnp.where(scale == 0, unit, scale)  # a zero scale's product is zero
                              for scale, unit in zip(step, units)]
                    rescaled = [acc * lax.broadcast_in_dim(unit / scale, acc.shape, [0])
                                for acc, unit, scale in zip(accs, units, scales)]

                def products(acc_refs):
                    for h, acc_ref in enumerate(acc_refs):
                        part_cols = pl.ds(wg_cols.start + h * part_n, part_n)
                        plgpu.wgmma(acc_ref, x_smem.at[wg_rows], w_smem.at[part_cols].transpose((1, 0)))
                    if config.pingpong:
                        take_turns()

                with jax.named_scope("issue"):  # and await: run_state waits for its products
                    if interpret:  # Pallas' GPU interpreter has no run_state: the same sums, added after
                        fresh = pl.run_scoped(lambda *refs: (products(refs), [ref[...] for ref in refs])[1],
                                              *[plgpu.ACC((wg_m, part_n), jnp.float32)] * parts)
                        accs = tuple(acc + part for acc, part in zip(rescaled, fresh))
                    else:
                        accs = pl.run_state(products)(tuple(plgpu.ACC.init(acc) for acc in rescaled))
                plgpu.commit_smem()
                return (accs, tuple(scales)), w_next

            def multiply(indices, x_smem, w_smem, x_scales_smem, carry):
                accs, w_scales = carry
                scales, w_next = step_scales(*indices, x_scales_smem, w_scales)
                summed = []
                for h, acc in enumerate(accs):
                    part_cols = pl.ds(wg_cols.start + h * part_n, part_n)

                    def product(part_ref, part_cols=part_cols):
                        with jax.named_scope("issue"):
                            plgpu.wgmma(part_ref, x_smem.at[wg_rows], w_smem.at[part_cols].transpose((1, 0)))
                        if config.pingpong:
                            take_turns()
                        with jax.named_scope("await"):
                            return part_ref[...]

                    part = pl.run_scoped(product, plgpu.ACC((wg_m, part_n), jnp.float32))
                    with jax.named_scope("promote"):
                        summed.append(acc + part * lax.broadcast_in_dim(scales[h], part.shape, [0]))
                # The reads (generic proxy) ordered before the slot's refill by TMA (async proxy).
                plgpu.commit_smem()
                return tuple(summed), w_next

            pipeline(rescale_and_multiply if config.rescale else multiply, context, state)(
                x_ref.at[rows, :], w_ref.at[expert].at[cols, :], x_scales_ref.at[:, rows], allocations=allocations
            )

        walk_items(item, config, steps, sm, mine, ctas)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def grouped_matmul_fp8_kernel(x, x_scales_t, weights, weight_scales, tile_experts, used_tiles, *, config, interpret, sms):
    """x [T * block_rows, K] fp8, x_scales_t [K / 128, T * block_rows] fp32 (scales K-block major: a
    step's row scales are one TMA row), weights [G, N, K] fp8, weight_scales [G, N / 128, K / 128]
    fp32 -> [T * block_rows, N] bf16."""
    kernel = warpgroup_kernel(
        functools.partial(_kernel, config=config, ctas=sms // config.cluster, interpret=bool(interpret)),
        jax.ShapeDtypeStruct((x.shape[0], weights.shape[1]), jnp.bfloat16),
        name="moe_grouped_matmul_fp8", ctas=sms // config.cluster, interpret=interpret, cluster=config.cluster,
        profile=config.profile,
    )
    used_tiles = jnp.reshape(used_tiles, (1,)).astype(jnp.int32)
    return kernel(tile_experts, expert_runs(tile_experts, used_tiles[0]), used_tiles, weight_scales, x, x_scales_t, weights)
