"""DSA's latent attention: the Pallas kernel (Triton, in Pallas' interpreter on the CPU) against the
pure-jnp reference and against a numpy softmax over each query's selected rows; the dispatch and
the argument checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import traced_kernels
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # the race detector's findings
from jax.experimental.pallas import mosaic_gpu as plgpu
from kernel_case import KernelCase

from pallas_kernels import latent_attention as la
from pallas_kernels.select_tokens import select_tokens_reference

# The kernel's bf16 probabilities and bf16 output against float64 numpy: 2.0-3.6e-3 of max|o|
# measured; the softmax scale 1% off gives 9.5e-3 to 1.7e-2 on the random cases.
TOLERANCE = 7e-3
ROUNDING = 2.0**-8  # the reference's bf16 output: within half an ulp (2^-9) of each value


def kernel_attention(q, latents, indices, **kwargs):
    """`sparse_latent_attention` with the kernel asked for, in the interpreter, checked to reach it."""
    run = lambda: la.sparse_latent_attention(q, latents, indices, implementation="pallas", interpret=True, **kwargs)  # noqa: E731
    assert traced_kernels(run) == {"sparse_latent_attention": 1}
    return run()


def relative_error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


def numpy_attention(q, latents, indices, scale):
    """Each query's softmax over its distinct selected rows, in float64; zeros for none."""
    q, latents = np.asarray(q, np.float64), np.asarray(latents, np.float64)
    b, t, h, r = q.shape
    out = np.zeros((b, t, h, r))
    for i in range(b):
        for j in range(t):
            rows = sorted({int(x) for x in np.asarray(indices[i, j]) if x >= 0})
            if rows:
                keys = latents[i, rows]  # [n, R]
                logits = q[i, j] @ keys.T * scale
                p = np.exp(logits - logits.max(-1, keepdims=True))
                out[i, j] = (p / p.sum(-1, keepdims=True)) @ keys
    return out


