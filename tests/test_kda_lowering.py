"""The Mosaic GPU scan kernels (intra and chain) lowered for the H200 on the CPU (no GPU needed): the
lowering checks TMA shapes, layouts and wgmma operands that the interpreter does not."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import kda_chain


@pytest.mark.parametrize("b, t, h, d", [(1, 16384, 16, 128), (2, 130, 2, 64), (3, 1, 1, 64), (1, 200, 4, 128)])
def test_scan_kernels_lower_for_the_gpu(b, t, h, d):
    shape = jax.ShapeDtypeStruct
    args = (
        *(shape((b, t, h, d), jnp.bfloat16) for _ in range(3)),
        shape((b, t, h, d), jnp.float32),
        shape((b, t, h), jnp.float32),
        shape((b, h, d, d), jnp.float32),
        shape((b,), jnp.int32),
    )
    scan = jax.jit(lambda *a: kda_chain.chunk_scan(*a, out_dtype=jnp.bfloat16))
    text = scan.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 2  # the intra kernel and the chain
