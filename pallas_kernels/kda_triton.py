"""KDA kernels for NVIDIA GPUs in Pallas, Triton backend: the chunked prefill scan and the fused decode step.

Why the Triton backend: the scan needs 64x64 triangular algebra, per-channel decays and cross-row
reductions on register tiles; Triton lays those out itself, and every kernel here was checked for
lowering on the CPU (in interpret mode) before its first GPU run. `kda.py` dispatches to this module.

Prefill, per head and 64-token chunk, with G the running sum of the log decays inside the chunk
(log2 units here) and q, k L2-normalised (q also scaled by dk^-0.5):
- `_intra_kernel` (parallel over every chunk): A_kk = strict_tril(beta k . k decayed), A_qk =
  tril(q . k decayed), T = (I + A_kk)^-1, and the chunk's WY factors u = T (beta v),
  w = T (beta k 2^G); also q 2^G, k 2^(G_last - G) and 2^G_last.
- `_chain_kernel` (serial over chunks, parallel over batch, head and value columns): with the fp32
  state S, v_new = u - w S, o = (q 2^G) S + A_qk v_new, S <- 2^G_last S + (k 2^(G_last - G))^T v_new.

Decays inside a chunk are factored through 16-token sub-chunks: for keys in sub-chunk J the
reference is J's last token, so the key factor 2^(G_J,end - G_j) <= 1 always and the query factor
2^(G_i - G_J,end) is <= 1 for every later row and at most 2^(15 |g| log2 e) inside J. That is exact
while every per-token gate g >= -5.5 (the model's lower bound is -5); rows before J are masked, and
their factor is clamped so that nothing overflows.

Precision (bf16 inputs, fp32 state): dots of fp32 operands run in tf32 inside a chunk; along the
chain S is split into two bf16 halves for w S (w is stored in bf16), and (q 2^G) S, A_qk v_new and
k^T v_new run in tf32 (or three bf16 passes with `chain_x3`). Measured on the H200 against the fp32
reference: state error 6e-4 (3e-4 with chain_x3), outputs at the bf16 rounding floor; fla and jla
are at 6e-3 to 7e-3 on the same inputs. Rounding u, q 2^G, k 2^(G_last - G) or A_qk to bf16 (as
fla does) would cost 1e-3 to 3e-3 relative error, so they stay fp32 in HBM.

Speed (bench/RESULTS.md): about 3x slower than fla's chunk_kda. The intra kernel dominates: it
runs 10 dependent 64x64 products for T plus eight 64x64x32 products per channel slice, each a
round trip between registers and shared memory, with one or two programs per SM.
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
LOG2E = math.log2(math.e)
L2_EPS = 1e-6
# 2^120 * 128 channels stays finite in fp32; exact inside a sub-chunk while 15 * |g| * log2 e <= 120.
MAX_EXP2 = 120.0
MIN_GATE = -MAX_EXP2 / (SUB_CHUNK - 1) / LOG2E
X3 = lax.DotAlgorithmPreset.BF16_BF16_F32_X3


@dataclasses.dataclass(frozen=True)
class ScanConfig:
    """Launch shape of the prefill kernels (benchmarked in bench/kda.py)."""

    block_v: int = 32  # value columns of the state per chain program
    intra_warps: int = 4
    chain_warps: int = 4
    chain_stages: int = 2
    intra_width: int = 32  # key channels per slice inside the intra kernel
    chain_x3: bool = False  # three bf16 passes (else tf32) for (q 2^G) S, A_qk v_new and k^T v_new


def _dot(a, b, *, trans_a=False, trans_b=False, precision=None):
    dims = (((0,) if trans_a else (1,), (1,) if trans_b else (0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _split_dot(a_bf16, s):
    """a @ s with bf16 `a` and fp32 `s` carried as two bf16 halves: exact to 2^-16 of s."""
    hi = s.astype(jnp.bfloat16)
    lo = (s - hi.astype(jnp.float32)).astype(jnp.bfloat16)
    return _dot(a_bf16, hi) + _dot(a_bf16, lo)


def _l2_normalise(x):
    return x / jnp.sqrt(jnp.sum(x * x, axis=1, keepdims=True) + L2_EPS)


def _intra_kernel(
    lengths_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, qg_ref, kd_ref, aqk_ref, decay_ref, *, width
):
    """One chunk of one head. Everything but the L2 norms is separable over key channels, so the
    channels are taken `width` at a time: few tiles are live at once (the kernel is register bound)."""
    n, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    c, dk, dv = CHUNK, q_ref.shape[-1], v_ref.shape[-1]
    rows = pl.ds(n * c, c)
    # Tokens past the sequence's length neither decay nor write the state: g = 0, beta = 0.
    length = lengths_ref[b]
    valid = n * c + lax.broadcasted_iota(jnp.int32, (c, 1), 0) < length

    def load(ref, chans):
        return jnp.where(valid, ref[b, rows, h, chans].astype(jnp.float32), 0.0)

    slices = [pl.ds(i, width) for i in range(0, dk, width)]
    inv_q = dk**-0.5 / jnp.sqrt(sum(jnp.sum(jnp.square(load(q_ref, s)), axis=1, keepdims=True) for s in slices) + L2_EPS)
    inv_k = 1.0 / jnp.sqrt(sum(jnp.sum(jnp.square(load(k_ref, s)), axis=1, keepdims=True) for s in slices) + L2_EPS)
    beta = jnp.where(valid, beta_ref[b, rows, h][:, None].astype(jnp.float32), 0.0)  # [C, 1]

    row = lax.broadcasted_iota(jnp.int32, (c, width), 0)
    sub = row // SUB_CHUNK
    n_sub = c // SUB_CHUNK

    def channels(chans):
        """Normalised k and the running log2 decay G of one channel slice, with G at each sub-chunk's end."""
        k = load(k_ref, chans) * inv_k
        cum = jnp.cumsum(load(g_ref, chans) * LOG2E, axis=0)
        ends = [jnp.sum(jnp.where(row == SUB_CHUNK * j + SUB_CHUNK - 1, cum, 0.0), axis=0) for j in range(n_sub)]
        return k, cum, ends

    kk = jnp.zeros((c, c), jnp.float32)
    qk = jnp.zeros((c, c), jnp.float32)
    for chans in slices:
        k, cum, ends = channels(chans)
        q = load(q_ref, chans) * inv_q
        own_end = ends[0][None, :]
        for j in range(1, n_sub):
            own_end = jnp.where(sub == j, ends[j][None, :], own_end)
        k_to_end = k * jnp.exp2(own_end - cum)  # decay from each key to its sub-chunk's end: <= 1
        for j in range(n_sub):
            from_end = jnp.exp2(jnp.minimum(cum - ends[j][None, :], MAX_EXP2))
            keys = jnp.where(sub == j, k_to_end, 0.0)
            kk += _dot(k * beta * from_end, keys, trans_b=True)
            qk += _dot(q * from_end, keys, trans_b=True)
        qg_ref[b, h, rows, chans] = q * jnp.exp2(cum)
        kd_ref[b, h, rows, chans] = k * jnp.exp2(ends[-1][None, :] - cum)
        decay_ref[b, h, n, chans] = jnp.exp2(ends[-1])

    i_idx = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    j_idx = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    aqk_ref[b, h, rows, :] = jnp.where(j_idx <= i_idx, qk, 0.0)
    # T = (I + A_kk)^-1 = prod_m (I + N^(2^m)) with N = -A_kk strictly lower, so N^64 = 0.
    power = -jnp.where(j_idx < i_idx, kk, 0.0)
    t = jnp.where(j_idx == i_idx, 1.0, 0.0) + power
    for _ in range(int(math.log2(c)) - 1):
        power = _dot(power, power)
        t = t + _dot(t, power)

    for chans in slices:
        k, cum, _ = channels(chans)
        w_ref[b, h, rows, chans] = _dot(t, k * beta * jnp.exp2(cum)).astype(w_ref.dtype)
    for i in range(0, dv, width):
        u_ref[b, h, rows, pl.ds(i, width)] = _dot(t, load(v_ref, pl.ds(i, width)) * beta)


