"""Each row's k best scores on the GPU, in Pallas' Triton backend: the row's k-th best score found bit
by bit, then what reaches it kept in the row's order (the same set as XLA's top-k, ties to the lower
index)."""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

MAX_TOP_POOLS = 32768  # the top-k kernel's widest row (a row is in registers); wider rows: XLA's top-k


def _top_pools_kernel(scores_ref, chosen_ref, valid_ref, *, k):
    """One row: the k-th best score found bit by bit (the largest threshold that at least k scores
    reach, on integer keys that order as the floats do; or the first that exactly k reach), then
    every score above it and the first of those equal to it, written in the row's order by their
    running count."""
    t, b = pl.program_id(0), pl.program_id(1)
    x = scores_ref[b, t, :]
    bits = lax.bitcast_convert_type(x, jnp.int32)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: the magnitude bits flipped

    def next_bit(carry):  # from the sign bit down; the sign bit's flip is int32's minimum
        i, threshold, _ = carry
        candidate = threshold ^ jnp.left_shift(jnp.int32(1), 31 - i)
        reached = jnp.sum((key >= candidate).astype(jnp.int32))
        return i + 1, jnp.where(reached >= k, candidate, threshold), reached == k

    # Done as soon as exactly k keys reach the threshold: they are the k best whatever its lower bits
    # (the remaining passes would only raise it to the k-th key itself).
    start = (jnp.int32(0), jnp.int32(-(2**31)), jnp.bool_(False))
    _, threshold, _ = lax.while_loop(lambda carry: (carry[0] < 32) & ~carry[2], next_bit, start)
    above = key > threshold
    equal = (key == threshold).astype(jnp.int32)
    chosen = above | ((equal == 1) & (jnp.cumsum(equal) - equal < k - jnp.sum(above.astype(jnp.int32))))
    index = lax.broadcasted_iota(jnp.int32, x.shape, 0)
    before = jnp.cumsum(chosen.astype(jnp.int32)) - chosen.astype(jnp.int32)
    # Exactly k are chosen: they go to slots 0..k-1; the rest to k.. in order, so that no two lanes
    # share a slot (the interpreter writes masked lanes too); the caller keeps the first k.
    slot = jnp.where(chosen, before, k + index - before)
    pltriton.store(chosen_ref.at[b, t, slot], index, mask=chosen)
    pltriton.store(valid_ref.at[b, t, slot], (x > -jnp.inf).astype(jnp.int32), mask=chosen)


def top_pools_kernel(scores, k, *, interpret=False):
    """`top_pools_reference`'s set of indices in one Pallas (Triton) launch, a program a row, in the
    row's order rather than best first; rows of up to MAX_TOP_POOLS scores (padded to a power of two).
    XLA sorts each whole row (on the H200, 73 of 88 ms of the selection at 65536 tokens)."""
    b, t, n = scores.shape
    width = pl.next_power_of_2(n)
    scores = jnp.pad(scores, [(0, 0), (0, 0), (0, width - n)], constant_values=-jnp.inf)
    chosen, valid = pl.pallas_call(
        functools.partial(_top_pools_kernel, k=k),
        out_shape=(jax.ShapeDtypeStruct((b, t, width), jnp.int32),) * 2,
        grid=(t, b),
        compiler_params=pltriton.CompilerParams(num_warps=min(16, max(4, width // 1024))),
        interpret=interpret,
        name="top_pools",
    )(scores)
    return chosen[..., :k], valid[..., :k] == 1
