"""Probe: where the fused decode step's time goes. At each batch (H = 64, D = 128), measured as
`bench/kda.py` measures the step (the kernel's GPU time from a profiler trace of 20 calls unrolled
in one jit, the state donated; the wall time per step beside it), in ms and % of the state-bytes
roofline:
  - XLA's in-place elementwise pass over the state (the floor under this timing);
  - `state only`: the step's slab update alone (`decode_fused_triton.slab_update`), its token vectors (q, k
    normalised, v, decay, beta) given in fp32 as fla's step takes them: what the state streaming
    costs without the conv, SiLU, norms and gate;
  - the token vectors computed by XLA alone (wall time of one jitted call; the work the fused step
    adds per program);
  - the fused step `decode_fused_triton.fused_decode_step` at each launch shape (block_v x warps).
Errors of the fused step against the reference as in bench/kda.py.

    PYTHONPATH=$PWD:$PWD/bench python3 bench/kda_decode_parts.py [--batches 64,256] [--shapes 64x4,32x4]
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import kda as bench
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import decode_fused_triton, kda


def _state_only_kernel(q_ref, k_ref, v_ref, decay_ref, beta_ref, s_ref, o_ref, s_out_ref, *, block_v):
    vb, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(vb * block_v, block_v)
    s = s_ref[b, h, :, cols]
    q, k = q_ref[b, h, :], k_ref[b, h, :]
    s_out_ref[b, h, :, cols], o = decode_fused_triton.slab_update(
        s, q, k, v_ref[b, h, cols], decay_ref[b, h, :], beta_ref[b, h], q_scale=1.0, k_scale=1.0
    )
    o_ref[b, h, cols] = o.astype(o_ref.dtype)


def state_only(q, k, v, decay, beta, state, *, block_v, num_warps):
    b, h, _, dv = state.shape
    return pl.pallas_call(
        functools.partial(_state_only_kernel, block_v=block_v),
        grid=(dv // block_v, h, b),
        out_shape=[jax.ShapeDtypeStruct((b, h, dv), jnp.bfloat16), jax.ShapeDtypeStruct(state.shape, jnp.float32)],
        input_output_aliases={5: 1},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        name="kda_decode_state_only",
    )(q, k, v, decay, beta, state)


def token_vectors_of(x, *, lower_bound):
    """q (normalised and scaled), k, v, decay and beta in fp32, [B, H, d] and [B, H], and the new conv
    state, of a `kda.random_decode_inputs` dict: the reference's token side, beta folded into k and v
    (k = sqrt(beta) k / |k|, v = sqrt(beta) v, beta = 1: the same delta rule)."""
    vectors, conv_state = kda.decode_token_vectors_reference(
        *kda.decode_token_inputs(x), lower_bound=lower_bound
    )
    q, k, decay, v = (vectors[:, :, i] for i in range(4))
    return q, k, v, decay, jnp.ones(q.shape[:2], jnp.float32), conv_state


def decode_cases(batches, h, d):
    """The decode probes' cases, after logging the JAX version and devices: for each batch size in
    the comma list `batches`, (b, `kda.random_decode_inputs` at H = h, dk = dv = d, the reference's
    (o, conv state, state), the state-bytes roofline in ms)."""
    bench.log("jax", jax.__version__, jax.devices())
    for b in (int(n) for n in batches.split(",")):
        x = kda.random_decode_inputs(jax.random.key(0), b, h, d, state_scale=0.01)
        yield b, x, kda.kda_decode_step_reference(**x, lower_bound=-5.0), 2 * b * h * d * d * 4 / bench.HBM * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--shapes", default="64x4,32x4", help="fused step launch shapes: block_v x warps")
    parser.add_argument("--state-shapes", default="64x4,32x4,32x2,128x8", help="state-only launch shapes: block_v x warps")
    args = parser.parse_args()
    h, d = 64, 128
    for b, x, ref, roof in decode_cases(args.batches, h, d):
        fixed = {k_: v_ for k_, v_ in x.items() if k_ not in ("conv_state", "state")}

        def report(name, ms, note=""):
            bench.log(f"B={b} {name}: {ms:.4f} ms ({roof / ms * 100:.0f}% of the {roof:.4f} ms roofline) {note}")

        def measure(name, call, carry, kernel_name, note=""):
            kernel = bench.kernel_ms(call, carry, kernel_name)
            wall = bench.chain_ms(call, tuple(a + 0 for a in carry))
            report(name + " (kernel)", kernel, f"{note}; wall {wall:.4f} ms per step ({roof / wall * 100:.0f}%)")

        measure("XLA pass over the state", lambda state: (jax.lax.optimization_barrier(state * 0.999 + 1e-6),),
                (x["state"],), "fusion")
        rows = jax.jit(functools.partial(token_vectors_of, lower_bound=-5.0))
        q, k, v, decay, beta, _ = rows(x)
        report("token vectors by XLA alone", bench.dispatched_ms(rows, x))
        for shape in args.state_shapes.split(","):
            block_v, warps = (int(n) for n in shape.split("x"))
            call = functools.partial(state_only, q, k, v, decay, beta, block_v=block_v, num_warps=warps)
            o, s = jax.jit(call)(x["state"])
            err = max(bench.relative_error(o.astype(jnp.float32), ref[0].astype(jnp.float32)),
                      bench.relative_error(s, ref[2]))
            measure(f"state only {shape}", lambda state: (call(state)[1],), (x["state"],), "kda_decode_state_only",
                    f"err {err:.1e}")
        for shape in args.shapes.split(","):
            block_v, warps = (int(n) for n in shape.split("x"))

            def step(conv_state, state, block_v=block_v, warps=warps):
                return decode_fused_triton.fused_decode_step(
                    conv_state=conv_state, state=state, **fixed, lower_bound=-5.0, block_v=block_v,
                    num_warps=warps,
                )

            try:
                got = jax.jit(step)(x["conv_state"], x["state"])
                err = max(bench.relative_error(a.astype(jnp.float32), r.astype(jnp.float32)) for a, r in zip(got, ref))
                measure(f"fused step {shape}", lambda *c: step(*c)[1:], (x["conv_state"], x["state"]),
                        "kda_decode_step", f"err {err:.1e}")
            except Exception as e:  # a probe: report and go on
                bench.log(f"B={b} fused step {shape}: failed {type(e).__name__}: {str(e)[:300]}")


if __name__ == "__main__":
    main()
