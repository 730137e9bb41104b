"""DSA's token selection (`pallas_kernels.select_tokens`) on the GPU, through the reference's candidate
scores (jnp), through the Triton kernels and through the Mosaic GPU scores kernel
(`backend="mosaic"`, the top-k kernel after it), with what the model's cached DSA layer does with
its rows (the workspace write, and the padding to the latent attention kernel's blocks of 64
tokens), at the wider config's shapes (bench/model_gpu.py: 32 index heads of 128, top-k 2048 in
pools of 4): decode steps at batch 8 over 4096 cached tokens and batch 64 over 131072, prefills of 1
x 4096, 1 x 16384 and 1 x 65536. Beside them jla's indexer top-k
(`jla.ops.mosaic_gpu.dsa.index_topk`, radix select; from ../shared/peers/ when importable) over the
prefill's T tokens as keys: DeepSeek-V3.2's indexer without pools, 4x the products of ours at pools
of 4 (it has no decode form). Prints, per implementation, the GPU time a call (sum of its kernels in
a profiler trace), the rows whose selection differs from the reference's, and the costliest kernels
with their HLO result and op; with --hlo DIR, writes those kernels' fused computations there. Rows
for bench/results.jsonl: op `select_tokens` per shape (ours: the default kernels' GPU ms a call;
configs: the Mosaic GPU scores'; baseline: the jnp reference's; roofline: max(products / MATMUL,
(pool keys read + scores written and read) / HBM)).

    python -m bench.select_tokens [--shapes "NAME;NAME..."] [--hlo DIR] [--results bench/results.jsonl]

With --blocks "64x128,32x128,..." it times the candidates' scores kernel alone over those (queries x
pools) program blocks at the prefill shapes instead, each checked against the default block's scores.
"""

import argparse
import functools
import os
import re

import jax
import jax.numpy as jnp

from bench.common import HBM, MATMUL, Results, add_results_argument, fusion_sources, trace_kernels
from pallas_kernels import select_tokens
from pallas_kernels.select_tokens import candidate_scores_triton

SHAPES = {  # name: (batch, queries, keys in the cache, valid keys)
    "decode, batch 8, 4096 cached": (8, 1, 4160, 4097),
    "decode, batch 64, 131072 cached": (64, 1, 131136, 131073),
    "prefill 1 x 4096": (1, 4096, 4096, 4096),
    "prefill 1 x 16384": (1, 16384, 16384, 16384),
    "prefill 1 x 65536": (1, 65536, 65536, 65536),
}
HEADS, HEAD_DIM, TOPK, POOL = 32, 128, 2048, 4
IMPLEMENTATIONS = {  # name: select_tokens' (implementation, backend)
    "reference": ("reference", "triton"),
    "pallas": ("pallas", "triton"),
    "pallas, Mosaic GPU scores": ("pallas", "mosaic"),
}


