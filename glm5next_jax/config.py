"""The model's hyper-parameters, read from a transformers `config.json` (`glm5_next` or `glm5_next_text`).

`Config` is a frozen dataclass of plain values and tuples, so it is hashable and is passed to
`jax.jit` as a static argument. Field names are transformers' own.

`Config.from_hf` reads a config.json as transformers 5.23 reads it, the published file of the release
included: the legacy spellings of layer types it accepts, `linear_attn_config`, and the fields
transformers keeps without using. Each field that asks for a computation is used, or refused by name
where it asks for one this library (and transformers) does not run; a field that contradicts
another (`linear_attn_config`'s layer lists, `first_k_dense_replace`, `qk_head_dim`) is refused
naming both; the rest is read and ignored for the reasons in `IGNORED_FIELDS` (docs/config.md).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from .errors import InputError

log = logging.getLogger("glm5next_jax")

MODEL_TYPES = ("glm5_next", "glm5_next_text")  # transformers' names of this model and its text part

KDA = "linear_attention"
DSA = "indexed_attention"
# The spellings of layer types that transformers 5.23 runs as one of the two (its legacy remap,
# `configuration_utils._LEGACY_LAYER_TYPE_REMAP`, and glm5_next's own "full_attention"). Its legacy
# "attention" becomes "full_attention" after glm5_next's remap has run, which its forward cannot run.
LAYER_TYPE_ALIASES = {
    "full_attention": DSA, "deepseek_sparse_attention": DSA, "qwen_sparse_attention": DSA, "mamba": KDA,
}
MLP_TYPES = ("dense", "sparse")
INDEXER_TYPES = ("full", "shared")

# Fields transformers keeps but does not read: its model always computes the value given here, so any
# other value asks for a model that neither transformers nor this library runs.
REQUIRED_VALUES: dict[str, tuple[Any, str]] = {
    "mla_use_nope": (True, "DSA layers are NoPE MLA: no rotary part in the queries, keys or latents"),
    "index_kpool_compress": (True, "the indexer scores pooled keys (a gated softmax over index_kpool tokens)"),
    "scoring_func": ("sigmoid", "the router scores experts with a sigmoid"),
    "topk_method": ("noaux_tc", "experts are chosen by score + e_score_correction_bias within the best groups"),
    "moe_router_dtype": ("float32", "router logits are computed in float32"),
    "mhc": (True, "every layer mixes manifold-constrained hyper-connection streams (hc_mult of them)"),
}
# Fields read and ignored, with the reason: none changes the text forward as transformers runs it.
IGNORED_FIELDS: dict[str, str] = {
    "head_dim": "transformers sets it to qk_rope_head_dim whatever the file says (its name for the rotary width)",
    "indexer_rope_interleave": "how a rotary part of the indexer's keys is laid out; the indexer has none (NoPE; "
                               "transformers' indexer has no rotary embedding)",
    "index_share_for_mtp_iteration": "concerns the MTP layer's drafting iterations; the MTP layer is not run",
    "max_position_embeddings": "no positional embedding (NoPE): lengths are bounded by the cache alone",
    "attention_dropout": "dropout acts in training mode only; the forward here is inference's",
    "initializer_range": "the std of a fresh initialisation; weights come from the checkpoint",
    "router_aux_loss_coef": "a training loss weight",
    "output_router_logits": "whether transformers returns router logits for that loss",
    "use_cache": "transformers' default for its generate; caches here are explicit",
    "dtype": "the dtype the weights were saved in; the files' own dtypes are read",
    "torch_dtype": "the former name of dtype",
    "rope_parameters": "no rotary embedding in the text model (NoPE)",
    "rope_scaling": "no rotary embedding in the text model (NoPE)",
    "rope_theta": "no rotary embedding in the text model (NoPE)",
    "vision_config": "the vision tower is not part of the text forward; its tensors are skipped",
    **dict.fromkeys(
        ("image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id", "video_start_token_id",
         "video_end_token_id"),
        "multimodal token ids: the text forward embeds every id as text",
    ),
    "quantization_config": "how the weights are stored, read by glm5next_jax.quantization",
    **dict.fromkeys(
        ("architectures", "transformers_version", "_name_or_path", "id2label", "label2id", "problem_type",
         "return_dict", "output_attentions", "output_hidden_states", "chunk_size_feed_forward", "is_encoder_decoder"),
        "transformers' generic bookkeeping",
    ),
}
LINEAR_ATTN_KEYS = ("num_heads", "head_dim", "short_conv_kernel_size", "gate_lower_bound", "safe_gate", "kda_layers",
                    "full_attn_layers")
# Read by from_hf beyond Config's own fields: transformers' aliases and schedules, and the fields checked above.
READ_FIELDS = ("model_type", "text_config", "num_local_experts", "index_topk_pattern", "index_topk_freq",
               "index_skip_topk_offset", "linear_attn_config", "first_k_dense_replace", "qk_head_dim")


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int = 154880
    hidden_size: int = 4096
    num_hidden_layers: int = 45
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    pad_token_id: int | None = 154820
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()

    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    indexer_types: tuple[str, ...] = ()

    # Dense MLP and MoE.
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 288
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    swiglu_limit: float = 10.0

    # DSA (NoPE MLA) and its indexer.
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 256
    qk_rope_head_dim: int = 0
    v_head_dim: int = 256
    attention_bias: bool = False
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True

    # KDA.
    linear_num_heads: int = 64
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0

    # Hyper-connections (mHC).
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20

    hidden_act: str = "silu"

    # Layers past num_hidden_layers that the checkpoint holds for multi-token prediction (not run here);
    # None: not stated, every layer past num_hidden_layers is taken for one.
    num_nextn_predict_layers: int | None = None

    def __post_init__(self):
        n = self.num_hidden_layers
        if not self.layer_types:
            object.__setattr__(self, "layer_types", tuple(DSA if i % 4 == 3 else KDA for i in range(n)))
        object.__setattr__(
            self, "layer_types", tuple(LAYER_TYPE_ALIASES.get(t, t) for t in self.layer_types)
        )
        if not self.mlp_layer_types:
            object.__setattr__(self, "mlp_layer_types", ("dense",) * min(3, n) + ("sparse",) * max(n - 3, 0))
        if not self.indexer_types:
            object.__setattr__(self, "indexer_types", indexer_schedule(n))
        for name in ("layer_types", "mlp_layer_types", "indexer_types", "eos_token_id"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        _validate(self)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, source: str | os.PathLike | Mapping[str, Any]) -> Config:
        """From a transformers config: a dict, a `config.json` path or a checkpoint directory.

        Text fields may sit flat or under `text_config` (the multimodal `glm5_next` layout). Every
        problem is named in one InputError; fields this library does not know are logged and ignored.
        """
        raw = read_config_json(source)
        if raw.get("model_type", "glm5_next") not in MODEL_TYPES:
            raise InputError(f"config model_type must be one of {MODEL_TYPES}, got {raw['model_type']!r}")
        text = dict(raw.get("text_config") or raw)
        if text.get("model_type", "glm5_next_text") not in MODEL_TYPES:
            raise InputError(f"config text_config.model_type must be one of {MODEL_TYPES}, got {text['model_type']!r}")
        for key in ("tie_word_embeddings",):  # multimodal configs keep these at the top level
            if key in raw and key not in text:
                text[key] = raw[key]
        if not isinstance(text.get("linear_attn_config") or {}, Mapping):
            raise InputError(f"config linear_attn_config must be a mapping, got {text['linear_attn_config']!r}")
        _log_unknown(raw, text)
        problems = _refused_values(text)
        try:
            config = cls(**_normalise_hf_fields(text))
        except InputError as err:
            if not problems:
                raise
            raise InputError("\n  - ".join([str(err), *problems])) from None
        problems += _contradictions(text, config)
        if problems:
            raise InputError("invalid GLM-5-Next config:\n  - " + "\n  - ".join(problems))
        return config

    def replace(self, **changes) -> Config:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ---- derived ------------------------------------------------------------------------------
    @property
    def kda_dim(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def experts_per_group(self) -> int:
        return self.n_routed_experts // self.n_group

    @property
    def select_width(self) -> int:
        """Width of a row of selected token indices: index_topk, plus the tail when it is appended."""
        tail = self.index_kpool - 1 if self.index_kpool_always_select_tail else 0
        return self.index_topk + tail


def read_config_json(source: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """The config as a dict: `source` itself (a mapping), a `config.json` path or a checkpoint directory."""
    if isinstance(source, Mapping):
        return dict(source)
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise InputError(f"{path} is not valid JSON: {e}") from None


def indexer_schedule(num_layers: int, pattern=None, freq: int = 1, offset: int = 2) -> tuple[str, ...]:
    """transformers' default `indexer_types`: a "F"/"S" pattern, else every `freq`-th layer from `offset`."""
    if pattern is not None:
        if isinstance(pattern, str):
            return tuple({"F": "full", "S": "shared"}[c] for c in pattern)
        return tuple(pattern)
    freq = max(freq, 1)
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers))


