"""The prefill scan in several chain configs side by side on the GPU: for each shape, each config's
median time, its error against the fp32 jnp reference (o as bf16, max|d| / max|ref|), and how far
each config's o and state are from the first config's (0 where a change must not alter the numbers,
e.g. the chain's buffering or its multicast).

    PYTHONPATH=$PWD:$PWD/bench python3 bench/kda_configs.py [--shapes "B,T,H;..."] [--configs default,mc,...]

(`--interpret`: one small shape on the CPU, to check the script. `--digests N`: also run each config N
times more and print the sha256 of each run's o and state, so that two checkouts can be compared bit
for bit, and a race shows as digests that differ between runs.)
"""

import argparse
import hashlib

import jax
import jax.numpy as jnp
import kda as bench
import numpy as np

from pallas_kernels import kda, prefill_chain_mosaic


def digest(*arrays):
    return "/".join(hashlib.sha256(np.asarray(x).tobytes()).hexdigest()[:12] for x in arrays)


def compare(shape, names, interpret, digests=0):
    b, t, h, d = shape
    q, k, v, g, beta = bench.to_jax(*bench.prefill_inputs(b, t, h, d))
    o_ref, s_ref = jax.jit(kda.kda_chunk_scan_reference)(q.astype(jnp.float32), k, v, g, beta)
    s0, lengths = jnp.zeros((b, h, d, d), jnp.float32), jnp.full((b,), t, jnp.int32)
    first = None
    for name in names:
        cfg = bench.CONFIGS[name]
        scan = jax.jit(lambda q, k, v, g, beta, cfg=cfg: prefill_chain_mosaic.chunk_scan(
            q, k, v, g, beta, s0, lengths, out_dtype=jnp.bfloat16, interpret=interpret, **cfg))
        o, s = scan(q, k, v, g, beta)
        runs = [(lambda o, s: digest(o[:, :t], s))(*scan(q, k, v, g, beta)) for _ in range(digests)]
        o, s = np.asarray(o[:, :t], np.float32), np.asarray(s)
        ms = float("nan") if interpret else bench.dispatched_ms(scan, q, k, v, g, beta)
        first = first or (name, o, s)
        bench.log(
            f"| {shape[:3]} | {name} | {ms:.3f} | {bench.relative_error(o, o_ref):.2e} / {bench.relative_error(s, s_ref):.2e}"
            f" | {np.abs(o - first[1]).max():.2e} / {np.abs(s - first[2]).max():.2e} |"
            + (f" {' '.join(runs)} |" if runs else "")
        )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=";".join(",".join(map(str, x[:3])) for x in bench.PREFILL_SHAPES))
    parser.add_argument("--configs", default="default", help="among: " + ",".join(bench.CONFIGS))
    parser.add_argument("--interpret", action="store_true")
    parser.add_argument("--digests", type=int, default=0, help="runs whose o and state digests are printed")
    args = parser.parse_args()
    shapes = [(1, 130, 2, 64)] if args.interpret else [
        tuple(int(x) for x in s.split(",")) + (128,) for s in args.shapes.split(";")
    ]
    bench.log("| (B, T, H) | config | ms | error o / state | max abs difference from the first config, o / state |")
    bench.log("| --- | --- | --- | --- | --- |")
    for shape in shapes:
        compare(shape, args.configs.split(","), args.interpret, args.digests)


if __name__ == "__main__":
    main()