def _chain_kernel(
    w_ref, u_ref, qg_ref, kd_ref, aqk_ref, decay_ref, s0_ref, o_ref, s_ref, *, n_chunks, block_v, x3
):
    vb, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    c = CHUNK
    cols = pl.ds(vb * block_v, block_v)
    precision = X3 if x3 else None

    def step(n, s):
        rows = pl.ds(n * c, c)
        v_new = u_ref[b, h, rows, cols] - _split_dot(w_ref[b, h, rows, :], s)
        o = _dot(qg_ref[b, h, rows, :], s, precision=precision) + _dot(aqk_ref[b, h, rows, :], v_new, precision=precision)
        o_ref[b, rows, h, cols] = o.astype(o_ref.dtype)
        decay = decay_ref[b, h, n, :]
        return s * decay[:, None] + _dot(kd_ref[b, h, rows, :], v_new, trans_a=True, precision=precision)

    s_ref[b, h, :, cols] = lax.fori_loop(0, n_chunks, step, s0_ref[b, h, :, cols])


def intra(q, k, v, g, beta, lengths, *, config=ScanConfig(), interpret=False):
    """The parallel half of the scan: per chunk (w, u, q 2^G, k 2^(G_last - G), A_qk, 2^G_last)."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    n_chunks = t // CHUNK
    f32 = jnp.float32
    return pl.pallas_call(
        functools.partial(_intra_kernel, width=min(config.intra_width, dk, dv)),
        grid=(n_chunks, h, b),
        out_shape=[
            jax.ShapeDtypeStruct((b, h, t, dk), jnp.bfloat16),  # w
            jax.ShapeDtypeStruct((b, h, t, dv), f32),  # u
            jax.ShapeDtypeStruct((b, h, t, dk), f32),  # q 2^G
            jax.ShapeDtypeStruct((b, h, t, dk), f32),  # k 2^(G_last - G)
            jax.ShapeDtypeStruct((b, h, t, CHUNK), f32),  # A_qk
            jax.ShapeDtypeStruct((b, h, n_chunks, dk), f32),  # 2^G_last
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
        functools.partial(_chain_kernel, n_chunks=t // CHUNK, block_v=block_v, x3=config.chain_x3),
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

    cols = pl.ds(vb * block_v, block_v)
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

    s = s_ref[b, h, :, cols] * jnp.exp(g)[:, None]
    predicted = jnp.sum(k[:, None] * s, axis=0)
    s = s + k[:, None] * ((v - predicted) * beta)[None, :]
    s_out_ref[b, h, :, cols] = s
    o_ref[b, h, cols] = jnp.sum(q[:, None] * s, axis=0).astype(o_ref.dtype)


def decode_step(
    qkv, conv_state, conv_weight, f, dt_bias, a_log, beta_logits, state, *, lower_bound, block_v=32, interpret=False
):
    """The fused one-token KDA step; shapes as `kda.kda_decode_step`. The recurrent state is
    updated in place (donate it under jit, or XLA copies it first). Each program streams a
    [dk, block_v] slab of one head's state: small slabs keep many loads in flight."""
    b, h, dk, dv = state.shape
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
        compiler_params=pltriton.CompilerParams(num_warps=4 if block_v * dk <= 4096 else 8, num_stages=1),
        interpret=interpret,
        name="kda_decode_step",
    )
    return kernel(qkv, conv_state, conv_weight, f, dt_bias, a_log, beta_logits, state)
