"""Where the KDA prefill scan spends its time on the GPU: the intra and chain kernels timed alone,
as built and with every product's operands rounded to bf16 (a probe of the tf32 products' cost).

    PYTHONPATH=$PWD:$PWD/bench python3 bench/kda_parts.py [--shape B,T,H] [--configs default,...] [--probes no_inverse] [--bf16]
"""

import argparse

import jax
import jax.numpy as jnp

import kda as bench
from pallas_kernels import kda_triton


def _bf16_dot(a, b, *, dot=kda_triton._dot, **transposes):
    return dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), **transposes)


def time_parts(shape, cfg, label, interpret=False):
    b, t, h, d = shape
    q, k, v, g, beta = bench.to_jax(*bench.prefill_inputs(b, t, h, d))
    lengths = jnp.full((b,), t, jnp.int32)
    s0 = jnp.zeros((b, h, d, d), jnp.float32)
    scan = jax.jit(lambda *a: kda_triton.chunk_scan(*a, config=cfg, interpret=interpret))

    def scan_step(c):
        o, s = scan(q, k, v, g, beta + c.astype(beta.dtype) * 0, s0, lengths)
        return c + o[0, 0, 0, 0].astype(jnp.float32) * 0 + s[0, 0, 0, 0] * 0

    intra = bench.intra_ms(q, k, v, g, beta, cfg, interpret)
    total = bench.loop_ms(scan_step, jnp.float32(0))
    bench.log(f"{label:28s} B={b} T={t} H={h}: scan {total:.3f} ms = intra {intra:.3f} + chain {total - intra:.3f}")


def _no_inverse(blocks):
    return {ij: jnp.eye(kda_triton.SUB_CHUNK, dtype=jnp.float32) + a if ij[0] == ij[1] else a for ij, a in blocks.items()}


INTRA_PROBES = {  # intra-kernel variants that leave one stage out (timings only)
    "no_inverse": ("_unit_lower_inverse", _no_inverse),
}


def time_probe(shape, probe, interpret=False):
    b, t, h, d = shape
    attr, fn = INTRA_PROBES[probe]
    kept = getattr(kda_triton, attr)
    setattr(kda_triton, attr, fn)
    try:
        ms = bench.intra_ms(*bench.to_jax(*bench.prefill_inputs(b, t, h, d)), kda_triton.ScanConfig(), interpret)
    finally:
        setattr(kda_triton, attr, kept)
    bench.log(f"{'intra probe ' + probe:28s} B={b} T={t} H={h}: intra {ms:.3f} ms")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="1,16384,16")
    parser.add_argument("--configs", default="default")
    parser.add_argument("--probes", default="", help="intra probes: " + ",".join(INTRA_PROBES))
    parser.add_argument("--bf16", action="store_true", help="also time with every product in bf16")
    parser.add_argument("--interpret", action="store_true", help="CPU smoke run in the Pallas interpreter")
    args = parser.parse_args()
    shape = tuple(int(x) for x in args.shape.split(",")) + (128,)
    for name in args.configs.split(","):
        time_parts(shape, bench.CONFIGS[name], f"{name}, tf32 products", args.interpret)
    for probe in filter(None, args.probes.split(",")):
        time_probe(shape, probe, args.interpret)
    if not args.bf16:
        return
    kda_triton._dot = _bf16_dot
    for name in args.configs.split(","):
        time_parts(shape, bench.CONFIGS[name], f"{name}, bf16 products", args.interpret)


if __name__ == "__main__":
    main()
