"""Orbax save/restore of params (with their config) and of caches, restorable onto a given sharding.

    save_params(path, params, config)        -> path/params (orbax), path/glm5next.json
    config, params = restore_params(path, shardings=None)
    save_cache(path, cache); cache = restore_cache(path, shardings=None)
    save_train_state(path, state, config, data_position)
    config, state, data_position = restore_train_state(path, like)

`shardings` is a tree of jax.sharding.Sharding matching the restored tree (e.g. from
sharding.param_shardings(config, layout) or layout.shardings(cache_axes(cache))); None restores onto
the default device.

A save never loses the checkpoint it replaces: everything is written into a sibling folder
(`.NAME.partial`), the metadata last, and only a complete folder takes the target's place, by an
atomic exchange of the two names (Linux's renameat2; elsewhere the old one is moved aside to
`NAME.previous` first, which a restore reads while NAME is missing). A process killed at any moment
leaves the old checkpoint or the new one restorable, never neither, and a partial folder is never
read: its name is not the target's, and the next save of that target removes it.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from .config import Config
from .errors import InputError, MissingFileError
from .params import param_shapes

META = "glm5next.json"


COMPLETE = "glm5next-complete"  # written last into a saved cache's folder


def _exchange(a, b):
    """Swap the names a and b in one step (renameat2's RENAME_EXCHANGE); False where the system has
    no such call."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_cwd, exchange = -100, 2
    if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), exchange) != 0:
        errno = ctypes.get_errno()
        if errno in (38, 22, 95):  # ENOSYS, EINVAL, EOPNOTSUPP: the file system cannot; move aside instead
            return False
        raise OSError(errno, f"swapping {a} and {b}: {os.strerror(errno)}")
    return True


def check_target(path, marker=META):
    """Refuse a save's target that holds something else than a checkpoint of ours (found by its
    `marker` file) or an empty folder: a save replaces the whole folder."""
    path = os.path.abspath(os.fspath(path))
    empty_folder = os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path)
    if os.path.lexists(path) and not empty_folder and not os.path.isfile(os.path.join(path, marker)):
        kind = "a folder" if os.path.isdir(path) else "a file"
        raise InputError(f"{path} is {kind} but not a checkpoint written here (no {marker} in it): a save would replace it")


def write_atomically(path, marker, write):
    """write(folder) into a fresh sibling of `path`, then the complete folder in path's place."""
    check_target(path, marker)
    path = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(path)
    partial, previous = os.path.join(parent, f".{name}.partial"), f"{path}.previous"
    if jax.process_index() == 0:
        os.makedirs(parent, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # a save that was killed
        if os.path.isdir(previous) and os.path.isdir(path):  # a fallback save that was killed after its last step
            shutil.rmtree(previous)
    _sync(f"glm5next_save_start:{path}")
    write(partial)
    _sync(f"glm5next_save_written:{path}")
    if jax.process_index() == 0:
        if not os.path.exists(path):
            os.rename(partial, path)
        elif _exchange(partial, path):
            shutil.rmtree(partial)  # the old checkpoint, under the partial name
        else:
            if os.path.exists(previous):
                shutil.rmtree(previous)
            os.rename(path, previous)  # from here until the next rename, a restore reads `previous`
            os.rename(partial, path)
            shutil.rmtree(previous)
    _sync(f"glm5next_save_done:{path}")


def _sync(name):
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _readable(path):
    """The folder a restore of `path` reads: path, or the checkpoint a killed save moved aside."""
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path):
        return path
    if os.path.isdir(f"{path}.previous"):
        return f"{path}.previous"
    raise MissingFileError(f"no checkpoint at {path}")


def _save_tree(folder, tree):
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(folder, tree)
    checkpointer.wait_until_finished()


def _restore(path, target):
    return ocp.StandardCheckpointer().restore(os.path.abspath(path), target)


