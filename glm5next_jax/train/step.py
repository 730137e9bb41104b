"""A training step over the train form's parameters (`params.param_spec(config, form="train")`):
the forward's absorbed DSA projections computed from the checkpoint's, the loss, an optax update.

Frozen, as transformers trains the model: the indexer (its only way to the loss is the discrete
selection) and the router's selection bias (moved by the release's load balancing, not by
gradients): their updates are zero whatever the optimizer.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ..checkpoint import absorb_o, absorb_q
from ..config import Config
from .loss import next_token_loss


class TrainState(NamedTuple):
    params: Any  # the train form's tree
    opt_state: Any
    step: jax.Array  # int32 []


def inference_params(params, config: Config):
    """The forward's parameters from the train form's: each DSA layer's q_absorb and o_absorb computed
    in fp32 from q_b_proj, kv_b_proj and o_proj (then in q_b_proj's dtype, as the loader does);
    everything else as it is."""
    layers = []
    for p in params["layers"]:
        attn = dict(p["attn"])
        if "q_b_proj" in attn:
            q_b, kv_b, o_proj = attn.pop("q_b_proj"), attn.pop("kv_b_proj"), attn.pop("o_proj")
            attn["q_absorb"] = absorb_q(q_b.T, kv_b.T, config).astype(q_b.dtype)
            attn["o_absorb"] = absorb_o(o_proj.T, kv_b.T, config).astype(o_proj.dtype)
        layers.append({**p, "attn": attn})
    return {**params, "layers": layers}


def trainable(params):
    """A tree of bools: False for the indexer's leaves and the router's selection bias."""
    def mark(path, _):
        names = [getattr(k, "key", None) for k in path]
        return "indexer" not in names and "router_bias" not in names

    return jax.tree_util.tree_map_with_path(mark, params)


def init_train_state(params, optimizer: optax.GradientTransformation) -> TrainState:
    return TrainState(params, optimizer.init(params), jnp.int32(0))


def train_step(state: TrainState, input_ids, attention_mask=None, *, config: Config,
               optimizer: optax.GradientTransformation, implementation=None, interpret=False, layout=None,
               remat="none"):
    """(next state, {"loss", "grad_norm"}): one step of `optimizer` on `next_token_loss` of the batch
    (input_ids [B, T], attention_mask 0/1 [B, T] or None), the frozen leaves' updates zeroed. Jit it
    with config, optimizer, implementation, interpret and layout static (`jax.jit(train_step,
    static_argnames=STATIC)`). layout (`sharding.Layout`): the mesh the params are placed on
    (`sharding.shard_params(..., form="train")`); the batch is split as its rules say. remat: what
    each layer keeps for the backward pass (`model.REMAT_POLICIES`: "none", "full", "dots")."""
    def loss_of(params):
        return next_token_loss(inference_params(params, config), config, input_ids, attention_mask,
                               implementation=implementation, interpret=interpret, layout=layout, remat=remat)

    loss, grads = jax.value_and_grad(loss_of)(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    updates = jax.tree.map(lambda u, keep: u if keep else jnp.zeros_like(u), updates, trainable(state.params))
    params = optax.apply_updates(state.params, updates)
    return TrainState(params, opt_state, state.step + 1), {"loss": loss, "grad_norm": optax.tree.norm(grads)}


STATIC = ("config", "optimizer", "implementation", "interpret", "layout", "remat")
