"""Probe: the decode step's slab update with the state's loads through TMA into shared memory
(Mosaic GPU) rather than through L1, which XLA's launch leaves at 28 KiB per SM (bench/RESULTS.md,
fifteenth session). Same work and inputs as bench/kda_decode_parts.py's `state only` kernel: the token
vectors given in fp32 (q, k normalised; decay; v, beta and q . k broadcast over the value columns).
Persistent CTAs of one warpgroup each walk the [dk, block_v] slabs (CTA c takes slabs c, c + CTAs,
...), with `stages` slabs in shared memory: while one is updated (in registers, WGMMA layout;
reductions over dk to one value per column) and stored out by TMA, the next stages - 1
are on their way in; one stage and one CTA per slab (CTAs 0) is the simplest form: load, update,
store in turn. The slab is kept in shared memory as swizzled [8, 32] tiles (unswizzled, the WGMMA
layout's loads conflict on the banks: 0.176 / 0.687 ms at B = 64 / 256 against 0.138 / 0.560
swizzled, 64 columns, 4 stages). On the H200 the fastest forms reach 91-93% of the state-bytes
roofline (bench/RESULTS.md, sixteenth session): 32 columns, one CTA per slab; or 64 columns,
4 stages, 132 persistent CTAs.
Timed as bench/kda.py times the step (the kernel's GPU time in a profiler trace of 20 chained calls).

    PYTHONPATH=$PWD:$PWD/bench python3 bench/kda_decode_mosaic.py [--batches 64,256] [--configs model,64x4x132]

`model` times the model's kernel (`decode_update_mosaic.update_state`, 32 columns, one CTA per slab, the state
updated in place) on the same inputs: in the step it ran at 89-90% where 32x1x0, which writes a
second buffer, ran at 92-93% (bench/RESULTS.md, seventeenth session).
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import kda as bench
import kda_decode_parts as parts
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import decode_update_mosaic, kda

_F32 = jnp.float32


def state_update(vectors, state, *, block_v=64, stages=3, ctas=132, interpret=False):
    """vectors [B, H, 4, d] (q, sqrt(beta) k, decay, sqrt(beta) v), state [B, H, d, d] fp32:
    (o [B, H, dv] bf16, the new state), by `ctas` persistent CTAs with `stages` slabs in flight, each
    slab updated by `decode_update_mosaic.update_slab` (the model's kernel, one CTA per slab, is this with
    one stage and a CTA per slab, the state updated in place)."""
    b, h, dk, dv = state.shape
    nv = dv // block_v
    slabs = b * h * nv

    def kernel(vectors_ref, s_ref, o_ref, s_out_ref, s_buf, rows_buf, v_buf, o_buf, arrived):
        cta = lax.axis_index("cta")
        steps = (slabs - cta + ctas - 1) // ctas

        def where(i):
            slab = i * ctas + cta
            return slab // (h * nv), (slab // nv) % h, pl.ds((slab % nv) * block_v, block_v)

        def fetch(i):
            bi, hi, cs = where(i)
            slot = i % stages
            plgpu.copy_gmem_to_smem(s_ref.at[bi, hi, :, cs], s_buf.at[slot], arrived.at[slot])
            plgpu.copy_gmem_to_smem(vectors_ref.at[bi, hi, pl.ds(0, 3)], rows_buf.at[slot], arrived.at[slot])
            plgpu.copy_gmem_to_smem(vectors_ref.at[bi, hi, 3, cs], v_buf.at[slot], arrived.at[slot])

        for i in range(stages):
            pl.when(i < steps)(functools.partial(fetch, i))

        @pl.loop(0, steps)
        def _(i):
            slot = i % stages
            plgpu.barrier_wait(arrived.at[slot])
            decode_update_mosaic.update_slab(s_buf.at[slot], rows_buf.at[slot], v_buf.at[slot], o_buf.at[slot])
            plgpu.commit_smem()
            bi, hi, cs = where(i)
            plgpu.copy_smem_to_gmem(s_buf.at[slot], s_out_ref.at[bi, hi, :, cs], commit_group=False)
            plgpu.copy_smem_to_gmem(o_buf.at[slot], o_ref.at[bi, hi, cs], commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            # Refill the slot of the step before this one, once its store has read it out.
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            pl.when((i >= 1) & (i - 1 + stages < steps))(lambda: fetch(i - 1 + stages))

        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((b, h, dv), jnp.bfloat16), jax.ShapeDtypeStruct(state.shape, _F32)),
        grid=(ctas,), grid_names=("cta",),
        scratch_types=(
            plgpu.SMEM((stages, dk, block_v), _F32, transforms=decode_update_mosaic.SLAB_TRANSFORMS),
            plgpu.SMEM((stages, 3, dk), _F32),
            plgpu.SMEM((stages, block_v), _F32),
            plgpu.SMEM((stages, block_v), jnp.bfloat16),
            plgpu.Barrier(num_arrivals=3, num_barriers=stages),
        ),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="kda_decode_mosaic_pipelined",
    )(vectors, state)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--configs", default="model,32x1x0,64x4x132,64x6x132",
                        help="block_v x stages x CTAs (0 CTAs: one per slab), or model: the model's kernel,"
                             " decode_update_mosaic.update_state (32x1x0 with the state updated in place)")
    args = parser.parse_args()
    h, d = 64, 128
    for b, x, ref, roof in parts.decode_cases(args.batches, h, d):
        vectors, _ = jax.jit(functools.partial(kda.decode_token_vectors_reference, lower_bound=-5.0))(
            *kda.decode_token_inputs(x)
        )
        for config in args.configs.split(","):
            if config == "model":
                update = functools.partial(decode_update_mosaic.update_state, out_dtype=jnp.bfloat16)
                call = jax.jit(lambda state, update=update: update(vectors, state), donate_argnums=0)
                name, kernel = f"B={b} state only, decode_update_mosaic.update_state (in place)", "kda_decode_update"
            else:
                block_v, stages, ctas = (int(n) for n in config.split("x"))
                ctas = ctas or b * h * d // block_v
                call = jax.jit(functools.partial(
                    state_update, vectors, block_v=block_v, stages=stages, ctas=ctas
                ))
                name = f"B={b} state only, Mosaic GPU, block_v={block_v} stages={stages} CTAs={ctas}"
                kernel = "kda_decode_mosaic"
            try:
                o, s = call(x["state"] + 0)
                err = max(bench.relative_error(o.astype(_F32), ref[0].astype(_F32)), bench.relative_error(s, ref[2]))
                ms = bench.kernel_ms(lambda state, call=call: (call(state)[1],), (x["state"],), kernel)
            except Exception as e:  # a launch shape that does not fit is reported, not fatal
                bench.log(f"{name}: failed: {str(e).splitlines()[0][:200]}")
                continue
            bench.log(f"{name}: kernel {ms:.4f} ms ({roof / ms * 100:.0f}% of the {roof:.4f} ms roofline) err {err:.1e}")


if __name__ == "__main__":
    main()
