"""Fuzzed arguments of the public API (hypothesis): every call returns finite logits of the right
shape or raises the library's InputError naming an argument, never an error from inside JAX, numpy
or a kernel. A 2-layer model of the shipped widths (a KDA and a DSA layer, both with a MoE) keeps the
valid calls' compilations few: the token batches take a handful of shapes."""

import re

import jax
import numpy as np
import pytest
from conftest import SHIPPED
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import glm5next_jax
from glm5next_jax import InputError

FUZZ = settings(max_examples=40, deadline=None, derandomize=False, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def model():
    config = glm5next_jax.Config.from_hf(SHIPPED).replace(
        num_hidden_layers=2, layer_types=("linear_attention", "indexed_attention"), mlp_layer_types=("sparse", "sparse"),
        indexer_types=("full", "full"),
    )
    return config, glm5next_jax.init_params(config, jax.random.key(0), dtype="float32")


DTYPES = [np.int32, np.int64, np.uint8, np.float32, np.float64, np.bool_]


@st.composite
def token_batches(draw):
    """(ids, mask): mostly well-formed batches of 1-2 rows of 1-4 tokens, with every kind of defect."""
    b, t = draw(st.sampled_from([(1, 1), (1, 4), (2, 3), (0, 3), (2, 0)]))
    shape = draw(st.sampled_from([(b, t), (b,), (b, t, 1), ()])) if draw(st.booleans()) else (b, t)
    dtype = draw(st.sampled_from(DTYPES)) if draw(st.integers(0, 3)) == 0 else np.int32
    high = draw(st.sampled_from([512, 513, 2**31 - 1]))
    low = draw(st.sampled_from([0, 0, -1]))
    ids = np.asarray(draw(st.lists(st.integers(low, high - 1), min_size=int(np.prod(shape)), max_size=int(np.prod(shape)))))
    ids = ids.reshape(shape).astype(dtype)
    if dtype in (np.float32, np.float64) and ids.size and draw(st.booleans()):
        ids.flat[0] = draw(st.sampled_from([np.nan, np.inf, 0.5]))
    kind = draw(st.sampled_from(["none", "ones", "left", "right", "hole", "values", "shape"]))
    if kind == "none":
        return ids, None
    mask = np.ones(shape if len(shape) == 2 else (b, max(t, 1)), np.int32)
    if kind in ("left", "right", "hole") and mask.ndim == 2 and mask.shape[0] and mask.shape[1] > 2:
        pad = draw(st.integers(1, mask.shape[1] - 1))
        if kind == "left":
            mask[-1, :pad] = 0
        elif kind == "right":
            mask[-1, mask.shape[1] - pad :] = 0
        else:
            mask[-1, 1] = 0
    elif kind == "values" and mask.size:
        mask.flat[0] = draw(st.sampled_from([2, -1]))
    elif kind == "shape":
        mask = mask[:, :-1] if mask.ndim == 2 else mask
    return ids, mask.astype(draw(st.sampled_from([np.int32, np.bool_, np.float32])))


def names_an_argument(error, names):
    assert isinstance(error, InputError), f"{type(error).__name__}: {error}"
    assert any(re.search(rf"\b{n}\b", str(error)) for n in names), str(error)


LEFT_PADDED = (np.array([[5, 6, 7], [8, 9, 10]]), np.array([[1, 1, 1], [0, 1, 1]]))


def forward_logits(params, config, ids, mask):
    return glm5next_jax.forward(params, config, ids, mask)


def prefill_logits(params, config, ids, mask):
    rows = np.shape(ids)[0] if np.ndim(ids) and np.shape(ids)[0] else 2  # a cache of the batch's rows
    cache = glm5next_jax.init_cache(config, rows, 64, page_size=16, dtype="float32")
    return glm5next_jax.prefill(params, config, ids, mask, cache)[0]


@pytest.mark.parametrize("entry", [forward_logits, prefill_logits], ids=["forward", "prefill"])
@FUZZ
@given(batch=token_batches())
@example(batch=LEFT_PADDED)
def test_any_token_batch_gives_logits_or_names_what_is_wrong(model, entry, batch):
    config, params = model
    ids, mask = batch
    try:
        logits = entry(params, config, ids, mask)
    except Exception as error:  # noqa: BLE001 - the property is about which errors escape
        names_an_argument(error, ["input_ids", "attention_mask"])
        return
    event("logits returned")
    assert logits.shape == (*np.shape(ids), config.vocab_size)
    assert np.isfinite(np.asarray(logits)).all()


numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 600), st.sampled_from([None, True, "1", 2.5])
)


@FUZZ
@given(
    prompt=st.one_of(st.lists(st.integers(-2, 520), min_size=0, max_size=3),
                     st.lists(st.floats(0, 10), min_size=1, max_size=2), st.just([[5, 6]]), st.just("5 6")),
    max_new_tokens=st.one_of(st.just(2), numbers), temperature=st.one_of(st.just(0.0), st.just(0.7), numbers),
    top_k=st.one_of(st.none(), numbers), top_p=st.one_of(st.none(), numbers),
    seed=st.one_of(st.just(0), st.integers(-(2**70), 2**70), numbers),
)
@example(prompt=[5, 6, 7], max_new_tokens=2, temperature=0.7, top_k=5, top_p=0.9, seed=2**40)
def test_generate_takes_any_arguments_or_names_the_wrong_one(model, prompt, max_new_tokens, temperature, top_k, top_p, seed):
    config, params = model
    if isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool) and max_new_tokens > 2:
        max_new_tokens = 2  # the fuzz is of the checks; long generations add nothing
    try:
        out = glm5next_jax.generate(params, config, [prompt], max_new_tokens, temperature=temperature, top_k=top_k,
                                    top_p=top_p, seed=seed)
    except Exception as error:  # noqa: BLE001
        names_an_argument(error, ["prompts", r"prompts\[0\]", "max_new_tokens", "temperature", "top_k", "top_p", "seed"])
        return
    event("tokens returned")
    assert 1 <= len(out.tokens[0]) <= max_new_tokens
    assert all(0 <= t < config.vocab_size for t in out.tokens[0])
