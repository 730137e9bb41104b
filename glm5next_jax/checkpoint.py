"""Load transformers GLM-5-Next checkpoints (sharded safetensors) into the parameter tree.

Two namings are read: the release naming that `save_pretrained` writes (per-expert tensors, split
q/k/v convs, `hc_attn_fn`, forget-gate tensors on `self_attn`) and transformers' in-memory naming
(`experts.gate_up_proj`, `conv1d`, `attn_hc.fn`, `forget_gate.*`). Text weights may sit under
`model.language_model.`, `model.` or no prefix; `lm_head.weight` at the top.

Each parameter is first a lazy view of the stored tensors (`tensor_views`); every shape is checked
before any data is read. With a layout, each device's slice of each parameter is read from the files
and put on that device (the release's per-expert tensors read only by the devices that hold those
experts); stored bf16 stays bf16 on the host. The DSA projections are absorbed in fp32 a head at a
time (q_absorb, o_absorb), the indexer's head weights pre-scaled by index_n_heads^-0.5, and gates,
conv, mHC, router and ape kept in fp32.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from .check import CheckReport, summarise
from .config import DSA, Config, read_config_json
from .errors import InputError, MissingFileError
from .fp8_views import expand_views, fp8_views
from .params import FORMS, Leaf, leaf_dtype, param_spec
from .progress import ByteProgress
from .quantization import SCALE_SUFFIX, QuantizationConfig, scale_problems
from .tensor_views import (
    FLOAT8,
    ArraySource,
    BlockScaled,
    PerGroup,
    Scaled,
    SplitAxis,
    Squeeze,
    Stack,
    Tensor,
    TensorFiles,
    Transpose,
)

__all__ = ["ArraySource", "LoadPlan", "Reader", "TensorFiles", "check", "load_checkpoint", "plan_load"]

log = logging.getLogger("glm5next_jax")

TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.", "")
VISION_PATTERN = re.compile(r"(^|\.)(visual|vision_tower|vision_model)\.")
LAYER_PATTERN = re.compile(r"^layers\.(\d+)\.")


class Reader:
    """Takes tensors by (alternative) names, checking shapes; collects every problem for one error.

    Names are relative to `prefix`; a name starting with "/" is absolute (lm_head.weight).
    """

    def __init__(self, source, prefix: str = "", wanted=None, scales=None):
        self.source, self.prefix = source, prefix
        self.scales = scales or {}  # float8 weight -> its block scales
        wanted = set(source.names()) if wanted is None else wanted
        self.unused = set(wanted)
        self.unavailable = getattr(source, "unavailable", set())  # named by the source's own problems
        self.missing: list[str] = []
        self.misshaped: list[str] = []
        self.mistyped: list[str] = []

    def has(self, name):
        return self.prefix + name in self.source

    def problems(self):
        return (
            [f"missing: {n}" for n in self.missing]
            + [f"mis-shaped: {m}" for m in self.misshaped]
            + [f"not floating-point: {m}" for m in self.mistyped]
            + [f"unexpected: {n}" for n in sorted(self.unused)]
        )

    def take(self, names, shape):
        """First present name of `names` (text-relative), as a lazy view, or None (recorded as missing)."""
        names = [names] if isinstance(names, str) else names
        for name in names:
            full = self.prefix + name if not name.startswith("/") else name[1:]
            if full in self.unavailable:
                self.unused.discard(full)
                return None
            if full in self.source:
                self.unused.discard(full)
                got = self.source.shape(full)
                if got != tuple(shape):
                    self.misshaped.append(f"{full}: expected {tuple(shape)}, found {got}")
                    return None
                dtype = self.source.dtype(full)
                if not jnp.issubdtype(dtype, jnp.floating):  # bf16 and fp8 included
                    self.mistyped.append(f"{full}: {dtype}")
                    return None
                tensor = Tensor(self.source, full, got, dtype)
                if dtype in FLOAT8:  # its values are codes times its block scales (a missing scale is a problem)
                    scale = self.scales.get(full)
                    if scale is None:
                        return None
                    return BlockScaled(tensor, Tensor(self.source, scale, self.source.shape(scale), np.float32))
                return tensor
        self.missing.append(self.prefix + names[0] if not names[0].startswith("/") else names[0][1:])
        return None


def _detect_prefix(files: TensorFiles) -> str:
    for prefix in TEXT_PREFIXES:
        if prefix + "embed_tokens.weight" in files or prefix + "embed_tokens.weight" in files.unavailable:
            return prefix
    raise InputError("no embed_tokens.weight under any known prefix " + str([p + "embed_tokens.weight" for p in TEXT_PREFIXES]))


def _t(x):
    return None if x is None else x.T


def _all(*views):
    return all(v is not None for v in views)


def read_kda(r: Reader, L: str, c: Config):
    d, ch, h, dk, k = c.hidden_size, c.kda_dim, c.linear_num_heads, c.linear_head_dim, c.linear_conv_kernel_dim
    a = L + "self_attn."
    qkv = [r.take(a + f"{n}_proj.weight", (ch, d)) for n in "qkv"]
    if r.has(a + "conv1d.weight"):
        conv = r.take(a + "conv1d.weight", (3 * ch, 1, k))
        conv = None if conv is None else Transpose(SplitAxis(Squeeze(conv, 1), 0, (3, ch)), (2, 0, 1))
    else:
        parts = [r.take(a + f"{n}_conv1d.weight", (ch, 1, k)) for n in "qkv"]
        conv = Stack([Squeeze(x, 1).T for x in parts], axis=1) if _all(*parts) else None

    def gate(name, shape):
        return r.take([a + name, a + "forget_gate." + name], shape)

    return {
        "qkv_proj": Stack([x.T for x in qkv], axis=1) if _all(*qkv) else None,
        "conv": conv,
        "f_a": _t(gate("f_a_proj.weight", (dk, d))),
        "f_b": _t(gate("f_b_proj.weight", (ch, dk))),
        "dt_bias": gate("dt_bias", (ch,)),
        "A_log": gate("A_log", (h,)),
        "b_proj": _t(r.take(a + "b_proj.weight", (h, d))),
        "g_a": _t(r.take(a + "g_a_proj.weight", (dk, d))),
        "g_b": _t(r.take(a + "g_b_proj.weight", (ch, dk))),
        "o_norm": r.take(a + "o_norm.weight", (dk,)),
        "o_proj": _t(r.take(a + "o_proj.weight", (d, ch))),
    }


def _at_least_fp32(x):
    """x in fp32 or wider: a jax array stays one (traced in training), anything else becomes numpy."""
    xp = jnp if isinstance(x, jax.Array) else np
    x = xp.asarray(x)
    return x.astype(xp.promote_types(x.dtype, np.float32))


def _einsum(spec, a, b):
    if isinstance(a, jax.Array):
        return jnp.einsum(spec, a, b, precision=jax.lax.Precision.HIGHEST)
    return np.einsum(spec, a, b)


def absorb_q(q_b, kv_b, c: Config):
    """q_absorb [q_lora, heads * R] for the heads whose rows q_b [heads * nope, q_lora] and kv_b
    [heads * (nope + v), R] hold: per head W_qb^T W_kb, so that q_resid @ q_absorb is the query in
    latent space. In fp32 at least; in jnp for jax arrays (numpy otherwise)."""
    nope, v, r = c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
    w_q = _at_least_fp32(q_b).reshape(-1, nope, q_b.shape[-1])  # [heads, nope, q_lora]
    w_k = _at_least_fp32(kv_b).reshape(-1, nope + v, r)[:, :nope]  # [heads, nope, R]
    return _einsum("hnq,hnr->qhr", w_q, w_k).reshape(w_q.shape[-1], -1)


def absorb_o(o_proj, kv_b, c: Config):
    """o_absorb [heads * R, D] for the heads whose columns o_proj [D, heads * v] and rows kv_b hold:
    per head W_o W_vb, mapping the latent attention output to the hidden size. In fp32 at least; in
    jnp for jax arrays (numpy otherwise)."""
    nope, v, r = c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
    w_v = _at_least_fp32(kv_b).reshape(-1, nope + v, r)[:, nope:]  # [heads, v, R]
    w_o = _at_least_fp32(o_proj).reshape(o_proj.shape[0], -1, v)  # [D, heads, v]
    return _einsum("dhv,hvr->hrd", w_o, w_v).reshape(-1, o_proj.shape[0])


def absorbed_q(q_b, kv_b, c: Config):
    """q_absorb as a view: the heads a slice spans are absorbed from their own rows."""
    nope, v, r, heads = c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank, c.num_attention_heads
    rows = lambda g: ((slice(g.start * nope, g.stop * nope), slice(None)),  # noqa: E731
                      (slice(g.start * (nope + v), g.stop * (nope + v)), slice(None)))
    return PerGroup((q_b.shape[1], heads * r), 1, r, [q_b, kv_b], rows, lambda g, q, kv: absorb_q(q, kv, c))


def absorbed_o(o_proj, kv_b, c: Config):
    """o_absorb as a view: the heads a slice spans are absorbed from their own columns and rows."""
    nope, v, r, heads = c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank, c.num_attention_heads
    parts = lambda g: ((slice(None), slice(g.start * v, g.stop * v)),  # noqa: E731
                       (slice(g.start * (nope + v), g.stop * (nope + v)), slice(None)))
    return PerGroup((heads * r, o_proj.shape[0]), 0, r, [o_proj, kv_b], parts, lambda g, o, kv: absorb_o(o, kv, c))


def read_dsa(r: Reader, L: str, c: Config, layer: int, form: str = "inference"):
    d, heads, ql, rank = c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank
    a = L + "self_attn."
    q_b = r.take(a + "q_b_proj.weight", (heads * c.qk_head_dim, ql))
    kv_b = r.take(a + "kv_b_proj.weight", (heads * (c.qk_nope_head_dim + c.v_head_dim), rank))
    o_proj = r.take(a + "o_proj.weight", (d, heads * c.v_head_dim))
    out = {
        "q_a_proj": _t(r.take(a + "q_a_proj.weight", (ql, d))),
        "q_a_norm": r.take(a + "q_a_layernorm.weight", (ql,)),
        "q_absorb": absorbed_q(q_b, kv_b, c) if _all(q_b, kv_b) else None,
        "kv_a_proj": _t(r.take(a + "kv_a_proj_with_mqa.weight", (rank + c.qk_rope_head_dim, d))),
        "kv_a_norm": r.take(a + "kv_a_layernorm.weight", (rank,)),
        "o_absorb": absorbed_o(o_proj, kv_b, c) if _all(o_proj, kv_b) else None,
    }
    if form == "train":
        del out["q_absorb"], out["o_absorb"]
        out.update(q_b_proj=_t(q_b), kv_b_proj=_t(kv_b), o_proj=_t(o_proj))
    if c.indexer_types[layer] == "full":
        i = a + "indexer."
        nh, hd = c.index_n_heads, c.index_head_dim
        weights_proj = r.take(i + "weights_proj.weight", (nh, d))
        out["indexer"] = {
            "wq_b": _t(r.take(i + "wq_b.weight", (nh * hd, ql))),
            "wk": _t(r.take(i + "wk.weight", (hd, d))),
            "k_norm_weight": r.take(i + "k_norm.weight", (hd,)),
            "k_norm_bias": r.take(i + "k_norm.bias", (hd,)),
            "compress_gate": _t(r.take(i + "index_kpool_compress_gate", (hd, d))),
            "weights_proj": None if weights_proj is None else Scaled(weights_proj, nh**-0.5).T,
            "ape": r.take(i + "index_kpool_compress_ape", (c.index_kpool, hd)),
        }
    return out


def read_dense_mlp(r: Reader, m: str, c: Config, intermediate: int):
    d = c.hidden_size
    gate = r.take(m + "gate_proj.weight", (intermediate, d))
    up = r.take(m + "up_proj.weight", (intermediate, d))
    return {
        "gate_up": Stack([gate.T, up.T], axis=1) if _all(gate, up) else None,
        "down": _t(r.take(m + "down_proj.weight", (d, intermediate))),
    }


def read_moe(r: Reader, L: str, c: Config):
    d, e, i = c.hidden_size, c.n_routed_experts, c.moe_intermediate_size
    m = L + "mlp."
    if r.has(m + "experts.gate_up_proj"):
        gu = r.take(m + "experts.gate_up_proj", (e, 2 * i, d))
        down = r.take(m + "experts.down_proj", (e, d, i))
        gate_up = None if gu is None else Transpose(SplitAxis(gu, 1, (2, i)), (0, 3, 1, 2))
        down = None if down is None else Transpose(down, (0, 2, 1))
    else:
        per_expert = []
        for j in range(e):
            x = m + f"experts.{j}."
            parts = (("gate_proj.weight", (i, d)), ("up_proj.weight", (i, d)), ("down_proj.weight", (d, i)))
            per_expert.append([r.take(x + n, s) for n, s in parts])
        whole = all(_all(*views) for views in per_expert)
        gate_up = Stack([Stack([g.T, u.T], axis=1) for g, u, _ in per_expert], axis=0) if whole else None
        down = Stack([dn.T for _, _, dn in per_expert], axis=0) if whole else None
    out = {
        "router": _t(r.take(m + "gate.weight", (e, d))),
        "router_bias": r.take(m + "gate.e_score_correction_bias", (e,)),
        "experts_gate_up": gate_up,
        "experts_down": down,
    }
    if c.n_shared_experts > 0:
        out["shared"] = read_dense_mlp(r, m + "shared_experts.", c, i * c.n_shared_experts)
    elif r.has(m + "shared_experts.gate_proj.weight"):  # transformers keeps a zero-width one: it adds nothing
        read_dense_mlp(r, m + "shared_experts.", c, 0)
    return out


def read_hc(r: Reader, L: str, site: str, c: Config):
    width = (2 + c.hc_mult) * c.hc_mult
    return {
        "fn": _t(r.take([L + f"hc_{site}_fn", L + f"{site}_hc.fn"], (width, c.hc_mult * c.hidden_size))),
        "base": r.take([L + f"hc_{site}_base", L + f"{site}_hc.base"], (width,)),
        "scale": r.take([L + f"hc_{site}_scale", L + f"{site}_hc.scale"], (3,)),
    }


def read_params(r: Reader, c: Config, form: str = "inference"):
    """The parameter tree (`params.param_spec`'s `form`) as lazy views of the stored tensors (None
    where one is missing)."""
    layers = []
    for i in range(c.num_hidden_layers):
        L = f"layers.{i}."
        layers.append(
            {
                "attn_hc": read_hc(r, L, "attn", c),
                "ffn_hc": read_hc(r, L, "ffn", c),
                "input_norm": r.take(L + "input_layernorm.weight", (c.hidden_size,)),
                "post_attention_norm": r.take(L + "post_attention_layernorm.weight", (c.hidden_size,)),
                "attn": read_dsa(r, L, c, i, form) if c.layer_types[i] == DSA else read_kda(r, L, c),
                "mlp": read_moe(r, L, c)
                if c.mlp_layer_types[i] == "sparse"
                else read_dense_mlp(r, L + "mlp.", c, c.intermediate_size),
            }
        )
    embed = r.take("embed_tokens.weight", (c.vocab_size, c.hidden_size))
    if c.tie_word_embeddings and "lm_head.weight" not in r.source:
        lm_head = None if embed is None else embed.T
    else:
        lm_head = _t(r.take("/lm_head.weight", (c.vocab_size, c.hidden_size)))
    return {"embed_tokens": embed, "layers": layers, "norm": r.take("norm.weight", (c.hidden_size,)), "lm_head": lm_head}


def _skipped(name: str, prefix: str, c: Config) -> str | None:
    """Why a tensor outside the text forward is skipped (vision tower, MTP layer), or None."""
    if VISION_PATTERN.search(name):
        return "vision tower"
    if name.startswith(prefix):
        match = LAYER_PATTERN.match(name[len(prefix):])
        n, mtp = c.num_hidden_layers, c.num_nextn_predict_layers  # mtp None: every layer past n
        if match and int(match.group(1)) >= n and (mtp is None or int(match.group(1)) < n + mtp):
            return f"MTP layer {match.group(1)}"
        if ".shared_head." in name:
            return "MTP shared head"
    return None


@dataclasses.dataclass
class LoadPlan:
    """What `load_checkpoint` does with a checkpoint, from its config.json, index and safetensors
    headers alone (no tensor data): the parameter tree as views of the stored tensors, what is
    skipped and why, the float8 weights and their scales, and every problem."""

    path: str
    config: Config
    quantization: QuantizationConfig | None
    files: TensorFiles
    views: dict  # the parameter tree, each leaf a view (None where a tensor is missing)
    skipped: dict[str, list[str]]  # reason -> stored tensors outside the text forward
    scales: dict[str, str]  # float8 weight -> its scale, over every stored tensor
    problems: list[str]

    def loaded(self) -> list[str]:
        """The stored tensors the parameter views read, their float8 weights' scales aside."""
        views = [v for v in jax.tree.leaves(self.views) if v is not None]
        return sorted({t.name for v in views for t in v.stored() if not t.name.endswith(SCALE_SUFFIX)})

    def float8_loaded(self) -> list[str]:
        """The float8 weights among them."""
        return [n for n in self.loaded() if self.files.dtype(n) in FLOAT8]


