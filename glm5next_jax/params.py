"""The parameter tree: one spec per leaf (shape, logical axes, dtype rule), from which the shapes,
the sharding annotations and a random initialisation are all derived.

Layout: weights are [in, out] (torch Linear transposed). The tree is

    {"embed_tokens": [V, D], "layers": [layer, ...], "norm": [D], "lm_head": [D, V]}
    layer = {"attn_hc", "ffn_hc": {fn, base, scale}, "input_norm", "post_attention_norm": [D],
             "attn": KDA or DSA params (see layers/kda.py, layers/dsa.py),
             "mlp": dense {gate_up, down} or MoE params (see layers/mlp.py)}

In the FP8 form (`fp8=True`) the linears the release stores block-scaled (`Leaf.converted`: the
dense MLPs, the routed and shared experts, DSA's q_a and kv_a projections) are `Fp8Weight` nodes in
torch's [out, in] layout instead; DSA's q_b and o projections reach the model absorbed with kv_b
(q_absorb, o_absorb), which stay in the model dtype.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import block_fp8

from .config import DSA, Config


@dataclasses.dataclass(frozen=True)
class Leaf:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # one logical axis name (or None) per dimension
    fp32: bool = False  # kept in fp32 whatever the model dtype (gates, conv, mHC, router, ape)
    init: str = "normal"  # "normal" (std 0.02), "ones" or "zeros"
    converted: bool = False  # a linear [*batch, in, *out] the release stores block-scaled in FP8
    batch_dims: int = 0  # leading dimensions that are not the linear's (the experts)
    float8: bool = False  # stored e4m3 (an Fp8Weight's weight)

    def __post_init__(self):
        assert len(self.shape) == len(self.axes), (self.shape, self.axes)


class Fp8Weight(NamedTuple):
    """A linear's block-scaled FP8 weight, as the release stores it: `weight` e4m3 [*batch, *out, in]
    (torch's layout: K-major, as FP8 wgmma reads its operands) and `scale` fp32 [*batch, *out[:-1],
    ceil(out[-1] / 128), ceil(in / 128)], one per 128 x 128 block of the last two axes (value =
    weight x scale). Both carry the logical axes of the dimensions they span. A layout that cuts
    the blocks holds the scales per element along the cut axis (`sharding.scales_per_element`)."""

    weight: Any
    scale: Any


def to_out_in(dims: tuple, batch_dims: int = 0) -> tuple:
    """A linear's dimensions (shape or logical axes) [*batch, in, *out] in torch's order [*batch, *out, in]."""
    b = batch_dims
    return dims[:b] + dims[b + 1:] + (dims[b],)


def is_fp8(params) -> bool:
    """Whether a parameter tree is in the FP8 form (holds `Fp8Weight` nodes)."""
    return any(isinstance(x, Fp8Weight) for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, Fp8Weight)))


def fp8_leaf(leaf: Leaf) -> Fp8Weight:
    """The FP8 form's specs of a converted linear's bf16 spec [*batch, in, *out]."""
    shape, axes = to_out_in(leaf.shape, leaf.batch_dims), to_out_in(leaf.axes, leaf.batch_dims)
    scale = shape[:-2] + (block_fp8.blocks(shape[-2]), block_fp8.blocks(shape[-1]))
    return Fp8Weight(Leaf(shape, axes, float8=True), Leaf(scale, axes, fp32=True))


def _kda_spec(c: Config):
    d, h, dk, ch, k = c.hidden_size, c.linear_num_heads, c.linear_head_dim, c.kda_dim, c.linear_conv_kernel_dim
    return {
        "qkv_proj": Leaf((d, 3, ch), ("embed", None, "kda_channels")),
        "conv": Leaf((k, 3, ch), (None, None, "kda_channels"), fp32=True),
        "f_a": Leaf((d, dk), ("embed", None)),
        "f_b": Leaf((dk, ch), (None, "kda_channels")),
        "dt_bias": Leaf((ch,), ("kda_channels",), fp32=True),
        "A_log": Leaf((h,), ("kda_heads",), fp32=True, init="zeros"),
        "b_proj": Leaf((d, h), ("embed", "kda_heads")),
        "g_a": Leaf((d, dk), ("embed", None)),
        "g_b": Leaf((dk, ch), (None, "kda_channels")),
        "o_norm": Leaf((dk,), (None,), init="ones"),
        "o_proj": Leaf((ch, d), ("kda_channels", "embed")),
    }


def _dsa_spec(c: Config, layer: int, form: str):
    d, heads, r, ql = c.hidden_size, c.num_attention_heads, c.kv_lora_rank, c.q_lora_rank
    spec = {
        "q_a_proj": Leaf((d, ql), ("embed", "q_lora"), converted=True),
        "q_a_norm": Leaf((ql,), ("q_lora",), init="ones"),
        "q_absorb": Leaf((ql, heads * r), ("q_lora", "heads_latent")),
        "kv_a_proj": Leaf((d, r), ("embed", "kv_lora"), converted=True),
        "kv_a_norm": Leaf((r,), ("kv_lora",), init="ones"),
        "o_absorb": Leaf((heads * r, d), ("heads_latent", "embed")),
    }
    if form == "train":  # the checkpoint's projections, from which the absorbed ones are computed
        del spec["q_absorb"], spec["o_absorb"]
        spec["q_b_proj"] = Leaf((ql, heads * c.qk_head_dim), ("q_lora", "heads_q"))
        spec["kv_b_proj"] = Leaf((r, heads * (c.qk_nope_head_dim + c.v_head_dim)), ("kv_lora", "heads_kv"))
        spec["o_proj"] = Leaf((heads * c.v_head_dim, d), ("heads_v", "embed"))
    if c.indexer_types[layer] == "full":
        nh, hd = c.index_n_heads, c.index_head_dim
        spec["indexer"] = {
            "wq_b": Leaf((ql, nh * hd), ("q_lora", "index_heads_dim")),
            "wk": Leaf((d, hd), ("embed", None)),
            "k_norm_weight": Leaf((hd,), (None,), init="ones"),
            "k_norm_bias": Leaf((hd,), (None,), init="zeros"),
            "compress_gate": Leaf((d, hd), ("embed", None)),
            "weights_proj": Leaf((d, nh), ("embed", None)),
            "ape": Leaf((c.index_kpool, hd), (None, None), fp32=True),
        }
    return spec


def _dense_mlp_spec(c: Config, intermediate: int):
    d = c.hidden_size
    return {
        "gate_up": Leaf((d, 2, intermediate), ("embed", None, "mlp"), converted=True),
        "down": Leaf((intermediate, d), ("mlp", "embed"), converted=True),
    }


def _moe_spec(c: Config):
    d, e, i = c.hidden_size, c.n_routed_experts, c.moe_intermediate_size
    spec = {
        # The router stays replicated: every rank must pick the same experts.
        "router": Leaf((d, e), (None, None), fp32=True),
        "router_bias": Leaf((e,), (None,), fp32=True, init="zeros"),
        "experts_gate_up": Leaf((e, d, 2, i), ("experts", "embed", None, "expert_mlp"), converted=True, batch_dims=1),
        "experts_down": Leaf((e, i, d), ("experts", "expert_mlp", "embed"), converted=True, batch_dims=1),
    }
    if c.n_shared_experts > 0:
        spec["shared"] = _dense_mlp_spec(c, i * c.n_shared_experts)
    return spec


def _hc_spec(c: Config):
    n, d = c.hc_mult, c.hidden_size
    width = (2 + n) * n
    return {
        "fn": Leaf((n * d, width), (None, None), fp32=True),
        "base": Leaf((width,), (None,), fp32=True, init="zeros"),
        "scale": Leaf((3,), (None,), fp32=True, init="ones"),
    }


FORMS = ("inference", "train")


def param_spec(config: Config, fp8: bool = False, form: str = "inference"):
    """The tree of `Leaf` specs; with fp8, the converted linears as `Fp8Weight` nodes of specs.
    form "train": DSA's q_b_proj, kv_b_proj and o_proj (as [in, out]) in place of the absorbed
    q_absorb and o_absorb (`train.inference_params` computes those from them)."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    if fp8:
        if form == "train":
            raise ValueError("the train form holds plain weights: no fp8")
        return jax.tree.map(lambda leaf: fp8_leaf(leaf) if leaf.converted else leaf, param_spec(config), is_leaf=_is_leaf)
    c = config
    d, v = c.hidden_size, c.vocab_size
    layers = []
    for i in range(c.num_hidden_layers):
        layers.append(
            {
                "attn_hc": _hc_spec(c),
                "ffn_hc": _hc_spec(c),
                "input_norm": Leaf((d,), (None,), init="ones"),
                "post_attention_norm": Leaf((d,), (None,), init="ones"),
                "attn": _dsa_spec(c, i, form) if c.layer_types[i] == DSA else _kda_spec(c),
                "mlp": _moe_spec(c) if c.mlp_layer_types[i] == "sparse" else _dense_mlp_spec(c, c.intermediate_size),
            }
        )
    return {
        "embed_tokens": Leaf((v, d), ("vocab", "embed")),
        "layers": layers,
        "norm": Leaf((d,), (None,), init="ones"),
        "lm_head": Leaf((d, v), ("embed", "vocab")),
    }


