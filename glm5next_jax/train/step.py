"""A training step over the train form's parameters (`params.param_spec(config, form="train")`):
the forward's absorbed DSA projections computed from the checkpoint's, the loss, an optax update.

Frozen, as transformers trains the model: the indexer (its only way to the loss is the discrete
selection) and the router's selection bias (moved by the release's load balancing, not by
gradients): their optimizer updates are zero. The balancing is DeepSeek-V3's auxiliary-loss-free
rule: after each step every MoE layer's bias moves by `router_bias_rate` towards balance, up for an
expert that got fewer of the batch's real tokens than the mean, down for more (0: kept as loaded).
Optionally, as DeepSeek-V3 also trains, the sequence-wise balance loss of every MoE layer is added
to the objective with weight `balance_loss_weight` (its alpha; 0: not added).

The indexer trains, as DeepSeek-V3.2 trains its lightning indexer, when `indexer_loss` names a stage
of `layers.indexer_loss`: every full DSA layer's KL from its attention to its indexer is added to the
objective (its gradient reaches the indexers alone, so no weight: the two parts' gradients are
disjoint). "dense" is the warm-up: the indexers alone train (every other update zeroed, the routers'
biases kept); "sparse" trains the whole model, the indexers by their KL only.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ..checkpoint import absorb_o, absorb_q
from ..config import Config
from ..errors import InputError
from ..lora import LoraSpec, LoraWeight, adapters_axes, attach, merged
from ..model import forward
from ..sharding import param_shardings
from .loss import expert_loads, sequence_balance_loss, token_loss


class TrainState(NamedTuple):
    params: Any  # the train form's tree
    opt_state: Any
    step: jax.Array  # int32 []


def plain(w):
    """A weight's values: a `lora.LoraWeight`'s merged with its adapter (differentiable in both)."""
    return merged(w) if isinstance(w, LoraWeight) else w


def inference_params(params, config: Config):
    """The forward's parameters from the train form's: each DSA layer's q_absorb and o_absorb computed
    in fp32 from q_b_proj, kv_b_proj and o_proj (then in q_b_proj's dtype, as the loader does; a
    LoRA-adapted one merged first); everything else as it is."""
    layers = []
    for p in params["layers"]:
        attn = dict(p["attn"])
        if "q_b_proj" in attn:
            q_b, kv_b, o_proj = (plain(attn.pop(name)) for name in ("q_b_proj", "kv_b_proj", "o_proj"))
            attn["q_absorb"] = absorb_q(q_b.T, kv_b.T, config).astype(q_b.dtype)
            attn["o_absorb"] = absorb_o(o_proj.T, kv_b.T, config).astype(o_proj.dtype)
        layers.append({**p, "attn": attn})
    return {**params, "layers": layers}


def trainable(params, indexer_loss=None):
    """A tree of bools, which leaves a step updates: all but the indexer's leaves and the router's
    selection bias; with `indexer_loss` "sparse" the indexer's too; with "dense" the indexer's alone."""
    def mark(path, _):
        names = [getattr(k, "key", None) for k in path]
        if indexer_loss == "dense":
            return "indexer" in names
        return (indexer_loss == "sparse" or "indexer" not in names) and "router_bias" not in names

    return jax.tree_util.tree_map_with_path(mark, params)


def init_train_state(params, optimizer: optax.GradientTransformation) -> TrainState:
    return TrainState(params, optimizer.init(params), jnp.int32(0))


def balance_router(params, loads, rate):
    """params with each MoE layer's router_bias moved by rate x sign(mean load - load) (`loads`:
    layer index -> tokens per expert [E])."""
    layers = list(params["layers"])
    for i, load in loads.items():
        mlp = dict(layers[i]["mlp"])
        bias = mlp["router_bias"]
        mlp["router_bias"] = (bias + rate * jnp.sign(jnp.mean(load) - load)).astype(bias.dtype)
        layers[i] = {**layers[i], "mlp": mlp}
    return {**params, "layers": layers}


def _attention_mask(input_ids, attention_mask, segment_ids):
    if segment_ids is not None:
        if attention_mask is not None:
            raise InputError("pass segment_ids or attention_mask, not both: padding is segment 0")
        return jnp.asarray(segment_ids) > 0
    return jnp.ones(jnp.shape(input_ids), jnp.int32) if attention_mask is None else attention_mask


def objective(params, config: Config, input_ids, attention_mask, segment_ids=None, *, implementation=None,
              interpret=False, layout=None, remat="none", balance_loss_weight=0.0, indexer_loss=None):
    """(the step's objective, (token loss, balance loss, indexer loss, each MoE layer's expert loads))
    of the train form's `params` on a batch: `train_step`'s loss before its gradient."""
    logits, internals = forward(inference_params(params, config), config, input_ids,
                                None if segment_ids is not None else attention_mask,
                                implementation=implementation, interpret=interpret, layout=layout,
                                return_internals=True, remat=remat, indexer_loss=indexer_loss,
                                segment_ids=segment_ids)
    routings = {i: inside["routing"] for i, inside in enumerate(internals) if "routing" in inside}
    loads = {i: expert_loads(r["experts"], attention_mask, config.n_routed_experts) for i, r in routings.items()}
    balance = sum((sequence_balance_loss(r["scores"], r["experts"], attention_mask) for r in routings.values()),
                  jnp.float32(0))
    indexer = sum((inside["indexer_loss"] for inside in internals if "indexer_loss" in inside), jnp.float32(0))
    loss = token_loss(logits, input_ids, attention_mask, segment_ids)
    return loss + balance_loss_weight * balance + indexer, (loss, balance, indexer, loads)


def _metrics(aux, grads):
    loss, balance, indexer, loads = aux
    ratios = [jnp.max(load) / jnp.maximum(jnp.mean(load), 1e-9) for load in loads.values()]
    imbalance = jnp.max(jnp.stack(ratios)) if ratios else jnp.float32(0)
    return {"loss": loss, "balance_loss": balance, "indexer_loss": indexer, "grad_norm": optax.tree.norm(grads),
            "expert_load_imbalance": imbalance}


def train_step(state: TrainState, input_ids, attention_mask=None, *, config: Config,
               optimizer: optax.GradientTransformation, implementation=None, interpret=False, layout=None,
               remat="none", router_bias_rate=0.0, balance_loss_weight=0.0, indexer_loss=None, segment_ids=None):
    """(next state, metrics): one step of `optimizer` on `next_token_loss` of the batch (input_ids
    [B, T], attention_mask 0/1 [B, T] or None) plus `balance_loss_weight` x the MoE layers'
    `sequence_balance_loss` summed, the frozen leaves' updates zeroed, then the routers' balancing by
    `router_bias_rate`. metrics: "loss" (the token loss alone), "balance_loss" (the sum over MoE
    layers, unweighted; 0 without one), "indexer_loss" (the full DSA layers' KLs summed; 0 without
    `indexer_loss`), "grad_norm" and "expert_load_imbalance" (the largest expert load over the mean,
    the worst MoE layer; 0 without one). indexer_loss: None, "dense" or "sparse" (module docstring).
    segment_ids [B, T] (in place of attention_mask): packed sequences, as `forward` takes them; the
    balance loss stays a row's.
    Jit it with STATIC
    static (`jax.jit(train_step, static_argnames=STATIC)`). layout (`sharding.Layout`): the mesh
    the params are placed on (`sharding.shard_params(..., form="train")`, FSDP's too); the batch is
    split as its rules say. remat: what each layer keeps for the backward pass (`model.REMAT_POLICIES`)."""
    attention_mask = _attention_mask(input_ids, attention_mask, segment_ids)
    keep = trainable(state.params, indexer_loss)

    def loss_of(params):
        # The frozen leaves as constants: no backward pass is formed for what only they need.
        params = jax.tree.map(lambda a, k: a if k else jax.lax.stop_gradient(a), params, keep)
        return objective(params, config, input_ids, attention_mask, segment_ids, implementation=implementation,
                         interpret=interpret, layout=layout, remat=remat, balance_loss_weight=balance_loss_weight,
                         indexer_loss=indexer_loss)

    (_, aux), grads = jax.value_and_grad(loss_of, has_aux=True)(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    updates = jax.tree.map(lambda u, k: u if k else jnp.zeros_like(u), updates, keep)
    params = optax.apply_updates(state.params, updates)
    if indexer_loss != "dense":
        params = balance_router(params, aux[3], router_bias_rate)
    if layout is not None:  # the stepped parameters stay where they are kept (with fsdp: split over data)
        params = jax.lax.with_sharding_constraint(params, param_shardings(config, layout, form="train"))
    return TrainState(params, opt_state, state.step + 1), _metrics(aux, grads)


def lora_train_step(state: TrainState, base, input_ids, attention_mask=None, *, config: Config, spec: LoraSpec,
                    optimizer: optax.GradientTransformation, implementation=None, interpret=False, layout=None,
                    remat="none", balance_loss_weight=0.0, segment_ids=None):
    """`train_step` for LoRA: state.params are the adapters (`lora.init_adapters` or `load_adapters`,
    with `spec`), the optimizer's state theirs alone; `base` the frozen parameters they attach to (the
    train form, or the inference form where DSA's absorbed projections are not targeted: bf16,
    float32 or FP8), never updated, the routers' biases included. Same batch arguments and metrics;
    jit it with LORA_STATIC static."""
    attention_mask = _attention_mask(input_ids, attention_mask, segment_ids)
    base = jax.lax.stop_gradient(base)

    def loss_of(adapters):
        return objective(attach(base, adapters, spec), config, input_ids, attention_mask, segment_ids,
                         implementation=implementation, interpret=interpret, layout=layout, remat=remat,
                         balance_loss_weight=balance_loss_weight)

    (_, aux), grads = jax.value_and_grad(loss_of, has_aux=True)(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    adapters = optax.apply_updates(state.params, updates)
    if layout is not None:  # the stepped adapters stay split as their bases are (`lora.adapters_axes`)
        axes = adapters_axes(adapters, config)
        adapters = jax.tree.map(layout.constrain, adapters, axes)
    return TrainState(adapters, opt_state, state.step + 1), _metrics(aux, grads)


STATIC = ("config", "optimizer", "implementation", "interpret", "layout", "remat", "indexer_loss")  # the rates: values
LORA_STATIC = ("config", "spec", "optimizer", "implementation", "interpret", "layout", "remat")
