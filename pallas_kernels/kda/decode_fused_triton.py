"""The KDA decode step's Triton kernels: the fused step (`decode_step`, for states under
`decode_update_mosaic.MIN_STATE_BYTES` and head dims outside `decode_update_mosaic.STEP_HEAD_DIMS`) and the token side
alone (`token_vectors`, before `decode_update_mosaic.update_state`).
`api.kda_decode_step` dispatches here; the chunked prefill scan is in Mosaic GPU (`prefill_intra_mosaic`,
`prefill_chain_mosaic`). The launch shapes and what holds the fused step's speed: docs/kda.md.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.kda.reference import L2_EPS


def _conv_silu(qkv_ref, conv_ref, weight_ref, conv_out_ref, b, part, chans):
    """Short conv over the window (conv state[1:], x), SiLU, rounded to the activations' dtype as the
    reference does; the new conv state is that window. The taps are read one at a time (a channel's
    K taps share a sector: L1 serves all but the first) and written as one [channels, K] block (one
    8-byte store a channel at K = 4 in bf16, not four 2-byte ones). Read as a block, the taps taken
    apart in registers would need layout conversions: ptxas then gives the fused step 255 registers
    and 8 KB of shared memory rather than 128 and 1 KB (bench/RESULTS.md)."""
    kernel = weight_ref.shape[0]
    x = qkv_ref[b, part, chans].astype(jnp.float32)
    window = [conv_ref[b, part, chans, j].astype(jnp.float32) for j in range(1, kernel)] + [x]
    y = sum(window[j] * weight_ref[j, part, chans] for j in range(kernel))
    tap = jax.lax.broadcasted_iota(jnp.int32, (x.shape[0], kernel), 1)
    new_state = sum(jnp.where(tap == j, window[j][:, None], 0.0) for j in range(kernel))
    conv_out_ref[b, part, chans, :] = new_state.astype(conv_out_ref.dtype)
    return (jax.nn.sigmoid(y) * y).astype(qkv_ref.dtype).astype(jnp.float32)


def _decay_and_beta(f_ref, dt_bias_ref, a_log_ref, beta_ref, b, h, chans, lower_bound):
    """The head's per-channel decay exp(g) and its beta, in fp32."""
    f = f_ref[b, chans].astype(jnp.float32) + dt_bias_ref[chans].astype(jnp.float32)
    rate = jnp.exp(a_log_ref[h].astype(jnp.float32))
    if lower_bound is not None:
        g = lower_bound * jax.nn.sigmoid(rate * f)
    else:
        g = -rate * jnp.where(f > 20.0, f, jnp.log1p(jnp.exp(jnp.minimum(f, 20.0))))
    return jnp.exp(g), jax.nn.sigmoid(beta_ref[b, h].astype(jnp.float32))


def _norm_scale(x):
    return 1.0 / jnp.sqrt(jnp.sum(x * x) + L2_EPS)


def _decode_kernel(
    qkv_ref, conv_ref, weight_ref, f_ref, dt_bias_ref, a_log_ref, beta_ref, s_ref,
    o_ref, conv_out_ref, s_out_ref, *, lower_bound, block_v,
):
    # The value block varies fastest in launch order, then the head: CTAs resident together stream
    # one contiguous stretch of the state rather than the same slab of 64+ different sequences.
    vb, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    dk = s_ref.shape[2]
    heads_k = pl.ds(h * dk, dk)
    cols = pl.ds(vb * block_v, block_v)
    s = s_ref[b, h, :, cols]  # first: the slab's load is in flight while the token's vectors are computed

    # Every value block's program writes the head's q and k conv states, the same values from
    # registers: cheaper than a branch in which one program loads them again to write them.
    conv_silu = functools.partial(_conv_silu, qkv_ref, conv_ref, weight_ref, conv_out_ref, b)
    q = conv_silu(0, heads_k)
    k = conv_silu(1, heads_k)
    decay, beta = _decay_and_beta(f_ref, dt_bias_ref, a_log_ref, beta_ref, b, h, heads_k, lower_bound)
    v = conv_silu(2, pl.ds(h * dk + vb * block_v, block_v))
    # q's and k's L2 norms are scalars applied after the reductions over the slab, so that those
    # reductions need not wait for the norms' own.
    s_out_ref[b, h, :, cols], o = slab_update(
        s, q, k, v, decay, beta, q_scale=dk**-0.5 * _norm_scale(q), k_scale=_norm_scale(k)
    )
    o_ref[b, h, cols] = o.astype(o_ref.dtype)


