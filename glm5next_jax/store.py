"""Orbax save/restore of params (with their config) and of caches, restorable onto a given sharding.

    save_params(path, params, config)        -> path/params (orbax), path/glm5next.json
    config, params = restore_params(path, shardings=None)
    save_cache(path, cache); cache = restore_cache(path, shardings=None)

`shardings` is a tree of jax.sharding.Sharding matching the restored tree (e.g. from
sharding.param_shardings(config, layout) or layout.shardings(cache_axes(cache))); None restores onto
the default device.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from .config import Config
from .params import param_shapes

META = "glm5next.json"


def _save(path, tree):
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.abspath(path), tree, force=True)
    checkpointer.wait_until_finished()


def _restore(path, target):
    return ocp.StandardCheckpointer().restore(os.path.abspath(path), target)


def _with_shardings(shapes, shardings):
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), shapes)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def save_params(path, params, config: Config):
    os.makedirs(path, exist_ok=True)
    _save(os.path.join(path, "params"), params)
    with open(os.path.join(path, META), "w") as f:
        json.dump({"config": config.to_dict(), "dtype": str(params["embed_tokens"].dtype)}, f, indent=1)


def restore_params(path, shardings=None, *, layout=None):
    """(config, params) saved by save_params, placed by `shardings` (a tree like param_shapes) or by a
    layout's rules (each process reading its own devices' shards)."""
    with open(os.path.join(path, META)) as f:
        meta = json.load(f)
    config = Config(**meta["config"])
    if layout is not None:
        from .sharding import param_shardings

        shardings = param_shardings(config, layout)
    target = _with_shardings(param_shapes(config, meta["dtype"]), shardings)
    return config, _restore(os.path.join(path, "params"), target)


def save_cache(path, cache):
    """Save a generation's cache, to resume it later (pair it with the params it was made with)."""
    _save(path, cache)


def restore_cache(path, shardings=None):
    metadata = ocp.StandardCheckpointer().metadata(os.path.abspath(path)).item_metadata
    shapes = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), jnp.dtype(m.dtype)), metadata.tree)
    shapes = _as_lists(shapes)
    return _restore(path, _with_shardings(shapes, shardings))


def _as_lists(tree):
    """Orbax metadata keeps list nodes as dicts keyed "0", "1", ...; the cache has a list of layers."""
    if isinstance(tree, dict):
        if tree and all(k.isdigit() for k in tree):
            return [_as_lists(tree[str(i)]) for i in range(len(tree))]
        return {k: _as_lists(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_as_lists(v) for v in tree]
    return tree
