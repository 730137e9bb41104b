"""DeepSeek Sparse Attention sublayer: NoPE MLA in the absorbed latent form, with a pooled indexer.

p (weights [in, out]):
  q_a_proj [D, q_lora], q_a_norm [q_lora], q_absorb [q_lora, H * R] (q_b_proj through kv_b_proj's
  K half, per head), kv_a_proj [D, R], kv_a_norm [R], o_absorb [H * R, D] (o_proj with kv_b_proj's
  V half folded in), and on "full" layers an indexer:
  wq_b [q_lora, nh * hd], wk [D, hd], k_norm_weight [hd], k_norm_bias [hd], compress_gate [D, hd],
  weights_proj [D, nh] (pre-scaled by nh^-0.5), ape [P, hd] fp32.
R is kv_lora_rank; the latent c = RMSNorm(kv_a_proj(h)) is what a cache keeps per token.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.latent_attention import sparse_latent_attention
from pallas_kernels.select_tokens import first_valid_key, pool_token_indices, select_tokens

from .common import layer_norm, linear, rms_norm

INDEXER_NORM_EPS = 1e-6


def indexer_keys(p, h):
    """Per-token indexer state: k_idx = LayerNorm(wk(h)) and the pool gate compress_gate(h), [B, T, hd]."""
    k_idx = layer_norm(linear(h, p["wk"]), p["k_norm_weight"], p["k_norm_bias"], INDEXER_NORM_EPS)
    return k_idx, linear(h, p["compress_gate"])


def pool_keys(k_idx, gate, ape, first_key, n_pools):
    """pool_key[p] = sum_j softmax_j(gate_j + ape_j) * k_j over the P tokens of pool p, per channel.

    k_idx, gate [B, S, hd]; ape [P, hd]; first_key [B] (pools start there). Positions past S are
    left out of the softmax (a pool with none is zeros); whether a pool is valid is the selection's
    concern.
    """
    b, s, hd = k_idx.shape
    pool_size = ape.shape[0]
    if n_pools == 0:
        return jnp.zeros((b, 0, hd), k_idx.dtype)
    idx = pool_token_indices(first_key, n_pools, pool_size)  # [B, NP, P]
    exists = idx < s
    flat = jnp.clip(idx, 0, s - 1).reshape(b, -1, 1)
    keys = jnp.take_along_axis(k_idx, flat, axis=1).reshape(*idx.shape, -1)
    logits = jnp.take_along_axis(gate, flat, axis=1).reshape(*idx.shape, -1).astype(jnp.float32)
    logits = jnp.where(exists[..., None], logits + ape.astype(jnp.float32), -jnp.inf)
    probs = jnp.nan_to_num(jax.nn.softmax(logits, axis=2)).astype(k_idx.dtype)
    return jnp.sum(probs * keys, axis=2)


def indexer_head_weights(p, h):
    return linear(h, p["weights_proj"]).astype(jnp.float32)


def indexer_queries(p, q_resid, config):
    q = linear(q_resid, p["wq_b"])
    return q.reshape(*q.shape[:-1], config.index_n_heads, config.index_head_dim)


def latent_query(p, q_resid, config):
    q = linear(q_resid, p["q_absorb"])
    return q.reshape(*q.shape[:-1], config.num_attention_heads, config.kv_lora_rank)


def latent_output(p, o_lat):
    return linear(o_lat.reshape(*o_lat.shape[:-2], -1), p["o_absorb"])


def indexer_select(p, h, q_resid, key_valid, config):
    """The indexer over a whole sequence: selected key indices [B, T, W] (-1 padded) per query."""
    b, t = h.shape[:2]
    k_idx, gate = indexer_keys(p, h)
    return select_tokens(
        indexer_queries(p, q_resid, config),
        indexer_head_weights(p, h),
        pool_keys(k_idx, gate, p["ape"], first_valid_key(key_valid), t // config.index_kpool),
        key_valid,
        jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
        index_topk=config.index_topk,
        pool_size=config.index_kpool,
        select_tail=config.index_kpool_always_select_tail,
    )


def dsa_layer(p, h, config, key_valid, shared_indices=None):
    """Uncached DSA sublayer. h [B, T, D]; key_valid [B, T] bool (the padding mask).

    A "full" layer (p has an indexer) selects its tokens; a "shared" layer takes `shared_indices`
    from the preceding full layer. Returns (y [B, T, D], selected indices [B, T, W]).
    """
    q_resid = rms_norm(linear(h, p["q_a_proj"]), p["q_a_norm"], config.rms_norm_eps)
    latents = rms_norm(linear(h, p["kv_a_proj"]), p["kv_a_norm"], config.rms_norm_eps)
    if "indexer" in p:
        indices = indexer_select(p["indexer"], h, q_resid, key_valid, config)
    elif shared_indices is None:
        raise ValueError("a 'shared' DSA layer needs the selected indices of the preceding full layer")
    else:
        indices = shared_indices
    o_lat = sparse_latent_attention(
        latent_query(p, q_resid, config), latents, indices, scale=config.qk_head_dim**-0.5
    )
    return latent_output(p, o_lat), indices
