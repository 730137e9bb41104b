"""How a checkpoint stores its weights: config.json's `quantization_config`, and each float8 weight
checked against its block scales from the safetensors headers alone.

The format read is the release's block-scaled FP8 (transformers' `FineGrainedFP8Config`):
`quant_method` "fp8", `fmt` "e4m3", `weight_block_size` [128, 128], `activation_scheme` "dynamic".
Each converted linear stores `NAME.weight` as float8_e4m3fn [out, in] beside
`NAME.weight_scale_inv`, float32 [ceil(out/128), ceil(in/128)], one scale per 128 x 128 block
(weight = fp8 x scale); the modules that `modules_to_not_convert` names stay in bf16. Any other
method, format, block or scheme is refused by name.

`QuantizationConfig` describes the files, not the model: the FP8 and BF16 releases of one model have
one `Config` (one compiled program), so it is kept beside the Config rather than in it. It is a
frozen dataclass of strings and tuples, hashable like the Config.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from .errors import InputError
from .release_fp8 import SCALE_SUFFIX
from .tensor_views import DTYPES, FLOAT8

log = logging.getLogger("glm5next_jax")

# quantization_config's fields: what each must be, and why anything else is refused.
REQUIRED = {
    "quant_method": ("fp8", "block-scaled FP8 is the format read here"),
    "fmt": ("e4m3", "float8_e4m3fn weights"),
    "weight_block_size": ([128, 128], "one float32 scale per 128 x 128 block"),
    "activation_scheme": ("dynamic", "activations quantized at run time, per token in 1 x 128 groups"),
    "scale_fmt": ("float", "float32 scales (not ue8m0 exponents)"),
    "expert_dtype": ("fp8", "experts in float8 like every other converted linear (not fp4)"),
}
KNOWN = {*REQUIRED, "modules_to_not_convert", "ignored_layers", "modules_to_convert", "dequantize"}


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    """The release's block-scaled FP8 format (the only one read: each field's one accepted value), and
    the modules it leaves in bf16."""

    quant_method: str = "fp8"
    fmt: str = "e4m3"
    weight_block_size: tuple[int, int] = (128, 128)
    activation_scheme: str = "dynamic"
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> QuantizationConfig | None:
        """From a config.json's dict: None without a `quantization_config`; an InputError naming each
        field that asks for a format other than the release's."""
        q = raw.get("quantization_config")
        if q is None:
            return None
        if not isinstance(q, Mapping):
            raise InputError(f"config quantization_config must be a mapping, got {q!r}")
        defaults = {"fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "scale_fmt": "float",
                    "expert_dtype": "fp8"}  # transformers' defaults (fmt: the release's, transformers has no such field)
        problems = []
        for name, (value, meaning) in REQUIRED.items():
            got = q.get(name, defaults.get(name))
            if (list(got) if isinstance(got, (list, tuple)) else got) != value:
                problems.append(f"quantization_config.{name} = {got!r} is not supported; this library reads "
                                f"{name} = {value!r} ({meaning})")
        if q.get("modules_to_convert"):
            problems.append(f"quantization_config.modules_to_convert = {q['modules_to_convert']!r} is not supported "
                            f"(it converts modules such as embeddings that the release keeps in bf16)")
        if problems:
            raise InputError("unsupported quantization_config:\n  - " + "\n  - ".join(problems))
        unknown = sorted(set(q) - KNOWN)
        if unknown:
            log.warning("quantization_config fields this library does not know, ignored: %s", ", ".join(unknown))
        skip = q.get("modules_to_not_convert", q.get("ignored_layers")) or ()  # transformers' alias
        return cls(modules_to_not_convert=tuple(skip))

    def scale_shape(self, shape) -> tuple[int, int]:
        """The scale grid of a weight [out, in]: [ceil(out / block), ceil(in / block)]."""
        return tuple(math.ceil(n / b) for n, b in zip(shape, self.weight_block_size))

    def not_converted(self, module: str) -> bool:
        """Whether `modules_to_not_convert` names `module`, by transformers' rule
        (`quantizers_utils.should_convert_module`): a pattern matching from the start up to a module
        boundary ("a.b" matches "a.b" and "a.b.c", not "a.bc"), as a regex with that boundary, or as a
        suffix. A pattern of name characters and dots is looked up among the module's dotted prefixes
        (a dot standing for the separator it is); any other is matched as a regex."""
        names, patterns, suffixes = self._skip_rules
        parts = module.split(".")
        prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        return (
            any(p in names or p + "." in names for p in prefixes)
            or bool(patterns and patterns.match(module))
            or any(module[-n:] in keys for n, keys in suffixes.items())
        )

    @functools.cached_property
    def _skip_rules(self):
        """(the plain patterns, one regex of the others up to a module boundary, {length: patterns})."""
        plain = re.compile(r"[\w.]+$")
        names = {k for k in self.modules_to_not_convert if plain.match(k)}
        others = [k for k in self.modules_to_not_convert if not plain.match(k)]
        patterns = re.compile("|".join(rf"(?:{k})(?:(?<=\.)|(?=\.|$))" for k in others)) if others else None
        suffixes = {}
        for key in self.modules_to_not_convert:
            suffixes.setdefault(len(key), set()).add(key)
        return names, patterns, suffixes


