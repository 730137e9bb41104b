"""The FP8 form of a converted linear as lazy views: `Fp8Weight(codes, scales)` in torch's [*batch,
*out, in] layout, from the view the loader builds for the plain form [*batch, in, *out].

Stored float8 weights keep their codes and scales: the plain view's composition (the per-expert
stacks, gate beside up, the transposes) is rebuilt twice, once over the codes and once over the
scale grids, each block of the scales following its block of codes. Stored bf16 (or fp32) weights
are quantized as they are read (`weights="fp8"`), in whole 128 x 128 blocks of amax / 448, the
release's quantizer, whichever slice a device asks for.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels import block_fp8

from .errors import InputError
from .params import Fp8Weight, Leaf, to_out_in
from .tensor_views import BlockScaled, Float8, SplitAxis, Squeeze, Stack, Tensor, Transpose, View


def fp8_views(view: View, leaf: Leaf, name: str) -> Fp8Weight:
    """The FP8 form of a converted linear's plain view (`name` says which parameter, for errors)."""
    torch = Transpose(view, to_out_in(tuple(range(view.ndim)), leaf.batch_dims))
    stored = view.stored()
    scaled = [isinstance(v, BlockScaled) for v in _leaves(view)]
    if all(scaled):
        codes, scales, blocked = _split(torch)
        if blocked[-2:] != (True, True) or any(blocked[:-2]):
            raise InputError(f"{name}: its stored blocks do not fall on the last two axes of [*batch, out, in]")
        return Fp8Weight(codes, scales)
    if any(scaled):
        raise InputError(f"{name}: made of float8 and unquantized tensors ({', '.join(t.name for t in stored)})")
    return Fp8Weight(Quantized(torch, codes=True), Quantized(torch, codes=False))


def _leaves(view):
    """The innermost views: stored tensors, or the float8 weights with their scales."""
    if isinstance(view, (Tensor, BlockScaled)):
        return [view]
    return [leaf for part in view.parts() for leaf in _leaves(part)]


def _split(view):
    """(codes view, scales view, which axes are in blocks) of a composition of BlockScaled tensors."""
    if isinstance(view, BlockScaled):
        return Float8(view.weight), view.scale, (False,) * (view.ndim - 2) + (True, True)
    if isinstance(view, Transpose):
        codes, scales, blocked = _split(view.view)
        return Transpose(codes, view.perm), Transpose(scales, view.perm), tuple(blocked[p] for p in view.perm)
    if isinstance(view, Stack):
        parts = [_split(v) for v in view.views]
        blocked = parts[0][2]
        return (Stack([p[0] for p in parts], view.axis), Stack([p[1] for p in parts], view.axis),
                blocked[: view.axis] + (False,) + blocked[view.axis:])
    if isinstance(view, SplitAxis):
        codes, scales, blocked = _split(view.view)
        a, b = view.sizes
        if blocked[view.axis] and b % block_fp8.BLOCK:
            raise InputError(f"a stored axis of {a} x {b} splits its 128-blocks ({b} is not a multiple of 128)")
        sizes = (a, b // block_fp8.BLOCK) if blocked[view.axis] else (a, b)
        return (SplitAxis(codes, view.axis, view.sizes), SplitAxis(scales, view.axis, sizes),
                blocked[: view.axis] + (False, blocked[view.axis]) + blocked[view.axis + 1:])
    if isinstance(view, Squeeze):
        codes, scales, blocked = _split(view.view)
        if not blocked[view.axis]:
            return Squeeze(codes, view.axis), Squeeze(scales, view.axis), blocked[: view.axis] + blocked[view.axis + 1:]
    raise InputError(f"a converted linear's stored float8 blocks cannot be kept through {type(view).__name__}")


class Quantized(View):
    """The codes (codes=True) or the scales of `view` [..., N, K] quantized in 128 x 128 blocks of its
    last two axes; a slice reads the whole blocks it touches."""

    def __init__(self, view: View, codes: bool):
        self.view, self.codes = view, codes
        lead, (n, k) = view.shape[:-2], view.shape[-2:]
        if codes:
            self.shape, self.dtype = view.shape, np.dtype(block_fp8.FP8)
        else:
            self.shape, self.dtype = lead + (block_fp8.blocks(n), block_fp8.blocks(k)), np.dtype(np.float32)

    def _read(self, index):
        b = block_fp8.BLOCK
        lead, (rows, cols) = index[:-2], index[-2:]
        if self.codes:  # the blocks the slice touches, cut to it after quantizing
            whole = [slice(s.start // b * b, min(-(-s.stop // b) * b, n)) for s, n in zip((rows, cols), self.shape[-2:])]
        else:
            whole = [slice(s.start * b, min(s.stop * b, n)) for s, n in zip((rows, cols), self.view.shape[-2:])]
        codes, scales = block_fp8.quantize_blocks(jnp.asarray(self.view._read(lead + tuple(whole)), jnp.float32))
        if not self.codes:
            return np.asarray(scales)
        cut = tuple(slice(s.start - w.start, s.stop - w.start) for s, w in zip((rows, cols), whole))
        return np.asarray(codes)[(...,) + cut]


class PerElement(View):
    """Block scales `view` per element of `shape` (the codes' shape) along `axes`: each element
    reads its block's scale. A slice reads the blocks it touches."""

    def __init__(self, view: View, axes, shape):
        self.view, self.axes = view, tuple(axes)
        self.shape = tuple(n if axis in self.axes else s for axis, (n, s) in enumerate(zip(shape, view.shape)))
        self.dtype = view.dtype

    def _read(self, index):
        b = block_fp8.BLOCK
        inner = tuple(slice(s.start // b, -(-s.stop // b)) if axis in self.axes else s for axis, s in enumerate(index))
        scales = self.view._read(inner)
        for axis in self.axes:
            offset = index[axis].start - inner[axis].start * b
            scales = np.repeat(scales, b, axis=axis).take(range(offset, offset + index[axis].stop - index[axis].start),
                                                          axis=axis)
        return scales


def expand_views(node: Fp8Weight, axes) -> Fp8Weight:
    """An `Fp8Weight` of views with its scales per element on `axes` (`sharding.scales_per_element`'s
    expand)."""
    return Fp8Weight(node.weight, PerElement(node.scale, axes, node.weight.shape))

