"""The scan's first stage (`kda_gates.gate_sums`: G, the running sum of g inside each 64-token chunk;
G at every 8th token; exp(G_last)) at the three prefill shapes: the kernel in several tile widths
against formulations in XLA (jnp.cumsum is a 64-wide reduce-window there). Median ms per
call of 20 jitted calls dispatched back to back (every output returned, so every element is
computed), GB/s of the bytes that must move (g read; G, G at every 8th token and exp(G_last)
written), and each one's largest error against a float64 cumsum on the host.

    PYTHONPATH=$PWD:$PWD/bench python3 bench/kda_prelude.py [--interpret]

(`--interpret`: a small shape on the CPU, to check the formulations agree.)
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import kda as bench
from pallas_kernels import kda_gates

C, MARK = kda_gates.CHUNK, kda_gates.MARK


def in_xla(cumsum):
    """gate_sums with `cumsum` over each chunk's 64 tokens (axis 2 of `gates_by_chunk`)."""

    def gate_sums(g, lengths, padded):
        cum = cumsum(kda_gates.gates_by_chunk(g, lengths, padded))
        return kda_gates.marks_and_decay(cum.reshape(g.shape[0], padded, *g.shape[2:]))

    return gate_sums


def by_product(x):
    """A product with tril(ones) at fp32 precision."""
    return jnp.einsum("ij,bnjx->bnix", jnp.tril(jnp.ones((C, C), jnp.float32)), x, precision=lax.Precision.HIGHEST)


def kernels(blocks, interpret=False):
    return {f"kernel, block {block}": functools.partial(kda_gates.gate_sums, block=block, interpret=interpret) for block in blocks}


XLA_FORMULATIONS = {
    "two levels (gate_sums_reference)": kda_gates.gate_sums_reference,
    "tril product": in_xla(by_product),
    "reduce-window": in_xla(lambda x: jnp.cumsum(x, axis=2)),
    "associative scan": in_xla(lambda x: lax.associative_scan(jnp.add, x, axis=2)),
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--interpret", action="store_true")
    interpret = parser.parse_args().interpret
    shapes = [(2, 200, 3, 64)] if interpret else [s[:4] for s in bench.PREFILL_SHAPES]
    formulations = {**kernels([128] if interpret else [128, 256], interpret), **XLA_FORMULATIONS}
    bench.log("| (B, T, H, D) | formulation | ms | GB/s | max abs error (G, marks, exp(G_last)) |")
    bench.log("| --- | --- | --- | --- | --- |")
    for b, t, h, d in shapes:
        g = jnp.asarray(bench.prefill_inputs(b, t, h, d)[3])
        lengths = jnp.array([t, max(t - 77, 1)][:b] + [t] * max(b - 2, 0), jnp.int32)
        padded = -(-t // C) * C
        x = np.where((np.arange(t) < np.asarray(lengths)[:, None])[:, :, None, None], np.asarray(g, np.float64), 0.0)
        x = np.pad(x, [(0, 0), (0, padded - t), (0, 0), (0, 0)]).reshape(b, padded // C, C, h, d)
        cum = np.cumsum(x, axis=2).reshape(b, padded, h, d)
        want = (cum, cum[:, MARK - 1 :: MARK], np.exp(np.swapaxes(cum[:, C - 1 :: C], 1, 2)))
        gb = (g.size + b * padded * h * d * (1 + 1 / MARK + 1 / C)) * 4 / 1e9
        for name, fn in formulations.items():
            call = jax.jit(fn, static_argnums=2)
            got = call(g, lengths, padded)
            errors = " / ".join(f"{np.abs(np.asarray(a, np.float64) - w).max():.1e}" for a, w in zip(got, want))
            ms = bench.dispatched_ms(call, g, lengths, padded)
            bench.log(f"| ({b}, {t}, {h}, {d}) | {name} | {ms:.3f} | {gb / ms * 1e3:.0f} | {errors} |")


if __name__ == "__main__":
    main()
