"""Stateful inference: prefill, continuation prefill and decode over the cache, against the
uncached forward and against transformers' own cached generation; the engine's invariants."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import KERNELS, SHIPPED, assert_generation_matches, golden_case, load_model, record, relative_error

import glm5next_jax
from glm5next_jax import cache as cache_lib
from glm5next_jax import inference
from glm5next_jax.cache import init_cache
from glm5next_jax.generate import generate
from glm5next_jax.layers.dsa import dsa_layer_cached

EXACT = 1e-5  # fp32 params and fp32 latents: only summation order differs


@pytest.fixture(scope="module")
def model():
    return load_model(SHIPPED, "float32")


def fp32_cache(config, batch, max_len=192, **kw):
    return init_cache(config, batch, max_len, dtype="float32", latent_dtype=kw.pop("latent_dtype", "float32"), page_size=16, **kw)


def random_ids(seed, batch, length, vocab):
    return np.random.default_rng(seed).integers(2, vocab, (batch, length)).astype(np.int32)


@pytest.mark.parametrize("case", ["tiny_left_pad", "tiny_right_pad", "tiny_long_left_pad"])
def test_prefill_equals_forward_and_transformers(goldens, model, case):
    config, params = model
    data = golden_case(goldens, case)
    cache = fp32_cache(config, data["ids"].shape[0], max_len=-(-data["ids"].shape[1] // 16) * 16)
    logits, cache = glm5next_jax.prefill(params, config, data["ids"], data["mask"], cache)
    real = data["mask"].astype(bool)
    forward = glm5next_jax.forward(params, config, data["ids"], data["mask"])
    assert relative_error(logits, forward, real) < EXACT
    assert record(f"prefill {case} vs transformers", relative_error(logits, data["logits"], real)) < 1e-4
    np.testing.assert_array_equal(cache["lengths"], real.sum(1))


@pytest.mark.parametrize("length, split", [(30, 6), (150, 23)], ids=["dense", "sparse"])
def test_prefill_equals_prefix_plus_decode_steps_plus_continuation(model, length, split):
    """prefill(T) == prefill(T-k) + k decode steps == prefill(T-k) + a continuation of k tokens.

    Sparse: 150 tokens select 8 of up to 37 pools; the split at 127 crosses the KDA chunk boundary
    (128) and leaves incomplete pools on both sides."""
    config, params = model
    ids = random_ids(length, 2, length, config.vocab_size)
    full, full_cache = glm5next_jax.prefill(params, config, ids, None, fp32_cache(config, 2))
    head = length - split

    _, cache = glm5next_jax.prefill(params, config, ids[:, :head], None, fp32_cache(config, 2))
    stepped = []
    for i in range(split):
        logits, cache = glm5next_jax.decode_step(params, config, ids[:, head + i], cache)
        stepped.append(logits)
    assert relative_error(jnp.stack(stepped, 1), full[:, head:]) < EXACT

    _, cont = glm5next_jax.prefill(params, config, ids[:, :head], None, fp32_cache(config, 2))
    logits, cont = glm5next_jax.prefill(params, config, ids[:, head:], None, cont)
    assert relative_error(logits, full[:, head:]) < EXACT

    for a, b, c in zip(jax.tree.leaves(full_cache), jax.tree.leaves(cache), jax.tree.leaves(cont)):
        if jnp.issubdtype(a.dtype, jnp.integer):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(a, c)
        else:
            assert relative_error(b, a) < EXACT and relative_error(c, a) < EXACT


def test_rows_of_different_lengths_advance_independently(model):
    """A right-padded batch (37 and 90 tokens), then decode steps: each row equals its own forward."""
    config, params = model
    lengths = [37, 90]
    ids = random_ids(1, 2, 90 + 8, config.vocab_size)
    mask = (np.arange(90)[None] < np.array(lengths)[:, None]).astype(np.int32)
    logits, cache = glm5next_jax.prefill(params, config, ids[:, :90], mask, fp32_cache(config, 2))
    fed = [[], []]
    steps = []
    for i in range(8):
        tokens = ids[:, 90 + i]
        step, cache = glm5next_jax.decode_step(params, config, tokens, cache)
        steps.append(step)
        for b in range(2):
            fed[b].append(int(tokens[b]))
    np.testing.assert_array_equal(cache["lengths"], np.array(lengths) + 8)
    for b, n in enumerate(lengths):
        row = np.concatenate([ids[b, :n], fed[b]])[None]
        want = glm5next_jax.forward(params, config, row)[0]
        assert relative_error(logits[b, :n], want[:n]) < EXACT
        assert relative_error(jnp.stack(steps, 1)[b], want[n:]) < EXACT


def test_a_model_without_dsa_layers_holds_max_len_tokens(model):
    """Nothing is paged without DSA layers; the cache still holds max_len tokens (KDA state only)."""
    config, _ = model
    config = config.replace(num_hidden_layers=2, layer_types=("linear_attention",) * 2, mlp_layer_types=("dense",) * 2,
                            indexer_types=("full",) * 2)
    params = glm5next_jax.init_params(config, jax.random.key(0), dtype="float32")
    ids = random_ids(5, 2, 100, config.vocab_size)
    logits, cache = glm5next_jax.prefill(params, config, ids, None, fp32_cache(config, 2, max_len=112))
    assert relative_error(logits, glm5next_jax.forward(params, config, ids)) < EXACT
    np.testing.assert_array_equal(cache["lengths"], [100, 100])
    with pytest.raises(ValueError, match="would exceed the cache's 112 tokens"):
        glm5next_jax.prefill(params, config, ids[:, :13], None, cache)


def test_decode_compiles_once(model):
    config, params = model
    cache = fp32_cache(config, 2)
    _, cache = glm5next_jax.prefill(params, config, random_ids(2, 2, 10, config.vocab_size), None, cache)
    before = inference._decode._cache_size()
    for i in range(6):
        _, cache = glm5next_jax.decode_step(params, config, np.array([3 + i, 4 + i]), cache)
    assert inference._decode._cache_size() - before <= 1


def test_bf16_latent_cache_within_rounding(goldens, model):
    config, params = model
    data = golden_case(goldens, "tiny_sparse")
    ids = data["ids"]
    cache = fp32_cache(config, 1, latent_dtype="bfloat16")
    logits, cache = glm5next_jax.prefill(params, config, ids[:, :-8], None, cache)
    steps = [logits]
    for i in range(8):
        step, cache = glm5next_jax.decode_step(params, config, ids[:, -8 + i], cache)
        steps.append(step[:, None])
    error = relative_error(jnp.concatenate(steps, 1), data["logits"])
    error = record("bf16 latent cache (fp32 params) vs uncached forward", error)
    assert error < 2e-3


def typical_and_worst(got, want):
    """(median over tokens, max) of each token's max |got - want|, over max |want|."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    per_token = np.abs(got - want).reshape(-1, want.shape[-1]).max(-1) / np.abs(want).max()
    return float(np.median(per_token)), float(per_token.max())


