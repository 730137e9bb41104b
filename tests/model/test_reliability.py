"""Bad input named before any work: checkpoint files and tensors, configs, token batches, sampling
arguments, and the CLI's one-line errors (exit status 2)."""

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import ROOT, SHIPPED, load_model

import glm5next_jax
from glm5next_jax import InputError, MissingFileError
from glm5next_jax.store import restore_cache, save_cache, save_params

EMBED = "model.language_model.embed_tokens.weight"


@pytest.fixture(scope="module")
def model():
    return load_model(SHIPPED, "float32")


def copied_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(SHIPPED, path)
    return path


def shard_of(path, name):
    with open(path / "model.safetensors.index.json") as f:
        return path / json.load(f)["weight_map"][name]


def rewrite_tensor(path, name, convert):
    from safetensors.numpy import load_file, save_file

    file = shard_of(path, name)
    tensors = load_file(file)
    tensors[name] = convert(tensors[name])
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("dtype", [np.int8, np.bool_, np.uint8])
def test_a_tensor_that_is_not_floating_point_is_named(tmp_path, dtype):
    path = copied_checkpoint(tmp_path)
    rewrite_tensor(path, EMBED, lambda x: x.astype(dtype))
    with pytest.raises(InputError, match=rf"not floating-point: {EMBED}: {np.dtype(dtype)}"):
        glm5next_jax.load_checkpoint(path, "float32")


@pytest.mark.parametrize("damage", ["truncated", "corrupted header", "missing"])
def test_a_damaged_shard_is_named(tmp_path, damage):
    path = copied_checkpoint(tmp_path)
    file = shard_of(path, EMBED)
    data = file.read_bytes()
    if damage == "truncated":
        file.write_bytes(data[: len(data) // 2])
    elif damage == "corrupted header":
        file.write_bytes(data[:8] + b"\xff" * 64 + data[72:])
    else:
        file.unlink()
    with pytest.raises((InputError, MissingFileError), match=str(file.name)):
        glm5next_jax.load_checkpoint(path, "float32")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_a_json_file_that_is_not_json_is_named(tmp_path, name):
    path = copied_checkpoint(tmp_path)
    (path / name).write_text("{not json")
    with pytest.raises(InputError, match=rf"{name} is not valid JSON"):
        glm5next_jax.load_checkpoint(path, "float32")


def test_another_models_config_is_refused(tmp_path):
    path = copied_checkpoint(tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="model_type must be one of .* got 'llama'"):
        glm5next_jax.load_checkpoint(path, "float32")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=float("nan")), "temperature must be a finite number"),
        (dict(temperature=float("inf")), "temperature must be a finite number"),
        (dict(temperature=1.0, top_p=float("nan")), "top_p must be in"),
        (dict(temperature=1.0, top_k=2.5), "top_k must be an integer"),
        (dict(seed=2**70), "seed must be in"),
        (dict(max_new_tokens=2.0), "max_new_tokens must be an integer"),
    ],
)
def test_sampling_arguments_are_checked(model, kwargs, message):
    config, params = model
    kwargs = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(InputError, match=message):
        glm5next_jax.generate(params, config, [[5, 6, 7]], **kwargs)


@pytest.mark.parametrize("prompt", [[5, 6.5, 7], [5, True, 7], [[5, 6]]])
def test_prompts_of_non_integer_ids_are_refused(model, prompt):
    config, params = model
    with pytest.raises(InputError, match=r"prompts\[0\] must be a list of integer token ids"):
        glm5next_jax.generate(params, config, [prompt], 2)


def test_forward_refuses_a_mask_with_a_hole_as_prefill_does(model):
    config, params = model
    ids, mask = np.array([[5, 6, 7, 8, 9]]), np.array([[1, 0, 1, 1, 1]])
    cache = glm5next_jax.init_cache(config, 1, 64, page_size=16)
    for call in (lambda: glm5next_jax.forward(params, config, ids, mask),
                 lambda: glm5next_jax.prefill(params, config, ids, mask, cache)):
        with pytest.raises(InputError, match=r"attention_mask rows \[0\] are neither left- nor right-padded"):
            call()


