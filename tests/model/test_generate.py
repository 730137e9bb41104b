"""generate(): greedy and sampling, EOS, streaming callback; pausing and resuming through orbax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SHIPPED, load_model

import glm5next_jax
from glm5next_jax.generate import generate, sample
from glm5next_jax.store import restore_cache, save_cache

PROMPTS = [[5, 17, 301, 42, 8, 77, 9], [9, 10, 11]]


@pytest.fixture(scope="module")
def model():
    return load_model(SHIPPED, "float32")


@pytest.fixture(scope="module")
def greedy(model):
    config, params = model
    return generate(params, config, PROMPTS, 12, eos_token_id=[])


def test_top_k_1_and_tiny_top_p_are_greedy(model, greedy):
    config, params = model
    assert generate(params, config, PROMPTS, 12, temperature=1.0, top_k=1, eos_token_id=[]).tokens == greedy.tokens
    assert generate(params, config, PROMPTS, 12, temperature=1.0, top_p=1e-6, eos_token_id=[]).tokens == greedy.tokens


def test_sampling_is_seeded(model, greedy):
    config, params = model
    a = generate(params, config, PROMPTS, 12, temperature=1.0, seed=3, eos_token_id=[])
    b = generate(params, config, PROMPTS, 12, temperature=1.0, seed=3, eos_token_id=[])
    c = generate(params, config, PROMPTS, 12, temperature=1.0, seed=4, eos_token_id=[])
    assert a.tokens == b.tokens and a.tokens != c.tokens and a.tokens != greedy.tokens


def test_sample_follows_the_restricted_distribution():
    logits = jnp.log(jnp.array([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    logits = jnp.repeat(logits, 40000, axis=0)
    draws = np.asarray(sample(logits, jax.random.key(0), temperature=1.0, top_k=3, top_p=None))
    freq = np.bincount(draws, minlength=5) / draws.size
    np.testing.assert_allclose(freq, [0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0], atol=0.01)
    draws = np.asarray(sample(logits, jax.random.key(1), temperature=1.0, top_k=None, top_p=0.6))
    freq = np.bincount(draws, minlength=5) / draws.size  # 0.5 < 0.6: the top two tokens stay
    np.testing.assert_allclose(freq, [0.5 / 0.7, 0.2 / 0.7, 0, 0, 0], atol=0.01)
    draws = np.asarray(sample(logits * 0.5, jax.random.key(2), temperature=0.5, top_k=None, top_p=None))
    np.testing.assert_allclose(np.bincount(draws, minlength=5) / draws.size, [0.5, 0.2, 0.15, 0.1, 0.05], atol=0.01)


def test_eos_stops_only_its_row(model, greedy):
    config, params = model
    eos = greedy.tokens[0][2]
    assert eos not in greedy.tokens[1]
    out = generate(params, config, PROMPTS, 12, eos_token_id=eos)
    assert out.tokens[0] == greedy.tokens[0][:3] and out.finished[0]
    assert out.tokens[1] == greedy.tokens[1] and not out.finished[1]


def test_callback_streams_and_can_stop(model, greedy):
    config, params = model
    seen = []

    def callback(step, tokens, finished):
        seen.append(tokens.tolist())
        return step == 4

    out = generate(params, config, PROMPTS, 12, eos_token_id=[], callback=callback)
    assert len(seen) == 5 and [s[0] for s in seen] == greedy.tokens[0][:5]
    assert out.tokens == [t[:5] for t in greedy.tokens]


def test_pause_and_resume_through_orbax(model, greedy, tmp_path):
    """Generate 6 tokens, save the cache, restore it, decode on: the same tokens as 12 in one go."""
    config, params = model
    first = generate(params, config, PROMPTS, 6, eos_token_id=[])
    save_cache(tmp_path / "cache", first.cache)
    cache = restore_cache(tmp_path / "cache")
    for a, b in zip(jax.tree.leaves(first.cache), jax.tree.leaves(cache)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    tokens = np.array([t[-1] for t in first.tokens])  # the last new token is not in the cache yet
    resumed = [list(t) for t in first.tokens]
    for _ in range(6):
        logits, cache = glm5next_jax.decode_step(params, config, tokens, cache)
        tokens = np.asarray(jnp.argmax(logits, -1))
        for b in range(2):
            resumed[b].append(int(tokens[b]))
    assert resumed == greedy.tokens


def test_bad_arguments(model):
    config, params = model
    for kwargs, message in (({"temperature": -1.0}, "temperature"), ({"top_k": 0}, "top_k"), ({"top_p": 1.5}, "top_p")):
        with pytest.raises(ValueError, match=message):
            generate(params, config, PROMPTS, 4, **kwargs)
    with pytest.raises(ValueError, match="non-empty"):
        generate(params, config, [[1], []], 4)
