"""Probe: the decode step's slab update with the state's loads through TMA into shared memory
(Mosaic GPU) rather than through L1, which XLA's launch leaves at 28 KiB per SM (bench/RESULTS.md,
fifteenth session). Same work and inputs as bench/kda_decode_parts.py's `state only` kernel: the token
vectors given in fp32 (q, k normalised; decay; v, beta and q . k broadcast over the value columns).
One warpgroup per [dk, block_v] slab: TMA in, the update in registers (WGMMA layout; reductions over
dk to one value per column), the slab back to SMEM and out by TMA. Timed as bench/kda.py times the
step (the kernel's GPU time in a profiler trace of 20 chained calls), beside the Triton state-only
kernel. On the H200 it took 0.172 / 0.665 ms at B = 64 / 256 (73% / 75% of the roofline) with
block_v = 64: slower than the Triton kernel (bench/RESULTS.md, fifteenth session).

    PYTHONPATH=$PWD:$PWD/bench python3 bench/kda_decode_mosaic.py [--batches 64,256] [--block-v 64]
"""

import argparse
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import kda as bench
import kda_decode_parts as parts
from pallas_kernels import kda

_F32 = jnp.float32
_WG = plgpu.Layout.WGMMA
_ROW, _COL = _WG.reduce(1), _WG.reduce(0)


def _kernel(rows_ref, cols_ref, s_ref, o_ref, s_out_ref, s_smem, rows_smem, cols_smem, o_smem, arrived):
    vb, h, b = lax.axis_index("v"), lax.axis_index("h"), lax.axis_index("b")
    dk, block_v = s_smem.shape
    cols = pl.ds(vb * block_v, block_v)
    plgpu.copy_gmem_to_smem(s_ref.at[b, h, :, cols], s_smem, arrived)
    plgpu.copy_gmem_to_smem(rows_ref.at[b, h], rows_smem, arrived)
    plgpu.copy_gmem_to_smem(cols_ref.at[b, h, :, cols], cols_smem, arrived)
    plgpu.barrier_wait(arrived)
    s = plgpu.load(s_smem, (), layout=_WG, optimized=False)
    q, k, decay = (plgpu.load(rows_smem.at[i], (), layout=_ROW, optimized=False) for i in range(3))
    v, beta, qk = (plgpu.load(cols_smem.at[i], (), layout=_COL, optimized=False) for i in range(3))

    def rows_of(x):
        return lax.broadcast_in_dim(x, (dk, block_v), [0])

    def cols_of(x):
        return lax.broadcast_in_dim(x, (dk, block_v), [1])

    predicted = jnp.sum(rows_of(k * decay) * s, axis=0)
    out = jnp.sum(rows_of(q * decay) * s, axis=0)
    delta = (v - predicted) * beta
    s_smem[...] = s * rows_of(decay) + rows_of(k) * cols_of(delta)
    o_smem[...] = (out + qk * delta).astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(s_smem, s_out_ref.at[b, h, :, cols])
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, h, cols])
    plgpu.wait_smem_to_gmem(0)


def state_update(rows, cols, state, *, block_v=64, interpret=False):
    """rows [B, H, 3, dk] (q, k, decay), cols [B, H, 3, dv] (v, beta, q . k), state [B, H, dk, dv] fp32:
    (o [B, H, dv] bf16, new state)."""
    b, h, dk, dv = state.shape
    return plgpu.kernel(
        _kernel,
        out_type=(jax.ShapeDtypeStruct((b, h, dv), jnp.bfloat16), jax.ShapeDtypeStruct(state.shape, _F32)),
        grid=(dv // block_v, h, b),
        grid_names=("v", "h", "b"),
        scratch_types=(
            plgpu.SMEM((dk, block_v), _F32),
            plgpu.SMEM((3, dk), _F32),
            plgpu.SMEM((3, block_v), _F32),
            plgpu.SMEM((block_v,), jnp.bfloat16),
            plgpu.Barrier(num_arrivals=3),
        ),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="kda_decode_mosaic",
    )(rows, cols, state)


def inputs(x, lower_bound=-5.0):
    """The probe's rows and cols from `kda.random_decode_inputs`, by the reference's own token side."""
    q, k, v, decay, beta, _ = parts.token_vectors_of(x, lower_bound=lower_bound)
    qk = jnp.sum(q * k, axis=-1)
    rows = jnp.stack([q, k, decay], axis=2)
    cols = jnp.stack([v, jnp.broadcast_to(beta[..., None], v.shape), jnp.broadcast_to(qk[..., None], v.shape)], axis=2)
    return rows, cols


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--block-v", type=int, default=64)
    args = parser.parse_args()
    h, d = 64, 128
    for b in (int(x) for x in args.batches.split(",")):
        x = kda.random_decode_inputs(jax.random.key(0), b, h, d, state_scale=0.01)
        ref = kda.kda_decode_step_reference(**x, lower_bound=-5.0)
        rows, cols = jax.jit(inputs)(x)
        call = jax.jit(functools.partial(state_update, rows, cols, block_v=args.block_v))
        o, s = call(x["state"] + 0)
        err = max(bench.relative_error(o.astype(_F32), ref[0].astype(_F32)), bench.relative_error(s, ref[2]))
        roof = 2 * b * h * d * d * 4 / bench.HBM * 1e3
        ms = bench.kernel_ms(lambda state: (call(state)[1],), (x["state"],), "kda_decode_mosaic")
        bench.log(f"B={b} state only, Mosaic GPU (TMA) block_v={args.block_v}: kernel {ms:.4f} ms"
                  f" ({roof / ms * 100:.0f}% of the {roof:.4f} ms roofline) err {err:.1e}")


if __name__ == "__main__":
    main()
