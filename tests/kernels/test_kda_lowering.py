"""The KDA kernels (the scan's intra and chain kernels in Mosaic GPU; the decode step's
Triton and Mosaic GPU kernels) lowered for the H200 on the CPU (no GPU needed; an abstract H200 stands in
for Triton's target): the lowering checks TMA shapes, layouts, wgmma operands and Triton's block
shapes, which the interpreter does not."""

import re

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import kda
from pallas_kernels.common import lower_for_h200
from pallas_kernels.kda import decode_update_mosaic, prefill_chain_mosaic


def lowered_calls(fn, *args):
    """The custom calls of `fn` lowered for the H200."""
    return re.findall(r"custom_call @([\w$.]+)", lower_for_h200(fn, *args).as_text())


@pytest.mark.parametrize(
    "b, t, h, d",
    # (2, 130, 80, 64): over one wave, so 64 value columns in one slot of u and A_qk u by default
    [(1, 16384, 16, 128), (2, 130, 2, 64), (3, 1, 1, 64), (1, 200, 4, 128), (1, 70, 3, 64), (1, 70, 5, 64),
     (2, 130, 80, 64)],
)
def test_scan_kernels_lower_for_the_gpu(b, t, h, d):
    args = prefill_chain_mosaic.scan_arg_shapes(b, t, h, d)
    calls = lowered_calls(lambda *a: prefill_chain_mosaic.chunk_scan(*a, out_dtype=jnp.bfloat16), *args)
    assert calls == ["mosaic_gpu_v2"] * 2, calls  # intra, chain


@pytest.mark.parametrize("multicast", [False, True])
@pytest.mark.parametrize("b, t, h, d", [(1, 8192, 64, 128), (8, 4096, 16, 128)])
def test_chain_with_one_value_slot_lowers_for_the_gpu(b, t, h, d, multicast):
    """64 value columns, the key tiles in two slots, u and A_qk u in one (221,184 B of SMEM)."""
    scan = lambda *a: prefill_chain_mosaic.chunk_scan(  # noqa: E731
        *a, out_dtype=jnp.bfloat16, block_v=64, value_slots=1, multicast=multicast
    )
    assert lowered_calls(scan, *prefill_chain_mosaic.scan_arg_shapes(b, t, h, d)) == ["mosaic_gpu_v2"] * 2


@pytest.mark.parametrize("value_slots", [1, 2])
@pytest.mark.parametrize("b, t, h, d", [(1, 16384, 16, 128), (2, 130, 3, 64)])
def test_chain_with_multicast_lowers_for_the_gpu(b, t, h, d, value_slots):
    """Clusters of a head's value blocks, TMA multicast and the cluster barrier that frees each slot."""
    scan = lambda *a: prefill_chain_mosaic.chunk_scan(  # noqa: E731
        *a, out_dtype=jnp.bfloat16, value_slots=value_slots, multicast=True
    )
    assert lowered_calls(scan, *prefill_chain_mosaic.scan_arg_shapes(b, t, h, d)) == ["mosaic_gpu_v2"] * 2


@pytest.mark.parametrize(
    "b, h, d, two_kernels",
    [(1, 64, 128, False), (8, 64, 128, False), (16, 64, 128, True), (256, 64, 128, True), (3, 2, 64, False),
     (256, 64, 64, False), (2, 4, 16, False), (1024, 64, 32, False)],
)
def test_decode_step_lowers_for_the_gpu(b, h, d, two_kernels):
    """States of 64 MiB and more at head dim 128: the Triton token vectors, then the Mosaic GPU
    update; smaller states and other head dims (64 among them) the fused Triton step."""
    assert (b * h * d * d * 4 >= decode_update_mosaic.MIN_STATE_BYTES and d in decode_update_mosaic.STEP_HEAD_DIMS) == two_kernels
    args = jax.eval_shape(lambda: kda.random_decode_inputs(jax.random.key(0), b, h, d))
    step = lambda x: kda.kda_decode_step(**x, lower_bound=-5.0, implementation="pallas")  # noqa: E731
    expected = ["__gpu$xla.gpu.triton", "mosaic_gpu_v2"] if two_kernels else ["__gpu$xla.gpu.triton"]
    assert lowered_calls(step, args) == expected