def roofline_ms(b, t, n_valid):
    """max(products / MATMUL, bytes / HBM): each query's visible pools against its heads, the pool
    keys read once and the [T, n_pools] fp32 scores written and read once."""
    pools = n_valid // POOL
    seen = sum(min(pools, (n_valid - t + i + 1) // POOL) for i in range(t)) if t > 1 else pools
    flops = 2 * b * seen * HEADS * HEAD_DIM
    bytes_ = b * pools * HEAD_DIM * 2 + 2 * 4 * b * t * pools
    return 1e3 * max(flops / MATMUL, bytes_ / HBM)


def jla_index_topk_ms(b, t):
    """jla's indexer top-k (radix select) over T tokens as keys, the design without pools (T x T / 2
    products, 4x ours at pools of 4, top 2048 tokens), GPU ms a call; or why it did not run."""
    try:
        from jla.ops.mosaic_gpu import dsa as jla_dsa
    except ImportError as e:
        return f"not importable: {e}"
    if t == 1:
        return "no decode form (its queries are its keys)"
    ks = jax.random.split(jax.random.key(1), 3)
    q_idx = jax.random.normal(ks[0], (b, t, HEADS, HEAD_DIM), jnp.bfloat16)
    k_idx = jax.random.normal(ks[1], (b, t, HEAD_DIM), jnp.bfloat16)
    w_idx = jax.random.normal(ks[2], (b, t, HEADS), jnp.bfloat16)
    topk = jax.jit(lambda q, k, w: jla_dsa.index_topk(q, k, w, TOPK, method="radix"))
    try:
        per_name, _ = trace_kernels(functools.partial(topk, q_idx, k_idx, w_idx), 5)
        return sum(per_name.values())
    except Exception as e:  # a peer that does not take this shape: say so
        return f"failed: {type(e).__name__}: {str(e)[:160]}"


def selection_step(q_idx, head_weights, pool_keys, key_valid, positions, workspace, implementation, backend):
    """The selection and its two consumers in `dsa.dsa_layer_cached`: the last query's row into the
    workspace (where the row was written), and the rows padded for the latent attention."""
    indices = select_tokens.select_tokens(
        q_idx, head_weights, pool_keys, key_valid, positions, index_topk=TOPK, pool_size=POOL,
        implementation=implementation, backend=backend,
    )
    rows = jnp.pad(indices[:, -1], [(0, 0), (0, workspace.shape[1] - indices.shape[-1])], constant_values=-1)
    workspace = jnp.where((positions[:, -1] >= 0)[:, None], rows, workspace)
    width = -(-indices.shape[-1] // 64) * 64  # the latent attention kernel walks blocks of 64 tokens
    padded = jnp.pad(indices, [(0, 0), (0, 0), (0, width - indices.shape[-1])], constant_values=-1)
    return workspace, padded


def inputs(b, t, s, n_valid):
    ks = jax.random.split(jax.random.key(0), 3)
    q_idx = jax.random.normal(ks[0], (b, t, HEADS, HEAD_DIM), jnp.bfloat16)
    head_weights = jax.random.normal(ks[1], (b, t, HEADS), jnp.float32) * HEADS**-0.5
    # A decode step reads the cache's pool keys, whole blocks of the kernels' (`cache.init_cache`); a
    # prefill the prompt's pools.
    n_pools = select_tokens.pool_rows(s, POOL) if t == 1 else s // POOL
    pool_keys = jax.random.normal(ks[2], (b, n_pools, HEAD_DIM), jnp.bfloat16)
    key_valid = jnp.broadcast_to(jnp.arange(s) < n_valid, (b, s))
    positions = jnp.broadcast_to(n_valid - t + jnp.arange(t, dtype=jnp.int32), (b, t))
    workspace = jnp.full((b, TOPK + POOL - 1), -1, jnp.int32)
    return q_idx, head_weights, pool_keys, key_valid, positions, workspace


def fused_computations(text, names):
    """The HLO text of the computations that the instructions `names` (trace names) call."""
    called, blocks = {}, {}
    for line in text.splitlines():
        found = re.match(r"\s*(?:ROOT )?%?([\w.-]+) = .* calls=%?([\w.-]+)", line)
        if found:
            called[found.group(1).replace(".", "_")] = found.group(2)
    for block in re.split(r"\n(?=\S)", text):
        header = re.match(r"%?([\w.-]+) ", block)
        if header:
            blocks[header.group(1)] = block
    return {name: blocks.get(called.get(name, ""), "") for name in names}


def time_score_blocks(blocks):
    """The scores kernel's GPU ms a call per (queries x pools) program block, at the prefill shapes."""
    default = (candidate_scores_triton.MAX_BLOCK_QUERIES, candidate_scores_triton.BLOCK_POOLS)
    print("\n| shape | queries x pools a program | scores kernel ms | max |d| vs the default block's |\n|---|---|---|---|")
    for shape_name, shape in SHAPES.items():
        if shape[1] < candidate_scores_triton.MIN_BLOCK_QUERIES:
            continue
        q_idx, head_weights, pool_keys, key_valid, positions, _ = inputs(*shape)
        pool_valid = select_tokens.pool_validity(key_valid, pool_keys.shape[1], POOL)
        visible = select_tokens.visible_pools(select_tokens.first_valid_key(key_valid), positions, POOL, pool_keys.shape[1])
        want = None
        for block in [default] + [b for b in blocks if b != default]:
            candidate_scores_triton.MAX_BLOCK_QUERIES, candidate_scores_triton.BLOCK_POOLS = block
            jax.clear_caches()  # the module's block sizes are read when the kernel is traced
            scores = jax.jit(candidate_scores_triton.candidate_scores_kernel)
            run = functools.partial(scores, q_idx, head_weights, pool_keys, pool_valid, visible)
            per_name, _ = trace_kernels(run, 5)
            got = run()
            want = got if want is None else want
            finite = jnp.isfinite(want)
            err = float(jnp.max(jnp.where(finite, jnp.abs(got - want), 0.0)))
            same_mask = bool((jnp.isfinite(got) == finite).all())
            print(f"| {shape_name} | {block[0]} x {block[1]} | {per_name.get('candidate_pool_scores', float('nan')):.4f} | "
                  f"{err:.2e}{'' if same_mask else ', candidates differ'} |", flush=True)
    candidate_scores_triton.MAX_BLOCK_QUERIES, candidate_scores_triton.BLOCK_POOLS = default


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=";".join(SHAPES), help="names of SHAPES, separated by ';'")
    parser.add_argument("--hlo", metavar="DIR", help="write the costliest kernels' fused computations here")
    parser.add_argument("--blocks", help="time the scores kernel alone over these QUERIESxPOOLS blocks, comma-separated")
    add_results_argument(parser)
    options = parser.parse_args()
    if options.blocks:
        return time_score_blocks([tuple(map(int, b.split("x"))) for b in options.blocks.split(",")])
    hlo_dir = options.hlo
    print("devices:", jax.devices())
    results = Results(options.results)
    step = jax.jit(selection_step, static_argnames=("implementation", "backend"))
    for shape_name in filter(None, options.shapes.split(";")):
        shape = SHAPES[shape_name]
        args = inputs(*shape)
        selected, gpu_ms, differ = {}, {}, 0
        for impl, (implementation, backend) in IMPLEMENTATIONS.items():
            run = functools.partial(step, *args, implementation=implementation, backend=backend)
            try:
                per_name, launches = trace_kernels(run, 5)
            except Exception as e:  # a kernel that does not compile or run: say so and go on
                print(f"\n{shape_name}, {impl}: failed: {type(e).__name__}: {str(e)[:300]}")
                continue
            selected[impl] = run()[1]
            hlo = step.lower(*args, implementation=implementation, backend=backend).compile().as_text()
            sources = fusion_sources(hlo)
            ranked = sorted(((ms, launches[name], name) for name, ms in per_name.items()), reverse=True)[:8]
            differ = int((jnp.sort(selected[impl], -1) != jnp.sort(selected["reference"], -1)).any(-1).sum())
            gpu_ms[impl] = sum(per_name.values())
            print(f"\n{shape_name}, {impl}: GPU {sum(per_name.values()):.4f} ms a call in "
                  f"{sum(launches.values()):.0f} kernels; {differ} of {shape[0] * shape[1]} rows differ from the reference's")
            print("| ms a call | launches | kernel | result, op (HLO) |\n|---|---|---|---|")
            for ms, n, name in ranked:
                print(f"| {ms:.4f} | {n:.0f} | {name[:60]} | {sources.get(name, '')} |")
            if hlo_dir:
                os.makedirs(hlo_dir, exist_ok=True)
                bodies = fused_computations(hlo, [name for _, _, name in ranked if name in sources][:4])
                with open(os.path.join(hlo_dir, f"select_{impl}_{shape[0]}x{shape[1]}.txt"), "w") as f:
                    for name, body in bodies.items():
                        f.write(f"==== {name}\n{body}\n\n")
        peer = jla_index_topk_ms(shape[0], shape[1])
        roofline = roofline_ms(shape[0], shape[1], shape[3])
        print(f"\n{shape_name}: jla index_topk, radix, tokens as keys: {peer}; our roofline {roofline:.4f} ms")
        if "pallas" not in gpu_ms:
            continue
        results.add(
            "select_tokens", shape_name, gpu_ms["pallas"],
            metric="GPU ms a call (the kernels' sum in a profiler trace of 5 calls)",
            baselines={"jnp reference": gpu_ms.get("reference")}, roofline=roofline, rows_differing=differ,
            rows=shape[0] * shape[1],
            configs={"Mosaic GPU scores": gpu_ms[name] for name in ["pallas, Mosaic GPU scores"] if name in gpu_ms},
            peers={"jla index_topk, tokens as keys (4x the products)": peer} if isinstance(peer, float) else {},
        )


if __name__ == "__main__":
    main()
