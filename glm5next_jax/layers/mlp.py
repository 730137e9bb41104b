"""Clamped SwiGLU MLP and the sigmoid-routed MoE with a shared expert."""

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import block_fp8, moe_gemm

from ..lora import LoraWeight, adapter_axes, expert_rows, lora_product
from ..params import Fp8Weight, to_out_in
from .common import PRECISION, fp8_linear, linear, quantize_split_rows, straight_through


def clamped_swiglu(gate_up, limit):
    """silu(min(gate, limit)) * clip(up, -limit, limit); gate_up is [..., 2, I] (gate, up)."""
    gate, up = gate_up[..., 0, :], gate_up[..., 1, :]
    return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


def dense_mlp(p, x, config, layout=None):
    """p: gate_up [D, 2, I], down [I, D] (or their `Fp8Weight` forms, or LoRA-adapted either way).
    Under a layout, FP8 weights run in `shard_map` (their GEMM is a kernel, which XLA would otherwise
    gather whole): gate_up split on I, down on its in dimension, the partial outputs summed over the
    devices that split I."""
    if layout is not None and isinstance(_base(p["down"]), Fp8Weight):
        return _fp8_dense_mlp_sharded(p, x, config, layout)
    return linear(clamped_swiglu(linear(x, p["gate_up"]), config.swiglu_limit), p["down"])


def _base(w):
    return w.base if isinstance(w, LoraWeight) else w


def weight_axes(w, axes, batch_dims=0):
    """The logical axes of a weight as `shard_map` takes it, from its axes in our layout [*batch, in,
    *out]: an `Fp8Weight`'s in torch's [*batch, *out, in] (weight and scale alike); a LoRA-adapted
    one's base and adapter (`lora.adapter_axes`)."""
    if isinstance(w, LoraWeight):
        return LoraWeight(weight_axes(w.base, axes, batch_dims), adapter_axes(w, axes), w.scaling, w.experts)
    if isinstance(w, Fp8Weight):
        return Fp8Weight(*(to_out_in(axes, batch_dims),) * 2)
    return axes


def _fp8_dense_mlp_sharded(p, x, config, layout):
    gate_up_axes, down_axes = ("embed", None, "mlp"), ("mlp", "embed")
    split = layout.mesh_axes("mlp", gate_up_axes)
    x_axes = ("batch",) + (None,) * (x.ndim - 2) + ("embed",)
    quantizer = _hidden_quantizer(_base(p["down"]), split)

    def local(gate_up, down, x):
        hidden = clamped_swiglu(linear(x, gate_up), config.swiglu_limit)
        y = fp8_linear(hidden, _base(down), quantizer)
        if isinstance(down, LoraWeight):  # its A split on I as the hidden is: a partial sum, as the base's
            y = y + lora_product(hidden, down)
        return jax.lax.psum(y, split) if split else y

    run = layout.shard_map(local, in_axes=(weight_axes(p["gate_up"], gate_up_axes), weight_axes(p["down"], down_axes),
                                           x_axes), out_axes=x_axes)
    return run(p["gate_up"], p["down"], x)


def _hidden_quantizer(down: Fp8Weight, split):
    """The quantizer of the rows that enter a down projection whose in dimension (the MLP's width) is
    split over mesh axes `split` here: where the split cuts the weight's blocks (its scales per
    element along in), the activations' 1 x 128 groups straddle devices too, and are taken whole."""
    if split and not block_fp8.in_blocks(down.weight.shape[-1:], down.scale.shape[-1:]):
        return functools.partial(quantize_split_rows, axes=split)
    return block_fp8.quantize_rows


def router_scores(p, x):
    """The router's sigmoid score of every expert [N, E] (fp32) for x [N, D]: what selection ranks
    (with the bias added) and what the chosen experts are weighted by."""
    logits = jnp.einsum("nd,de->ne", x.astype(jnp.float32), p["router"].astype(jnp.float32), precision=PRECISION)
    return jax.nn.sigmoid(logits)


def route(p, x, config):
    """Router: top-k experts per token and their weights.

    Selection ranks sigmoid scores plus `router_bias` (e_score_correction_bias), limited to the
    best `topk_group` groups; the emitted weights are the unbiased scores of the chosen experts.
    Returns (weights [N, k] fp32, experts [N, k] int32) for x [N, D].
    """
    return select_experts(p, router_scores(p, x), config)


