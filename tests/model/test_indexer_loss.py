"""The indexer's loss (`layers.indexer_loss`, `forward(..., indexer_loss=)`, `train_step`): its value
against a per-query numpy computation from the layer's parameters, the main model's gradients
bit-identical with it and without it, and the dense warm-up training the indexers alone."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import SHIPPED, load_model

from glm5next_jax import forward, load_checkpoint, train
from glm5next_jax.config import DSA
from glm5next_jax.errors import InputError
from glm5next_jax.layers.dsa import dsa_layer
from glm5next_jax.layers.indexer_loss import indexer_kl


@pytest.fixture(scope="module")
def batch():
    """The tiny checkpoint (pools of 4, 8 pools selected: sparse beyond 35 visible keys) and a batch
    of 48 tokens with a left-padded row."""
    config, params = load_model(SHIPPED, "float32")
    ids = np.random.default_rng(3).integers(2, config.vocab_size, (2, 48)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :5] = 0
    return config, params, ids, mask


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def numpy_indexer_kl(p, h, valid, selected, config, stage):
    """The loss's definition one query at a time in float64 (the module docstring of
    `layers.indexer_loss`), from the layer's input h [B, T, D] and its selection."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    ip, size, eps = p["indexer"], config.index_kpool, config.rms_norm_eps
    heads, rank = config.num_attention_heads, config.kv_lora_rank
    nh, hd = config.index_n_heads, config.index_head_dim
    b, t = valid.shape
    n_pools = t // size
    kls = []
    for row in range(b):
        x = np.asarray(h[row], np.float64)
        q_resid = rms(x @ p["q_a_proj"], p["q_a_norm"], eps)
        latents = rms(x @ p["kv_a_proj"], p["kv_a_norm"], eps)
        q_lat = (q_resid @ p["q_absorb"]).reshape(t, heads, rank)
        k = x @ ip["wk"]
        k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + 1e-6) * ip["k_norm_weight"] + ip["k_norm_bias"]
        gate = x @ ip["compress_gate"]
        q_idx = (q_resid @ ip["wq_b"]).reshape(t, nh, hd)
        weights = x @ ip["weights_proj"]
        first = int(np.argmax(valid[row]))
        pools = [range(first + j * size, first + (j + 1) * size) for j in range(n_pools)]
        pool_keys = []
        for tokens in pools:
            tokens = [min(s, t - 1) for s in tokens]
            logits = gate[tokens] + ip["ape"]
            mix = np.exp(logits - logits.max(0)) / np.exp(logits - logits.max(0)).sum(0)
            pool_keys.append((mix * k[tokens]).sum(0))
        for q in range(t):
            if not valid[row, q]:
                continue
            chosen = set(selected[row, q][selected[row, q] >= 0].tolist())
            if stage == "dense":
                allowed = [s for s in range(q + 1) if valid[row, s]]
            else:
                allowed = sorted(chosen)
            targets = [j for j, tokens in enumerate(pools)
                       if tokens[-1] <= q and tokens[-1] < t and all(valid[row, s] for s in tokens)
                       and (stage == "dense" or tokens[0] in chosen)]
            if not targets:
                continue
            mass = np.zeros(t)
            for head in range(heads):
                scores = latents[allowed] @ q_lat[q, head] * config.qk_head_dim**-0.5
                mass[allowed] += softmax(scores)
            target = np.array([mass[list(pools[j])].sum() for j in targets])
            target /= target.sum()
            index_scores = np.array([
                sum(weights[q, i] * max(q_idx[q, i] @ pool_keys[j] * hd**-0.5, 0.0) for i in range(nh)) for j in targets
            ])
            log_indexer = index_scores - index_scores.max() - np.log(np.exp(index_scores - index_scores.max()).sum())
            kls.append(float(np.sum(target * (np.log(target) - log_indexer))))
    return np.mean(kls), len(kls)


@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_the_loss_is_its_definition(batch, stage):
    config, params, ids, mask = batch
    _, internals = forward(params, config, ids, mask, return_internals=True, indexer_loss=stage)
    layers = [i for i, t in enumerate(config.layer_types) if t == DSA and "indexer" in params["layers"][i]["attn"]]
    assert layers and all(("indexer_loss" in internals[i]) == (i in layers) for i in range(len(internals)))
    for i in layers:
        want, queries = numpy_indexer_kl(params["layers"][i]["attn"], np.asarray(internals[i]["attention_input"]),
                                         mask.astype(bool), np.asarray(internals[i]["selected"]), config, stage)
        assert queries > 60  # both rows' queries past their first pool
        np.testing.assert_allclose(float(internals[i]["indexer_loss"]), want, rtol=2e-5)


