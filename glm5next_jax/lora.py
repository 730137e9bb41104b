"""LoRA adapters, in PEFT's format: low-rank updates W + s B A of the model's linears, trained with
the base frozen, merged into it and taken out again, saved and loaded as PEFT saves them.

Targets are transformers' module names (PEFT's `target_modules`): KDA's q_proj, k_proj, v_proj,
f_a_proj, f_b_proj, b_proj, g_a_proj, g_b_proj, o_proj; DSA's q_a_proj, q_b_proj,
kv_a_proj_with_mqa, kv_b_proj, o_proj; the dense and shared-expert MLPs' gate_proj, up_proj,
down_proj; and the routed experts' 3-D parameters (PEFT's `target_parameters`),
experts.gate_up_proj and experts.down_proj, each expert its own A and B. The indexer (no gradient
reaches it), the router, embeddings and lm_head take none. Where our tree fuses modules (q, k and v
in `qkv_proj`; gate and up in `gate_up`) they are targeted together.

An adapted weight is a `LoraWeight` leaf in place of its weight (`attach`); `layers.common.linear`
adds the adapter's product x A^T B^T s to the base's, never forming B A, and the MoE runs its
experts' adapters over the grouped GEMM's tiled rows, each tile through its expert's A and B in one
batched product (`expert_rows`). The base stays as it is: bf16 or float32, or `Fp8Weight`s (FP8
release form, inference form: DSA's q_b_proj, kv_b_proj and o_proj are absorbed there, so they
take no adapter; the train form has them). `merge` and `unmerge` add and take out s B A.

Optionally (`shared_expert_a`) the routed experts share one A (a [in, parts, r]) and keep their own
B: PEFT has no form for that, so `save_adapters` writes the shared A once for every expert and
`load_adapters` reads per-expert A's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .config import DSA, Config
from .errors import InputError
from .params import Fp8Weight

# transformers' module under a layer -> (our weight's path in the layer, which part, parts fused there)
_KDA = {
    "self_attn.q_proj": (("attn", "qkv_proj"), 0, 3),
    "self_attn.k_proj": (("attn", "qkv_proj"), 1, 3),
    "self_attn.v_proj": (("attn", "qkv_proj"), 2, 3),
    "self_attn.forget_gate.f_a_proj": (("attn", "f_a"), 0, 1),
    "self_attn.forget_gate.f_b_proj": (("attn", "f_b"), 0, 1),
    "self_attn.b_proj": (("attn", "b_proj"), 0, 1),
    "self_attn.g_a_proj": (("attn", "g_a"), 0, 1),
    "self_attn.g_b_proj": (("attn", "g_b"), 0, 1),
    "self_attn.o_proj": (("attn", "o_proj"), 0, 1),
}
_DSA = {
    "self_attn.q_a_proj": (("attn", "q_a_proj"), 0, 1),
    "self_attn.q_b_proj": (("attn", "q_b_proj"), 0, 1),
    "self_attn.kv_a_proj_with_mqa": (("attn", "kv_a_proj"), 0, 1),
    "self_attn.kv_b_proj": (("attn", "kv_b_proj"), 0, 1),
    "self_attn.o_proj": (("attn", "o_proj"), 0, 1),
}


def _mlp(prefix, path):
    return {
        f"{prefix}gate_proj": ((*path, "gate_up"), 0, 2),
        f"{prefix}up_proj": ((*path, "gate_up"), 1, 2),
        f"{prefix}down_proj": ((*path, "down"), 0, 1),
    }


_DENSE = _mlp("mlp.", ("mlp",))
_MOE = {
    **_mlp("mlp.shared_experts.", ("mlp", "shared")),
    "mlp.experts.gate_up_proj": (("mlp", "experts_gate_up"), 0, 1),
    "mlp.experts.down_proj": (("mlp", "experts_down"), 0, 1),
}
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # PEFT's target_parameters, in order
TARGETS = ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj",
           "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "gate_proj", "up_proj", "down_proj",
           "experts.gate_up_proj", "experts.down_proj")
LAYER_PREFIX = "model.language_model.layers."  # where transformers' Glm5NextForConditionalGeneration keeps them
PEFT_PREFIX = "base_model.model."  # what PEFT puts before a module's name in the adapter's file


class Adapter(NamedTuple):
    """One adapted weight's factors in our layout: a [*experts, in, parts, r] (A^T of each fused
    module), b [*experts, parts, r, *rest] (B^T, rest the base's out dimensions after the fused one:
    qkv_proj [D, 3, C] has b [3, r, C], experts_gate_up [E, D, 2, I] b [E, 1, r, 2, I]), so that b
    splits over a mesh as its base does. A routed experts' adapter may hold one A for all experts:
    a [in, parts, r]."""

    a: Any
    b: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraWeight:
    """A frozen weight (ours [*experts, in, *out], or its `Fp8Weight`) and its adapter, whose product
    is scaled by `scaling` (alpha / r, or alpha / sqrt(r) with rsLoRA); `experts`: the routed experts'
    weight, its first axis the experts'."""

    base: Any
    adapter: Adapter
    scaling: float = dataclasses.field(metadata={"static": True})
    experts: bool = dataclasses.field(default=False, metadata={"static": True})


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """rank r, lora_alpha, the targeted module names (`TARGETS`' vocabulary), rsLoRA's scaling, and
    whether the routed experts share one A. Hashable: a jitted step takes it as a static argument."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = TARGETS
    use_rslora: bool = False
    shared_expert_a: bool = False

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise InputError(f"rank must be an int >= 1, got {self.rank!r}")
        if not self.alpha > 0:
            raise InputError(f"alpha must be > 0, got {self.alpha!r}")
        unknown = sorted(set(self.targets) - set(TARGETS))
        if unknown or not self.targets:
            raise InputError(f"targets must be some of {TARGETS}, got {list(self.targets)}")
        for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            if 0 < len(set(group) & set(self.targets)) < len(group):
                raise InputError(f"targets {group} are one weight here: target all of them or none")

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def layer_modules(config: Config, layer: int) -> dict:
    """{transformers module under the layer: (our path, part, parts)} of every adaptable linear."""
    modules = dict(_DSA if config.layer_types[layer] == DSA else _KDA)
    modules.update(_MOE if config.mlp_layer_types[layer] == "sparse" else _DENSE)
    if config.mlp_layer_types[layer] == "sparse" and config.n_shared_experts == 0:
        modules = {m: t for m, t in modules.items() if ".shared_experts." not in m}
    return modules


def _targeted(module: str, spec: LoraSpec) -> bool:
    return any(module == t or module.endswith("." + t) for t in spec.targets) and (
        ".experts." not in module or module.split(".", 1)[1] in spec.targets)


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree, path, value):
    if not path:
        return value
    return {**tree, path[0]: _set(tree[path[0]], path[1:], value)}


def _is_experts(path) -> bool:
    return path[-1].startswith("experts_")


def weight_dims(weight, experts: bool) -> tuple[tuple, int, tuple]:
    """(experts dims, in, out dims) of a weight in our layout, or of its `Fp8Weight` [*experts, *out, in]."""
    batch = 1 if experts else 0
    if isinstance(weight, Fp8Weight):
        shape = weight.weight.shape
        return shape[:batch], shape[-1], shape[batch:-1]
    shape = weight.shape
    return shape[:batch], shape[batch], shape[batch + 1:]


def _plan(params, config: Config, spec: LoraSpec):
    """[(layer, {our path (joined by "."): (path, parts, [modules in part order])})] of what `spec`
    adapts; a target the tree lacks (DSA's absorbed projections in the inference form) is refused."""
    plan = []
    for i, layer in enumerate(params["layers"]):
        weights = {}
        for module, (path, part, parts) in layer_modules(config, i).items():
            if not _targeted(module, spec):
                continue
            try:
                _get(layer, path)
            except KeyError:
                raise InputError(f"layer {i}'s {module} is absorbed in this parameter tree (inference form): load the "
                                 "checkpoint's train form (form='train') to adapt it, or leave it out of the targets")
            entry = weights.setdefault(".".join(path), (path, parts, [None] * parts))
            entry[2][part] = module
        plan.append((i, weights))
    return plan


def init_adapters(params, config: Config, spec: LoraSpec, key, dtype=jnp.float32):
    """Fresh adapters for `params` (our tree, any form): A as PEFT draws it (Kaiming-uniform, bounds
    +-1/sqrt(in)), B zero, so the adapted model starts as the base. -> {"layers": [{path: Adapter}]}."""
    layers = []
    for i, weights in _plan(params, config, spec):
        adapters = {}
        for name, (path, parts, _) in weights.items():
            experts, fan_in, out = weight_dims(_get(params["layers"][i], path), _is_experts(path))
            rest = out[1:] if parts > 1 else out
            a_batch = () if spec.shared_expert_a else experts
            key, draw = jax.random.split(key)
            bound = 1 / math.sqrt(fan_in)
            a = jax.random.uniform(draw, (*a_batch, fan_in, parts, spec.rank), jnp.float32, -bound, bound)
            adapters[name] = Adapter(a.astype(dtype), jnp.zeros((*experts, parts, spec.rank, *rest), dtype))
        layers.append(adapters)
    return {"layers": layers}


def attach(params, adapters, spec: LoraSpec):
    """params with each adapted weight a `LoraWeight` of it and its adapter."""
    layers = []
    for layer, adapted in zip(params["layers"], adapters["layers"], strict=True):
        for name, adapter in adapted.items():
            path = tuple(name.split("."))
            layer = _set(layer, path, LoraWeight(_get(layer, path), adapter, spec.scaling, _is_experts(path)))
        layers.append(layer)
    return {**params, "layers": layers}


def lora_product(x, w: LoraWeight):
    """x [..., in] through a dense weight's adapter: s (x A^T) B^T as [..., *out], in x's dtype (the
    product in the adapter's dtype)."""
    a, b = w.adapter
    _, _, out = weight_dims(w.base, False)
    low = jnp.einsum("...i,ipr->...pr", x.astype(a.dtype), a, precision=jax.lax.Precision.HIGHEST)
    b = b.reshape(*b.shape[:2], -1)
    y = jnp.einsum("...pr,prn->...pn", low, b, precision=jax.lax.Precision.HIGHEST) * w.scaling
    return y.reshape(*x.shape[:-1], *out).astype(x.dtype)


def adapter_axes(w: LoraWeight, axes) -> Adapter:
    """The logical axes of `w`'s adapter from its base's in our layout [*experts, in, *out]: A split
    as the base's in dimension, B as its out dimensions after the fused one; ranks and parts whole."""
    batch = 1 if w.experts else 0
    parts = w.adapter.b.shape[batch]
    rest = axes[batch + 1:][1:] if parts > 1 else axes[batch + 1:]
    a_batch = axes[:batch] if w.adapter.a.ndim == 3 + batch else ()  # else one A for all experts
    return Adapter((*a_batch, axes[batch], None, None), (*axes[:batch], None, None, *rest))


def adapters_axes(adapters, config: Config):
    """The tree of each adapter's logical axes (`adapter_axes` of its base's, which every form
    shares where the adapter can be), for placing the adapters and their moments on a mesh."""
    from .params import param_axes

    axes = param_axes(config, form="train")
    out = []
    for i, layer in enumerate(adapters["layers"]):
        placed = {}
        for name, adapter in layer.items():
            path = tuple(name.split("."))
            base = _get(axes["layers"][i], path)
            placed[name] = adapter_axes(LoraWeight(None, adapter, 1.0, _is_experts(path)), base)
        out.append(placed)
    return {"layers": out}


def expert_rows(rows, w: LoraWeight, tile_experts, block_rows: int):
    """The routed experts' adapter on the grouped GEMM's tiled rows [tiles x block_rows, in]: each
    tile's rows through its expert's A and B (`tile_experts` [tiles]), one batched product for all
    tiles -> [rows, parts x n] in rows' dtype."""
    a, b = w.adapter
    x = rows.reshape(tile_experts.shape[0], block_rows, rows.shape[-1]).astype(a.dtype)
    hi = jax.lax.Precision.HIGHEST
    if a.ndim == 3:  # one A for all experts
        low = jnp.einsum("tmi,ipr->tmpr", x, a, precision=hi)
    else:
        low = jnp.einsum("tmi,tipr->tmpr", x, a[tile_experts], precision=hi)
    b = b[tile_experts].reshape(*tile_experts.shape, *b.shape[1:3], -1)
    y = jnp.einsum("tmpr,tprn->tmpn", low, b, precision=hi) * w.scaling
    return y.reshape(rows.shape[0], -1).astype(rows.dtype)


def delta(w: LoraWeight):
    """s B A in the base's layout [*experts, in, *out], fp32."""
    a, b = w.adapter
    experts, fan_in, out = weight_dims(w.base, w.experts)
    b = b.reshape(*experts, *b.shape[len(experts):len(experts) + 2], -1)
    hi = jax.lax.Precision.HIGHEST
    spec = "ipr,...prn->...ipn" if a.ndim == 3 else "...ipr,...prn->...ipn"
    d = jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32), precision=hi) * w.scaling
    return d.reshape(*experts, fan_in, *out)


