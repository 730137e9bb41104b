"""Clamped SwiGLU MLP and the sigmoid-routed MoE with a shared expert."""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import moe_gemm

from .common import PRECISION, linear


def clamped_swiglu(gate_up, limit):
    """silu(min(gate, limit)) * clip(up, -limit, limit); gate_up is [..., 2, I] (gate, up)."""
    gate, up = gate_up[..., 0, :], gate_up[..., 1, :]
    return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


def dense_mlp(p, x, config):
    """p: gate_up [D, 2, I], down [I, D]."""
    return linear(clamped_swiglu(linear(x, p["gate_up"]), config.swiglu_limit), p["down"])


def route(p, x, config):
    """Router: top-k experts per token and their weights.

    Selection ranks sigmoid scores plus `router_bias` (e_score_correction_bias), limited to the
    best `topk_group` groups; the emitted weights are the unbiased scores of the chosen experts.
    Returns (weights [N, k] fp32, experts [N, k] int32) for x [N, D].
    """
    logits = jnp.einsum("nd,de->ne", x.astype(jnp.float32), p["router"].astype(jnp.float32), precision=PRECISION)
    scores = jax.nn.sigmoid(logits)
    choice = scores + p["router_bias"].astype(jnp.float32)
    if config.n_group > 1:
        grouped = choice.reshape(choice.shape[0], config.n_group, config.experts_per_group)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
        _, best_groups = jax.lax.top_k(group_scores, config.topk_group)
        keep_group = jax.nn.one_hot(best_groups, config.n_group, dtype=jnp.bool_).any(axis=-2)
        keep = jnp.repeat(keep_group, config.experts_per_group, axis=-1)
        choice = jnp.where(keep, choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, config.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if config.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * config.routed_scaling_factor, experts.astype(jnp.int32)


def combine(rows, slot_of_choice, experts, weights, dtype):
    """Each token's sum over its k experts of weight x its row of `rows` [slots, D], in `dtype`:
    slot_of_choice [N, k] (where each choice's output row is), experts and weights [N, k]. As the
    reference adds them (`index_add_`, one expert after another): each weighted row cast to `dtype`,
    then summed in ascending expert order. A gather of k rows a token: the scatter-add it replaces
    took 3.25 ms a layer on the H200 at 16384 tokens x 8 experts (bench/RESULTS.md)."""
    by_expert = jnp.argsort(experts, axis=-1)
    slot_of_choice = jnp.take_along_axis(slot_of_choice, by_expert, axis=-1)
    weights = jnp.take_along_axis(weights, by_expert, axis=-1)
    out = jnp.zeros((experts.shape[0], rows.shape[-1]), dtype)
    for j in range(experts.shape[-1]):
        out = out + (rows[slot_of_choice[:, j]] * weights[:, j, None]).astype(dtype)
    return out


def moe(p, x, config, implementation=None, interpret=False):
    """Routed experts (grouped GEMM over tokens sorted by expert) plus the unscaled shared expert.

    p: router [D, E] fp32, router_bias [E] fp32, experts_gate_up [E, D, 2, I], experts_down [E, I, D],
    shared {gate_up, down} when n_shared_experts > 0. implementation: the grouped GEMM's (None: the
    Pallas kernel on GPU for bf16 weights, else the reference; `interpret` runs the kernel in Pallas'
    interpreter), see `pallas_kernels.moe_gemm`.
    """
    shape = x.shape
    tokens = x.reshape(-1, shape[-1])
    weights, experts = route(p, tokens, config)
    k = config.num_experts_per_tok
    flat_experts = experts.reshape(-1)
    order = jnp.argsort(flat_experts, stable=True)
    group_sizes = jnp.bincount(flat_experts, length=config.n_routed_experts).astype(jnp.int32)
    gate_up = p["experts_gate_up"]
    gate_up = gate_up.reshape(*gate_up.shape[:2], -1)
    implementation, gemm = moe_gemm.plan(
        implementation, tokens, (gate_up, p["experts_down"]), rows=order.shape[0], interpret=interpret
    )
    # Rows sorted by expert, each expert's starting a tile of the kernel's (one row: packed, for the
    # reference); padding slots read token 0 and their outputs are never gathered.
    tiles = moe_gemm.expert_tiles(group_sizes, order.shape[0], gemm.block_rows)
    token_of_row = order // k
    token_of_slot = jnp.zeros(tiles.tile_experts.shape[0] * gemm.block_rows, jnp.int32).at[tiles.slots].set(token_of_row)
    run = functools.partial(
        moe_gemm.grouped_matmul, tile_experts=tiles.tile_experts, used_tiles=tiles.used_tiles,
        implementation=implementation, config=gemm, interpret=interpret,
    )
    hidden = run(tokens[token_of_slot], gate_up)
    hidden = clamped_swiglu(hidden.reshape(hidden.shape[0], 2, -1), config.swiglu_limit)
    down = run(hidden, p["experts_down"])
    # Where each token's choices came out in the tiled layout: the sort's inverse, through the slots.
    slot_of_choice = jnp.zeros_like(flat_experts).at[order].set(tiles.slots).reshape(experts.shape)
    out = combine(down, slot_of_choice, experts, weights, x.dtype).reshape(shape)
    if "shared" in p:
        out = out + dense_mlp(p["shared"], x, config)
    return out
