"""Training's gradients against torch autograd: `train.checkpoint_gradients` on the goldens' models
(the shipped tiny checkpoint dense and sparse with left padding, a shared-indexer variant with right
padding, group-limited routing) against transformers' `loss.backward()` in fp32, keyed as its
`named_parameters()`; and the pieces it stands on (module naming, the views evaluated in jnp)."""

import os

import jax
import numpy as np
import pytest
from conftest import golden_case, load_model, model_path, record

from glm5next_jax import train
from glm5next_jax.errors import InputError

GRADIENT_CASES = ["grad_tiny_dense", "grad_tiny_sparse_left_pad", "grad_shared_right_pad", "grad_groups",
                  "grad_kernels_left_pad"]


def golden_gradients(goldens, case):
    data = dict(np.load(os.path.join(goldens, "gradients", case + ".npz")))
    grads = {k[len("grad:"):]: v for k, v in data.items() if k.startswith("grad:")}
    return data, grads


def relative_l2(got, want):
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


@pytest.mark.parametrize("case", GRADIENT_CASES)
def test_fp32_gradients_match_torch_autograd(goldens, case):
    data, want = golden_gradients(goldens, case)
    path = model_path(goldens, str(data["model"]))
    loss, got = train.checkpoint_gradients(path, data["ids"], data["mask"], dtype="float32", implementation="reference")
    assert abs(loss - float(data["loss"])) <= 1e-5 * abs(float(data["loss"]))
    assert sorted(got) == sorted(want)  # every parameter torch's backward fills, none other
    errors = {name: relative_l2(got[name], want[name]) for name in want}
    assert all(got[name].shape == want[name].shape for name in want)
    worst = max(errors, key=errors.get)
    record(f"gradients {case}, relative L2 (worst: {worst})", errors[worst])
    assert errors[worst] < 1e-4, (worst, errors[worst])


def test_bf16_gradients_through_the_kernels_are_as_close_as_the_reference_paths(goldens):
    """bf16 through every kernel (interpreted: the MoE's forward and backward kernels, the KDA scan's
    and the latent attention's forward kernels with their reference backward, the selection's
    kernels without gradient) against torch's fp32 gradients, as close as the pure-jnp reference
    path in bf16 is: the relative L2 over all gradients together and the per-tensor median."""
    data, want = golden_gradients(goldens, "grad_kernels_left_pad")
    path = model_path(goldens, "kernels")
    runs = {
        implementation: train.checkpoint_gradients(path, data["ids"], data["mask"], dtype="bfloat16",
                                                   implementation=implementation, interpret=True)
        for implementation in ("reference", "pallas")
    }
    summary = {}
    for implementation, (loss, got) in runs.items():
        assert sorted(got) == sorted(want)
        total = np.sqrt(sum(np.sum((got[n] - want[n]) ** 2) for n in want) / sum(np.sum(want[n] ** 2) for n in want))
        median = float(np.median([relative_l2(got[n], want[n]) for n in want]))
        summary[implementation] = (float(total), median, abs(loss / float(data["loss"]) - 1))
        record(f"bf16 gradients through {implementation}, relative L2 of all", float(total))
        record(f"bf16 gradients through {implementation}, median per tensor", median)
        record(f"bf16 loss through {implementation}, relative", summary[implementation][2])
    (ref_total, ref_median, _), (total, median, loss) = summary["reference"], summary["pallas"]
    assert total <= 1.5 * ref_total and median <= 1.5 * ref_median, summary
    assert loss < 2.0**-7, summary  # a bf16 forward's loss: within a few of its roundings


def test_module_naming_gives_the_loaders_params(goldens):
    """The shipped checkpoint renamed into transformers' module naming and computed through the
    views in jnp: every parameter equal to `load_checkpoint`'s."""
    config, named = train.module_named_tensors(model_path(goldens, "shipped"))
    views = train.gradients.parameter_views(named, config)
    params = train.params_of_tensors(views, {n: jax.numpy.asarray(x) for n, x in named.items()}, config)
    _, loaded = load_model(model_path(goldens, "shipped"), "float32")
    for (where, got), want in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7,
                                   err_msg=jax.tree_util.keystr(where))


def test_bad_arguments_are_named(goldens):
    case = golden_case(goldens, "tiny_dense")
    with pytest.raises(InputError, match="dtype must be"):
        train.checkpoint_gradients(model_path(goldens, "shipped"), case["ids"], dtype="float16")
    with pytest.raises(ValueError, match="T >= 2"):
        train.next_token_loss(*load_model(model_path(goldens, "shipped"), "float32")[::-1], case["ids"][:, :1])
    with pytest.raises(InputError, match="float8"):
        train.checkpoint_gradients(model_path(goldens, "fp8"), case["ids"])