def slab_update(s, q, k, v, decay, beta, *, q_scale, k_scale):
    """The delta rule on a [dk, block_v] slab of the state for q_scale q and k_scale k (scalars):
    (new slab, o's block_v columns).

    With D = diag(decay): predicted = k^T D S and o = q^T D S + (q . k) delta, two independent
    reductions over the old state, then S <- D S + k delta^T."""
    predicted = jnp.sum((k * decay)[:, None] * s, axis=0) * k_scale
    o = jnp.sum((q * decay)[:, None] * s, axis=0) * q_scale
    delta = (v - predicted) * beta
    new = s * decay[:, None] + (k * k_scale)[:, None] * delta[None, :]
    return new, o + jnp.sum(q * k) * (q_scale * k_scale) * delta


def fused_decode_step(
    qkv, conv_state, conv_weight, f, dt_bias, a_log, beta_logits, state, *, lower_bound, block_v=64, num_warps=4,
    interpret=False,
):
    """The fused one-token KDA step; shapes as `kda.kda_decode_step`. The recurrent state is
    updated in place (donate it under jit, or XLA copies it first). Each program streams a
    [dk, block_v] slab of one head's state; the defaults, 64 columns with 4 warps, are the fastest
    of eight launch shapes on the H200 (bench/RESULTS.md; 8 warps take twice as long). On the H200
    the kernel reaches 76-79% of the state-bytes roofline at batch 64 and 256 (H = 64, D = 128),
    where the two-kernel step (`decode_update_mosaic`) reaches 82-84%; with less than 64 MiB of
    state, or at D = 64, it is the faster of the two. What holds it there is XLA's launch, which
    leaves 28 KiB of L1 per SM for its loads (docs/kda.md)."""
    b, h, _, dv = state.shape
    block_v = min(block_v, dv)
    kernel = pl.pallas_call(
        functools.partial(_decode_kernel, lower_bound=lower_bound, block_v=block_v),
        grid=(dv // block_v, h, b),
        out_shape=[
            jax.ShapeDtypeStruct((b, h, dv), qkv.dtype),
            jax.ShapeDtypeStruct(conv_state.shape, qkv.dtype),
            jax.ShapeDtypeStruct(state.shape, jnp.float32),
        ],
        input_output_aliases={7: 2},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_decode_step",
    )
    return kernel(qkv, conv_state, conv_weight, f, dt_bias, a_log, beta_logits, state)


def _token_kernel(
    qkv_ref, conv_ref, weight_ref, f_ref, dt_bias_ref, a_log_ref, beta_ref, vectors_ref, conv_out_ref, *, lower_bound,
):
    h, b = pl.program_id(0), pl.program_id(1)
    d = vectors_ref.shape[-1]
    heads = pl.ds(h * d, d)
    conv_silu = functools.partial(_conv_silu, qkv_ref, conv_ref, weight_ref, conv_out_ref, b)
    q, k, v = (conv_silu(part, heads) for part in range(3))
    decay, beta = _decay_and_beta(f_ref, dt_bias_ref, a_log_ref, beta_ref, b, h, heads, lower_bound)
    root_beta = jnp.sqrt(beta)
    vectors_ref[b, h, 0, :] = q * (d**-0.5 * _norm_scale(q))
    vectors_ref[b, h, 1, :] = k * (root_beta * _norm_scale(k))
    vectors_ref[b, h, 2, :] = decay
    vectors_ref[b, h, 3, :] = v * root_beta


def token_vectors(
    qkv, conv_state, conv_weight, f, dt_bias, a_log, beta_logits, *, lower_bound, num_warps=4, interpret=False,
):
    """The decode step's token side, one program per head: (vectors [B, H, 4, d] fp32: q normalised
    and scaled, sqrt(beta) k with k normalised, the decay exp(g), sqrt(beta) v; the new conv state).
    Shapes as `kda.kda_decode_step`, dk = dv = d; the oracle is `kda.decode_token_vectors_reference`."""
    b, _, c = qkv.shape
    h = a_log.shape[0]
    d = c // h
    return pl.pallas_call(
        functools.partial(_token_kernel, lower_bound=lower_bound),
        grid=(h, b),
        out_shape=[
            jax.ShapeDtypeStruct((b, h, 4, d), jnp.float32),
            jax.ShapeDtypeStruct(conv_state.shape, qkv.dtype),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_decode_token_vectors",
    )(qkv, conv_state, conv_weight, f, dt_bias, a_log, beta_logits)
