"""LoRA (glm5next_jax/lora.py): our adapted forward and merged model against PEFT's reading of the
adapter folder we write (transformers + peft in the reference env), the adapters' gradients against
the chain rule through the full weights' gradients, the LoRA step (the base frozen, the optimizer's
state the adapters' alone), the routed experts' adapters over the grouped GEMM's tiles through the
kernel in Pallas' interpreter, and the errors."""

import json
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import FP8, KERNELS, REFERENCE_PYTHON, ROOT, SHIPPED

from glm5next_jax import forward, load_checkpoint, lora, train
from glm5next_jax.errors import InputError
from glm5next_jax.layers import mlp

SPEC = lora.LoraSpec(rank=4, alpha=8.0)


def random_adapters(params, config, spec, seed, b_scale=0.05):
    """Adapters with both factors drawn (a fresh adapter's B is zero, which would test nothing)."""
    adapters = lora.init_adapters(params, config, spec, jax.random.key(seed))
    keys = iter(jax.random.split(jax.random.key(seed + 1), len(jax.tree.leaves(adapters))))
    return jax.tree.map(lambda ad: lora.Adapter(ad.a, b_scale * jax.random.normal(next(keys), ad.b.shape, ad.b.dtype)),
                        adapters, is_leaf=lambda x: isinstance(x, lora.Adapter))


@pytest.fixture(scope="module")
def shipped():
    return load_checkpoint(SHIPPED, "float32", form="train", progress=False)


def relative(got, want):
    return float(np.linalg.norm(np.asarray(got) - want) / np.linalg.norm(want))


def test_adapted_and_merged_logits_equal_peft(shipped, tmp_path):
    """The adapter folder we write, read by PEFT onto transformers' fp32 model: its adapted logits
    equal our adapted forward (the adapters' products beside the frozen weights) and its
    `merge_and_unload` logits our merged model's, within 2e-5 (3e-6 measured), while the adapters
    move the logits by over 50%; reading the folder back gives the adapters exactly."""
    config, params = shipped
    adapters = random_adapters(params, config, SPEC, seed=1)
    folder = os.path.join(tmp_path, "adapter")
    lora.save_adapters(folder, adapters, config, SPEC, base_model=SHIPPED)
    ids = np.random.default_rng(0).integers(2, config.vocab_size, (2, 40))
    np.save(os.path.join(tmp_path, "ids.npy"), ids)
    out = os.path.join(tmp_path, "peft.npz")
    subprocess.run([REFERENCE_PYTHON, os.path.join(ROOT, "tests", "reference", "peft_logits.py"), SHIPPED, folder,
                    os.path.join(tmp_path, "ids.npy"), out], check=True, capture_output=True)
    theirs = np.load(out)
    expected = {f"base_model.model.{lora.LAYER_PREFIX}{i}.{name}"
                for i in range(config.num_hidden_layers) for name in set(lora._peft_modules(config, SPEC, i).values())}
    assert set(theirs["wrapped"]) >= expected  # every adapter we wrote was applied (the experts' wrappers nest)

    adapted = forward(train.inference_params(lora.attach(params, adapters, SPEC), config), config, ids)
    merged = forward(train.inference_params(lora.merge(params, adapters, SPEC), config), config, ids)
    assert relative(theirs["adapted"], theirs["base"]) > 0.5
    assert relative(adapted, theirs["adapted"]) < 2e-5
    assert relative(merged, theirs["merged"]) < 2e-5

    read, spec = lora.load_adapters(folder, params, config)
    assert spec.rank == SPEC.rank and spec.alpha == SPEC.alpha and set(spec.targets) == set(SPEC.targets)
    for (where, got), want in zip(jax.tree_util.tree_leaves_with_path(read), jax.tree.leaves(adapters), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=jax.tree_util.keystr(where))


@pytest.mark.slow  # two whole-model gradients to compile (57 s here); the LoRA step's training is in the default run
def test_adapter_gradients_are_the_chain_rule_of_the_weights(shipped):
    """d loss / d A and d B through the adapted forward equal s G B^T and s A^T G, G the gradient of
    the merged model's weight (per expert for the routed experts, per module of a fused weight)."""
    config, params = shipped
    adapters = random_adapters(params, config, SPEC, seed=3)
    ids = np.random.default_rng(1).integers(2, config.vocab_size, (1, 16))
    mask = np.ones_like(ids)

    def loss(p):
        return train.objective(p, config, ids, mask)[0]

    weight_grads = jax.grad(loss)(lora.merge(params, adapters, SPEC))
    adapter_grads = jax.grad(lambda a: loss(lora.attach(params, a, SPEC)))(adapters)
    hi = jax.lax.Precision.HIGHEST
    for i, layer in enumerate(adapters["layers"]):
        for name, (a, b) in layer.items():
            g = weight_grads["layers"][i]
            for key in name.split("."):
                g = g[key]
            g = g.reshape(*a.shape[:-2], b.shape[-3], b.shape[-1])  # [*experts, in, parts, n]
            want_a = SPEC.scaling * jnp.einsum("...ipn,...prn->...ipr", g, b, precision=hi)
            want_b = SPEC.scaling * jnp.einsum("...ipr,...ipn->...prn", a, g, precision=hi)
            got = adapter_grads["layers"][i][name]
            assert relative(got.a, want_a) < 1e-4, (i, name, "a")
            assert relative(got.b, want_b) < 1e-4, (i, name, "b")


LORA_STEP = jax.jit(train.lora_train_step, static_argnames=train.LORA_STATIC)


