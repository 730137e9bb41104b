"""`glm5next-jax convert --to fp8`: a bf16 (or float32) transformers checkpoint rewritten in the FP8
release's format, one tensor at a time.

The linears the release converts (`release_fp8.converted`) are stored as float8_e4m3fn with a
float32 `weight_scale_inv` per 128 x 128 block, scale = amax / 448 and value / scale rounded to e4m3
(`pallas_kernels.block_fp8.quantize_blocks`, transformers' `Fp8Quantize` to the bit on whole
blocks; a partial block at a ragged edge gets its own scale, which the release's format allows and
transformers' quantizer does not make). Every other tensor is copied as stored; config.json gains
the release's `quantization_config`; the folder's other files (tokenizer, generation config) are
copied. The output appears whole or not at all (`store.write_atomically`).
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np

from pallas_kernels import block_fp8

from . import release_fp8
from .config import Config, read_config_json
from .errors import InputError
from .progress import ByteProgress
from .safetensors_write import INDEX, nbytes, plan_shards, write_shards
from .store import check_target, write_atomically
from .tensor_views import DTYPES, FLOAT8, TensorFiles

DEFAULT_SHARD_BYTES = 5 * 2**30
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_QUANTIZABLE = ("BF16", "F16", "F32")


def plan_fp8(files: TensorFiles):
    """[[(name, safetensors dtype, shape)]]: each stored tensor as the FP8 release writes it (a
    converted weight beside its scales), in the files' order; an InputError names every tensor the
    release converts that cannot be quantized."""
    names = list(files.names())
    converted = set(release_fp8.converted(names))
    groups, problems = [], []
    for name in names:
        dtype, shape = _NAMES[files.dtype(name)], tuple(files.shape(name))
        if name not in converted:
            groups.append([(name, dtype, shape)])
        elif dtype not in _QUANTIZABLE or len(shape) != 2:
            problems.append(f"{name} is {dtype} {shape}: the release converts it, from a 2-d {'/'.join(_QUANTIZABLE)} weight")
        else:
            scale = (release_fp8.scale_name(name), "F32", release_fp8.scale_shape(shape))
            groups.append([(name, "F8_E4M3", shape), scale])
    if problems:
        raise InputError("cannot convert to FP8:\n  " + "\n  ".join(problems))
    return groups


def quantize_checkpoint(source, out, *, shard_bytes: int = DEFAULT_SHARD_BYTES, progress="auto") -> dict:
    """Write `source` (a transformers checkpoint directory) in the FP8 release's format at `out`.
    Returns {"tensors", "float8", "files", "bytes_in", "bytes_out"}."""
    source, out = os.fspath(source), os.fspath(out)
    if not os.path.isdir(source):
        raise InputError(f"--checkpoint: no checkpoint directory at {source}")
    if os.path.realpath(source) == os.path.realpath(out):
        raise InputError(f"--out {out} is the checkpoint being converted")
    check_target(out, INDEX)
    raw = read_config_json(source)
    Config.from_hf(raw)  # a model this package reads
    if "quantization_config" in raw or "quantization_config" in raw.get("text_config", {}):
        raise InputError(f"{source} is quantized already (its config.json has a quantization_config)")
    files = TensorFiles(source)
    if files.problems or files.unavailable:
        raise InputError(f"checkpoint {source}:\n  " + "\n  ".join(files.problems or sorted(files.unavailable)))
    float8 = [name for name in files.names() if files.dtype(name) in FLOAT8]
    if float8:
        raise InputError(f"{source} holds float8 tensors already ({len(float8)}, e.g. {float8[0]})")
    if shard_bytes <= 0:
        raise InputError(f"shard bytes must be positive, got {shard_bytes}")
    groups = plan_fp8(files)
    shards = plan_shards(groups, shard_bytes)
    quantize = jax.jit(block_fp8.quantize_blocks)
    config_json = {**raw, "quantization_config": release_fp8.quantization_config(files.names())}

    def arrays_of(group):
        name = group[0][0]
        if len(group) == 1:
            return [files.get_stored(name)]
        codes, scales = quantize(files.get(name).astype(np.float32))
        return [np.asarray(codes), np.asarray(scales)]

    def write(folder):
        os.makedirs(folder)
        with ByteProgress(progress, sum(nbytes(g) for g in groups), "writing") as bar:
            write_shards(folder, shards, arrays_of, bar.advance)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config_json, f, indent=2)
        for entry in os.scandir(source):
            if entry.is_file() and not entry.name.endswith(".safetensors") and entry.name not in (INDEX, "config.json"):
                shutil.copy2(entry.path, os.path.join(folder, entry.name))

    write_atomically(out, INDEX, write)
    return {"tensors": sum(len(g) for g in groups), "float8": sum(len(g) == 2 for g in groups), "files": len(shards),
            "bytes_in": sum(files.nbytes(name) for name in files.names()), "bytes_out": sum(nbytes(g) for g in groups)}
