"""Load transformers GLM-5-Next checkpoints (sharded safetensors) into the parameter tree.

Two namings are read: the release naming that `save_pretrained` writes (per-expert tensors, split
q/k/v convs, `hc_attn_fn`, forget-gate tensors on `self_attn`) and transformers' in-memory naming
(`experts.gate_up_proj`, `conv1d`, `attn_hc.fn`, `forget_gate.*`). Text weights may sit under
`model.language_model.`, `model.` or no prefix; `lm_head.weight` at the top.

At load the DSA projections are absorbed in fp32 (q_absorb, o_absorb), the indexer's head weights
are pre-scaled by index_n_heads^-0.5, and gates, conv, mHC, router and ape are kept in fp32.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so safetensors can return it)
import numpy as np
from safetensors import safe_open

from .config import DSA, Config
from .params import Leaf, leaf_dtype, param_spec

log = logging.getLogger("glm5next_jax")

TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.", "")
VISION_PATTERN = re.compile(r"(^|\.)(visual|vision_tower|vision_model)\.")
LAYER_PATTERN = re.compile(r"^layers\.(\d+)\.")


class TensorFiles:
    """Lazy access by name to the tensors of a directory of (sharded) safetensors files."""

    def __init__(self, path: str):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            self.file_of = {name: os.path.join(path, file) for name, file in weight_map.items()}
        else:
            files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
            if not files:
                raise FileNotFoundError(f"no model.safetensors.index.json or *.safetensors in {path}")
            self.file_of = {}
            for file in files:
                with safe_open(file, "np") as f:
                    self.file_of.update({name: file for name in f.keys()})
        self._open = {}

    def names(self):
        return self.file_of.keys()

    def __contains__(self, name):
        return name in self.file_of

    def shape(self, name):
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get(self, name) -> np.ndarray:
        return self._handle(name).get_tensor(name)

    def _handle(self, name):
        file = self.file_of[name]
        if file not in self._open:
            self._open[file] = safe_open(file, "np")
        return self._open[file]


class ArraySource:
    """In-memory tensors by name (numpy arrays), with the interface of TensorFiles."""

    def __init__(self, arrays):
        self.arrays = dict(arrays)

    def names(self):
        return self.arrays.keys()

    def __contains__(self, name):
        return name in self.arrays

    def shape(self, name):
        return tuple(self.arrays[name].shape)

    def get(self, name):
        return np.asarray(self.arrays[name])


class Reader:
    """Takes tensors by (alternative) names, checking shapes; collects every problem for one error.

    Names are relative to `prefix`; a name starting with "/" is absolute (lm_head.weight).
    """

    def __init__(self, source, prefix: str = "", wanted=None):
        self.source, self.prefix = source, prefix
        wanted = set(source.names()) if wanted is None else wanted
        self.unused = set(wanted)
        self.missing: list[str] = []
        self.misshaped: list[str] = []

    def has(self, name):
        return self.prefix + name in self.source

    def problems(self):
        return (
            [f"missing: {n}" for n in self.missing]
            + [f"mis-shaped: {m}" for m in self.misshaped]
            + [f"unexpected: {n}" for n in sorted(self.unused)]
        )

    def take(self, names, shape):
        """First present name of `names` (text-relative), as fp32, or None (recorded as missing)."""
        names = [names] if isinstance(names, str) else names
        for name in names:
            full = self.prefix + name if not name.startswith("/") else name[1:]
            if full in self.source:
                self.unused.discard(full)
                got = self.source.shape(full)
                if got != tuple(shape):
                    self.misshaped.append(f"{full}: expected {tuple(shape)}, found {got}")
                    return None
                return self.source.get(full).astype(np.float32)
        self.missing.append(self.prefix + names[0] if not names[0].startswith("/") else names[0][1:])
        return None


def _detect_prefix(files: TensorFiles) -> str:
    for prefix in TEXT_PREFIXES:
        if prefix + "embed_tokens.weight" in files:
            return prefix
    raise ValueError("no embed_tokens.weight under any known prefix " + str([p + "embed_tokens.weight" for p in TEXT_PREFIXES]))


def _t(x):
    return None if x is None else x.T


def read_kda(r: Reader, L: str, c: Config):
    d, ch, h, dk, k = c.hidden_size, c.kda_dim, c.linear_num_heads, c.linear_head_dim, c.linear_conv_kernel_dim
    a = L + "self_attn."
    qkv = [r.take(a + f"{n}_proj.weight", (ch, d)) for n in "qkv"]
    if r.has(a + "conv1d.weight"):
        conv = r.take(a + "conv1d.weight", (3 * ch, 1, k))
        conv = None if conv is None else conv.reshape(3, ch, k).transpose(2, 0, 1)
    else:
        parts = [r.take(a + f"{n}_conv1d.weight", (ch, 1, k)) for n in "qkv"]
        conv = None if any(p is None for p in parts) else np.stack([p[:, 0, :].T for p in parts], axis=1)

    def gate(name, shape):
        return r.take([a + name, a + "forget_gate." + name], shape)

    return {
        "qkv_proj": None if any(x is None for x in qkv) else np.stack([x.T for x in qkv], axis=1),
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


def absorb_q(q_b, kv_b, c: Config):
    """q_absorb [q_lora, H * R]: per head W_qb^T W_kb, so that q_resid @ q_absorb is the query in latent space."""
    heads, nope, v, r = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
    w_q = q_b.reshape(heads, nope, -1)  # [H, nope, q_lora]
    w_k = kv_b.reshape(heads, nope + v, r)[:, :nope]  # [H, nope, R]
    return np.einsum("hnq,hnr->qhr", w_q, w_k).reshape(w_q.shape[-1], heads * r)


def absorb_o(o_proj, kv_b, c: Config):
    """o_absorb [H * R, D]: per head W_o W_vb, mapping the latent attention output to the hidden size."""
    heads, nope, v, r = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
    w_v = kv_b.reshape(heads, nope + v, r)[:, nope:]  # [H, v, R]
    w_o = o_proj.reshape(o_proj.shape[0], heads, v)  # [D, H, v]
    return np.einsum("dhv,hvr->hrd", w_o, w_v).reshape(heads * r, o_proj.shape[0])


def read_dsa(r: Reader, L: str, c: Config, layer: int):
    d, heads, ql, rank = c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank
    a = L + "self_attn."
    q_b = r.take(a + "q_b_proj.weight", (heads * c.qk_head_dim, ql))
    kv_b = r.take(a + "kv_b_proj.weight", (heads * (c.qk_nope_head_dim + c.v_head_dim), rank))
    o_proj = r.take(a + "o_proj.weight", (d, heads * c.v_head_dim))
    out = {
        "q_a_proj": _t(r.take(a + "q_a_proj.weight", (ql, d))),
        "q_a_norm": r.take(a + "q_a_layernorm.weight", (ql,)),
        "q_absorb": None if q_b is None or kv_b is None else absorb_q(q_b, kv_b, c),
        "kv_a_proj": _t(r.take(a + "kv_a_proj_with_mqa.weight", (rank + c.qk_rope_head_dim, d))),
        "kv_a_norm": r.take(a + "kv_a_layernorm.weight", (rank,)),
        "o_absorb": None if o_proj is None or kv_b is None else absorb_o(o_proj, kv_b, c),
    }
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
            "weights_proj": None if weights_proj is None else (weights_proj * np.float32(nh**-0.5)).T,
            "ape": r.take(i + "index_kpool_compress_ape", (c.index_kpool, hd)),
        }
    return out


def read_dense_mlp(r: Reader, m: str, c: Config, intermediate: int):
    d = c.hidden_size
    gate = r.take(m + "gate_proj.weight", (intermediate, d))
    up = r.take(m + "up_proj.weight", (intermediate, d))
    return {
        "gate_up": None if gate is None or up is None else np.stack([gate.T, up.T], axis=1),
        "down": _t(r.take(m + "down_proj.weight", (d, intermediate))),
    }


def read_moe(r: Reader, L: str, c: Config):
    d, e, i = c.hidden_size, c.n_routed_experts, c.moe_intermediate_size
    m = L + "mlp."
    if r.has(m + "experts.gate_up_proj"):
        gu = r.take(m + "experts.gate_up_proj", (e, 2 * i, d))
        down = r.take(m + "experts.down_proj", (e, d, i))
        gate_up = None if gu is None else gu.reshape(e, 2, i, d).transpose(0, 3, 1, 2)
        down = None if down is None else down.transpose(0, 2, 1)
    else:
        gate_up = np.empty((e, d, 2, i), np.float32)
        down = np.empty((e, i, d), np.float32)
        for j in range(e):
            x = m + f"experts.{j}."
            g, u, dn = (r.take(x + n, s) for n, s in (("gate_proj.weight", (i, d)), ("up_proj.weight", (i, d)), ("down_proj.weight", (d, i))))
            if g is not None and u is not None:
                gate_up[j] = np.stack([g.T, u.T], axis=1)
            if dn is not None:
                down[j] = dn.T
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


def read_params(r: Reader, c: Config, progress=None):
    layers = []
    for i in range(c.num_hidden_layers):
        if progress is not None:
            progress(i, c.num_hidden_layers)
        L = f"layers.{i}."
        layers.append(
            {
                "attn_hc": read_hc(r, L, "attn", c),
                "ffn_hc": read_hc(r, L, "ffn", c),
                "input_norm": r.take(L + "input_layernorm.weight", (c.hidden_size,)),
                "post_attention_norm": r.take(L + "post_attention_layernorm.weight", (c.hidden_size,)),
                "attn": read_dsa(r, L, c, i) if c.layer_types[i] == DSA else read_kda(r, L, c),
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
        if match and int(match.group(1)) >= c.num_hidden_layers:
            return f"MTP layer {match.group(1)}"
        if ".shared_head." in name:
            return "MTP shared head"
    return None


def load_checkpoint(path, dtype="bfloat16", *, progress=None):
    """(config, params) from a transformers checkpoint directory; params in `dtype` ("float32" or "bfloat16").

    progress(done_layers, total_layers), if given, is called as layers are read.
    """
    path = os.fspath(path)
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
    config = Config.from_hf(path)
    files = TensorFiles(path)
    prefix = _detect_prefix(files)
    skipped: dict[str, int] = {}
    wanted = set()
    for name in files.names():
        reason = _skipped(name, prefix, config)
        if reason:
            skipped[reason] = skipped.get(reason, 0) + 1
        else:
            wanted.add(name)
    reader = Reader(files, prefix, wanted)
    raw = read_params(reader, config, progress)
    problems = reader.problems()
    if problems:
        raise ValueError(f"checkpoint {path} does not match its config ({len(problems)} problems):\n  " + "\n  ".join(problems))
    if skipped:
        log.info("skipped tensors outside the text forward: %s", ", ".join(f"{r} ({n})" for r, n in sorted(skipped.items())))
    if progress is not None:
        progress(config.num_hidden_layers, config.num_hidden_layers)
    spec = param_spec(config)
    params = jax.tree.map(
        lambda leaf, x: jnp.asarray(x, leaf_dtype(leaf, dtype)), spec, raw, is_leaf=lambda x: isinstance(x, Leaf)
    )
    return config, params
