"""The Mosaic GPU intra kernel lowered for the H200 on the CPU (no GPU needed): the lowering checks
TMA shapes, layouts and wgmma operands that the interpreter does not."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import kda_intra


@pytest.mark.parametrize("b, t, h, d", [(1, 16384, 16, 128), (2, 130, 2, 64), (3, 1, 1, 64), (1, 200, 4, 128)])
def test_intra_kernel_lowers_for_the_gpu(b, t, h, d):
    shape = jax.ShapeDtypeStruct
    args = (
        *(shape((b, t, h, d), jnp.bfloat16) for _ in range(3)),
        shape((b, t, h, d), jnp.float32),
        shape((b, h, t), jnp.float32),
        shape((b,), jnp.int32),
    )
    text = jax.jit(kda_intra.intra).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
