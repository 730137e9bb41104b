"""The released model compiled for 8 H200s without a GPU, per layout: per-device memory, the collective
bytes of one step by kind, and a floor for the step's time from them.

    .venv-gpu-compile/bin/python -m bench.sharded_compile [--layers 45] [--layouts tp:8,tp-ep:8,dp-ep:8]
        [--phases decode:64x32768,prefill:8192,train:8x8192] [--weights bf16|fp8] [--devices 8]
        [--fsdp] [--remat full] [--json bench/sharded_compile.json] [--results bench/results.jsonl]

Phase `lora:BATCHxTOKENS` is LoRA over the frozen model: one `train.lora_train_step` (AdamW over
rank-`--lora-rank` adapters on every projection and the routed experts, fp32 adapters and moments
split with their bases, the base bf16 in the train form or with `--weights fp8` the FP8 release
form, DSA's absorbed projections then untargeted).

`--weights fp8` holds the release's converted linears in block-scaled FP8 (`params.param_spec(config,
fp8=True)`: what `load_checkpoint(..., weights="checkpoint")` gives on the FP8 release); `--devices`
the mesh's size (the H100 and the H200 compile alike: compare the memory with 80 GB or 141 GB), in
hosts of 8 GPUs past 8 (topology 1 x hosts x 8). Phase `train:BATCHxTOKENS` is full fine-tuning:
one `train.train_step` (AdamW, bf16 parameters and moments, the state donated, `--remat` per
layer) of the train form; `--fsdp` keeps parameters and moments split over "data" as well
(`make_layout(..., fsdp=True)`); its memory is the state (arguments) plus the step's temporaries.

Needs JAX's CUDA plugin (`.venv-gpu-compile`, see bench/decode_compile.py); nothing is materialised:
parameters and caches are abstract arrays placed by the layout on 8 compile-only H200s
(`jax.experimental.topologies`, topology 1x1x8), and the Pallas kernels lower for them. Phases (by
default): prefill of 8192 tokens (batch 1) and the decode step at batch 64 over 32768 cached tokens
(fp8 latents); a layout that splits the batch (dp-ep) prefills one sequence on each of its batch
shards. Each compile runs in a child process (the released model's takes minutes).

Collective bytes are each op's buffer (all-reduce: its operand; all-gather: its result; reduce-
scatter: its operand; all-to-all and collective-permute: their operand), and what a device sends in
a ring over its group of n: all-reduce 2 (n - 1) / n of it, the others (n - 1) / n. The floor is the
per-device weight bytes over 4.3 TB/s (HBM) plus the sent bytes over 450 GB/s (NVLink, a direction).
`--json` appends each compile's whole result; the rows for bench/results.jsonl (op `sharded_compile`,
per layout and phase) hold the compile's seconds on this machine, with the floor and the bytes beside.
"""

import argparse
import json
import os
import re
import sys
import time

from bench.common import HBM, Results, add_results_argument, run_child
from bench.decode_compile import H200_TARGET

DEVICE = "{} compile-only NVIDIA H200s (no GPU)"
NVLINK = 450e9
PHASES = "decode:64x32768,prefill:8192"  # decode:BATCHxCACHED, prefill:TOKENS (batch 1)


def phase_shape(text):
    """("decode", dict(batch, cached)), ("prefill", dict(batch=1, tokens)) or ("train", dict(batch,
    tokens)) from a --phases entry."""
    kind, _, size = text.partition(":")
    if kind == "decode":
        batch, cached = map(int, size.split("x"))
        return kind, dict(batch=batch, cached=cached)
    if kind == "prefill":
        return kind, dict(batch=1, tokens=int(size))
    if kind in ("train", "lora"):
        batch, tokens = map(int, size.split("x"))
        return kind, dict(batch=batch, tokens=tokens)
    raise ValueError(f"a phase is decode:BATCHxCACHED, prefill:TOKENS, train:BATCHxTOKENS or lora:BATCHxTOKENS, "
                     f"got {text!r}")
BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "bf16": 2, "f16": 2, "s16": 2, "f32": 4, "s32": 4, "u32": 4,
         "f64": 8, "s64": 8}
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def collectives(hlo: str):
    """{kind: (buffer bytes, bytes a device sends)} over the compiled module's collective ops."""
    out = {kind: [0, 0.0] for kind in KINDS}
    pattern = re.compile(r"= (\(?[^=]*?\)?) (" + "|".join(KINDS) + r")(?:-start)?\((.*)")
    for line in hlo.splitlines():
        match = pattern.search(line)
        if not match:
            continue
        result, kind, rest = match.groups()
        shapes = re.findall(r"(\w+)\[([\d,]*)\]", result if kind == "all-gather" else rest.split(")")[0] + ")")
        if kind != "all-gather" and not shapes:  # operands named without types: use the result
            shapes = re.findall(r"(\w+)\[([\d,]*)\]", result)
        size = sum(BYTES.get(t, 4) * _count(dims) for t, dims in shapes if t in BYTES)
        n = _group_size(line)
        out[kind][0] += size
        out[kind][1] += size * (2 if kind == "all-reduce" else 1) * (n - 1) / max(n, 1)
    return {k: {"buffer_bytes": v[0], "sent_bytes": v[1]} for k, v in out.items()}


def _count(dims):
    n = 1
    for d in filter(None, dims.split(",")):
        n *= int(d)
    return n


def _group_size(line):
    """Devices in each replica group of a collective's HLO line (8 when it cannot be read)."""
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if iota:
        return int(iota.group(2))
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if listed:
        return len(listed.group(1).split(","))
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
    if mesh:
        sizes = dict((k.strip("' "), int(v)) for k, v in (p.split("=") for p in mesh.group(1).split(",")))
        return int(__import__("math").prod(sizes[a.strip("' ")] for a in mesh.group(2).split(",")))
    return 8


def train_step_traced(config, layout, batch, tokens, remat):
    """`train.train_step` traced on abstract arrays: the train form's bf16 parameters and AdamW's
    moments where the layout keeps them, the state donated."""
    import jax
    import jax.numpy as jnp
    import optax

    from glm5next_jax import train
    from glm5next_jax.params import param_spec, spec_shapes
    from glm5next_jax.sharding import param_shardings

    shardings = param_shardings(config, layout, form="train")
    kept = lambda shapes: jax.tree.map(  # noqa: E731
        lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), shapes, shardings)
    params = kept(spec_shapes(param_spec(config, form="train"), "bfloat16"))
    optimizer = optax.adamw(1e-5)
    adam, *rest = jax.eval_shape(optimizer.init, params)
    replicated = jax.sharding.NamedSharding(layout.mesh, jax.sharding.PartitionSpec())
    adam = adam._replace(count=jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated), mu=kept(adam.mu), nu=kept(adam.nu))
    state = train.TrainState(params, (adam, *rest), jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated))
    batch_sharding = layout.sharding(("batch", None))
    ids = jax.ShapeDtypeStruct((batch, tokens), jnp.int32, sharding=batch_sharding)
    step = jax.jit(train.train_step, static_argnames=train.STATIC, donate_argnums=0)
    return step.trace(state, ids, ids, config=config, optimizer=optimizer, layout=layout, remat=remat), state


def lora_step_traced(config, layout, params, batch, tokens, remat, rank):
    """`train.lora_train_step` traced on abstract arrays: fp32 adapters of `rank` on every target the
    base holds and AdamW's moments, split as `lora.adapters_axes` says, the state donated; `params`
    the placed frozen base (train form, or FP8 inference form)."""
    import jax
    import jax.numpy as jnp
    import optax

    from glm5next_jax import lora, train

    absorbed = "q_b_proj" not in next(p["attn"] for p in params["layers"] if "q_a_proj" in p["attn"])
    targets = tuple(t for t in lora.TARGETS if not (absorbed and t in ("q_b_proj", "kv_b_proj", "o_proj")))
    spec = lora.LoraSpec(rank=rank, alpha=2.0 * rank, targets=targets)
    shapes = jax.eval_shape(lambda: lora.init_adapters(params, config, spec, jax.random.key(0)))
    axes = lora.adapters_axes(shapes, config)
    kept = lambda tree: jax.tree.map(  # noqa: E731
        lambda x, a: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=layout.sharding(a)), tree, axes)
    adapters = kept(shapes)
    optimizer = optax.adamw(1e-4)
    adam, *rest = jax.eval_shape(optimizer.init, adapters)
    replicated = jax.sharding.NamedSharding(layout.mesh, jax.sharding.PartitionSpec())
    adam = adam._replace(count=jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated), mu=kept(adam.mu), nu=kept(adam.nu))
    state = train.TrainState(adapters, (adam, *rest), jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated))
    ids = jax.ShapeDtypeStruct((batch, tokens), jnp.int32, sharding=layout.sharding(("batch", None)))
    step = jax.jit(train.lora_train_step, static_argnames=train.LORA_STATIC, donate_argnums=0)
    return step.trace(state, params, ids, ids, config=config, spec=spec, optimizer=optimizer, layout=layout,
                      remat=remat), state


