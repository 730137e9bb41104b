"""Orbax: bit-exact round trips of params and caches, restored onto a given sharding; saves killed
part way leave the previous checkpoint or the new one."""

import collections
import os
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import ROOT, SHIPPED, load_model, record

import glm5next_jax
from glm5next_jax.cache import cache_axes
from glm5next_jax.sharding import make_layout, param_shardings
from glm5next_jax.store import restore_cache, restore_params, save_cache, save_params


def assert_identical(a_tree, b_tree):
    assert jax.tree.structure(a_tree) == jax.tree.structure(b_tree)
    for a, b in zip(jax.tree.leaves(a_tree), jax.tree.leaves(b_tree)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_params_round_trip_onto_a_sharding(tmp_path):
    config, params = load_model(SHIPPED, "bfloat16")
    save_params(tmp_path / "ckpt", params, config)
    restored_config, restored = restore_params(tmp_path / "ckpt", shardings=param_shardings(config, make_layout("3d")))
    assert restored_config == config
    assert_identical(params, restored)
    leaf = restored["layers"][4]["mlp"]["experts_gate_up"]
    assert leaf.sharding.mesh.axis_names == ("data", "expert", "model")


def test_fp8_cache_round_trip(tmp_path):
    config, params = load_model(SHIPPED, "bfloat16")
    cache = glm5next_jax.init_cache(config, 2, 64, latent_dtype="float8_e4m3fn", page_size=16)
    _, cache = glm5next_jax.prefill(params, config, np.arange(2, 42).reshape(2, 20), None, cache)
    save_cache(tmp_path / "cache", cache)
    assert_identical(cache, restore_cache(tmp_path / "cache"))
    shardings = make_layout("3d").shardings(cache_axes(cache))
    assert_identical(cache, restore_cache(tmp_path / "cache", shardings=shardings))


SAVE_AND_REPORT = r"""
import sys, time
import jax, jax.numpy as jnp, numpy as np
import glm5next_jax
from glm5next_jax.params import param_shapes
from glm5next_jax.store import save_params
config = glm5next_jax.Config.from_hf(sys.argv[1])
with np.load(sys.argv[3]) as leaves:
    values = [jnp.asarray(leaves[f"leaf{i}"]) for i in range(len(leaves.files))]
params = jax.tree.unflatten(jax.tree.structure(param_shapes(config, "float32")), values)
jax.block_until_ready(params)
print("start", flush=True)
start = time.perf_counter()
save_params(sys.argv[2], params, config)
print("done", time.perf_counter() - start, flush=True)
"""


def saving_process(path, leaves):
    """A process that saves the params in the file `leaves` (their leaves in order) to `path`, once it
    has said "start"."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-c", SAVE_AND_REPORT, SHIPPED, str(path), str(leaves)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "start", proc.stderr.read()[-3000:]
    return proc


def test_a_killed_save_leaves_the_old_or_the_new_checkpoint(tmp_path):
    """Saves over a checkpoint killed (SIGKILL) at 9 moments spread over a save's duration and once
    after the save said it was done (so that both sides of the switch are hit however slow a loaded
    machine makes a save): after each, the checkpoint restores bit for bit to what was there before
    or to what was being saved, never neither; no partial folder is read."""
    config = glm5next_jax.Config.from_hf(SHIPPED)
    by_seed = {seed: glm5next_jax.init_params(config, jax.random.key(seed), dtype="float32") for seed in (0, 1)}
    leaves = {seed: tmp_path / f"leaves{seed}.npz" for seed in by_seed}
    for seed, file in leaves.items():
        np.savez(file, **{f"leaf{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(by_seed[seed]))})
    path = tmp_path / "ckpt"
    full = saving_process(path, leaves[0])
    duration = float(full.stdout.readline().split()[1])
    assert full.wait() == 0
    held, outcomes = 0, collections.Counter()
    for i, fraction in enumerate([*np.linspace(0.0, 1.5, 9), None]):
        seed = 1 - held
        proc = saving_process(path, leaves[seed])
        if fraction is None:
            assert proc.stdout.readline().startswith("done"), proc.stderr.read()[-3000:]
            moment = "once done"
        else:
            time.sleep(fraction * duration)
            moment = f"at {fraction * duration:.3f} s"
        proc.kill()
        proc.wait()
        _, restored = restore_params(path)
        equal = [s for s in (held, seed) if all(
            np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
            for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(by_seed[s]), strict=True))]
        assert equal, f"kill {i} {moment} of a {duration:.3f} s save: neither checkpoint restored"
        outcomes["new" if equal[0] == seed else "old"] += 1
        held = equal[0]
    record(f"killed saves ({duration:.2f} s each): old kept / new complete", outcomes["old"] / max(outcomes["new"], 1))
    assert outcomes["old"] and outcomes["new"], outcomes  # the kills fell both before and after the switch


def test_a_partial_folder_is_never_restored(tmp_path):
    """A save killed before its switch leaves `.NAME.partial` beside the checkpoint; a restore of
    NAME reads the complete one, and a restore of a folder without the metadata is refused."""
    config = glm5next_jax.Config.from_hf(SHIPPED)
    params = glm5next_jax.init_params(config, jax.random.key(0), dtype="float32")
    save_params(tmp_path / "ckpt", params, config)
    shutil.copytree(tmp_path / "ckpt" / "params", tmp_path / ".ckpt.partial" / "params")
    assert_identical(params, restore_params(tmp_path / "ckpt")[1])
    with pytest.raises(FileNotFoundError, match=r"\.ckpt\.partial is not a checkpoint written by save_params"):
        restore_params(tmp_path / ".ckpt.partial")
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        restore_params(tmp_path / "missing")
    save_params(tmp_path / "ckpt", params, config)  # the next save removes what a killed one left
    assert not (tmp_path / ".ckpt.partial").exists()
