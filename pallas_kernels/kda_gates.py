"""The first stage of the chunked KDA scan on the GPU: G, the running sum of the log decays g inside
each 64-token chunk, with G at every 8th token (the intra kernel's reference tokens) and exp(G_last)
(the chain's decay per chunk). A memory-bound pass (g in, G out, fp32), in Pallas, Triton backend;
`gate_sums_reference` is the same in jnp.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

CHUNK = 64  # tokens per chunk of the scan
MARK = 8  # G is also passed at every MARK-th token


def _gate_sums_kernel(lengths_ref, g_ref, cum_ref, *, block):
    n, col, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    tokens, cols = pl.ds(n * CHUNK, CHUNK), pl.ds(col * block, block)
    # Tokens at or past a sequence's length do not decay; masked rows are not read (past T included).
    valid = n * CHUNK + jnp.arange(CHUNK) < lengths_ref[b]
    g = pltriton.load(g_ref.at[b, tokens, cols], mask=valid[:, None], other=0.0)
    cum_ref[b, tokens, cols] = jnp.cumsum(g.astype(jnp.float32), axis=0)


def gate_sums(g, lengths, padded, *, block=256, num_warps=4, interpret=False):
    """G [B, T', H, dk] fp32, zero-extended past each sequence's length; G at every 8th token
    [B, T' / 8, H, dk]; exp(G_last) [B, H, T' / 64, dk]. g [B, T, H, dk] (natural-log decays),
    lengths [B] int32 (<= T), T' = `padded` (T rounded up to whole chunks). Each program sums a
    [64, block'] tile of the [T, H dk] gates of one sequence, block' the widest power of two up to
    `block` that divides H dk (Triton's blocks are powers of two; dk in (64, 128) makes it >= 64)."""
    b, t, h, dk = g.shape
    width = h * dk
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    block = math.gcd(width, block)
    cum = pl.pallas_call(
        functools.partial(_gate_sums_kernel, block=block),
        grid=(padded // CHUNK, width // block, b),
        out_shape=jax.ShapeDtypeStruct((b, padded, width), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_gate_sums",
    )(lengths, g.reshape(b, t, width))
    return marks_and_decay(cum.reshape(b, padded, h, dk))


def gate_sums_reference(g, lengths, padded):
    """`gate_sums` in jnp, in two levels: running sums inside 8-token blocks plus the running totals
    of the blocks (G at every 8th token)."""
    b, _, h, dk = g.shape
    x = gates_by_chunk(g, lengths, padded).reshape(b, padded // CHUNK, CHUNK // MARK, MARK, h * dk)
    inner = jnp.cumsum(x, axis=3)
    totals = jnp.cumsum(inner[:, :, :, -1], axis=2)  # G at every 8th token
    before = jnp.pad(totals[:, :, :-1], [(0, 0), (0, 0), (1, 0), (0, 0)])  # the earlier blocks' total
    return marks_and_decay((inner + before[:, :, :, None]).reshape(b, padded, h, dk))


def marks_and_decay(cum):
    """(G, G at every 8th token, exp(G_last) [B, H, T' / 64, dk]) from G [B, T', H, dk]."""
    return cum, cum[:, MARK - 1 :: MARK], jnp.exp(jnp.swapaxes(cum[:, CHUNK - 1 :: CHUNK], 1, 2))


def gates_by_chunk(g, lengths, padded):
    """g as [B, T' / 64, 64, H * dk] fp32, T' = `padded` tokens: zero at or past a sequence's length
    (those tokens do not decay) and in the padding."""
    b, t, h, dk = g.shape
    g = jnp.where((jnp.arange(t) < lengths[:, None])[:, :, None, None], g.astype(jnp.float32), 0.0)
    return jnp.pad(g, [(0, 0), (0, padded - t), (0, 0), (0, 0)]).reshape(b, padded // CHUNK, CHUNK, h * dk)
