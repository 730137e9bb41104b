"""What both kernels do around their launch: repeated indices marked empty before it, and the parts
of a split selection merged after it."""

import jax.numpy as jnp


def mark_repeats_empty(indices):
    """Each row's repeated indices after their first as -1 (the order of a row does not matter)."""
    ordered = jnp.sort(indices, axis=-1)
    repeat = jnp.concatenate([jnp.zeros_like(ordered[..., :1], bool), ordered[..., 1:] == ordered[..., :-1]], axis=-1)
    return jnp.where(repeat, -1, ordered)


def merge_splits(o, top, total, axis):
    """The parts' normalised outputs o [..., splits, H, R] (splits at `axis`), with their running
    max `top` (base 2) and sum `total` [..., splits, H], weighed by their share of the softmax sum."""
    weight = total * jnp.exp2(top - top.max(axis=axis, keepdims=True))
    norm = weight.sum(axis=axis)
    merged = jnp.sum(jnp.expand_dims(weight, -1) * o, axis=axis)
    return merged / jnp.where(norm > 0, norm, 1.0)[..., None]
