"""The MoE's grouped GEMMs on the GPU: ours (`moe_gemm.grouped_matmul`, Mosaic GPU over the
expert-tiled row layout) against jla 0.1.0 `ragged_dot`, JAX's Pallas `ragged_dot_mgpu` and XLA's
`lax.ragged_dot`, at GLM-5.3's shapes (288 experts, 8 per token, hidden 4096, expert width 2048):
gate_up K = 4096, N = 4096 and down K = 2048, N = 4096, for 8, 64, 1024 and 8192 tokens, each token
routed to 8 distinct experts drawn uniformly. Then the whole MoE layer (`layers.mlp.moe`, random
router) with the kernel and with the reference (the GEMMs' backward: bench/train.py). Then the same
GEMMs with block-scaled FP8 operands
(W8A8: weights e4m3 in 128 x 128 blocks, rows in 1 x 128 groups, as the release runs them).

    python -m bench.moe [--tokens 8,64,1024,8192] [--skip gemm,layer,fp8] [--no-peers] [--configs 128x128x64x4]
        [--fp8-tokens 64,8192] [--fp8-stages 3,4] [--fp8-clusters 1,2] [--fp8-cols 256] [--fp8-no-overlap]
        [--fp8-pingpong] [--fp8-rescale] [--fp8-columns-fastest]
        [--results bench/results.jsonl]

Times are medians of 20 jitted calls dispatched back to back (`common.dispatched_ms`), per call; ours
is the kernel alone on rows already in the tiled layout (the MoE layer gathers its rows into either
layout at the same cost). The roofline is max(FLOPs / `common.MATMUL`, bytes / `common.HBM`), bytes
= the used experts' weights once plus the rows in and out. Errors are max|d| / max|ref| against an
fp32 product over the rows of 8 sampled experts. Rows for bench/results.jsonl: op `moe_gemm` per GEMM
and token count (ours: the config `moe_gemm.plan` picks; peers: jla, JAX, XLA), op `moe_layer` per
token count (baseline: the layer through the reference, XLA's `ragged_dot`), op `moe_gemm_fp8` per
GEMM and token count (ours: `moe_gemm.grouped_matmul_fp8` on quantized rows; baselines: our bf16
kernel, the rows' quantization alone; peers: jla's `ragged_dot_fp8`, one scale per tensor, and XLA's
`ragged_dot` on fp8 operands; roofline at `common.FP8_MATMUL` and fp8 bytes).

jla comes as a wheel (../shared/peers/), installed on the GPU machine from a folder carried with the
tree:
    python3 -m pip install -q --no-index --no-deps --target .peers-site .peers/*.whl
    PYTHONPATH=$PWD/.peers-site python3 -m bench.moe
"""

import argparse
import dataclasses
import functools
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import FP8_MATMUL, HBM, MATMUL, Results, add_results_argument, dispatched_ms, log
from glm5next_jax.config import Config
from glm5next_jax.layers import mlp
from pallas_kernels import block_fp8, moe_gemm

EXPERTS, TOP_K, HIDDEN, WIDTH = 288, 8, 4096, 2048
GEMMS = {"gate_up": (HIDDEN, 2 * WIDTH), "down": (WIDTH, HIDDEN)}


def routed_rows(tokens, seed=0):
    """Group sizes [G] of tokens x 8 rows, each token's 8 experts distinct."""
    rng = np.random.default_rng(seed)
    experts = np.argsort(rng.random((tokens, EXPERTS)), axis=1)[:, :TOP_K]
    return np.bincount(experts.reshape(-1), minlength=EXPERTS).astype(np.int32)


def peers():
    out = {}
    try:
        from jla.ops.mosaic_gpu import ragged_dot as jla_rd

        out["jla ragged_dot"] = lambda x, w, s: jla_rd.ragged_dot(x, w, s)
    except Exception:
        traceback.print_exc()
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    out["jax ragged_dot_mgpu"] = lambda x, w, s: ragged_dot_mgpu.ragged_dot(
        x, w, group_sizes=s, block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=2
    )
    out["xla lax.ragged_dot"] = lambda x, w, s: jax.lax.ragged_dot(x, w, s)  # a dense one-hot product on GPU
    return out


