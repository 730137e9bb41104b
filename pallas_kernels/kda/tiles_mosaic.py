"""The Mosaic GPU tile helpers both halves of the KDA scan build on: wgmma operands in SMEM, tiles
loaded into the WGMMA register layout, fp32 split into bf16 halves, and products summed in an
accumulator."""

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

WGMMA = plgpu.Layout.WGMMA
ROW = WGMMA.reduce(1)  # one value per row of a WGMMA-layout tile
COL = WGMMA.reduce(0)  # one value per column


def operand_smem(shape, dtype=jnp.bfloat16):
    """SMEM tiled and swizzled for its minor dimension, as wgmma operands need."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(shape[-1] * itemsize * 8)
    return plgpu.SMEM(
        shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))
    )


def load(ref, layout=WGMMA, optimized=True):
    """A tile from SMEM; `optimized` (the default) refuses access patterns with bank conflicts."""
    return plgpu.load(ref, layout=layout, optimized=optimized)


def split(x):
    """x ~= hi + lo, both bf16."""
    hi = x.astype(jnp.bfloat16)
    return hi, (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)


def matmul(shape, pairs):
    """sum(a @ b for a, b in pairs) in fp32 on the tensor cores, both operands SMEM refs."""

    def accumulate(acc):
        for a, b in pairs:
            plgpu.wgmma(acc, a, b)
        return acc[...]

    return pl.run_scoped(accumulate, plgpu.ACC(shape, jnp.float32))
