"""Stateful inference: prefill (also continuation prefill) and single-token decode over a cache.

Sequences are stored from cache slot 0; a left-padded prompt batch is compacted to the left first
(the model is position-free: pools start at the first real token and KDA ignores zeroed pads, so
the results are those of the padded forward). Each row advances by its own number of new tokens.
The checks of the engine's invariants run on the host, before any computation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import cache as cache_lib
from .config import DSA, Config
from .errors import InputError
from .layers.dsa import dsa_layer_cached
from .layers.kda import kda_layer_cached, kda_layer_decode
from .model import check_ids_in_range, check_token_batch, decoder_layer, embed, final_logits, padding
from .sharding import host_values, shard_batch


def _cached_layers(params, config: Config, streams, cache, valid, decode: bool, implementation, interpret, layout):
    """(streams, the new cache, each layer's internals as `forward` returns them)."""
    start = cache["lengths"]
    layers, internals = [], []
    indices = None
    for i, (p, lc) in enumerate(zip(params["layers"], cache["layers"])):

        def attend(pa, h, i=i, lc=lc, indices=indices):
            if config.layer_types[i] == DSA:
                y, new_lc, idx = dsa_layer_cached(
                    pa, h, config, lc, cache["page_table"], start, valid, indices, implementation, interpret, layout
                )
                return y, (new_lc, idx)
            if decode:
                y, new_lc = kda_layer_decode(pa, h, config, lc, implementation, interpret, layout)
            else:
                y, new_lc = kda_layer_cached(pa, h, config, lc, valid, implementation, interpret, layout)
            return y, (new_lc, None)

        streams, (lc, indices), inside = decoder_layer(p, streams, config, i, attend, implementation, interpret, layout)
        layers.append(lc)
        internals.append(inside if indices is None else dict(inside, selected=indices))
    new_cache = dict(cache, lengths=start + valid.sum(-1, dtype=jnp.int32), layers=layers)
    if layout is not None:  # the cache keeps its placement from step to step
        new_cache = jax.tree.map(layout.constrain, new_cache, cache_lib.cache_axes(new_cache))
    return streams, new_cache, internals


@functools.partial(jax.jit, static_argnames=("config", "implementation", "interpret", "layout", "return_internals"))
def _prefill(
    params, config: Config, ids, valid, offset, cache, implementation=None, interpret=False, layout=None,
    return_internals=False,
):
    streams = embed(params, ids, config, layout)
    streams, cache, internals = _cached_layers(
        params, config, streams, cache, valid, False, implementation, interpret, layout
    )
    logits = final_logits(params, streams, config, layout)
    # Back to the caller's layout: compacted position i of row b was at offset[b] + i.
    t = ids.shape[1]
    back = (jnp.arange(t)[None] - offset[:, None]) % t
    uncompact = lambda x: jnp.take_along_axis(x, back.reshape(back.shape + (1,) * (x.ndim - 2)), axis=1)  # noqa: E731
    if return_internals:
        return uncompact(logits), cache, jax.tree.map(uncompact, internals)
    return uncompact(logits), cache


@functools.partial(
    jax.jit, static_argnames=("config", "implementation", "interpret", "layout"), donate_argnames="cache"
)
def _decode(params, config: Config, token_ids, cache, implementation=None, interpret=False, layout=None):
    streams = embed(params, token_ids[:, None], config, layout)
    valid = jnp.ones(token_ids.shape + (1,), jnp.bool_)
    streams, cache, _ = _cached_layers(params, config, streams, cache, valid, True, implementation, interpret, layout)
    return final_logits(params, streams, config, layout)[:, 0], cache


def prefill(
    params, config: Config, ids, attention_mask, cache, *, implementation=None, interpret=False, layout=None,
    return_internals=False,
):
    """Append a chunk of tokens to every sequence of the cache; returns (logits [B, T, vocab], cache),
    and each layer's internals as `forward` returns them when `return_internals` (with the cache's
    latents: e.g. an fp8 cache's attention outputs).

    ids [B, T]; attention_mask [B, T] of 0/1 (None: all 1), each row left- or right-padded. Rows
    may add different numbers of tokens (a row of zeros adds none). On an empty cache this is the
    prompt prefill, on a live one a continuation prefill. implementation, interpret, layout: as in
    `forward` (the cache made by `init_cache` with the same layout).
    """
    check_token_batch(ids, attention_mask, config.vocab_size)
    ids = np.asarray(ids)
    mask = np.ones(ids.shape, bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
    offset, n_new = padding(mask)
    check_cache(params, config, cache, ids.shape[0], n_new)
    compact = (np.arange(ids.shape[1])[None] + offset[:, None]) % ids.shape[1]
    ids = np.take_along_axis(ids, compact, axis=1)
    valid = np.arange(ids.shape[1])[None] < n_new[:, None]
    inputs = [np.asarray(ids, np.int32), valid, np.asarray(offset, np.int32)]
    inputs = [jnp.asarray(x) if layout is None else shard_batch(x, layout) for x in inputs]
    return _prefill(params, config, *inputs, cache, implementation, bool(interpret), layout, bool(return_internals))


def decode_step(params, config: Config, token_ids, cache, *, implementation=None, interpret=False, layout=None):
    """One token for each sequence: token_ids [B] (or [B, 1]) -> (logits [B, vocab], cache).
    implementation, interpret, layout: as in `prefill`.

    The input cache's buffers are donated (updated in place on accelerators): use the returned one.
    """
    token_ids = np.asarray(token_ids)
    if token_ids.ndim == 2 and token_ids.shape[1] == 1:
        token_ids = token_ids[:, 0]
    if token_ids.ndim != 1 or not np.issubdtype(token_ids.dtype, np.integer):
        raise InputError(f"token_ids must be an integer array [B] or [B, 1], got {token_ids.dtype} {token_ids.shape}")
    check_ids_in_range(token_ids, config.vocab_size, "token_ids")
    check_cache(params, config, cache, token_ids.shape[0], np.ones(token_ids.shape[0], np.int64))
    return decode_unchecked(params, config, token_ids.astype(np.int32), cache, implementation, interpret, layout)


def decode_unchecked(params, config: Config, token_ids, cache, implementation=None, interpret=False, layout=None):
    """decode_step without the host-side checks, for loops that have checked their own bounds."""
    token_ids = jnp.asarray(token_ids, jnp.int32) if layout is None else shard_batch(token_ids, layout)
    return _decode(params, config, token_ids, cache, implementation, bool(interpret), layout)


def check_cache(params, config: Config, cache, batch: int, n_new) -> None:
    """The engine's invariants, checked before any computation (raises ValueError)."""
    indexed = [i for i, layer in enumerate(cache["layers"]) if "indexer_length" in layer]
    # One transfer for every length the checks read (each is a wait on the device's queue).
    lengths, indexer_lengths = host_values((cache["lengths"], [cache["layers"][i]["indexer_length"] for i in indexed]))
    lengths = np.asarray(lengths)
    if lengths.shape != (batch,):
        raise InputError(f"batch mismatch: the inputs have {batch} sequences, the cache {lengths.shape[0]}")
    dtype = params["embed_tokens"].dtype
    if cache_lib.cache_dtype(cache) != dtype:
        raise InputError(f"dtype mismatch: params are {dtype}, the cache was made for {cache_lib.cache_dtype(cache)}")
    if len(cache["layers"]) != config.num_hidden_layers:
        raise InputError(f"the cache has {len(cache['layers'])} layers, the config {config.num_hidden_layers}")
    rows = cache_lib.select_rows(cache)
    if rows is not None and not 0 < config.select_width <= rows:
        raise InputError(
            f"selection width k = {config.select_width} must be in [1, {rows}] (the cache's selection workspace rows)"
        )
    room = cache_lib.max_len(cache) - lengths
    if (np.asarray(n_new) > room).any():
        raise InputError(
            f"no room: sequences {np.nonzero(np.asarray(n_new) > room)[0].tolist()} would exceed the cache's "
            f"{cache_lib.max_len(cache)} tokens (lengths {lengths.tolist()}, adding {np.asarray(n_new).tolist()})"
        )
    for i, indexer_length in zip(indexed, indexer_lengths):
        behind = np.asarray(indexer_length) < lengths
        if behind.any():
            raise InputError(
                f"layer {i}: the indexer cache is behind the sequence for rows {np.nonzero(behind)[0].tolist()}"
            )
