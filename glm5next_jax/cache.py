"""Inference state, as a pytree passed in and returned (never mutated).

    cache = {
      "lengths":    [B] int32       tokens held per sequence (sequences start at slot 0),
      "page_table": [B, pages] int32 physical page of each sequence's logical page (all DSA layers),
      "layers": [per layer:
         KDA: {"conv": [B, 3, C, K] (the last K conv inputs, oldest first), "state": [B, H, dk, dv] fp32}
         DSA: {"latent": [n_pages, page_size, R] bf16 or fp8 e4m3, "latent_scale": [n_pages, page_size]
               fp32 (fp8 only: per-token scale), and on "full" layers the indexer cache:
               "index_k", "index_gate": [n_pages, page_size, hd] (paged like the latents),
               "pool_keys": [B, pool_rows(max_len, P), hd] (written once, when a pool completes; the
                   pools in whole blocks of the scores kernels', which read it in place),
               "indexer_length": [B] int32, "selected": [B, rows] int32 (the workspace: the last
               query's selected tokens)}],
    }

The page table starts as the identity (sequence b owns pages b*pages .. (b+1)*pages - 1); it is
data, so a caller may remap pages. Writes past a sequence's pages are dropped, never wrapped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.select_tokens import pool_rows

from .config import DSA, Config
from .errors import InputError, checked_int
from .sharding import check_divisible

FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)
LATENT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), FP8)


def init_cache(
    config: Config,
    batch: int,
    max_len: int,
    *,
    latent_dtype="bfloat16",
    page_size: int = 64,
    dtype="bfloat16",
    select_rows: int | None = None,
    layout=None,
):
    """An empty cache for `batch` sequences of up to `max_len` tokens.

    latent_dtype: "bfloat16", "float32" or "float8_e4m3fn" (with a per-token fp32 scale).
    dtype: the activation dtype of the params the cache will serve (KDA conv state, indexer keys).
    select_rows: rows of the selection workspace (default index_topk + kpool - 1).
    layout (`sharding.Layout`): places every entry by `cache_axes` (batch rows, and the pages of
    those rows, as the layout splits "batch"; KDA state and conv channels by head as "kda_heads").
    """
    latent_dtype, dtype = jnp.dtype(latent_dtype), jnp.dtype(dtype)
    if latent_dtype not in LATENT_DTYPES:
        raise InputError(f"latent_dtype must be one of {[str(d) for d in LATENT_DTYPES]}, got {latent_dtype}")
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise InputError(f"dtype must be bfloat16 or float32, got {dtype}")
    batch, max_len = checked_int("batch", batch, 1), checked_int("max_len", max_len, 1)
    page_size = checked_int("page_size", page_size, 1)
    if max_len % page_size:
        raise InputError(f"max_len ({max_len}) must be a multiple of page_size ({page_size})")
    rows = config.select_width if select_rows is None else select_rows
    if DSA not in config.layer_types:
        page_size = 1  # nothing is paged; the page table's width then says max_len (see `page_size`)
    pages = max_len // page_size
    n_pages = batch * pages
    c = config
    layers = []
    for i in range(c.num_hidden_layers):
        if c.layer_types[i] == DSA:
            layer = {"latent": jnp.zeros((n_pages, page_size, c.kv_lora_rank), latent_dtype)}
            if latent_dtype == FP8:
                layer["latent_scale"] = jnp.zeros((n_pages, page_size), jnp.float32)
            if c.indexer_types[i] == "full":
                layer.update(
                    index_k=jnp.zeros((n_pages, page_size, c.index_head_dim), dtype),
                    index_gate=jnp.zeros((n_pages, page_size, c.index_head_dim), dtype),
                    pool_keys=jnp.zeros((batch, pool_rows(max_len, c.index_kpool), c.index_head_dim), dtype),
                    indexer_length=jnp.zeros((batch,), jnp.int32),
                    selected=jnp.full((batch, rows), -1, jnp.int32),
                )
        else:
            layer = {
                "conv": jnp.zeros((batch, 3, c.kda_dim, c.linear_conv_kernel_dim), dtype),
                "state": jnp.zeros((batch, c.linear_num_heads, c.linear_head_dim, c.linear_head_dim), jnp.float32),
            }
        layers.append(layer)
    cache = {
        "lengths": jnp.zeros((batch,), jnp.int32),
        "page_table": jnp.arange(n_pages, dtype=jnp.int32).reshape(batch, pages),
        "layers": layers,
    }
    if layout is not None:
        shardings = layout.shardings(cache_axes(cache))
        check_divisible(cache, shardings)
        cache = jax.device_put(cache, shardings)
    return cache


def cache_axes(cache):
    """Logical axes of every cache array (for `sharding.Layout.shardings`)."""
    names = {
        "lengths": ("batch",), "page_table": ("batch", None), "conv": ("batch", None, "kda_channels", None),
        "state": ("batch", "kda_heads", None, None), "latent": ("pages", None, "kv_lora"),
        "latent_scale": ("pages", None), "index_k": ("pages", None, None), "index_gate": ("pages", None, None),
        "pool_keys": ("batch", None, None), "indexer_length": ("batch",), "selected": ("batch", None),
    }
    return {
        "lengths": names["lengths"],
        "page_table": names["page_table"],
        "layers": [{k: names[k] for k in layer} for layer in cache["layers"]],
    }


# ---- geometry -----------------------------------------------------------------------------------


def max_len(cache) -> int:
    return cache["page_table"].shape[1] * page_size(cache)


def page_size(cache) -> int:
    for layer in cache["layers"]:
        if "latent" in layer:
            return layer["latent"].shape[1]
    return 1


def cache_dtype(cache):
    for layer in cache["layers"]:
        if "conv" in layer:
            return layer["conv"].dtype
        if "index_k" in layer:
            return layer["index_k"].dtype
    return None


def select_rows(cache) -> int | None:
    for layer in cache["layers"]:
        if "selected" in layer:
            return layer["selected"].shape[1]
    return None


# ---- paged storage ------------------------------------------------------------------------------


def page_slots(page_table, positions, valid, n_pages, size):
    """(page, slot) of each token position [B, T]; invalid tokens go to page n_pages (dropped)."""
    logical = jnp.clip(positions // size, 0, page_table.shape[1] - 1)
    page = jnp.take_along_axis(page_table, logical, axis=1)
    in_range = valid & (positions // size < page_table.shape[1])
    return jnp.where(in_range, page, n_pages), positions % size


def write_pages(pages, page_table, positions, valid, values):
    """Store values [B, T, ...] at token positions [B, T] (where valid) of paged storage [n_pages, size, ...]."""
    page, slot = page_slots(page_table, positions, valid, pages.shape[0], pages.shape[1])
    return pages.at[page, slot].set(values.astype(pages.dtype), mode="drop")


def read_pages(pages, page_table, positions):
    """Values at token positions [B, N] -> [B, N, ...] (positions must lie inside the sequence's pages)."""
    size = pages.shape[1]
    page = jnp.take_along_axis(page_table, jnp.clip(positions // size, 0, page_table.shape[1] - 1), axis=1)
    return pages[page, positions % size]


def quantise_latent(latent):
    """fp32 latents [..., R] -> (e4m3 values, per-token fp32 scale) with max|x| mapped to the fp8 max."""
    latent = latent.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(latent), axis=-1) / FP8_MAX, jnp.finfo(jnp.float32).tiny)
    return (latent / scale[..., None]).astype(FP8), scale


def write_latents(layer, page_table, positions, valid, latents):
    if layer["latent"].dtype == FP8:
        values, scale = quantise_latent(latents)
        return dict(
            layer,
            latent=write_pages(layer["latent"], page_table, positions, valid, values),
            latent_scale=write_pages(layer["latent_scale"], page_table, positions, valid, scale),
        )
    return dict(layer, latent=write_pages(layer["latent"], page_table, positions, valid, latents))


# ---- bytes --------------------------------------------------------------------------------------


def bytes_per_token(config: Config, latent_dtype="bfloat16", dtype="bfloat16") -> dict[str, float]:
    """Cache bytes that grow with each token (DSA layers), and the fixed KDA state per sequence."""
    latent_dtype, dtype = jnp.dtype(latent_dtype), jnp.dtype(dtype)
    c = config
    latent = c.kv_lora_rank * latent_dtype.itemsize + (4 if latent_dtype == FP8 else 0)
    per_token = 0.0
    for i in range(c.num_hidden_layers):
        if c.layer_types[i] == DSA:
            per_token += latent
            if c.indexer_types[i] == "full":
                per_token += 2 * c.index_head_dim * dtype.itemsize + c.index_head_dim * dtype.itemsize / c.index_kpool
    kda_layers = c.layer_types.count("linear_attention")
    fixed = kda_layers * (
        3 * c.kda_dim * c.linear_conv_kernel_dim * dtype.itemsize + c.linear_num_heads * c.linear_head_dim**2 * 4
    )
    return {"per_token": per_token, "kda_state_per_sequence": float(fixed)}
