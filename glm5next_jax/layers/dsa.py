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
from pallas_kernels.select_tokens import first_valid_key, packed_pools, pool_token_indices, select_tokens

from ..cache import read_pages, write_latents, write_pages
from ..errors import InputError
from ..sharding import shard_mapped
from .common import layer_norm, linear, rms_norm

INDEXER_NORM_EPS = 1e-6


def indexer_keys(p, h):
    """Per-token indexer state: k_idx = LayerNorm(wk(h)) and the pool gate compress_gate(h), [B, T, hd]."""
    k_idx = layer_norm(linear(h, p["wk"]), p["k_norm_weight"], p["k_norm_bias"], INDEXER_NORM_EPS)
    return k_idx, linear(h, p["compress_gate"])


def pool_key_of(keys, gate, ape):
    """keys, gate [..., P, hd] -> [..., hd]: sum_j softmax_j(gate_j + ape_j) * k_j, per channel."""
    logits = gate.astype(jnp.float32) + ape.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-2).astype(keys.dtype)
    return jnp.sum(probs * keys, axis=-2)


def pool_keys(k_idx, gate, ape, starts):
    """Keys of the pools that start at the keys `starts` [B, n_pools] (each P tokens long).

    k_idx, gate [B, S, hd]; ape [P, hd]. A pool reaching past S repeats the last token; it is never
    valid, and validity is the selection's concern.
    """
    b, s, hd = k_idx.shape
    n_pools, size = starts.shape[1], ape.shape[0]
    if n_pools == 0:
        return jnp.zeros((b, 0, hd), k_idx.dtype)
    flat = jnp.clip((starts[..., None] + jnp.arange(size, dtype=jnp.int32)).reshape(b, -1, 1), 0, s - 1)
    group = lambda x: jnp.take_along_axis(x, flat, axis=1).reshape(b, n_pools, size, hd)  # noqa: E731
    return pool_key_of(group(k_idx), group(gate), ape)


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


def attend_selected(p, q_resid, latents, indices, config, implementation, interpret, layout, page_table=None,
                    latent_scales=None):
    """o_lat [B, T, H, R]: each query over its selected latents ([B, S, R], or a cache's pages with
    `page_table` and `latent_scales`). A selection is distinct by construction (whole disjoint pools,
    then the tail after the last of them). Under a layout each device attends for its batch rows and
    heads; its pages are those of its rows (page ids local to the device's share of the pages), so
    a row's pages must lie in its own share, as `init_cache`'s page table places them."""
    paged = page_table is not None
    scaled = latent_scales is not None
    page_axes = () if layout is None or not paged else layout.mesh_axes("pages")

    def attend(q_lat, latents, indices, *extra):
        extra = list(extra)
        table = extra.pop(0) if paged else None
        if page_axes:
            table = table - jax.lax.axis_index(page_axes) * latents.shape[0]
        return sparse_latent_attention(
            q_lat, latents, indices, scale=config.qk_head_dim**-0.5, latent_scales=extra.pop(0) if scaled else None,
            page_table=table, implementation=implementation, interpret=interpret, distinct_indices=True,
        )

    q_axes = ("batch", "sequence", "heads", None)
    latent_axes = ("pages", None, None) if paged else ("batch", None, None)
    in_axes = (q_axes, latent_axes, ("batch", "sequence", None)) + ((("batch", None),) if paged else ()) + (
        (("pages", None),) if scaled else ()
    )
    args = (latent_query(p, q_resid, config), latents, indices) + ((page_table,) if paged else ()) + (
        (latent_scales,) if scaled else ()
    )
    return shard_mapped(layout, attend, in_axes, q_axes)(*args)


def select(q_idx, head_weights, pool_keys, key_valid, query_positions, config, implementation, interpret, layout,
           segment_ids=None):
    """`select_tokens` with the config's selection (segment_ids: packed sequences), on each device's
    batch rows under a layout."""
    run = lambda *args: select_tokens(  # noqa: E731
        *args[:5], index_topk=config.index_topk, pool_size=config.index_kpool,
        select_tail=config.index_kpool_always_select_tail, segment_ids=args[5] if len(args) > 5 else None,
        implementation=implementation, interpret=interpret,
    )
    in_axes = (("batch", "sequence", None, None), ("batch", "sequence", None), ("batch", None, None), ("batch", None),
               ("batch", "sequence")) + ((("batch", None),) if segment_ids is not None else ())
    args = (q_idx, head_weights, pool_keys, key_valid, query_positions) + ((segment_ids,) if segment_ids is not None else ())
    return shard_mapped(layout, run, in_axes, ("batch", "sequence", None))(*args)


def indexer_select(p, h, q_resid, key_valid, config, implementation=None, interpret=False, layout=None,
                   segment_ids=None):
    """The indexer over a whole sequence: selected key indices [B, T, W] (-1 padded) per query;
    `implementation` and `interpret` pick the selection's kernels (as in `select_tokens`); segment_ids
    [B, T]: packed sequences, each with its own pools. No gradient flows through it (transformers'
    neither): its only way to the loss is the discrete selection."""
    p, h, q_resid = jax.lax.stop_gradient((p, h, q_resid))
    b, t = h.shape[:2]
    n_pools = t // config.index_kpool
    k_idx, gate = indexer_keys(p, h)
    if segment_ids is None:  # pool p starts at the first valid key + p * P
        starts = pool_token_indices(first_valid_key(key_valid), n_pools, config.index_kpool)[..., 0]
    else:
        starts = packed_pools(segment_ids, n_pools, config.index_kpool).starts
    return select(
        indexer_queries(p, q_resid, config),
        indexer_head_weights(p, h),
        pool_keys(k_idx, gate, p["ape"], starts),
        key_valid,
        jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
        config, implementation, interpret, layout, segment_ids,
    )