def _is_leaf(x):
    return isinstance(x, Leaf)


def leaf_dtype(leaf: Leaf, dtype) -> jnp.dtype:
    if leaf.float8:
        return jnp.dtype(block_fp8.FP8)
    return jnp.dtype(jnp.float32) if leaf.fp32 else jnp.dtype(dtype)


def param_shapes(config: Config, dtype="bfloat16", fp8: bool = False):
    """Tree of jax.ShapeDtypeStruct, the exact structure `load_checkpoint` and `init_params` return."""
    return spec_shapes(param_spec(config, fp8), dtype)


def spec_shapes(spec, dtype="bfloat16"):
    """The jax.ShapeDtypeStruct of each `Leaf` of a spec tree, in `dtype` where the leaf follows it."""
    return jax.tree.map(lambda l: jax.ShapeDtypeStruct(l.shape, leaf_dtype(l, dtype)), spec, is_leaf=_is_leaf)


def param_axes(config: Config, fp8: bool = False, form: str = "inference"):
    """Tree of logical-axis tuples, one name (or None) per dimension of each parameter."""
    return jax.tree.map(lambda l: l.axes, param_spec(config, fp8, form), is_leaf=_is_leaf)


def quantize_linear(w, leaf: Leaf) -> Fp8Weight:
    """A converted linear [*batch, in, *out] in its FP8 form, 128 x 128 blocks of amax / 448."""
    return Fp8Weight(*block_fp8.quantize_blocks(jnp.transpose(w, to_out_in(tuple(range(w.ndim)), leaf.batch_dims))))


