"""The KDA decode step's state update in Pallas Mosaic GPU, after `decode_fused_triton.token_vectors`.

The step is a stream over the state. Each CTA (one warpgroup) takes one [dk, block_v] slab of one
head's state into shared memory by TMA, as swizzled [8, 32] fp32 tiles (unswizzled, the WGMMA
register layout's loads would conflict on the banks), updates it in registers and stores it back in
place by TMA. Loaded through L1, as a Triton kernel loads it, the slabs stall under XLA's launch,
which leaves 28 KiB of L1 per SM; by TMA the update reaches 89-93% of the state-bytes roofline on
the H200, against 85-88% at best through L1 (bench/RESULTS.md).

The token side (conv, SiLU, norms, gate, beta) runs before, in `decode_fused_triton.token_vectors`:
the step in two kernels reaches 82-84% of the roofline at batch 64 and 256 (H = 64, D = 128), where
the token side fused into this kernel, or beside it in one launch, is slower (docs/kda.md).
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda import decode_fused_triton

BLOCK_V = 32  # the fastest slab width on the H200 (bench/RESULTS.md)
HEAD_DIMS = (64, 128)  # dk: the WGMMA layout's 64-row tiles
# Where the two kernels beat the fused Triton step on the H200 (bench/RESULTS.md): from 64 MiB of
# state at D = 128 (H = 64, kernel ms, two kernels vs fused: B = 8 0.0224 vs 0.0163, B = 16 0.0428
# vs 0.0442, B = 64 0.155 vs 0.161); below it the state sits largely in the 50 MB L2, where one
# launch is cheaper. At D = 64 never: the token side weighs twice as much against a head's state, and
# the fused step is faster at every size from 8 to 128 MiB (B = 512: 0.414 ms against 0.434 with
# 64-column slabs, 0.488 with 32).
MIN_STATE_BYTES = 64 * 2**20
STEP_HEAD_DIMS = (128,)

_F32 = jnp.float32
_SLAB = plgpu.Layout.WGMMA
_ROW, _COL = _SLAB.reduce(1), _SLAB.reduce(0)
SLAB_TRANSFORMS = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))


def update_slab(s_smem, rows_smem, v_smem, o_smem):
    """The delta rule on a [dk, block_v] slab in shared memory, written back there; o's block_v
    columns to o_smem. rows_smem [3, dk]: q (normalised, scaled), k' = sqrt(beta) k (k normalised),
    decay; v_smem [block_v]: v' = sqrt(beta) v (`kda.decode_token_vectors_reference`).

    With D = diag(decay): S <- D S + k' (v' - k'^T D S)^T, then o = q^T S."""
    dk, block_v = s_smem.shape
    s = plgpu.load(s_smem, layout=_SLAB)
    q, k, decay = (plgpu.load(rows_smem.at[i], layout=_ROW, optimized=False) for i in range(3))
    v = plgpu.load(v_smem, layout=_COL, optimized=False)

    def rows_of(x):
        return lax.broadcast_in_dim(x, (dk, block_v), [0])

    delta = v - jnp.sum(rows_of(k * decay) * s, axis=0)
    s = s * rows_of(decay) + rows_of(k) * lax.broadcast_in_dim(delta, (dk, block_v), [1])
    s_smem[...] = s
    o_smem[...] = jnp.sum(rows_of(q) * s, axis=0).astype(o_smem.dtype)


def _update_kernel(vectors_ref, s_ref, o_ref, s_smem, rows_smem, v_smem, o_smem, arrived):
    vb, h, b = lax.axis_index("v"), lax.axis_index("h"), lax.axis_index("b")
    block_v = s_smem.shape[1]
    cols = pl.ds(vb * block_v, block_v)
    plgpu.copy_gmem_to_smem(s_ref.at[b, h, :, cols], s_smem, arrived)
    plgpu.copy_gmem_to_smem(vectors_ref.at[b, h, pl.ds(0, 3)], rows_smem, arrived)
    plgpu.copy_gmem_to_smem(vectors_ref.at[b, h, 3, cols], v_smem, arrived)
    plgpu.barrier_wait(arrived)
    update_slab(s_smem, rows_smem, v_smem, o_smem)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(s_smem, s_ref.at[b, h, :, cols])
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, h, cols])
    plgpu.wait_smem_to_gmem(0)


def update_state(vectors, state, *, out_dtype, block_v=BLOCK_V, interpret=False):
    """vectors [B, H, 4, d] fp32 from `decode_fused_triton.token_vectors` (q, sqrt(beta) k, decay,
    sqrt(beta) v), state [B, H, d, d] fp32 (d in HEAD_DIMS, a multiple of block_v in {32, 64}):
    (o [B, H, d] in out_dtype, the new state). The state is updated in place (donate it under jit,
    or XLA copies it first). One CTA per slab, the value block varying fastest in launch order, then
    the head: CTAs resident together stream one contiguous stretch of the state (with the batch
    fastest, slabs 4 MiB apart, the step reaches 67-74% of the roofline on the H200, where the update
    alone in this order reaches 89-93%). The oracle is `kda.decode_update_reference`."""
    b, h, dk, dv = state.shape
    if dk not in HEAD_DIMS or dv != dk or block_v not in (32, 64) or dv % block_v:
        raise ValueError(f"the state must be [B, H, d, d] with d one of {HEAD_DIMS}, a multiple of block_v in"
                         f" (32, 64); got dk = {dk}, dv = {dv}, block_v = {block_v}")
    if vectors.shape != (b, h, 4, dk) or vectors.dtype != _F32:
        raise ValueError(f"vectors must be float32 [{b}, {h}, 4, {dk}], got {vectors.dtype} {list(vectors.shape)}")
    kernel = plgpu.kernel(
        _update_kernel,
        out_type=jax.ShapeDtypeStruct((b, h, dv), out_dtype),
        grid=(b, h, dv // block_v),  # Mosaic GPU launches the last grid axis fastest
        grid_names=("b", "h", "v"),
        scratch_types=(
            plgpu.SMEM((dk, block_v), _F32, transforms=SLAB_TRANSFORMS),
            plgpu.SMEM((3, dk), _F32),
            plgpu.SMEM((block_v,), _F32),
            plgpu.SMEM((block_v,), out_dtype),
            plgpu.Barrier(num_arrivals=3),
        ),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="kda_decode_update",
    )
    # The state goes in as a mutable Ref: the kernel writes each slab back where it read it.
    state = jax.new_ref(state)
    o = kernel(vectors, state)
    return o, jax.freeze(state)


def two_kernel_decode_step(
    qkv, conv_state, conv_weight, f, dt_bias, a_log, beta_logits, state, *, lower_bound, block_v=BLOCK_V,
    token_warps=4, interpret=False,
):
    """The one-token KDA step in two kernels: `decode_fused_triton.token_vectors`, then `update_state`. Shapes
    and results as `kda.kda_decode_step` (checked there)."""
    vectors, conv_state = decode_fused_triton.token_vectors(
        qkv, conv_state, conv_weight, f, dt_bias, a_log, beta_logits, lower_bound=lower_bound, num_warps=token_warps,
        interpret=interpret,
    )
    o, state = update_state(vectors, state, out_dtype=qkv.dtype, block_v=block_v, interpret=interpret)
    return o, conv_state, state