def test_the_stages_differ_only_where_the_selection_is_sparse(batch):
    """At most 35 visible keys every pool is selected (sparse = dense); at 48 the late queries lose pools."""
    config, params, ids, mask = batch
    losses = {}
    for t in (32, 48):
        for stage in ("dense", "sparse"):
            _, internals = forward(params, config, ids[:, :t], mask[:, :t], return_internals=True, indexer_loss=stage)
            losses[t, stage] = float(internals[3]["indexer_loss"])
    assert losses[32, "dense"] == pytest.approx(losses[32, "sparse"], rel=1e-6)
    assert abs(losses[48, "dense"] - losses[48, "sparse"]) > 1e-4 * losses[48, "dense"]


def test_the_layers_gradients_are_bit_identical_with_the_loss_on_and_off(batch):
    """At the full DSA layer: the gradients of its parameters but the indexer's and of its input h
    (all that the rest of the model gets from it) are the same bits with its KL added; the indexer's
    come from the KL alone."""
    config, params, ids, mask = batch
    _, internals = forward(params, config, ids, mask, return_internals=True)
    layer = next(i for i, t in enumerate(config.layer_types) if t == DSA)
    key_valid = jnp.asarray(mask, bool)
    probe = jax.random.normal(jax.random.key(0), internals[layer]["attention_output"].shape)

    def objective(p, h, with_loss):
        y, indices = dsa_layer(p, h, config, key_valid)
        value = jnp.sum(y * probe)
        return value + indexer_kl(p, h, key_valid, indices, config, "sparse") if with_loss else value

    args = (params["layers"][layer]["attn"], internals[layer]["attention_input"])
    off = jax.jit(jax.grad(objective, argnums=(0, 1)), static_argnums=2)(*args, False)
    on = jax.jit(jax.grad(objective, argnums=(0, 1)), static_argnums=2)(*args, True)
    np.testing.assert_array_equal(np.asarray(off[1]), np.asarray(on[1]))
    for (where, a), b in zip(jax.tree_util.tree_leaves_with_path(off[0]), jax.tree.leaves(on[0]), strict=True):
        name = jax.tree_util.keystr(where)
        if "indexer" in name:
            assert not np.any(np.asarray(a)) and np.any(np.asarray(b)), name
        else:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.mark.slow
def test_the_main_gradients_are_bit_identical_with_the_loss_on_and_off(batch):
    """The whole model's gradients, on and off: two compiles of its backward pass, the module's
    slowest, so run with -m slow; the layer's test above checks the same property by default."""
    config, params, ids, mask = batch

    def objective(p, stage):
        logits, internals = forward(p, config, ids, mask, return_internals=True, indexer_loss=stage)
        return train.token_loss(logits, ids, mask) + sum(i["indexer_loss"] for i in internals if "indexer_loss" in i)

    off, on = jax.grad(objective)(params, None), jax.grad(objective)(params, "sparse")
    indexer_leaves = 0
    for (where, a), b in zip(jax.tree_util.tree_leaves_with_path(off), jax.tree.leaves(on), strict=True):
        name = jax.tree_util.keystr(where)
        if "indexer" in name:
            indexer_leaves += 1
            assert not np.any(np.asarray(a)) and np.any(np.asarray(b)), name  # the loss alone reaches them
        else:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    assert indexer_leaves >= 14


def test_the_dense_warm_up_trains_the_indexers_alone(batch):
    config, _, ids, mask = batch
    _, params = load_checkpoint(SHIPPED, "float32", form="train")
    optimizer = optax.adam(3e-3)
    step = jax.jit(train.train_step, static_argnames=train.STATIC)
    state = train.init_train_state(params, optimizer)
    losses = []
    for _ in range(12):
        state, metrics = step(state, ids, mask, config=config, optimizer=optimizer, indexer_loss="dense",
                              router_bias_rate=1e-3)
        losses.append(float(metrics["indexer_loss"]))
    assert losses[-1] < 0.5 * losses[0], losses
    for (where, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(state.params), strict=True):
        moved = not np.array_equal(np.asarray(a), np.asarray(b))
        assert moved == ("indexer" in jax.tree_util.keystr(where)), jax.tree_util.keystr(where)


def test_a_bad_stage_is_named(batch):
    config, params, ids, mask = batch
    with pytest.raises(InputError, match="indexer_loss must be None or one of"):
        forward(params, config, ids, mask, indexer_loss="warmup")
