"""The FP8 form of the parameters and the W8A8 layers: the converted linears quantized and back, a
block-scaled linear and the MoE with FP8 experts against numpy's W8A8 (rows quantized per 1 x 128
group, both operands dequantized, products in float64), the MoE's grouped GEMMs through the FP8
kernel in Pallas' interpreter."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import relative_error, traced_kernels

from glm5next_jax import Config
from glm5next_jax.layers import common, mlp
from glm5next_jax.params import (
    Fp8Weight,
    dequantize_params,
    init_params,
    param_shapes,
    param_spec,
    quantize_linear,
    quantize_params,
)
from pallas_kernels import block_fp8

# W8A8's outputs against numpy's same quantization: the products agree to fp32 rounding, the
# outputs are bf16 (2^-8 of the largest) or rounded to bf16 between the GEMMs.
TOLERANCE = 1e-2


def numpy_rows(x):
    """x [..., K] float64 after 1 x 128 group quantization: amax / 448 scales, e4m3 values."""
    x = np.asarray(x, np.float32)
    k = x.shape[-1]
    out = np.zeros(x.shape, np.float64)
    for start in range(0, k, 128):
        group = x[..., start:start + 128]
        amax = np.abs(group).max(axis=-1, keepdims=True)
        scale = np.where(amax > 0, amax / np.float32(448), np.finfo(np.float32).tiny).astype(np.float32)
        out[..., start:start + 128] = (group / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale
    return out


def numpy_weight(w: Fp8Weight):
    """The values of w [..., N, K]: each 128 x 128 block's e4m3 values times its scale, float64."""
    q = np.asarray(w.weight).astype(np.float64)
    s = np.asarray(w.scale, np.float64)
    n, k = q.shape[-2:]
    return q * np.repeat(np.repeat(s, 128, axis=-2), 128, axis=-1)[..., :n, :k]


@pytest.mark.parametrize("k, out", [(256, (384,)), (200, (2, 70))])  # whole blocks; gate/up with partial blocks
def test_fp8_linear_is_numpys_w8a8(k, out):
    rng = np.random.default_rng(k)
    x = jnp.asarray(rng.standard_normal((3, 5, k)), jnp.bfloat16)
    w = Fp8Weight(*block_fp8.quantize_blocks(jnp.asarray(rng.standard_normal((*out, k)) * k**-0.5, jnp.float32)))
    got = common.linear(x, w)
    assert got.shape == (3, 5, *out) and got.dtype == jnp.bfloat16
    want = np.einsum("abk,...k->ab...", numpy_rows(x), numpy_weight(w))
    assert relative_error(got, want) < TOLERANCE


