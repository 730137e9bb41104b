"""Training's kernels on the GPU. Today: the MoE grouped GEMM's backward at GLM-5.3's shapes (288
experts, 8 a token; gate_up K = 4096, N = 4096 and down K = 2048, N = 4096), its two products
apart:
- d_lhs, the rows' gradient d_out W^T: ours (`moe_gemm.grouped_matmul(..., transposed=True)`, the
  forward kernel reading W [G, K, N] as its transpose in place), jla's ragged_dot backward in the
  rows alone, JAX's `ragged_dot_mgpu` on W transposed beforehand (the transpose not timed), XLA's
  `lax.ragged_dot` (1024 tokens and fewer);
- d_rhs, the weights' gradient x^T d_out per expert: ours (`moe_gemm.expert_outer_products`), jla's
  `transposed_ragged_dot`, XLA's ragged dot transposed (1024 tokens and fewer).

    python -m bench.train [--tokens 1024,8192] [--no-peers] [--results bench/results.jsonl]

Rows: op `moe_gemm_bwd`, shape `d_lhs <gemm> K=.. N=.., <tokens> tokens` and `d_rhs ...`; the
roofline is max(FLOPs / `common.MATMUL`, bytes / `common.HBM`), d_lhs's bytes the used experts'
weights and the rows in and out, d_rhs's every expert's gradient written (zeros for the unused)
and the rows read. Errors: max|d| / max|ref| against fp32 products over 8 sampled experts. jla comes
as a wheel (see bench/moe.py).
"""

import argparse
import functools
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import HBM, MATMUL, Results, add_results_argument, dispatched_ms, log
from bench.moe import EXPERTS, GEMMS, routed_rows
from pallas_kernels import moe_gemm


def sampled_error(got_of_expert, want_of_expert, sizes, rng):
    worst = 0.0
    for g in rng.choice(np.flatnonzero(sizes), size=min(8, np.count_nonzero(sizes)), replace=False):
        want = np.asarray(want_of_expert(g))
        worst = max(worst, float(np.abs(np.asarray(got_of_expert(g), np.float32) - want).max() / np.abs(want).max()))
    return worst


