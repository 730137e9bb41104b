"""Mutation checks: small breakages of the library that the test suite must catch.

Each mutation edits one line of a copy of the working tree (the tracked files, with the goldens and
the reference env linked in) and runs the tests named for it there; a mutation is caught when they
fail. Prints one line a mutation and exits non-zero if any went uncaught.

    .venv/bin/python scripts/mutations.py            # all of them (about 6 minutes on 2 cores)
    .venv/bin/python scripts/mutations.py --list
    .venv/bin/python scripts/mutations.py "fallback to the reference" ...
"""

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINKED = (".goldens", ".venv-ref")  # what the tests read besides the tracked files


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest node ids or -k expressions ("file::test" or "file -k expr")


MUTATIONS = [
    Mutation(
        "fallback to the reference",
        "pallas_kernels/common.py",
        "    return implementation\n",
        '    return "reference"\n',
        ("tests/kernels/test_dispatch.py", "tests/model/test_model_kernels.py",
         "tests/kernels/test_kda_kernels.py -k decode_step_matches",
         "tests/kernels/test_latent_attention.py -k matches_reference",
         "tests/kernels/test_select_tokens.py -k through_the_kernel", "tests/kernels/test_moe_gemm.py -k moe_layer"),
    ),
    Mutation(
        "fallback to the reference where the choice is automatic",
        "pallas_kernels/common.py",
        'return "pallas" if on_gpu and',
        'return "reference" if on_gpu and',
        ("tests/kernels/test_dispatch.py", "tests/model/test_model_kernels.py", "tests/kernels/test_kda_kernels.py -k dispatch"),
    ),
    Mutation(
        "latent attention's softmax scale 1% off",
        "pallas_kernels/latent_attention/sparse_attend_triton.py",
        "c = scale * math.log2(math.e)",
        "c = 1.01 * scale * math.log2(math.e)",
        ("tests/kernels/test_latent_attention.py", "tests/model/test_model_kernels.py"),
    ),
    Mutation(
        "fp8 latents dequantised 1% off in the kernel",
        "pallas_kernels/latent_attention/sparse_attend_triton.py",
        "latent = latent.astype(jnp.float32) * scales_ref[row][:, None]",
        "latent = latent.astype(jnp.float32) * (1.01 * scales_ref[row][:, None])",
        ("tests/kernels/test_latent_attention.py", "tests/model/test_model_kernels.py -k fp8"),
    ),
    Mutation(
        "a dropped pool in the top-k kernel",
        "pallas_kernels/select_tokens/top_pools_triton.py",
        "return chosen[..., :k], valid[..., :k] == 1",
        "return chosen[..., :k], (valid[..., :k] == 1).at[..., k - 1].set(False)",
        ("tests/kernels/test_select_tokens.py", "tests/model/test_model_kernels.py"),
    ),
    Mutation(
        "a dropped pool in the reference selection",
        "pallas_kernels/select_tokens/reference.py",
        "tokens = jnp.where(chosen_valid[..., None], tokens, -1)",
        "tokens = jnp.where(chosen_valid[..., None] & (jnp.arange(n_select) < n_select - 1)[:, None], tokens, -1)",
        ("tests/model/test_parity_model.py -k fp32", "tests/model/test_parity_layers.py -k dsa"),
    ),
    Mutation(
        "the grouped GEMM multiplies a tile by the next expert's weights",
        "pallas_kernels/moe_gemm/grouped_matmul_mosaic.py",
        "w_ref.at[tile_experts_ref[tile]]",
        "w_ref.at[jnp.minimum(tile_experts_ref[tile] + 1, w_ref.shape[0] - 1)]",
        ("tests/kernels/test_moe_gemm.py", "tests/model/test_model_kernels.py"),
    ),
    Mutation(
        "the experts' rows combined in the routing's order, not the experts'",
        "glm5next_jax/layers/mlp.py",
        "by_expert = jnp.argsort(experts, axis=-1)",
        "by_expert = jnp.broadcast_to(jnp.arange(experts.shape[-1]), experts.shape)",
        ("tests/kernels/test_moe_gemm.py -k combine",),
    ),
    Mutation(
        "the MoE ignores the layout (every device runs every expert)",
        "glm5next_jax/layers/mlp.py",
        "    if layout is None:\n        weights, experts = route(p, tokens, config)",
        "    if True:\n        weights, experts = route(p, tokens, config)",
        ("tests/model/test_sharding.py -k gathers_no_expert_weights",),
    ),
    Mutation(
        "the KDA decode step called outside shard_map",
        "glm5next_jax/layers/kda.py",
        "    o, conv_state, state = shard_mapped(layout, step, in_axes,",
        "    o, conv_state, state = shard_mapped(None, step, in_axes,",
        ("tests/model/test_sharding.py -k inside_a_shard_map",),
    ),
    Mutation(
        "bf16 logits 5% off",
        "glm5next_jax/model.py",
        '    x = rms_norm(streams.mean(axis=-2), params["norm"], config.rms_norm_eps)\n',
        '    x = rms_norm(streams.mean(axis=-2), params["norm"], config.rms_norm_eps)\n'
        "    x = x * 1.05 if x.dtype == jnp.bfloat16 else x\n",
        ("tests/model/test_parity_model.py -k bf16", "tests/model/test_model_kernels.py -k forward"),
    ),
    Mutation(
        "bf16 KDA output 5% off",
        "glm5next_jax/layers/kda.py",
        "    return (normed * weight.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(o.dtype)",
        "    y = normed * weight.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))\n"
        "    return (y * (1.05 if o.dtype == jnp.bfloat16 else 1.0)).astype(o.dtype)",
        ("tests/model/test_parity_model.py -k bf16", "tests/model/test_model_kernels.py -k forward"),
    ),
    Mutation(
        "the embedding lookup left to XLA under a layout",
        "glm5next_jax/model.py",
        "    split = () if layout is None else layout.mesh_axes(\"vocab\", table_axes)",
        "    split = ()",
        ("tests/model/test_sharding.py -k embedding",),
    ),
    Mutation(
        "Mosaic latent attention's softmax scale 1% off",
        "pallas_kernels/latent_attention/sparse_attend_mosaic.py",
        "    c = scale * math.log2(math.e)",
        "    c = 1.01 * scale * math.log2(math.e)",
        ("tests/kernels/test_latent_attention.py -k Mosaic",),
    ),
    Mutation(
        "Mosaic latent attention's scores without the other consumer's half",
        "pallas_kernels/latent_attention/sparse_attend_mosaic.py",
        "s = s + plgpu.load(shared.exchange.at[slot, 1 - wg], layout=_WGMMA)",
        "s = s + 0 * plgpu.load(shared.exchange.at[slot, 1 - wg], layout=_WGMMA)",
        ("tests/kernels/test_latent_attention.py -k Mosaic",),
    ),
    Mutation(
        "Mosaic latent attention's fp8 rows scaled 1% off",
        "pallas_kernels/latent_attention/sparse_attend_mosaic.py",
        "                    block = block.astype(jnp.float32) * by_row",
        "                    block = block.astype(jnp.float32) * 1.01 * by_row",
        ("tests/kernels/test_latent_attention.py -k Mosaic",),
    ),
    Mutation(
        "Mosaic selection scores without the relu (queries form)",
        "pallas_kernels/select_tokens/candidate_scores_mosaic.py",
        "* jnp.maximum(dots * scale, 0.0)\n\n        pipeline",
        "* (dots * scale)\n\n        pipeline",
        ("tests/kernels/test_select_tokens.py -k Mosaic",),
    ),
    Mutation(
        "Mosaic selection scores without the relu (heads form)",
        "pallas_kernels/select_tokens/candidate_scores_mosaic.py",
        "scores = jnp.sum(weight * jnp.maximum(dots * scale, 0.0), axis=0)",
        "scores = jnp.sum(weight * (dots * scale), axis=0)",
        ("tests/kernels/test_select_tokens.py -k Mosaic",),
    ),
]


