"""How long XLA takes to compile the model's decode step on the GPU, kernels path, from abstract
shapes (no prefill, no data): bench/model_gpu.py's wider configs, batch 8 over 4096 + 64 cached.
Each compile runs in a child process under a time limit, so that one that hangs leaves the others
measured (a compile that priority fusion stalls in can take many minutes).

    python -m bench.decode_compile [--mlps dense,moe] [--settings defaults,...] [--limit 150] [--dump DIR]
        [--results bench/results.jsonl]

With --deviceless it compiles for a compile-only H200 on a machine without a GPU (the GEMM
autotuner off, as it runs its candidates on the GPU), in an environment with JAX's CUDA plugin:
    PYENV_VERSION=3.12.1 python3.12 -m venv .venv-gpu-compile
    .venv-gpu-compile/bin/pip install "jax[cuda12]==0.11.2" -e .
    .venv-gpu-compile/bin/python -m bench.decode_compile --deviceless --mlps dense

It needs only `model_gpu.wider_config` and `inference._decode(params, config, token_ids, cache,
implementation)`, so copied into a checkout of another commit (tools/stage_branches.sh) it compiles
that commit's step. Settings (`SETTINGS`): XLA's defaults, the GEMM autotuner off
(`xla_gpu_autotune_level` 0, which tells an autotuning stall from another), and cuBLAS for every dot
(no Triton GEMM fusions). With --dump DIR, XLA writes the module after each of its passes under
DIR/<config>-<setting>/, and a compile cut by the limit is reported with the last files written
(the pass where it stalled). Rows for bench/results.jsonl: op `decode_compile` per config and
setting, in seconds (ours: XLA's compile; `lowering_s` beside it); a deviceless run's rows name a
compile-only device.
"""

import argparse
import json
import os
import subprocess
import sys
import time

from bench.common import ROOT, Results, add_results_argument

SETTINGS = {  # --settings picks among them by name (all by default)
    "defaults": {},
    "autotuner-off": {"xla_gpu_autotune_level": 0},
    "no-triton-gemms": {"xla_gpu_enable_triton_gemm": False},
}


# The H200's properties as XLA's GPU compiler reads them (a GpuTargetConfigProto): for --deviceless.
H200_TARGET = """gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 shared_memory_per_block_optin: 232448 threads_per_core_limit: 2048
  core_count: 132 fpus_per_core: 128 registers_per_core_limit: 65536 registers_per_block_limit: 65536
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 151397597184
  cuda_compute_capability { major: 9 feature_extension: ACCELERATED_FEATURES }
}
runtime_version { major: 12 minor: 8 }
dnn_version_info { major: 9 minor: 10 }
platform_name: "CUDA"
device_description_str: "NVIDIA H200"
"""


DEVICELESS = "compile-only NVIDIA H200 (no GPU)"


