"""The whole model against transformers' logits (fp32 and bf16)."""

import numpy as np
import pytest
from conftest import SHIPPED, bf16_report, golden_case, load_model, model_path, record, relative_error

import glm5next_jax

FP32_TOLERANCE = 1e-4

MODEL_CASES = [
    "tiny_dense", "tiny_sparse", "tiny_left_pad", "tiny_right_pad", "tiny_one_token",
    "shared_left_pad", "shared_right_pad", "groups_left_pad", "groups_right_pad",
    "kpool16_left_pad", "kpool16_right_pad", "nobound_left_pad", "nobound_right_pad",
    "tiny_long_left_pad", "tiny_long_right_pad", "kernels_left_pad", "kernels_right_pad",
    *(f"{variant}_left_pad" for variant in ("kpool1", "notail", "tied", "hc3", "unnormed", "noshared", "conv3")),
]


def run_case(goldens, case, dtype="float32", **config_changes):
    data = golden_case(goldens, case)
    config, params = load_model(model_path(goldens, str(data["model"])), dtype)
    if config_changes:
        config = config.replace(**config_changes)
    logits = glm5next_jax.forward(params, config, data["ids"], data["mask"])
    return np.asarray(logits), data


def test_manifest_lists_every_case(manifest):
    fp8 = ["fp8_left_pad", "fp8_right_pad", "fp8_generate"]  # tests/model/test_fp8_checkpoint.py
    assert sorted(manifest["cases"]) == sorted(MODEL_CASES + ["generate", "generate_bf16"] + fp8)
    assert manifest["transformers"] == "5.23.0" and manifest["torch"].startswith("2.13.0")


@pytest.mark.parametrize("case", MODEL_CASES)
def test_logits_match_transformers_fp32(goldens, case):
    logits, data = run_case(goldens, case)
    assert logits.dtype == np.float32 and logits.shape == data["logits"].shape
    real = data["mask"].astype(bool)
    error = record(f"fp32 {case}", relative_error(logits, data["logits"], real))
    assert error < FP32_TOLERANCE


def test_sparse_case_really_is_sparse(goldens):
    """Attending densely (a top-k covering every pool) must NOT reproduce the sparse reference."""
    config, _ = load_model(SHIPPED, "float32")
    dense, data = run_case(goldens, "tiny_sparse", index_topk=config.index_kpool * 64)
    error = record("fp32 tiny_sparse with dense attention (must differ)", relative_error(dense, data["logits"]))
    assert error > 100 * FP32_TOLERANCE


def test_dense_case_is_dense(goldens):
    """At <= index_topk + kpool - 1 tokens, any larger top-k gives the same logits (DSA == dense)."""
    config, _ = load_model(SHIPPED, "float32")
    dense, data = run_case(goldens, "tiny_dense", index_topk=config.index_kpool * 64)
    assert relative_error(dense, data["logits"]) < FP32_TOLERANCE


# The typical bf16 token's error, over max |fp32 logit|, at about twice the largest measured (ours
# 0.020-0.077 on the shipped checkpoint, where bf16 flips a choice upstream of most tokens of its 8
# layers; 0.0097-0.0113 on the 3-layer kernels checkpoint, where most tokens see rounding alone).
BF16_LIMITS = {"shipped": 0.16, "kernels": 0.025}


@pytest.mark.parametrize(
    "case",
    ["tiny_dense", "tiny_sparse", "tiny_left_pad", "tiny_right_pad", "tiny_one_token", "kernels_left_pad",
     "kernels_right_pad"],
)
def test_bf16_logits_against_transformers_bf16(goldens, case):
    """bf16 params and activations (the references) against the fp32 reference, beside transformers'
    own bf16 run (`conftest.Bf16Report`); tests/model/test_model_kernels.py does the same through the kernels."""
    logits, data = run_case(goldens, case, dtype="bfloat16")
    report = bf16_report(logits, data, data["mask"].astype(bool))
    record(f"bf16 {case}: typical token (ours)", report.ours)
    record(f"bf16 {case}: typical token (transformers bf16)", report.theirs)
    report.check()
    assert report.ours < BF16_LIMITS[str(data["model"])]
