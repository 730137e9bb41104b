"""Explicit sharding: every parameter, cache entry and activation boundary names its dimensions with
logical axes; a `Layout` resolves them onto a mesh through flax's logical-axis rules
(`flax.linen.logical_to_mesh_axes`: the rules are candidates in order of precedence, and a mesh axis
serves at most one dimension of an array). One device is a mesh of one.

Meshes have the axes ("data", "expert", "model"). The layouts are named presets of one rules table,
`RULES`, each adding at most one candidate in front of it:
- "tp": everything over "model": DSA and KDA heads, MLP and every expert's intermediate width, the
  vocabulary; each device holds a slice of every expert.
- "tp-ep": as "tp", but the routed experts whole, split over "model" (36 a device on 8 for the
  released 288): the MoE moves tokens, never weights.
- "dp-ep": attention and KDA data-parallel (batch over "data", their weights replicated), the routed
  experts split over "data" (DeepSeek-style).
- "3d": the table alone on a data x expert x model mesh (batch over data, experts over expert, heads
  and widths over model).
Any layout may add FSDP (`fsdp=True`, for training): parameters and their optimizer state are kept
split over "data" too (`FSDP_RULES`, after the table: along embed, else q_lora or kv_lora, where no
other rule took "data"), and gathered a layer at a time for the compute (`Layout.gathered`).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallas_kernels import block_fp8
from pallas_kernels.block_fp8 import BLOCK

from .config import Config
from .errors import InputError
from .params import Fp8Weight, Leaf, is_fp8, param_axes, param_spec

MESH_AXES = ("data", "expert", "model")

# Logical axes: batch, sequence, embed, vocab, kda_heads, kda_channels (heads x head_dim), heads
# (DSA's), heads_latent (DSA heads x latent width), heads_q, heads_kv, heads_v (the train form's DSA
# heads x query, key + value and value widths), q_lora, kv_lora, index_heads_dim, mlp, experts,
# expert_mlp, pages (the paged caches' first dimension: pages follow their sequences' batch rows).
RULES: tuple[tuple[str, str], ...] = (
    ("batch", "data"),
    ("pages", "data"),
    ("vocab", "model"),
    ("kda_heads", "model"),
    ("kda_channels", "model"),
    ("heads", "model"),
    ("heads_latent", "model"),
    ("heads_q", "model"),
    ("heads_kv", "model"),
    ("heads_v", "model"),
    ("mlp", "model"),
    ("experts", "expert"),
    ("expert_mlp", "model"),
)
LAYOUTS: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {  # name: (the mesh axis its devices form, rules)
    "tp": ("model", RULES),
    "tp-ep": ("model", (("experts", "model"),) + RULES),
    "dp-ep": ("data", (("experts", "data"),) + RULES),
}
# Where FSDP keeps a parameter's other split: the candidates after the layout's own rules.
FSDP_RULES: tuple[tuple[str, str], ...] = (("embed", "data"), ("q_lora", "data"), ("kv_lora", "data"))


def is_axes(x) -> bool:
    """A leaf of a logical-axes tree: one name (or None) per dimension of an array."""
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


LOGICAL_AXES = frozenset({"sequence", "embed", "q_lora", "kv_lora", "index_heads_dim"} | {name for name, _ in RULES})


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh and the rules that place logical axes on it; hashable (a static argument of jit).
    fsdp: parameters kept split over "data" as well (`param_sharding`)."""

    mesh: Mesh
    rules: tuple[tuple[str, str], ...] = RULES
    name: str = "3d"
    fsdp: bool = False

    def spec(self, axes) -> PartitionSpec:
        """The PartitionSpec of an array whose dimensions have these logical axes (None: replicated)."""
        unknown = sorted({a for a in axes if a is not None and a not in LOGICAL_AXES})
        if unknown:
            raise InputError(f"logical axes {unknown} have no rule; known: {sorted(LOGICAL_AXES)}")
        # Mesh axes of one device split nothing: their rules give way to the next candidates.
        present = tuple((name, axis) for name, axis in self.rules if self.mesh.shape.get(axis, 1) > 1)
        return nn.logical_to_mesh_axes(tuple(axes), present)

    def sharding(self, axes) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes))

    def shardings(self, axes_tree):
        """NamedShardings for a tree of logical-axis tuples."""
        return jax.tree.map(self.sharding, axes_tree, is_leaf=is_axes)

    def param_sharding(self, axes) -> NamedSharding:
        """Where a parameter with these logical axes is kept (and its optimizer state): as `sharding`
        places it, and with fsdp split over "data" too by `FSDP_RULES`."""
        if not self.fsdp:
            return self.sharding(axes)
        return dataclasses.replace(self, rules=self.rules + FSDP_RULES, fsdp=False).sharding(axes)

    def gathered(self, params, axes_tree):
        """params (inside jit; `axes_tree` their logical axes) as the compute takes them: with fsdp each
        constrained to `sharding`, so that XLA gathers its "data" pieces there, and its gradient
        constrained back to `param_sharding`, so that the batch shards' partial gradients are
        reduce-scattered rather than all-reduced whole; without fsdp, params themselves."""
        if not self.fsdp:
            return params

        def gather(axes, x):
            compute, kept = self.sharding(axes), self.param_sharding(axes)

            @jax.custom_vjp
            def gathered(x):
                return jax.lax.with_sharding_constraint(x, compute)

            gathered.defvjp(lambda x: (gathered(x), None), lambda _, g: (jax.lax.with_sharding_constraint(g, kept),))
            return gathered(x)

        return jax.tree.map(gather, axes_tree, params, is_leaf=is_axes)

    def mesh_axes(self, name: str, array_axes=None) -> tuple[str, ...]:
        """The mesh axes that the logical axis `name` is split over, in an array with these logical
        axes (default: alone)."""
        array_axes = (name,) if array_axes is None else tuple(array_axes)
        entry = self.spec(array_axes)[array_axes.index(name)]
        return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)

    def size(self, name: str, array_axes=None) -> int:
        """How many parts the logical axis `name` is split into (in an array with these axes)."""
        return int(np.prod([self.mesh.shape[a] for a in self.mesh_axes(name, array_axes)], dtype=int))

    def constrain(self, x, axes):
        """x with its sharding pinned by logical axes (inside jit)."""
        return jax.lax.with_sharding_constraint(x, self.sharding(axes))

    def shard_map(self, fn, in_axes, out_axes):
        """fn under `jax.shard_map` on this mesh, its arguments' and results' specs from logical axes
        (trees of tuples, None for an argument that is None)."""
        to_specs = lambda tree: jax.tree.map(self.spec, tree, is_leaf=is_axes)  # noqa: E731
        return jax.shard_map(fn, mesh=self.mesh, in_specs=to_specs(in_axes), out_specs=to_specs(out_axes), check_vma=False)


