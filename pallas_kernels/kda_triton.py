"""KDA kernels for NVIDIA GPUs in Pallas, Triton backend: the serial chain of the chunked prefill
scan and the fused decode step. `kda.py` dispatches here; the parallel half of the scan is the
Mosaic GPU kernel in `kda_intra`.

Prefill, per head and 64-token chunk (G the running sum of the log decays inside the chunk):
`kda_intra.intra` computes, for every chunk at once, the WY factors w and u, q_w = q exp(G) - A_qk w,
A_qk u, k exp(G_last - G) and exp(G_last). `_chain_kernel` (serial over chunks, parallel over batch,
head and value columns) carries the fp32 state S: v_new = u - w S, o = q_w S + A_qk u,
S <- exp(G_last) S + (k exp(G_last - G))^T v_new (o = q exp(G) S + A_qk v_new rewritten with
v_new = u - w S).

Precision (fp32 state): the chain's fp32 products run in tf32; S is split into two bf16 halves for
w S (w is bf16). u, q_w, A_qk u and k exp(G_last - G) stay fp32 in HBM: in bf16 they would cost
1e-3 to 3e-3 of relative error.

Speed (bench/RESULTS.md): Nsight Compute on the H200 found the chain at 255 registers per thread,
spilling (856k local-memory requests), its pipelined loads taking 127 KB of shared memory, one
program per SM.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import kda_intra

CHUNK = kda_intra.CHUNK
L2_EPS = kda_intra.L2_EPS


@dataclasses.dataclass(frozen=True)
class ScanConfig:
    """Launch shape of the chain kernel (benchmarked in bench/kda.py)."""

    block_v: int = 32  # value columns of the state per chain program
    chain_warps: int = 4
    chain_stages: int = 3  # loads of the next chunks in flight (H200: 3 beat 2 by 3-4%)


def _dot(a, b, *, trans_a=False, trans_b=False):
    """fp32 operands run in tf32 on the tensor cores (the Triton lowering's default precision)."""
    dims = (((0,) if trans_a else (1,), (1,) if trans_b else (0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _split_dot(a_bf16, s):
    """a @ s with bf16 `a` and fp32 `s` carried as two bf16 halves: exact to 2^-16 of s."""
    hi = s.astype(jnp.bfloat16)
    lo = (s - hi.astype(jnp.float32)).astype(jnp.bfloat16)
    return _dot(a_bf16, hi) + _dot(a_bf16, lo)


def _chain_kernel(w_ref, u_ref, qw_ref, ou_ref, kd_ref, decay_ref, s0_ref, o_ref, s_ref, *, n_chunks, block_v):
    """Serial over chunks for one head and `block_v` value columns, the fp32 state S in registers:
    v_new = u - w S, o = q_w S + A_qk u, S <- 2^G_last S + (k 2^(G_last - G))^T v_new. Only the
    first product is on the path from S to the next S; the output product runs beside it."""
    vb, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(vb * block_v, block_v)

    def step(n, s):
        rows = pl.ds(n * CHUNK, CHUNK)
        v_new = u_ref[b, h, rows, cols] - _split_dot(w_ref[b, h, rows, :], s)
        o = _dot(qw_ref[b, h, rows, :], s) + ou_ref[b, h, rows, cols]
        o_ref[b, rows, h, cols] = o.astype(o_ref.dtype)
        return s * decay_ref[b, h, n, :][:, None] + _dot(kd_ref[b, h, rows, :], v_new, trans_a=True)

    s_ref[b, h, :, cols] = lax.fori_loop(0, n_chunks, step, s0_ref[b, h, :, cols])


def chunk_scan(q, k, v, g, beta, initial_state, lengths, *, out_dtype=jnp.bfloat16, config=ScanConfig(), interpret=False):
    """The chunked KDA scan on the GPU: `kda_intra.intra` (Mosaic GPU), then the serial chain here.
    q, k, v [B, T, H, d] bf16 (d in kda_intra.HEAD_DIMS), g [B, T, H, d] fp32, beta [B, T, H],
    `initial_state` fp32 [B, H, d, d] (zeros allowed), `lengths` int32 [B]. Returns o [B, T', H, d]
    in `out_dtype` (T' = T rounded up to whole chunks; rows past T are meaningless) and the final state."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    block_v = min(config.block_v, dv)
    parts = kda_intra.intra(q, k, v, g, jnp.swapaxes(beta, 1, 2).astype(jnp.float32), lengths, interpret=interpret)
    padded = parts[0].shape[2]
    chain = pl.pallas_call(
        functools.partial(_chain_kernel, n_chunks=padded // CHUNK, block_v=block_v),
        grid=(dv // block_v, h, b),
        out_shape=[jax.ShapeDtypeStruct((b, padded, h, dv), out_dtype), jax.ShapeDtypeStruct((b, h, dk, dv), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=config.chain_warps, num_stages=config.chain_stages),
        interpret=interpret,
        name="kda_chain",
    )
    return chain(*parts, initial_state)


def _decode_kernel(
    qkv_ref, conv_ref, weight_ref, f_ref, dt_bias_ref, a_log_ref, beta_ref, s_ref,
    o_ref, conv_out_ref, s_out_ref, *, lower_bound, block_v,
):
    b, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    dk = s_ref.shape[2]
    kernel = weight_ref.shape[0]
    heads_k = pl.ds(h * dk, dk)
    cols = pl.ds(vb * block_v, block_v)
    s = s_ref[b, h, :, cols]  # first: the slab's load is in flight while the token's vectors are computed

    def conv_silu(part, chans, write):
        """Short conv over the window (conv state[1:], x), SiLU, rounded to the activations' dtype as
        the reference does; the new conv state is that window."""
        x = qkv_ref[b, part, chans]
        history = [conv_ref[b, part, chans, j] for j in range(kernel)]
        window = history[1:] + [x]
        y = sum(window[j].astype(jnp.float32) * weight_ref[j, part, chans] for j in range(kernel))
        if write:
            for j in range(kernel):
                conv_out_ref[b, part, chans, j] = window[j].astype(conv_out_ref.dtype)
        return jax.nn.sigmoid(y) * y

    first = vb == 0
    q = conv_silu(0, heads_k, False).astype(qkv_ref.dtype).astype(jnp.float32)
    k = conv_silu(1, heads_k, False).astype(qkv_ref.dtype).astype(jnp.float32)

    @pl.when(first)
    def _():  # q and k conv states are shared by the value blocks: one program writes them
        conv_silu(0, heads_k, True)
        conv_silu(1, heads_k, True)

    v = conv_silu(2, pl.ds(h * dk + vb * block_v, block_v), True).astype(qkv_ref.dtype).astype(jnp.float32)
    q = q * (dk**-0.5 / jnp.sqrt(jnp.sum(q * q) + L2_EPS))
    k = k / jnp.sqrt(jnp.sum(k * k) + L2_EPS)

    f = f_ref[b, heads_k].astype(jnp.float32) + dt_bias_ref[heads_k].astype(jnp.float32)
    rate = jnp.exp(a_log_ref[h].astype(jnp.float32))
    if lower_bound is not None:
        g = lower_bound * jax.nn.sigmoid(rate * f)
    else:
        g = -rate * jnp.where(f > 20.0, f, jnp.log1p(jnp.exp(jnp.minimum(f, 20.0))))
    beta = jax.nn.sigmoid(beta_ref[b, h].astype(jnp.float32))

    # With D = diag(exp g): predicted = k^T D S and o = q^T D S + (q . k) delta, two independent
    # reductions over the old state, then S <- D S + k delta^T.
    decay = jnp.exp(g)
    predicted = jnp.sum((k * decay)[:, None] * s, axis=0)
    o = jnp.sum((q * decay)[:, None] * s, axis=0)
    delta = (v - predicted) * beta
    s_out_ref[b, h, :, cols] = s * decay[:, None] + k[:, None] * delta[None, :]
    o_ref[b, h, cols] = (o + jnp.sum(q * k) * delta).astype(o_ref.dtype)


def decode_step(
    qkv, conv_state, conv_weight, f, dt_bias, a_log, beta_logits, state, *, lower_bound, block_v=64, num_warps=4,
    interpret=False,
):
    """The fused one-token KDA step; shapes as `kda.kda_decode_step`. The recurrent state is
    updated in place (donate it under jit, or XLA copies it first). Each program streams a
    [dk, block_v] slab of one head's state; the defaults, 64 columns with 4 warps, were the fastest
    of eight launch shapes on the H200 (bench/RESULTS.md; 8 warps took twice as long)."""
    b, h, _, dv = state.shape
    block_v = min(block_v, dv)
    kernel = pl.pallas_call(
        functools.partial(_decode_kernel, lower_bound=lower_bound, block_v=block_v),
        grid=(b, h, dv // block_v),
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
