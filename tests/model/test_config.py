"""Config from transformers' config.json: layouts, defaults, aliases and clear errors."""

import json

import pytest
from conftest import SHIPPED

from glm5next_jax import Config
from glm5next_jax.config import DSA, KDA


def test_released_defaults():
    c = Config()
    assert c.layer_types[:4] == (KDA, KDA, KDA, DSA) and c.layer_types.count(DSA) == 11
    assert c.mlp_layer_types[:4] == ("dense", "dense", "dense", "sparse")
    assert c.indexer_types == ("full",) * 45
    assert c.select_width == 2048 + 15
    hash(c)  # static argument of jit


def test_from_nested_checkpoint_config():
    c = Config.from_hf(SHIPPED)
    raw = json.load(open(f"{SHIPPED}/config.json"))["text_config"]
    assert c.hidden_size == raw["hidden_size"] and c.layer_types == tuple(raw["layer_types"])
    assert c.eos_token_id == (1,)


def test_flat_dict_aliases_and_linear_attn_config():
    c = Config.from_hf({
        "num_hidden_layers": 4, "layer_types": ["linear_attention", "full_attention"] * 2,
        "linear_attn_config": {"head_dim": 64, "num_heads": 8, "short_conv_kernel_size": 3, "gate_lower_bound": None},
        "num_local_experts": 32, "eos_token_id": [5, 6], "vision_config": {"depth": 2},
    })
    assert c.layer_types == (KDA, DSA, KDA, DSA)
    assert (c.linear_head_dim, c.linear_num_heads, c.linear_conv_kernel_dim) == (64, 8, 3)
    assert c.linear_lower_bound == -5.0  # safe_gate defaults to True
    assert c.n_routed_experts == 32 and c.eos_token_id == (5, 6)


def test_indexer_schedule_from_pattern_and_frequency():
    assert Config.from_hf({"num_hidden_layers": 4, "index_topk_pattern": "FSFS",
                           "layer_types": ["indexed_attention"] * 4}).indexer_types == ("full", "shared", "full", "shared")
    c = Config.from_hf({"num_hidden_layers": 6, "index_topk_freq": 2, "index_skip_topk_offset": 1,
                        "layer_types": ["indexed_attention"] * 6})
    assert c.indexer_types == ("full", "shared", "full", "shared", "full", "shared")


@pytest.mark.parametrize("changes, message", [
    ({"index_topk": 30, "index_kpool": 4}, "divisible by index_kpool"),
    ({"qk_rope_head_dim": 64}, "NoPE"),
    ({"num_key_value_heads": 8}, "num_key_value_heads"),
    ({"n_group": 5}, "divisible by n_group"),
    ({"n_routed_experts": 8, "n_group": 8, "topk_group": 1}, ">= 2 experts"),
    ({"topk_group": 2}, "topk_group"),
    ({"layer_types": ("linear_attention",) * 3}, "layer_types has 3 entries"),
    ({"mlp_layer_types": ("dense", "moe") * 22 + ("dense",)}, "unknown values"),
    ({"index_kpool": 0}, "index_kpool must be positive"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_constraint_violations_raise_clear_errors(changes, message):
    with pytest.raises(ValueError, match=message):
        Config(**changes)


def test_shared_indexer_layer_needs_a_full_dsa_layer_before_it():
    types = ("linear_attention", "indexed_attention", "linear_attention", "indexed_attention")
    with pytest.raises(ValueError, match="layer 3 is a 'shared' DSA layer"):
        Config(num_hidden_layers=4, layer_types=types, indexer_types=("full", "full", "full", "shared"))
    Config(num_hidden_layers=3, layer_types=("linear_attention", DSA, DSA), indexer_types=("full", "full", "shared"))


def test_all_errors_reported_at_once():
    with pytest.raises(ValueError) as err:
        Config(qk_rope_head_dim=64, num_key_value_heads=8)
    assert "NoPE" in str(err.value) and "num_key_value_heads" in str(err.value)