def shard_mapped(layout: Layout | None, fn, in_axes, out_axes):
    """fn under `shard_map` on the layout's mesh (its arguments and results split by logical axes), or
    fn itself without a layout: how a kernel runs on its own shards, so that XLA never gathers its
    inputs (an opaque call under a mesh would have them whole)."""
    return fn if layout is None else layout.shard_map(fn, in_axes, out_axes)


def make_mesh(data: int = 1, expert: int = 1, model: int | None = None, devices=None) -> Mesh:
    """A ("data", "expert", "model") mesh; `model` defaults to the devices left over."""
    devices = list(jax.devices() if devices is None else devices)
    if model is None:
        model = len(devices) // (data * expert)
    if data * expert * model != len(devices):
        raise InputError(f"mesh data={data} x expert={expert} x model={model} != {len(devices)} devices")
    return Mesh(np.array(devices).reshape(data, expert, model), MESH_AXES)


def _preset(spec: str, available: int | None):
    """(name, rules, (data, expert, model) sizes) of a layout string; `available`: the devices that
    a size left out defaults to (None: none to default to, the size must be given)."""
    name, _, sizes = spec.partition(":")
    if not sizes and available is None:
        raise InputError(f"layout {spec!r} needs its device count without devices to count, e.g. '{name}:8'")
    if name == "3d":
        dims = [int(s) for s in sizes.split("x")] if sizes else [1, 1, available]
        if len(dims) != 3:
            raise InputError(f"a 3d layout takes data x expert x model sizes, e.g. '3d:2x2x2', got {spec!r}")
        return name, RULES, tuple(dims)
    if name not in LAYOUTS:
        raise InputError(f"unknown layout {name!r}; presets: {sorted(LAYOUTS) + ['3d']}")
    n = int(sizes) if sizes else available
    if n < 1 or (available is not None and n > available):
        raise InputError(f"layout {spec!r} asks for {n} devices; {available} are available")
    axis, rules = LAYOUTS[name]
    return name, rules, tuple(n if a == axis else 1 for a in MESH_AXES)


