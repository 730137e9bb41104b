"""The released-size text model on several GPUs, per layout, through the library's entry points
(`load_checkpoint(..., layout=)`, `prefill`, `decode_step`, `generate`), each number beside the
floor of the same compiled step (as bench/sharded_compile.py computes it: weight bytes a device over
HBM, plus the bytes its collectives send over NVLink) and the ratio.

    python -m bench.sharded_gpu plan [--layers 45]               # the memory plan, no GPU needed
    python -m bench.sharded_gpu run --checkpoint DIR [--layouts tp:8,tp-ep:8,dp-ep:8]
        [--phases load,prefill,decode,check] [--layers 45] [--prefills 8192,32768]
        [--decodes 1x4096,64x4096,256x4096,1x32768,64x32768,256x32768] [--results bench/results.jsonl]

Phases, each layout's in a child process of its own (its memory, and a failure, its own):
- load: `checkpoints/make_random.py` writes a release-format checkpoint of the released widths
  with `--load-layers` layers (default 12: 128.6 GiB) into DIR/load (once);
  `load_checkpoint(DIR/load, layout=)`: seconds, peak host memory (VmHWM of the loading process),
  memory per GPU after it. The released 45 layers
  (585 GiB of bf16 files) do not fit an 8-GPU machine's 235 GB disk: the load is measured on the
  layers that fit and reported per layer as well.
- prefill: the whole model's random params made on the GPUs (`init_params` jitted onto the layout);
  `prefill` of batch 1 (a layout that splits the batch: one sequence a batch shard) at each length of
  `--prefills` into an fp8 latent cache: median ms, tokens/s, memory per GPU after it.
- decode: a cache holding C tokens of random content per sequence (lengths and indexer lengths
  C, fp8 latents), `decode_step` (host checks included) and `decode_unchecked` at each BxC of
  `--decodes`: median ms a step, tokens/s (B / step), memory per GPU.
- check: a 4-layer model of the released widths (`make_random.py --layers 4` into DIR/check) loaded
  onto one GPU and onto the layout in fp32 (`--check-dtype`): forward logits' relative difference
  (max|d| / max|one GPU|) and the share of equal greedy tokens over `generate` of 32 tokens for 8
  prompts of 16-512 tokens.
Before each step the compiled executable's memory (`memory_analysis`: arguments + temporaries +
outputs) is checked against the GPU's; a step that does not fit is reported and skipped.

`plan` prints, per layout, weights and cache bytes per GPU for each decode shape from the shapes
and the layout's rules (no compile): what fits 139 GiB and what does not.

`plan` and the dry run need 8 devices: on a machine without GPUs, 8 CPU host devices, with `--set` to
shrink the config for the dry run (`--dry-run`: `DRY_RUN`'s changes):
    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python -m bench.sharded_gpu plan
    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python -m bench.sharded_gpu run \\
        --checkpoint /tmp/dry --layers 8 --load-layers 4 --prefills 256 --decodes 8x256 --results none --dry-run
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from bench.common import HBM, ROOT, Results, add_results_argument, median_ms, run_child

NVLINK = 450e9  # bytes/s a direction, as bench/sharded_compile.py
GPU_BYTES = 139 * 2**30  # an H200's usable memory
PREFILLS = "8192,32768"
DECODES = "1x4096,64x4096,256x4096,1x32768,64x32768,256x32768"
PAGE = 64
# The dry run's config (--set each): the released layer order at small widths.
DRY_RUN = ["hidden_size=256", "intermediate_size=512", "n_routed_experts=16", "moe_intermediate_size=64", "vocab_size=1024",
           "linear_num_heads=8", "linear_head_dim=64", "num_attention_heads=8", "num_key_value_heads=8", "q_lora_rank=128",
           "kv_lora_rank=64", "qk_nope_head_dim=32", "v_head_dim=32", "index_topk=32", "index_n_heads=4", "index_head_dim=32"]


def config_for(layers, settings):
    import glm5next_jax

    changes = {k: _value(v) for k, v in (s.split("=", 1) for s in settings)}
    if layers is not None:
        changes["num_hidden_layers"] = layers
    return glm5next_jax.Config(**changes)


def _value(text):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def device_memory():
    """The most bytes in use on any local device (None where the runtime does not say: CPU)."""
    import jax

    stats = [d.memory_stats() for d in jax.local_devices()]
    return max((s["bytes_in_use"] for s in stats if s), default=None)


def floor_ms(compiled, params):
    """Weight bytes a device over HBM plus the bytes its collectives send over NVLink, in ms."""
    from bench.sharded_compile import collectives
    from glm5next_jax.sharding import device_bytes

    sent = sum(v["sent_bytes"] for v in collectives(compiled.as_text()).values())
    return 1e3 * (device_bytes(params) / HBM + sent / NVLINK)


def fits(compiled, limit):
    """(fits, bytes): the executable's arguments, temporaries and outputs a device against `limit`."""
    m = compiled.memory_analysis()
    if m is None:
        return True, None
    total = m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    return total <= limit, total


