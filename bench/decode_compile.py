"""How long XLA takes to compile the model's decode step on the GPU, kernels path, from abstract
shapes (no prefill, no data): bench/model_gpu.py's wider configs, batch 8 over 4096 + 64 cached.
Each compile runs in a child process under a time limit, so that one that hangs (the twenty-ninth
session saw the dense config's step not compiled after 380 s) leaves the others measured.

    PYTHONPATH=$PWD:$PWD/bench python3 bench/decode_compile.py [--mlps dense,moe] [--limit 150] [--dump DIR]

Copied into a checkout of another commit (bench/stage_branches.sh) and run there, it compiles that
commit's step: it needs only `model_gpu.wider_config` and `inference._decode(params, config,
token_ids, cache, implementation)` beside it. Settings: XLA's defaults, the GEMM autotuner off
(`xla_gpu_autotune_level` 0, which tells an autotuning stall from another), and cuBLAS for every
dot (no Triton GEMM fusions). With --dump DIR, XLA writes the module after each of its passes under
DIR/<config>-<setting>/, and a compile cut by the limit is reported with the last files written
(the pass where it stalled).
"""

import json
import os
import re
import subprocess
import sys
import time

SETTINGS = {
    "XLA's defaults": {},
    "autotuner off": {"xla_gpu_autotune_level": 0},
    "no Triton GEMMs": {"xla_gpu_enable_triton_gemm": False},
}


def compile_seconds(mlps, options):
    """Seconds to lower and compile `inference._decode` for `mlps`' config with `options`."""
    import jax
    import jax.numpy as jnp

    import glm5next_jax
    from glm5next_jax import inference
    from model_gpu import wider_config

    config = wider_config(mlps)
    params = jax.eval_shape(lambda: glm5next_jax.init_params(config, jax.random.key(0), "bfloat16"))
    cache = jax.eval_shape(
        lambda: glm5next_jax.init_cache(config, 8, 4096 + 64, dtype="bfloat16", latent_dtype="float8_e4m3fn")
    )
    tokens = jax.ShapeDtypeStruct((8,), jnp.int32)
    start = time.perf_counter()
    lowered = inference._decode.lower(params, config, tokens, cache, "pallas")
    lowered_s = time.perf_counter() - start
    lowered.compile(compiler_options=options)
    return lowered_s, time.perf_counter() - start - lowered_s


def last_passes(dump_dir, n=3):
    """', last written: <the n newest files of an XLA pass dump>' ('' without a dump)."""
    if not dump_dir or not os.path.isdir(dump_dir):
        return ""
    files = sorted(os.listdir(dump_dir), key=lambda f: os.path.getmtime(os.path.join(dump_dir, f)))
    return ", last written: " + " ; ".join(files[-n:])


def main():
    args = sys.argv[1:]
    if args[:1] == ["--one"]:  # the child: one config and setting, seconds as JSON on the last line
        print(json.dumps(compile_seconds(args[1], json.loads(args[2]))))
        return
    mlps_configs = args[args.index("--mlps") + 1].split(",") if "--mlps" in args else ["dense", "moe"]
    limit = float(args[args.index("--limit") + 1]) if "--limit" in args else 150.0
    dump = args[args.index("--dump") + 1] if "--dump" in args else None
    print("| config | setting | lowering s | XLA compile s |\n|---|---|---|---|", flush=True)
    for mlps in mlps_configs:
        for name, options in SETTINGS.items():
            dump_dir = os.path.join(dump, f"{mlps}-{re.sub(r'[^a-z]+', '_', name.lower())}") if dump else None
            if dump_dir:
                options = dict(options, xla_dump_to=dump_dir, xla_dump_hlo_pass_re=".*")
            try:
                done = subprocess.run(
                    [sys.executable, __file__, "--one", mlps, json.dumps(options)],
                    capture_output=True, text=True, timeout=limit,
                )
            except subprocess.TimeoutExpired:
                print(f"| {mlps} | {name} | | not done in {limit:.0f} s{last_passes(dump_dir)} |", flush=True)
                continue
            if done.returncode:
                errors = [line for line in done.stderr.splitlines() if "Error" in line] or done.stderr.splitlines()[-1:]
                print(f"| {mlps} | {name} | | failed: {errors[-1][:200]} |", flush=True)
                continue
            lowered_s, compile_s = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"| {mlps} | {name} | {lowered_s:.1f} | {compile_s:.1f} |", flush=True)


if __name__ == "__main__":
    main()
