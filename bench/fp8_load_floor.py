"""The FP8 grouped GEMM's operand stream alone: for each tiling, the time of a kernel that walks the
same (tile, column block) items, loads the same K slices by TMA through the same warp-specialized
pipeline (stages, clusters' multicast of rows, items' loads running on) and multiplies nothing,
beside the GEMM itself at that tiling. If the stream alone takes about the GEMM's time, the loads
bound the kernel and only fewer bytes a product (wider tiles, multicast) can speed it; if it takes
far less, the compute warpgroups' schedule does.

    python -m bench.fp8_load_floor [--tokens 8192] [--gemm gate_up]
        [--configs default,cluster=2,block_cols=256+stages=3,block_cols=256+stages=3+cluster=2]

Printed a config: both times, the bytes the stream delivers to the SMs (each CTA's operands and row
scales) and at what rate, and the bytes read from L2 (rows multicast to a cluster read once).
Nothing goes to bench/results.jsonl: a bound of one kernel's design, not an op's time.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from bench.common import dispatched_ms, log
from bench.fp8_trace import parse_config
from bench.moe import GEMMS, fp8_operands, routed_rows
from pallas_kernels import block_fp8, moe_gemm
from pallas_kernels.block_fp8 import BLOCK
from pallas_kernels.common import ignore, sm_count, warpgroup_kernel

_OPERAND = (plgpu.TilingTransform((8, BLOCK)), plgpu.SwizzleTransform(BLOCK))


def _stream_kernel(used_ref, x_ref, x_scales_ref, w_ref, o_ref, *, config, ctas):
    """The GEMM kernel's walk and loads (its `_kernel`, weights of expert 0: the same bytes a tile)
    with bodies that only release each slot."""
    bm, bn = config.block_rows, config.block_cols
    k, n = x_ref.shape[1], w_ref.shape[1]
    col_groups = n // bn // config.cluster
    steps = k // BLOCK
    shared = ("cluster",) if config.cluster > 1 else ()

    def pipeline(body, context, state=None):
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

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(ignore, ignore).get_allocations(x_ref, w_ref.at[0], x_scales_ref),
        collective_axes="wg",
    )
    def scope(allocations):
        sm = lax.axis_index("sm")
        items = used_ref[0] * col_groups
        mine = jnp.maximum(items - sm + ctas - 1, 0) // ctas

        def item(index, state):
            tile, col_group = index // col_groups, index % col_groups
            col_block = col_group * config.cluster + lax.axis_index("cluster")

            def context(run_pipeline):
                run_pipeline(())

            def release(indices, x_smem, w_smem, x_scales_smem, carry):
                return carry

            pipeline(release, context, state)(
                x_ref.at[pl.ds(tile * bm, bm), :], w_ref.at[0].at[pl.ds(col_block * bn, bn), :],
                x_scales_ref.at[:, pl.ds(tile * bm, bm)], allocations=allocations,
            )

        if not (config.overlap_items and steps % min(config.stages, steps) == 0):  # as the GEMM decides
            pl.loop(0, mine)(lambda i: item(sm + i * ctas, None))
            return

        pl.when(mine == 1)(lambda: item(sm, None))

        @pl.when(mine > 1)
        def _():
            @pl.loop(0, mine)
            def _(i):
                state = jnp.where(i == 0, plgpu.PipelinePipeline.START, plgpu.PipelinePipeline.STEADY)
                item(sm + i * ctas, jnp.where(i == mine - 1, plgpu.PipelinePipeline.STOP, state))

    del o_ref  # nothing is written: the stream is what is timed


def stream(x, x_scales_t, weights, used_tiles, *, config, sms):
    ctas = sms // config.cluster
    kernel = warpgroup_kernel(
        functools.partial(_stream_kernel, config=config, ctas=ctas),
        jax.ShapeDtypeStruct((8, 128), jnp.float32), name="fp8_operand_stream", ctas=ctas, interpret=False,
        cluster=config.cluster,
    )
    return kernel(jnp.reshape(used_tiles, (1,)).astype(jnp.int32), x, x_scales_t, weights)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--gemm", default="gate_up", choices=sorted(GEMMS))
    parser.add_argument("--configs", default="default,cluster=2,block_cols=256+stages=3,"
                                             "block_cols=256+stages=3+cluster=2")
    args = parser.parse_args()
    k, n = GEMMS[args.gemm]
    key = jax.random.key(2)
    w, w_s = fp8_operands(k, n, jax.random.fold_in(key, k))
    sizes = routed_rows(args.tokens)
    rows = int(sizes.sum())
    x = jax.random.normal(jax.random.fold_in(key, args.tokens), (rows, k), jnp.bfloat16)
    x_q, x_s = jax.jit(block_fp8.quantize_rows)(x)
    _, default = moe_gemm.plan_fp8(None, (w,), rows=rows)
    sms = sm_count()
    log(f"{jax.devices()[0].device_kind}; {args.gemm} K={k} N={n}, {args.tokens} tokens ({rows} rows)")
    log("\n| config | GEMM ms | stream alone ms | stream / GEMM | delivered GB | delivered TB/s (alone) | "
        "read from L2 GB |")
    log("|" + " --- |" * 7)
    for text in args.configs.split(","):
        config = parse_config(text, default)
        tiles = moe_gemm.expert_tiles(jnp.asarray(sizes), rows, config.block_rows)
        m = tiles.tile_experts.shape[0] * config.block_rows
        x_tiled = jnp.zeros((m, k), x_q.dtype).at[tiles.slots].set(x_q)
        s_tiled = jnp.ones((m, k // BLOCK), jnp.float32).at[tiles.slots].set(x_s)
        gemm = jax.jit(lambda *a, c=config: moe_gemm.grouped_matmul_fp8(*a, implementation="pallas", config=c))
        alone = jax.jit(lambda a, s, b, u, c=config: stream(a, s.T, b, u, config=c, sms=sms))
        try:
            alone_ms = dispatched_ms(alone, x_tiled, s_tiled, w, tiles.used_tiles)
        except Exception as e:  # a config that does not fit in shared memory, say
            log(f"| {text} | failed: {type(e).__name__}: {str(e)[:300]} |")
            continue
        try:
            gemm_ms = dispatched_ms(gemm, x_tiled, s_tiled, w, w_s, tiles.tile_experts, tiles.used_tiles)
        except Exception as e:  # the GEMM's accumulators and output buffers take room the stream does not
            log(f"| {text} | GEMM failed: {type(e).__name__}: {str(e)[:200]} |")
            gemm_ms = float("nan")
        used = int(tiles.used_tiles)
        a_step = (config.block_rows * BLOCK, config.block_cols * BLOCK, 4 * config.block_rows)  # x, w, scales
        steps = used * (n // config.block_cols) * (k // BLOCK)
        delivered = steps * sum(a_step)
        from_l2 = steps * (a_step[1] + (a_step[0] + a_step[2]) / config.cluster)
        log(f"| {text} | {gemm_ms:.3f} | {alone_ms:.3f} | {alone_ms / gemm_ms:.2f} | {delivered / 1e9:.2f} | "
            f"{delivered / alone_ms / 1e9:.2f} | {from_l2 / 1e9:.2f} |")


if __name__ == "__main__":
    main()