def compile_only_h200():
    """A sharding on a compile-only H200 (no GPU needed; JAX's CUDA plugin must be installed), with
    that device made JAX's default, so that the Pallas kernels lower for it."""
    import jax
    import numpy as np
    from jax.experimental import topologies

    topology = topologies.get_topology_desc("h200", "cuda", target_config=H200_TARGET, topology="1x1x1")
    jax.config.update("jax_default_device", topology.devices[0])
    # The library makes its GPU-only choices (the latent attention's split of a decode query) by the
    # default backend, which stays "cpu" on a machine without a GPU.
    jax.default_backend = lambda: "gpu"
    mesh = jax.sharding.Mesh(np.array(topology.devices[:1]), ("x",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def compile_seconds(mlps, options, deviceless=False):
    """(seconds to lower, seconds to compile, device) of `inference._decode` for `mlps`' config with
    `options`."""
    if deviceless:
        os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"  # the plugin's checks need a driver
    import jax
    import jax.numpy as jnp

    import glm5next_jax
    from bench.model_gpu import wider_config
    from glm5next_jax import inference

    sharding = compile_only_h200() if deviceless else None
    config = wider_config(mlps)

    def shapes(tree):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)

    params = shapes(jax.eval_shape(lambda: glm5next_jax.init_params(config, jax.random.key(0), "bfloat16")))
    cache = shapes(jax.eval_shape(
        lambda: glm5next_jax.init_cache(config, 8, 4096 + 64, dtype="bfloat16", latent_dtype="float8_e4m3fn")
    ))
    tokens = jax.ShapeDtypeStruct((8,), jnp.int32, sharding=sharding)
    start = time.perf_counter()
    lowered = inference._decode.trace(params, config, tokens, cache, "pallas").lower(lowering_platforms=("cuda",))
    lowered_s = time.perf_counter() - start
    if deviceless:  # the autotuner runs candidates on a GPU
        options = dict({"xla_gpu_autotune_level": 0}, **options)
    lowered.compile(compiler_options=options)
    device = DEVICELESS if deviceless else jax.devices()[0].device_kind
    return lowered_s, time.perf_counter() - start - lowered_s, device


def last_passes(dump_dir, n=3):
    """', last written: <the n newest files of an XLA pass dump>' ('' without a dump)."""
    if not dump_dir or not os.path.isdir(dump_dir):
        return ""
    files = sorted(os.listdir(dump_dir), key=lambda f: os.path.getmtime(os.path.join(dump_dir, f)))
    return ", last written: " + " ; ".join(files[-n:])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mlps", default="dense,moe", help="the wider configs: dense, moe or both")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"XLA settings by name, among {list(SETTINGS)}")
    parser.add_argument("--limit", type=float, default=150.0, help="seconds a compile may take")
    parser.add_argument("--dump", metavar="DIR", help="XLA's per-pass dumps here")
    parser.add_argument("--deviceless", action="store_true", help="compile for a compile-only H200 (no GPU)")
    parser.add_argument("--one", nargs=2, metavar=("MLPS", "OPTIONS"), help=argparse.SUPPRESS)
    add_results_argument(parser)
    args = parser.parse_args()
    if args.one:  # the child: one config and setting, its seconds as JSON on the last line
        print(json.dumps(compile_seconds(args.one[0], json.loads(args.one[1]), deviceless=args.deviceless)))
        return
    chosen = args.settings.split(",")
    unknown = set(chosen) - set(SETTINGS)
    if unknown:
        raise SystemExit(f"--settings takes names among {list(SETTINGS)}, got {sorted(unknown)}")
    # Deviceless, the autotuner is off in every setting (compile_seconds), so that one is the defaults.
    settings = {name: SETTINGS[name] for name in chosen if not (args.deviceless and name == "autotuner-off")}
    if args.deviceless:
        os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"  # for the children: the plugin's checks need a driver
    results = None  # made once a child has said which device it compiled for (this process leaves the GPU alone)
    print("| config | setting | lowering s | XLA compile s |\n|---|---|---|---|", flush=True)
    for mlps in args.mlps.split(","):
        for name, options in settings.items():
            dump_dir = os.path.join(args.dump, f"{mlps}-{name}") if args.dump else None
            if dump_dir:
                options = dict(options, xla_dump_to=dump_dir, xla_dump_hlo_pass_re=".+")  # ".*": changed passes only
            try:
                done = subprocess.run(
                    [sys.executable, "-m", "bench.decode_compile", "--one", mlps, json.dumps(options)]
                    + ["--deviceless"] * args.deviceless,
                    capture_output=True, text=True, timeout=args.limit, cwd=ROOT,
                )
            except subprocess.TimeoutExpired:
                print(f"| {mlps} | {name} | | not done in {args.limit:.0f} s{last_passes(dump_dir)} |", flush=True)
                continue
            if done.returncode:
                errors = [line for line in done.stderr.splitlines() if "Error" in line] or done.stderr.splitlines()[-1:]
                print(f"| {mlps} | {name} | | failed: {errors[-1][:200]} |", flush=True)
                continue
            lowered_s, compile_s, device = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"| {mlps} | {name} | {lowered_s:.1f} | {compile_s:.1f} |", flush=True)
            results = results or Results(args.results, device=device)
            results.add(
                "decode_compile", f"{mlps} MLPs" + ("" if name == "defaults" else f", {name}"), compile_s, unit="s",
                metric="XLA compile s of the decode step (kernels path, batch 8 over 4096 cached), from abstract shapes",
                lowering_s=lowered_s,
            )


if __name__ == "__main__":
    main()
