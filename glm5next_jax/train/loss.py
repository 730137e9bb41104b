"""The causal language-modelling loss: mean next-token cross-entropy over real positions."""

import jax
import jax.numpy as jnp

from ..config import Config
from ..model import forward


def next_token_loss(params, config: Config, input_ids, attention_mask=None, *, implementation=None, interpret=False,
                    layout=None, remat="none"):
    """Mean cross-entropy of each next token over the positions whose token and target are both real
    (mask 1 at t and t + 1), in fp32: what transformers' `loss` is for the same labels with padding
    masked out. input_ids [B, T] (T >= 2), attention_mask [B, T] of 0/1 (None: every token real);
    the keywords as for `forward`."""
    if jnp.ndim(input_ids) != 2 or jnp.shape(input_ids)[1] < 2:
        raise ValueError(f"next_token_loss: input_ids must be [B, T] with T >= 2, got shape {jnp.shape(input_ids)}")
    if attention_mask is None:
        attention_mask = jnp.ones(jnp.shape(input_ids), jnp.int32)
    logits = forward(params, config, input_ids, attention_mask, implementation=implementation, interpret=interpret,
                     layout=layout, remat=remat)
    return token_loss(logits, input_ids, attention_mask)


def token_loss(logits, input_ids, attention_mask):
    """`next_token_loss` from the forward's logits [B, T, vocab]."""
    log_probs = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    targets = jnp.asarray(input_ids)[:, 1:, None].astype(jnp.int32)
    picked = jnp.take_along_axis(log_probs, targets, axis=-1)[..., 0]
    mask = jnp.asarray(attention_mask).astype(jnp.bool_)
    counted = mask[:, :-1] & mask[:, 1:]
    return -jnp.sum(jnp.where(counted, picked, 0.0)) / jnp.maximum(jnp.sum(counted), 1)


def expert_loads(experts, attention_mask, n_experts: int):
    """Tokens routed to each expert [E] (fp32) from a MoE layer's choices [B, T, k] (`forward`'s
    internals), real tokens (mask 1) only."""
    real = jnp.asarray(attention_mask).astype(jnp.float32)[..., None, None]
    return jnp.sum(jax.nn.one_hot(experts, n_experts, dtype=jnp.float32) * real, axis=(0, 1, 2))
