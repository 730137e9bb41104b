"""Lazy views of checkpoint tensors: what a parameter is made of, read one slice at a time.

A parameter of the tree is a `View`: its shape, and `read(index)` that returns the slice `index`
(one slice per dimension) as numpy, reading from the files only the bytes that slice needs (whole
rows of a stored tensor at most). Views compose the stored tensors as the loader needs them:
transposes, stacks (the per-expert tensors of a MoE layer), an axis split in two, a scale, a
computation over whole heads (DSA's absorbed projections). `np.asarray(view)` reads all of it;
`view.evaluate(arrays)` computes all of it in jnp from the stored tensors given as arrays (traceable:
what training differentiates with respect to the stored tensors).

`TensorFiles` reads safetensors itself (header, then positioned reads of byte ranges), so that a
slice of a bf16 tensor costs its own bytes, and a damaged file is named in the error.
"""

from __future__ import annotations

import glob
import json
import math
import os
import struct

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .errors import InputError, MissingFileError

DTYPES = {
    "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16), "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I8": np.dtype(np.int8), "I16": np.dtype(np.int16), "I32": np.dtype(np.int32), "I64": np.dtype(np.int64),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
FLOAT8 = (DTYPES["F8_E4M3"], DTYPES["F8_E5M2"])


def full_index(shape):
    return tuple(slice(0, n) for n in shape)


def normalise(index, shape):
    """One slice(start, stop) with step 1 per dimension."""
    out = []
    for s, n in zip(index, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise InputError(f"views read contiguous slices only, got step {step}")
        out.append(slice(start, max(start, stop)))
    return tuple(out)


class View:
    """A lazily read array: `shape`, `dtype` (of what `read` returns) and `read(index)`."""

    shape: tuple[int, ...]
    dtype: np.dtype

    def read(self, index) -> np.ndarray:
        return self._read(normalise(index, self.shape))

    def _read(self, index) -> np.ndarray:
        raise NotImplementedError

    def evaluate(self, arrays):
        """The whole view in jnp, from `arrays` (stored name -> array)."""
        raise NotImplementedError

    def stored(self) -> list[Tensor]:
        """The stored tensors this view reads."""
        return [t for v in self.parts() for t in v.stored()]

    def parts(self):
        return [self.view]

    def __array__(self, dtype=None, copy=None):
        x = self.read(full_index(self.shape))
        return x if dtype is None else x.astype(dtype)

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def T(self):  # noqa: N802 (numpy's name)
        return Transpose(self, tuple(reversed(range(self.ndim))))


class Tensor(View):
    """A stored tensor."""

    def __init__(self, source, name, shape, dtype):
        self.source, self.name, self.shape, self.dtype = source, name, tuple(shape), np.dtype(dtype)

    def stored(self):
        return [self]

    def _read(self, index):
        return self.source.read(self.name, index)

    def evaluate(self, arrays):
        return jnp.asarray(arrays[self.name])


class Transpose(View):
    def __init__(self, view, perm):
        self.view, self.perm = view, tuple(perm)
        self.shape, self.dtype = tuple(view.shape[p] for p in perm), view.dtype

    def _read(self, index):
        inner = [None] * len(index)
        for out_axis, in_axis in enumerate(self.perm):
            inner[in_axis] = index[out_axis]
        return self.view._read(tuple(inner)).transpose(self.perm)

    def evaluate(self, arrays):
        return jnp.transpose(self.view.evaluate(arrays), self.perm)


class Stack(View):
    """Views of one shape stacked along a new `axis`."""

    def __init__(self, views, axis):
        self.views, self.axis = list(views), axis
        inner = views[0].shape
        self.shape = inner[:axis] + (len(self.views),) + inner[axis:]
        self.dtype = views[0].dtype

    def parts(self):
        return self.views

    def _read(self, index):
        rest = index[: self.axis] + index[self.axis + 1 :]
        parts = [self.views[i]._read(rest) for i in range(index[self.axis].start, index[self.axis].stop)]
        if not parts:
            return np.zeros(tuple(s.stop - s.start for s in index), self.dtype)
        return np.stack(parts, axis=self.axis)

    def evaluate(self, arrays):
        return jnp.stack([v.evaluate(arrays) for v in self.views], axis=self.axis)


class SplitAxis(View):
    """`axis` of size a * b read as two axes (a, b), as a row-major reshape."""

    def __init__(self, view, axis, sizes):
        a, b = sizes
        assert view.shape[axis] == a * b, (view.shape, axis, sizes)
        self.view, self.axis, self.sizes = view, axis, (a, b)
        self.shape, self.dtype = view.shape[:axis] + (a, b) + view.shape[axis + 1 :], view.dtype

    def _read(self, index):
        outer, inner = index[self.axis], index[self.axis + 1]
        b = self.sizes[1]
        span = slice(outer.start * b, max(outer.start * b, (outer.stop - 1) * b + b))  # whole rows of the outer axis
        x = self.view._read(index[: self.axis] + (span,) + index[self.axis + 2 :])
        x = x.reshape(x.shape[: self.axis] + (outer.stop - outer.start, b) + x.shape[self.axis + 1 :])
        return x[(slice(None),) * (self.axis + 1) + (inner,)]

    def evaluate(self, arrays):
        return jnp.reshape(self.view.evaluate(arrays), self.shape)


class Squeeze(View):
    def __init__(self, view, axis):
        assert view.shape[axis] == 1
        self.view, self.axis = view, axis
        self.shape, self.dtype = view.shape[:axis] + view.shape[axis + 1 :], view.dtype

    def _read(self, index):
        return self.view._read(index[: self.axis] + (slice(0, 1),) + index[self.axis :]).squeeze(self.axis)

    def evaluate(self, arrays):
        return jnp.squeeze(self.view.evaluate(arrays), self.axis)


class Scaled(View):
    """view * factor, computed in fp32."""

    def __init__(self, view, factor):
        self.view, self.factor = view, np.float32(factor)
        self.shape, self.dtype = view.shape, np.dtype(np.float32)

    def _read(self, index):
        return self.view._read(index).astype(np.float32) * self.factor

    def evaluate(self, arrays):
        return self.view.evaluate(arrays).astype(jnp.float32) * self.factor


class PerGroup(View):
    """A computed array whose `axis` holds groups of `width` (heads): `fn(groups, inputs)` computes the
    whole groups `groups` (a range) from `inputs`, the views' slices those groups need
    (`slice_of(groups) -> one index per view`); the result is cut to the index asked for."""

    def __init__(self, shape, axis, width, views, slice_of, fn):
        self.shape, self.axis, self.width = tuple(shape), axis, width
        self.views, self.slice_of, self.fn = views, slice_of, fn
        self.dtype = np.dtype(np.float32)

    def parts(self):
        return self.views

    def _read(self, index):
        span = index[self.axis]
        groups = range(span.start // self.width, -(-span.stop // self.width))
        inputs = [v._read(normalise(i, v.shape)) for v, i in zip(self.views, self.slice_of(groups))]
        x = self.fn(groups, *inputs)  # the whole groups, every other dimension whole
        offset = groups.start * self.width
        cut = list(index)
        cut[self.axis] = slice(span.start - offset, span.stop - offset)
        return x[tuple(cut)]

    def evaluate(self, arrays):
        return self.fn(range(self.shape[self.axis] // self.width), *[v.evaluate(arrays) for v in self.views])


class Float8(View):
    """A stored float8 weight's codes, as stored (the FP8 form keeps them beside their scales)."""

    def __init__(self, tensor: Tensor):
        self.view, self.shape, self.dtype = tensor, tensor.shape, tensor.dtype

    def _read(self, index):
        return self.view.source.read_stored(self.view.name, index)

    def evaluate(self, arrays):
        raise InputError(f"{self.view.name} is float8: its codes have no gradient (dequantize the checkpoint first)")


class BlockScaled(View):
    """A float8 weight [..., N, K] read as float32 values: each code times the scale of its block of
    the last two axes (`scale` [..., ceil(N / block), ceil(K / block)]), exactly."""

    def __init__(self, weight: Tensor, scale: Tensor, block: int = 128):
        self.weight, self.scale, self.block = weight, scale, block
        self.shape, self.dtype = weight.shape, np.dtype(np.float32)

    def parts(self):
        return [self.weight, self.scale]

    def _read(self, index):
        codes = self.weight.source.read_stored(self.weight.name, index).astype(np.float32)
        b = self.block
        spans = [slice(s.start // b, -(-s.stop // b)) for s in index[-2:]]
        scales = self.scale._read(index[:-2] + tuple(spans))
        for axis, span in zip((-2, -1), index[-2:]):
            offset = span.start - span.start // b * b
            scales = np.repeat(scales, b, axis=axis).take(range(offset, offset + span.stop - span.start), axis=axis)
        return codes * scales

    def evaluate(self, arrays):
        raise InputError(f"{self.weight.name} is float8: its codes have no gradient (dequantize the checkpoint first)")


class TensorFiles:
    """The tensors of a directory of (sharded) safetensors files, by name, read a slice at a time.

    Opening reads the index and every file's header, no tensor data. Damage is collected rather than
    raised, so that a checkpoint's every problem can be named at once: `problems` names each shard
    missing on disk, unreadable, or shorter than its header says; `unavailable` holds the tensors the
    index places where they cannot be found (a missing or unreadable shard, a header without them).
    A float8 tensor is never read as values: its values are meaningless without its block scales.
    """

    def __init__(self, path: str):
        index = os.path.join(path, "model.safetensors.index.json")
        self.entries = {}  # name -> (file, data start, dtype, shape)
        self.problems: list[str] = []
        self.unavailable: set[str] = set()
        self.sizes: dict[str, int] = {}  # shard -> bytes on disk
        if os.path.exists(index):  # the index says which file holds each tensor
            with open(index) as f:
                weight_map = _json(f, index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise InputError(f"{index} has no weight_map")
            self.files = sorted(set(weight_map.values()))
            headers = {file: self._header(path, file) for file in self.files}
            for name, file in weight_map.items():
                if headers[file] is None:
                    self.unavailable.add(name)
                elif name not in headers[file]:
                    self.problems.append(f"{index} places {name} in {file}, which does not hold it")
                    self.unavailable.add(name)
                else:
                    self.entries[name] = headers[file][name]
        else:
            self.files = sorted(os.path.basename(f) for f in glob.glob(os.path.join(path, "*.safetensors")))
            if not self.files:
                raise MissingFileError(f"no model.safetensors.index.json or *.safetensors in {path}")
            for file in self.files:
                self.entries.update(self._header(path, file) or {})

    def _header(self, path, file):
        """The header's entries of one shard, or None (a problem recorded) when it cannot be read."""
        full = os.path.join(path, file)
        if not os.path.isfile(full):
            self.problems.append(f"{full}: listed in the index but missing on disk")
            return None
        try:
            entries, unknown, end = _header(full)
        except InputError as err:
            self.problems.append(str(err))
            return None
        size = self.sizes[file] = os.path.getsize(full)
        if end > size:
            self.problems.append(f"{full}: truncated: {size:,} bytes, its header's tensors end at byte {end:,}")
        self.problems += [f"{full}: tensor {name} has dtype {dtype}, which the loader does not know" for name, dtype in unknown]
        self.unavailable.update(name for name, _ in unknown)
        return entries

    def names(self):
        return self.entries.keys()

    def __contains__(self, name):
        return name in self.entries

    def shape(self, name):
        return self.entries[name][3]

    def dtype(self, name):
        return self.entries[name][2]

    def file_bytes(self) -> int:
        return sum(self.sizes.values())

    def nbytes(self, name):
        _, _, dtype, shape = self.entries[name]
        return math.prod(shape) * dtype.itemsize

    def get(self, name) -> np.ndarray:
        return self.read(name, full_index(self.shape(name)))

    def get_stored(self, name) -> np.ndarray:
        """A whole tensor as stored (a float8 weight's codes included)."""
        return self.read_stored(name, full_index(self.shape(name)))

    def read(self, name, index) -> np.ndarray:
        """The slice `index` of a tensor: the rows of its first axis that the slice spans, read at once.
        A float8 tensor is refused: its values mean nothing without its scales (`BlockScaled`)."""
        if self.entries[name][2] in FLOAT8:
            raise InputError(f"{name} is {self.entries[name][2]}: block-scaled FP8 weights are read with their scales")
        return self.read_stored(name, index)

    def read_stored(self, name, index) -> np.ndarray:
        """The slice `index` of a tensor as stored (float8 codes included)."""
        file, start, dtype, shape = self.entries[name]
        if not shape:
            rows, row_shape = slice(0, 1), ()
        else:
            rows, row_shape = index[0], shape[1:]
        row_bytes = int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize
        count = rows.stop - rows.start
        with open(file, "rb") as f:
            data = os.pread(f.fileno(), count * row_bytes, start + rows.start * row_bytes)
        x = np.frombuffer(data, dtype).reshape((count,) + tuple(row_shape) if shape else ())
        return x[(slice(None),) + tuple(index[1:])] if shape else x.copy()


def _json(f, path):
    try:
        return json.load(f)
    except json.JSONDecodeError as e:
        raise InputError(f"{path} is not valid JSON: {e}") from None


def _header(file):
    """({name: (file, absolute data start, dtype, shape)}, [(name, unknown dtype)], the byte where the
    data ends by the header) of a safetensors file; an InputError when the header cannot be read."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < length <= size - 8:
            raise InputError(f"{file}: not a safetensors file (header length {length}, file of {size} bytes)")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InputError(f"{file}: the safetensors header is not valid JSON ({e})") from None
    out, unknown, end = {}, [], 8 + length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, stop = entry["data_offsets"]
        end = max(end, 8 + length + stop)
        if entry["dtype"] not in DTYPES:
            unknown.append((name, entry["dtype"]))
            continue
        out[name] = (file, 8 + length + begin, DTYPES[entry["dtype"]], tuple(entry["shape"]))
    return out, unknown, end


class ArraySource:
    """In-memory tensors by name (numpy arrays), with the interface of TensorFiles."""

    def __init__(self, arrays):
        self.arrays = {name: np.asarray(x) for name, x in arrays.items()}

    def names(self):
        return self.arrays.keys()

    def __contains__(self, name):
        return name in self.arrays

    def shape(self, name):
        return tuple(self.arrays[name].shape)

    def dtype(self, name):
        return self.arrays[name].dtype

    def get(self, name):
        return self.arrays[name]

    def read(self, name, index):
        return self.arrays[name][tuple(index)]

    read_stored = read
