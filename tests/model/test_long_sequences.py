"""Over 64K tokens of the shipped tiny model (fp32): logits and KDA states stay finite, and a prefill
of all but the last tokens followed by decode steps over them equals the uncached forward."""

import jax
import numpy as np
import pytest
from conftest import SHIPPED, load_model, record, relative_error

import glm5next_jax

TOKENS, STEPS = 65536, 4


@pytest.mark.slow
def test_prefill_then_decode_equals_forward_over_64k_tokens():
    config, params = load_model(SHIPPED, "float32")
    ids = np.random.default_rng(0).integers(2, config.vocab_size, (1, TOKENS)).astype(np.int32)
    logits = np.asarray(glm5next_jax.forward(params, config, ids))
    assert np.isfinite(logits).all()
    cache = glm5next_jax.init_cache(config, 1, TOKENS, page_size=64, dtype="float32", latent_dtype="float32")
    prefix, cache = glm5next_jax.prefill(params, config, ids[:, : TOKENS - STEPS], None, cache)
    steps = [np.asarray(prefix)[:, -1]]
    for t in range(TOKENS - STEPS, TOKENS - 1):
        step, cache = glm5next_jax.decode_step(params, config, ids[:, t], cache)
        steps.append(np.asarray(step))
    states = [layer["state"] for layer in cache["layers"] if "state" in layer]
    assert states and all(np.isfinite(np.asarray(s)).all() for s in states)
    error = record("64K tokens: prefill + decode vs forward (last positions)",
                   relative_error(np.stack(steps, 1), logits[:, TOKENS - STEPS - 1 : TOKENS - 1]))
    assert error < 1e-4
    assert relative_error(np.asarray(prefix), logits[:, : TOKENS - STEPS]) < 1e-4
    jax.clear_caches()