def dequantize_linear(w: Fp8Weight, leaf: Leaf, dtype) -> jax.Array:
    """The values of a converted linear's FP8 form, back in the layout [*batch, in, *out] and `dtype`."""
    b = leaf.batch_dims
    values = block_fp8.dequantize_blocks(w.weight, w.scale)
    return jnp.moveaxis(values, -1, b).astype(dtype)


def quantize_params(params, config: Config):
    """The FP8 form of a parameter tree: each converted linear quantized, the rest as it is."""
    return jax.tree.map(
        lambda leaf, x: quantize_linear(x, leaf) if leaf.converted else x, param_spec(config), params, is_leaf=_is_leaf
    )


def dequantize_params(params, config: Config, dtype="bfloat16"):
    """The plain form of an FP8 tree: each Fp8Weight's values in `dtype`, exactly (fp32) or rounded once."""
    return jax.tree.map(
        lambda leaf, x: dequantize_linear(x, leaf, dtype) if leaf.converted else x,
        param_spec(config), params, is_leaf=lambda x: _is_leaf(x) or isinstance(x, Fp8Weight),
    )


def init_params(config: Config, key, dtype="bfloat16", fp8: bool = False, form: str = "inference"):
    """Random parameters (normal, std 0.02; norms ones) for benchmarks and tests without a checkpoint;
    with fp8, the converted linears quantized from such values; `form` as for `param_spec`."""
    if fp8:
        return quantize_params(init_params(config, key, dtype), config)
    spec = param_spec(config, form=form)
    leaves, treedef = jax.tree.flatten(spec, is_leaf=_is_leaf)
    keys = jax.random.split(key, len(leaves))

    def make(leaf, k):
        dt = leaf_dtype(leaf, dtype)
        if leaf.init == "ones":
            return jnp.ones(leaf.shape, dt)
        if leaf.init == "zeros":
            return jnp.zeros(leaf.shape, dt)
        return (0.02 * jax.random.normal(k, leaf.shape, jnp.float32)).astype(dt)

    return jax.tree.unflatten(treedef, [make(l, k) for l, k in zip(leaves, keys)])


def tree_bytes(tree) -> int:
    """Bytes of a tree of arrays or ShapeDtypeStructs."""
    return sum(int(math.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def count_params(tree) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(tree))
