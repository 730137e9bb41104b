"""Training on the GPU:
1. the KDA chunked scan's forward + backward (`jax.value_and_grad` of <o, do> for q, k, v, g, beta
   through `kda.kda_chunk_scan`) at (1, 16384, 16), (8, 4096, 16), (1, 8192, 64), D = 128, beside
   jla's `kda` and fla's `chunk_kda` (torch autograd) on the same inputs, with each one's peak memory
   beyond its inputs (ours and jla's: the compiled program's temporaries; fla's: torch's peak);
2. the MoE grouped GEMM's backward at GLM-5.3's shapes (288 experts, 8 a token; gate_up K = 4096,
   N = 4096 and down K = 2048, N = 4096), its two products apart:
   - d_lhs, the rows' gradient d_out W^T: ours (`moe_gemm.grouped_matmul(..., transposed=True)`, the
     forward kernel reading W [G, K, N] as its transpose in place), jla's ragged_dot backward in the
     rows alone, JAX's `ragged_dot_mgpu` on W transposed beforehand (the transpose not timed), XLA's
     `lax.ragged_dot` (1024 tokens and fewer);
   - d_rhs, the weights' gradient x^T d_out per expert: ours (`moe_gemm.expert_outer_products`), jla's
     `transposed_ragged_dot`, XLA's ragged dot transposed (1024 tokens and fewer);
3. DSA's latent attention forward + backward (`jax.grad` of <o, do> in q_lat and the latents through
   `latent_attention.sparse_latent_attention`: the Triton and the Mosaic GPU kernels forward, the
   gradient over the selection in XLA) at GLM-5.3's 64 heads, R = 512 and W = 2048 selected, beside
   the dense reference's gradient where it fits (4096 tokens);
4. a training step (`train.train_step`, AdamW, bf16 train-form parameters, through the kernels) of
   bench.model_gpu's wider MoE config, in tokens/s and model FLOPs utilisation.

    python -m bench.train [--skip kda,gemm,latent,step] [--tokens 1024,8192] [--step-batch 4x4096] [--no-peers]
        [--results bench/results.jsonl]

Rows: op `kda_train`, shape `B=1 T=16384 H=16 D=128` (peers `jla kda`, `fla chunk_kda`); op
`moe_gemm_bwd`, shape `d_lhs <gemm> K=.. N=.., <tokens> tokens` and `d_rhs ...`, the roofline
max(FLOPs / `common.MATMUL`, bytes / `common.HBM`), d_lhs's bytes the used experts' weights and the
rows in and out, d_rhs's every expert's gradient written (zeros for the unused) and the rows read,
errors max|d| / max|ref| against fp32 products over 8 sampled experts; op `latent_attention_train`,
shape `B=1 T=.. H=64 R=512 W=2048`, roofline max(FLOPs / `common.MATMUL`, bytes / `common.HBM`) with
the forward's 2 and the backward's 5 products of 2 H W R FLOPs a query and the bytes of the rows
gathered twice (bf16) and their gradients added into fp32 (read and written); op `train_step`, whose
roofline is the step's model FLOPs at `TRAIN_PEAK` (989 TFLOP/s dense bf16), so that MFU = roofline
/ ours: model FLOPs = 6 x the matmul parameters a token uses (the routed experts' k / E of theirs,
lm_head included, the embedding table not) x tokens, the attention's and KDA's products over the
sequence left out (MFU errs low). jla comes as a wheel (see bench/moe.py), fla with torch.
"""

import argparse
import functools
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import HBM, MATMUL, Results, add_results_argument, dispatched_ms, log
from bench.moe import EXPERTS, GEMMS, routed_rows
from pallas_kernels import kda, moe_gemm

KDA_SHAPES = [(1, 16384, 16, 128), (8, 4096, 16, 128), (1, 8192, 64, 128)]
TRAIN_PEAK = 989e12  # dense bf16 FLOP/s: the MFU's denominator


