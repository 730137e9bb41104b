"""Kimi Delta Attention's core: the chunked scan for prefill (Mosaic GPU: `prefill_intra_mosaic`, then
`prefill_chain_mosaic`), the decode step (the fused Triton step, `decode_fused_triton`, or its token
vectors then the Mosaic GPU state update, `decode_update_mosaic`), and their pure-jnp references
(`reference`), behind `kda_chunk_scan`, `kda_recurrent` and `kda_decode_step` (`api`); the chunked
scan's backward derived by hand (`chunk_backward`)."""

from pallas_kernels.kda.api import kda_chunk_scan, kda_decode_step, kda_recurrent
from pallas_kernels.kda.chunk_backward import kda_chunk_scan_backward
from pallas_kernels.kda.prefill_intra_mosaic import MIN_GATE
from pallas_kernels.kda.reference import (
    L2_EPS,
    causal_short_conv,
    check_scan_inputs,
    decode_token_vectors_reference,
    decode_update_reference,
    forget_gate,
    kda_chunk_scan_reference,
    kda_decode_step_reference,
    kda_recurrent_reference,
    l2_normalise,
)
from pallas_kernels.kda.testing import decode_token_inputs, random_decode_inputs

__all__ = [
    "L2_EPS",
    "MIN_GATE",
    "causal_short_conv",
    "check_scan_inputs",
    "decode_token_inputs",
    "decode_token_vectors_reference",
    "decode_update_reference",
    "forget_gate",
    "kda_chunk_scan",
    "kda_chunk_scan_backward",
    "kda_chunk_scan_reference",
    "kda_decode_step",
    "kda_decode_step_reference",
    "kda_recurrent",
    "kda_recurrent_reference",
    "l2_normalise",
    "random_decode_inputs",
]
