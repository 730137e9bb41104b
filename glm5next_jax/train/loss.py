"""The causal language-modelling loss (mean next-token cross-entropy over real positions) and what
the MoE's routing adds: each expert's load, and DeepSeek-V3's sequence-wise balance loss."""

import jax
import jax.numpy as jnp

from ..config import Config
from ..model import forward


def next_token_loss(params, config: Config, input_ids, attention_mask=None, *, implementation=None, interpret=False,
                    layout=None, remat="none", segment_ids=None):
    """Mean cross-entropy of each next token over the positions whose token and target are both real
    (mask 1 at t and t + 1) and, with segment_ids (packed sequences, in place of the mask), of one
    document, in fp32: what transformers' `loss` is for the same labels with padding masked out.
    input_ids [B, T] (T >= 2), attention_mask [B, T] of 0/1 (None: every token real); the keywords
    as for `forward`."""
    if jnp.ndim(input_ids) != 2 or jnp.shape(input_ids)[1] < 2:
        raise ValueError(f"next_token_loss: input_ids must be [B, T] with T >= 2, got shape {jnp.shape(input_ids)}")
    logits = forward(params, config, input_ids, attention_mask, implementation=implementation, interpret=interpret,
                     layout=layout, remat=remat, segment_ids=segment_ids)
    if segment_ids is not None:
        attention_mask = jnp.asarray(segment_ids) > 0
    elif attention_mask is None:
        attention_mask = jnp.ones(jnp.shape(input_ids), jnp.int32)
    return token_loss(logits, input_ids, attention_mask, segment_ids)


def token_loss(logits, input_ids, attention_mask, segment_ids=None):
    """`next_token_loss` from the forward's logits [B, T, vocab]."""
    log_probs = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    targets = jnp.asarray(input_ids)[:, 1:, None].astype(jnp.int32)
    picked = jnp.take_along_axis(log_probs, targets, axis=-1)[..., 0]
    mask = jnp.asarray(attention_mask).astype(jnp.bool_)
    counted = mask[:, :-1] & mask[:, 1:]
    if segment_ids is not None:  # a document's last token predicts nothing of the next one
        segment_ids = jnp.asarray(segment_ids)
        counted = counted & (segment_ids[:, :-1] == segment_ids[:, 1:])
    return -jnp.sum(jnp.where(counted, picked, 0.0)) / jnp.maximum(jnp.sum(counted), 1)


def expert_loads(experts, attention_mask, n_experts: int):
    """Tokens routed to each expert [E] (fp32) from a MoE layer's choices [B, T, k] (`forward`'s
    internals), real tokens (mask 1) only."""
    real = jnp.asarray(attention_mask).astype(jnp.float32)[..., None, None]
    return jnp.sum(jax.nn.one_hot(experts, n_experts, dtype=jnp.float32) * real, axis=(0, 1, 2))


def sequence_balance_loss(scores, experts, attention_mask):
    """DeepSeek-V3's sequence-wise balance loss of one MoE layer, over the batch's sequences that have
    a real token (mask 1): per sequence sum_i f_i P_i, with f_i = E / (k T) x the choices of expert i
    among its T real tokens' top k, and P_i the mean over those tokens of expert i's score normalised
    over all experts (s_i / sum_j s_j); 1 where the routing is balanced. scores [B, T, E] (the
    router's sigmoid scores, `forward`'s routing internals), experts [B, T, k], attention_mask [B, T].
    The counts f carry no gradient: it reaches the router through P."""
    real = jnp.asarray(attention_mask).astype(jnp.float32)
    n_experts, k = scores.shape[-1], experts.shape[-1]
    tokens = jnp.sum(real, axis=-1)  # [B]
    counts = jnp.sum(jax.nn.one_hot(experts, n_experts, dtype=jnp.float32) * real[..., None, None], axis=(1, 2))
    f = jax.lax.stop_gradient(counts * n_experts / (k * jnp.maximum(tokens, 1.0))[:, None])
    normalised = scores / jnp.sum(scores, axis=-1, keepdims=True)
    p = jnp.sum(normalised * real[..., None], axis=1) / jnp.maximum(tokens, 1.0)[:, None]
    seen = tokens > 0
    return jnp.sum(jnp.where(seen, jnp.sum(f * p, axis=-1), 0.0)) / jnp.maximum(jnp.sum(seen), 1)