def merged(w: LoraWeight):
    """The base with s B A added, in the base's dtype."""
    if isinstance(w.base, Fp8Weight):
        raise InputError("merging into an FP8 weight would requantize it: merge into a bf16 or float32 base")
    return (w.base.astype(jnp.float32) + delta(w)).astype(w.base.dtype)


def _replace_adapted(params, adapters, spec, fn):
    attached = attach(params, adapters, spec)
    return jax.tree.map(lambda x: fn(x) if isinstance(x, LoraWeight) else x, attached,
                        is_leaf=lambda x: isinstance(x, LoraWeight))


def merge(params, adapters, spec: LoraSpec):
    """A plain parameter tree: each adapted weight W + s B A, in W's dtype."""
    return _replace_adapted(params, adapters, spec, merged)


def unmerge(params, adapters, spec: LoraSpec):
    """`merge`'s inverse: each adapted weight W - s B A (exact up to W's rounding)."""
    return _replace_adapted(
        params, adapters, spec, lambda w: (w.base.astype(jnp.float32) - delta(w)).astype(w.base.dtype)
    )


def _to_peft(adapter: Adapter, part: int, experts: bool):
    """(lora_A.weight, lora_B.weight) of one module as PEFT stores them: [r, in] and [out, r]; an
    experts' parameter [r x E, in] (expert-major rows) and [out, r x E] (rank-major columns)."""
    a, b = (np.asarray(x, np.float32) for x in adapter)
    b = b.reshape(*b.shape[: 3 if experts else 2], -1)
    if not experts:
        return a[:, part, :].T, b[part].T
    e, _, r, n = b.shape
    a = np.broadcast_to(a, (e, *a.shape[-3:]))[:, :, part, :]  # [E, in, r]
    return a.transpose(0, 2, 1).reshape(e * r, -1), b[:, part].transpose(2, 1, 0).reshape(n, r * e)


