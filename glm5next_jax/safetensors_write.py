"""Writing a checkpoint in transformers' sharded safetensors layout one tensor at a time, so that a
checkpoint of hundreds of GiB never sits in memory: shards of whole tensor groups (a float8 weight
beside its scales), each file's header first and its tensors streamed after, then the index.

A tensor is (name, safetensors dtype, shape), the dtype one of `tensor_views.DTYPES`' names.
"""

from __future__ import annotations

import json
import math
import os
import struct

import numpy as np

from .tensor_views import DTYPES

INDEX = "model.safetensors.index.json"


def nbytes(tensors) -> int:
    return sum(math.prod(shape) * DTYPES[dtype].itemsize for _, dtype, shape in tensors)


def shard_header(tensors) -> tuple[bytes, int]:
    """(a safetensors file's first bytes: the header's length and the header, padded to 8 bytes, the
    data's size) for `tensors` laid out in order."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in tensors:
        size = nbytes([(name, dtype, shape)])
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, offset


def plan_shards(groups, shard_bytes: int):
    """`groups` (lists of tensors kept in one file), in order, cut into shards of at most `shard_bytes`
    (a group larger than that alone in its shard)."""
    if shard_bytes <= 0:
        raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
    shards, current, size = [], [], 0
    for group in groups:
        group_bytes = nbytes(group)
        if current and size + group_bytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(group)
        size += group_bytes
    if current:
        shards.append(current)
    return shards


def write_shards(folder: str, shards, arrays_of, written=None) -> dict:
    """Each shard (lists of groups, `plan_shards`) into `folder` as model-0000i-of-0000n.safetensors,
    `arrays_of(group)` giving the group's arrays in its tensors' order (each checked against its
    tensor's dtype and shape before it is written), then the index. `written(n)`, if given, is called
    with each array's bytes. Returns the index's weight_map."""
    weight_map, total = {}, 0
    for s, shard in enumerate(shards):
        file = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = [tensor for group in shard for tensor in group]
        head, size = shard_header(tensors)
        with open(os.path.join(folder, file), "wb") as f:
            f.write(head)
            for group in shard:
                arrays = arrays_of(group)
                if len(arrays) != len(group):
                    raise ValueError(f"{len(arrays)} arrays for the {len(group)} tensors {[t[0] for t in group]}")
                for (name, dtype, shape), array in zip(group, arrays):
                    array = np.asarray(array)
                    if array.dtype != DTYPES[dtype] or array.shape != tuple(shape):
                        raise ValueError(f"{name}: {array.dtype} {array.shape} given for {dtype} {tuple(shape)}")
                    f.write(np.ascontiguousarray(array).tobytes())
                    if written is not None:
                        written(array.nbytes)
        weight_map.update(dict.fromkeys((name for name, _, _ in tensors), file))
        total += size
    with open(os.path.join(folder, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return weight_map
