"""Config from transformers' config.json: layouts, defaults, aliases and clear errors; the published
config.json and quantization_config read as transformers reads them."""

import dataclasses
import json
import logging
import os
import re

import pytest
from conftest import ROOT, SHIPPED

from glm5next_jax import Config, InputError
from glm5next_jax.config import DSA, IGNORED_FIELDS, KDA, REQUIRED_VALUES
from glm5next_jax.quantization import QuantizationConfig


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


PUBLISHED = os.path.join(ROOT, "tests", "model", "fixtures", "GLM-5.3-Flash.config.json")


def published(**text_changes):
    """The published config.json as a dict, with changes to its text_config (None: the field removed)."""
    raw = json.load(open(PUBLISHED))
    for name, value in text_changes.items():
        if value is None:
            raw["text_config"].pop(name)
        else:
            raw["text_config"][name] = value
    return raw


def release_golden(goldens):
    return json.load(open(os.path.join(goldens, "release", "config.json")))


def test_the_published_config_reads_as_transformers_reads_it(goldens):
    """Every field, layer by layer, as transformers 5.23 reads the published file (legacy layer types
    and linear_attn_config included)."""
    ours, theirs = Config.from_hf(PUBLISHED), release_golden(goldens)["text_config"]
    for field in dataclasses.fields(Config):
        value = getattr(ours, field.name)
        want = theirs[field.name]
        assert (list(value) if isinstance(value, tuple) else value) == want, field.name
    assert ours.qk_head_dim == theirs["qk_head_dim"]
    assert ours.layer_types.count(DSA) == 11 and ours.index_kpool == 4 and ours.num_nextn_predict_layers == 1


def test_every_layer_type_spelling_that_transformers_runs_is_read_as_it_reads_it(goldens):
    """transformers' forward runs linear_attention and indexed_attention layers (its mask mapping has
    those two); every spelling its config turns into one of them reads the same here, the rest is
    refused naming it."""
    for spelling, as_read in release_golden(goldens)["layer_types"].items():
        def make():
            return Config(num_hidden_layers=1, layer_types=(spelling,), mlp_layer_types=("dense",), indexer_types=("full",))
        if as_read in (KDA, DSA):
            assert make().layer_types == (as_read,), spelling
        else:
            with pytest.raises(InputError, match=f"unknown values \\['{spelling}'\\]"):
                make()


@pytest.mark.parametrize("name", sorted(REQUIRED_VALUES))
def test_a_field_asking_for_another_model_is_refused_by_name(name):
    value, _ = REQUIRED_VALUES[name]
    other = (not value) if isinstance(value, bool) else value + "_other"
    with pytest.raises(InputError, match=rf"{name} = {other!r} is not supported"):
        Config.from_hf(published(**{name: other}))


@pytest.mark.parametrize("changes, message", [
    (dict(linear_attn_config=dict(published()["text_config"]["linear_attn_config"],
                                  kda_layers=[i + 1 for i in published()["text_config"]["linear_attn_config"]["kda_layers"]])),
     r"linear_attn_config.kda_layers \[1, 2, 3, 5, .*\] \(0-based\) contradicts layer_types, whose linear_attention layers "
     r"are \[0, 1, 2, 4, "),
    (dict(linear_attn_config={"full_attn_layers": [3, 7]}),
     r"full_attn_layers \[3, 7\] .* indexed_attention layers are \[3, 7, 11"),
    (dict(first_k_dense_replace=5), r"first_k_dense_replace = 5 contradicts mlp_layer_types, whose dense layers are \[0, 1, 2\]"),
    (dict(first_k_dense_replace=1, mlp_layer_types=None),
     r"first_k_dense_replace = 1 contradicts mlp_layer_types \(transformers' default\), whose dense layers are \[0, 1, 2\]"),
    (dict(qk_head_dim=192), r"qk_head_dim = 192 contradicts qk_nope_head_dim \+ qk_rope_head_dim = 256 \+ 0"),
])
def test_a_field_contradicting_another_is_refused_naming_both(changes, message):
    with pytest.raises(InputError, match=message):
        Config.from_hf(published(**changes))


def test_every_published_field_is_known_and_each_ignored_one_documented(caplog):
    with caplog.at_level(logging.WARNING, logger="glm5next_jax"):
        Config.from_hf(PUBLISHED)
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    with caplog.at_level(logging.WARNING, logger="glm5next_jax"):
        Config.from_hf(published(rope_interleave_everything=True))
    assert "rope_interleave_everything" in caplog.records[-1].getMessage()
    docs = open(os.path.join(ROOT, "docs", "config.md")).read()
    assert [name for name in [*REQUIRED_VALUES, *IGNORED_FIELDS] if f"`{name}`" not in docs] == []


def test_the_published_quantization_config_reads_as_transformers_reads_it(goldens):
    golden = release_golden(goldens)
    q = QuantizationConfig.from_hf({"quantization_config": golden["quantization_config"]})
    theirs = golden["quantization"]
    assert list(q.weight_block_size) == theirs["weight_block_size"] and q.activation_scheme == theirs["activation_scheme"]
    assert list(q.modules_to_not_convert) == theirs["modules_to_not_convert"]
    assert QuantizationConfig.from_hf(published()) is None
    skip = QuantizationConfig(modules_to_not_convert=tuple(golden["skip_patterns"]))
    assert {m: not skip.not_converted(m) for m in golden["converted"]} == golden["converted"]


@pytest.mark.parametrize("field, value", [
    ("quant_method", "awq"), ("fmt", "e5m2"), ("weight_block_size", [64, 64]), ("activation_scheme", "static"),
    ("scale_fmt", "ue8m0"), ("expert_dtype", "fp4"), ("modules_to_convert", ["model.language_model.embed_tokens"]),
])
def test_a_quantization_other_than_the_releases_is_refused_by_name(field, value):
    q = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic", field: value}
    with pytest.raises(InputError, match=rf"quantization_config.{field} = {re.escape(repr(value))} is not supported"):
        QuantizationConfig.from_hf({"quantization_config": q})