def bench_gemm_backward(token_counts, skip_peers, results):
    log("| tokens | product | implementation | ms | TFLOP/s | x roofline | error |")
    log("| --- | --- | --- | --- | --- | --- | --- |")
    key = jax.random.key(3)
    for name, (k, n) in GEMMS.items():
        w = (jax.random.normal(jax.random.fold_in(key, k), (EXPERTS, k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
        w_t = None
        for tokens in token_counts:
            sizes = routed_rows(tokens)
            rows, used = int(sizes.sum()), int(np.count_nonzero(sizes))
            starts = np.cumsum(sizes) - sizes
            x = jax.random.normal(jax.random.fold_in(key, tokens), (rows, k), jnp.bfloat16)
            d_out = jax.random.normal(jax.random.fold_in(key, tokens + 1), (rows, n), jnp.bfloat16)
            group = lambda a, g: a[int(starts[g]):int(starts[g] + sizes[g])].astype(jnp.float32)  # noqa: E731
            implementation, config = moe_gemm.plan(None, x, (w,), rows=rows)
            tiles = moe_gemm.expert_tiles(jnp.asarray(sizes), rows, config.block_rows)
            m = tiles.tile_experts.shape[0] * config.block_rows
            x_tiled = jnp.zeros((m, k), x.dtype).at[tiles.slots].set(x)
            d_tiled = jnp.zeros((m, n), x.dtype).at[tiles.slots].set(d_out)
            d_lhs_config = moe_gemm.GemmConfig(config.block_rows, 256 if k % 256 == 0 else 128, 64, config.stages)
            s = jnp.asarray(sizes)
            flops = 2 * rows * k * n
            products = {
                "d_lhs": dict(
                    roofline=max(flops / MATMUL, (used * k * n * 2 + rows * (k + n) * 2) / HBM) * 1e3,
                    want=lambda g: jnp.dot(group(d_out, g), w[g].astype(jnp.float32).T, precision="highest"),
                    runs={f"ours ({implementation}, weights read transposed in place)": (
                        functools.partial(jax.jit(functools.partial(
                            moe_gemm.grouped_matmul, implementation=implementation, config=d_lhs_config,
                            transposed=True)), d_tiled, w, tiles.tile_experts, tiles.used_tiles),
                        lambda out, g: group(out[tiles.slots], g))},
                ),
                "d_rhs": dict(
                    roofline=max(flops / MATMUL, (EXPERTS * k * n * 2 + rows * (k + n) * 2) / HBM) * 1e3,
                    want=lambda g: jnp.dot(group(x, g).T, group(d_out, g), precision="highest"),
                    runs={"ours (expert_outer_products)": (
                        functools.partial(jax.jit(functools.partial(
                            moe_gemm.expert_outer_products, experts=EXPERTS,
                            config=moe_gemm.OuterConfig(block_rows=config.block_rows))),
                            x_tiled, d_tiled, tiles.tile_experts, tiles.used_tiles),
                        lambda out, g: out[g])},
                ),
            }
            if not skip_peers:
                try:
                    from jla.ops.mosaic_gpu import ragged_dot as jla_rd

                    f = jax.jit(lambda x, w, d, s: jax.vjp(lambda x: jla_rd.ragged_dot(x, w, s), x)[1](d)[0])
                    products["d_lhs"]["runs"]["jla ragged_dot backward, rows alone"] = (
                        functools.partial(f, x, w, d_out, s), lambda out, g: group(out, g))
                    f = jax.jit(jla_rd.transposed_ragged_dot)
                    products["d_rhs"]["runs"]["jla transposed_ragged_dot"] = (
                        functools.partial(f, x, d_out, s), lambda out, g: out[g])
                except Exception:
                    traceback.print_exc()
                from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

                if w_t is None:
                    w_t = jax.block_until_ready(jnp.swapaxes(w, 1, 2))
                f = jax.jit(lambda d, w_t, s: ragged_dot_mgpu.ragged_dot(
                    d, w_t, group_sizes=s, block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=2))
                products["d_lhs"]["runs"]["jax ragged_dot_mgpu on W transposed beforehand"] = (
                    functools.partial(f, d_out, w_t, s), lambda out, g: group(out, g))
                if tokens <= 1024:
                    f = jax.jit(lambda x, w, d, s: jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, s), x, w)[1](d))
                    products["d_lhs"]["runs"]["xla lax.ragged_dot transposed"] = (
                        functools.partial(f, x, w, d_out, s), lambda out, g: group(out[0], g))
                    products["d_rhs"]["runs"]["xla lax.ragged_dot transposed (both products)"] = (
                        functools.partial(f, x, w, d_out, s), lambda out, g: out[1][g])
            for product, spec in products.items():
                timed = {}
                for label, (call, pick) in spec["runs"].items():
                    try:
                        out = jax.block_until_ready(call())
                        err = sampled_error(functools.partial(pick, out), spec["want"], sizes, np.random.default_rng(1))
                        del out
                        ms = dispatched_ms(call)
                        timed[label] = (ms, err)
                        log(f"| {tokens} | {product} {name} | {label} | {ms:.3f} | {flops / ms / 1e9:.0f} | "
                            f"{ms / spec['roofline']:.2f} | {err:.1e} |")
                    except Exception as e:
                        log(f"| {tokens} | {product} {name} | {label} | failed: {type(e).__name__}: {str(e)[:160]} | | | |")
                log(f"| {tokens} | {product} {name} | roofline | {spec['roofline']:.3f} | | 1.00 | |")
                ours = [label for label in timed if label.startswith("ours")]
                if ours:
                    results.add(
                        "moe_gemm_bwd", f"{product} {name} K={k} N={n}, {tokens} tokens", timed[ours[0]][0],
                        metric="median ms a call, 20 jitted calls dispatched back to back",
                        peers={label: ms for label, (ms, _) in timed.items() if label not in ours},
                        roofline=spec["roofline"], implementation=ours[0], error=timed[ours[0]][1],
                    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1024,8192", help="token counts, comma-separated")
    parser.add_argument("--no-peers", action="store_true", help="time ours alone")
    add_results_argument(parser)
    args = parser.parse_args()
    log("jax", jax.__version__, jax.devices())
    bench_gemm_backward([int(t) for t in args.tokens.split(",")], args.no_peers, Results(args.results))


if __name__ == "__main__":
    main()
