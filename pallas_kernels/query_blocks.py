"""Per-query work a block of queries at a time, so that what a query builds against every key or
pool (scores, masks) is never whole for the sequence: the references of DSA's token selection and
latent attention run this way."""

import jax
import jax.numpy as jnp


def map_query_blocks(fn, xs, fills, block):
    """fn over blocks of `block` queries (fewer when T is shorter). xs: arrays [B, T, ...], padded on T
    to whole blocks with `fills` (one per array); fn(blocks of xs) -> a pytree of [B, block, ...].
    Returns that pytree as [B, T, ...]."""
    b, t = xs[0].shape[:2]
    block = min(block, t)
    pad = -t % block

    def split(x, fill):  # [B, T, ...] -> [T / block, B, block, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        return jnp.moveaxis(x.reshape(b, -1, block, *x.shape[2:]), 1, 0)

    out = jax.lax.map(fn, tuple(split(x, fill) for x, fill in zip(xs, fills)))
    return jax.tree.map(lambda y: jnp.moveaxis(y, 0, 1).reshape(b, -1, *y.shape[3:])[:, :t], out)
