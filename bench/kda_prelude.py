"""The XLA work around the intra kernel at the three prefill shapes: G (the chunk-local running sum
of g) by jnp.cumsum (a reduce-window in XLA) and by a product with tril(ones) (`kda_intra.chunk_cumsum`),
and all of it (`kda_intra.gate_sums`: G, G at every 8th token, exp(G_last)). Median ms of 10 calls in one
jitted loop, and GB/s of the bytes each must move (g read, G written).

    PYTHONPATH=$PWD:$PWD/bench python3 bench/kda_prelude.py
"""

import jax
import jax.numpy as jnp

import kda as bench
from pallas_kernels import kda_intra


def cumsum_by_reduce_window(g, lengths, padded):
    by_chunk = jnp.cumsum(kda_intra.gates_by_chunk(g, lengths, padded), axis=2)
    return by_chunk.reshape(g.shape[0], padded, *g.shape[2:])


def main():
    bench.log("| (B, T, H), D = 128 | cumsum (reduce-window) ms | tril product ms | whole prelude ms | GB moved (g in, G out) |")
    bench.log("| --- | --- | --- | --- | --- |")
    for b, t, h, d in bench.PREFILL_SHAPES:
        g = jnp.asarray(bench.prefill_inputs(b, t, h, d)[3])
        lengths = jnp.full((b,), t, jnp.int32)
        times = []
        for fn in (cumsum_by_reduce_window, kda_intra.chunk_cumsum, kda_intra.gate_sums):
            def step(c, fn=fn):
                out = jax.tree.leaves(fn(g + c, lengths, -(-t // kda_intra.CHUNK) * kda_intra.CHUNK))
                return c + sum(x.reshape(-1)[0] for x in out) * 0
            times.append(bench.loop_ms(step, jnp.float32(0)))
        gb = 2 * g.size * 4 / 1e9
        bench.log(f"| ({b}, {t}, {h}) | {times[0]:.3f} | {times[1]:.3f} | {times[2]:.3f} | {gb:.2f} |")


if __name__ == "__main__":
    main()