def bench_kda_train(skip_peers, results):
    """Forward + backward of the chunked scan, ours beside jla's and fla's, with peak memory."""
    from bench.kda import prefill_inputs, to_jax

    log("\n| shape | implementation | fwd + bwd ms | peak extra MiB |")
    log("| --- | --- | --- | --- |")
    for b, t, h, d in KDA_SHAPES:
        shape = f"B={b} T={t} H={h} D={d}"
        np_in = prefill_inputs(b, t, h, d)
        inputs = to_jax(*np_in)
        d_out = jax.random.normal(jax.random.key(t + h), (b, t, h, d), jnp.bfloat16)
        runs = {"ours": lambda q, k, v, g, beta: kda.kda_chunk_scan(q, k, v, g, beta)[0]}
        if not skip_peers:
            try:
                from jla.ops.mosaic_gpu.kda import kda as jla_kda

                runs["jla kda"] = lambda q, k, v, g, beta: jla_kda(
                    q, k, v, g, beta, scale=d**-0.5, output_final_state=False, use_qk_l2norm=True)[0]
            except Exception:
                traceback.print_exc()
        timed = {}
        for label, scan in runs.items():
            try:
                grads = jax.jit(jax.grad(lambda *a, scan=scan: jnp.sum(scan(*a[:5]).astype(jnp.float32) * a[5]),
                                         argnums=(0, 1, 2, 3, 4)))
                memory = grads.lower(*inputs, d_out).compile().memory_analysis().temp_size_in_bytes / 2**20
                ms = dispatched_ms(grads, *inputs, d_out)
                timed[label] = (ms, memory)
                log(f"| {shape} | {label} | {ms:.3f} | {memory:.0f} |")
            except Exception as e:
                log(f"| {shape} | {label} | failed: {type(e).__name__}: {str(e)[:160]} | |")
        if not skip_peers:
            try:
                timed["fla chunk_kda"] = fla_kda_train(np_in, np.asarray(d_out, np.float32), d)
                log(f"| {shape} | fla chunk_kda | {timed['fla chunk_kda'][0]:.3f} | {timed['fla chunk_kda'][1]:.0f} |")
            except Exception:
                traceback.print_exc()
        if "ours" in timed:
            results.add("kda_train", shape, timed["ours"][0],
                        metric="median ms of a forward + backward (jax.grad of <o, do>; fla: do_bench)",
                        peers={label: ms for label, (ms, _) in timed.items() if label != "ours"},
                        implementation="kda.kda_chunk_scan (its backward: kda.kda_chunk_scan_backward, the d S "
                                       "recurrence a Mosaic kernel, the chunk-parallel terms in XLA)",
                        peak_extra_mib={label: memory for label, (_, memory) in timed.items()})


LATENT_SHAPES = [(1, 4096, 64, 512, 2048), (1, 16384, 64, 512, 2048)]


def bench_latent_train(results):
    """Forward + backward of the latent attention over a causal random selection: ours (each forward
    kernel, the XLA gradient over the selection) and the dense reference's gradient at 4096 tokens."""
    from pallas_kernels import latent_attention as la

    log("\n| shape | implementation | fwd + bwd ms | temporaries MiB |")
    log("| --- | --- | --- | --- |")
    for b, t, h, r, w in LATENT_SHAPES:
        shape = f"B={b} T={t} H={h} R={r} W={w}"
        keys = jax.random.split(jax.random.key(t), 4)
        q = jax.random.normal(keys[0], (b, t, h, r), jnp.bfloat16)
        latents = jax.random.normal(keys[1], (b, t, r), jnp.bfloat16)
        # W distinct earlier tokens a query (fewer, -1 padded, for the first W): a causal selection
        offsets = jax.random.randint(keys[2], (b, t, w), 0, 2**30) % jnp.maximum(jnp.arange(t)[None, :, None], 1)
        indices = jnp.where(jnp.arange(w) < jnp.arange(t)[None, :, None], offsets, -1)
        indices = jnp.sort(indices, axis=-1).astype(jnp.int32)
        d_out = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
        runs = {"triton": dict(implementation="pallas"), "mosaic": dict(implementation="pallas", config=la.MosaicConfig())}
        if t <= 4096:
            runs["reference"] = dict(implementation="reference")
        timed = {}
        for label, kwargs in runs.items():
            try:
                attend = functools.partial(la.sparse_latent_attention, scale=256**-0.5, **kwargs)
                grads = jax.jit(jax.grad(lambda q, c, i, d: jnp.sum(attend(q, c, i).astype(jnp.float32) * d), argnums=(0, 1)))
                memory = grads.lower(q, latents, indices, d_out).compile().memory_analysis().temp_size_in_bytes / 2**20
                timed[label] = (dispatched_ms(grads, q, latents, indices, d_out, n=5, reps=3), memory)
                log(f"| {shape} | {label} | {timed[label][0]:.3f} | {memory:.0f} |")
            except Exception as e:
                log(f"| {shape} | {label} | failed: {type(e).__name__}: {str(e)[:160]} | |")
        flops = 7 * 2 * h * w * r * b * t
        moved = 2 * b * t * w * r * 2 + 2 * b * t * w * r * 4
        if "triton" in timed:
            results.add("latent_attention_train", shape, timed["triton"][0],
                        metric="median ms of a forward + backward (jax.grad of <o, do> in q_lat and the latents)",
                        peers={label: ms for label, (ms, _) in timed.items() if label != "triton"},
                        roofline=max(flops / MATMUL, moved / HBM) * 1e3,
                        implementation="latent_attention.sparse_latent_attention (Triton kernel forward; backward: "
                                       "sparse_latent_attention_backward in XLA)",
                        temp_mib={label: memory for label, (_, memory) in timed.items()})