def _with_shardings(shapes, shardings):
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), shapes)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def save_params(path, params, config: Config):
    """params and their config into the folder `path` (replacing a checkpoint there only once this one
    is complete). Every process of a multi-process run calls it; each writes its own shards."""

    def write(folder):
        _save_tree(os.path.join(folder, "params"), params)
        if jax.process_index() == 0:
            with open(os.path.join(folder, META), "w") as f:
                json.dump({"config": config.to_dict(), "dtype": str(params["embed_tokens"].dtype)}, f, indent=1)
                f.flush()
                os.fsync(f.fileno())

    write_atomically(path, META, write)


def restore_params(path, shardings=None, *, layout=None):
    """(config, params) saved by save_params, placed by `shardings` (a tree like param_shapes) or by a
    layout's rules (each process reading its own devices' shards)."""
    path = _readable(path)
    if not os.path.exists(os.path.join(path, META)):
        raise MissingFileError(f"{path} is not a checkpoint written by save_params: no {META} in it")
    with open(os.path.join(path, META)) as f:
        meta = json.load(f)
    config = Config(**meta["config"])
    if layout is not None:
        from .sharding import param_shardings

        shardings = param_shardings(config, layout)
    target = _with_shardings(param_shapes(config, meta["dtype"]), shardings)
    return config, _restore(os.path.join(path, "params"), target)


TRAIN_META = "glm5next-train.json"  # written last into a saved train state's folder


def save_train_state(path, state, config: Config, data_position: int = 0):
    """A training run's state (`train.TrainState`: params, optimizer state, step) with its config and
    how far into the data it is (`data_position`, e.g. examples consumed), into the folder `path`,
    replacing a state there only once this one is complete."""
    if isinstance(data_position, bool) or not isinstance(data_position, int) or data_position < 0:
        raise InputError(f"data_position must be an int >= 0, got {data_position!r}")

    def write(folder):
        _save_tree(os.path.join(folder, "state"), state)
        if jax.process_index() == 0:
            with open(os.path.join(folder, TRAIN_META), "w") as f:
                json.dump({"config": config.to_dict(), "data_position": data_position}, f, indent=1)
                f.flush()
                os.fsync(f.fileno())

    write_atomically(path, TRAIN_META, write)


def restore_train_state(path, like):
    """(config, state, data_position) saved by save_train_state; `like` is a state of the same
    structure (e.g. `train.init_train_state` of the same params and optimizer, or its
    `jax.eval_shape`) whose leaves' shapes, dtypes and shardings the restored leaves take."""
    path = _readable(path)
    if not os.path.exists(os.path.join(path, TRAIN_META)):
        raise MissingFileError(f"{path} is not a train state written by save_train_state: no {TRAIN_META} in it")
    with open(os.path.join(path, TRAIN_META)) as f:
        meta = json.load(f)
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None) or default), like
    )
    return Config(**meta["config"]), _restore(os.path.join(path, "state"), target), meta["data_position"]


def save_cache(path, cache):
    """Save a generation's cache into the folder `path`, to resume it later (pair it with the params it
    was made with); a cache already there is replaced only once this one is complete."""

    def write(folder):
        _save_tree(os.path.join(folder, "cache"), cache)
        if jax.process_index() == 0:
            with open(os.path.join(folder, COMPLETE), "w"):
                pass

    write_atomically(path, COMPLETE, write)


def restore_cache(path, shardings=None):
    path = _readable(path)
    if not os.path.exists(os.path.join(path, COMPLETE)):
        raise MissingFileError(f"{path} is not a cache written by save_cache: no {COMPLETE} in it")
    path = os.path.join(path, "cache")
    metadata = ocp.StandardCheckpointer().metadata(path).item_metadata
    shapes = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), jnp.dtype(m.dtype)), metadata.tree)
    shapes = _as_lists(shapes)
    return _restore(path, _with_shardings(shapes, shardings))


def _as_lists(tree):
    """Orbax metadata keeps list nodes as dicts keyed "0", "1", ...; the cache has a list of layers."""
    if isinstance(tree, dict):
        if tree and all(k.isdigit() for k in tree):
            return [_as_lists(tree[str(i)]) for i in range(len(tree))]
        return {k: _as_lists(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_as_lists(v) for v in tree]
    return tree
