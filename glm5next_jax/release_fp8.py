"""The FP8 release's split of the text model: which linears GLM-5.3-Flash stores as float8_e4m3fn
with float32 128 x 128 block scales, and the `quantization_config` of config.json that names the rest.

Converted: every MLP projection of the text model (dense MLPs, routed and shared experts) and a DSA
layer's q_a, q_b, kv_a and o projections. Everything else stays as it is (KDA layers, whose o_proj
included, kv_b, the indexer, the router, embeddings, lm_head, norms, the vision tower), and
`modules_to_not_convert` lists each module of those that holds a weight or a bias, by its name in the
file (transformers maps the names to its own modules when it loads). Names only and the standard
library alone: `glm5next-jax convert --to fp8` and checkpoints/make_random.py write this split, and
checkpoints/make_tiny.py reads this file by its path in the reference env, which has no JAX.
"""

import re

BLOCK = 128
SCALE_SUFFIX = "_scale_inv"  # NAME.weight -> NAME.weight_scale_inv
_MLP = re.compile(r"^model\.language_model\.layers\.\d+\.mlp\.(?:experts\.\d+\.|shared_experts\.)?(?:gate|up|down)_proj\.weight$")
_DSA = re.compile(r"^(model\.language_model\.layers\.\d+\.self_attn)\.(?:q_a_proj|q_b_proj|kv_a_proj_with_mqa|o_proj)\.weight$")


def converted(names):
    """The names (in the given order) that the release stores in FP8. A DSA attention is one with a
    kv_a_proj_with_mqa: KDA has an o_proj too, kept in bf16."""
    names = list(names)
    dsa = {n.removesuffix(".kv_a_proj_with_mqa.weight") for n in names if n.endswith(".self_attn.kv_a_proj_with_mqa.weight")}
    return [n for n in names if _MLP.match(n) or ((m := _DSA.match(n)) and m.group(1) in dsa)]


def scale_name(name):
    return name + SCALE_SUFFIX


def scale_shape(shape):
    """The block grid of a weight [out, in]: [ceil(out / 128), ceil(in / 128)]."""
    return tuple(-(-n // BLOCK) for n in shape)


def quantization_config(names):
    """config.json's quantization_config for a checkpoint of the tensors `names` (release names, before
    any scale) whose `converted(names)` are stored in FP8."""
    fp8 = set(converted(names))
    module = lambda n: n.rsplit(".", 1)[0]  # noqa: E731
    kept = {module(n): None for n in names if n not in fp8 and n.rsplit(".", 1)[-1] in ("weight", "bias")}
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK],
            "modules_to_not_convert": list(kept)}
