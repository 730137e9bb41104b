"""The whole model through the Pallas kernels, in Pallas' interpreter, on the checkpoint whose widths
every kernel takes (checkpoints/glm5next-tiny-kernels): `forward`, `prefill` + `decode_step` and
`generate` in bf16 against transformers' fp32 logits and bf16 generation, each asserting which
kernels its program launches.

bf16 bounds are set by transformers' own bf16 run on the same inputs (`bf16_report`): the typical
token's logit error within twice transformers', and the fp32 argmax kept wherever its margin is clear
of transformers' bf16 rounding at that token."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    KERNELS,
    assert_generation_matches,
    bf16_report,
    golden_case,
    load_model,
    record,
    relative_error,
    traced_kernels,
)

import glm5next_jax
from glm5next_jax.cache import init_cache
from glm5next_jax.layers.dsa import dsa_layer_cached

generate_module = importlib.import_module("glm5next_jax.generate")  # the package's `generate` is the function

# What the kernels checkpoint's three layers launch: the KDA scan (intra, then the chain), the full
# DSA layer's selection (candidate scores, top-k), latent attention in both DSA layers, and the
# grouped GEMM twice (gate_up, down) in each of the two MoE layers.
PREFILL_KERNELS = {
    "kda_intra": 1, "kda_chain": 1, "candidate_pool_scores": 1, "top_pools": 1,
    "sparse_latent_attention": 2, "moe_grouped_matmul": 4,
}
# A decode step: the KDA layer's fused step in place of the scan.
DECODE_KERNELS = {
    "kda_decode_step": 1, "candidate_pool_scores": 1, "top_pools": 1, "sparse_latent_attention": 2,
    "moe_grouped_matmul": 4,
}
DECODE_STEPS = 8


@pytest.fixture(scope="module")
def model():
    return load_model(KERNELS, "bfloat16")


def kernel_cache(config, batch, max_len=128):
    return init_cache(config, batch, max_len, latent_dtype="bfloat16", page_size=16)


def test_forward_through_the_kernels(goldens, model):
    config, params = model
    data = golden_case(goldens, "kernels_right_pad")
    run = lambda: glm5next_jax.forward(params, config, data["ids"], data["mask"], interpret=True)  # noqa: E731
    assert traced_kernels(run) == PREFILL_KERNELS
    report = bf16_report(np.asarray(run()), data, data["mask"].astype(bool))
    record("bf16 kernels forward: typical token (ours)", report.ours)
    record("bf16 kernels forward: typical token (transformers bf16)", report.theirs)
    report.check()


def test_prefill_and_decode_steps_through_the_kernels(goldens, model):
    """The left-padded case's first tokens prefilled (the prompt compacted into the paged cache), the
    last DECODE_STEPS fed one at a time: every logit against transformers' fp32 forward."""
    config, params = model
    data = golden_case(goldens, "kernels_left_pad")
    ids, mask = data["ids"], data["mask"]
    head = ids.shape[1] - DECODE_STEPS
    cache = kernel_cache(config, ids.shape[0])
    prefill = lambda: glm5next_jax.prefill(params, config, ids[:, :head], mask[:, :head], cache, interpret=True)  # noqa: E731
    assert traced_kernels(prefill) == PREFILL_KERNELS
    logits, cache = prefill()
    steps = [np.asarray(logits)]
    for i in range(DECODE_STEPS):
        if i == 0:
            step = lambda: glm5next_jax.decode_step(params, config, ids[:, head], cache, interpret=True)  # noqa: E731
            assert traced_kernels(step) == DECODE_KERNELS
        step_logits, cache = glm5next_jax.decode_step(params, config, ids[:, head + i], cache, interpret=True)
        steps.append(np.asarray(step_logits)[:, None])
    np.testing.assert_array_equal(cache["lengths"], mask.sum(1))
    report = bf16_report(np.concatenate(steps, axis=1), data, mask.astype(bool))
    record("bf16 kernels prefill + decode: typical token (ours)", report.ours)
    report.check()


def test_generate_through_the_kernels(goldens, model, monkeypatch):
    """transformers' own bf16 greedy generation, reproduced through the kernels up to each row's first
    step whose choice is within bf16 rounding (where two bf16 implementations may part)."""
    config, params = model
    data = golden_case(goldens, "generate_bf16")
    prompts = [row[m.astype(bool)].tolist() for row, m in zip(data["ids"], data["mask"])]
    launched = {}

    def traced(name, entry):
        def run(*args, **kwargs):
            if name not in launched:  # what generate hands the entry point, traced once
                launched[name] = traced_kernels(lambda: entry(*args, **kwargs))
            return entry(*args, **kwargs)

        monkeypatch.setattr(generate_module, name, run)

    traced("prefill", generate_module.prefill)
    traced("decode_unchecked", generate_module.decode_unchecked)
    new = data["new_tokens"].shape[1]
    out = glm5next_jax.generate(params, config, prompts, new, eos_token_id=[], latent_dtype="bfloat16", interpret=True)
    assert launched == {"prefill": PREFILL_KERNELS, "decode_unchecked": DECODE_KERNELS}
    assert_generation_matches(np.array(out.tokens), data)


def test_dsa_layer_over_an_fp8_cache_through_the_kernels(model):
    """The full DSA layer (indexer, selection, latent attention through the page table) appending
    to an fp8 e4m3 latent cache: the kernels dequantise the pages as the references do."""
    config, params = model
    h = jax.random.normal(jax.random.key(1), (2, 60, config.hidden_size), jnp.bfloat16)
    valid = jnp.arange(60)[None] < jnp.array([[60], [43]])
    cache = init_cache(config, 2, 64, latent_dtype="float8_e4m3fn", page_size=16)
    layer = lambda **kw: dsa_layer_cached(  # noqa: E731
        params["layers"][1]["attn"], h, config, cache["layers"][1], cache["page_table"], cache["lengths"], valid, **kw
    )
    assert traced_kernels(lambda: layer(interpret=True)) == {
        "candidate_pool_scores": 1, "top_pools": 1, "sparse_latent_attention": 1,
    }
    got, got_cache, got_indices = layer(interpret=True)
    want, want_cache, want_indices = layer(implementation="reference")
    # The same selections (the top-k kernel keeps a row's pools in their order, the reference best
    # first), and the same cache: latents, scales, indexer keys, pool keys bit for bit.
    np.testing.assert_array_equal(np.sort(got_indices, -1), np.sort(want_indices, -1))
    np.testing.assert_array_equal(np.sort(got_cache.pop("selected"), -1), np.sort(want_cache.pop("selected"), -1))
    for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    error = record("fp8 cache: DSA layer through the kernels vs the references", relative_error(got[valid], want[valid]))
    assert error < 5e-3  # 2.3e-3 measured: bf16 probabilities and output
