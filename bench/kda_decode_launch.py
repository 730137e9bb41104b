"""Probe: two ways around the two-kernel decode step's overheads that need no new kernel, at H = 64,
D = 128 (ms per step from a profiler trace of 20 steps unrolled in one jit, the state donated, as
`bench/kda.py` times the step):

1. `token side`: the token vectors computed by XLA's own fusions of
   `kda.decode_token_vectors_reference` before `decode_update_mosaic.update_state`, against the Triton token
   kernel (`decode_update_mosaic.two_kernel_decode_step`). Every GPU kernel of a step is summed, since XLA names its
   fusions as it likes.
2. `cache preference`: the CUDA context's L1 / shared-memory preference, read after JAX has
   started, then set to prefer L1 and back to none (libcuda through ctypes), timing the fused Triton
   step, the two-kernel step and XLA's elementwise pass over the state under each. XLA launches
   Pallas Triton kernels with a 228 KiB shared-memory split (bench/RESULTS.md, fifteenth session);
   if that came from the context, a caller could change it.

    PYTHONPATH=$PWD:$PWD/bench python3 bench/kda_decode_launch.py [--batches 64,256]
"""

import argparse
import collections
import ctypes
import functools
import glob
import statistics
import tempfile

import jax
import kda as bench

from pallas_kernels import decode_fused_triton, decode_update_mosaic, kda

CACHE_CONFIGS = {0: "none", 1: "shared", 2: "L1", 3: "equal"}  # CUfunc_cache


def all_kernels_ms(call, carry, n=20):
    """GPU time per call of every kernel in n calls of `call(*carry) -> carry` unrolled in one jit,
    and {kernel name: (count, median ms)}."""
    run = jax.jit(lambda c: functools.reduce(lambda c, _: call(*c), range(n), c), donate_argnums=0)
    carry = jax.block_until_ready(run(tuple(x + 0 for x in carry)))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(run(carry))
        (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        data = jax.profiler.ProfileData.from_file(path)
    times = collections.defaultdict(list)
    for plane in data.planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                if "stream" in line.name.lower():
                    for event in line.events:
                        times[event.name].append(event.duration_ns / 1e6)
    parts = {name: (len(t), statistics.median(t)) for name, t in times.items()}
    return sum(sum(t) for t in times.values()) / n, parts


def steps(b, h=64, d=128):
    """(conv_state, state) and the three steps (conv_state, state) -> (conv_state, state)."""
    x = kda.random_decode_inputs(jax.random.key(0), b, h, d, state_scale=0.01)
    fixed = {k: v for k, v in x.items() if k not in ("conv_state", "state")}
    token_inputs = kda.decode_token_inputs(x)

    def xla_token_side(conv_state, state):
        vectors, conv_state = kda.decode_token_vectors_reference(
            token_inputs[0], conv_state, *token_inputs[2:], lower_bound=-5.0
        )
        return conv_state, decode_update_mosaic.update_state(vectors, state, out_dtype=x["qkv"].dtype)[1]

    def two_kernels(conv_state, state):
        return decode_update_mosaic.two_kernel_decode_step(conv_state=conv_state, state=state, **fixed, lower_bound=-5.0)[1:]

    def fused_triton(conv_state, state):
        return decode_fused_triton.fused_decode_step(conv_state=conv_state, state=state, **fixed, lower_bound=-5.0)[1:]

    return (x["conv_state"], x["state"]), xla_token_side, two_kernels, fused_triton


def token_side(batches):
    print("| B | step | ms per step (all kernels) | kernels: count x median ms |\n| --- | --- | --- | --- |")
    for b in batches:
        carry, xla_token_side, two_kernels, _ = steps(b)
        for name, step in (("Triton token kernel + update", two_kernels), ("XLA token fusions + update", xla_token_side)):
            total, parts = all_kernels_ms(step, carry)
            kernels = "; ".join(f"{k[:48]} {c} x {ms:.4f}" for k, (c, ms) in sorted(parts.items()))
            print(f"| {b} | {name} | {total:.4f} | {kernels} |", flush=True)


def cache_preference(batches):
    cuda = ctypes.CDLL("libcuda.so.1")

    def call(fn, *args):
        if (err := fn(*args)) != 0:
            raise RuntimeError(f"{fn.__name__} returned CUresult {err}")

    jax.block_until_ready(jax.numpy.ones(4))  # JAX's context exists from here
    device, context = ctypes.c_int(), ctypes.c_void_p()
    call(cuda.cuDeviceGet, ctypes.byref(device), 0)
    call(cuda.cuDevicePrimaryCtxRetain, ctypes.byref(context), device)
    call(cuda.cuCtxSetCurrent, context)

    def preference():
        config = ctypes.c_int()
        call(cuda.cuCtxGetCacheConfig, ctypes.byref(config))
        return CACHE_CONFIGS[config.value]

    print("\n| B | context preference | fused Triton step | two kernels | XLA pass over the state |\n| --- | --- | --- | --- | --- |")
    for b in batches:
        carry, _, two_kernels, fused_triton = steps(b)
        xla_pass = lambda state: (jax.lax.optimization_barrier(state * 0.999 + 1e-6),)  # noqa: E731
        for setting in (None, 2, 0):
            if setting is not None:
                call(cuda.cuCtxSetCacheConfig, ctypes.c_int(setting))
            fused = bench.kernel_ms(fused_triton, carry, "kda_decode_step")
            two = bench.kernel_ms(two_kernels, carry, ("kda_decode_token_vectors", "kda_decode_update"))
            floor = bench.kernel_ms(xla_pass, (carry[1],), "fusion")
            label = preference() + (" (as JAX left it)" if setting is None else "")
            print(f"| {b} | {label} | {fused:.4f} | {two:.4f} | {floor:.4f} |", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="64,256")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    print(f"jax {jax.__version__} {jax.devices()}")
    token_side(batches)
    cache_preference(batches)


if __name__ == "__main__":
    main()