def test_fp8_tree_has_the_converted_linears_in_torch_layout():
    config = Config.from_hf("checkpoints/glm5next-tiny-kernels")
    plain, fp8 = param_shapes(config), param_shapes(config, fp8=True)
    converted = ["mlp/gate_up", "mlp/down", "attn/q_a_proj", "attn/kv_a_proj", "mlp/experts_gate_up", "mlp/experts_down",
                 "mlp/shared/gate_up", "mlp/shared/down"]
    found = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(param_spec(config))[0]:
        name = "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path[2:])
        if leaf.converted:
            found.add(name)
    assert found == set(converted)
    moe = next(i for i, t in enumerate(config.mlp_layer_types) if t == "sparse")
    e, d, two, i = plain["layers"][moe]["mlp"]["experts_gate_up"].shape
    w = fp8["layers"][moe]["mlp"]["experts_gate_up"]
    assert w.weight.shape == (e, 2, i, d) and w.weight.dtype == jnp.float8_e4m3fn
    assert w.scale.shape == (e, 2, -(-i // 128), -(-d // 128)) and w.scale.dtype == jnp.float32
    assert fp8["layers"][moe]["mlp"]["router"] == plain["layers"][moe]["mlp"]["router"]  # not converted


@pytest.mark.slow  # the quantizer is checked bit for bit against numpy in tests/model/test_convert_fp8.py
def test_quantized_params_dequantize_to_within_e4m3_rounding():
    config = Config.from_hf("checkpoints/glm5next-tiny-kernels")
    params = init_params(config, jax.random.key(0), "float32")
    q = quantize_params(params, config)
    assert jax.tree.structure(q) == jax.tree.structure(param_shapes(config, fp8=True))
    back = dequantize_params(q, config, "float32")
    for path, leaf in jax.tree_util.tree_flatten_with_path(param_spec(config))[0]:
        before = np.asarray(_at(params, path))
        after = np.asarray(_at(back, path))
        if leaf.converted:
            assert np.all(np.abs(after - before) <= np.abs(before) * 2.0**-4 + np.abs(before).max() * 2.0**-12)
            assert np.any(after != before)
        else:
            np.testing.assert_array_equal(after, before)


def _at(tree, path):
    for p in path:
        tree = tree[getattr(p, "key", getattr(p, "idx", None))]
    return tree


def moe_case(seed, tokens, width):
    config = Config().replace(hidden_size=256, moe_intermediate_size=width, n_routed_experts=8, num_experts_per_tok=3,
                              n_shared_experts=0)
    ks = jax.random.split(jax.random.key(seed), 3)
    plain = dict(
        router=jax.random.normal(ks[0], (256, 8), jnp.float32),
        router_bias=jnp.zeros(8, jnp.float32),
        experts_gate_up=jax.random.normal(ks[1], (8, 256, 2, width)) * 256**-0.5,
        experts_down=jax.random.normal(ks[2], (8, width, 256)) * width**-0.5,
    )
    spec = param_spec(config)["layers"][config.mlp_layer_types.index("sparse")]["mlp"]
    p = {name: quantize_linear(v, spec[name]) if name.startswith("experts") else v for name, v in plain.items()}
    x = jax.random.normal(jax.random.fold_in(ks[0], tokens), (1, tokens, 256), jnp.float32).astype(jnp.bfloat16)
    return config, p, x


def numpy_moe(p, x, config):
    """Each token through its experts as the release runs them: routed as `mlp.route` picks (the
    choice itself is checked by the bf16 parity tests), rows quantized before each GEMM, the gate_up
    GEMM's output in bf16 as the kernel writes it and the SwiGLU in bf16 as the layer runs it."""
    tokens = x.reshape(-1, x.shape[-1])
    weights, experts = (np.asarray(a) for a in mlp.route(p, tokens, config))
    gate_up, down = numpy_weight(p["experts_gate_up"]), numpy_weight(p["experts_down"])  # [E, 2, I, D], [E, D, I]
    rows = numpy_rows(tokens)
    out = np.zeros(tokens.shape, np.float64)
    for n in range(tokens.shape[0]):
        for w, e in zip(weights[n], experts[n]):
            gu = jnp.asarray(gate_up[e] @ rows[n], jnp.bfloat16)  # [2, I], as the kernel writes it
            h = np.asarray(mlp.clamped_swiglu(gu, config.swiglu_limit), np.float64)  # bf16, as the layer does
            out[n] += w * (down[e] @ numpy_rows(h[None])[0])
    return out.reshape(x.shape)


@pytest.mark.parametrize("width", [128, 64])  # gate and up as one GEMM of whole blocks; as two with partial blocks
def test_moe_with_fp8_experts_is_numpys_w8a8(width):
    config, p, x = moe_case(width, 37, width)
    got = mlp.moe(p, x, config, implementation="reference")
    assert got.shape == x.shape and got.dtype == x.dtype
    assert relative_error(got, numpy_moe(p, x, config)) < TOLERANCE


def test_moe_through_the_fp8_kernel_matches_the_reference():
    """A decode step's tokens (64-row tiles; tests/kernels covers both tile heights)."""
    tokens = 3
    config, p, x = moe_case(tokens, tokens, 128)
    run = lambda: mlp.moe(p, x, config, implementation="pallas", interpret=True)  # noqa: E731
    assert traced_kernels(run) == {"moe_grouped_matmul_fp8": 2}  # gate_up (one GEMM), down
    got = run()
    assert relative_error(got, mlp.moe(p, x, config, implementation="reference")) < TOLERANCE


def test_w8a8_products_differentiate_straight_through():
    """The W8A8 linears pass gradients to their inputs as the product with the dequantized weight
    (straight through the rows' rounding; the kernels have no gradient of their own): a dense one's
    d x against numpy's d y W, the MoE's through the FP8 and bf16 kernels (interpreted) against its
    reference, and within 10% of the dequantized model's (whose activations are not rounded)."""
    rng = np.random.default_rng(7)
    w = Fp8Weight(*block_fp8.quantize_blocks(jnp.asarray(rng.standard_normal((2, 128, 256)) * 0.06, jnp.float32)))
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.float32)
    d_y = rng.standard_normal((3, 2, 128))
    d_x = jax.vjp(lambda x: common.linear(x, w), x)[1](jnp.asarray(d_y, jnp.float32))[0]
    assert relative_error(d_x, np.einsum("mon,onk->mk", d_y, numpy_weight(w))) < 1e-6

    config, p, x = moe_case(128, 40, 128)
    d_out = jnp.asarray(rng.standard_normal(x.shape), x.dtype)

    def d_tokens(p, **kwargs):
        return jax.vjp(lambda x: mlp.moe(p, x, config, **kwargs), x)[1](d_out)[0]

    reference = d_tokens(p, implementation="reference")
    assert relative_error(d_tokens(p, implementation="pallas", interpret=True), reference) < TOLERANCE
    dequantized = {**p, "experts_gate_up": jnp.asarray(np.moveaxis(numpy_weight(p["experts_gate_up"]), -1, 1), x.dtype),
                   "experts_down": jnp.asarray(np.moveaxis(numpy_weight(p["experts_down"]), -1, 1), x.dtype)}
    assert relative_error(reference, d_tokens(dequantized, implementation="reference")) < 0.1