def test_fp8_latents_round_within_half_an_e4m3_step():
    """Each token's latents scaled so that max |x| is e4m3's largest value (448): every element is
    within half a step of e4m3 (3 mantissa bits: 2^-4 of it; 2^-10 of the scale below e4m3's normal
    range), over magnitudes from 1e-6 to 1e2 in one row."""
    x = np.random.default_rng(3).standard_normal((64, 512)) * np.logspace(-6, 2, 512)
    values, scale = cache_lib.quantise_latent(jnp.asarray(x, jnp.float32))
    back = np.asarray(values.astype(jnp.float32), np.float64) * np.asarray(scale, np.float64)[:, None]
    x32 = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    bound = np.maximum(2.0**-4 * np.abs(x32), 2.0**-10 * np.asarray(scale, np.float64)[:, None])
    assert (np.abs(back - x32) <= bound * (1 + 1e-6)).all()
    np.testing.assert_allclose(np.abs(back).max(-1), np.abs(x32).max(-1), rtol=1e-6)  # the row's max is exact


def test_fp8_latent_cache_bound(goldens, model):
    """e4m3 keeps 3 mantissa bits (per-token scale). Limits at about twice the measured: the DSA
    layer's output moves by 3.9e-3 on the typical token (2.1e-2 at most); through the model's
    discrete choices, the logits by 3.7e-2 (0.16 at most)."""
    config, params = model
    h = jax.random.normal(jax.random.key(0), (2, 150, config.hidden_size))
    valid = jnp.ones((2, 150), bool)
    outs = {}
    for latent in ("float32", "float8_e4m3fn"):
        cache = fp32_cache(config, 2, latent_dtype=latent)
        outs[latent], _, _ = dsa_layer_cached(params["layers"][3]["attn"], h, config, cache["layers"][3],
                                              cache["page_table"], cache["lengths"], valid)
    typical, worst = typical_and_worst(outs["float8_e4m3fn"], outs["float32"])
    record("fp8 latent cache: DSA layer output, typical token", typical)
    record("fp8 latent cache: DSA layer output, worst token", worst)
    assert typical < 8e-3 and worst < 4e-2

    data = golden_case(goldens, "tiny_sparse")
    cache = fp32_cache(config, 1, latent_dtype="float8_e4m3fn")
    logits, cache = glm5next_jax.prefill(params, config, data["ids"], None, cache)
    typical, worst = typical_and_worst(logits, data["logits"])
    record("fp8 latent cache: logits vs transformers fp32, typical token", typical)
    assert typical < 8e-2 and worst < 0.3


def test_greedy_generation_matches_transformers_cached_generation(goldens, model):
    """32 greedy tokens for 2 prompts of different lengths, identical to transformers' generate."""
    config, params = model
    data = golden_case(goldens, "generate")
    prompts = [row[m.astype(bool)].tolist() for row, m in zip(data["ids"], data["mask"])]
    assert len(prompts[0]) != len(prompts[1])
    out = generate(params, config, prompts, 32, latent_dtype="float32")
    np.testing.assert_array_equal(np.array(out.tokens), data["new_tokens"])
    assert out.finished == [False, False]