def compile_one(layout_spec, phase, layers, weights="bf16", devices=8, fsdp=False, remat="full", lora_rank=16):
    """Compile one phase under one layout; its memory, collectives and floor as a dict."""
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"  # the plugin's checks need a driver
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies

    import glm5next_jax
    from glm5next_jax import inference
    from glm5next_jax.cache import cache_axes
    from glm5next_jax.params import param_axes, param_spec, spec_shapes
    from glm5next_jax.sharding import device_bytes, make_layout, placed

    hosts = max(devices // 8, 1)
    topology = topologies.get_topology_desc("h200", "cuda", target_config=H200_TARGET,
                                            topology=f"1x{hosts}x{devices // hosts}")
    jax.config.update("jax_default_device", topology.devices[0])
    jax.default_backend = lambda: "gpu"  # the library's GPU-only choices (kernels, the decode split)
    layout = make_layout(layout_spec, devices=topology.devices, fsdp=fsdp)
    config = glm5next_jax.Config() if layers is None else glm5next_jax.Config(num_hidden_layers=layers)

    fp8 = weights == "fp8"
    phase, p = phase_shape(phase)
    form = "train" if phase == "lora" and not fp8 else "inference"
    params = placed(spec_shapes(param_spec(config, fp8, form), "bfloat16"), param_axes(config, fp8, form), layout)
    if phase == "prefill":  # a layout that splits the batch prefills one sequence a batch shard
        p["batch"] = max(p["batch"], layout.size("batch"))
    batch_axes = lambda n: ("batch",) + (None,) * (n - 1)  # noqa: E731
    if phase == "train":
        if fp8:
            raise ValueError("the train phase takes bf16 weights")
        traced, state = train_step_traced(config, layout, p["batch"], p["tokens"], remat)
        params = state.params
    elif phase == "lora":
        traced, state = lora_step_traced(config, layout, params, p["batch"], p["tokens"], remat, lora_rank)
    elif phase == "decode":
        max_len = p["cached"] + 64
        cache = jax.eval_shape(lambda: glm5next_jax.init_cache(config, p["batch"], max_len, latent_dtype="float8_e4m3fn"))
        cache = placed(cache, cache_axes(cache), layout)
        tokens = jax.ShapeDtypeStruct((p["batch"],), jnp.int32, sharding=layout.sharding(("batch",)))
        traced = inference._decode.trace(params, config, tokens, cache, None, False, layout)
    else:
        cache = jax.eval_shape(lambda: glm5next_jax.init_cache(config, p["batch"], p["tokens"], latent_dtype="float8_e4m3fn"))
        cache = placed(cache, cache_axes(cache), layout)
        ids = jax.ShapeDtypeStruct((p["batch"], p["tokens"]), jnp.int32, sharding=layout.sharding(batch_axes(2)))
        valid = jax.ShapeDtypeStruct((p["batch"], p["tokens"]), jnp.bool_, sharding=layout.sharding(batch_axes(2)))
        offset = jax.ShapeDtypeStruct((p["batch"],), jnp.int32, sharding=layout.sharding(("batch",)))
        traced = inference._prefill.trace(params, config, ids, valid, offset, cache, None, False, layout)
    start = time.perf_counter()
    compiled = traced.lower().compile(compiler_options={"xla_gpu_autotune_level": 0})
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    weight_bytes = device_bytes(params)
    found = collectives(compiled.as_text())
    sent = sum(v["sent_bytes"] for v in found.values())
    return {
        "layout": layout_spec + (" fsdp" if fsdp else ""), "phase": phase, "layers": config.num_hidden_layers,
        "weights": weights, **({"remat": remat} if phase in ("train", "lora") else {}),
        **({"lora_rank": lora_rank, "adapter_bytes": device_bytes(state.params)} if phase == "lora" else {}),
        "compile_s": round(seconds, 1),
        **{k: v for k, v in p.items() if k != "batch"},
        "batch": p["batch"],
        "argument_bytes": memory.argument_size_in_bytes, "temp_bytes": memory.temp_size_in_bytes,
        "output_bytes": memory.output_size_in_bytes, "weight_bytes": weight_bytes, "collectives": found,
        "floor_ms": 1e3 * (weight_bytes / HBM + sent / NVLINK),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, help="layers (default: the released 45)")
    parser.add_argument("--layouts", default="tp:8,tp-ep:8,dp-ep:8")
    parser.add_argument("--phases", default=PHASES, help="decode:BATCHxCACHED and prefill:TOKENS, comma-separated")
    parser.add_argument("--limit", type=float, default=1800, help="seconds a compile may take")
    parser.add_argument("--json", help="append each result as a line of JSON here")
    parser.add_argument("--weights", default="bf16", choices=["bf16", "fp8"], help="the converted linears' form")
    parser.add_argument("--devices", type=int, default=8, help="compile-only GPUs in the mesh")
    parser.add_argument("--fsdp", action="store_true", help="parameters and moments split over data as well")
    parser.add_argument("--remat", default="full", help="the train and lora phases' remat policy")
    parser.add_argument("--lora-rank", type=int, default=16, help="the lora phase's adapters' rank")
    parser.add_argument("--one", nargs=2, metavar=("LAYOUT", "PHASE"), help=argparse.SUPPRESS)
    add_results_argument(parser)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(compile_one(*args.one, args.layers, args.weights, args.devices, args.fsdp, args.remat,
                                     args.lora_rank)))
        return
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"  # for the children: the plugin's checks need a driver
    results = Results(args.results, device=DEVICE.format(args.devices))
    gib = 2**30
    print("| layout | phase | batch | args GiB/dev | temp GiB/dev | weights GiB/dev |"
          " collective MiB/dev sent (AR/AG/RS/A2A/CP) | floor ms | compile s |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    for layout in args.layouts.split(","):
        for phase in args.phases.split(","):
            cmd = [sys.executable, "-m", "bench.sharded_compile", "--one", layout, phase, "--weights", args.weights,
                   "--devices", str(args.devices), "--remat", args.remat, "--lora-rank", str(args.lora_rank)] + (
                      ["--fsdp"] if args.fsdp else []) + (
                      ["--layers", str(args.layers)] if args.layers else [])
            r = run_child(cmd, args.limit, f"{layout} | {phase}")
            if r is None:
                continue
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(r) + "\n")
            results.add(
                "sharded_compile", f"{r['layout']} {phase}, batch {r['batch']}, {r['layers']} layers"
                + (", fp8 weights" if args.weights == "fp8" else ""), r["compile_s"], unit="s",
                metric="XLA compile s on the host's CPU", floor_ms=r["floor_ms"], weight_bytes=r["weight_bytes"],
                argument_bytes=r["argument_bytes"], temp_bytes=r["temp_bytes"],
                sent_bytes={kind: r["collectives"][kind]["sent_bytes"] for kind in KINDS},
            )
            sent = "/".join(f"{r['collectives'][k]['sent_bytes'] / 2**20:.1f}" for k in KINDS)
            print(f"| {r['layout']} | {phase} | {r['batch']} | {r['argument_bytes'] / gib:.1f} | {r['temp_bytes'] / gib:.1f} | "
                  f"{r['weight_bytes'] / gib:.1f} | {sent} | {r['floor_ms']:.2f} | {r['compile_s']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