def describe(q: QuantizationConfig | None) -> str:
    if q is None:
        return "none (bf16 weights)"
    block = "x".join(map(str, q.weight_block_size))
    return (f"{q.quant_method} {q.fmt}, {block} blocks, {q.activation_scheme} activations, "
            f"{len(q.modules_to_not_convert):,} modules not converted")


def scale_problems(files, q: QuantizationConfig | None) -> tuple[dict[str, str], list[str]]:
    """({float8 weight: its scale}, problems) over every tensor of `files` (a TensorFiles): each float8
    weight needs its float32 scale of the right grid and a module that is converted; each scale its
    float8 weight; float8 needs a quantization_config."""
    names = set(files.names())
    float8 = sorted(n for n in names if files.dtype(n) in FLOAT8)
    scales = sorted(n for n in names if n.endswith(SCALE_SUFFIX))
    problems, pairs = [], {}
    if float8 and q is None:
        return pairs, [f"{len(float8):,} tensors are float8 (e.g. {float8[0]}) but config.json has no quantization_config "
                       f"to say how they are scaled"]
    if q is not None and not float8:
        problems.append("config.json has a quantization_config (fp8) but no tensor is float8")
    for name in float8:
        scale = name + SCALE_SUFFIX
        if files.dtype(name) != DTYPES["F8_E4M3"]:
            problems.append(f"wrong dtype: {name}: {files.dtype(name)}, quantization_config.fmt is e4m3")
        elif not name.endswith(".weight") or len(files.shape(name)) != 2:
            problems.append(f"float8 tensor that is not a linear weight: {name} {files.shape(name)}")
        elif scale not in names and scale not in files.unavailable:
            problems.append(f"float8 weight without its scale: {name} (no {scale})")
        elif scale in names:
            pairs[name] = scale
            want = q.scale_shape(files.shape(name))
            if files.dtype(scale) != np.float32:
                problems.append(f"wrong dtype: {scale}: {files.dtype(scale)}, float32 expected")
            if files.shape(scale) != want:
                problems.append(f"scale grid does not match its weight: {scale}: expected {want} for "
                                f"{files.shape(name)} in {q.weight_block_size} blocks, found {files.shape(scale)}")
        module = name.removesuffix(".weight")
        if q.not_converted(module):
            problems.append(f"converted though modules_to_not_convert lists it: {module} (float8)")
    for scale in scales:
        weight = scale.removesuffix(SCALE_SUFFIX)
        if weight in files.unavailable:
            continue
        if weight not in names:
            problems.append(f"scale without its weight: {scale} (no {weight})")
        elif files.dtype(weight) not in FLOAT8:
            problems.append(f"scale without a float8 weight: {scale} ({weight} is {files.dtype(weight)})")
    return pairs, problems