_FIELDS = {f.name for f in dataclasses.fields(Config)}


def _normalise_hf_fields(text: dict[str, Any]) -> dict[str, Any]:
    text = dict(text)
    if text.get("indexer_types") is None:
        text["indexer_types"] = indexer_schedule(
            text.get("num_hidden_layers", Config.num_hidden_layers),
            text.get("index_topk_pattern"),
            text.get("index_topk_freq", 1),
            text.get("index_skip_topk_offset", 2),
        )
    linear = text.get("linear_attn_config")
    if linear is not None:
        text["linear_head_dim"] = linear.get("head_dim", text.get("linear_head_dim", Config.linear_head_dim))
        text["linear_num_heads"] = linear.get("num_heads", text.get("linear_num_heads", Config.linear_num_heads))
        text["linear_conv_kernel_dim"] = linear.get(
            "short_conv_kernel_size", text.get("linear_conv_kernel_dim", Config.linear_conv_kernel_dim)
        )
        bound = linear.get("gate_lower_bound", text.get("linear_lower_bound", Config.linear_lower_bound))
        if linear.get("safe_gate", True) and bound is None:
            bound = -5.0
        text["linear_lower_bound"] = bound
    if "num_local_experts" in text and "n_routed_experts" not in text:
        text["n_routed_experts"] = text["num_local_experts"]
    eos = text.get("eos_token_id")
    text["eos_token_id"] = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))
    for name in ("layer_types", "mlp_layer_types", "indexer_types"):
        if text.get(name) is None:
            text.pop(name, None)
    if text.get("num_key_value_heads") is None:
        text["num_key_value_heads"] = text.get("num_attention_heads", Config.num_attention_heads)
    return {k: v for k, v in text.items() if k in _FIELDS}


