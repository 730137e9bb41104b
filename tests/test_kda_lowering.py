"""The scan's kernels (the gate sums in Triton; intra and chain in Mosaic GPU) lowered for the H200 on
the CPU (no GPU needed; an abstract H200 stands in for Triton's target): the lowering checks TMA
shapes, layouts, wgmma operands and Triton's block shapes, which the interpreter does not."""

import re

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
    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h200)):
        text = scan.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"custom_call @([\w$.]+)", text)
    assert calls.count("mosaic_gpu_v2") == 2 and calls.count("__gpu$xla.gpu.triton") == 1, calls
