"""Checkpoint loading: both namings, absorption, dtypes, and one clear error for every problem."""

import json
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SHIPPED, load_model
from safetensors.numpy import save_file

import glm5next_jax
from glm5next_jax.checkpoint import TensorFiles, absorb_o, absorb_q, plan_load
from glm5next_jax.params import param_shapes


def test_structure_matches_param_shapes():
    config, params = load_model(SHIPPED, "bfloat16")
    want = param_shapes(config, "bfloat16")
    assert jax.tree.structure(params) == jax.tree.structure(want)
    for got, spec in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
        assert got.shape == spec.shape and got.dtype == spec.dtype


def test_release_and_in_memory_namings_load_identically(goldens):
    _, release = load_model(SHIPPED, "float32")
    _, in_memory = load_model(os.path.join(goldens, "models", "shipped-inmemory"), "float32")
    for a, b in zip(jax.tree.leaves(release), jax.tree.leaves(in_memory)):
        np.testing.assert_array_equal(a, b)


def test_fp32_islands_in_a_bf16_load():
    _, params = load_model(SHIPPED, "bfloat16")
    kda, dsa, moe = params["layers"][0]["attn"], params["layers"][3]["attn"], params["layers"][3]["mlp"]
    for x in (kda["conv"], kda["dt_bias"], kda["A_log"], dsa["indexer"]["ape"], moe["router"], moe["router_bias"],
              params["layers"][0]["attn_hc"]["fn"], params["layers"][0]["attn_hc"]["base"]):
        assert x.dtype == jnp.float32
    assert kda["qkv_proj"].dtype == dsa["q_absorb"].dtype == jnp.bfloat16


def test_indexer_head_weights_prescaled():
    config, params = load_model(SHIPPED, "float32")
    raw = TensorFiles(SHIPPED).get("model.language_model.layers.3.self_attn.indexer.weights_proj.weight")
    np.testing.assert_allclose(params["layers"][3]["attn"]["indexer"]["weights_proj"],
                               raw.astype(np.float32).T * config.index_n_heads**-0.5, rtol=1e-6)


def test_absorbed_attention_equals_the_expanded_form():
    """softmax(q k) v through q_b/kv_b/o_proj equals the latent form through q_absorb/o_absorb."""
    config, _ = load_model(SHIPPED, "float32")
    files = TensorFiles(SHIPPED)
    get = lambda n: files.get(f"model.language_model.layers.3.self_attn.{n}.weight").astype(np.float64)  # noqa: E731
    q_b, kv_b, o_proj = get("q_b_proj"), get("kv_b_proj"), get("o_proj")
    h, nope, v, r = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim, config.kv_lora_rank
    rng = np.random.default_rng(0)
    q_resid, latents = rng.standard_normal((5, q_b.shape[1])), rng.standard_normal((7, r))
    kv = (latents @ kv_b.T).reshape(7, h, nope + v)
    q = (q_resid @ q_b.T).reshape(5, h, nope)
    p = jax.nn.softmax(np.einsum("qhd,khd->hqk", q, kv[..., :nope]) * nope**-0.5, axis=-1)
    expanded = np.einsum("hqk,khd->qhd", p, kv[..., nope:]).reshape(5, h * v) @ o_proj.T
    q_lat = (q_resid @ absorb_q(q_b, kv_b, config)).reshape(5, h, r)
    p_lat = jax.nn.softmax(np.einsum("qhr,kr->hqk", q_lat, latents) * nope**-0.5, axis=-1)
    latent = np.einsum("hqk,kr->qhr", p_lat, latents).reshape(5, h * r) @ absorb_o(o_proj, kv_b, config)
    np.testing.assert_allclose(latent, expanded, rtol=1e-9, atol=1e-12)


def _copy_checkpoint(tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(SHIPPED, dst)
    return dst


def _add_tensors(path, tensors):
    save_file(tensors, str(path / "extra.safetensors"))
    index = json.load(open(path / "model.safetensors.index.json"))
    index["weight_map"].update({k: "extra.safetensors" for k in tensors})
    json.dump(index, open(path / "model.safetensors.index.json", "w"))


def test_one_error_lists_missing_unexpected_and_misshaped(tmp_path):
    path = _copy_checkpoint(tmp_path)
    index = json.load(open(path / "model.safetensors.index.json"))
    del index["weight_map"]["model.language_model.layers.0.self_attn.b_proj.weight"]
    norm = "model.language_model.layers.1.input_layernorm.weight"
    index["weight_map"].pop(norm)
    json.dump(index, open(path / "model.safetensors.index.json", "w"))
    _add_tensors(path, {"model.language_model.layers.0.self_attn.surprise": np.zeros(3, np.float32),
                        norm: np.zeros(7, np.float32)})
    with pytest.raises(ValueError) as err:
        glm5next_jax.load_checkpoint(path)
    text = str(err.value)
    assert "3 problems" in text
    assert "missing: model.language_model.layers.0.self_attn.b_proj.weight" in text
    assert "unexpected: model.language_model.layers.0.self_attn.surprise" in text
    assert "mis-shaped: model.language_model.layers.1.input_layernorm.weight: expected (128,), found (7,)" in text


def test_vision_tower_and_mtp_layer_skipped_with_one_log_line(tmp_path, caplog):
    path = _copy_checkpoint(tmp_path)
    _add_tensors(path, {"model.language_model.layers.8.eh_proj.weight": np.zeros((2, 2), np.float32),
                        "model.language_model.layers.8.shared_head.norm.weight": np.zeros(2, np.float32)})
    with caplog.at_level(logging.INFO, logger="glm5next_jax"):
        glm5next_jax.load_checkpoint(path, "float32")
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 1 and "vision tower" in lines[0] and "MTP layer 8 (2)" in lines[0]


def test_the_mtp_layers_the_config_names_are_skipped_and_a_layer_past_them_is_unexpected(tmp_path):
    path = _copy_checkpoint(tmp_path)
    config = json.load(open(path / "config.json"))
    config["text_config"]["num_nextn_predict_layers"] = 1
    json.dump(config, open(path / "config.json", "w"))
    _add_tensors(path, {"model.language_model.layers.8.eh_proj.weight": np.zeros((2, 2), np.float32),
                        "model.language_model.layers.9.eh_proj.weight": np.zeros((2, 2), np.float32)})
    plan = plan_load(path)
    assert plan.skipped["MTP layer 8"] == ["model.language_model.layers.8.eh_proj.weight"]
    assert plan.problems == ["unexpected: model.language_model.layers.9.eh_proj.weight"]


def test_bad_arguments():
    with pytest.raises(ValueError, match="dtype must be float32 or bfloat16"):
        glm5next_jax.load_checkpoint(SHIPPED, "float16")
    with pytest.raises(FileNotFoundError):
        glm5next_jax.load_checkpoint("/nonexistent/checkpoint")