def make_layout(spec: str, devices=None, fsdp: bool = False) -> Layout:
    """A layout from "NAME:N" (a preset over N devices: tp, tp-ep, dp-ep) or "3d:DxExM"; N or the
    sizes default to every device. E.g. "tp-ep:8", "dp-ep", "3d:2x2x2". fsdp: `Layout.fsdp`."""
    devices = list(jax.devices() if devices is None else devices)
    name, rules, dims = _preset(spec, len(devices))
    n = int(np.prod(dims))
    return Layout(make_mesh(*dims, devices=devices[:n]), rules, name, fsdp)


def abstract_layout(spec: str, fsdp: bool = False) -> Layout:
    """The layout of a string with its sizes ("tp:8", "3d:2x2x2") on an abstract mesh: what each
    device would hold, worked out without the devices."""
    name, rules, dims = _preset(spec, None)
    return Layout(jax.sharding.AbstractMesh(dims, MESH_AXES), rules, name, fsdp)


def placed(shapes, axes, layout: Layout):
    """A tree of jax.ShapeDtypeStruct (shapes) with the layout's shardings of their logical axes."""
    return jax.tree.map(lambda s, a: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=layout.sharding(a)), shapes, axes,
                        is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))


def device_bytes(tree) -> int:
    """Bytes a device holds of a tree of placed arrays or ShapeDtypeStructs (shardings that divide
    their arrays: every device holds the same)."""
    return sum(int(np.prod(x.sharding.shard_shape(x.shape), dtype=np.int64)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def fp8_cut_axes(config: Config, layout: Layout) -> dict[str, tuple[int, ...]]:
    """The float8 weights that a layout cuts inside their 128 x 128 blocks: each one's path in the
    parameter tree (`jax.tree_util.keystr`) -> the axes of [*batch, out, in] cut there. A device then
    holds such a weight's scales per element along those axes (`scales_per_element`), so that its
    slice of the scales is the one its codes need; where in is cut, a row's 1 x 128 activation groups
    straddle devices too, and the layers quantize them with an all-reduce of the pieces' amax
    (`layers.common.quantize_split_rows`). The released widths cut whole blocks under every preset up
    to 16 devices."""
    cuts = {}

    def check(path, node):
        shape, axes = node.weight.shape, node.weight.axes
        cut = tuple(dim for dim in (len(shape) - 2, len(shape) - 1)
                    if axes[dim] and (parts := layout.size(axes[dim], axes)) > 1 and (shape[dim] // parts) % BLOCK)
        if cut:
            cuts[jax.tree_util.keystr(path)] = cut

    _each_fp8_node(check, param_spec(config, fp8=True))
    return cuts


def _each_fp8_node(fn, tree):
    """tree with fn(path, node) in place of each `Fp8Weight` node (nodes of specs, views or arrays)."""
    is_node = lambda x: isinstance(x, (Fp8Weight, Leaf))  # noqa: E731
    return jax.tree_util.tree_map_with_path(lambda p, x: fn(p, x) if isinstance(x, Fp8Weight) else x, tree, is_leaf=is_node)


def scales_per_element(tree, config: Config, layout: Layout, expand):
    """An FP8-form tree (of `Leaf` specs, loader views or arrays) as `layout` holds it: each weight that
    the layout cuts inside its blocks (`fp8_cut_axes`) as `expand(node, axes)`, its scales per
    element along those axes."""
    cuts = fp8_cut_axes(config, layout)
    return _each_fp8_node(lambda path, node: expand(node, cuts[key]) if (key := jax.tree_util.keystr(path)) in cuts
                          else node, tree)


def expand_spec(node: Fp8Weight, axes) -> Fp8Weight:
    """An `Fp8Weight` of specs with its scales per element on `axes` (`scales_per_element`'s expand)."""
    shape = tuple(n if dim in axes else s for dim, (n, s) in enumerate(zip(node.weight.shape, node.scale.shape)))
    return Fp8Weight(node.weight, dataclasses.replace(node.scale, shape=shape))


def expand_arrays(node: Fp8Weight, axes) -> Fp8Weight:
    """An `Fp8Weight` of arrays with its scales per element on `axes` (`scales_per_element`'s expand)."""
    return Fp8Weight(node.weight, block_fp8.expand_scales(node.scale, node.weight.shape, axes))


def layout_param_spec(config: Config, layout: Layout, fp8: bool = False):
    """`params.param_spec` as `layout` holds it (the FP8 form's cut scales per element)."""
    spec = param_spec(config, fp8)
    return scales_per_element(spec, config, layout, expand_spec) if fp8 else spec


def param_shardings(config: Config, layout: Layout, fp8: bool = False, form: str = "inference"):
    """The parameters' shardings (fp8: of the FP8 form, its scales split alike with their codes;
    `form` as for `params.param_spec`)."""
    if fp8 and layout.fsdp:
        raise InputError("fsdp keeps the bf16 and fp32 forms split over data; the FP8 form is placed without it")
    return jax.tree.map(layout.param_sharding, param_axes(config, fp8, form), is_leaf=is_axes)


def indivisible(shapes_tree, shardings_tree) -> list[str]:
    """Every dimension of a tree of arrays (or shapes) that its mesh axes do not divide, by name."""
    problems = []

    def check(path, shape, sharding):
        for dim, (size, axes) in enumerate(zip(shape.shape, sharding.spec)):
            parts = int(np.prod([sharding.mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ())]))
            if size % parts:
                problems.append(f"{jax.tree_util.keystr(path)} dim {dim} ({size}) over {axes} ({parts})")

    jax.tree_util.tree_map_with_path(check, shapes_tree, shardings_tree)
    return problems


def check_divisible(shapes_tree, shardings_tree):
    """Raise one error listing every dimension that its mesh axes do not divide."""
    problems = indivisible(shapes_tree, shardings_tree)
    if problems:
        raise InputError("sharding does not divide:\n  " + "\n  ".join(problems))


def shard_params(params, config: Config, layout: Layout, form: str = "inference"):
    """Place params (of `params.param_spec`'s `form`) on the layout's mesh by its rules (in the FP8
    form, the scales of the weights it cuts inside blocks per element along the cut:
    `scales_per_element`)."""
    fp8 = is_fp8(params)
    if fp8:
        params = scales_per_element(params, config, layout, expand_arrays)
    shardings = param_shardings(config, layout, fp8, form)
    check_divisible(params, shardings)
    return jax.device_put(params, shardings)


def shard_batch(x, layout: Layout):
    """Place a [B, ...] input (the same host array in every process) with its batch split as the
    layout splits "batch"; each process places its own devices' rows."""
    sharding = layout.sharding(("batch",) + (None,) * (np.ndim(x) - 1))
    if isinstance(x, jax.Array):
        return jax.device_put(x, sharding)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])


def host_values(tree):
    """The arrays of a tree as numpy, whole in every process (a multi-process array's other
    processes' shards gathered first), fetched in one transfer."""
    from jax.experimental import multihost_utils

    def whole(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return multihost_utils.process_allgather(x, tiled=True)
        return x

    return jax.device_get(jax.tree.map(whole, tree))