def _validate(c: Config) -> None:
    errors = []

    def need(ok, message):
        if not ok:
            errors.append(message)

    for name in (
        "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "moe_intermediate_size",
        "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
        "index_head_dim", "index_n_heads", "index_topk", "linear_num_heads", "linear_head_dim",
        "linear_conv_kernel_dim", "hc_mult", "hc_sinkhorn_iters", "n_group", "topk_group",
    ):
        value = getattr(c, name)
        need(isinstance(value, int) and value >= 1, f"{name} must be a positive integer, got {value!r}")
    n = c.num_hidden_layers
    for name, allowed in (("layer_types", (KDA, DSA)), ("mlp_layer_types", MLP_TYPES), ("indexer_types", INDEXER_TYPES)):
        values = getattr(c, name)
        need(len(values) == n, f"{name} has {len(values)} entries, expected num_hidden_layers = {n}")
        bad = sorted({v for v in values if v not in allowed})
        spellings = f" (or their spellings {sorted(LAYER_TYPE_ALIASES)})" if name == "layer_types" else ""
        need(not bad, f"{name} has unknown values {bad}; allowed: {list(allowed)}{spellings}")
    need(
        c.num_nextn_predict_layers is None or (isinstance(c.num_nextn_predict_layers, int) and c.num_nextn_predict_layers >= 0),
        f"num_nextn_predict_layers must be None or an integer >= 0, got {c.num_nextn_predict_layers!r}",
    )
    need(
        c.num_attention_heads == c.num_key_value_heads,
        f"num_attention_heads ({c.num_attention_heads}) must equal num_key_value_heads ({c.num_key_value_heads})",
    )
    need(c.index_kpool >= 1, f"index_kpool must be positive, got {c.index_kpool}")
    need(
        c.index_kpool >= 1 and c.index_topk % c.index_kpool == 0,
        f"index_topk ({c.index_topk}) must be divisible by index_kpool ({c.index_kpool})",
    )
    need(c.qk_rope_head_dim == 0, f"qk_rope_head_dim must be 0 (DSA layers are NoPE), got {c.qk_rope_head_dim}")
    need(not c.attention_bias, "attention_bias=True is not supported (GLM-5-Next has no attention biases)")
    need(c.hidden_act == "silu", f"hidden_act must be 'silu', got {c.hidden_act!r}")
    need(c.n_shared_experts >= 0, f"n_shared_experts must be >= 0, got {c.n_shared_experts}")
    if "sparse" in c.mlp_layer_types and c.n_group >= 1:
        need(
            c.n_routed_experts % c.n_group == 0,
            f"n_routed_experts ({c.n_routed_experts}) must be divisible by n_group ({c.n_group})",
        )
        need(
            c.n_routed_experts // c.n_group >= 2,
            f"each expert group needs >= 2 experts (groups are scored by their top 2), got "
            f"{c.n_routed_experts} experts in {c.n_group} groups",
        )
        need(c.topk_group <= c.n_group, f"topk_group ({c.topk_group}) must be <= n_group ({c.n_group})")
        need(
            1 <= c.num_experts_per_tok <= c.topk_group * max(c.n_routed_experts // c.n_group, 1),
            f"num_experts_per_tok ({c.num_experts_per_tok}) must be in [1, topk_group * experts per group]",
        )
    if len(c.layer_types) == n and len(c.indexer_types) == n:
        for i in range(n):
            if c.layer_types[i] == DSA and c.indexer_types[i] == "shared":
                prev_ok = i > 0 and c.layer_types[i - 1] == DSA and c.indexer_types[i - 1] == "full"
                need(
                    prev_ok,
                    f"layer {i} is a 'shared' DSA layer, so layer {i - 1} must be a 'full' DSA layer "
                    f"(it reuses the immediately preceding layer's top-k)",
                )
    if c.linear_lower_bound is not None:
        need(c.linear_lower_bound < 0, f"linear_lower_bound must be negative, got {c.linear_lower_bound}")
    if errors:
        raise InputError("invalid GLM-5-Next config:\n  - " + "\n  - ".join(errors))


def _log_unknown(raw: dict[str, Any], text: dict[str, Any]) -> None:
    """Log (once per read) the fields that neither transformers' glm5_next nor this library defines."""
    known = _FIELDS | set(REQUIRED_VALUES) | set(IGNORED_FIELDS) | set(READ_FIELDS)
    unknown = sorted(k for k in {**raw, **text} if k not in known)
    linear = text.get("linear_attn_config") or {}
    unknown += [f"linear_attn_config.{k}" for k in sorted(linear) if k not in LINEAR_ATTN_KEYS]
    if unknown:
        log.warning("config fields this library does not know, ignored: %s", ", ".join(unknown))


def _refused_values(text: dict[str, Any]) -> list[str]:
    return [
        f"{name} = {text[name]!r} is not supported, only {value!r}: {reason}"
        for name, (value, reason) in REQUIRED_VALUES.items()
        if name in text and text[name] != value
    ]


def _contradictions(text: dict[str, Any], c: Config) -> list[str]:
    """Fields that restate part of the schedule or a width, checked against what the config runs."""
    problems = []
    linear = text.get("linear_attn_config") or {}
    for key, kind in (("kda_layers", KDA), ("full_attn_layers", DSA)):
        if linear.get(key) is not None:
            listed = sorted(linear[key])
            runs = [i for i, t in enumerate(c.layer_types) if t == kind]
            if listed != runs:
                problems.append(f"linear_attn_config.{key} {listed} (0-based) contradicts layer_types, whose {kind} "
                                f"layers are {runs}")
    k = text.get("first_k_dense_replace")
    if k is not None:
        expected = tuple("dense" if i < k else "sparse" for i in range(c.num_hidden_layers))
        if c.mlp_layer_types != expected:
            dense = [i for i, t in enumerate(c.mlp_layer_types) if t == "dense"]
            source = "mlp_layer_types" if text.get("mlp_layer_types") is not None else "mlp_layer_types (transformers' default)"
            problems.append(f"first_k_dense_replace = {k} contradicts {source}, whose dense layers are {dense}")
    if text.get("qk_head_dim") is not None and text["qk_head_dim"] != c.qk_head_dim:
        problems.append(f"qk_head_dim = {text['qk_head_dim']} contradicts qk_nope_head_dim + qk_rope_head_dim = "
                        f"{c.qk_nope_head_dim} + {c.qk_rope_head_dim}")
    return problems