def random_params(config, layout, seed=0):
    """`init_params` made directly in the layout's shards."""
    import jax

    import glm5next_jax
    from glm5next_jax.sharding import param_shardings

    shardings = param_shardings(config, layout)
    make = jax.jit(lambda key: glm5next_jax.init_params(config, key, "bfloat16"), out_shardings=shardings)
    return jax.block_until_ready(make(jax.random.key(seed)))


def filled_cache(config, batch, cached, layout, seed=0):
    """A cache whose sequences hold `cached` tokens of random content (fp8 latents), room for 64 more."""
    import jax
    import jax.numpy as jnp

    import glm5next_jax
    from glm5next_jax.cache import cache_axes

    max_len = cached + PAGE
    empty = jax.eval_shape(lambda: glm5next_jax.init_cache(config, batch, max_len, latent_dtype="float8_e4m3fn"))
    shardings = layout.shardings(cache_axes(empty))

    def fill(key):
        cache = glm5next_jax.init_cache(config, batch, max_len, latent_dtype="float8_e4m3fn")
        leaves, treedef = jax.tree_util.tree_flatten_with_path(cache)
        keys = jax.random.split(key, len(leaves))
        out = []
        for (path, x), k in zip(leaves, keys):
            name = jax.tree_util.keystr(path[-1:])
            if name in ("['lengths']", "['indexer_length']"):
                x = jnp.full(x.shape, cached, x.dtype)
            elif name == "['latent_scale']":
                x = jax.random.uniform(k, x.shape, x.dtype, 0.005, 0.02)
            elif name in ("['latent']", "['index_k']", "['index_gate']", "['pool_keys']", "['conv']", "['state']"):
                x = (jax.random.normal(k, x.shape, jnp.float32) * (32.0 if name == "['latent']" else 0.1)).astype(x.dtype)
            out.append(x)
        return jax.tree.unflatten(treedef, out)

    return jax.jit(fill, out_shardings=shardings)(jax.random.key(seed))


def run_load(args, layout_spec):
    import jax

    import glm5next_jax
    from glm5next_jax.sharding import device_bytes, make_layout

    path = os.path.join(args.checkpoint, "load")
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM from here on
        f.write("5")
    start = time.perf_counter()
    config, params = glm5next_jax.load_checkpoint(path, layout=make_layout(layout_spec))
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    files = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    return [dict(phase="load", shape=f"{config.num_hidden_layers} layers, {files / 2**30:.1f} GiB of files",
                 seconds=seconds, seconds_per_layer=seconds / config.num_hidden_layers, host_peak_bytes=peak,
                 device_bytes=device_memory() or device_bytes(params))]


def run_prefill(args, layout_spec):
    import glm5next_jax
    from glm5next_jax import inference
    from glm5next_jax.sharding import device_bytes, make_layout, shard_batch

    layout = make_layout(layout_spec)
    config = config_for(args.layers, args.set)
    params = random_params(config, layout)
    held = device_memory() or device_bytes(params)
    rows = [dict(phase="params", shape=f"{config.num_hidden_layers} layers", device_bytes=held)]
    for tokens in map(int, filter(None, args.prefills.split(","))):
        batch = max(1, layout.size("batch"))
        shape = f"prefill B={batch} T={tokens}"
        ids = np.random.default_rng(tokens).integers(2, config.vocab_size, (batch, tokens)).astype(np.int32)
        cache = glm5next_jax.init_cache(config, batch, tokens, latent_dtype="float8_e4m3fn", layout=layout)
        inputs = [shard_batch(x, layout) for x in (ids, np.ones(ids.shape, bool), np.zeros(batch, np.int32))]
        compiled = inference._prefill.trace(params, config, *inputs, cache, None, False, layout).lower().compile()
        ok, need = fits(compiled, args.gpu_bytes)
        if not ok:
            rows.append(dict(phase="prefill", shape=shape, skipped=f"needs {need / 2**30:.1f} GiB a device"))
            continue
        floor = floor_ms(compiled, params)

        def step(ids=ids, cache=cache):
            return glm5next_jax.prefill(params, config, ids, None, cache, layout=layout)[0]

        ms = median_ms(step, args.repeats)
        rows.append(dict(phase="prefill", shape=shape, ms=ms, tokens_per_s=batch * tokens / ms * 1e3, floor_ms=floor,
                         ratio=ms / floor, device_bytes=device_memory() or need))
        del cache
    return rows


