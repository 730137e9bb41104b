"""`glm5next-jax convert --to fp8` on the shipped bf16 checkpoint: against transformers' quantizer where
it quantizes (whole blocks: scales within a float32 ulp and the same e4m3 codes but at near-ties,
as it computes 1 / (448 / amax) and multiplies), and against the release's rule (scale = amax / 448, codes the e4m3 rounding of
value / scale) recomputed in numpy on every converted weight, bit for bit; the load's progress in
bytes."""

import os
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import ROOT, SHIPPED, golden_layer, relative_error, release_fp8_weights

import glm5next_jax
from glm5next_jax.tensor_views import TensorFiles


def convert(*args):
    return subprocess.run([sys.executable, "-m", "glm5next_jax", "convert", *args], cwd=ROOT, capture_output=True, text=True)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("convert") / "fp8"
    result = convert("--to", "fp8", "--checkpoint", SHIPPED, "--out", str(out), "--shard-gb", "0.001")
    assert result.returncode == 0, result.stderr
    assert "writing" not in result.stderr  # no bar where stderr is not a terminal
    return out, result.stdout


def numpy_quantized(w):
    """The release's 128 x 128 block rule in numpy: scale = amax / 448 per block (a partial block at the
    edge its own), codes = value / scale rounded to e4m3."""
    w = np.asarray(w, np.float32)
    scales = np.zeros((-(-w.shape[0] // 128), -(-w.shape[1] // 128)), np.float32)
    codes = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            scales[i, j] = np.abs(block).max() / np.float32(448)
            codes[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (block / scales[i, j]).astype(ml_dtypes.float8_e4m3fn)
    return codes, scales


def test_converted_weights_are_transformers_quantizer_and_the_release_rule(goldens, converted):
    out, stdout = converted
    fp8, files = release_fp8_weights(out)  # the release's format: dtypes, scale shapes, quantization_config
    source = TensorFiles(SHIPPED)
    assert "272 float8" in stdout and len(fp8) == 272
    golden = golden_layer(goldens, "fp8_quantizer")
    whole = [name for name in golden if name.endswith(".weight")]
    assert len(whole) == 11  # the dense MLPs' and DSA's linears with whole blocks; the rest are ragged
    ties = 0
    for name in whole:
        # transformers stores 1 / (448 / amax) and rounds value x (448 / amax); the release's rule is
        # amax / 448 and value / scale: scales at most one float32 ulp apart, and the codes equal but
        # where value / scale lies within an ulp or two of the midpoint between two e4m3 values
        # (bf16 weights put many there), a code apart.
        scales = files.get(name + "_scale_inv")
        ulps = np.abs(scales.view(np.int32) - golden[name + "_scale_inv"].view(np.int32))
        assert ulps.max() <= 1, name
        ours, theirs = files.get_stored(name), golden[name].view(ml_dtypes.float8_e4m3fn)
        apart = ours.view(np.uint8) != theirs.view(np.uint8)
        scaled = source.get(name).astype(np.float32) / np.repeat(np.repeat(scales, 128, 0), 128, 1)
        midway = (ours.astype(np.float32) + theirs.astype(np.float32)) / 2
        assert np.all(np.abs(scaled - midway)[apart] <= 2.0**-22 * np.abs(midway[apart])), name
        ties += apart.sum()
    assert ties < 1e-2 * sum(golden[name].size for name in whole)
    for name in fp8:
        codes, scales = numpy_quantized(source.get(name))
        assert np.array_equal(files.get(name + "_scale_inv"), scales), name
        assert np.array_equal(files.get_stored(name).view(np.uint8), codes.view(np.uint8)), name
    kept = [name for name in source.names() if name not in fp8]
    assert sorted(kept) == sorted(n for n in files.names() if n not in fp8 and not n.endswith("_scale_inv"))
    for name in kept:
        assert np.array_equal(files.get_stored(name), source.get_stored(name)), name
    # Beside the weights, the source's other files (generation_config.json, tokenizer.json) come along.
    assert sorted(os.listdir(out)) == sorted(
        [f for f in os.listdir(out) if f.endswith(".safetensors")] + ["config.json", "generation_config.json",
                                                                      "model.safetensors.index.json", "tokenizer.json"]
    )


def test_the_converted_checkpoint_loads_as_the_bf16_one_quantized_at_load(converted):
    """Equal leaf for leaf, but DSA's absorbed q_b and o: the load absorbs them with kv_b in fp32 from
    the values it reads (bf16 there, e4m3 x scale here), as their products are no converted linear."""
    _, at_load = glm5next_jax.load_checkpoint(SHIPPED, "float32", weights="fp8", progress=False)
    _, stored = glm5next_jax.load_checkpoint(converted[0], "float32", progress=False)
    leaves = jax.tree.leaves_with_path(at_load)
    assert len(leaves) == len(jax.tree.leaves(stored))
    absorbed = 0
    for (path, a), b in zip(leaves, jax.tree.leaves(stored)):
        name = jax.tree_util.keystr(path)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if "absorb" in name:
            absorbed += 1
            assert relative_error(b, a) < 2.0**-4, name  # e4m3's rounding, half a step at most
        else:
            assert np.array_equal(np.asarray(a), np.asarray(b)), name
    assert absorbed == 4  # q_absorb and o_absorb of the two DSA layers


def test_convert_refuses_what_it_cannot_write(converted, tmp_path):
    out = str(converted[0])
    cases = [
        (["--checkpoint", out, "--out", str(tmp_path / "again")], "is quantized already"),
        (["--checkpoint", SHIPPED, "--out", SHIPPED], "is the checkpoint being converted"),
        (["--checkpoint", SHIPPED, "--out", str(tmp_path), "--mesh", "tp:2"], "--mesh"),
    ]
    (tmp_path / "notes.txt").write_text("keep")
    cases.append((["--checkpoint", SHIPPED, "--out", str(tmp_path)], "not a checkpoint written here"))
    for args, message in cases:
        result = convert("--to", "fp8", *args)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)
    assert (tmp_path / "notes.txt").read_text() == "keep" and not (tmp_path / "again").exists()


def test_loading_reports_the_stored_bytes_read():
    seen = []
    glm5next_jax.load_checkpoint(SHIPPED, "float32", progress=lambda done, total: seen.append((done, total)))
    files = TensorFiles(SHIPPED)
    vision = sum(files.nbytes(n) for n in files.names() if ".visual." in n)
    total = seen[0][1]
    assert total == sum(files.nbytes(n) for n in files.names()) - vision  # every text tensor once
    assert seen[0][0] == 0 and seen[-1][0] == total
    assert all(b[0] > a[0] for a, b in zip(seen, seen[1:]))
    result = subprocess.run([sys.executable, "-m", "glm5next_jax", "logits", "--ids", "5 17", "--progress", "on"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0 and "reading: 100%" in result.stderr, result.stderr
