"""The gradient of sparse latent attention over each query's selection alone: FLOPs and bytes in the
selection's width W, not in the sequence (the reference's own vjp builds dense [H, S] scores a query).

For one query (all heads at once) with selected rows c_j, which are the keys and the values alike:
s = scale q c^T, P = softmax(s) over the selection, o = P c. Given d o,

    dP = d o c^T,    D = sum_j P_j dP_j  (= d o . o),    dS = P (dP - D),
    d q = scale dS c,    d c_j = scale dS_j^T q + P_j^T d o  (summed over heads),

and a row's gradient is the sum of d c_j over every query that selected it. Blocks of queries gather
their rows, and scatter-add their d c into the sequence's [B, S, R] fp32 gradient, carried through
a scan; that gradient goes back to the latents (pages, per-token scales, the rounding to q_lat's
dtype) through the vjp of the rows' preparation, as in the reference.

The products take q_lat's dtype with fp32 accumulation; P and dS are rounded to it for the second
products, as flash attention's backward does (for fp32 q_lat everything is fp32).
"""

import jax
import jax.numpy as jnp

from pallas_kernels.common import HIGHEST, join_query_blocks, query_blocks
from pallas_kernels.latent_attention.reference import sequence_latents
from pallas_kernels.latent_attention.splits import mark_repeats_empty

GATHERED_ELEMENTS = 2**25  # a block's gathered rows (B x queries x W x R): 64 MiB in bf16


def _product(spec, a, b):
    return jnp.einsum(spec, a, b, precision=HIGHEST, preferred_element_type=jnp.float32)


def sparse_latent_attention_backward(
    q_lat, latents, indices, d_out, *, scale, latent_scales=None, page_table=None, distinct_indices=False,
    block_queries=None,
):
    """(d q_lat, d latents) of `sparse_latent_attention_reference(q_lat, latents, indices, ...)` for
    the output's cotangent d_out [B, T, H, R]; the arguments as the reference's (checked by
    `sparse_latent_attention`). `distinct_indices`: no row repeats an index (else repeats are marked
    empty first: a token counts once). `block_queries`: queries a step gathers for (None: as many as
    keep B x queries x W x R within GATHERED_ELEMENTS)."""
    b, t, _, r = q_lat.shape
    w = indices.shape[-1]
    if not distinct_indices:
        indices = mark_repeats_empty(indices)
    keys, keys_vjp = jax.vjp(lambda c: sequence_latents(q_lat, c, latent_scales, page_table), latents)
    s = keys.shape[1]
    block = min(t, block_queries or max(1, GATHERED_ELEMENTS // (b * max(w, 1) * r)))
    batch = jnp.arange(b)[:, None, None]

    def step(d_keys, xs):
        q, d_o, idx = xs  # [B, block, H, R], [B, block, H, R], [B, block, W]
        valid = (idx >= 0) & (idx < s)
        rows = keys[batch, jnp.where(valid, idx, 0)]  # [B, block, W, R]
        logits = jnp.where(valid[:, :, None], _product("bqhr,bqwr->bqhw", q, rows) * scale, -jnp.inf)
        top = jnp.max(logits, axis=-1, keepdims=True)
        p = jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0))
        total = p.sum(-1, keepdims=True)
        p = p / jnp.where(total > 0, total, 1.0)
        d_p = _product("bqhr,bqwr->bqhw", d_o, rows)
        d_s = (p * (d_p - jnp.sum(p * d_p, axis=-1, keepdims=True))).astype(q.dtype)
        d_q = scale * _product("bqhw,bqwr->bqhr", d_s, rows)
        d_rows = scale * _product("bqhw,bqhr->bqwr", d_s, q) + _product("bqhw,bqhr->bqwr", p.astype(q.dtype), d_o)
        d_keys = d_keys.at[batch, jnp.where(valid, idx, s)].add(d_rows, mode="drop")
        return d_keys, d_q.astype(q_lat.dtype)

    xs = (query_blocks(q_lat, 0, block), query_blocks(d_out.astype(q_lat.dtype), 0, block), query_blocks(indices, -1, block))
    d_keys, d_q = jax.lax.scan(step, jnp.zeros(keys.shape, jnp.float32), xs)
    d_q = join_query_blocks(d_q, t)
    (d_latents,) = keys_vjp(d_keys.astype(keys.dtype))
    return d_q, d_latents