def run_decode(args, layout_spec):
    import jax

    import glm5next_jax
    from glm5next_jax import inference
    from glm5next_jax.sharding import make_layout, shard_batch

    layout = make_layout(layout_spec)
    config = config_for(args.layers, args.set)
    params = random_params(config, layout)
    rows = []
    for text in filter(None, args.decodes.split(",")):
        batch, cached = map(int, text.split("x"))
        shape = f"decode B={batch} over {cached} cached"
        if batch % layout.size("batch"):
            rows.append(dict(phase="decode", shape=shape, skipped=f"batch {batch} does not split over {layout.size('batch')}"))
            continue
        empty = jax.eval_shape(lambda b=batch, c=cached: filled_cache(config, b, c, layout))
        tokens = shard_batch(np.full(batch, 7, np.int32), layout)
        compiled = inference._decode.trace(params, config, tokens, empty, None, False, layout).lower().compile()
        ok, need = fits(compiled, args.gpu_bytes)
        if not ok:
            rows.append(dict(phase="decode", shape=shape, skipped=f"needs {need / 2**30:.1f} GiB a device"))
            continue
        floor = floor_ms(compiled, params)
        cache = filled_cache(config, batch, cached, layout)
        held = {"cache": cache}

        def checked(held=held, batch=batch):
            logits, held["cache"] = glm5next_jax.decode_step(params, config, np.full(batch, 7), held["cache"], layout=layout)
            return logits

        def unchecked(held=held, tokens=tokens):
            logits, held["cache"] = inference.decode_unchecked(params, config, tokens, held["cache"], layout=layout)
            return logits

        # Each call adds a token: at most PAGE - 2 steps fit the cache's room beyond `cached`.
        n = min(args.repeats, (PAGE - 2) // 2 - 1)
        ms = median_ms(checked, n)
        ms_unchecked = median_ms(unchecked, n)
        rows.append(dict(phase="decode", shape=shape, ms=ms, ms_unchecked=ms_unchecked, tokens_per_s=batch / ms * 1e3,
                         floor_ms=floor, ratio=ms_unchecked / floor, device_bytes=device_memory() or need))
        del held, cache
    return rows


def run_check(args, layout_spec):
    import jax

    import glm5next_jax
    from glm5next_jax.sharding import make_layout

    path = os.path.join(args.checkpoint, "check")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 1000, n).tolist() for n in (512, 384, 200, 64, 500, 300, 100, 16)]
    ids = np.zeros((len(prompts), 512), np.int32)
    mask = np.zeros((len(prompts), 512), np.int32)
    for i, p in enumerate(prompts):  # left-padded
        ids[i, 512 - len(p):], mask[i, 512 - len(p):] = p, 1
    out = {}
    for spec in ("one", layout_spec):
        layout = None if spec == "one" else make_layout(spec)
        config, params = glm5next_jax.load_checkpoint(path, args.check_dtype, layout=layout)
        logits = np.asarray(glm5next_jax.forward(params, config, ids, mask, layout=layout), np.float64)
        tokens = np.asarray(glm5next_jax.generate(params, config, prompts, 32, layout=layout).tokens)
        out[spec] = (logits, tokens)
        del params
        jax.clear_caches()
    (one, one_tokens), (many, many_tokens) = out["one"], out[layout_spec]
    real = mask.astype(bool)
    error = float(np.abs(many[real] - one[real]).max() / np.abs(one[real]).max())
    return [dict(phase="check", shape=f"4 layers, {config.hidden_size} wide, {args.check_dtype}, 8 prompts, 32 greedy tokens",
                 logits_relative_difference=error, equal_greedy_tokens=float((many_tokens == one_tokens).mean()))]


PHASES = {"load": run_load, "prefill": run_prefill, "decode": run_decode, "check": run_check}


def make_checkpoints(args):
    """The load and check checkpoints, written once (make_random.py: one tensor at a time)."""
    for name, layers in (("load", args.load_layers), ("check", 4)):
        path = os.path.join(args.checkpoint, name)
        if os.path.exists(os.path.join(path, "model.safetensors.index.json")):
            continue
        start = time.perf_counter()
        subprocess.run([sys.executable, os.path.join(ROOT, "checkpoints", "make_random.py"), path, "--layers", str(layers),
                        *(f"--set={s}" for s in args.set)], check=True)
        print(f"wrote {path} ({layers} layers) in {time.perf_counter() - start:.0f} s", flush=True)


