"""KDA kernels for NVIDIA GPUs in Pallas, Triton backend: the chunked prefill scan and the fused decode step.

Why the Triton backend: the scan needs triangular algebra, per-channel decays and cross-row
reductions on register tiles; Triton lays those out itself. The kernels lower to Triton IR on the
CPU too (interpret mode runs them); only the H200 compiles and times them. `kda.py` dispatches here.

Prefill, per head and 64-token chunk, with G the running sum of the log decays inside the chunk
(log2 units here) and q, k L2-normalised (q also scaled by dk^-0.5):
- `_intra_kernel` (parallel over every chunk), in 16-token blocks: the ten blocks on or below the
  diagonal of A_kk = strict_tril(beta k . k decayed) and A_qk = tril(q . k decayed), each a
  [16, d] x [d, 16] product; T = (I + A_kk)^-1 block by block; the WY factors w = T (beta k 2^G),
  u = T (beta v); and, so that A_qk never enters the serial loop, q_w = q 2^G - A_qk w and A_qk u.
  Also k 2^(G_last - G) and 2^G_last.
- `_chain_kernel` (serial over chunks, parallel over batch, head and value columns): with the fp32
  state S, v_new = u - w S, o = q_w S + A_qk u, S <- 2^G_last S + (k 2^(G_last - G))^T v_new
  (o = q 2^G S + A_qk v_new rewritten with v_new = u - w S).

Decays factor through the end of each key's 16-token block J: key factor 2^(G_J,end - G_j) <= 1,
query factor 2^(G_i - G_J,end) <= 1 for rows past J and at most 2^(15 |g| log2 e) inside J. That is
exact while every per-token gate g >= MIN_GATE (about -5.5; the model's lower bound is -5).

Precision (bf16 inputs, fp32 state): products of fp32 operands run in tf32; along the chain S is
split into two bf16 halves for w S (w is stored in bf16). Measured on the H200 against the fp32
reference: state error 6e-4, outputs 3e-3 against a bf16 rounding floor of 2.6e-3; fla and jla are
at 6e-3 to 7e-3 on the same inputs. u, q_w, A_qk u and k 2^(G_last - G) stay fp32 in HBM: in bf16
they would cost 1e-3 to 3e-3 of relative error.

Speed (bench/RESULTS.md): about 3x slower than fla's chunk_kda. Nsight Compute on the H200: both
scan kernels use 255 registers per thread; the intra kernel runs at 12.5% occupancy (two programs
per SM) and its time did not move when the block inverse or the running sums were left out (2.7 ms
at (1, 16384, 16) either way); the chain spills (856k local-memory requests) and its pipelined loads
take 127 KB of shared memory, one program per SM.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

CHUNK = 64
SUB_CHUNK = 16
N_SUB = CHUNK // SUB_CHUNK
LOG2E = math.log2(math.e)
L2_EPS = 1e-6
# 2^120 * 128 channels stays finite in fp32; exact inside a sub-chunk while 15 * |g| * log2 e <= 120.
MAX_EXP2 = 120.0
MIN_GATE = -MAX_EXP2 / (SUB_CHUNK - 1) / LOG2E


@dataclasses.dataclass(frozen=True)
class ScanConfig:
    """Launch shape of the prefill kernels (benchmarked in bench/kda.py)."""

    block_v: int = 32  # value columns of the state per chain program
    intra_warps: int = 4
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


def _unit_lower_inverse(blocks):
    """T = (I + A)^-1 for strictly lower A given as 16x16 blocks {(i, j): A_ij, i >= j}: the diagonal
    blocks by doubling ((I + N)(I + N^2)(I + N^4)(I + N^8) with N = -A_ii, N^16 = 0), then block rows
    top-down, T_ij = -T_ii sum_{j <= m < i} A_im T_mj."""
    t = {}
    for i in range(N_SUB):
        power = -blocks[i, i]
        inv = jnp.eye(SUB_CHUNK, dtype=jnp.float32) + power
        for _ in range(int(math.log2(SUB_CHUNK)) - 1):
            power = _dot(power, power)
            inv = inv + _dot(inv, power)
        t[i, i] = inv
    for i in range(1, N_SUB):
        for j in range(i):
            acc = sum(_dot(blocks[i, m], t[m, j]) for m in range(j, i))
            t[i, j] = -_dot(t[i, i], acc)
    return t


def _intra_kernel(lengths_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, qw_ref, ou_ref, kd_ref, decay_ref):
    """One chunk of one head, in 16-token sub-chunks (blocks I, J below; rows i, j).

    Decays factor through the end of the key's sub-chunk J: key factor 2^(G_Jend - G_j) <= 1, query
    factor 2^(G_i - G_Jend) <= 1 for i past J and at most 2^(15 |g| log2 e) inside J. Products are
    [16, d] x [d, 16] blocks, only the ten on or below the diagonal."""
    n, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    dk = q_ref.shape[-1]
    length = lengths_ref[b]
    sub_row = lax.broadcasted_iota(jnp.int32, (SUB_CHUNK, SUB_CHUNK), 0)
    sub_col = lax.broadcasted_iota(jnp.int32, (SUB_CHUNK, SUB_CHUNK), 1)

    def rows(i):
        return pl.ds(n * CHUNK + i * SUB_CHUNK, SUB_CHUNK)

    def load(ref, i):
        # Tokens past the sequence's length neither decay nor write the state: g = 0, beta = 0.
        valid = n * CHUNK + i * SUB_CHUNK + lax.broadcasted_iota(jnp.int32, (SUB_CHUNK, 1), 0) < length
        x = ref[b, rows(i), h][:, None] if ref.ndim == 3 else ref[b, rows(i), h, :]
        return jnp.where(valid, x.astype(jnp.float32), 0.0)

    def sub_chunk(i, start):
        """Normalised q and k, beta [16, 1] and the running log2 decay G of sub-chunk i (G = start
        before it), with G at its last token."""
        q, k = load(q_ref, i), load(k_ref, i)
        q = q * (dk**-0.5 / jnp.sqrt(jnp.sum(q * q, axis=1, keepdims=True) + L2_EPS))
        k = k / jnp.sqrt(jnp.sum(k * k, axis=1, keepdims=True) + L2_EPS)
        g = load(g_ref, i) * LOG2E
        return q, k, load(beta_ref, i), start[None, :] + jnp.cumsum(g, axis=0), start + jnp.sum(g, axis=0)

    # Scores: A_kk strictly lower (beta_i k_i . k_j decayed), A_qk lower (q_i . k_j decayed).
    ends, keys, a_kk, a_qk = [], [], {}, {}
    end = jnp.zeros((dk,), jnp.float32)
    for i in range(N_SUB):
        q, k, beta, cum, end = sub_chunk(i, end)
        ends.append(end)
        keys.append(k * jnp.exp2(end[None, :] - cum))
        for j in range(i + 1):
            to_end = jnp.exp2(jnp.minimum(cum - ends[j][None, :], MAX_EXP2))
            kk = beta * _dot(k * to_end, keys[j], trans_b=True)
            qk = _dot(q * to_end, keys[j], trans_b=True)
            a_kk[i, j] = jnp.where(sub_col < sub_row, kk, 0.0) if i == j else kk
            a_qk[i, j] = jnp.where(sub_col <= sub_row, qk, 0.0) if i == j else qk
    t = _unit_lower_inverse(a_kk)
    last = ends[-1]
    decay_ref[b, h, n, :] = jnp.exp2(last)

    # w = T (beta k 2^G); q_w = q 2^G - A_qk w (so that the chain's o = q_w S + A_qk u); k 2^(G_last - G).
    # The sub-chunks are loaded and normalised again rather than kept: the kernel is short of registers.
    w, end = [None] * N_SUB, jnp.zeros((dk,), jnp.float32)
    for j in range(N_SUB):
        q, k, beta, cum, end = sub_chunk(j, end)
        x = k * beta * jnp.exp2(cum)
        for i in range(j, N_SUB):
            part = _dot(t[i, j], x)
            w[i] = part if w[i] is None else w[i] + part
        w_ref[b, h, rows(j), :] = w[j].astype(w_ref.dtype)
        qw_ref[b, h, rows(j), :] = q * jnp.exp2(cum) - sum(_dot(a_qk[j, m], w[m]) for m in range(j + 1))
        kd_ref[b, h, rows(j), :] = k * jnp.exp2(last[None, :] - cum)

    # u = T (beta v); A_qk u.
    u = [None] * N_SUB
    for j in range(N_SUB):
        y = load(v_ref, j) * load(beta_ref, j)
        for i in range(j, N_SUB):
            part = _dot(t[i, j], y)
            u[i] = part if u[i] is None else u[i] + part
        u_ref[b, h, rows(j), :] = u[j]
        ou_ref[b, h, rows(j), :] = sum(_dot(a_qk[j, m], u[m]) for m in range(j + 1))


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


def intra(q, k, v, g, beta, lengths, *, config=ScanConfig(), interpret=False):
    """The parallel half of the scan, per chunk: w (bf16), u, q_w, A_qk u, k 2^(G_last - G), 2^G_last."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    f32 = jnp.float32
    return pl.pallas_call(
        _intra_kernel,
        grid=(t // CHUNK, h, b),
        out_shape=[
            jax.ShapeDtypeStruct((b, h, t, dk), jnp.bfloat16),  # w
            jax.ShapeDtypeStruct((b, h, t, dv), f32),  # u
            jax.ShapeDtypeStruct((b, h, t, dk), f32),  # q_w
            jax.ShapeDtypeStruct((b, h, t, dv), f32),  # A_qk u
            jax.ShapeDtypeStruct((b, h, t, dk), f32),  # k 2^(G_last - G)
            jax.ShapeDtypeStruct((b, h, t // CHUNK, dk), f32),  # 2^G_last
        ],
        compiler_params=pltriton.CompilerParams(num_warps=config.intra_warps, num_stages=1),
        interpret=interpret,
        name="kda_intra",
    )(lengths, q, k, v, g, beta)


def chunk_scan(q, k, v, g, beta, initial_state, lengths, *, config=ScanConfig(), interpret=False):
    """The chunked KDA scan on the GPU. Shapes as `kda.kda_chunk_scan`; `initial_state` fp32
    [B, H, dk, dv] (zeros allowed), `lengths` int32 [B]; T a multiple of CHUNK (callers pad)."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    block_v = min(config.block_v, dv)
    chain = pl.pallas_call(
        functools.partial(_chain_kernel, n_chunks=t // CHUNK, block_v=block_v),
        grid=(dv // block_v, h, b),
        out_shape=[jax.ShapeDtypeStruct((b, t, h, dv), q.dtype), jax.ShapeDtypeStruct((b, h, dk, dv), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=config.chain_warps, num_stages=config.chain_stages),
        interpret=interpret,
        name="kda_chain",
    )
    return chain(*intra(q, k, v, g, beta, lengths, config=config, interpret=interpret), initial_state)


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
