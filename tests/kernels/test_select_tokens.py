"""Token selection reference: structural properties (transformers parity is in test_parity_layers)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import traced_kernels
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # the race detector's findings
from jax.experimental.pallas import mosaic_gpu as plgpu
from kernel_case import KernelCase

from pallas_kernels import select_tokens as st
from pallas_kernels.select_tokens import (
    candidate_scores_mosaic,
    candidate_scores_triton,
    pool_scores,
    select_tokens,
    top_pools_triton,
    visible_key_counts,
)


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
    from pallas_kernels.select_tokens import reference as module

    mask = jnp.ones((2, 45), bool).at[0, :6].set(False).at[1, 40:].set(False)
    q, w, keys, mask, pos = inputs(jax.random.key(3), 2, 45, 4, mask=mask)
    whole = select_tokens(q, w, keys[:, :10], mask, pos, index_topk=12, pool_size=4)
    monkeypatch.setattr(module, "QUERY_BLOCK", 8)
    blocked = select_tokens(q, w, keys[:, :10], mask, pos, index_topk=12, pool_size=4)
    np.testing.assert_array_equal(np.asarray(whole), np.asarray(blocked))
    assert (np.asarray(whole) >= 0).any(axis=-1).sum() == 2 * 45 - 6 - 5  # every valid query selects


def test_visible_key_counts_match_a_numpy_count():
    """Valid keys at or before each query (holes in the mask too; a query before the first key sees 0)."""
    rng = np.random.default_rng(0)
    key_valid = rng.random((3, 50)) < 0.7
    positions = rng.integers(-2, 50, (3, 20)).astype(np.int32)
    want = [[key_valid[b, : p + 1].sum() if p >= 0 else 0 for p in row] for b, row in enumerate(positions)]
    np.testing.assert_array_equal(visible_key_counts(jnp.asarray(key_valid), jnp.asarray(positions)), want)


def test_visible_key_counts_are_materialised_for_the_gpu():
    """Fused into the selected rows, XLA's cumsum tree is walked again for each element read (the
    decode step's two fusions of 0.02-0.04 ms on the H200, bench/RESULTS.md): the counts go through an
    optimization barrier."""
    traced = jax.jit(visible_key_counts).trace(jnp.ones((2, 64), bool), jnp.zeros((2, 1), jnp.int32))
    assert traced.lower(lowering_platforms=("cuda",)).as_text().count("stablehlo.optimization_barrier") == 1


def test_bf16_pool_scores_are_the_exact_products_summed_in_fp32():
    """bf16 operands go to the tensor cores unconverted: their products are exact, so the scores
    equal a float64 computation on the same values to fp32 summation error, and select what the
    fp32 path selects on the upcast values."""
    ks = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(ks[0], (2, 40, 4, 32), jnp.bfloat16)
    w = jax.random.normal(ks[1], (2, 40, 4)) * 0.5
    keys = jax.random.normal(ks[2], (2, 10, 32), jnp.bfloat16)
    q64, k64, w64 = (np.asarray(x, np.float64) for x in (q, keys, w))
    want = np.einsum("bth,bthp->btp", w64, np.maximum(np.einsum("bthd,bpd->bthp", q64, k64) * 32**-0.5, 0))
    np.testing.assert_allclose(pool_scores(q, w, keys), want, rtol=1e-5, atol=1e-5)
    dots = [e for e in jax.make_jaxpr(pool_scores)(q, w, keys).eqns if e.primitive.name == "dot_general"]
    assert [v.aval.dtype for v in dots[0].invars] == [jnp.bfloat16] * 2
    mask = jnp.ones((2, 40), bool)
    positions = jnp.broadcast_to(jnp.arange(40, dtype=jnp.int32), (2, 40))
    kw = dict(index_topk=16, pool_size=4)
    np.testing.assert_array_equal(
        select_tokens(q, w, keys, mask, positions, **kw),
        select_tokens(q.astype(jnp.float32), w, keys.astype(jnp.float32), mask, positions, **kw),
    )


def kernel_case(seed, b, t, n_pools, pool, first_query, nh=4, hd=32, holes=False):
    """bf16 queries at positions first_query .. first_query + t - 1 over n_pools * pool keys, the
    first key of sequence 1 at 3 (left padding), with some pools invalid when `holes`."""
    s = n_pools * pool
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (b, t, nh, hd), jnp.bfloat16)
    w = jax.random.normal(ks[1], (b, t, nh)) * nh**-0.5
    keys = jax.random.normal(ks[2], (b, n_pools, hd), jnp.bfloat16)
    mask = jnp.ones((b, s), bool).at[1, :3].set(False)
    if holes:
        mask = mask.at[0, 5 * pool + 1].set(False).at[1, s // 2 :].set(False)
    positions = jnp.broadcast_to(first_query + jnp.arange(t, dtype=jnp.int32), (b, t))
    return q, w, keys, mask, positions


KERNEL_CASES = {  # name: (b, t, n_pools, pool, first query's position, holes, heads)
    "one query at the end of the cache, heads as rows": (2, 1, 37, 4, 147, False, 4),
    "9 queries, 6 heads as rows padded to 16": (2, 9, 70, 4, 270, True, 6),
    "ragged prefill, one block of pools": (2, 45, 12, 4, 0, True, 4),
    "two query blocks, the second block of pools unseen": (1, 70, 140, 4, 0, False, 4),
    "two query blocks over three blocks of pools": (2, 70, 140, 4, 490, True, 4),
    "pools of 1, a 32-query block": (1, 20, 30, 1, 10, False, 3),
}


@pytest.mark.parametrize("name", KERNEL_CASES)
def test_candidate_scores_kernel_matches_the_reference(name):
    """The Pallas kernel (Triton, interpreted) against the jnp reference: the same candidates (-inf
    elsewhere) and the same scores up to the order of fp32 sums, on ragged query and pool blocks."""
    b, t, n_pools, pool, first_query, holes, nh = KERNEL_CASES[name]
    q, w, keys, mask, positions = kernel_case(len(name), b, t, n_pools, pool, first_query, nh=nh, holes=holes)
    pool_valid = st.pool_validity(mask, n_pools, pool)
    visible = st.visible_pools(st.first_valid_key(mask), positions, pool, n_pools)
    want = np.asarray(st.candidate_scores_reference(q, w, keys, pool_valid, visible))
    got = np.asarray(candidate_scores_triton.candidate_scores_kernel(q, w, keys, pool_valid, visible, interpret=True))
    assert np.isfinite(want).any() and np.isinf(want).any()
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5 * np.abs(want[finite]).max())


@pytest.mark.parametrize("name", KERNEL_CASES)
def test_selection_through_the_kernel_is_the_references(name):
    b, t, n_pools, pool, first_query, holes, nh = KERNEL_CASES[name]
    q, w, keys, mask, positions = kernel_case(len(name) + 1, b, t, n_pools, pool, first_query, nh=nh, holes=holes)
    kw = dict(index_topk=8 * pool, pool_size=pool)
    want = st.select_tokens(q, w, keys, mask, positions, implementation="reference", **kw)
    run = lambda: st.select_tokens(q, w, keys, mask, positions, implementation="pallas", interpret=True, **kw)  # noqa: E731
    assert traced_kernels(run) == {"candidate_pool_scores": 1, "top_pools": 1}
    got = run()
    # The top-k kernel keeps each row's pools in their order, the reference best first.
    np.testing.assert_array_equal(np.sort(got, axis=-1), np.sort(want, axis=-1))
    assert (np.asarray(want) >= 0).any()


@pytest.mark.parametrize("implementation", ["reference", "pallas"])
def test_a_pool_key_cache_of_whole_blocks_selects_as_the_keys_pools_alone(implementation):
    """pool_keys with `pool_rows` rows (the keys' 37 pools and 27 rows past them, garbage that is
    never valid, as the decode cache holds them so that the scores kernel reads it in place): the
    selection equals that over the 37 pools alone, and the Triton wrapper pads nothing."""
    b, t, n_pools, pool, first_query, _, nh = KERNEL_CASES["one query at the end of the cache, heads as rows"]
    q, w, keys, mask, positions = kernel_case(5, b, t, n_pools, pool, first_query, nh=nh)
    rows = st.pool_rows(n_pools * pool, pool)
    assert rows == st.POOL_BLOCK
    cache = jnp.concatenate([keys, jax.random.normal(jax.random.key(6), (b, rows - n_pools, keys.shape[-1]), keys.dtype)], 1)
    kw = dict(index_topk=64 * pool, pool_size=pool, implementation=implementation, interpret=True)  # more than 37 pools
    got, want = st.select_tokens(q, w, cache, mask, positions, **kw), st.select_tokens(q, w, keys, mask, positions, **kw)
    np.testing.assert_array_equal(np.sort(got, axis=-1), np.sort(want, axis=-1))
    if implementation == "pallas":
        jaxpr = jax.make_jaxpr(lambda c: st.select_tokens(q, w, c, mask, positions, **kw))(cache)
        assert not [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pad" and e.invars[0] is jaxpr.jaxpr.invars[0]]
    with pytest.raises(ValueError, match="pool_rows"):
        st.select_tokens(q, w, jnp.concatenate([cache, cache[:, :1]], 1), mask, positions, **kw)


@pytest.mark.parametrize("n, k", [(64, 16), (100, 7), (33, 33), (1, 1), (1040, 512)])
def test_top_pools_kernel_keeps_the_references_set(n, k):
    """Against XLA's top-k: ties (scores rounded to halves, and many zeros) go to the lower index,
    rows with fewer than k candidates keep their first -inf pools as non-candidates, negative and
    positive scores, a row whose k best are the only positive ones (the bit search stops early),
    rows padded to a power of two."""
    rng = np.random.default_rng(n + k)
    scores = np.round(rng.normal(size=(2, 6, n)) * 2) / 2
    scores[0, 1] = np.maximum(scores[0, 1], 0.0)  # a row of ties at zero
    scores[1, 2, n // 3 :] = -np.inf  # fewer candidates than k where n // 3 < k
    scores[1, 3] = -np.inf
    scores[0, 2] = -np.abs(scores[0, 2]) - 1  # exactly k positive: the search is done at its first pass
    scores[0, 2, rng.permutation(n)[:k]] = rng.uniform(1, 2, k)
    scores = jnp.asarray(scores, jnp.float32)
    want_index, want_valid = st.top_pools_reference(scores, k)
    index, valid = top_pools_triton.top_pools_kernel(scores, k, interpret=True)
    order = np.argsort(want_index, axis=-1)
    np.testing.assert_array_equal(index, np.take_along_axis(np.asarray(want_index), order, axis=-1))
    np.testing.assert_array_equal(valid, np.take_along_axis(np.asarray(want_valid), order, axis=-1))


def test_the_kernel_refuses_what_it_cannot_take():
    q, w, keys, mask, positions = kernel_case(0, 1, 8, 4, 4, 0)
    kw = dict(index_topk=8, pool_size=4, implementation="pallas", interpret=True)
    with pytest.raises(ValueError, match="must be bf16"):
        st.select_tokens(q.astype(jnp.float32), w, keys, mask, positions, **kw)
    with pytest.raises(ValueError, match="index head dim"):
        st.select_tokens(q[..., :24], w, keys[..., :24], mask, positions, **kw)
    with pytest.raises(ValueError, match="implementation"):
        st.select_tokens(q, w, keys, mask, positions, index_topk=8, pool_size=4, implementation="triton")


def test_kernel_lowers_for_the_gpu_at_the_model_shapes():
    """Through Triton's lowering for an H200 (the interpreter does not check it): the wider config's
    indexer (32 heads of 128, pools of 4) in a decode step and prefills of 4096 and 131072 tokens
    (the top-k kernel's widest rows, 32768 pools)."""
    from pallas_kernels.common import lower_for_h200

    sds = jax.ShapeDtypeStruct
    for b, t, s in [(8, 1, 4160), (1, 4096, 4096), (1, 131072, 131072)]:
        text = lower_for_h200(
            lambda q, w, k, m, p: select_tokens(q, w, k, m, p, index_topk=2048, pool_size=4, implementation="pallas"),
            sds((b, t, 32, 128), jnp.bfloat16), sds((b, t, 32), jnp.float32), sds((b, s // 4, 128), jnp.bfloat16),
            sds((b, s), jnp.bool_), sds((b, t), jnp.int32),
        ).as_text()
        assert text.count("xla.gpu.triton") == 2  # the candidates' scores, the top-k


class TestCandidateScores(KernelCase):
    """The candidates' scores kernel through `candidate_scores_kernel`: one query (heads as the
    product's rows) and a ragged prefill over invalid pools; the same candidates (-inf elsewhere)
    and the same scores up to the order of fp32 sums."""

    cases = {
        "one query, heads as rows": dict(b=2, t=1, n_pools=37, pool=4, first_query=147),
        "ragged prefill with holes": dict(b=2, t=45, n_pools=12, pool=4, first_query=0, holes=True),
    }
    kernels = {"candidate_pool_scores": 1}
    lowering_cases = {
        "decode over 4160 keys": (dict(b=8, t=1, s=4160), ["__gpu$xla.gpu.triton"]),
        "prefill of 4096": (dict(b=1, t=4096, s=4096), ["__gpu$xla.gpu.triton"]),
    }

    def inputs(self, key, b, t, n_pools, pool, first_query, holes=False):
        q, w, keys, mask, positions = kernel_case(int(jax.random.randint(key, (), 0, 2**30)), b, t, n_pools, pool,
                                                  first_query, holes=holes)
        visible = st.visible_pools(st.first_valid_key(mask), positions, pool, n_pools)
        return (q, w, keys, st.pool_validity(mask, n_pools, pool), visible), {}

    def kernel(self, *args, interpret=True):
        return candidate_scores_triton.candidate_scores_kernel(*args, interpret=interpret)

    def reference(self, *args):
        return st.candidate_scores_reference(*args)

    def compare(self, got, want, **_):
        assert np.isfinite(want).any()
        np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
        finite = np.isfinite(want)
        np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5 * np.abs(want[finite]).max())

    def lowering_args(self, b, t, s):
        sds, pools = jax.ShapeDtypeStruct, s // 4
        return (sds((b, t, 32, 128), jnp.bfloat16), sds((b, t, 32), jnp.float32), sds((b, pools, 128), jnp.bfloat16),
                sds((b, pools), jnp.bool_), sds((b, t), jnp.int32)), {}


class TestTopPools(KernelCase):
    """The ranking kernel through `top_pools_kernel` on scores with ties (halves) and rows of fewer
    candidates than k: XLA's top-k's set, ties to the lower index, in each row's order."""

    cases = {"a row narrower than k": dict(rows=6, n=33, k=33), "rows padded to 128": dict(rows=4, n=100, k=7)}
    kernels = {"top_pools": 1}
    lowering_cases = {"32768 pools": (dict(rows=4096, n=32768, k=512), ["__gpu$xla.gpu.triton"])}

    def inputs(self, key, rows, n, k):
        scores = jnp.round(jax.random.normal(key, (2, rows, n)) * 2) / 2
        return (scores.at[1, 1, n // 3 :].set(-jnp.inf),), dict(k=k)

    def kernel(self, scores, k, interpret=True):
        return top_pools_triton.top_pools_kernel(scores, k, interpret=interpret)

    def reference(self, scores, k):
        index, valid = st.top_pools_reference(scores, k)
        order = jnp.argsort(index, axis=-1)
        return jnp.take_along_axis(index, order, axis=-1), jnp.take_along_axis(valid, order, axis=-1)

    def compare(self, got, want, **_):
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])

    def lowering_args(self, rows, n, k):
        return (jax.ShapeDtypeStruct((1, rows, n), jnp.float32),), dict(k=k)


class TestCandidateScoresMosaic(TestCandidateScores):
    """The Mosaic GPU scores kernel through `candidate_scores_kernel`, under the race detector: the
    heads form (one query, 4 heads padded to 64; 9 queries of 32 heads over two stretches of pools
    with holes) and the queries form (a ragged prefill with holes in one block of pools; two blocks
    of queries over three blocks of pools, some unseen)."""

    cases = {
        "one query, 4 heads as rows": dict(b=2, t=1, n_pools=37, pool=4, first_query=147, hd=64),
        "9 queries, 32 heads, holes": dict(b=2, t=9, n_pools=300, pool=4, first_query=1100, nh=32, hd=128, holes=True),
        "ragged prefill with holes": dict(b=2, t=45, n_pools=12, pool=4, first_query=0, hd=64, holes=True),
        "two query blocks over three pool blocks": dict(b=1, t=70, n_pools=300, pool=4, first_query=700, hd=128),
    }
    kernels = {"candidate_pool_scores_mosaic": 1}
    lowering_cases = {
        "decode B=64 over 128K keys": (dict(b=64, t=1, s=131072), ["mosaic_gpu_v2"]),
        "prefill of 65536": (dict(b=1, t=65536, s=65536), ["mosaic_gpu_v2"]),
    }

    def inputs(self, key, b, t, n_pools, pool, first_query, nh=4, hd=64, holes=False):
        seed = int(jax.random.randint(key, (), 0, 2**30))
        q, w, keys, mask, positions = kernel_case(seed, b, t, n_pools, pool, first_query, nh=nh, hd=hd, holes=holes)
        visible = st.visible_pools(st.first_valid_key(mask), positions, pool, n_pools)
        return (q, w, keys, st.pool_validity(mask, n_pools, pool), visible), {}

    def kernel(self, *args, interpret=True):
        if interpret:  # a pipeline slot refilled before its product is done is a race
            interpret = plgpu.InterpretGPUParams(detect_races=True)
        return candidate_scores_mosaic.candidate_scores_kernel(*args, interpret=interpret)

    def compare(self, got, want, **shape):
        assert not gpu_callbacks.get_races().races_found  # of the kernel's run just before
        super().compare(got, want, **shape)


@pytest.mark.parametrize(
    "b, t, n_pools, pool, first_query, holes, nh",
    [(2, 1, 300, 4, 1195, True, 32), (2, 70, 40, 4, 0, True, 4), (1, 20, 30, 1, 10, False, 3)],
)
def test_selection_through_the_mosaic_scores_is_the_references(b, t, n_pools, pool, first_query, holes, nh):
    """`select_tokens(..., backend="mosaic")`: the Mosaic GPU scores, then the top-k kernel."""
    q, w, keys, mask, positions = kernel_case(t + nh, b, t, n_pools, pool, first_query, nh=nh, hd=64, holes=holes)
    kw = dict(index_topk=8 * pool, pool_size=pool)
    want = st.select_tokens(q, w, keys, mask, positions, implementation="reference", **kw)
    run = lambda: st.select_tokens(  # noqa: E731
        q, w, keys, mask, positions, implementation="pallas", backend="mosaic", interpret=True, **kw
    )
    assert traced_kernels(run) == {"candidate_pool_scores_mosaic": 1, "top_pools": 1}
    got = run()
    np.testing.assert_array_equal(np.sort(got, axis=-1), np.sort(want, axis=-1))
    assert (np.asarray(want) >= 0).any()


def test_the_mosaic_kernel_refuses_what_it_cannot_take():
    q, w, keys, mask, positions = kernel_case(0, 1, 8, 4, 4, 0)  # index heads of 32
    kw = dict(index_topk=8, pool_size=4, implementation="pallas", backend="mosaic", interpret=True)
    with pytest.raises(ValueError, match="index head dim must be one of \\(64, 128\\)"):
        st.select_tokens(q, w, keys, mask, positions, **kw)
    q, w, keys, mask, positions = kernel_case(0, 1, 2, 4, 4, 0, nh=65, hd=64)
    with pytest.raises(ValueError, match="at most 64 heads"):
        st.select_tokens(q, w, keys, mask, positions, **kw)
    with pytest.raises(ValueError, match="backend must be one of"):
        st.select_tokens(q, w, keys, mask, positions, index_topk=8, pool_size=4, backend="cuda")


PACKED_RUNS = [[37, 50, 5, 4], [70, 25]]  # documents a row (the second row right-padded to 96)


def packed_case(seed, pool=4, nh=4, hd=32, dtype=jnp.float32):
    """Queries over 96 keys packed with the documents of PACKED_RUNS: per-token key features pooled
    (mean of each pool's tokens) in `packed_pools`' order."""
    t = 96
    ids = np.zeros((2, t), np.int32)
    for row, lengths in enumerate(PACKED_RUNS):
        ids[row, : sum(lengths)] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (2, t, nh, hd), dtype)
    w = jax.random.normal(ks[1], (2, t, nh)) * nh**-0.5
    features = jax.random.normal(ks[2], (2, t, hd))
    pools = st.packed_pools(jnp.asarray(ids), t // pool, pool)
    members = pools.starts[..., None] + jnp.arange(pool)
    keys = jnp.take_along_axis(features, members.reshape(2, -1, 1), axis=1).reshape(2, -1, pool, hd).mean(2)
    return q, w, keys.astype(dtype), features, jnp.asarray(ids)


def test_packed_documents_select_as_they_would_alone():
    pool, topk = 4, 16
    q, w, keys, features, ids = packed_case(0, pool)
    positions = jnp.broadcast_to(jnp.arange(96, dtype=jnp.int32), (2, 96))
    got = as_sets(st.select_tokens(q, w, keys, ids > 0, positions, index_topk=topk, pool_size=pool, segment_ids=ids))
    sparse = 0
    for row, lengths in enumerate(PACKED_RUNS):
        start = 0
        for n in lengths:
            part = slice(start, start + n)
            alone_keys = features[row : row + 1, part][:, : n // pool * pool].reshape(1, -1, pool, features.shape[-1]).mean(2)
            alone = st.select_tokens(q[row : row + 1, part], w[row : row + 1, part], alone_keys, jnp.ones((1, n), bool),
                                     positions[:1, :n], index_topk=topk, pool_size=pool)
            for i, chosen in enumerate(as_sets(alone)[0]):
                assert got[row][start + i] == {start + j for j in chosen}, (row, start, i)
                sparse += len(chosen) < i + 1
            start += n
        assert all(not chosen for chosen in got[row][start:])  # padding selects nothing
    assert sparse > 50  # documents longer than topk + pool - 1 keys rank their pools


def test_packed_selection_through_the_kernels_is_the_references():
    q, w, keys, _, ids = packed_case(1, dtype=jnp.bfloat16)
    positions = jnp.broadcast_to(jnp.arange(96, dtype=jnp.int32), (2, 96))
    kw = dict(index_topk=16, pool_size=4, segment_ids=ids)
    want = st.select_tokens(q, w, keys, ids > 0, positions, implementation="reference", **kw)
    got = st.select_tokens(q, w, keys, ids > 0, positions, implementation="pallas", interpret=True, **kw)
    np.testing.assert_array_equal(np.sort(got, axis=-1), np.sort(want, axis=-1))


def test_a_lone_sequences_pools_are_the_usual_ones():
    mask = jnp.arange(23)[None] >= jnp.array([[0], [3]])
    pools = st.packed_pools(mask.astype(jnp.int32), 5, 4)
    np.testing.assert_array_equal(pools.starts, st.pool_token_indices(st.first_valid_key(mask), 5, 4)[..., 0]
                                  * np.asarray(st.pool_validity(mask, 5, 4)))
    np.testing.assert_array_equal(pools.valid, st.pool_validity(mask, 5, 4))