def select_experts(p, scores, config):
    """`route`'s choice from the router's scores [N, E] (`router_scores`)."""
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


def combine(rows, slot_of_choice, experts, weights, dtype, present=None):
    """Each token's sum over its k experts of weight x its row of `rows` [slots, D], in `dtype`:
    slot_of_choice [N, k] (where each choice's output row is), experts and weights [N, k]; `present`
    [N, k] (default all) marks the choices whose rows are here (an expert-parallel device holds
    some experts only). As the reference adds them (`index_add_`, one expert after another): each
    weighted row cast to `dtype`, then summed in ascending expert order. A gather of k rows a token,
    not a scatter-add, which takes 3.25 ms a layer on the H200 at 16384 tokens x 8 experts
    (bench/RESULTS.md); its gradient is a gather too (`_weighted_rows_sum`)."""
    by_expert = jnp.argsort(experts, axis=-1)
    slot_of_choice = jnp.take_along_axis(slot_of_choice, by_expert, axis=-1)
    weights = jnp.take_along_axis(weights, by_expert, axis=-1)
    present = jnp.ones(experts.shape, jnp.bool_) if present is None else jnp.take_along_axis(present, by_expert, axis=-1)
    return _weighted_rows_sum(rows, slot_of_choice, weights, present, dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _weighted_rows_sum(rows, slot_of_choice, weights, present, dtype):
    """sum_j present[:, j] weights[:, j] rows[slot_of_choice[:, j]], each term cast to dtype, in j's order.
    Its vjp takes the rows' gradient slot by slot (each slot holds one choice, so it is a gather of
    the choice's token's output gradient times its weight) where autodiff would scatter-add into a
    zeroed [slots, D] buffer, which XLA allocates for every layer at once (573 MB a MoE layer on each
    of 8 devices at 8192 tokens)."""
    out = jnp.zeros((slot_of_choice.shape[0], rows.shape[-1]), dtype)
    for j in range(slot_of_choice.shape[-1]):
        term = (_choice_rows(rows, slot_of_choice[:, j]) * weights[:, j, None]).astype(dtype)
        out = out + jnp.where(present[:, j, None], term, 0)
    return out


def _choice_rows(rows, slots):
    return rows[jnp.clip(slots, 0, rows.shape[0] - 1)]


def _weighted_rows_sum_fwd(rows, slot_of_choice, weights, present, dtype):
    return _weighted_rows_sum(rows, slot_of_choice, weights, present, dtype), (rows, slot_of_choice, weights, present)


def _weighted_rows_sum_bwd(dtype, residuals, d_out):
    rows, slot_of_choice, weights, present = residuals
    n, k = slot_of_choice.shape
    d_out = d_out.astype(jnp.float32)
    # Each slot's choice (n k for none: padding, or choices held elsewhere).
    held_slots = jnp.where(present, slot_of_choice, rows.shape[0]).reshape(-1)
    choice_of_slot = jnp.full(rows.shape[0], n * k, jnp.int32).at[held_slots].set(jnp.arange(n * k, dtype=jnp.int32),
                                                                                  mode="drop")
    choice = jnp.minimum(choice_of_slot, n * k - 1)
    d_rows = d_out[choice // k] * weights.reshape(-1)[choice, None].astype(jnp.float32)
    d_rows = jnp.where((choice_of_slot < n * k)[:, None], d_rows, 0).astype(rows.dtype)
    d_weights = jnp.stack([(_choice_rows(rows, slot_of_choice[:, j]).astype(jnp.float32) * d_out).sum(-1)
                           for j in range(k)], axis=-1)
    d_weights = jnp.where(present, d_weights, 0).astype(weights.dtype)
    return d_rows, None, d_weights, None


_weighted_rows_sum.defvjp(_weighted_rows_sum_fwd, _weighted_rows_sum_bwd)


class _Slots(NamedTuple):
    """Where the rows sorted by expert sit in the tiled layout: token_of_slot [slots] (padding slots
    read token 0), slot_of_choice [N, k] and present [N, k] (the choice's expert is held here)."""

    token_of_slot: jax.Array
    slot_of_choice: jax.Array
    present: jax.Array


@jax.custom_vjp
def _token_rows(tokens, slots: _Slots):
    """tokens[slots.token_of_slot]. Its vjp sums each token's held choices' row gradients by
    gathering them, where autodiff would scatter-add into a zeroed [N, D] buffer, which XLA allocates
    for every MoE layer at once (128 MiB each in float32 at 8192 tokens)."""
    return tokens[slots.token_of_slot]


def _token_sums(d_rows, slots: _Slots, dtype):
    """sum_j present[:, j] d_rows[slot_of_choice[:, j]] in float32, cast to dtype: the gradient of
    each token from its rows (padding slots belong to no choice)."""
    ones = jnp.ones(slots.slot_of_choice.shape, jnp.float32)
    return _weighted_rows_sum(d_rows, slots.slot_of_choice, ones, slots.present, jnp.float32).astype(dtype)


_token_rows.defvjp(lambda tokens, slots: (_token_rows(tokens, slots), slots),
                   lambda slots, d_rows: (_token_sums(d_rows, slots, d_rows.dtype), None))  # d_rows: tokens' dtype


def routed_experts(p, tokens, weights, experts, config, implementation=None, interpret=False, first_expert=0,
                   width_split=()):
    """The routed experts' sum for each token [N, D] (grouped GEMMs over the rows sorted by expert),
    over the experts held here: p's experts_gate_up [E_local, D, 2, I] and experts_down
    [E_local, I, D] (or their `Fp8Weight` forms) are experts first_expert .. first_expert + E_local - 1;
    a token's other choices add nothing. weights, experts [N, k] from `route`. width_split: the mesh
    axes that split the experts' width I here (inside `shard_map`). LoRA-adapted expert weights
    (`lora.LoraWeight`) add their adapters over the same tiled rows (`lora.expert_rows`)."""
    adapted = {name: p[name] for name in ("experts_gate_up", "experts_down") if isinstance(p[name], LoraWeight)}
    p = {**p, **{name: w.base for name, w in adapted.items()}}
    fp8 = isinstance(p["experts_down"], Fp8Weight)
    e_local = (p["experts_down"].weight if fp8 else p["experts_down"]).shape[0]
    k = config.num_experts_per_tok
    here = (experts >= first_expert) & (experts < first_expert + e_local)
    local = jnp.where(here, experts - first_expert, e_local).reshape(-1)  # e_local: held elsewhere
    order = jnp.argsort(local, stable=True)
    group_sizes = jnp.bincount(local, length=e_local + 1)[:e_local].astype(jnp.int32)
    if fp8:
        gemms = _fp8_gemms(p, tokens, order.shape[0], implementation, interpret, width_split)
    else:
        gemms = _bf16_gemms(p, tokens, order.shape[0], implementation, interpret)
    # Rows sorted by expert, each expert's starting a tile of the kernel's (one row: packed, for the
    # reference); padding slots read token 0 and their outputs are never gathered; rows of experts
    # held elsewhere sort last and get no slot.
    tiles = moe_gemm.expert_tiles(group_sizes, order.shape[0], gemms.block_rows)
    token_of_row = order // k
    token_of_slot = jnp.zeros(tiles.tile_experts.shape[0] * gemms.block_rows, jnp.int32).at[tiles.slots].set(token_of_row)
    # Where each token's choices come out in the tiled layout: the sort's inverse, through the slots.
    slot_of_choice = jnp.zeros_like(local).at[order].set(tiles.slots).reshape(experts.shape)
    slots = _Slots(token_of_slot, slot_of_choice, here)
    hidden = gemms.gate_up(slots, tiles)
    if "experts_gate_up" in adapted:
        hidden = hidden + expert_rows(_token_rows(tokens, slots), adapted["experts_gate_up"], tiles.tile_experts,
                                      gemms.block_rows)
    hidden = clamped_swiglu(hidden.reshape(hidden.shape[0], 2, -1), config.swiglu_limit)
    down = gemms.down(hidden, tiles)
    if "experts_down" in adapted:
        down = down + expert_rows(hidden, adapted["experts_down"], tiles.tile_experts, gemms.block_rows)
    return combine(down, slot_of_choice, experts, weights, tokens.dtype, here)


class _ExpertGemms(NamedTuple):
    block_rows: int  # the tiled layout's rows a tile
    gate_up: Callable  # (_Slots, tiles) -> [slots, 2 I]
    down: Callable  # (hidden [slots, I], tiles) -> [slots, D]


def _bf16_gemms(p, tokens, rows, implementation, interpret):
    gate_up = p["experts_gate_up"]
    gate_up = gate_up.reshape(*gate_up.shape[:2], -1)
    implementation, gemm = moe_gemm.plan(implementation, tokens, (gate_up, p["experts_down"]), rows=rows, interpret=interpret)

    def run(x, w, tiles):
        return moe_gemm.grouped_matmul(x, w, tiles.tile_experts, tiles.used_tiles, implementation=implementation,
                                       config=gemm, interpret=interpret)

    return _ExpertGemms(
        gemm.block_rows, lambda slots, tiles: run(_token_rows(tokens, slots), gate_up, tiles),
        lambda hidden, tiles: run(hidden, p["experts_down"], tiles),
    )


def _fp8_gemms(p, tokens, rows, implementation, interpret, width_split):
    """W8A8: tokens quantized once (1 x 128 groups) before their rows are gathered, the SwiGLU's
    output quantized again before the down GEMM. gate and up go as one GEMM where each is whole scale
    blocks, else as two. Scales per element (a mesh cut the blocks of I) take the reference."""
    gate_up, down = p["experts_gate_up"], p["experts_down"]  # [E, 2, I, D], [E, D, I]
    e, _, i, d = gate_up.weight.shape
    if i % block_fp8.BLOCK == 0:
        gate_up = [Fp8Weight(gate_up.weight.reshape(e, 2 * i, d), gate_up.scale.reshape(e, -1, gate_up.scale.shape[-1]))]
    else:
        gate_up = [Fp8Weight(gate_up.weight[:, j], gate_up.scale[:, j]) for j in (0, 1)]
    if implementation != "pallas" and not all(block_fp8.in_blocks(w.weight.shape[-2:], w.scale.shape[-2:])
                                              for w in gate_up + [down]):
        implementation = "reference"
    quantize_hidden = _hidden_quantizer(down, width_split)
    implementation, gemm = moe_gemm.plan_fp8(implementation, [w.weight for w in gate_up] + [down.weight], rows=rows,
                                             interpret=interpret, out_dtype=tokens.dtype)

    def run(x, x_scales, w, tiles):
        return moe_gemm.grouped_matmul_fp8(x, x_scales, w.weight, w.scale, tiles.tile_experts, tiles.used_tiles,
                                           implementation=implementation, config=gemm, interpret=interpret,
                                           out_dtype=tokens.dtype)

    # Differentiated straight through the rows' rounding: d rows = d out times each expert's
    # dequantized weight (the bf16 grouped GEMM), as `common.fp8_linear` is.
    def rows_gradient(d_out, w, tiles):
        weights = block_fp8.dequantize_blocks(w.weight, w.scale).astype(d_out.dtype)  # [G, N, K]: K out here
        config = moe_gemm.GemmConfig(block_rows=gemm.block_rows, block_cols=256 if weights.shape[2] % 256 == 0 else 128)
        d_rows = moe_gemm.grouped_matmul(d_out, weights, tiles.tile_experts, tiles.used_tiles,
                                         implementation=None if implementation == "pallas" else "reference",
                                         config=config, interpret=interpret)
        return jnp.where(jnp.arange(d_rows.shape[0])[:, None] < tiles.used_tiles * gemm.block_rows, d_rows, 0)

    def gate_up_forward(tokens, consts):
        slots, tiles, weights = consts
        x_q, x_s = block_fp8.quantize_rows(tokens)  # once a token, before its rows are gathered
        rows_q, rows_s = x_q[slots.token_of_slot], x_s[slots.token_of_slot]
        return jnp.concatenate([run(rows_q, rows_s, w, tiles) for w in weights], axis=-1)

    def gate_up_backward(d_out, consts):
        slots, tiles, weights = consts
        parts = jnp.split(d_out, len(weights), axis=-1)
        d_rows = sum(rows_gradient(d, w, tiles) for d, w in zip(parts, weights, strict=True))
        return _token_sums(d_rows, slots, tokens.dtype)

    def down_forward(hidden, consts):
        tiles, w = consts
        return run(*quantize_hidden(hidden), w, tiles)

    def down_backward(d_out, consts):
        tiles, w = consts
        return rows_gradient(d_out, w, tiles).astype(d_out.dtype)

    def gate_up_rows(slots, tiles):
        return straight_through(gate_up_forward, gate_up_backward, tokens, (slots, tiles, gate_up))

    def down_rows(hidden, tiles):
        return straight_through(down_forward, down_backward, hidden, (tiles, down))

    return _ExpertGemms(gemm.block_rows, gate_up_rows, down_rows)


def expert_parallel(p, tokens, config, implementation, interpret, layout):
    """The routed experts under a mesh, each device computing its own experts' rows (`shard_map`):
    tokens travel, weights never do. Tokens split over mesh axes that also split the experts are
    all-gathered over them first and the outputs reduce-scattered back; partial sums over the other
    expert axes and over the experts' split intermediate width are all-reduced. (At 8 devices and 8
    experts a token this moves as many bytes as an all-to-all dispatch and combine of each token's
    8 rows, with no capacity to size and nothing dropped.)"""
    gate_up_axes = ("experts", "embed", None, "expert_mlp")
    batch_axes, expert_axes = layout.mesh_axes("batch"), layout.mesh_axes("experts", gate_up_axes)
    gathered = tuple(a for a in batch_axes if a in expert_axes)
    summed = tuple(a for a in expert_axes if a not in gathered) + layout.mesh_axes("expert_mlp", gate_up_axes)
    e_local = config.n_routed_experts // layout.size("experts", gate_up_axes)

    def local(router, router_bias, gate_up, down, tokens):
        if gathered:
            tokens = jax.lax.all_gather(tokens, gathered, axis=0, tiled=True)
        weights, experts = route({"router": router, "router_bias": router_bias}, tokens, config)
        first = jax.lax.axis_index(expert_axes) * e_local if expert_axes else 0
        experts_here = {"experts_gate_up": gate_up, "experts_down": down}
        out = routed_experts(experts_here, tokens, weights, experts, config, implementation, interpret, first,
                             layout.mesh_axes("expert_mlp", gate_up_axes))
        if summed:
            out = jax.lax.psum(out, summed)
        if gathered:
            out = jax.lax.psum_scatter(out, gathered, scatter_dimension=0, tiled=True)
        return out

    run = layout.shard_map(
        local,
        in_axes=((None, None), (None,), weight_axes(p["experts_gate_up"], gate_up_axes, 1),
                 weight_axes(p["experts_down"], ("experts", "expert_mlp", "embed"), 1), ("batch", "embed")),
        out_axes=("batch", "embed"),
    )
    return run(p["router"], p["router_bias"], p["experts_gate_up"], p["experts_down"], tokens)


def moe(p, x, config, implementation=None, interpret=False, layout=None):
    """Routed experts (grouped GEMM over tokens sorted by expert) plus the unscaled shared expert.

    p: router [D, E] fp32, router_bias [E] fp32, experts_gate_up [E, D, 2, I], experts_down [E, I, D],
    shared {gate_up, down} when n_shared_experts > 0. implementation: the grouped GEMM's (None: the
    Pallas kernel on GPU for bf16 weights, else the reference; `interpret` runs the kernel in Pallas'
    interpreter), see `pallas_kernels.moe_gemm`. layout: the mesh, experts split as its rules say
    (`expert_parallel`).
    """
    shape = x.shape
    tokens = x.reshape(-1, shape[-1])
    if layout is None:
        weights, experts = route(p, tokens, config)
        out = routed_experts(p, tokens, weights, experts, config, implementation, interpret)
    else:
        out = expert_parallel(p, tokens, config, implementation, interpret, layout)
    out = out.reshape(shape)
    if "shared" in p:
        out = out + dense_mlp(p["shared"], x, config, layout)
    return out
