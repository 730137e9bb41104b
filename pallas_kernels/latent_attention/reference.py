"""The pure-jnp reference of sparse latent attention: dense scores over every key, masked to each
query's selection, a block of queries at a time (the [H, T, S] scores are never whole)."""

import jax
import jax.numpy as jnp

from pallas_kernels.common import HIGHEST, map_query_blocks

QUERY_BLOCK = 256


def sequence_latents(q_lat, latents, latent_scales, page_table):
    """Each sequence's latents [B, S, R] as the attention uses them: scaled, rounded to q_lat's dtype."""
    if page_table is not None:
        b = page_table.shape[0]
        latents = latents[page_table].reshape(b, -1, latents.shape[-1])
        latent_scales = None if latent_scales is None else latent_scales[page_table].reshape(b, -1)
    if latent_scales is not None:
        latents = latents.astype(jnp.float32) * latent_scales[..., None]
    return latents.astype(q_lat.dtype)


def sparse_latent_attention_reference(q_lat, latents, indices, *, scale, latent_scales=None, page_table=None):
    """q_lat [B, T, H, R]; latents [B, S, R], or pages [n_pages, page_size, R] with page_table
    [B, pages_per_sequence] int32 (then S = pages_per_sequence * page_size); latent_scales None or
    [B, S] / [n_pages, page_size] (multiplies each token's latent); indices [B, T, W] int32 into S
    (-1 or out of range = empty). Page-table entries must lie in [0, n_pages).

    Returns o_lat [B, T, H, R] in q_lat.dtype; a query with no selected token gets zeros.
    Queries are processed in blocks so the [H, T, S] score matrix is never whole.
    """
    b = q_lat.shape[0]
    keys = sequence_latents(q_lat, latents, latent_scales, page_table).astype(jnp.float32)
    s = keys.shape[1]

    def attend(xs):
        q, idx = xs  # [B, block, H, R], [B, block, W]
        # Scatter the selection into a [B, block, S] mask; -1 goes out of bounds and is dropped.
        target = jnp.where(idx < 0, s, idx)
        rows = jnp.arange(q.shape[1])[None, :, None]
        batch = jnp.arange(b)[:, None, None]
        selected = jnp.zeros((b, q.shape[1], s), jnp.bool_).at[batch, rows, target].set(True, mode="drop")
        logits = jnp.einsum("bqhr,bsr->bhqs", q.astype(jnp.float32), keys, precision=HIGHEST) * scale
        logits = jnp.where(selected[:, None], logits, -jnp.inf)
        any_selected = selected.any(-1)[:, None, :, None]
        probs = jax.nn.softmax(jnp.where(any_selected, logits, 0.0), axis=-1)
        probs = jnp.where(selected[:, None] & any_selected, probs, 0.0)
        return jnp.einsum("bhqs,bsr->bqhr", probs, keys, precision=HIGHEST)

    return map_query_blocks(attend, (q_lat, indices), (0, -1), QUERY_BLOCK).astype(q_lat.dtype)
