"""Registers, spills and shared memory of the Triton-backend KDA kernels (the fused decode step and
the token vectors before the Mosaic GPU update) for sm_90a, read on a machine with no GPU. (The
prefill scan's kernels are Mosaic GPU: their registers come from tools/kda_ptx.py on the GPU.)

Lowers the Pallas kernel to Triton IR with this project's JAX (as for an H200), compiles that IR
with the `triton` package in a second Python, and runs its ptxas -v. A lead, not a measurement:
XLA compiles the same IR through its own Triton pipeline on the GPU.

    python3.12 -m venv .venv-triton && .venv-triton/bin/pip install triton==3.6.0   # (pyenv: PYENV_VERSION=3.12.1)
    .venv/bin/python -m tools.kda_ptxas --triton-python .venv-triton/bin/python
"""

import argparse
import os
import subprocess
import sys
import tempfile


def compile_ir(path, warps, stages):
    """Run inside the triton Python: one line of readings for the kernel in `path`."""
    import triton
    from triton.backends.compiler import GPUTarget

    kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    ptx = kernel.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    report = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    lines = [line.split("info    :")[-1].strip() for line in report.stderr.splitlines() if "registers" in line or "spill" in line]
    counts = ", ".join(f"{name} {ptx.count(name)}" for name in ("wgmma.mma_async", "mma.sync"))
    print(f"shared {kernel.metadata.shared} B; {'; '.join(lines)}; {counts}")


def lowered_kernels(decode_block_v):
    """{name: Triton IR text} of the decode step's Triton kernels, for an H200."""
    import jax
    import jax.numpy as jnp
    from jax._src.pallas.triton import gpu_info, pallas_call_registration

    from pallas_kernels.kda import decode_fused_triton

    gpu_info.get_gpu_info = lambda: gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200)
    modules = []
    lower = pallas_call_registration.lowering.lower_jaxpr_to_triton_module

    def keep(*args, **kwargs):
        result = lower(*args, **kwargs)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    pallas_call_registration.lowering.lower_jaxpr_to_triton_module = keep
    b, h, d = 1, 2, 128
    c = h * d
    token_args = (
        jnp.zeros((b, 3, c), jnp.bfloat16), jnp.zeros((b, 3, c, 4), jnp.bfloat16), jnp.zeros((4, 3, c)),
        jnp.zeros((b, c), jnp.bfloat16), jnp.zeros((c,)), jnp.zeros((h,)), jnp.zeros((b, h), jnp.bfloat16),
    )
    step = jax.jit(lambda *a: decode_fused_triton.fused_decode_step(*a, lower_bound=-5.0, block_v=decode_block_v))
    step.trace(*token_args, jnp.zeros((b, h, d, d))).lower(lowering_platforms=("cuda",))
    token_vectors = jax.jit(lambda *a: decode_fused_triton.token_vectors(*a, lower_bound=-5.0))
    token_vectors.trace(*token_args).lower(lowering_platforms=("cuda",))
    return dict(zip(["kda_decode_step", "kda_decode_token_vectors"], modules, strict=True))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--triton-python", help="a Python with triton 3.6 (see the docstring)")
    parser.add_argument("--decode-block-v", type=int, default=64)
    parser.add_argument("--launches", default="kda_decode_step:4:1,kda_decode_step:8:1,kda_decode_token_vectors:4:1",
                        help="kernel:num_warps:num_stages, comma separated")
    parser.add_argument("--compile", nargs=3, metavar=("IR", "WARPS", "STAGES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compile:
        compile_ir(args.compile[0], int(args.compile[1]), int(args.compile[2]))
        return
    modules = lowered_kernels(args.decode_block_v)
    print(f"decode value columns {args.decode_block_v}")
    print("| kernel | warps | stages | readings |\n| --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for launch in args.launches.split(","):
            name, warps, stages = launch.split(":")
            path = os.path.join(tmp, f"{name}.ttir")
            with open(path, "w") as f:
                f.write(modules[name])
            out = subprocess.run([args.triton_python, __file__, "--compile", path, warps, stages], capture_output=True, text=True)
            reading = out.stdout.strip() or out.stderr.strip().splitlines()[-1]
            print(f"| {name} | {warps} | {stages} | {reading} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
