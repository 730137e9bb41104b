"""The choice between each op's Pallas kernel and its pure-jnp reference
(`pallas_kernels.common.pick_implementation`), alone and as the model makes it call by call."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SHIPPED, load_model, traced_kernels

import glm5next_jax
from glm5next_jax.cache import init_cache
from pallas_kernels.common import pick_implementation


def test_pick_implementation():
    bf16, fp32 = jnp.bfloat16, jnp.float32
    assert pick_implementation(None, None, bf16) == "reference"  # on the CPU
    assert pick_implementation(None, None, bf16, interpret=True) == "pallas"  # chosen as on a GPU
    assert pick_implementation(None, None, fp32, interpret=True) == "reference"  # fp32 stays exact
    assert pick_implementation(None, "too wide", bf16, interpret=True) == "reference"
    assert pick_implementation("reference", None, bf16, interpret=True) == "reference"
    assert pick_implementation("pallas", None, fp32) == "pallas"
    with pytest.raises(ValueError, match="does not support this call: too wide"):
        pick_implementation("pallas", "too wide", bf16)
    with pytest.raises(ValueError, match="implementation must be one of"):
        pick_implementation("triton", None, bf16)


def test_the_model_takes_each_kernel_that_fits_its_shapes():
    """The shipped checkpoint's KDA head dim (32) is one the scan kernel does not take and its MoE
    widths (2 x 32) none the grouped GEMM's column blocks divide: chosen as on a GPU, its forward runs
    only DSA's kernels (selection and latent attention in both DSA layers), its decode step the KDA
    step kernel in each of the 6 KDA layers too; fp32 params stay on the references."""
    config, params = load_model(SHIPPED, "bfloat16")
    ids = np.arange(2, 82, dtype=np.int32).reshape(2, 40)
    forward = lambda **kw: glm5next_jax.forward(params, config, ids, **kw)  # noqa: E731
    dsa = {"candidate_pool_scores": 2, "top_pools": 2, "sparse_latent_attention": 2}
    assert traced_kernels(forward) == {}  # the CPU: every reference
    assert traced_kernels(lambda: forward(interpret=True)) == dsa
    cache = init_cache(config, 2, 64, page_size=16)
    _, cache = glm5next_jax.prefill(params, config, ids, None, cache)
    step = lambda: glm5next_jax.decode_step(params, config, ids[:, 0], cache, interpret=True)  # noqa: E731
    assert traced_kernels(step) == {**dsa, "kda_decode_step": 6}
    with pytest.raises(ValueError, match="dk and dv must be equal and one of"):
        forward(implementation="pallas", interpret=True)

    config32, params32 = load_model(SHIPPED, "float32")
    assert traced_kernels(lambda: glm5next_jax.forward(params32, config32, ids, interpret=True)) == {}
