"""Where the KDA prefill scan spends its time on the GPU: the Mosaic GPU intra kernel alone and the
whole scan (the difference is the chain), for each chain config asked for.

    PYTHONPATH=$PWD:$PWD/bench python3 bench/kda_parts.py [--shape B,T,H] [--configs default,...]
"""

import argparse

import jax
import jax.numpy as jnp
import kda as bench

from pallas_kernels.kda import prefill_chain_mosaic


def time_parts(shape, cfg, label, interpret=False):
    b, t, h, d = shape
    q, k, v, g, beta = bench.to_jax(*bench.prefill_inputs(b, t, h, d))
    lengths = jnp.full((b,), t, jnp.int32)
    s0 = jnp.zeros((b, h, d, d), jnp.float32)
    scan = jax.jit(lambda *a: prefill_chain_mosaic.chunk_scan(*a, out_dtype=jnp.bfloat16, interpret=interpret, **cfg))
    intra = bench.intra_ms(q, k, v, g, beta, interpret)
    total = bench.dispatched_ms(scan, q, k, v, g, beta, s0, lengths)
    bench.log(f"{label:12s} B={b} T={t} H={h}: scan {total:.3f} ms = intra {intra:.3f} + chain {total - intra:.3f}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="1,16384,16")
    parser.add_argument("--configs", default="default")
    parser.add_argument("--interpret", action="store_true", help="CPU smoke run in the Pallas interpreter")
    args = parser.parse_args()
    shape = tuple(int(x) for x in args.shape.split(",")) + (128,)
    for name in args.configs.split(","):
        time_parts(shape, bench.CONFIGS[name], name, args.interpret)


if __name__ == "__main__":
    main()