def test_bf16_greedy_generation_matches_transformers_bf16(goldens):
    """transformers' own bf16 greedy generation (the kernels checkpoint; the references here,
    tests/model/test_model_kernels.py runs it through the kernels)."""
    config, params = load_model(KERNELS, "bfloat16")
    data = golden_case(goldens, "generate_bf16")
    prompts = [row[m.astype(bool)].tolist() for row, m in zip(data["ids"], data["mask"])]
    out = generate(params, config, prompts, data["new_tokens"].shape[1], eos_token_id=[], latent_dtype="bfloat16")
    assert_generation_matches(np.array(out.tokens), data)


# ---- the engine's invariants: clear errors before any computation ------------------------------


def test_invariant_errors(model):
    config, params = model
    cache = fp32_cache(config, 2, max_len=32)
    ids = random_ids(3, 2, 20, config.vocab_size)
    _, cache = glm5next_jax.prefill(params, config, ids, None, cache)

    with pytest.raises(ValueError, match="no room"):
        glm5next_jax.prefill(params, config, ids, None, cache)
    with pytest.raises(ValueError, match="batch mismatch"):
        glm5next_jax.decode_step(params, config, np.array([1, 2, 3]), cache)
    _, params16 = load_model(SHIPPED, "bfloat16")
    with pytest.raises(ValueError, match="dtype mismatch"):
        glm5next_jax.decode_step(params16, config, np.array([1, 2]), cache)
    with pytest.raises(ValueError, match=r"selection width k = 131 must be in \[1, 35\]"):
        glm5next_jax.decode_step(params, config.replace(index_topk=128), np.array([1, 2]), cache)
    with pytest.raises(ValueError, match="index_topk must be a positive integer"):
        config.replace(index_topk=0)  # k == 0 cannot even be configured
    behind = dict(cache, layers=[dict(l) for l in cache["layers"]])
    behind["layers"][3]["indexer_length"] = cache["lengths"] - 1
    with pytest.raises(ValueError, match="layer 3: the indexer cache is behind the sequence"):
        glm5next_jax.decode_step(params, config, np.array([1, 2]), behind)
    with pytest.raises(ValueError, match="neither left- nor right-padded"):
        glm5next_jax.prefill(params, config, ids[:, :3], np.array([[1, 0, 1], [1, 1, 1]]), fp32_cache(config, 2))


def test_indexer_cache_ahead_is_rewound(model):
    """An indexer ahead of the sequence (say, after the caller rolled lengths back) is rewound."""
    config, params = model
    ids = random_ids(4, 1, 60, config.vocab_size)
    _, clean = glm5next_jax.prefill(params, config, ids[:, :40], None, fp32_cache(config, 1))
    ahead = jax.tree.map(jnp.copy, clean)  # decode_step donates its cache: keep two independent copies
    ahead["layers"][3]["indexer_length"] = clean["lengths"] + 7
    want, _ = glm5next_jax.decode_step(params, config, ids[:, 40], clean)
    got, after = glm5next_jax.decode_step(params, config, ids[:, 40], ahead)
    assert relative_error(got, want) < EXACT
    np.testing.assert_array_equal(after["layers"][3]["indexer_length"], after["lengths"])


@pytest.mark.parametrize("entry", ["forward", "prefill"])
def test_bad_token_batches_are_rejected(model, entry):
    config, params = model

    def call(ids, mask):
        if entry == "forward":
            return glm5next_jax.forward(params, config, ids, mask)
        return glm5next_jax.prefill(params, config, ids, mask, fp32_cache(config, np.shape(ids)[0]))

    ids = np.ones((2, 4), np.int32)
    for bad_ids, mask, message in (
        (ids.astype(np.float32), None, "integer array"),
        (ids[:, :0], None, "at least one token"),
        (ids + config.vocab_size, None, "must lie in"),
        (ids, np.ones((2, 3)), "must match"),
        (ids, 2 * np.ones((2, 4)), "only 0 and 1"),
    ):
        with pytest.raises(ValueError, match=message):
            call(bad_ids, mask)


def test_token_batch_checks_take_traced_arrays():
    """forward under a caller's jax.jit: the shape and dtype checks still run, the value checks wait."""
    from glm5next_jax.model import check_token_batch

    ids, mask = np.ones((2, 3), np.int32), np.ones((2, 3), np.int32)
    checked = jax.jit(lambda i, m: (check_token_batch(i, m, 10), i)[1])
    np.testing.assert_array_equal(checked(ids, mask), ids)
    with pytest.raises(ValueError, match="integer array"):
        checked(ids.astype(np.float32), mask)
    with pytest.raises(ValueError, match="must match"):
        checked(ids, mask[:, :2])