def random_case(seed, b, t, h, r, s, w, *, empty_row=True, repeats=False):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, t, h, r)), jnp.bfloat16)
    latents = jnp.asarray(rng.standard_normal((b, s, r)), jnp.bfloat16)
    indices = np.stack([rng.permutation(s)[:w] for _ in range(b * t)]).reshape(b, t, w)
    if w > 1:
        indices[0, 0, w // 2 :] = -1  # a ragged row
    if empty_row:
        indices[-1, -1] = -1  # a query with nothing selected
    if repeats:
        indices[0, -1, 1 : w // 2] = indices[0, -1, 0]
    return q, latents, jnp.asarray(indices, jnp.int32)


@pytest.mark.parametrize(
    "b, t, h, r, s, w",
    [
        (1, 2, 64, 128, 200, 100),  # two blocks of 64 selected rows, the second ragged
        (2, 3, 4, 64, 50, 7),  # heads padded up to 16, fewer rows than a block
        (1, 2, 16, 256, 300, 64),  # exactly one block
        (1, 2, 128, 64, 130, 65),  # two head groups; one row past a block
        (2, 2, 8, 512, 100, 1),  # one selected row, the model's latent width
    ],
)
def test_kernel_matches_reference_and_numpy(b, t, h, r, s, w):
    q, latents, indices = random_case(b * 1000 + w, b, t, h, r, s, w)
    scale = r**-0.5
    got = kernel_attention(q, latents, indices, scale=scale)
    want = la.sparse_latent_attention_reference(q, latents, indices, scale=scale)
    exact = numpy_attention(q, latents, indices, scale)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert relative_error(got, exact) < TOLERANCE
    assert relative_error(want, exact) < ROUNDING
    assert not np.asarray(got[-1, -1]).any()  # nothing selected: zeros


def test_repeated_indices_count_once():
    q, latents, indices = random_case(7, 1, 3, 16, 64, 90, 40, repeats=True)
    got = kernel_attention(q, latents, indices, scale=0.125)
    assert relative_error(got, numpy_attention(q, latents, indices, 0.125)) < TOLERANCE


@pytest.mark.parametrize(
    "config",
    [
        la.KernelConfig(block_tokens=16, num_warps=4),
        la.KernelConfig(block_tokens=128),
        la.KernelConfig(splits=2),  # 150 rows: blocks 64 + 64 and 22 + empty
        la.KernelConfig(block_tokens=32, splits=5),  # 5 blocks, one each; a split with nothing selected
    ],
)
def test_kernel_configs(config):
    q, latents, indices = random_case(11, 1, 2, 16, 64, 300, 150, empty_row=False)
    indices = indices.at[0, 1, 120:].set(-1)
    got = kernel_attention(q, latents, indices, scale=0.125, config=config)
    assert relative_error(got, numpy_attention(q, latents, indices, 0.125)) < TOLERANCE


def test_selections_of_the_indexer():
    """Whole pools and the tail, as the model selects them (distinct, so the repeat pass is skipped):
    early queries see fewer tokens than the selection width and attend to all of them."""
    b, t, s, pool, topk = 1, 40, 40, 4, 16
    keys = jax.random.split(jax.random.key(3), 4)
    indices = select_tokens_reference(
        jax.random.normal(keys[0], (b, t, 2, 8)), jnp.ones((b, t, 2)), jax.random.normal(keys[1], (b, s // pool, 8)),
        jnp.ones((b, s), bool), jnp.broadcast_to(jnp.arange(t), (b, t)), index_topk=topk, pool_size=pool,
    )
    q = jax.random.normal(keys[2], (b, t, 16, 64), jnp.bfloat16)
    latents = jax.random.normal(keys[3], (b, s, 64), jnp.bfloat16)
    got = kernel_attention(q, latents, indices, scale=0.125, distinct_indices=True)
    assert relative_error(got, numpy_attention(q, latents, indices, 0.125)) < TOLERANCE


def test_default_on_cpu_is_the_reference():
    q, latents, indices = random_case(5, 1, 2, 4, 64, 20, 5)
    got = la.sparse_latent_attention(q, latents, indices, scale=0.125)
    want = la.sparse_latent_attention_reference(q, latents, indices, scale=0.125)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_kernel_lowers_for_the_gpu_at_the_model_shapes():
    from pallas_kernels.common import lower_for_h200

    sds = jax.ShapeDtypeStruct
    for b, t, s, splits in [(1, 4096, 4096, 1), (8, 1, 32768, 32)]:
        config = la.KernelConfig(splits=splits)
        text = lower_for_h200(
            lambda q, l, i: la.sparse_latent_attention(
                q, l, i, scale=1 / 16, implementation="pallas", config=config, distinct_indices=True
            ),
            sds((b, t, 64, 512), jnp.bfloat16), sds((b, s, 512), jnp.bfloat16), sds((b, t, 2051), jnp.int32),
        ).as_text()
        assert text.count("xla.gpu.triton") == 1


@pytest.mark.parametrize(
    "q_shape, latent_shape, index_shape, dtype, message",
    [
        ((2, 64, 64), (1, 10, 64), (1, 2, 4), jnp.bfloat16, "q_lat must be"),
        ((1, 2, 4, 64), (2, 10, 64), (1, 2, 4), jnp.bfloat16, "latents must be"),
        ((1, 2, 4, 64), (1, 10, 64), (1, 3, 4), jnp.bfloat16, "indices must be"),
        ((1, 2, 4, 96), (1, 10, 96), (1, 2, 4), jnp.bfloat16, "latent width R"),
        ((1, 2, 4, 64), (1, 10, 64), (1, 2, 4), jnp.float32, "q_lat must be bf16 or fp16"),
        ((1, 2, 4, 64), (5, 10, 64), (1, 2, 4), jnp.bfloat16, "latents must be \\[B, S, R\\]"),
    ],
)
def test_bad_arguments_are_named(q_shape, latent_shape, index_shape, dtype, message):
    with pytest.raises(ValueError, match=message):
        la.sparse_latent_attention(
            jnp.zeros(q_shape, dtype), jnp.zeros(latent_shape, dtype), jnp.zeros(index_shape, jnp.int32),
            scale=1.0, implementation="pallas",
        )


@pytest.mark.parametrize(
    "config, message",
    [
        (la.MosaicConfig(stages=4), "config.stages must be None, 1, 2 or 3"),
        (la.MosaicConfig(splits=0), "config.splits must be None or at least 1"),
        (la.KernelConfig(block_tokens=48), "config.block_tokens must be"),
        ({"splits": 2}, "config must be a KernelConfig"),
    ],
)
def test_bad_configs_are_named(config, message):
    with pytest.raises(ValueError, match=message):
        la.sparse_latent_attention(
            jnp.zeros((1, 2, 4, 128), jnp.bfloat16), jnp.zeros((1, 10, 128), jnp.bfloat16),
            jnp.zeros((1, 2, 4), jnp.int32), scale=1.0, implementation="pallas", config=config,
        )


@pytest.mark.parametrize("latent_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_paged_cache(latent_dtype):
    """An inference cache's pages in shuffled order, bf16 or fp8 with per-token scales: the kernel
    against the reference and against numpy over the dense sequences the pages hold. Indices past
    the sequence's keys count as empty."""
    b, t, h, r, page_size, pages_per_seq = 2, 3, 16, 64, 16, 4
    rng = np.random.default_rng(21)
    n_pages = b * pages_per_seq + 3
    page_table = rng.permutation(n_pages)[: b * pages_per_seq].reshape(b, pages_per_seq).astype(np.int32)
    dense = rng.standard_normal((n_pages, page_size, r)).astype(np.float32)
    scales = None
    if latent_dtype == jnp.float8_e4m3fn:
        scales = rng.uniform(0.01, 0.1, (n_pages, page_size)).astype(np.float32)
        pages = jnp.asarray(dense * 4, latent_dtype)
        values = np.asarray(pages.astype(jnp.float32)) * scales[..., None]
    else:
        pages = jnp.asarray(dense, latent_dtype)
        values = np.asarray(pages.astype(jnp.float32))
    sequences = jnp.asarray(values[page_table].reshape(b, -1, r), jnp.bfloat16)  # what the attention sees
    q = jnp.asarray(rng.standard_normal((b, t, h, r)), jnp.bfloat16) * 4
    indices = np.stack([rng.permutation(pages_per_seq * page_size)[:40] for _ in range(b * t)]).reshape(b, t, 40)
    indices[0, 1, :5] = pages_per_seq * page_size + np.arange(5)  # out of range: empty
    indices = jnp.asarray(indices, jnp.int32)
    scales = None if scales is None else jnp.asarray(scales)
    kwargs = dict(scale=r**-0.5, page_table=jnp.asarray(page_table), latent_scales=scales)
    got = kernel_attention(q, pages, indices, **kwargs)
    want = la.sparse_latent_attention(q, pages, indices, implementation="reference", **kwargs)
    in_range = jnp.where(indices < pages_per_seq * page_size, indices, -1)
    exact = numpy_attention(q, sequences, in_range, r**-0.5)
    assert relative_error(got, exact) < TOLERANCE
    assert relative_error(want, exact) < ROUNDING
    assert relative_error(want, la.sparse_latent_attention_reference(q, sequences, in_range, scale=r**-0.5)) < 1e-6


class TestSparseLatentAttention(KernelCase):
    """Through `sparse_latent_attention`: one query with 64 heads over an fp8 paged cache whose
    selection is narrower than a block; ragged and empty selections of a few queries, repeats
    among them, split across programs."""

    cases = {
        "one query, 64 heads, fp8 pages": dict(b=2, t=1, h=64, r=64, s=96, w=40, fp8=True),
        "ragged, empty and repeated rows, 2 splits": dict(b=2, t=3, h=4, r=128, s=80, w=70, splits=2),
    }
    kernels = {"sparse_latent_attention": 1}
    tolerance = TOLERANCE
    lowering_cases = {
        "prefill of 4096": (dict(b=1, t=4096, s=4096, fp8=False), ["__gpu$xla.gpu.triton"]),
        "decode over fp8 pages": (dict(b=8, t=1, s=32768, fp8=True), ["__gpu$xla.gpu.triton"]),
    }

    def config(self, splits, stages):
        return la.KernelConfig(splits=splits)

    def inputs(self, key, b, t, h, r, s, w, fp8=False, splits=None, stages=None):
        seed = int(jax.random.randint(key, (), 0, 2**30))
        q, latents, indices = random_case(seed, b, t, h, r, s, w, repeats=True)
        kwargs = dict(scale=r**-0.5, config=self.config(splits, stages))
        if not fp8:
            return (q, latents, indices), kwargs
        page_size = 16  # pages of each sequence in a shuffled pool
        pages = np.random.default_rng(seed).permutation(b * s // page_size).reshape(b, -1)
        values = np.asarray(latents, np.float32).reshape(b * s // page_size, page_size, r)
        scales = np.abs(values).max(-1) / 448.0
        stored = np.empty_like(values)
        stored[pages.reshape(-1)] = values / scales[..., None]
        pooled_scales = np.empty_like(scales)
        pooled_scales[pages.reshape(-1)] = scales
        kwargs.update(page_table=jnp.asarray(pages, jnp.int32), latent_scales=jnp.asarray(pooled_scales))
        return (q, jnp.asarray(stored, jnp.float8_e4m3fn), indices), kwargs

    def kernel(self, q, latents, indices, latent_scales=None, page_table=None, *, interpret=True, **kwargs):
        return la.sparse_latent_attention(
            q, latents, indices, latent_scales=latent_scales, page_table=page_table, implementation="pallas",
            interpret=interpret, **kwargs,
        )

    def reference(self, *args, config=None, **kwargs):
        return la.sparse_latent_attention_reference(*args, **kwargs)

    def compare(self, got, want, **_):
        # The reference rounds its fp32 output to bf16: within half an ulp of the exact value.
        assert got.shape == want.shape and got.dtype == want.dtype
        assert relative_error(got, want) < TOLERANCE + ROUNDING

    def lowering_args(self, b, t, s, fp8):
        sds = jax.ShapeDtypeStruct
        q, indices = sds((b, t, 64, 512), jnp.bfloat16), sds((b, t, 2051), jnp.int32)
        if not fp8:
            return (q, sds((b, s, 512), jnp.bfloat16), indices), dict(scale=1 / 16)
        pages = s // 64
        latents, scales = sds((b * pages, 64, 512), jnp.float8_e4m3fn), sds((b * pages, 64), jnp.float32)
        return (q, latents, indices, scales, sds((b, pages), jnp.int32)), dict(scale=1 / 16)


class TestSparseLatentAttentionMosaic(TestSparseLatentAttention):
    """The Mosaic GPU kernel through `sparse_latent_attention` (a `MosaicConfig`), under Pallas'
    race detector: one query over fp8 pages whose selection is narrower than a block; few heads
    (padded to 64) with ragged, empty and repeated rows in two splits; two head groups at the model's
    latent width over fp8 pages with three staging buffers in use; more splits than blocks (a part
    with nothing)."""

    cases = {
        "one query, fp8 pages, 20 selected": dict(b=2, t=1, h=64, r=128, s=96, w=20, fp8=True),
        "4 heads, ragged, empty and repeated rows, 2 splits": dict(b=2, t=3, h=4, r=128, s=80, w=70, splits=2),
        "128 heads, R = 512, fp8 pages, 3 stages, one row past 2 blocks": dict(b=1, t=2, h=128, r=512, s=192, w=65, fp8=True,
                                                                              stages=3),
        "5 splits over 4 blocks, 1 stage": dict(b=1, t=2, h=16, r=256, s=200, w=100, splits=5, stages=1),
    }
    kernels = {"sparse_latent_attention_mosaic": 1}
    lowering_cases = {
        "prefill of 4096": (dict(b=1, t=4096, s=4096, fp8=False), ["mosaic_gpu_v2"]),
        "decode over fp8 pages": (dict(b=8, t=1, s=32768, fp8=True), ["mosaic_gpu_v2"]),
        # Half the selection a CTA, as 132 SMs split it at B = 64.
        "decode B=64 over fp8 pages, 2 splits": (dict(b=64, t=1, s=32768, fp8=True, splits=2), ["mosaic_gpu_v2"]),
    }

    def config(self, splits, stages):
        return la.MosaicConfig(splits=splits, stages=stages)

    def kernel(self, *args, interpret=True, **kwargs):
        if interpret:  # a buffer refilled or read before its barrier says so is a race
            interpret = plgpu.InterpretGPUParams(detect_races=True)
        return super().kernel(*args, interpret=interpret, **kwargs)

    def compare(self, got, want, **shape):
        assert not gpu_callbacks.get_races().races_found  # of the kernel's run just before
        super().compare(got, want, **shape)

    def lowering_args(self, b, t, s, fp8, splits=None):
        args, kwargs = super().lowering_args(b, t, s, fp8)
        return args, dict(kwargs, config=la.MosaicConfig(splits=splits))


def test_mosaic_kernel_takes_what_it_supports():
    """A latent width outside 128, 256, 512: refused when asked for, the reference when not."""
    q, latents, indices = random_case(5, 1, 2, 4, 64, 20, 5)
    config = la.MosaicConfig()
    with pytest.raises(ValueError, match="latent width R must be one of"):
        la.sparse_latent_attention(q, latents, indices, scale=0.125, implementation="pallas", config=config)
    run = lambda: la.sparse_latent_attention(q, latents, indices, scale=0.125, interpret=True, config=config)  # noqa: E731
    assert traced_kernels(run) == {}
    want = la.sparse_latent_attention_reference(q, latents, indices, scale=0.125)
    np.testing.assert_array_equal(np.asarray(run()), np.asarray(want))


def test_mosaic_stages_that_do_not_fit_are_named():
    """Three bf16 staging buffers beside the rest at R = 512 and 2051 selected: 280 KiB of 227."""
    q, latents, indices = random_case(5, 1, 1, 64, 512, 2100, 2051)
    with pytest.raises(ValueError, match="config.stages = 3 needs 280.2 KiB of shared memory"):
        la.sparse_latent_attention(
            q, latents, indices, scale=0.125, implementation="pallas", interpret=True, config=la.MosaicConfig(stages=3)
        )


def reference_vjp(q, latents, indices, d_out, **kwargs):
    attend = lambda q, c: la.sparse_latent_attention_reference(q, c, indices, **kwargs)  # noqa: E731
    return jax.vjp(attend, q, latents)[1](d_out)


@pytest.mark.parametrize(
    "b, t, h, r, s, w, block",
    [
        (2, 7, 4, 32, 40, 9, 3),  # T not a multiple of the block: a padded last block
        (1, 5, 3, 16, 30, 30, None),  # every key selected, one block
        (1, 1, 64, 128, 90, 6, None),  # T = 1
    ],
)
def test_backward_matches_the_reference_vjp(b, t, h, r, s, w, block):
    """`sparse_latent_attention_backward` over the selection against jax.vjp of the dense reference,
    fp32 within 1e-5; ragged rows, a query with nothing selected, repeats and an index past S."""
    q, latents, indices = random_case(b * 100 + t, b, t, h, r, s, w, empty_row=t > 1, repeats=t > 1)
    q, latents = q.astype(jnp.float32), latents.astype(jnp.float32)
    indices = indices.at[0, -1, -1].set(s + 3)
    d_out = jax.random.normal(jax.random.key(t), q.shape)
    got = la.sparse_latent_attention_backward(q, latents, indices, d_out, scale=0.2, block_queries=block)
    for g, want in zip(got, reference_vjp(q, latents, indices, d_out, scale=0.2), strict=True):
        assert g.dtype == want.dtype and g.shape == want.shape
        assert relative_error(g, want) < 1e-5


@pytest.mark.parametrize("latent_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_backward_of_a_paged_cache(latent_dtype):
    """Shuffled pages, bf16 or fp8 with per-token scales, indices past the sequence: the latents'
    gradient goes back through the pages and the scales as the reference's does (fp32 q_lat; the
    pages' gradient in their dtype)."""
    b, t, h, r, page_size, pages_per_seq = 2, 3, 8, 32, 8, 4
    rng = np.random.default_rng(3)
    n_pages = b * pages_per_seq + 2
    page_table = jnp.asarray(rng.permutation(n_pages)[: b * pages_per_seq].reshape(b, pages_per_seq), jnp.int32)
    pages = jnp.asarray(rng.standard_normal((n_pages, page_size, r)) * 4, latent_dtype)
    scales = jnp.asarray(rng.uniform(0.01, 0.1, (n_pages, page_size)), jnp.float32) if latent_dtype != jnp.bfloat16 else None
    q = jnp.asarray(rng.standard_normal((b, t, h, r)), jnp.float32)
    indices = np.stack([rng.permutation(pages_per_seq * page_size)[:12] for _ in range(b * t)]).reshape(b, t, 12)
    indices[1, 2, :3] = pages_per_seq * page_size + np.arange(3)
    indices = jnp.asarray(indices, jnp.int32)
    d_out = jax.random.normal(jax.random.key(1), q.shape)
    kwargs = dict(scale=r**-0.5, page_table=page_table, latent_scales=scales)
    got = la.sparse_latent_attention_backward(q, pages, indices, d_out, **kwargs)
    for g, want in zip(got, reference_vjp(q, pages, indices, d_out, **kwargs), strict=True):
        assert g.dtype == want.dtype and g.shape == want.shape
        # the pages' gradient in their own dtype: bf16's rounding may differ by an ulp
        assert relative_error(g, want) < (1e-5 if g.dtype == jnp.float32 else ROUNDING)


@pytest.mark.parametrize("config", [la.KernelConfig(), la.MosaicConfig()], ids=["triton", "mosaic"])
def test_kernel_differentiates_as_the_reference(config):
    """jax.vjp through the kernel (interpreted) in q_lat and the latents, bf16, against the dense
    reference's vjp from the same inputs in fp32: within 1e-2 and twice the reference's own bf16
    error (its bf16 products round P and dS, 2.7-3.3e-3 measured against the reference's 2.0-3.0e-3)."""
    q, latents, indices = random_case(5, 1, 3, 64, 128, 90, 40, repeats=True)
    d_out = jax.random.normal(jax.random.key(6), q.shape).astype(jnp.bfloat16)

    def grads(implementation, q, latents, d_out):
        attend = lambda q, c: la.sparse_latent_attention(  # noqa: E731
            q, c, indices, scale=0.1, implementation=implementation, config=config, interpret=True)
        return jax.vjp(attend, q, latents)[1](d_out)

    exact = grads("reference", q.astype(jnp.float32), latents.astype(jnp.float32), d_out.astype(jnp.float32))
    for g, w, x in zip(grads("pallas", q, latents, d_out), grads("reference", q, latents, d_out), exact, strict=True):
        assert g.dtype == w.dtype == jnp.bfloat16
        assert relative_error(g, x) < min(1e-2, 2 * max(relative_error(w, x), 2.0**-9))


def test_backward_memory_grows_with_the_inputs_not_with_t_times_s():
    """The selection's gradient gathers W rows a query: from T = S = 4096 to 16384 its temporaries grow
    by less than its inputs do (15 MiB against 18 MiB measured; the dense reference's vjp grows by
    117 MiB, its [H, block, S] scores)."""
    b, h, r, w = 1, 2, 64, 64

    def temporaries_and_inputs(t):
        shapes = [((b, t, h, r), jnp.float32), ((b, t, r), jnp.float32), ((b, t, w), jnp.int32), ((b, t, h, r), jnp.float32)]
        args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
        backward = lambda q, c, i, d: la.sparse_latent_attention_backward(q, c, i, d, scale=0.125, block_queries=256)  # noqa: E731
        compiled = jax.jit(backward).lower(*args).compile()
        return compiled.memory_analysis().temp_size_in_bytes, sum(np.prod(s) * 4 for s, _ in shapes)

    (temp_short, in_short), (temp_long, in_long) = temporaries_and_inputs(4096), temporaries_and_inputs(16384)
    assert temp_long - temp_short < in_long - in_short


def test_reference_gradient_keeps_no_sequence_of_scores():
    """Differentiated, the reference recomputes each block of queries (`map_query_blocks` checkpoints
    its blocks): its gradient's temporaries stay below the [H, T, S] fp32 scores of the whole
    sequence (32 MiB here; 16 blocks of them were kept before)."""
    b, t, h, r, w = 1, 4096, 2, 64, 64
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, t, h, r))
    latents = jax.random.normal(keys[1], (b, t, r))
    indices = jax.random.randint(keys[2], (b, t, w), 0, t)
    loss = lambda q, c: la.sparse_latent_attention_reference(q, c, indices, scale=r**-0.5).sum()  # noqa: E731
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(q, latents).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < h * t * t * 4 / 2
