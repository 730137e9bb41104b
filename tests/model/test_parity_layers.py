"""Each layer alone against its transformers module (fp32), on the goldens' random inputs."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import golden_layer, record, relative_error

from glm5next_jax import Config
from glm5next_jax.checkpoint import ArraySource, Reader, read_dense_mlp, read_dsa, read_hc, read_kda, read_moe
from glm5next_jax.layers import common, hyper, kda, mlp
from glm5next_jax.layers.dsa import dsa_layer, indexer_select
from pallas_kernels import kda as kda_core

TOLERANCE = 1e-4
BF16_TOLERANCE = 2e-2
BF16 = jnp.bfloat16


def layer(goldens, name):
    data = golden_layer(goldens, name)
    config = Config.from_hf(json.loads(str(data["config"])))
    return data, config


def params_of(data, read, dtype=jnp.float32):
    """Our parameters from the module's state dict, through the checkpoint converters."""
    reader = Reader(ArraySource({k: v for k, v in data.items() if "." in k}))
    params = read(reader)
    assert not reader.problems(), reader.problems()
    return jax.tree.map(lambda x: jnp.asarray(x, dtype), params)


def check(case, got, want, where=None, tolerance=TOLERANCE):
    error = record(f"layer {case}", relative_error(got, want, where))
    assert error < tolerance


def test_rms_norm(goldens):
    data, config = layer(goldens, "rms_norm")
    check("rms_norm", common.rms_norm(data["x"], data["weight"], config.rms_norm_eps), data["y"])


def test_layer_norm(goldens):
    data, _ = layer(goldens, "layer_norm")
    check("layer_norm", common.layer_norm(data["x"], data["weight"], data["bias"], 1e-6), data["y"])


def test_dense_mlp_with_clamps(goldens):
    data, config = layer(goldens, "dense_mlp")
    p = params_of(data, lambda r: read_dense_mlp(r, "mlp.", config, config.intermediate_size))
    gate_up = np.einsum("btd,dgi->btgi", data["x"], np.asarray(p["gate_up"]))
    assert (gate_up[..., 0, :] > config.swiglu_limit).any() and (np.abs(gate_up[..., 1, :]) > config.swiglu_limit).any()
    check("dense_mlp", mlp.dense_mlp(p, jnp.asarray(data["x"]), config), data["y"])


@pytest.mark.parametrize("name", ["moe", "moe_groups"])
def test_moe(goldens, name):
    data, config = layer(goldens, name)
    p = params_of(data, lambda r: read_moe(r, "", config))
    x = jnp.asarray(data["x"])
    weights, experts = mlp.route(p, x.reshape(-1, x.shape[-1]), config)
    want_experts = data["route_experts"].reshape(experts.shape)
    np.testing.assert_array_equal(np.sort(experts, -1), np.sort(want_experts, -1))
    order, want_order = np.argsort(experts, -1), np.argsort(want_experts, -1)
    check(f"{name} route weights", np.take_along_axis(np.asarray(weights), order, -1),
          np.take_along_axis(data["route_weights"].reshape(weights.shape), want_order, -1))
    check(name, mlp.moe(p, x, config), data["y"])


def test_group_limited_routing_changes_the_choice(goldens):
    """With n_group > 1 the selection differs from plain top-k on the same scores (the groups bind)."""
    data, config = layer(goldens, "moe_groups")
    p = params_of(data, lambda r: read_moe(r, "", config))
    x = jnp.asarray(data["x"]).reshape(-1, config.hidden_size)
    _, grouped = mlp.route(p, x, config)
    _, ungrouped = mlp.route(p, x, config.replace(n_group=1, topk_group=1))
    assert (np.sort(grouped, -1) != np.sort(ungrouped, -1)).any(axis=-1).mean() > 0.1


def test_hyper_connection_mapping(goldens):
    data, config = layer(goldens, "hc")
    p = params_of(data, lambda r: read_hc(r, "", "attn", config))
    streams = jnp.asarray(data["streams"])
    pre, post, comb = hyper.mapping(p, streams, config)
    check("hc post", post, data["post"])
    check("hc comb", comb, data["comb"])
    check("hc collapse", hyper.collapse(pre, streams), data["collapsed"])
    np.testing.assert_allclose(np.asarray(comb).sum(-1), 1.0, atol=1e-3)  # doubly stochastic
    np.testing.assert_allclose(np.asarray(comb).sum(-2), 1.0, atol=1e-3)


