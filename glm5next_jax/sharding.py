"""Explicit sharding: every parameter (and cache) dimension has a logical axis name; one rules table
maps logical axes to mesh axes. One device is a mesh of one.

The default table shards the vocabulary, KDA channels, DSA latent heads and MLP widths over
"model" (tensor parallelism), experts over "expert" (expert parallelism) and the batch over "data".
Mesh axes a mesh lacks are dropped, so the same table serves any mesh.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .config import Config
from .params import param_axes

DEFAULT_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", "data"),
    ("vocab", "model"),
    ("embed", None),
    ("kda_channels", "model"),
    ("kda_heads", "model"),
    ("heads_latent", "model"),
    ("q_lora", None),
    ("kv_lora", None),
    ("index_heads_dim", None),
    ("mlp", "model"),
    ("experts", "expert"),
    ("expert_mlp", "model"),
    ("pages", None),
    ("sequence", None),
)


def make_mesh(data: int = 1, expert: int = 1, model: int | None = None, devices=None) -> Mesh:
    """A ("data", "expert", "model") mesh; `model` defaults to the devices left over."""
    devices = list(jax.devices() if devices is None else devices)
    if model is None:
        model = len(devices) // (data * expert)
    if data * expert * model != len(devices):
        raise ValueError(f"mesh data={data} x expert={expert} x model={model} != {len(devices)} devices")
    return Mesh(np.array(devices).reshape(data, expert, model), ("data", "expert", "model"))


def logical_to_spec(axes, mesh: Mesh, rules=DEFAULT_RULES) -> PartitionSpec:
    """PartitionSpec for one array's logical axes; a mesh axis is used at most once per array."""
    table = dict(rules)
    used = set()
    spec = []
    for name in axes:
        mesh_axis = table.get(name) if name is not None else None
        if name is not None and name not in table:
            raise ValueError(f"logical axis {name!r} has no rule; known: {sorted(table)}")
        if mesh_axis is None or mesh_axis not in mesh.axis_names or mesh_axis in used:
            spec.append(None)
        else:
            used.add(mesh_axis)
            spec.append(mesh_axis)
    return PartitionSpec(*spec)


def tree_shardings(axes_tree, mesh: Mesh, rules=DEFAULT_RULES):
    """NamedShardings for a tree of logical-axis tuples."""
    return jax.tree.map(
        lambda axes: NamedSharding(mesh, logical_to_spec(axes, mesh, rules)),
        axes_tree,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def param_shardings(config: Config, mesh: Mesh, rules=DEFAULT_RULES):
    return tree_shardings(param_axes(config), mesh, rules)


def check_divisible(shapes_tree, shardings_tree):
    """Raise one error listing every dimension that its mesh axes do not divide."""
    problems = []

    def check(path, shape, sharding):
        for dim, (size, axis) in enumerate(zip(shape.shape, sharding.spec)):
            if axis is not None and size % sharding.mesh.shape[axis]:
                problems.append(f"{jax.tree_util.keystr(path)} dim {dim} ({size}) over '{axis}' ({sharding.mesh.shape[axis]})")

    jax.tree_util.tree_map_with_path(check, shapes_tree, shardings_tree)
    if problems:
        raise ValueError("sharding does not divide:\n  " + "\n  ".join(problems))


def shard_params(params, config: Config, mesh: Mesh, rules=DEFAULT_RULES):
    """Place params on `mesh` by the rules table."""
    shardings = param_shardings(config, mesh, rules)
    check_divisible(params, shardings)
    return jax.device_put(params, shardings)


def shard_batch(x, mesh: Mesh, rules=DEFAULT_RULES):
    """Place a [B, ...] input with its batch over the data axis."""
    return jax.device_put(x, NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (x.ndim - 1), mesh, rules)))
