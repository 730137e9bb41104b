"""Token selection reference: structural properties (transformers parity is in test_parity_layers)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.select_tokens import select_tokens


def inputs(key, b, t, pool, nh=4, hd=8, mask=None):
    k1, k2, k3 = jax.random.split(key, 3)
    q = jax.random.normal(k1, (b, t, nh, hd))
    w = jax.random.normal(k2, (b, t, nh))
    keys = jax.random.normal(k3, (b, t // pool, hd))
    mask = jnp.ones((b, t), bool) if mask is None else mask
    return q, w, keys, mask, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def as_sets(indices):
    return [[set(int(i) for i in row if i >= 0) for row in seq] for seq in np.asarray(indices)]


@pytest.mark.parametrize("pool", [1, 4, 16])
def test_dense_at_or_below_topk_plus_tail(pool):
    topk, t = 4 * pool, 4 * pool + pool - 1
    q, w, keys, mask, pos = inputs(jax.random.key(pool), 2, t, pool)
    got = as_sets(select_tokens(q, w, keys, mask, pos, index_topk=topk, pool_size=pool))
    for seq in got:
        for i, row in enumerate(seq):
            assert row == set(range(i + 1))


def test_sparse_rows_keep_whole_pools_plus_the_tail():
    pool, topk, t = 4, 8, 40
    q, w, keys, mask, pos = inputs(jax.random.key(7), 1, t, pool)
    idx = select_tokens(q, w, keys, mask, pos, index_topk=topk, pool_size=pool)
    assert idx.shape == (1, t, topk + pool - 1)
    for i, row in enumerate(as_sets(idx)[0]):
        visible = i + 1
        tail = set(range(visible - visible % pool, visible))
        assert tail <= row
        pools = row - tail
        assert len(pools) == min(topk, visible - visible % pool)
        assert all(all(p // pool * pool + j in pools for j in range(pool)) for p in pools)


def test_left_padding_shifts_the_pools_to_the_first_real_token():
    pool, t, pad = 4, 23, 3
    mask = jnp.arange(t)[None] >= pad
    q, w, keys, _, pos = inputs(jax.random.key(3), 1, t, pool, mask=mask)
    idx = select_tokens(q, w, keys, mask, pos, index_topk=8, pool_size=pool)
    sets = as_sets(idx)[0]
    assert all(not row for row in sets[:pad])  # padded queries select nothing
    assert sets[pad + 5] == set(range(pad, pad + 6))
    assert all(min(row) >= pad for row in sets[pad:])


def test_bad_shapes_are_rejected():
    q, w, keys, mask, pos = inputs(jax.random.key(0), 1, 8, 4)
    with pytest.raises(ValueError, match="head_weights"):
        select_tokens(q, w[..., :2], keys, mask, pos, index_topk=8, pool_size=4)
    with pytest.raises(ValueError, match="multiple of pool_size"):
        select_tokens(q, w, keys, mask, pos, index_topk=6, pool_size=4)


def test_query_blocks_do_not_change_the_selection(monkeypatch):
    """Scored and ranked 8 queries at a time (a ragged last block) or all at once: the same indices."""
    from pallas_kernels import select_tokens as module

    mask = jnp.ones((2, 45), bool).at[0, :6].set(False).at[1, 40:].set(False)
    q, w, keys, mask, pos = inputs(jax.random.key(3), 2, 45, 4, mask=mask)
    whole = select_tokens(q, w, keys[:, :10], mask, pos, index_topk=12, pool_size=4)
    monkeypatch.setattr(module, "QUERY_BLOCK", 8)
    blocked = select_tokens(q, w, keys[:, :10], mask, pos, index_topk=12, pool_size=4)
    np.testing.assert_array_equal(np.asarray(whole), np.asarray(blocked))
    assert (np.asarray(whole) >= 0).any(axis=-1).sum() == 2 * 45 - 6 - 5  # every valid query selects