def sampled_error(out_rows, x_rows, w, sizes, rng):
    """out_rows [M, N] in packed order against fp32 products for 8 nonempty experts."""
    starts = np.cumsum(sizes) - sizes
    worst = 0.0
    for g in rng.choice(np.flatnonzero(sizes), size=min(8, np.count_nonzero(sizes)), replace=False):
        rows = slice(int(starts[g]), int(starts[g] + sizes[g]))
        want = np.asarray(jnp.dot(x_rows[rows].astype(jnp.float32), w[g].astype(jnp.float32), precision="highest"))
        got = np.asarray(out_rows[rows], np.float32)
        worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
    return worst


def parse_config(text):
    """`<block_rows>x<block_cols>x<block_k>x<stages>`, e.g. 128x256x64x3, with "t" after it for the
    items walking each expert's tiles fastest (128x256x64x3t)."""
    tiles_fastest = text.endswith("t")
    rows, cols, k, stages = (int(v) for v in text.removesuffix("t").split("x"))
    return moe_gemm.GemmConfig(block_rows=rows, block_cols=cols, block_k=k, stages=stages, tiles_fastest=tiles_fastest)


def bench_gemms(token_counts, skip_peers, configs, results):
    log("| tokens | GEMM | implementation | ms | TFLOP/s | x roofline | error |")
    log("| --- | --- | --- | --- | --- | --- | --- |")
    key = jax.random.key(0)
    for name, (k, n) in GEMMS.items():
        w = (jax.random.normal(jax.random.fold_in(key, k), (EXPERTS, k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
        for tokens in token_counts:
            sizes = routed_rows(tokens)
            rows = int(sizes.sum())
            x = jax.random.normal(jax.random.fold_in(key, tokens), (rows, k), jnp.bfloat16)
            flops = 2 * rows * k * n
            data = np.count_nonzero(sizes) * k * n * 2 + rows * (k + n) * 2
            roof = max(flops / MATMUL, data / HBM) * 1e3

            implementation, default = moe_gemm.plan(None, x, (w,), rows=rows)
            runs = {}
            for config in [default] + configs:
                tiles = moe_gemm.expert_tiles(jnp.asarray(sizes), rows, config.block_rows)
                log(f"| {tokens} | {name} | rows {rows}, in {config.block_rows}-row tiles "
                    f"{int(tiles.used_tiles) * config.block_rows} | | | | |")
                x_tiled = jnp.zeros((tiles.tile_experts.shape[0] * config.block_rows, k), x.dtype).at[tiles.slots].set(x)
                ours = jax.jit(functools.partial(moe_gemm.grouped_matmul, implementation=implementation, config=config))
                label = "ours" if config == default else "ours, config"
                shape = f"{config.block_rows}x{config.block_cols}x{config.block_k}x{config.stages}"
                shape += ", tiles fastest" if config.tiles_fastest else ""
                runs[f"{label} ({implementation} {shape})"] = (
                    functools.partial(ours, x_tiled, w, tiles.tile_experts, tiles.used_tiles),
                    lambda out, slots=tiles.slots: out[slots],
                )
            if not skip_peers:
                for peer, fn in peers().items():
                    if peer.startswith("xla") and tokens > 1024:
                        log(f"| {tokens} | {name} | {peer} | skipped: its one-hot operand would take "
                            f"{rows * EXPERTS * k * 2 / 2**30:.0f} GiB | | | |")
                        continue
                    f = jax.jit(fn)
                    runs[peer] = (lambda f=f: f(x, w, jnp.asarray(sizes)), lambda out: out)
            timed = {}
            for label, (call, packed) in runs.items():
                try:
                    out = jax.block_until_ready(call())
                    err = sampled_error(packed(out), x, w, sizes, np.random.default_rng(1))
                    ms = dispatched_ms(call)
                    timed[label] = (ms, err)
                    log(f"| {tokens} | {name} | {label} | {ms:.3f} | {flops / ms / 1e9:.0f} | {ms / roof:.2f} | {err:.1e} |")
                except Exception as e:  # a peer that cannot take the shape (out of memory, unsupported)
                    log(f"| {tokens} | {name} | {label} | failed: {type(e).__name__}: {str(e)[:120]} | | | |")
                    out = None
                del out
            log(f"| {tokens} | {name} | roofline | {roof:.3f} | | 1.00 | |")
            ours = [label for label in timed if label.startswith("ours (")]
            if ours:
                results.add(
                    "moe_gemm", f"{name} K={k} N={n}, {tokens} tokens", timed[ours[0]][0],
                    metric="median ms a call, 20 jitted calls dispatched back to back",
                    peers={label: ms for label, (ms, _) in timed.items() if not label.startswith("ours")},
                    roofline=roof, implementation=ours[0], error=timed[ours[0]][1],
                    configs={label: ms for label, (ms, _) in timed.items() if label.startswith("ours, config")},
                )


def bench_layer(token_counts, results):
    config = Config()
    key = jax.random.key(1)
    ks = jax.random.split(key, 4)
    p = dict(
        router=jax.random.normal(ks[0], (HIDDEN, EXPERTS), jnp.float32) * 0.02,
        router_bias=jnp.zeros(EXPERTS, jnp.float32),
        experts_gate_up=(jax.random.normal(ks[1], (EXPERTS, HIDDEN, 2, WIDTH), jnp.float32) * 0.02).astype(jnp.bfloat16),
        experts_down=(jax.random.normal(ks[2], (EXPERTS, WIDTH, HIDDEN), jnp.float32) * 0.02).astype(jnp.bfloat16),
    )
    log("\n| tokens | MoE layer (routed experts) | ms | error against the reference |")
    log("| --- | --- | --- | --- |")
    for tokens in token_counts:
        x = jax.random.normal(jax.random.fold_in(ks[3], tokens), (1, tokens, HIDDEN), jnp.bfloat16)
        outputs, timed, err = {}, {}, None
        for implementation in ("pallas", "reference"):
            f = jax.jit(lambda p, x, implementation=implementation: mlp.moe(p, x, config, implementation))
            try:
                outputs[implementation] = jax.block_until_ready(f(p, x))
                timed[implementation] = ms = dispatched_ms(f, p, x)
                note = ""
                if implementation == "reference" and "pallas" in outputs:
                    got, want = np.asarray(outputs["pallas"], np.float32), np.asarray(outputs["reference"], np.float32)
                    err = float(np.abs(got - want).max() / np.abs(want).max())
                    note = f"pallas: {err:.1e}"
                log(f"| {tokens} | {implementation} | {ms:.3f} | {note} |")
            except Exception as e:
                log(f"| {tokens} | {implementation} | failed: {type(e).__name__}: {str(e)[:120]} | |")
        if "pallas" in timed:
            results.add(
                "moe_layer", f"{tokens} tokens",
                timed["pallas"], metric="median ms a call, 20 jitted calls dispatched back to back",
                baselines={"reference (XLA ragged_dot)": timed.get("reference")}, difference_from_reference=err,
            )


def fp8_operands(k, n, key):
    """Weights [G, N, K] e4m3 with [G, N / 128, K / 128] scales, drawn directly (quantizing 4.8 G
    values would need tens of GB): e4m3 values of a normal law over +-448, scales near 0.02 / 64."""
    kq, ks = jax.random.split(key)
    w = jnp.clip(jax.random.normal(kq, (EXPERTS, n, k), jnp.bfloat16) * 64, -448, 448).astype(block_fp8.FP8)
    scales = jax.random.uniform(ks, (EXPERTS, n // 128, k // 128), jnp.float32, 0.5, 1.5) * (0.02 / 64)
    return w, scales


def fp8_sampled_error(out_rows, x_q, x_s, w, w_s, sizes, rng):
    """out_rows [M, N] in packed order against the dequantized operands' fp32 products, 8 experts."""
    starts = np.cumsum(sizes) - sizes
    worst = 0.0
    for g in rng.choice(np.flatnonzero(sizes), size=min(8, np.count_nonzero(sizes)), replace=False):
        rows = slice(int(starts[g]), int(starts[g] + sizes[g]))
        x = block_fp8.dequantize_rows(x_q[rows], x_s[rows])
        want = np.asarray(jnp.dot(x, block_fp8.dequantize_blocks(w[g], w_s[g]).T, precision="highest"))
        got = np.asarray(out_rows[rows], np.float32)
        worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
    return worst


def bench_fp8_gemms(token_counts, stages, clusters, cols, no_overlap, pingpong, rescale, columns_fastest, skip_peers,
                    results):
    log("\n| tokens | FP8 GEMM | implementation | ms | TFLOP/s | x roofline | error |")
    log("| --- | --- | --- | --- | --- | --- | --- |")
    key = jax.random.key(2)
    for name, (k, n) in GEMMS.items():
        w, w_s = fp8_operands(k, n, jax.random.fold_in(key, k))
        w_bf16 = None
        for tokens in token_counts:
            sizes = routed_rows(tokens)
            rows = int(sizes.sum())
            x = jax.random.normal(jax.random.fold_in(key, tokens), (rows, k), jnp.bfloat16)
            x_q, x_s = jax.jit(block_fp8.quantize_rows)(x)
            flops = 2 * rows * k * n
            used = np.count_nonzero(sizes)
            data = used * (n * k + (n // 128) * (k // 128) * 4) + rows * (k + k // 128 * 4 + n * 2)
            roof = max(flops / FP8_MATMUL, data / HBM) * 1e3
            implementation, default = moe_gemm.plan_fp8(None, (w,), rows=rows)
            runs = {}
            vary = functools.partial(dataclasses.replace, default)
            variants = {default}
            variants |= {vary(stages=s) for s in stages}
            variants |= {vary(cluster=c) for c in clusters}
            variants |= {vary(block_cols=b, stages=min(default.stages, 3), cluster=c)
                         for b in cols for c in {default.cluster, *clusters}}
            if no_overlap:
                variants |= {vary(cluster=c, overlap_items=False) for c in {default.cluster, *clusters}}
            if pingpong:
                variants |= {dataclasses.replace(v, pingpong=True) for v in variants}
            if rescale:
                variants |= {dataclasses.replace(v, rescale=True) for v in variants}
            if columns_fastest:
                variants |= {dataclasses.replace(v, tiles_fastest=False) for v in variants}
            order = lambda v: (v.block_cols, v.stages, v.cluster, not v.overlap_items, v.pingpong, v.rescale,  # noqa: E731
                               not v.tiles_fastest)
            for config in sorted((v for v in variants if n % (v.block_cols * v.cluster) == 0), key=order):
                b, s, c = config.block_cols, config.stages, config.cluster
                tiles = moe_gemm.expert_tiles(jnp.asarray(sizes), rows, config.block_rows)
                m = tiles.tile_experts.shape[0] * config.block_rows
                x_tiled = jnp.zeros((m, k), x_q.dtype).at[tiles.slots].set(x_q)
                s_tiled = jnp.ones((m, k // 128), jnp.float32).at[tiles.slots].set(x_s)
                ours = jax.jit(functools.partial(moe_gemm.grouped_matmul_fp8, implementation=implementation, config=config))
                label = "ours" if config == default else "ours, config"
                overlap = "" if config.overlap_items else ", items not overlapped"
                overlap += ", warpgroups taking turns" if config.pingpong else ""
                overlap += ", sums rescaled" if config.rescale else ""
                overlap += "" if config.tiles_fastest else ", column blocks fastest"
                runs[f"{label} ({implementation} {config.block_rows}x{b}x{s}, cluster {c}{overlap})"] = (
                    functools.partial(ours, x_tiled, s_tiled, w, w_s, tiles.tile_experts, tiles.used_tiles),
                    lambda out, slots=tiles.slots: out[slots],
                )
            baselines = {"quantize rows (1 x 128)": (functools.partial(jax.jit(block_fp8.quantize_rows), x), None)}
            if w_bf16 is None:  # our bf16 kernel on the same values, [G, K, N]
                w_bf16 = jax.jit(lambda w, s: jnp.swapaxes(block_fp8.dequantize_blocks(w, s), 1, 2).astype(jnp.bfloat16))(w, w_s)
            bf16_impl, bf16_config = moe_gemm.plan(None, x, (w_bf16,), rows=rows)
            tiles = moe_gemm.expert_tiles(jnp.asarray(sizes), rows, bf16_config.block_rows)
            x_deq = block_fp8.dequantize_rows(x_q, x_s).astype(jnp.bfloat16)
            m = tiles.tile_experts.shape[0] * bf16_config.block_rows
            x_tiled = jnp.zeros((m, k), jnp.bfloat16).at[tiles.slots].set(x_deq)
            bf16 = jax.jit(functools.partial(moe_gemm.grouped_matmul, implementation=bf16_impl, config=bf16_config))
            baselines["ours bf16"] = (
                functools.partial(bf16, x_tiled, w_bf16, tiles.tile_experts, tiles.used_tiles),
                lambda out, slots=tiles.slots: out[slots],
            )
            if not skip_peers:
                w_t = None
                try:
                    from jla.ops.mosaic_gpu import ragged_dot_fp8 as jla_fp8

                    f = jax.jit(jla_fp8.ragged_dot_fp8)
                    runs["jla ragged_dot_fp8 (one scale a tensor)"] = (lambda f=f: f(x_q, w, jnp.asarray(sizes)), None)
                except Exception:
                    traceback.print_exc()
                if tokens <= 1024:
                    w_t = jnp.swapaxes(w, 1, 2)
                    f = jax.jit(lambda x, w, s: jax.lax.ragged_dot(x, w, s, preferred_element_type=jnp.float32))
                    runs["xla lax.ragged_dot on fp8 (no scales)"] = (lambda f=f, w_t=w_t: f(x_q, w_t, jnp.asarray(sizes)), None)
            timed, named = {}, {**runs, **baselines}
            for label, (call, packed) in named.items():
                try:
                    out = jax.block_until_ready(call())
                    err = fp8_sampled_error(packed(out), x_q, x_s, w, w_s, sizes, np.random.default_rng(1)) if packed else None
                    ms = dispatched_ms(call)
                    timed[label] = (ms, err)
                    err_text = "" if err is None else f"{err:.1e}"
                    log(f"| {tokens} | {name} | {label} | {ms:.3f} | {flops / ms / 1e9:.0f} | {ms / roof:.2f} | {err_text} |")
                except Exception as e:
                    log(f"| {tokens} | {name} | {label} | failed: {type(e).__name__}: {str(e)[:160]} | | | |")
                    out = None
                del out
            log(f"| {tokens} | {name} | roofline | {roof:.3f} | | 1.00 | |")
            ours = [label for label in timed if label.startswith("ours (")]
            if ours:
                results.add(
                    "moe_gemm_fp8", f"{name} K={k} N={n}, {tokens} tokens", timed[ours[0]][0],
                    metric="median ms a call, 20 jitted calls dispatched back to back",
                    peers={label: ms for label, (ms, _) in timed.items() if label in runs and not label.startswith("ours")},
                    baselines={label: timed.get(label, (None,))[0] for label in baselines},
                    roofline=roof, implementation=ours[0], error=timed[ours[0]][1],
                    configs={label: ms for label, (ms, _) in timed.items() if label.startswith("ours, config")},
                )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="8,64,1024,8192", help="token counts, comma-separated")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: gemm, layer, fp8")
    parser.add_argument("--fp8-tokens", default="64,8192", help="token counts of the FP8 GEMMs")
    parser.add_argument("--fp8-stages", default="", help="more pipeline depths of the FP8 kernel, comma-separated")
    parser.add_argument("--fp8-clusters", default="", help="more cluster sizes of the FP8 kernel, comma-separated")
    parser.add_argument("--fp8-cols", default="", help="more column widths of the FP8 kernel's tiles (3 stages)")
    parser.add_argument("--fp8-no-overlap", action="store_true",
                        help="also the FP8 kernel with each item filling and draining its own pipeline")
    parser.add_argument("--fp8-pingpong", action="store_true",
                        help="also every FP8 config with its compute warpgroups taking turns")
    parser.add_argument("--fp8-rescale", action="store_true",
                        help="also every FP8 config with its running sums rescaled in the accumulators")
    parser.add_argument("--fp8-columns-fastest", action="store_true",
                        help="also every FP8 config with its items walking column blocks fastest")
    parser.add_argument("--no-peers", action="store_true", help="time ours alone")
    parser.add_argument(
        "--configs", default="",
        help="more kernel configs, <block_rows>x<block_cols>x<block_k>x<stages>[t] (t: tiles fastest), e.g. 128x256x64x3t",
    )
    add_results_argument(parser)
    args = parser.parse_args()
    results = Results(args.results)
    token_counts = [int(t) for t in args.tokens.split(",")]
    log("jax", jax.__version__, jax.devices())
    if "gemm" not in args.skip:
        bench_gemms(token_counts, args.no_peers, [parse_config(c) for c in args.configs.split(",") if c], results)
    if "layer" not in args.skip:
        bench_layer(token_counts, results)
    if "fp8" not in args.skip:
        stages = [int(v) for v in args.fp8_stages.split(",") if v]
        clusters = [int(v) for v in args.fp8_clusters.split(",") if v]
        cols = [int(v) for v in args.fp8_cols.split(",") if v]
        bench_fp8_gemms([int(t) for t in args.fp8_tokens.split(",")], stages, clusters, cols, args.fp8_no_overlap,
                        args.fp8_pingpong, args.fp8_rescale, args.fp8_columns_fastest, args.no_peers, results)


if __name__ == "__main__":
    main()