def fla_kda_train(np_in, d_out, d):
    """(ms, peak extra MiB) of fla's chunk_kda forward + backward (torch autograd) on these inputs."""
    import torch
    import triton
    from fla.ops.kda import chunk_kda

    q, k, v, g, beta = (torch.from_numpy(x).cuda() for x in np_in)
    q, k, v, beta = (x.bfloat16().requires_grad_() for x in (q, k, v, beta))
    g = g.requires_grad_()
    do = torch.from_numpy(d_out).cuda().bfloat16()

    def fwd_bwd():
        o = chunk_kda(q, k, v, g, beta, scale=d**-0.5, use_qk_l2norm_in_kernel=True)[0]
        torch.autograd.grad(o, (q, k, v, g, beta), do)

    fwd_bwd()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return triton.testing.do_bench(fwd_bwd, warmup=20, rep=100, return_mode="median"), peak


def model_flops(config, tokens):
    """6 x the matmul parameters a token uses x tokens (see the module docstring)."""
    from glm5next_jax.params import param_spec, spec_shapes

    used = 0.0
    shapes = spec_shapes(param_spec(config, form="train"))
    for path, leaf in jax.tree_util.tree_leaves_with_path(shapes):
        name = jax.tree_util.keystr(path)
        if leaf.ndim < 2 or "embed_tokens" in name:
            continue
        share = config.num_experts_per_tok / config.n_routed_experts if "experts_" in name else 1.0
        used += np.prod(leaf.shape) * share
    return 6 * used * tokens


def bench_train_step(batch, seq, remat, results):
    """Steps of the wider MoE config's training: median ms a step, tokens/s and MFU."""
    import optax

    import glm5next_jax
    from bench.model_gpu import wider_config
    from glm5next_jax import train

    config = wider_config("moe")
    params = glm5next_jax.init_params(config, jax.random.key(0), dtype="bfloat16", form="train")
    optimizer = optax.adamw(1e-5)
    step = jax.jit(train.train_step, static_argnames=train.STATIC, donate_argnums=0)
    state = train.init_train_state(params, optimizer)
    ids = jax.random.randint(jax.random.key(1), (batch, seq), 2, config.vocab_size)
    mask = jnp.ones((batch, seq), jnp.int32)
    times = []
    log(f"\ntrain step, wider MoE config, {batch} x {seq} tokens, remat {remat}: compiling")
    for i in range(10):
        start = time.perf_counter()
        state, metrics = step(state, ids, mask, config=config, optimizer=optimizer, remat=remat)
        jax.block_until_ready(metrics)
        if i == 0:  # a run cut short still says how far it got
            log(f"first step (compile and run): {time.perf_counter() - start:.1f} s")
        if i >= 2:  # the first two compile and warm up
            times.append((time.perf_counter() - start) * 1e3)
    ms = statistics.median(times)
    flops = model_flops(config, batch * seq)
    roofline = flops / TRAIN_PEAK * 1e3
    log(f"\ntrain step, wider MoE config, {batch} x {seq} tokens, remat {remat}: {ms:.2f} ms, "
        f"{batch * seq / ms * 1e3:.0f} tokens/s, {flops / 1e12:.2f} model TFLOP, MFU {roofline / ms:.1%} "
        f"(loss {float(metrics['loss']):.3f})")
    results.add("train_step", f"wider MoE config, {batch} x {seq} tokens, remat {remat}", ms,
                metric="median ms a step (steps 3-10, each waited for)", roofline=roofline,
                implementation="train.train_step, bf16 through the kernels, AdamW",
                tokens_per_s=batch * seq / ms * 1e3, mfu=roofline / ms)


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
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: kda, gemm, latent, step")
    parser.add_argument("--tokens", default="1024,8192", help="the GEMMs' token counts, comma-separated")
    parser.add_argument("--step-batch", default="2x4096", help="the training step's batch, <sequences>x<tokens>")
    parser.add_argument("--remat", default="none", help="the training step's remat policy")
    parser.add_argument("--no-peers", action="store_true", help="time ours alone")
    add_results_argument(parser)
    args = parser.parse_args()
    results = Results(args.results)
    log("jax", jax.__version__, jax.devices())
    if "kda" not in args.skip:
        bench_kda_train(args.no_peers, results)
    if "gemm" not in args.skip:
        bench_gemm_backward([int(t) for t in args.tokens.split(",")], args.no_peers, results)
    if "latent" not in args.skip:
        bench_latent_train(results)
    if "step" not in args.skip:
        batch, seq = (int(v) for v in args.step_batch.split("x"))
        bench_train_step(batch, seq, args.remat, results)


if __name__ == "__main__":
    main()
