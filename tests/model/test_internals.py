"""`forward(..., return_internals=True)` and `prefill(..., return_internals=True)`: the layers' inner
values for analysis, consistent with the logits and with each other."""

import jax
import numpy as np
import pytest
from conftest import SHIPPED, load_model, relative_error

import glm5next_jax
from glm5next_jax.config import DSA


@pytest.fixture(scope="module")
def run():
    config, params = load_model(SHIPPED, "float32")
    ids = np.random.default_rng(0).integers(2, config.vocab_size, (2, 70)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :9] = 0  # left-padded
    logits, internals = glm5next_jax.forward(params, config, ids, mask, return_internals=True)
    return config, params, ids, mask, logits, internals


def test_the_logits_are_forwards(run):
    """The same computation, compiled as another program (XLA fuses it otherwise): fp32 rounding apart."""
    config, params, ids, mask, logits, _ = run
    assert relative_error(logits, glm5next_jax.forward(params, config, ids, mask)) < 1e-5


def test_each_layer_reports_what_it_computes(run):
    config, _, ids, _, _, internals = run
    b, t = ids.shape
    n = config.hc_mult
    assert len(internals) == config.num_hidden_layers
    for i, inside in enumerate(internals):
        for key in ("attention_mixing", "mlp_mixing"):
            comb = np.asarray(inside[key]["comb"])
            assert comb.shape == (b, t, n, n) and inside[key]["pre"].shape == inside[key]["post"].shape == (b, t, n)
            # Sinkhorn-normalised: rows and columns sum to one, to the iterations' tolerance.
            np.testing.assert_allclose(comb.sum(-1), 1.0, atol=1e-3)
            np.testing.assert_allclose(comb.sum(-2), 1.0, atol=1e-3)
        assert inside["attention_output"].shape == inside["attention_input"].shape == (b, t, config.hidden_size)
        if config.layer_types[i] == DSA:
            selected = np.asarray(inside["selected"])
            assert selected.ndim == 3 and selected.shape[:2] == (b, t) and "forget_gate" not in inside
            assert (selected < np.arange(t)[None, :, None] + 1).all()  # causal: at or before the query
        else:
            g = np.asarray(inside["forget_gate"])
            assert g.shape == (b, t, config.linear_num_heads, config.linear_head_dim) and "selected" not in inside
            assert (g <= 0).all() and (g >= config.linear_lower_bound).all()
        if config.mlp_layer_types[i] == "sparse":
            experts = np.asarray(inside["routing"]["experts"])
            assert experts.shape == inside["routing"]["weights"].shape == (b, t, config.num_experts_per_tok)
            assert ((experts >= 0) & (experts < config.n_routed_experts)).all()
            assert (np.sort(experts, -1)[..., 1:] != np.sort(experts, -1)[..., :-1]).all()  # distinct experts
        else:
            assert "routing" not in inside


def test_prefill_reports_the_same_in_the_callers_positions(run):
    config, params, ids, mask, _, internals = run
    cache = glm5next_jax.init_cache(config, 2, 128, page_size=16, dtype="float32", latent_dtype="float32")
    _, _, cached = glm5next_jax.prefill(params, config, ids, mask, cache, return_internals=True)
    real = mask.astype(bool)
    for i, (a, b) in enumerate(zip(internals, cached, strict=True)):
        assert jax.tree.structure(a) == jax.tree.structure(b), i
        for name in ("forget_gate", "attention_output"):
            if name in a:
                np.testing.assert_allclose(np.asarray(b[name])[real], np.asarray(a[name])[real], rtol=1e-4, atol=1e-4)
        for sublayer in ("attention_mixing", "mlp_mixing"):
            np.testing.assert_allclose(np.asarray(b[sublayer]["comb"])[real], np.asarray(a[sublayer]["comb"])[real],
                                       rtol=1e-4, atol=1e-5)
        if config.mlp_layer_types[i] == "sparse":
            np.testing.assert_array_equal(np.asarray(b["routing"]["experts"])[0], np.asarray(a["routing"]["experts"])[0])
