"""The serial half of the chunked KDA scan's backward on Hopper, in Pallas Mosaic GPU: the state's
gradient d S carried back across the chunks (`chunk_backward.state_gradients_reference`' kernel).

One warpgroup per (value block, head, sequence) walks the chunks from the last, the previous chunk's
tiles in flight (TMA, two slots) while it works on the current one:
    d v' = d v_local + (k exp(G_L - G)) d S',   d S = exp(G_L) d S' + d S_local - w^T d v',
d v_local = A^T d o and d S_local = (q exp(G))^T d o being each chunk's own terms, computed for all
chunks at once before, arriving in fp32. Both products take their left operand from SMEM as bf16
halves (hi + lo) and their fp32 right operand (d S', d v') as halves too, three products each (hi.hi
+ hi.lo + lo.hi): as accurate as fp32 work to about 1e-5, like the forward's chain. Each chunk's d v' and the d S' it
received leave for the chunk-parallel rest of the backward.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.prefill_chain_mosaic import BLOCK_V, _key_smem
from pallas_kernels.kda.prefill_intra_mosaic import CHUNK
from pallas_kernels.kda.tiles_mosaic import ROW, load, matmul, operand_smem, split

_F32 = jnp.float32
SLOTS = 2  # the previous chunk's tiles come in while this one's are worked on


def _backward_kernel(
    k_last_hi_ref, k_last_lo_ref, w_hi_ref, w_lo_ref, dv_ref, ds_ref, decay_ref, d_state_ref,
    d_v_ref, d_next_ref, d_state0_ref,
    k_last_hi_s, k_last_lo_s, w_hi_s, w_lo_s, dv_s, ds_s, s_halves, v_halves, d_v_s, arrived,
    *, n_chunks,
):
    vb, h, b = lax.axis_index("v"), lax.axis_index("h"), lax.axis_index("b")
    block_v = dv_s.shape[-1]
    dk = w_hi_s.shape[-1]
    cols = pl.ds(vb * block_v, block_v)

    def fetch(n, slot):
        tokens = pl.ds(n * CHUNK, CHUNK)
        for src, dst in ((k_last_hi_ref, k_last_hi_s), (k_last_lo_ref, k_last_lo_s), (w_hi_ref, w_hi_s),
                         (w_lo_ref, w_lo_s)):
            plgpu.copy_gmem_to_smem(src.at[b, h, tokens], dst.at[slot], arrived.at[slot])
        plgpu.copy_gmem_to_smem(dv_ref.at[b, h, tokens, cols], dv_s.at[slot], arrived.at[slot])
        plgpu.copy_gmem_to_smem(ds_ref.at[b, h, n, :, cols], ds_s.at[slot], arrived.at[slot])

    def step(i, d_s):
        n = n_chunks - 1 - i
        slot = lax.rem(i, SLOTS)
        plgpu.commit_smem()  # every thread is done with the previous chunk's buffers

        @pl.when(n >= 1)
        def _():
            fetch(n - 1, 1 - slot)

        decay = load(decay_ref.at[b, h, n], ROW, optimized=False)
        d_next_ref.at[b, h, n, :, cols][...] = d_s
        plgpu.barrier_wait(arrived.at[slot])
        s_hi, s_lo = split(d_s)
        s_halves[0][...] = s_hi
        s_halves[1][...] = s_lo
        plgpu.commit_smem()
        k_last_hi, k_last_lo = k_last_hi_s.at[slot], k_last_lo_s.at[slot]
        d_v = load(dv_s.at[slot]) + matmul(
            (CHUNK, block_v), [(k_last_hi, s_halves[0]), (k_last_hi, s_halves[1]), (k_last_lo, s_halves[0])])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous chunk's d v' is read
        d_v_s[...] = d_v
        v_hi, v_lo = split(d_v)
        v_halves[0][...] = v_hi
        v_halves[1][...] = v_lo
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(d_v_s, d_v_ref.at[b, h, pl.ds(n * CHUNK, CHUNK), cols])
        w_hi, w_lo = w_hi_s.at[slot].T, w_lo_s.at[slot].T  # [dk, 64]: channels as rows
        w_d_v = matmul((dk, block_v), [(w_hi, v_halves[0]), (w_hi, v_halves[1]), (w_lo, v_halves[0])])
        return d_s * lax.broadcast_in_dim(decay, (dk, block_v), [0]) + load(ds_s.at[slot]) - w_d_v

    fetch(n_chunks - 1, 0)
    d_s = lax.fori_loop(0, n_chunks, step, load(d_state_ref.at[b, h, :, cols], optimized=False))
    d_state0_ref.at[b, h, :, cols][...] = d_s
    plgpu.wait_smem_to_gmem(0)


def state_gradients(d_v_local, d_s_local, w, k_last, decay, d_state, *, block_v=BLOCK_V, interpret=False):
    """`chunk_backward.state_gradients_reference` on the GPU: (d v' [B, H, N, C, dv], the d S' each
    chunk received [B, H, N, dk, dv], d S of the initial state [B, H, dk, dv]), all fp32, from the
    chunks' d v_local [B, H, N, C, dv], d S_local [B, H, N, dk, dv], w and k exp(G_L - G)
    [B, H, N, C, dk], exp(G_L) [B, H, N, dk] and the final state's cotangent [B, H, dk, dv]. C = 64;
    dk and dv multiples of 64, block_v dividing dv."""
    b, h, n, c, dk = w.shape
    dv = d_v_local.shape[-1]
    if c != CHUNK:
        raise ValueError(f"state_gradients: chunks must have {CHUNK} tokens, got {c}")
    block_v = min(block_v, dv)
    if dv % block_v:
        raise ValueError(f"state_gradients: block_v = {block_v} must divide dv = {dv}")
    tokens = lambda x: x.reshape(b, h, n * c, x.shape[-1])  # noqa: E731
    kernel = plgpu.kernel(
        functools.partial(_backward_kernel, n_chunks=n),
        out_type=(
            jax.ShapeDtypeStruct((b, h, n * c, dv), _F32),
            jax.ShapeDtypeStruct((b, h, n, dk, dv), _F32),
            jax.ShapeDtypeStruct((b, h, dk, dv), _F32),
        ),
        grid=(dv // block_v, h, b),
        grid_names=("v", "h", "b"),
        scratch_types=(
            *(_key_smem((SLOTS, c, dk), block_v) for _ in range(4)),  # k exp(G_L - G) and w, hi and lo
            operand_smem((SLOTS, c, block_v), _F32),  # d v_local
            operand_smem((SLOTS, dk, block_v), _F32),  # d S_local
            tuple(_key_smem((dk, block_v), block_v) for _ in range(2)),  # d S' hi/lo
            tuple(_key_smem((c, block_v), block_v) for _ in range(2)),  # d v' hi/lo
            operand_smem((c, block_v), _F32),  # d v' on its way out
            plgpu.Barrier(num_arrivals=6, num_barriers=SLOTS),
        ),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane, approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="kda_chain_backward",
    )
    d_v, d_next, d_state0 = kernel(
        *split(tokens(k_last)), *split(tokens(w)), tokens(d_v_local).astype(_F32), d_s_local.astype(_F32),
        decay.astype(_F32), d_state.astype(_F32),
    )
    return d_v.reshape(d_v_local.shape), d_next, d_state0