def dsa_layer(p, h, config, key_valid, shared_indices=None, implementation=None, interpret=False, layout=None,
              segment_ids=None):
    """Uncached DSA sublayer. h [B, T, D]; key_valid [B, T] bool (the padding mask).

    A "full" layer (p has an indexer) selects its tokens; a "shared" layer takes `shared_indices`
    from the preceding full layer. `implementation` and `interpret` pick the kernels of the token
    selection and of the latent attention (as in `forward`); layout: the mesh; segment_ids [B, T]
    (packed sequences, key_valid their nonzero ones): each query selects within its own segment.
    Returns (y [B, T, D], selected indices [B, T, W]).
    """
    q_resid = rms_norm(linear(h, p["q_a_proj"]), p["q_a_norm"], config.rms_norm_eps)
    latents = rms_norm(linear(h, p["kv_a_proj"]), p["kv_a_norm"], config.rms_norm_eps)
    if "indexer" in p:
        indices = indexer_select(p["indexer"], h, q_resid, key_valid, config, implementation, interpret, layout,
                                 segment_ids)
    elif shared_indices is None:
        raise InputError("a 'shared' DSA layer needs the selected indices of the preceding full layer")
    else:
        indices = shared_indices
    o_lat = attend_selected(p, q_resid, latents, indices, config, implementation, interpret, layout)
    return latent_output(p, o_lat), indices


def complete_pools(layer_cache, page_table, ape, start, end, n_new):
    """Pool keys of the pools the new tokens complete (end of pool in (start, end]), written once.

    At most n_new // P + 1 pools complete per call; each is read back from the paged indexer cache.
    """
    pool_keys_cache = layer_cache["pool_keys"]
    b, max_pools, hd = pool_keys_cache.shape
    size = ape.shape[0]
    pool = start[:, None] // size + jnp.arange(n_new // size + 1)  # [B, J] candidate pools
    done = ((pool + 1) * size <= end[:, None]) & ((pool + 1) * size > start[:, None]) & (pool < max_pools)
    positions = (pool[..., None] * size + jnp.arange(size)).reshape(b, -1)
    positions = jnp.where(jnp.repeat(done, size, axis=1), positions, 0)
    group = lambda x: read_pages(x, page_table, positions).reshape(b, -1, size, hd)  # noqa: E731
    keys = pool_key_of(group(layer_cache["index_k"]), group(layer_cache["index_gate"]), ape)
    batch = jnp.arange(b)[:, None]
    return pool_keys_cache.at[batch, jnp.where(done, pool, max_pools)].set(keys.astype(pool_keys_cache.dtype), mode="drop")


def dsa_layer_cached(
    p, h, config, layer_cache, page_table, start, valid, shared_indices=None, implementation=None, interpret=False,
    layout=None,
):
    """DSA over new tokens appended to the cache. h [B, T, D]; start [B] tokens already cached;
    valid [B, T] marks each row's new tokens (a prefix); `implementation`, `interpret` as in `dsa_layer`.
    Returns (y, new layer cache, indices)."""
    b, t = h.shape[:2]
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)
    end = start + valid.sum(-1, dtype=jnp.int32)
    q_resid = rms_norm(linear(h, p["q_a_proj"]), p["q_a_norm"], config.rms_norm_eps)
    latents = rms_norm(linear(h, p["kv_a_proj"]), p["kv_a_norm"], config.rms_norm_eps)
    lc = write_latents(layer_cache, page_table, positions, valid, latents)
    if "indexer" in p:
        ip = p["indexer"]
        k_idx, gate = indexer_keys(ip, h)
        lc["index_k"] = write_pages(lc["index_k"], page_table, positions, valid, k_idx)
        lc["index_gate"] = write_pages(lc["index_gate"], page_table, positions, valid, gate)
        lc["pool_keys"] = complete_pools(lc, page_table, ip["ape"], start, end, t)
        lc["indexer_length"] = end
        max_len = page_table.shape[1] * lc["latent"].shape[1]
        key_valid = jnp.arange(max_len)[None] < end[:, None]
        indices = select(
            indexer_queries(ip, q_resid, config), indexer_head_weights(ip, h), lc["pool_keys"], key_valid, positions,
            config, implementation, interpret, layout,
        )
        last = jnp.clip(end - start - 1, 0, t - 1)
        rows = jnp.take_along_axis(indices, last[:, None, None], axis=1)[:, 0]
        rows = jnp.pad(rows, [(0, 0), (0, lc["selected"].shape[1] - rows.shape[1])], constant_values=-1)
        lc["selected"] = jnp.where((end > start)[:, None], rows, lc["selected"])
    elif shared_indices is None:
        raise InputError("a 'shared' DSA layer needs the selected indices of the preceding full layer")
    else:
        indices = shared_indices
    # The attention reads only the selected rows, through the page table, dequantising them itself.
    o_lat = attend_selected(
        p, q_resid, lc["latent"], indices, config, implementation, interpret, layout,
        page_table=page_table, latent_scales=lc.get("latent_scale"),
    )
    return latent_output(p, o_lat), lc, indices
