"""The model's hyper-parameters, read from a transformers `config.json` (`glm5_next` or `glm5_next_text`).

`Config` is a frozen dataclass of plain values and tuples, so it is hashable and is passed to
`jax.jit` as a static argument. Field names are transformers' own.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from .errors import InputError

MODEL_TYPES = ("glm5_next", "glm5_next_text")  # transformers' names of this model and its text part

KDA = "linear_attention"
DSA = "indexed_attention"
LAYER_TYPE_ALIASES = {"full_attention": DSA}
MLP_TYPES = ("dense", "sparse")
INDEXER_TYPES = ("full", "shared")


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

        Text fields may sit flat or under `text_config` (the multimodal `glm5_next` layout); the
        vision config is ignored.
        """
        if isinstance(source, Mapping):
            raw = dict(source)
        else:
            path = os.fspath(source)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                try:
                    raw = json.load(f)
                except json.JSONDecodeError as e:
                    raise InputError(f"{path} is not valid JSON: {e}") from None
        if raw.get("model_type", "glm5_next") not in MODEL_TYPES:
            raise InputError(f"config model_type must be one of {MODEL_TYPES}, got {raw['model_type']!r}")
        text = dict(raw.get("text_config") or raw)
        if text.get("model_type", "glm5_next_text") not in MODEL_TYPES:
            raise InputError(f"config text_config.model_type must be one of {MODEL_TYPES}, got {text['model_type']!r}")
        for key in ("tie_word_embeddings",):  # multimodal configs keep these at the top level
            if key in raw and key not in text:
                text[key] = raw[key]
        return cls(**_normalise_hf_fields(text))

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
        need(not bad, f"{name} has unknown values {bad}; allowed: {list(allowed)}")
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