def plan_load(path, form: str = "inference") -> LoadPlan:
    """load_checkpoint's dry run: every shape, dtype, scale and file checked, every problem collected;
    the views in `params.param_spec`'s `form`."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise MissingFileError(f"no checkpoint directory at {path}")
    raw = read_config_json(path)
    config = Config.from_hf(raw)
    quantization = QuantizationConfig.from_hf(raw)
    files = TensorFiles(path)
    prefix = _detect_prefix(files)
    skipped: dict[str, list[str]] = {}
    wanted = set()
    for name in [*files.names(), *files.unavailable]:
        if name.endswith(SCALE_SUFFIX):
            continue  # paired with its weight by scale_problems
        reason = _skipped(name, prefix, config)
        if reason:
            skipped.setdefault(reason, []).append(name)
        else:
            wanted.add(name)
    scales, scale_issues = scale_problems(files, quantization)
    reader = Reader(files, prefix, wanted, scales)
    views = read_params(reader, config, form)
    problems = files.problems + reader.problems() + scale_issues
    return LoadPlan(path, config, quantization, files, views, skipped, scales, problems)


def check(path, layout=None, dtype="bfloat16") -> CheckReport:
    """What `load_checkpoint(path, dtype, layout=)` will do, and every problem that would stop it, from
    the config.json, the index and the safetensors headers (no tensor data read). `layout`: a
    layout string ("tp:8", "tp-ep:8", "3d:2x2x2"), resolved without its devices, or a Layout."""
    start = time.perf_counter()
    dtype = _load_dtype(dtype)
    if isinstance(layout, str):
        from .sharding import abstract_layout

        layout = abstract_layout(layout)
    return summarise(plan_load(path), layout, dtype, start)


def _load_dtype(dtype):
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise InputError(f"dtype must be float32 or bfloat16, got {dtype}")
    return dtype


def place(view, shape, dtype, sharding=None):
    """A jax.Array of `view` in `dtype`: on the default device, or each of the sharding's addressable
    devices given its own slice (read once per distinct slice, so the host holds one slice at a time)."""
    if sharding is None:
        return jnp.asarray(np.asarray(view).astype(dtype))
    by_slice = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        key = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
        by_slice.setdefault(key, (index, []))[1].append(device)
    arrays = []
    for index, devices in by_slice.values():
        host = view.read(index).astype(dtype, copy=False)
        arrays += [jax.device_put(host, device) for device in devices]
        del host
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


WEIGHTS = ("checkpoint", "dequantize", "fp8")


def _check_weights(weights):
    if weights not in WEIGHTS:
        raise InputError(f"weights must be one of {WEIGHTS}, got {weights!r}")


def form_views(plan: LoadPlan, weights: str):
    """(fp8, the parameter views in the form `weights` asks for): the FP8 form (`params.param_spec(
    config, fp8=True)`) where the converted linears are kept or made float8, else the plain form."""
    _check_weights(weights)
    fp8 = weights == "fp8" or (weights == "checkpoint" and bool(plan.float8_loaded()))
    if not fp8:
        return False, plan.views
    return True, jax.tree_util.tree_map_with_path(
        lambda key, leaf, view: fp8_views(view, leaf, jax.tree_util.keystr(key)) if leaf.converted else view,
        param_spec(plan.config), plan.views, is_leaf=_is_leaf,
    )


def load_checkpoint(path, dtype="bfloat16", *, layout=None, progress="auto", weights="checkpoint", form="inference"):
    """(config, params) from a transformers checkpoint directory; params in `dtype` ("float32" or "bfloat16").

    weights: the form of the linears the release converts to block-scaled FP8 (`params.Fp8Weight`,
    W8A8 in the layers): "checkpoint" keeps what is stored (float8 weights with their scales, a
    bf16 checkpoint plain), "dequantize" reads float8 weights as their values (fp8 x scale, exact
    in float32) in `dtype`, "fp8" also quantizes a bf16 checkpoint's (128 x 128 blocks of amax / 448).
    DSA's q_b and o projections are absorbed with kv_b in fp32 whatever their form (docs/fp8.md).
    layout (`sharding.Layout`): each device reads its own slices of the parameters from the files
    (in a multi-process run, each process its addressable devices'), never the whole model in one
    place; None: one device. progress (`progress.ByteProgress`): "auto" shows a bar of the stored bytes
    read, with rate and ETA, when stderr is a terminal; True always, False never; a callable gets
    (done_bytes, total_bytes) as the tensors load.
    form: "inference" (DSA's projections absorbed) or "train" (`params.param_spec`: q_b_proj,
    kv_b_proj and o_proj as stored, transposed; plain weights only, a float8 checkpoint dequantized).
    Every problem `check` finds is refused in one error before any tensor data is read.
    """
    dtype = _load_dtype(dtype)
    _check_weights(weights)
    if form not in FORMS:
        raise InputError(f"form must be one of {FORMS}, got {form!r}")
    if form == "train" and weights == "fp8":
        raise InputError('form="train" holds plain weights: weights="fp8" does not apply')
    plan = plan_load(path, form)
    config, problems = plan.config, plan.problems
    if len(problems) == 1:
        raise InputError(f"checkpoint {plan.path}: {problems[0]}")
    if problems:
        raise InputError(f"checkpoint {plan.path} has {len(problems)} problems:\n  " + "\n  ".join(problems))
    if plan.skipped:
        log.info("skipped tensors outside the text forward: %s",
                 ", ".join(f"{r} ({len(n)})" for r, n in sorted(plan.skipped.items())))
    fp8, views = form_views(plan, "dequantize" if form == "train" else weights)
    spec = param_spec(config, fp8, form)
    if layout is not None:
        from .sharding import check_divisible, layout_param_spec, param_shardings, scales_per_element

        if fp8:  # the weights the layout cuts inside blocks: their scales per element along the cut
            spec = layout_param_spec(config, layout, fp8)
            views = scales_per_element(views, config, layout, expand_views)
        shardings = param_shardings(config, layout, fp8, form)
        shapes = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, jnp.float32), spec, is_leaf=_is_leaf)
        check_divisible(shapes, shardings)
    else:
        shardings = jax.tree.map(lambda _: None, spec, is_leaf=_is_leaf)

    counted = set()

    def stored_bytes(view):
        """Bytes of the stored tensors `view` reads that no earlier leaf read (kv_b serves two)."""
        new = {t.name for t in view.stored()} - counted
        counted.update(new)
        return sum(plan.files.nbytes(name) for name in new)

    total = sum(stored_bytes(view) for view in jax.tree.leaves(views))
    counted.clear()

    def load(tree_spec, tree_views, tree_shardings, bar):
        def leaf(spec_leaf, view, sharding):
            array = place(view, spec_leaf.shape, leaf_dtype(spec_leaf, dtype), sharding)
            bar.advance(stored_bytes(view))
            return array

        return jax.tree.map(leaf, tree_spec, tree_views, tree_shardings, is_leaf=_is_leaf)

    with ByteProgress(progress, total, "reading") as bar:
        layers = [
            load(spec["layers"][i], views["layers"][i], shardings["layers"][i], bar)
            for i in range(config.num_hidden_layers)
        ]
        top = {k: v for k, v in spec.items() if k != "layers"}
        params = load(top, {k: views[k] for k in top}, {k: shardings[k] for k in top}, bar)
    return config, {**params, "layers": layers}


def _is_leaf(x):
    return isinstance(x, Leaf)
