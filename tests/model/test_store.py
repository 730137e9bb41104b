"""Orbax: bit-exact round trips of params and caches, restored onto a given sharding."""

import jax
import numpy as np
from conftest import SHIPPED, load_model

import glm5next_jax
from glm5next_jax.cache import cache_axes
from glm5next_jax.sharding import make_layout, param_shardings
from glm5next_jax.store import restore_cache, restore_params, save_cache, save_params


def assert_identical(a_tree, b_tree):
    assert jax.tree.structure(a_tree) == jax.tree.structure(b_tree)
    for a, b in zip(jax.tree.leaves(a_tree), jax.tree.leaves(b_tree)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_params_round_trip_onto_a_sharding(tmp_path):
    config, params = load_model(SHIPPED, "bfloat16")
    save_params(tmp_path / "ckpt", params, config)
    restored_config, restored = restore_params(tmp_path / "ckpt", shardings=param_shardings(config, make_layout("3d")))
    assert restored_config == config
    assert_identical(params, restored)
    leaf = restored["layers"][4]["mlp"]["experts_gate_up"]
    assert leaf.sharding.mesh.axis_names == ("data", "expert", "model")


def test_fp8_cache_round_trip(tmp_path):
    config, params = load_model(SHIPPED, "bfloat16")
    cache = glm5next_jax.init_cache(config, 2, 64, latent_dtype="float8_e4m3fn", page_size=16)
    _, cache = glm5next_jax.prefill(params, config, np.arange(2, 42).reshape(2, 20), None, cache)
    save_cache(tmp_path / "cache", cache)
    assert_identical(cache, restore_cache(tmp_path / "cache"))
    shardings = make_layout("3d").shardings(cache_axes(cache))
    assert_identical(cache, restore_cache(tmp_path / "cache", shardings=shardings))
