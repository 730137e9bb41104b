"""DSA's token selection (`pallas_kernels.select_tokens`, jnp) on the GPU, with what the model's
cached DSA layer does with its rows (the workspace write, and the padding to the latent attention
kernel's blocks of 64 tokens), at the wider config's shapes (bench/model_gpu.py: 32 index heads of 128,
top-k 2048 in pools of 4): the decode step at batch 8 over 4096 cached tokens and a prefill of
1 x 4096. Prints the GPU time a call (sum of its kernels in a profiler trace) and the costliest
kernels with their HLO result and op; with --hlo DIR, writes those kernels' fused computations there.

    PYTHONPATH=$PWD:$PWD/bench python3 bench/select_tokens.py [--hlo DIR]
"""

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
}
HEADS, HEAD_DIM, TOPK, POOL = 32, 128, 2048, 4


def selection_step(q_idx, head_weights, pool_keys, key_valid, positions, workspace):
    """The selection and its two consumers in `dsa.dsa_layer_cached`: the last query's row into the
    workspace (where the row was written), and the rows padded for the latent attention."""
    indices = select_tokens.select_tokens(
        q_idx, head_weights, pool_keys, key_valid, positions, index_topk=TOPK, pool_size=POOL
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


def main():
    hlo_dir = sys.argv[sys.argv.index("--hlo") + 1] if "--hlo" in sys.argv else None
    print("devices:", jax.devices())
    step = jax.jit(selection_step)
    for shape_name, shape in SHAPES.items():
        args = inputs(*shape)
        per_name, launches = trace_kernels(lambda: step(*args), 10)
        hlo = step.lower(*args).compile().as_text()  # once: for the names and the fused computations
        sources = fusion_sources(hlo)
        ranked = sorted(((ms, launches[name], name) for name, ms in per_name.items()), reverse=True)[:8]
        print(f"\n{shape_name}: GPU {sum(per_name.values()):.4f} ms a call in {sum(launches.values()):.0f} kernels")
        print("| ms a call | launches | kernel | result, op (HLO) |\n|---|---|---|---|")
        for ms, n, name in ranked:
            print(f"| {ms:.4f} | {n:.0f} | {name[:60]} | {sources.get(name, '')} |")
        if hlo_dir:
            os.makedirs(hlo_dir, exist_ok=True)
            bodies = fused_computations(hlo, [name for _, _, name in ranked if name in sources][:4])
            with open(os.path.join(hlo_dir, f"select_{shape[0]}x{shape[1]}.txt"), "w") as f:
                for name, body in bodies.items():
                    f.write(f"==== {name}\n{body}\n\n")


if __name__ == "__main__":
    main()
