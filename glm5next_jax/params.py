"""The parameter tree: one spec per leaf (shape, logical axes, dtype rule), from which the shapes,
the sharding annotations and a random initialisation are all derived.

Layout: weights are [in, out] (torch Linear transposed). The tree is

    {"embed_tokens": [V, D], "layers": [layer, ...], "norm": [D], "lm_head": [D, V]}
    layer = {"attn_hc", "ffn_hc": {fn, base, scale}, "input_norm", "post_attention_norm": [D],
             "attn": KDA or DSA params (see layers/kda.py, layers/dsa.py),
             "mlp": dense {gate_up, down} or MoE params (see layers/mlp.py)}
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .config import DSA, Config


@dataclasses.dataclass(frozen=True)
class Leaf:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # one logical axis name (or None) per dimension
    fp32: bool = False  # kept in fp32 whatever the model dtype (gates, conv, mHC, router, ape)
    init: str = "normal"  # "normal" (std 0.02), "ones" or "zeros"

    def __post_init__(self):
        assert len(self.shape) == len(self.axes), (self.shape, self.axes)


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


def _dsa_spec(c: Config, layer: int):
    d, heads, r, ql = c.hidden_size, c.num_attention_heads, c.kv_lora_rank, c.q_lora_rank
    spec = {
        "q_a_proj": Leaf((d, ql), ("embed", "q_lora")),
        "q_a_norm": Leaf((ql,), ("q_lora",), init="ones"),
        "q_absorb": Leaf((ql, heads * r), ("q_lora", "heads_latent")),
        "kv_a_proj": Leaf((d, r), ("embed", "kv_lora")),
        "kv_a_norm": Leaf((r,), ("kv_lora",), init="ones"),
        "o_absorb": Leaf((heads * r, d), ("heads_latent", "embed")),
    }
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
        "gate_up": Leaf((d, 2, intermediate), ("embed", None, "mlp")),
        "down": Leaf((intermediate, d), ("mlp", "embed")),
    }


def _moe_spec(c: Config):
    d, e, i = c.hidden_size, c.n_routed_experts, c.moe_intermediate_size
    spec = {
        # The router stays replicated: every rank must pick the same experts.
        "router": Leaf((d, e), (None, None), fp32=True),
        "router_bias": Leaf((e,), (None,), fp32=True, init="zeros"),
        "experts_gate_up": Leaf((e, d, 2, i), ("experts", "embed", None, "expert_mlp")),
        "experts_down": Leaf((e, i, d), ("experts", "expert_mlp", "embed")),
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


def param_spec(config: Config):
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
                "attn": _dsa_spec(c, i) if c.layer_types[i] == DSA else _kda_spec(c),
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
    return jnp.dtype(jnp.float32) if leaf.fp32 else jnp.dtype(dtype)


def param_shapes(config: Config, dtype="bfloat16"):
    """Tree of jax.ShapeDtypeStruct, the exact structure `load_checkpoint` and `init_params` return."""
    return jax.tree.map(lambda l: jax.ShapeDtypeStruct(l.shape, leaf_dtype(l, dtype)), param_spec(config), is_leaf=_is_leaf)


def param_axes(config: Config):
    """Tree of logical-axis tuples, one name (or None) per dimension of each parameter."""
    return jax.tree.map(lambda l: l.axes, param_spec(config), is_leaf=_is_leaf)


def init_params(config: Config, key, dtype="bfloat16"):
    """Random parameters (normal, std 0.02; norms ones) for benchmarks and tests without a checkpoint."""
    spec = param_spec(config)
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


def count_params(tree) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(tree))