def _peft_modules(config: Config, spec: LoraSpec, layer: int, order=EXPERT_PARAMETERS):
    """{transformers module: the name PEFT gives its adapter in the file} under one layer: a module's
    own name, and for the experts' parameters their nested wrappers' (the first of `order`, the
    adapter config's target_parameters, wraps innermost, under `base_layer`)."""
    modules = [m for m in layer_modules(config, layer) if _targeted(m, spec)]
    wrapped = [m for m in order if m in modules]
    return {m: "mlp.experts" + ".base_layer" * (len(wrapped) - 1 - wrapped.index(m)) if m in wrapped else m
            for m in modules}


def adapter_tensors(adapters, config: Config, spec: LoraSpec) -> dict[str, np.ndarray]:
    """The adapter file's tensors, named as PEFT names them (float32)."""
    tensors = {}
    for i, weights in enumerate(adapters["layers"]):
        names = _peft_modules(config, spec, i)
        for module, (path, part, _) in layer_modules(config, i).items():
            if module not in names:
                continue
            lora_a, lora_b = _to_peft(weights[".".join(path)], part, _is_experts(path))
            stem = f"{PEFT_PREFIX}{LAYER_PREFIX}{i}.{names[module]}"
            # safetensors writes an array's buffer as it lies: each made C-contiguous first
            tensors[f"{stem}.lora_A.weight"] = np.ascontiguousarray(lora_a)
            tensors[f"{stem}.lora_B.weight"] = np.ascontiguousarray(lora_b)
    return tensors


