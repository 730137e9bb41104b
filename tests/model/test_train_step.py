"""The training step: the train form's parameters (DSA's checkpoint projections) against the
loader's inference form, its gradients against `checkpoint_gradients` (torch-keyed, checked against
autograd elsewhere), overfitting one batch, the frozen leaves, the routers' balancing and balance loss."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import golden_case, load_model, model_path

from glm5next_jax import forward, load_checkpoint, store, train
from glm5next_jax.errors import InputError
from glm5next_jax.params import param_spec

STEP = jax.jit(train.train_step, static_argnames=train.STATIC)
ADAMW = optax.adamw(1e-2)  # one optimizer object and one batch shape (2, 24): the tests share a compile


@pytest.fixture(scope="module")
def shipped_train_form(goldens):
    return load_checkpoint(model_path(goldens, "shipped"), "float32", form="train")


def test_train_form_gives_the_loaders_inference_params(goldens, shipped_train_form):
    config, params = shipped_train_form
    _, loaded = load_model(model_path(goldens, "shipped"), "float32")
    got = train.inference_params(params, config)
    assert jax.tree.structure(got) == jax.tree.structure(loaded)
    for (where, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-7, err_msg=jax.tree_util.keystr(where))


def test_train_form_gradients_are_the_checkpoints(goldens, shipped_train_form):
    """jax.grad over the train form equals `checkpoint_gradients` (transformers' names and layout)."""
    config, params = shipped_train_form
    case = golden_case(goldens, "tiny_dense")
    grads = jax.grad(lambda p: train.next_token_loss(train.inference_params(p, config), config, case["ids"]))(params)
    _, named = train.checkpoint_gradients(model_path(goldens, "shipped"), case["ids"])
    layer = next(i for i, t in enumerate(config.layer_types) if t == "indexed_attention")
    prefix = f"model.language_model.layers.{layer}."
    pairs = {
        "self_attn.q_b_proj.weight": grads["layers"][layer]["attn"]["q_b_proj"].T,
        "self_attn.kv_b_proj.weight": grads["layers"][layer]["attn"]["kv_b_proj"].T,
        "self_attn.o_proj.weight": grads["layers"][layer]["attn"]["o_proj"].T,
        "self_attn.q_a_proj.weight": grads["layers"][layer]["attn"]["q_a_proj"].T,
        "input_layernorm.weight": grads["layers"][layer]["input_norm"],
    }
    for name, got in pairs.items():
        want = named[prefix + name]
        assert np.linalg.norm(np.asarray(got) - want) <= 1e-5 * np.linalg.norm(want), name


def test_overfitting_one_batch(shipped_train_form):
    """AdamW on one batch of the tiny checkpoint drives the loss below a tenth of its start within 50
    steps; the indexer and the router's selection bias stay as loaded."""
    config, params = shipped_train_form
    ids = np.random.default_rng(0).integers(2, config.vocab_size, (2, 24))
    mask = np.ones_like(ids)
    mask[1, :4] = 0  # left padding: its positions count for nothing
    state = train.init_train_state(params, ADAMW)
    losses = []
    while len(losses) < 50 and not (losses and losses[-1] < 0.1 * losses[0]):
        state, metrics = STEP(state, ids, mask, config=config, optimizer=ADAMW)
        losses.append(float(metrics["loss"]))
    assert int(state.step) == len(losses) > 1
    assert losses[-1] < 0.1 * losses[0], losses  # (at the fifth step here)
    frozen = jax.tree.leaves(jax.tree.map(lambda keep, a, b: keep or bool(jnp.array_equal(a, b)),
                                          train.trainable(params), params, state.params))
    assert all(frozen)
    assert not all(jax.tree.leaves(train.trainable(params)))  # there were frozen leaves to check


def test_bad_forms_are_named(goldens):
    with pytest.raises(InputError, match="form must be one of"):
        load_checkpoint(model_path(goldens, "shipped"), form="training")
    with pytest.raises(InputError, match='weights="fp8" does not apply'):
        load_checkpoint(model_path(goldens, "shipped"), form="train", weights="fp8")
    with pytest.raises(ValueError, match="no fp8"):
        param_spec(load_model(model_path(goldens, "shipped"), "float32")[0], fp8=True, form="train")


def test_a_resumed_run_equals_an_unbroken_one(shipped_train_form, tmp_path):
    """Four AdamW steps unbroken, against two, save_train_state, restore into a fresh state's
    structure, and two more: bit for bit, the step count and the data position carried."""
    config, params = shipped_train_form
    rng = np.random.default_rng(5)
    batches = [rng.integers(2, config.vocab_size, (2, 24)) for _ in range(4)]
    mask = np.ones((2, 24), np.int32)

    def run(state, batches):
        for ids in batches:
            state, _ = STEP(state, ids, mask, config=config, optimizer=ADAMW)
        return state

    unbroken = run(train.init_train_state(params, ADAMW), batches)
    first = run(train.init_train_state(params, ADAMW), batches[:2])
    store.save_train_state(tmp_path / "run", first, config, data_position=2)
    restored_config, restored, position = store.restore_train_state(tmp_path / "run",
                                                                    train.init_train_state(params, ADAMW))
    assert restored_config == config and position == 2 and int(restored.step) == 2
    resumed = run(restored, batches[position:])
    assert jax.tree.structure(resumed) == jax.tree.structure(unbroken)
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(unbroken), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(InputError, match="data_position must be an int >= 0"):
        store.save_train_state(tmp_path / "bad", first, config, data_position=-1)


def _primitives_outside_loops(jaxpr):
    """Every primitive's name in a (closed) jaxpr, sub-jaxprs included but not those of scans and
    while loops (the KDA reference checkpoints its chunk step inside its scan)."""
    names = []
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        names.append(eqn.primitive.name)
        if eqn.primitive.name not in ("scan", "while"):
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                names += _primitives_outside_loops(sub)
    return names


@pytest.mark.parametrize("remat", ["full", pytest.param("dots", marks=pytest.mark.slow)])
def test_remat_keeps_the_values_and_checkpoints_each_layer(shipped_train_form, remat):
    """A step with each layer rematerialised equals one without: the loss and the gradients (read
    from Adam's first moment after its first step, (1 - b1) x g); the gradient's program checkpoints
    every layer once."""
    config, params = shipped_train_form
    ids = np.random.default_rng(6).integers(2, config.vocab_size, (2, 24))
    state = train.init_train_state(params, ADAMW)
    (got, metrics), (want, want_metrics) = (STEP(state, ids, np.ones_like(ids), config=config, optimizer=ADAMW, remat=r)
                                            for r in (remat, "none"))
    assert abs(float(metrics["loss"]) / float(want_metrics["loss"]) - 1) < 1e-6
    moments = list(zip(jax.tree.leaves(got.opt_state[0].mu), jax.tree.leaves(want.opt_state[0].mu)))
    total = np.sqrt(sum(float(jnp.sum((g - w) ** 2)) for g, w in moments) / sum(float(jnp.sum(w**2)) for _, w in moments))
    assert total < 1e-5, total

    def loss_of(remat):
        return lambda p: train.next_token_loss(train.inference_params(p, config), config, ids, remat=remat)

    names = _primitives_outside_loops(jax.make_jaxpr(jax.grad(loss_of(remat)))(params))
    assert sum("remat" in n or "checkpoint" in n for n in names) == config.num_hidden_layers
    with pytest.raises(InputError, match="remat must be one of"):
        train.next_token_loss(train.inference_params(params, config), config, ids, remat="some")


def test_router_balancing_moves_each_bias_towards_balance(shipped_train_form):
    """With router_bias_rate r, each MoE layer's bias moves by r x sign(mean load - load), the loads
    counted independently from the forward's routing over the real tokens; with r = 0 it stays."""
    config, params = shipped_train_form
    ids = np.random.default_rng(7).integers(2, config.vocab_size, (2, 24))
    mask = np.ones_like(ids)
    mask[0, :6] = 0
    state = train.init_train_state(params, ADAMW)  # the optimizer never moves the (frozen) bias
    moved, metrics = STEP(state, ids, mask, config=config, optimizer=ADAMW, router_bias_rate=0.01)
    kept, _ = STEP(state, ids, mask, config=config, optimizer=ADAMW, router_bias_rate=0.0)
    _, internals = forward(train.inference_params(params, config), config, ids, mask, return_internals=True)
    sparse = [i for i, t in enumerate(config.mlp_layer_types) if t == "sparse"]
    assert sparse
    worst = 0.0
    for i in sparse:
        experts = np.asarray(internals[i]["routing"]["experts"])[mask.astype(bool)]
        load = np.bincount(experts.reshape(-1), minlength=config.n_routed_experts).astype(np.float64)
        bias_of = lambda p: np.asarray(p["layers"][i]["mlp"]["router_bias"])  # noqa: E731
        np.testing.assert_allclose(bias_of(moved.params) - bias_of(params), 0.01 * np.sign(load.mean() - load), atol=1e-7)
        np.testing.assert_array_equal(bias_of(kept.params), bias_of(params))
        worst = max(worst, load.max() / load.mean())
    np.testing.assert_allclose(float(metrics["expert_load_imbalance"]), worst, rtol=1e-6)


def _numpy_balance_loss(scores, experts, mask):
    """DeepSeek-V3's sequence-wise balance loss written out per sequence and expert, and its gradient
    with respect to the scores (the counts constant): dL/ds_tj = (f_j / S_t - sum_i f_i s_ti / S_t^2) / T
    for S_t = sum_i s_ti, over the sequences with a real token."""
    b, _, e = scores.shape
    k = experts.shape[-1]
    losses, grad = [], np.zeros_like(scores)
    for row in range(b):
        real = np.flatnonzero(mask[row])
        if real.size == 0:
            continue
        f = np.array([(experts[row, real] == i).sum() for i in range(e)]) * e / (k * real.size)
        s = scores[row, real]
        total = s.sum(-1, keepdims=True)
        losses.append(float(np.sum(f * (s / total).mean(0))))
        grad[row, real] = (f / total - (s * f).sum(-1, keepdims=True) / total**2) / real.size
    return np.mean(losses), grad / len(losses)


def test_sequence_balance_loss_is_deepseeks():
    """The balance loss and its gradient against the per-sequence formula (padding, a sequence without
    real tokens, k = 3 of 8 experts); 1 where every expert gets its share and the scores are equal."""
    rng = np.random.default_rng(5)
    scores = rng.uniform(0.05, 0.95, (3, 10, 8))
    experts = np.stack([[rng.choice(8, 3, replace=False) for _ in range(10)] for _ in range(3)])
    mask = np.ones((3, 10), np.int32)
    mask[0, :4] = 0
    mask[2] = 0
    want, want_grad = _numpy_balance_loss(scores, experts, mask)
    loss, grad = jax.value_and_grad(train.sequence_balance_loss)(jnp.asarray(scores), jnp.asarray(experts), jnp.asarray(mask))
    np.testing.assert_allclose(float(loss), want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-8)
    balanced = np.arange(16).reshape(1, 8, 2) % 8  # 8 tokens x 2 choices: each expert twice
    assert float(train.sequence_balance_loss(jnp.full((1, 8, 8), 0.3), jnp.asarray(balanced), jnp.ones((1, 8)))) == \
        pytest.approx(1.0, rel=1e-6)


def test_the_balance_loss_joins_the_objective_with_its_weight(shipped_train_form):
    """metrics' balance_loss is the MoE layers' sequence-wise losses summed (from the forward's routing,
    through the numpy formula); its weight changes the routers' updates but not the token loss."""
    config, params = shipped_train_form
    ids = np.random.default_rng(7).integers(2, config.vocab_size, (2, 24))
    mask = np.ones_like(ids)
    mask[0, :6] = 0
    state = train.init_train_state(params, ADAMW)
    plain, plain_metrics = STEP(state, ids, mask, config=config, optimizer=ADAMW)
    weighted, metrics = STEP(state, ids, mask, config=config, optimizer=ADAMW, balance_loss_weight=0.5)
    _, internals = forward(train.inference_params(params, config), config, ids, mask, return_internals=True)
    routings = [inside["routing"] for inside in internals if "routing" in inside]
    want = sum(_numpy_balance_loss(np.asarray(r["scores"], np.float64), np.asarray(r["experts"]), mask)[0]
               for r in routings)
    np.testing.assert_allclose(float(metrics["balance_loss"]), want, rtol=1e-5)
    assert float(plain_metrics["balance_loss"]) == float(metrics["balance_loss"])
    assert float(plain_metrics["loss"]) == float(metrics["loss"])
    sparse = [i for i, t in enumerate(config.mlp_layer_types) if t == "sparse"]
    for i in sparse:
        router_of = lambda s: np.asarray(s.params["layers"][i]["mlp"]["router"])  # noqa: E731
        assert not np.array_equal(router_of(plain), router_of(weighted)), i