def test_hyper_connection_bf16_streams_are_mapped_as_in_fp32(goldens):
    """bf16 streams take the projection as (streams @ fn's three bf16 pieces) / rms: the fp32 path's
    numbers, on the same values, up to the order of fp32 roundings (a bf16 fn would be off by ~4e-3)."""
    data, config = layer(goldens, "hc")
    p = params_of(data, lambda r: read_hc(r, "", "attn", config))
    streams = jnp.asarray(data["streams"], BF16)
    fp32 = hyper.mapping(p, streams.astype(jnp.float32), config)
    for name, got, want in zip(("pre", "post", "comb"), hyper.mapping(p, streams, config), fp32):
        assert got.dtype == jnp.float32
        assert relative_error(got, want) < 2e-6, name


def test_hyper_connection_sinkhorn_is_unrolled_off_the_cpu(goldens):
    """On the GPU a rolled loop is a while loop with a host round trip per iteration (152 a decode
    step, bench/RESULTS.md); lowered for CUDA the mapping has none, for the CPU one."""
    data, config = layer(goldens, "hc")
    p = params_of(data, lambda r: read_hc(r, "", "attn", config))
    traced = jax.jit(lambda p, x: hyper.mapping(p, x, config)).trace(p, jnp.asarray(data["streams"]))
    loops = {platform: traced.lower(lowering_platforms=(platform,)).as_text().count("stablehlo.while")
             for platform in ("cuda", "cpu")}
    assert loops == {"cuda": 0, "cpu": 1}, loops


def test_hyper_connection_weights_leave_the_mapping_through_a_barrier(goldens):
    """Fused on into expand's and the projection's element-wise code, the unrolled Sinkhorn grows
    XLA:GPU fusions whose tiling priority fusion searches again at every step: the decode step takes
    398 s to compile for an H200 target, 44 s with pre, post and comb behind an optimization barrier
    (bench/RESULTS.md). Lowered for CUDA, the mapping's three results are the barrier's."""
    data, config = layer(goldens, "hc")
    p = params_of(data, lambda r: read_hc(r, "", "attn", config))
    text = jax.jit(lambda p, x: hyper.mapping(p, x, config)).trace(p, jnp.asarray(data["streams"])).lower(
        lowering_platforms=("cuda",)).as_text()
    barrier = re.search(r"(%\S+):3 = stablehlo.optimization_barrier", text)
    assert barrier, "no three-result optimization barrier in the mapping"
    returned = re.search(r"return (\S+), (\S+), (\S+) :", text.split("func.func public @main")[1])
    assert returned and returned.groups() == tuple(f"{barrier.group(1)}#{i}" for i in range(3)), returned


@pytest.mark.parametrize("name", ["kda_core", "kda_core_short"])
def test_kda_core_chunked_and_recurrent(goldens, name):
    data, _ = layer(goldens, name)
    args = [jnp.asarray(data[k]) for k in ("q", "k", "v", "g", "beta")]
    o, s = kda_core.kda_chunk_scan(*args, initial_state=jnp.asarray(data["s0"]))
    check(f"{name} chunk out", o, data["o_chunk"])
    check(f"{name} chunk state", s, data["s_chunk"])
    o, s = kda_core.kda_recurrent(*args, initial_state=jnp.asarray(data["s0"]))
    check(f"{name} recurrent out", o, data["o_recurrent"])
    check(f"{name} recurrent state", s, data["s_recurrent"])


@pytest.mark.parametrize("name", ["kda_layer", "kda_layer_unmasked"])
def test_kda_layer(goldens, name):
    data, config = layer(goldens, name)
    p = params_of(data, lambda r: read_kda(r, "", config))
    mask = jnp.asarray(data["mask"]) if "mask" in data else None
    y = kda.kda_layer(p, jnp.asarray(data["h"]), config, mask)
    check(name, y, data["y"], None if mask is None else np.asarray(mask))


def _selected_sets(indices):
    return [[frozenset(int(i) for i in row if i >= 0) for row in seq] for seq in np.asarray(indices)]


@pytest.mark.parametrize("name", ["dsa_layer", "dsa_layer_kpool16"])
def test_dsa_indexer_selects_the_same_sets(goldens, name):
    data, config = layer(goldens, name)
    p = params_of(data, lambda r: read_dsa(r, "", config, 3))
    h, mask = jnp.asarray(data["h"]), jnp.asarray(data["mask"])
    q_resid = common.rms_norm(common.linear(h, p["q_a_proj"]), p["q_a_norm"], config.rms_norm_eps)
    indices = indexer_select(p["indexer"], h, q_resid, mask, config)
    assert indices.shape == data["topk"].shape == (*h.shape[:2], config.select_width)
    got, want = _selected_sets(indices), _selected_sets(data["topk"])
    mismatched = [(b, t) for b in range(len(got)) for t in range(len(got[b])) if got[b][t] != want[b][t]]
    assert not mismatched, f"{len(mismatched)} query rows select different tokens, first {mismatched[:5]}"
    # The case is really sparse: some queries see more tokens than they select.
    assert max(len(s) for seq in want for s in seq) < int(np.asarray(mask).sum(-1).max())


