"""DSA's token selection (`pallas_kernels.select_tokens`) on the GPU, through the reference's
candidate scores (jnp) and through the kernel, with what the model's cached DSA layer does with its
rows (the workspace write, and the padding to the latent attention kernel's blocks of 64 tokens), at
the wider config's shapes (bench/model_gpu.py: 32 index heads of 128, top-k 2048 in pools of 4): the
decode step at batch 8 over 4096 cached tokens and prefills of 1 x 4096 and 1 x 16384 (--long adds
1 x 65536). Prints, per implementation, the GPU time a call (sum of its kernels in a profiler trace),
the rows whose selection differs from the reference's, and the costliest kernels with their HLO result
and op; with --hlo DIR, writes those kernels' fused computations there.

    PYTHONPATH=$PWD:$PWD/bench python3 bench/select_tokens.py [--long] [--hlo DIR]

With --blocks "64x128,32x128,..." it times the candidates' scores kernel alone over those (queries x
pools) program blocks at the prefill shapes instead, each checked against the default block's scores.
"""

import functools
import os
import re
import sys

import jax
import jax.numpy as jnp
from model_gpu import fusion_sources, trace_kernels

from pallas_kernels import select_tokens

SHAPES = {  # name: (batch, queries, keys in the cache, valid keys)
    "decode, batch 8, 4096 cached": (8, 1, 4160, 4097),
    "prefill 1 x 4096": (1, 4096, 4096, 4096),
    "prefill 1 x 16384": (1, 16384, 16384, 16384),
}
LONG_SHAPES = {"prefill 1 x 65536": (1, 65536, 65536, 65536)}
HEADS, HEAD_DIM, TOPK, POOL = 32, 128, 2048, 4


def selection_step(q_idx, head_weights, pool_keys, key_valid, positions, workspace, implementation):
    """The selection and its two consumers in `dsa.dsa_layer_cached`: the last query's row into the
    workspace (where the row was written), and the rows padded for the latent attention."""
    indices = select_tokens.select_tokens(
        q_idx, head_weights, pool_keys, key_valid, positions, index_topk=TOPK, pool_size=POOL,
        implementation=implementation,
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
    pool_keys = jax.random.normal(ks[2], (b, s // POOL, HEAD_DIM), jnp.bfloat16)
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
    default = (select_tokens.MAX_BLOCK_QUERIES, select_tokens.BLOCK_POOLS)
    print("\n| shape | queries x pools a program | scores kernel ms | max |d| vs the default block's |\n|---|---|---|---|")
    for shape_name, shape in SHAPES.items():
        if shape[1] < select_tokens.MIN_BLOCK_QUERIES:
            continue
        q_idx, head_weights, pool_keys, key_valid, positions, _ = inputs(*shape)
        pool_valid = select_tokens.pool_validity(key_valid, pool_keys.shape[1], POOL)
        visible = select_tokens.visible_pools(select_tokens.first_valid_key(key_valid), positions, POOL, pool_keys.shape[1])
        want = None
        for block in [default] + [b for b in blocks if b != default]:
            select_tokens.MAX_BLOCK_QUERIES, select_tokens.BLOCK_POOLS = block
            jax.clear_caches()  # the module's block sizes are read when the kernel is traced
            scores = jax.jit(select_tokens.candidate_scores_kernel)
            run = functools.partial(scores, q_idx, head_weights, pool_keys, pool_valid, visible)
            per_name, _ = trace_kernels(run, 5)
            got = run()
            want = got if want is None else want
            finite = jnp.isfinite(want)
            err = float(jnp.max(jnp.where(finite, jnp.abs(got - want), 0.0)))
            same_mask = bool((jnp.isfinite(got) == finite).all())
            print(f"| {shape_name} | {block[0]} x {block[1]} | {per_name.get('candidate_pool_scores', float('nan')):.4f} | "
                  f"{err:.2e}{'' if same_mask else ', candidates differ'} |", flush=True)
    select_tokens.MAX_BLOCK_QUERIES, select_tokens.BLOCK_POOLS = default


def main():
    if "--blocks" in sys.argv:
        blocks = [tuple(map(int, b.split("x"))) for b in sys.argv[sys.argv.index("--blocks") + 1].split(",")]
        return time_score_blocks(blocks)
    hlo_dir = sys.argv[sys.argv.index("--hlo") + 1] if "--hlo" in sys.argv else None
    print("devices:", jax.devices())
    step = jax.jit(selection_step, static_argnames="implementation")
    shapes = {**SHAPES, **(LONG_SHAPES if "--long" in sys.argv else {})}
    for shape_name, shape in shapes.items():
        args = inputs(*shape)
        selected = {}
        for impl in ("reference", "pallas"):
            run = functools.partial(step, *args, implementation=impl)
            per_name, launches = trace_kernels(run, 5)
            selected[impl] = run()[1]
            hlo = step.lower(*args, implementation=impl).compile().as_text()  # for the names and fusions
            sources = fusion_sources(hlo)
            ranked = sorted(((ms, launches[name], name) for name, ms in per_name.items()), reverse=True)[:8]
            differ = int((jnp.sort(selected[impl], -1) != jnp.sort(selected["reference"], -1)).any(-1).sum())
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


if __name__ == "__main__":
    main()