def test_an_empty_batch_is_refused(model):
    config, params = model
    cache = glm5next_jax.init_cache(config, 1, 64, page_size=16)
    with pytest.raises(InputError, match=r"at least one row .* got \(0, 5\)"):
        glm5next_jax.forward(params, config, np.zeros((0, 5), np.int32))
    with pytest.raises(InputError, match=r"at least one row .* got \(0, 5\)"):
        glm5next_jax.prefill(params, config, np.zeros((0, 5), np.int32), None, cache)
    with pytest.raises(InputError, match="prompts must be a non-empty list"):
        glm5next_jax.generate(params, config, [], 2)


def test_init_cache_takes_numpy_integers_and_refuses_bools(model):
    config, _ = model
    cache = glm5next_jax.init_cache(config, np.int64(2), np.int32(64), page_size=np.int64(16))
    assert jax.tree.leaves(cache)[0].shape[0] == 2
    with pytest.raises(InputError, match="batch must be an integer, got True"):
        glm5next_jax.init_cache(config, True, 64)


def test_restoring_what_is_not_there(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        restore_cache(tmp_path / "missing")
    (tmp_path / "other").mkdir()
    with pytest.raises(MissingFileError, match="is not a cache written by save_cache"):
        restore_cache(tmp_path / "other")


def test_a_save_refuses_to_replace_what_it_did_not_write(model, tmp_path):
    config, params = model
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("keep me")
    (tmp_path / "file").write_text("keep me too")
    for target in ("notes", "file"):
        with pytest.raises(InputError, match="not a checkpoint written here"):
            save_params(tmp_path / target, params, config)
    cache = glm5next_jax.init_cache(config, 1, 64, page_size=16)
    with pytest.raises(InputError, match="not a checkpoint written here"):
        save_cache(tmp_path / "notes", cache)
    assert (tmp_path / "notes" / "mine.txt").read_text() == "keep me"
    assert (tmp_path / "file").read_text() == "keep me too"


def cli_error(*args):
    """Run the CLI expecting a refusal: (its one stderr line, seconds it ran)."""
    result = subprocess.run([sys.executable, "-m", "glm5next_jax", *args], cwd=ROOT, capture_output=True, text=True)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, (result.returncode, result.stderr[-2000:])
    return lines[0]


def test_the_cli_names_bad_input_in_one_line_before_any_work(tmp_path):
    damaged = copied_checkpoint(tmp_path / "damaged")
    shard = shard_of(damaged, EMBED)
    shard.write_bytes(shard.read_bytes()[:1000])
    (tmp_path / "a_file").write_text("x")
    cases = [
        (("generate", "--ids", "5 6", "--checkpoint", str(damaged)), rf"{shard.name}: not a safetensors file"),
        (("generate", "--tokenizer", str(tmp_path / "none.json"), "--prompt", "hi"), "--tokenizer: no file at"),
        (("generate", "--tokenizer", str(tmp_path / "a_file"), "--prompt", "hi"), "is not a tokenizer.json"),
        (("generate", "--ids", "5 6", "--seed", str(2**70)), "seed must be in"),
        (("generate", "--ids", "5 6", "--temperature", "nan"), "temperature must be a finite number"),
        (("generate", "--ids", "5 6.5"), "--ids must be integer token ids"),
        (("convert", "--out", str(tmp_path / "a_file")), "a_file is a file but not a checkpoint written here"),
        (("convert", "--out", str(tmp_path)), "is a folder but not a checkpoint written here"),
        (("logits", "--ids", "5 6", "--out", str(tmp_path / "no" / "x.npy")), "--out: the folder .* does not exist"),
        (("generate", "--ids", "5 6", "--checkpoint", str(tmp_path / "none")), "none"),
    ]
    for args, message in cases:
        line = cli_error(*args, *(("--compilation-cache", "none") if args[0] != "convert" else ()))
        assert line.startswith(f"glm5next-jax {args[0]}: "), line
        assert re.search(message, line), (args, line)
    assert not (tmp_path / "a_file.partial").exists() and (tmp_path / "a_file").read_text() == "x"
    assert sorted(os.listdir(tmp_path)) == ["a_file", "damaged"]