def plan(args):
    """Weights and caches per device, by the layout's rules, for each decode shape."""
    import jax

    import glm5next_jax
    from glm5next_jax.cache import cache_axes
    from glm5next_jax.params import param_axes, param_shapes
    from glm5next_jax.sharding import device_bytes, make_layout, placed

    config = config_for(args.layers, args.set)
    print("| layout | weights GiB/GPU | " + " | ".join(f"cache B x C = {d} GiB/GPU" for d in args.decodes.split(",")) + " |")
    print("|---" * (2 + len(args.decodes.split(","))) + "|")
    for spec in args.layouts.split(","):
        layout = make_layout(spec)
        weights = device_bytes(placed(param_shapes(config, "bfloat16"), param_axes(config), layout))
        cells = []
        for text in args.decodes.split(","):
            batch, cached = map(int, text.split("x"))
            if batch % layout.size("batch"):
                cells.append("-")
                continue
            cache = jax.eval_shape(lambda b=batch, c=cached: glm5next_jax.init_cache(
                config, b, c + PAGE, latent_dtype="float8_e4m3fn"))
            size = device_bytes(placed(cache, cache_axes(cache), layout))
            cells.append(f"{size / 2**30:.1f}{'' if weights + size <= args.gpu_bytes else ' (does not fit)'}")
        print(f"| {spec} | {weights / 2**30:.1f} | " + " | ".join(cells) + " |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("plan", "run", "one"))
    parser.add_argument("--checkpoint", help="folder for the written checkpoints (DIR/load, DIR/check)")
    parser.add_argument("--layouts", default="tp:8,tp-ep:8,dp-ep:8")
    parser.add_argument("--phases", default="load,prefill,decode,check")
    parser.add_argument("--layers", type=int, help="layers of the prefill and decode model (default: the released 45)")
    parser.add_argument("--load-layers", type=int, default=12, help="layers of the load test's checkpoint")
    parser.add_argument("--set", action="append", default=[], help="a config change NAME=VALUE (repeatable)")
    parser.add_argument("--dry-run", action="store_true", help="the DRY_RUN config changes (small widths)")
    parser.add_argument("--prefills", default=PREFILLS)
    parser.add_argument("--decodes", default=DECODES, help="BATCHxCACHED, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--check-dtype", default="float32", help="the check phase's params (float32: the same function)")
    parser.add_argument("--gpu-bytes", type=float, default=GPU_BYTES)
    parser.add_argument("--limit", type=float, default=1800, help="seconds a child may take")
    parser.add_argument("--one", nargs=2, metavar=("LAYOUT", "PHASE"), help=argparse.SUPPRESS)
    add_results_argument(parser)
    args = parser.parse_args()
    if args.dry_run:
        args.set = DRY_RUN + args.set
    if args.command == "plan":
        return plan(args)
    if args.command == "one":
        print(json.dumps(PHASES[args.one[1]](args, args.one[0])))
        return
    if args.checkpoint is None:
        parser.error("run needs --checkpoint DIR")
    phases = [p for p in args.phases.split(",") if p]
    if {"load", "check"} & set(phases):
        make_checkpoints(args)
    results = Results(args.results)
    passed = sys.argv[2:]
    print("| layout | phase | shape | ms | tokens/s | floor ms | ratio | GiB a GPU | other |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    for layout in args.layouts.split(","):
        for phase in phases:
            cmd = [sys.executable, "-m", "bench.sharded_gpu", "one", "--one", layout, phase, *passed]
            for row in run_child(cmd, args.limit, f"{layout} | {phase}") or []:
                report(results, layout, row)


def report(results, layout, row):
    gib = row.get("device_bytes")
    gib = "" if gib is None else f"{gib / 2**30:.1f}"
    known = {"phase", "shape", "ms", "tokens_per_s", "floor_ms", "ratio", "device_bytes"}
    other = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items() if k not in known)
    cells = [f"{row[k]:.4g}" if k in row else "" for k in ("ms", "tokens_per_s", "floor_ms", "ratio")]
    print(f"| {layout} | {row['phase']} | {row['shape']} | " + " | ".join(cells) + f" | {gib} | {other} |", flush=True)
    measures = {  # the row's value: (field, unit, metric)
        "load": ("seconds", "s", "seconds to load onto the layout"),
        "prefill": ("ms", "ms", "median ms a prefill call"),
        "decode": ("ms", "ms", "median ms a decode_step call (host checks included)"),
        "check": ("logits_relative_difference", "relative", "max|d| / max|one GPU| of the logits, the layout vs one GPU"),
    }
    if row["phase"] not in measures or measures[row["phase"]][0] not in row:
        return
    field, unit, metric = measures[row["phase"]]
    results.add(
        f"sharded_{row['phase']}", f"{layout}, {row['shape']}", row[field], unit=unit, metric=metric,
        roofline=row.get("floor_ms"), **{k: v for k, v in row.items() if k not in ("phase", "shape", field, "floor_ms")},
    )


if __name__ == "__main__":
    main()
