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

from bench.common import dispatched_ms, log
from bench.fp8_trace import GemmCase, parse_config
from bench.moe import GEMMS
from pallas_kernels import moe_gemm
from pallas_kernels.block_fp8 import BLOCK
from pallas_kernels.common import ignore, sm_count, warpgroup_kernel
from pallas_kernels.moe_gemm.grouped_matmul_fp8_mosaic import operand_pipeline, walk_items


def _stream_kernel(used_ref, x_ref, x_scales_ref, w_ref, o_ref, *, config, ctas):
    """The GEMM kernel's walk and loads (its `operand_pipeline` and `walk_items`, weights of expert 0:
    the same bytes a tile) with bodies that only release each slot."""
    bm, bn = config.block_rows, config.block_cols
    k, n = x_ref.shape[1], w_ref.shape[1]
    col_groups = n // bn // config.cluster
    steps = k // BLOCK
    pipeline = functools.partial(operand_pipeline, config, steps)

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

            def release(indices, x_smem, w_smem, x_scales_smem, carry):
                return carry

            pipeline(release, lambda run_pipeline: run_pipeline(()), state)(
                x_ref.at[pl.ds(tile * bm, bm), :], w_ref.at[0].at[pl.ds(col_block * bn, bn), :],
                x_scales_ref.at[:, pl.ds(tile * bm, bm)], allocations=allocations,
            )

        walk_items(item, config, steps, sm, mine, ctas)

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
    case = GemmCase(args.gemm, args.tokens)
    k, n, w, w_s = case.k, case.n, case.w, case.w_s
    sms = sm_count()
    log(f"{jax.devices()[0].device_kind}; {args.gemm} K={k} N={n}, {args.tokens} tokens ({case.rows} rows)")
    log("\n| config | GEMM ms | stream alone ms | stream / GEMM | delivered GB | delivered TB/s (alone) | "
        "read from L2 GB |")
    log("|" + " --- |" * 7)
    for text in args.configs.split(","):
        config = parse_config(text, case.default)
        x_tiled, s_tiled, tiles = case.tiled(config)
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
