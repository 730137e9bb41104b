"""Shared fixtures: the transformers goldens (recomputed when missing or stale) and loaded models."""

import functools
import hashlib
import json
import os
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(ROOT, "checkpoints", "glm5next-tiny")
GOLDENS = os.path.join(ROOT, ".goldens")
REFERENCE_PYTHON = os.environ.get("GLM5NEXT_REFERENCE_PYTHON", os.path.join(ROOT, ".venv-ref", "bin", "python"))
GOLDEN_INPUTS = [
    os.path.join(ROOT, "tests", "reference", "make_goldens.py"),
    os.path.join(ROOT, "tests", "reference", "requirements.txt"),
    os.path.join(ROOT, "checkpoints", "make_tiny.py"),
    *sorted(os.path.join(SHIPPED, f) for f in os.listdir(SHIPPED)),
]

PARITY_ERRORS: dict[str, float] = {}  # case -> measured error, printed at the end of the session


def _stamp():
    digest = hashlib.sha256()
    for path in GOLDEN_INPUTS:
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def _make_goldens():
    if not os.path.exists(REFERENCE_PYTHON):
        raise RuntimeError(
            f"the reference env is missing ({REFERENCE_PYTHON}); run scripts/setup.sh, "
            "or point GLM5NEXT_REFERENCE_PYTHON at a Python with torch 2.13.0 and transformers 5.23.0"
        )
    tmp = tempfile.mkdtemp(prefix="goldens-", dir=ROOT)
    subprocess.run([REFERENCE_PYTHON, GOLDEN_INPUTS[0], tmp], check=True, cwd=ROOT)
    shutil.rmtree(GOLDENS, ignore_errors=True)
    os.replace(tmp, GOLDENS)


@pytest.fixture(scope="session")
def goldens():
    """Path of the golden directory, regenerated from transformers unless it is current."""
    stamp_file = os.path.join(GOLDENS, "stamp")
    current = os.path.exists(os.path.join(GOLDENS, "manifest.json")) and (
        os.path.exists(stamp_file) and open(stamp_file).read() == _stamp()
    )
    if not current:
        _make_goldens()
        with open(stamp_file, "w") as f:
            f.write(_stamp())
    return GOLDENS


@pytest.fixture(scope="session")
def manifest(goldens):
    with open(os.path.join(goldens, "manifest.json")) as f:
        return json.load(f)


@functools.lru_cache(maxsize=None)
def load_model(path, dtype):
    import glm5next_jax

    return glm5next_jax.load_checkpoint(path, dtype)


def model_path(goldens, name):
    return SHIPPED if name == "shipped" else os.path.join(goldens, "models", name)


def golden_case(goldens, name):
    return dict(np.load(os.path.join(goldens, "cases", name + ".npz")))


def golden_layer(goldens, name):
    return dict(np.load(os.path.join(goldens, "layers", name + ".npz")))


def relative_error(got, want, where=None):
    """max |got - want| / max |want| over the positions `where` selects (all if None)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if where is not None:
        got, want = got[where], want[where]
    assert np.isfinite(got).all(), "non-finite values in the output"
    return float(np.abs(got - want).max() / np.abs(want).max())


def record(case, error):
    PARITY_ERRORS[case] = error
    return error


def pytest_terminal_summary(terminalreporter):
    if PARITY_ERRORS:
        terminalreporter.section("measured errors against transformers (max|d| / max|ref|)")
        for case, error in sorted(PARITY_ERRORS.items()):
            terminalreporter.write_line(f"{case:48s} {error:.3e}")