def tracked_copy(into):
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        if os.path.exists(os.path.join(ROOT, rel)):
            os.makedirs(os.path.dirname(os.path.join(into, rel)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, rel), os.path.join(into, rel))
    for name in LINKED:
        if os.path.exists(os.path.join(ROOT, name)):
            os.symlink(os.path.join(ROOT, name), os.path.join(into, name))


def run_tests(tree, spec):
    """pytest on one spec in the mutated tree: True when the tests failed (the mutation is caught)."""
    path, *rest = spec.split(" -k ")
    args = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", path] + (["-k", rest[0]] if rest else [])
    done = subprocess.run(args, cwd=tree, capture_output=True, text=True)
    if done.returncode not in (0, 1):  # 1: tests failed; anything else: the run itself broke
        raise RuntimeError(f"pytest {spec} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    failed = [line.split(" - ")[0].removeprefix("FAILED ") for line in done.stdout.splitlines() if line.startswith("FAILED")]
    return failed


def check(mutation):
    with tempfile.TemporaryDirectory(prefix="mutation-") as tree:
        tracked_copy(tree)
        target = os.path.join(tree, mutation.path)
        with open(target) as f:
            text = f.read()
        if text.count(mutation.old) != 1:
            raise RuntimeError(f"{mutation.name}: the line to mutate occurs {text.count(mutation.old)} times in {mutation.path}")
        with open(target, "w") as f:
            f.write(text.replace(mutation.old, mutation.new))
        # The copy's packages, not the editable install's, must be the ones imported.
        probe = "import glm5next_jax, pallas_kernels; print(glm5next_jax.__file__, pallas_kernels.__file__)"
        where = subprocess.run([sys.executable, "-c", probe],
                               cwd=tree, check=True, capture_output=True, text=True).stdout
        assert where.count(tree) == 2, f"the tests would import the library from elsewhere: {where}"
        return {spec: run_tests(tree, spec) for spec in mutation.tests}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutations to check (default: all)")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    if args.list or not chosen:
        print("\n".join(m.name for m in MUTATIONS))
        return 0 if args.list else 2
    missed = 0
    for mutation in chosen:
        start = time.time()
        results = check(mutation)
        caught = [f"{spec}: {', '.join(failed)}" for spec, failed in results.items() if failed]
        missed += not caught
        verdict = "caught by " + "; ".join(caught) if caught else "MISSED by " + "; ".join(results)
        print(f"{mutation.name} ({time.time() - start:.0f} s): {verdict}", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
