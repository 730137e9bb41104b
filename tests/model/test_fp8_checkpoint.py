"""The FP8 tiny checkpoint (checkpoints/glm5next-tiny-fp8, the release's block-scaled FP8 format, made
with transformers) against transformers' reading of it: the format, the modules transformers makes
FP8, its dequantized weights bit for bit, and the model on those weights against its logits and
greedy generation (the weights dequantized here with pallas_kernels.block_fp8 and loaded as float32)."""

import json
import os

import numpy as np
import pytest
import safetensors.numpy
from conftest import FP8, golden_case, golden_layer, load_model, record, relative_error, release_fp8_weights

import glm5next_jax
from pallas_kernels import block_fp8

FP32_TOLERANCE = 1e-4


def fp8_module(name):
    """transformers' module of a float8 weight: the experts are one module (FP8Experts)."""
    module = name.removesuffix(".weight")
    return module.split(".experts.")[0] + ".experts" if ".experts." in module else module


def dequantized(files, name):
    return np.asarray(block_fp8.dequantize_blocks(files.get(name), files.get(name + "_scale_inv")))


def test_the_fp8_checkpoint_converts_what_the_release_converts():
    """The dense MLP, the experts and shared expert of each MoE layer, and the DSA layer's q_a, q_b, kv_a
    and o projections are float8; the KDA layers (their o_proj too), kv_b, the indexer, the routers,
    embeddings and lm_head are not."""
    fp8, _ = release_fp8_weights(FP8)
    layer = "model.language_model.layers."
    mlp = ("gate_proj", "up_proj", "down_proj")
    want = [f"{layer}0.mlp.{p}.weight" for p in mlp]
    for i in (1, 2, 3):
        want += [f"{layer}{i}.mlp.{e}.{p}.weight" for e in [*(f"experts.{j}" for j in range(8)), "shared_experts"] for p in mlp]
    want += [f"{layer}3.self_attn.{p}.weight" for p in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")]
    assert fp8 == sorted(want)


def test_transformers_makes_fp8_exactly_the_float8_modules(goldens):
    """Under the checkpoint's modules_to_not_convert, transformers' FP8 loading (where FP8 runs) makes
    FP8Linear / FP8Experts of exactly the modules whose weights the files store in float8."""
    fp8, _ = release_fp8_weights(FP8)
    assert sorted(golden_layer(goldens, "fp8_weights")["modules"]) == sorted({fp8_module(name) for name in fp8})


def test_dequantized_weights_equal_transformers_bit_for_bit(goldens):
    """block_fp8.dequantize_blocks of each float8 weight and its scales is transformers' float32 weight
    after its dequantizing load, bit for bit."""
    fp8, files = release_fp8_weights(FP8)
    theirs = golden_layer(goldens, "fp8_weights")
    worst = 0.0
    for name in fp8:
        ours = dequantized(files, name)
        assert ours.dtype == theirs[name].dtype == np.float32
        worst = max(worst, float(np.abs(ours - theirs[name]).max()))
        assert np.array_equal(ours.view(np.uint32), theirs[name].view(np.uint32)), name
    record("fp8 tiny: max |dequantize_blocks - transformers' dequantized weight|", worst)


@pytest.fixture(scope="module")
def dequantized_checkpoint(tmp_path_factory):
    """The FP8 checkpoint with each float8 weight dequantized (block_fp8) and every tensor float32, one
    file, config.json without quantization_config: what the checkpoint holds, in a form the loader reads."""
    fp8, files = release_fp8_weights(FP8)
    scales = {name + "_scale_inv" for name in fp8}
    tensors = {name: dequantized(files, name) if name in fp8 else files.get(name).astype(np.float32)
               for name in files.names() if name not in scales}
    path = tmp_path_factory.mktemp("fp8-dequantized")
    safetensors.numpy.save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(FP8, "config.json")) as f:
        config = json.load(f)
    del config["quantization_config"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


@pytest.mark.parametrize("case", ["fp8_left_pad", "fp8_right_pad"])
def test_logits_on_the_dequantized_weights_match_transformers(goldens, dequantized_checkpoint, case):
    """fp32 forward on the checkpoint's dequantized weights within 1e-4 of transformers' logits (100-token
    rows: DSA sparse)."""
    data = golden_case(goldens, case)
    assert str(data["model"]) == "fp8"
    config, params = load_model(dequantized_checkpoint, "float32")
    logits = glm5next_jax.forward(params, config, data["ids"], data["mask"])
    error = record(f"fp32 {case} (dequantized weights)", relative_error(logits, data["logits"], data["mask"].astype(bool)))
    assert error < FP32_TOLERANCE


def test_greedy_generation_on_the_dequantized_weights_matches_transformers(goldens, dequantized_checkpoint):
    """32 greedy tokens for 2 prompts of different lengths, identical to transformers' generate on its
    dequantizing load."""
    config, params = load_model(dequantized_checkpoint, "float32")
    data = golden_case(goldens, "fp8_generate")
    prompts = [row[m.astype(bool)].tolist() for row, m in zip(data["ids"], data["mask"])]
    out = glm5next_jax.generate(params, config, prompts, 32, latent_dtype="float32")
    np.testing.assert_array_equal(np.array(out.tokens), data["new_tokens"])
