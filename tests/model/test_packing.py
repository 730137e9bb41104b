"""Packed sequences (`forward(..., segment_ids=)`, `next_token_loss`, `train_step`): every document of a
packed row gets the logits it gets alone, and the loss is the documents' losses pooled."""

import jax
import numpy as np
import optax
import pytest
from conftest import SHIPPED, load_model

from glm5next_jax import forward, load_checkpoint, train
from glm5next_jax.errors import InputError

# Documents a row: longer than the tiny model's 32 + 3 selected keys (its DSA layers rank pools), not
# multiples of its pools of 4 or of KDA's chunks of 64, one of a single token; the second row right-padded.
DOCUMENTS = [[37, 50, 1, 8], [70, 21]]
T = 96


@pytest.fixture(scope="module")
def packed():
    config, params = load_model(SHIPPED, "float32")
    ids = np.random.default_rng(4).integers(2, config.vocab_size, (2, T)).astype(np.int32)
    segments = np.zeros((2, T), np.int32)
    for row, lengths in enumerate(DOCUMENTS):
        segments[row, : sum(lengths)] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
    return config, params, ids, segments


def documents_apart(ids):
    """Each document in a row of its own, right-padded to the longest: (ids, mask, [(row, slice)])."""
    parts = [(row, slice(start, start + n)) for row, lengths in enumerate(DOCUMENTS)
             for start, n in zip(np.cumsum([0] + lengths[:-1]), lengths)]
    apart = np.zeros((len(parts), max(max(lengths) for lengths in DOCUMENTS)), np.int32)
    mask = np.zeros_like(apart)
    for i, (row, part) in enumerate(parts):
        apart[i, : part.stop - part.start] = ids[row, part]
        mask[i, : part.stop - part.start] = 1
    return apart, mask, parts


def test_each_document_gets_its_logits_alone(packed):
    config, params, ids, segments = packed
    logits = np.asarray(forward(params, config, ids, segment_ids=segments))
    unpacked = np.asarray(forward(params, config, ids, np.ones_like(ids)))
    apart, mask, parts = documents_apart(ids)
    alone = np.asarray(forward(params, config, apart, mask))
    for i, (row, part) in enumerate(parts):
        want = alone[i, : part.stop - part.start]
        error = np.abs(logits[row, part] - want).max() / np.abs(want).max()
        assert error < 2e-5, (row, part, error)
        if part.start > 0 and part.stop - part.start > 4:  # what the row's earlier documents would change
            assert np.abs(unpacked[row, part] - want).max() / np.abs(want).max() > 1e-2


def test_the_loss_pools_the_documents_and_the_step_takes_it(packed):
    """The packed loss is the loss of the documents apart (the mean over all their targets: no target
    across a boundary); train_step reports the same loss for the packed batch."""
    config, _, ids, segments = packed
    _, params = load_checkpoint(SHIPPED, "float32", form="train")
    inference = train.inference_params(params, config)
    apart, mask, _ = documents_apart(ids)
    want = float(train.next_token_loss(inference, config, apart, mask))
    packed_loss = float(train.next_token_loss(inference, config, ids, segment_ids=segments))
    assert packed_loss == pytest.approx(want, rel=2e-5)
    optimizer = optax.sgd(0.0)
    step = jax.jit(train.train_step, static_argnames=train.STATIC)
    _, metrics = step(train.init_train_state(params, optimizer), ids, config=config, optimizer=optimizer,
                      segment_ids=segments)
    assert float(metrics["loss"]) == pytest.approx(packed_loss, rel=1e-5)


def test_bad_segment_ids_are_named(packed):
    config, params, ids, segments = packed
    with pytest.raises(InputError, match="not both"):
        forward(params, config, ids, np.ones_like(ids), segment_ids=segments)
    split = np.repeat([[1, 2, 1]], [10, 10, T - 20], axis=1).repeat(2, 0)  # document 1 in two runs
    with pytest.raises(InputError, match="one run of tokens"):
        forward(params, config, ids, segment_ids=split)
    with pytest.raises(InputError, match=">= 0"):
        forward(params, config, ids, segment_ids=-segments)
    with pytest.raises(InputError, match="shape"):
        forward(params, config, ids, segment_ids=segments[:, :10])
