"""Probe: does the serial chain overlap the intra kernel when the sequence is cut into pieces and
each piece's chain runs on a second GPU stream (`compute_on("gpu_stream:1")`) while the next piece's
intra kernel runs on the main one? Prints the plain scan's time beside the pipelined one's, and the
pipelined output's difference from the plain scan's (it should be zero: the same kernels on the same
chunks, only the state handed from piece to piece).

    PYTHONPATH=$PWD:$PWD/bench python3 bench/kda_overlap.py [--shapes "1,16384,16;..."] [--pieces 2,4,8]

Result on the H200 (bench/RESULTS.md, thirteenth session, with the chain then in one or two slots
of 32 columns): no overlap. The second stream gives the
same times as the first, with or without XLA's stream annotation flags, and every extra piece costs
about 0.04 ms. The intra kernel fills every SM's shared memory (two 105 KB CTAs), so a chain CTA
finds no room until the intra grid drains: the two kernels can only meet at their boundary.
"""

import argparse

import jax
import jax.numpy as jnp
import kda as bench
from jax.experimental.compute_on import compute_on

from pallas_kernels.kda import prefill_chain_mosaic, prefill_intra_mosaic
from pallas_kernels.kda.prefill_intra_mosaic import CHUNK


def pipelined_scan(q, k, v, g, beta, s0, lengths, *, pieces, stream):
    b, t, h, d = q.shape
    size = -(-t // (pieces * CHUNK)) * CHUNK
    beta_bht = jnp.swapaxes(beta, 1, 2).astype(jnp.float32)
    outs, state = [], s0
    for start in range(0, t, size):
        end = min(start + size, t)
        piece_lengths = jnp.clip(lengths - start, 0, end - start)
        parts = prefill_intra_mosaic.intra(
            q[:, start:end], k[:, start:end], v[:, start:end], g[:, start:end], beta_bht[..., start:end],
            piece_lengths, qw_lo=False,
        )

        def chain(parts, state):  # the scan's own options for the shape
            block_v, value_slots, multicast = prefill_chain_mosaic.default_options(b, h, d, jnp.bfloat16)
            return prefill_chain_mosaic.chain(
                *parts, state, out_dtype=jnp.bfloat16, block_v=block_v, value_slots=value_slots, multicast=multicast
            )

        if stream:
            chain = compute_on(compute_type="gpu_stream:1", out_memory_spaces=jax.memory.Space.Device)(chain)
        o, state = chain(parts, state)
        outs.append(o[:, : end - start])
    return jnp.concatenate(outs, axis=1), state


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="1,16384,16;1,8192,64;8,4096,16")
    parser.add_argument("--pieces", default="2,4,8")
    parser.add_argument("--print-hlo", action="store_true", help="the compiled HLO's async and stream lines")
    args = parser.parse_args()
    for shape in args.shapes.split(";"):
        b, t, h = (int(x) for x in shape.split(","))
        d = 128
        q, k, v, g, beta = bench.to_jax(*bench.prefill_inputs(b, t, h, d))
        lengths = jnp.full((b,), t, jnp.int32)
        s0 = jnp.zeros((b, h, d, d), jnp.float32)
        plain = jax.jit(lambda *a: prefill_chain_mosaic.chunk_scan(*a, out_dtype=jnp.bfloat16))
        o_ref, s_ref = plain(q, k, v, g, beta, s0, lengths)
        bench.log(f"B={b} T={t} H={h}: plain scan {bench.dispatched_ms(plain, q, k, v, g, beta, s0, lengths):.3f} ms")
        for pieces in (int(p) for p in args.pieces.split(",")):
            for stream in (False, True):
                fn = jax.jit(lambda *a, p=pieces, st=stream: pipelined_scan(*a, pieces=p, stream=st))
                try:
                    o, s = fn(q, k, v, g, beta, s0, lengths)
                    do = float(jnp.abs(o.astype(jnp.float32) - o_ref.astype(jnp.float32)).max())
                    ds = float(jnp.abs(s - s_ref).max())
                    ms = bench.dispatched_ms(fn, q, k, v, g, beta, s0, lengths)
                    bench.log(f"  pieces {pieces} stream {int(stream)}: {ms:.3f} ms  |do| {do:.2e} |ds| {ds:.2e}")
                except Exception as e:  # a probe: report and go on
                    bench.log(f"  pieces {pieces} stream {int(stream)}: failed {type(e).__name__}: {str(e)[:300]}")
                if args.print_hlo and pieces == 2 and stream:
                    text = fn.lower(q, k, v, g, beta, s0, lengths).compile().as_text()
                    lines = [line.strip()[:160] for line in text.splitlines() if "async" in line or "_xla_stream" in line]
                    bench.log("\n".join(lines[:20]) or "  (no async or stream-annotated instructions)")


if __name__ == "__main__":
    main()
