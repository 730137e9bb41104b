"""DSA attention in the absorbed latent form: each query attends to its selected tokens' latents.

Scores are q_lat . c (q_lat is the query mapped into the kv_lora space through q_absorb, c the
normalised latent); the output stays in latent space (o_absorb maps it to the hidden size).
Selected indices may repeat (a token counts once) and -1 marks an empty slot.
"""

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST
QUERY_BLOCK = 256


def sparse_latent_attention_reference(q_lat, latents, indices, *, scale):
    """q_lat [B, T, H, R]; latents [B, S, R]; indices [B, T, W] int32 into S (-1 = empty).

    Returns o_lat [B, T, H, R] in q_lat.dtype; a query with no selected token gets zeros.
    Queries are processed in blocks so the [H, T, S] score matrix is never whole.
    """
    b, t, h, r = q_lat.shape
    s = latents.shape[1]
    block = min(QUERY_BLOCK, t)
    n_blocks = -(-t // block)
    pad = n_blocks * block - t
    q_blocks = jnp.pad(q_lat, [(0, 0), (0, pad), (0, 0), (0, 0)]).reshape(b, n_blocks, block, h, r)
    i_blocks = jnp.pad(indices, [(0, 0), (0, pad), (0, 0)], constant_values=-1).reshape(b, n_blocks, block, -1)
    keys = latents.astype(jnp.float32)

    def attend(xs):
        q, idx = xs  # [B, block, H, R], [B, block, W]
        # Scatter the selection into a [B, block, S] mask; -1 goes out of bounds and is dropped.
        target = jnp.where(idx < 0, s, idx)
        rows = jnp.arange(block)[None, :, None]
        batch = jnp.arange(b)[:, None, None]
        selected = jnp.zeros((b, block, s), jnp.bool_).at[batch, rows, target].set(True, mode="drop")
        logits = jnp.einsum("bqhr,bsr->bhqs", q.astype(jnp.float32), keys, precision=HIGHEST) * scale
        logits = jnp.where(selected[:, None], logits, -jnp.inf)
        any_selected = selected.any(-1)[:, None, :, None]
        probs = jax.nn.softmax(jnp.where(any_selected, logits, 0.0), axis=-1)
        probs = jnp.where(selected[:, None] & any_selected, probs, 0.0)
        return jnp.einsum("bhqs,bsr->bqhr", probs, keys, precision=HIGHEST)

    out = jax.lax.map(attend, (jnp.moveaxis(q_blocks, 1, 0), jnp.moveaxis(i_blocks, 1, 0)))
    out = jnp.moveaxis(out, 0, 1).reshape(b, n_blocks * block, h, r)[:, :t]
    return out.astype(q_lat.dtype)


def sparse_latent_attention(q_lat, latents, indices, *, scale):
    """Validated entry point; see `sparse_latent_attention_reference`."""
    if q_lat.ndim != 4:
        raise ValueError(f"q_lat must be [B, T, H, R], got {q_lat.shape}")
    b, t, _, r = q_lat.shape
    if latents.ndim != 3 or latents.shape[0] != b or latents.shape[2] != r:
        raise ValueError(f"latents must be [B, S, R] = [{b}, S, {r}], got {latents.shape}")
    if indices.ndim != 3 or indices.shape[:2] != (b, t):
        raise ValueError(f"indices must be [B, T, W] with B, T = {(b, t)}, got {indices.shape}")
    return sparse_latent_attention_reference(q_lat, latents, indices, scale=scale)