def test_lora_step_trains_the_adapters_alone(shipped):
    """15 AdamW steps of rank-8 adapters on one batch cut the loss below a third of its start; the
    optimizer's state holds the adapters' moments only, and a fresh adapter starts as the base."""
    config, params = shipped
    spec = lora.LoraSpec(rank=8, alpha=16.0)
    adapters = lora.init_adapters(params, config, spec, jax.random.key(0))
    ids = np.random.default_rng(2).integers(2, config.vocab_size, (2, 24))
    optimizer = optax.adamw(1e-2)
    state = train.init_train_state(adapters, optimizer)
    assert sum(x.size for x in jax.tree.leaves(state.opt_state)) == 2 * sum(x.size for x in jax.tree.leaves(adapters)) + 1
    base_loss = train.objective(params, config, ids, np.ones_like(ids))[1][0]
    losses = []
    for _ in range(15):
        state, metrics = LORA_STEP(state, params, ids, config=config, spec=spec, optimizer=optimizer)
        losses.append(float(metrics["loss"]))
    assert abs(losses[0] - float(base_loss)) < 1e-5 * float(base_loss)
    assert losses[-1] < losses[0] / 3, losses
    assert int(state.step) == 15


def test_lora_over_the_fp8_release_form():
    """Adapters over the FP8 release form (W8A8 base, inference form: every target but DSA's absorbed
    projections): 10 AdamW steps on one batch cut the loss below a third of its start."""
    config, params = load_checkpoint(FP8, "float32", progress=False)
    spec = lora.LoraSpec(rank=4, alpha=8.0, targets=tuple(t for t in lora.TARGETS
                                                          if t not in ("q_b_proj", "kv_b_proj", "o_proj")))
    optimizer = optax.adamw(1e-2)
    state = train.init_train_state(lora.init_adapters(params, config, spec, jax.random.key(0)), optimizer)
    ids = np.random.default_rng(2).integers(2, config.vocab_size, (2, 24))
    losses = []
    for _ in range(10):
        state, metrics = LORA_STEP(state, params, ids, config=config, spec=spec, optimizer=optimizer)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] / 3, losses


def test_expert_adapters_through_the_grouped_gemm_kernel():
    """The routed experts' adapters over the kernel's tiles (Pallas' interpreter, bf16, 64-row tiles)
    equal the reference path's (one row a tile) and the merged experts' output, within bf16's error,
    with a per-expert A and with one A shared by the experts."""
    config, params = load_checkpoint(KERNELS, "bfloat16", progress=False)
    layer = next(i for i, t in enumerate(config.mlp_layer_types) if t == "sparse")
    p = params["layers"][layer]["mlp"]
    x = jax.random.normal(jax.random.key(4), (1, 48, config.hidden_size), jnp.bfloat16)
    for shared in (False, True):
        spec = lora.LoraSpec(rank=8, alpha=16.0, targets=("experts.gate_up_proj", "experts.down_proj"),
                             shared_expert_a=shared)
        adapters = random_adapters(params, config, spec, seed=5, b_scale=0.5)
        adapted = lora.attach(params, adapters, spec)["layers"][layer]["mlp"]
        merged = lora.merge(params, adapters, spec)["layers"][layer]["mlp"]
        base = mlp.moe(p, x, config, implementation="reference")
        want = mlp.moe(merged, x, config, implementation="reference").astype(jnp.float32)
        reference = mlp.moe(adapted, x, config, implementation="reference").astype(jnp.float32)
        kernel = mlp.moe(adapted, x, config, implementation="pallas", interpret=True).astype(jnp.float32)
        assert relative(want, base.astype(jnp.float32)) > 0.2
        assert relative(reference, want) < 2e-2, shared
        assert relative(kernel, want) < 2e-2, shared


def test_bad_adapters_are_refused(shipped, tmp_path):
    config, params = shipped
    with pytest.raises(InputError, match="target all of them"):
        lora.LoraSpec(rank=4, alpha=8.0, targets=("q_proj",))
    with pytest.raises(InputError, match="rank must be"):
        lora.LoraSpec(rank=0, alpha=8.0)
    _, inference = load_checkpoint(SHIPPED, "float32", progress=False)
    with pytest.raises(InputError, match="absorbed"):
        lora.init_adapters(inference, config, lora.LoraSpec(rank=4, alpha=8.0, targets=("q_b_proj",)), jax.random.key(0))
    with pytest.raises(InputError, match="no adapter_config.json"):
        lora.load_adapters(str(tmp_path), params, config)

    folder = os.path.join(tmp_path, "adapter")
    spec = lora.LoraSpec(rank=2, alpha=4.0, targets=("o_proj",))
    lora.save_adapters(folder, lora.init_adapters(params, config, spec, jax.random.key(0)), config, spec)
    with open(os.path.join(folder, lora.ADAPTER_CONFIG)) as f:
        saved = json.load(f)
    with open(os.path.join(folder, lora.ADAPTER_CONFIG), "w") as f:
        json.dump({**saved, "r": 3}, f)
    with pytest.raises(InputError, match=r"lora_A, lora_B are \(2, 128\), \(128, 2\); this model's are \(3, 128\)"):
        lora.load_adapters(folder, params, config)
    with open(os.path.join(folder, lora.ADAPTER_CONFIG), "w") as f:
        json.dump({**saved, "use_dora": True}, f)
    with pytest.raises(InputError, match="use_dora"):
        lora.load_adapters(folder, params, config)