def peft_config(config: Config, spec: LoraSpec, base_model: str | None = None) -> dict:
    """adapter_config.json's content: PEFT's LoraConfig, target_modules a regular expression over the
    language model's layers (transformers' model also holds a vision tower)."""
    modules = sorted({m for i in range(config.num_hidden_layers) for m in _peft_modules(config, spec, i)
                      if m not in EXPERT_PARAMETERS})
    parameters = [m for m in EXPERT_PARAMETERS if any(m in _peft_modules(config, spec, i)
                                                     for i in range(config.num_hidden_layers))]
    return {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "use_rslora": spec.use_rslora,
        "target_modules": re.escape(LAYER_PREFIX) + r"\d+\.(" + "|".join(re.escape(m) for m in modules) + ")",
        "target_parameters": parameters or None,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def save_adapters(path, adapters, config: Config, spec: LoraSpec, base_model: str | None = None):
    """adapter_config.json and adapter_model.safetensors in the folder `path` (PEFT's
    `save_pretrained` layout: `PeftModel.from_pretrained(transformers_model, path)` reads them),
    replacing what is there only once both are complete."""
    from safetensors.numpy import save_file

    from .store import write_atomically

    tensors = adapter_tensors(adapters, config, spec)

    def write(folder):
        if jax.process_index() != 0:
            return
        os.makedirs(folder, exist_ok=True)
        save_file(tensors, os.path.join(folder, ADAPTER_WEIGHTS))
        with open(os.path.join(folder, ADAPTER_CONFIG), "w") as f:
            json.dump(peft_config(config, spec, base_model), f, indent=2)
            f.flush()
            os.fsync(f.fileno())

    write_atomically(path, ADAPTER_CONFIG, write)


def _check_peft_config(peft: dict, path):
    if peft.get("peft_type") != "LORA":
        raise InputError(f"{path}: peft_type is {peft.get('peft_type')!r}; only LoRA adapters ('LORA') load here")
    for field, plain in (("bias", "none"), ("fan_in_fan_out", False), ("use_dora", False)):
        if peft.get(field, plain) not in (plain, None):
            raise InputError(f"{path}: {field} = {peft[field]!r} is not supported here (expected {plain!r})")
    for field in ("rank_pattern", "alpha_pattern", "layers_to_transform", "modules_to_save"):
        if peft.get(field):
            raise InputError(f"{path}: {field} = {peft[field]!r} is not supported here (one rank and alpha for "
                             "every adapted module, nothing else saved)")


def load_adapters(path, params, config: Config, dtype=jnp.float32):
    """(adapters, spec) from a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) for
    our `params` (the tree they attach to). Every tensor in the file must be one of the model's
    adaptable linears, each fused group whole; the experts' A's are read per expert."""
    from safetensors.numpy import load_file

    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not os.path.isfile(os.path.join(path, name)):
            raise InputError(f"{path}: no {name} (a PEFT LoRA adapter folder holds both)")
    with open(os.path.join(path, ADAPTER_CONFIG)) as f:
        peft = json.load(f)
    tensors = dict(load_file(os.path.join(path, ADAPTER_WEIGHTS)))
    _check_peft_config(peft, path)
    order = tuple(peft.get("target_parameters") or ())
    if set(order) - set(EXPERT_PARAMETERS):
        raise InputError(f"{path}: target_parameters {list(order)} must be some of {list(EXPERT_PARAMETERS)}")
    targets = {m.split(".", 1)[1] for m in order}
    for name in tensors:
        match = re.fullmatch(re.escape(PEFT_PREFIX + LAYER_PREFIX) + r"(\d+)\.(.+)\.lora_[AB]\.weight", name)
        if match is None or int(match[1]) >= config.num_hidden_layers:
            raise InputError(f"{path}: {name} is not an adapter of this model's layers")
        module = match[2]
        if re.fullmatch(r"mlp\.experts(\.base_layer)*", module):
            if not order:
                raise InputError(f"{path}: {name} adapts the routed experts but target_parameters names none")
        elif module in layer_modules(config, int(match[1])):
            targets.add(module.rsplit(".", 1)[1])
        else:
            raise InputError(f"{path}: layer {match[1]}'s {module} is not an adaptable linear of this model")
    spec = LoraSpec(rank=int(peft["r"]), alpha=peft["lora_alpha"], targets=tuple(sorted(targets)),
                    use_rslora=bool(peft.get("use_rslora")))
    adapters = init_adapters(params, config, spec, jax.random.key(0), dtype)
    layers = []
    for (i, planned), weights in zip(_plan(params, config, spec), adapters["layers"]):
        names = _peft_modules(config, spec, i, order)
        filled = {}
        for key, (weight_path, _, modules) in planned.items():
            a, b_shaped = (np.array(x, np.float32) for x in weights[key])
            b = b_shaped.reshape(*b_shaped.shape[: 3 if _is_experts(weight_path) else 2], -1)
            for part, module in enumerate(modules):
                stem = f"{PEFT_PREFIX}{LAYER_PREFIX}{i}.{names[module]}"
                if f"{stem}.lora_A.weight" not in tensors or f"{stem}.lora_B.weight" not in tensors:
                    raise InputError(f"{path}: no {stem}.lora_A / lora_B (adapters of the targets {sorted(targets)})")
                lora_a, lora_b = tensors[f"{stem}.lora_A.weight"], tensors[f"{stem}.lora_B.weight"]
                if _is_experts(weight_path):
                    e, r, n = b.shape[0], spec.rank, b.shape[-1]
                    want = ((e * r, a.shape[-3]), (n, r * e))
                    a_part = lora_a.reshape(e, r, -1).transpose(0, 2, 1) if lora_a.shape == want[0] else None
                    b_part = lora_b.reshape(n, r, e).transpose(2, 1, 0) if lora_b.shape == want[1] else None
                else:
                    want = ((spec.rank, a.shape[0]), (b.shape[-1], spec.rank))
                    a_part = lora_a.T if lora_a.shape == want[0] else None
                    b_part = lora_b.T if lora_b.shape == want[1] else None
                if a_part is None or b_part is None:
                    raise InputError(f"{path}: {stem}'s lora_A, lora_B are {lora_a.shape}, {lora_b.shape}; "
                                     f"this model's are {want[0]}, {want[1]}")
                a[..., part, :], b[..., part, :, :] = a_part, b_part
            filled[key] = Adapter(jnp.asarray(a, dtype), jnp.asarray(b.reshape(b_shaped.shape), dtype))
        layers.append(filled)
    return {"layers": layers}, spec