@pytest.mark.parametrize("name", ["dsa_layer", "dsa_layer_kpool16"])
def test_dsa_layer(goldens, name):
    data, config = layer(goldens, name)
    p = params_of(data, lambda r: read_dsa(r, "", config, 3))
    y, _ = dsa_layer(p, jnp.asarray(data["h"]), config, jnp.asarray(data["mask"]))
    check(name, y, data["y"], np.asarray(data["mask"]))


# ---- bf16: params and activations in bf16 against the fp32 goldens ----------------------------


def test_bf16_smooth_layers(goldens):
    data, config = layer(goldens, "dense_mlp")
    p = params_of(data, lambda r: read_dense_mlp(r, "mlp.", config, config.intermediate_size), BF16)
    check("bf16 dense_mlp", mlp.dense_mlp(p, jnp.asarray(data["x"], BF16), config), data["y"], tolerance=BF16_TOLERANCE)
    data, config = layer(goldens, "hc")
    p = params_of(data, lambda r: read_hc(r, "", "attn", config), BF16)
    streams = jnp.asarray(data["streams"], BF16)
    pre, post, comb = hyper.mapping(p, streams, config)
    check("bf16 hc comb", comb, data["comb"], tolerance=BF16_TOLERANCE)
    check("bf16 hc collapse", hyper.collapse(pre, streams), data["collapsed"], tolerance=BF16_TOLERANCE)
    data, config = layer(goldens, "kda_layer")
    p = params_of(data, lambda r: read_kda(r, "", config), BF16)
    y = kda.kda_layer(p, jnp.asarray(data["h"], BF16), config, jnp.asarray(data["mask"]))
    check("bf16 kda_layer", y, data["y"], data["mask"], tolerance=BF16_TOLERANCE)
    data, _ = layer(goldens, "kda_core")
    qkv = [jnp.asarray(data[k], BF16) for k in ("q", "k", "v")]
    o, s = kda_core.kda_chunk_scan(*qkv, jnp.asarray(data["g"]), jnp.asarray(data["beta"], BF16), jnp.asarray(data["s0"]))
    check("bf16 kda_core out", o, data["o_chunk"], tolerance=BF16_TOLERANCE)
    check("bf16 kda_core state", s, data["s_chunk"], tolerance=BF16_TOLERANCE)


def test_bf16_moe_where_routing_agrees(goldens):
    data, config = layer(goldens, "moe")
    p = params_of(data, lambda r: read_moe(r, "", config), BF16)
    x = jnp.asarray(data["x"], BF16)
    _, experts = mlp.route(p, x.reshape(-1, config.hidden_size), config)
    same = (np.sort(experts, -1) == np.sort(data["route_experts"], -1)).all(-1).reshape(x.shape[:2])
    record("bf16 moe: share of tokens routed as in fp32", float(same.mean()))
    assert same.mean() > 0.9
    check("bf16 moe (tokens routed alike)", mlp.moe(p, x, config), data["y"], same, tolerance=BF16_TOLERANCE)


def test_bf16_dsa_where_selection_agrees(goldens):
    data, config = layer(goldens, "dsa_layer")
    p = params_of(data, lambda r: read_dsa(r, "", config, 3), BF16)
    mask = jnp.asarray(data["mask"])
    y, indices = dsa_layer(p, jnp.asarray(data["h"], BF16), config, mask)
    got, want = _selected_sets(indices), _selected_sets(data["topk"])
    same = np.array([[g == w for g, w in zip(gs, ws)] for gs, ws in zip(got, want)]) & np.asarray(mask)
    record("bf16 dsa: share of queries selecting as in fp32", float(same.sum() / np.asarray(mask).sum()))
    assert same.sum() > 0.9 * np.asarray(mask).sum()
    # A query's output also depends on earlier queries only through the keys, which bf16 does not
    # select differently, so rows with the same selection are comparable on their own.
    check("bf16 dsa_layer (queries selecting alike)", y, data["y"], same, tolerance=BF16_TOLERANCE)


def test_pallas_scan_only_for_bounded_gates():
    """The Pallas scan is exact for gates >= MIN_GATE: unbounded (softplus) gates stay on the reference."""
    bounded, unbounded = Config(), Config(linear_lower_bound=None)
    assert kda.scan_implementation(bounded, None) is None and kda.scan_implementation(bounded, "pallas") == "pallas"
    assert kda.scan_implementation(unbounded, None) == "reference"
    with pytest.raises(ValueError, match="use implementation='reference'"):
        kda.scan_implementation(unbounded, "pallas")
