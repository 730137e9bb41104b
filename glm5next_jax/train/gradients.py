"""Gradients of the loss with respect to a checkpoint's own tensors, keyed and shaped as
transformers' `named_parameters()` of `Glm5NextForConditionalGeneration`.

The stored tensors are first put in transformers' module naming (`module_named_tensors`: the
release's per-expert tensors stacked into `experts.gate_up_proj` / `experts.down_proj`, its three
short convs into `conv1d`, the mHC and forget-gate tensors under their modules), which the loader
reads as well. The parameter tree is then the loader's own views of those tensors evaluated in jnp
(`params_of_tensors`), inside the differentiated function: DSA's absorbed projections are computed
there from q_b_proj, kv_b_proj and o_proj, so their gradients reach the checkpoint's form. The
indexer gets none (transformers runs it without gradient: its only way to the loss is the discrete
selection), nor does the router's score-correction bias (a buffer in transformers).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from ..checkpoint import TEXT_PREFIXES, Reader, plan_load, read_params
from ..config import Config
from ..errors import InputError
from ..params import Leaf, leaf_dtype, param_spec
from ..tensor_views import ArraySource, full_index
from .loss import next_token_loss

_RENAMES = [
    (re.compile(r"\.hc_(attn|ffn)_(fn|base|scale)$"), r".\1_hc.\2"),
    (re.compile(r"\.self_attn\.(A_log|dt_bias|f_a_proj\.weight|f_b_proj\.weight)$"), r".self_attn.forget_gate.\1"),
]
_SHORT_CONV = re.compile(r"^(.*\.self_attn\.)([qkv])_conv1d\.weight$")
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")


def _untrained(name: str) -> bool:
    return ".indexer." in name or name.endswith(".e_score_correction_bias")


def module_named_tensors(path) -> tuple[Config, dict[str, np.ndarray]]:
    """(config, {transformers module name: fp32 array}) of the tensors a checkpoint's text forward
    reads (vision tower and MTP layers skipped, as `load_checkpoint` does). float8 checkpoints are
    refused: their codes have no gradient."""
    plan = plan_load(path)
    if plan.problems:
        raise InputError(f"checkpoint {plan.path}: " + "; ".join(plan.problems))
    if plan.float8_loaded():
        raise InputError(f"checkpoint {plan.path} holds float8 weights ({plan.float8_loaded()[0]}, ...): gradients"
                         " need their values; convert it to bf16 or float32 first")
    named, short_convs, experts = {}, {}, {}
    for name in plan.loaded():
        x = np.asarray(plan.files.read(name, full_index(plan.files.shape(name))), np.float32)
        if match := _SHORT_CONV.match(name):
            short_convs.setdefault(match[1], {})[match[2]] = x
        elif match := _EXPERT.match(name):
            experts.setdefault(match[1], {})[int(match[2]), match[3]] = x
        else:
            for pattern, replacement in _RENAMES:
                name = pattern.sub(replacement, name)
            named[name] = x
    for prefix, parts in short_convs.items():
        named[prefix + "conv1d.weight"] = np.concatenate([parts[n] for n in "qkv"])
    for prefix, parts in experts.items():
        count = 1 + max(j for j, _ in parts)
        named[prefix + "gate_up_proj"] = np.stack([np.concatenate([parts[j, "gate"], parts[j, "up"]]) for j in range(count)])
        named[prefix + "down_proj"] = np.stack([parts[j, "down"] for j in range(count)])
    return plan.config, named


def parameter_views(named, config: Config):
    """The loader's parameter tree of views over module-named tensors (every one checked)."""
    prefix = next((p for p in TEXT_PREFIXES if p + "embed_tokens.weight" in named), None)
    if prefix is None:
        raise InputError("no embed_tokens.weight under any known prefix")
    reader = Reader(ArraySource({n: np.broadcast_to(np.float32(0), np.shape(x)) for n, x in named.items()}), prefix)
    views = read_params(reader, config)
    if reader.problems():
        raise InputError("tensors in module naming not read as the model's: " + "; ".join(reader.problems()))
    return views


def params_of_tensors(views, tensors, config: Config, dtype="float32"):
    """The parameter tree computed in jnp from `tensors` (stored name -> array) through `views`, each
    leaf in its load dtype (`params.leaf_dtype`): differentiable in the tensors."""
    spec = param_spec(config)
    return jax.tree.map(lambda leaf, view: view.evaluate(tensors).astype(leaf_dtype(leaf, dtype)), spec, views,
                        is_leaf=lambda x: isinstance(x, Leaf))


def checkpoint_gradients(path, input_ids, attention_mask=None, dtype="float32", implementation=None, interpret=False):
    """(loss, {name: gradient}) of `train.next_token_loss` on a checkpoint: the mean next-token
    cross-entropy over positions whose token and target are both real, and its gradient for every
    parameter transformers' `loss.backward()` fills, keyed and shaped as its `named_parameters()`
    (fp32 numpy). The parameters are computed from the checkpoint's tensors in `dtype` ("float32" or
    "bfloat16") inside the differentiated function; `implementation` and `interpret` as for
    `forward`."""
    if dtype not in ("float32", "bfloat16"):
        raise InputError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    config, named = module_named_tensors(path)
    views = parameter_views(named, config)
    input_ids = np.asarray(input_ids)
    mask = np.ones(input_ids.shape, np.int32) if attention_mask is None else np.asarray(attention_mask)

    @jax.jit
    def loss_and_grads(tensors):
        def loss(tensors):
            params = params_of_tensors(views, tensors, config, dtype)
            return next_token_loss(params, config, input_ids, mask, implementation=implementation, interpret=interpret)

        return jax.value_and_grad(loss)(tensors)

    loss, grads = loss_and_grads({n: jnp.asarray(x) for n, x in named.items()})
    return float(loss), {n: np.asarray(g, np.float32) for n, g in grads.items() if not _untrained(n)}
