"""Kimi Delta Attention (KDA) core: the gated delta rule with a per-channel forget gate.

Per head, with state S [dk, dv] in fp32, for each token t:
    S <- diag(exp g_t) S
    S <- S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = S^T q_t
q and k are L2-normalised here (x / sqrt(sum x^2 + 1e-6), in fp32) and q is scaled by dk^-0.5,
as transformers' `use_qk_l2norm_in_kernel=True` does.

`kda_chunk_scan` is the chunked (WY) form used for prefill; `kda_recurrent` the token-by-token form;
`kda_decode_step` one token per sequence with everything around the core fused in (the short conv
and its state, SiLU, L2 norm, forget gate, beta). The `*_reference` functions are pure jnp and are
the oracles of the Pallas kernels in `prefill_intra_mosaic`, `prefill_chain_mosaic`, `decode_fused_triton`
and `decode_update_mosaic`.

A batch of sequences of different lengths is passed right-padded with `lengths` [B] (valid tokens per
sequence, each in [0, T]; checked where the values are known, outside jit): a padded position
neither decays nor writes the state (g = 0, beta = 0 there), so the final state is each sequence's
state after its own last token; outputs at padded positions are meaningless. Several sequences
packed into a row carry `segment_ids` [B, T]: the state is discarded where the segment changes
(reference only: the Pallas scan declines them).

Dispatch (`implementation`, `interpret`): as `pallas_kernels.common.pick_implementation` says, the
kernels for bf16 inputs of supported shapes on a GPU (or in Pallas' interpreter with `interpret=True`),
else the reference.
The Pallas scan factors decays through reference tokens 16 tokens apart and is exact for gates
g >= prefill_intra_mosaic.MIN_GATE (-5 per token, which the model's lower bound guarantees); for unbounded
gates ask for "reference".

The Pallas scan differentiates (`jax.grad`): its forward keeps the state entering every chunk, and its
backward is `chunk_backward.kda_chunk_scan_backward` on those states, the serial d S recurrence in a
kernel (`backward_chain_mosaic`) and every chunk's own terms in XLA, all chunks at once.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.common import pick_implementation
from pallas_kernels.kda import (
    backward_chain_mosaic,
    decode_fused_triton,
    decode_update_mosaic,
    prefill_chain_mosaic,
    prefill_intra_mosaic,
)
from pallas_kernels.kda.chunk_backward import kda_chunk_scan_backward
from pallas_kernels.kda.reference import (
    check_scan_inputs,
    kda_chunk_scan_reference,
    kda_decode_step_reference,
    kda_recurrent_reference,
)


def _power_of_two(n, low, high):
    return low <= n <= high and n & (n - 1) == 0


def _scan_unsupported(q, v, chunk_size, segment_ids=None):
    if segment_ids is not None:
        return "the Pallas scan takes no segment_ids (packed sequences run on the reference)"
    if chunk_size != prefill_intra_mosaic.CHUNK:
        return f"chunk_size must be {prefill_intra_mosaic.CHUNK}, got {chunk_size}"
    if q.shape[-1] != v.shape[-1] or q.shape[-1] not in prefill_intra_mosaic.HEAD_DIMS:
        return f"dk and dv must be equal and one of {prefill_intra_mosaic.HEAD_DIMS}, got {q.shape[-1]} and {v.shape[-1]}"
    return None


def kda_chunk_scan(
    q, k, v, g, beta, initial_state=None, *, chunk_size=64, lengths=None, segment_ids=None, implementation=None,
    interpret=False, block_v=None, value_slots=None, o_products=None, multicast=None,
):
    """Chunked KDA for prefill; arguments and results as `kda_chunk_scan_reference`.

    `implementation` None / "reference" / "pallas" (see the module docstring), `interpret` runs the
    Pallas kernels in the interpreter, `block_v` the value columns per program of the serial chain,
    `value_slots` its buffering of u and A_qk u, `o_products` the precision of its q_w S and `multicast`
    its clusters (None picks each by the shape: `prefill_chain_mosaic.default_options`). The Pallas scan
    multiplies q, k and v as bf16 (other dtypes are rounded to it) and writes o in q's dtype.
    """
    check_scan_inputs(q, k, v, g, beta, initial_state, lengths, segment_ids)
    unsupported = _scan_unsupported(q, v, chunk_size, segment_ids)
    if pick_implementation(implementation, unsupported, q.dtype, interpret=interpret) == "reference":
        return kda_chunk_scan_reference(
            q, k, v, g, beta, initial_state, chunk_size=chunk_size, lengths=lengths, segment_ids=segment_ids
        )
    b, t, h, dk = q.shape
    lengths = jnp.full((b,), t, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
    if initial_state is None:
        initial_state = jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32)
    options = (chunk_size, block_v, value_slots, o_products, multicast, interpret)
    return _pallas_scan(q, k, v, g, beta, initial_state, lengths, options)


def _run_pallas_scan(q, k, v, g, beta, initial_state, lengths, options, keep_states):
    _, block_v, value_slots, o_products, multicast, interpret = options
    bf16 = jnp.bfloat16
    o, *states = prefill_chain_mosaic.chunk_scan(
        q.astype(bf16), k.astype(bf16), v.astype(bf16), g.astype(jnp.float32), beta,
        initial_state.astype(jnp.float32), lengths, out_dtype=q.dtype, block_v=block_v,
        value_slots=value_slots, o_products=o_products, multicast=multicast, keep_states=keep_states,
        interpret=interpret,
    )
    return o[:, : q.shape[1]], *states


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _pallas_scan(q, k, v, g, beta, initial_state, lengths, options):
    return _run_pallas_scan(q, k, v, g, beta, initial_state, lengths, options, keep_states=False)


def _pallas_scan_fwd(q, k, v, g, beta, initial_state, lengths, options):
    o, state, states = _run_pallas_scan(q, k, v, g, beta, initial_state, lengths, options, keep_states=True)
    return (o, state), (q, k, v, g, beta, initial_state, lengths, states)


def _pallas_scan_bwd(options, residuals, cotangents):
    *inputs, lengths, states = residuals
    state_gradients = functools.partial(backward_chain_mosaic.state_gradients, interpret=options[-1])
    return (*kda_chunk_scan_backward(*inputs, *cotangents, chunk_size=options[0], lengths=lengths, states=states,
                                     state_gradients=state_gradients), None)


_pallas_scan.defvjp(_pallas_scan_fwd, _pallas_scan_bwd)


def kda_recurrent(q, k, v, g, beta, initial_state=None, *, lengths=None, segment_ids=None):
    """Token-by-token KDA; see `kda_recurrent_reference` (reference only: prefill uses the chunked
    kernel and decode the fused step)."""
    return kda_recurrent_reference(q, k, v, g, beta, initial_state, lengths=lengths, segment_ids=segment_ids)


def _check_decode_inputs(qkv, conv_state, conv_weight, f, dt_bias, a_log, beta_logits, state):
    if qkv.ndim != 3 or qkv.shape[1] != 3:
        raise ValueError(f"qkv must be [B, 3, C], got {qkv.shape}")
    b, _, c = qkv.shape
    heads = a_log.shape[0] if a_log.ndim == 1 else 0
    if a_log.ndim != 1 or heads == 0 or c % heads:
        raise ValueError(f"a_log must be [H] with H dividing C = {c}, got {a_log.shape}")
    d = c // heads
    if conv_weight.ndim != 3 or conv_weight.shape[1:] != (3, c):
        raise ValueError(f"conv_weight must be [K, 3, C] = [K, 3, {c}], got {conv_weight.shape}")
    kernel = conv_weight.shape[0]
    expected = {
        "conv_state": (conv_state, (b, 3, c, kernel)),
        "f": (f, (b, c)),
        "dt_bias": (dt_bias, (c,)),
        "beta_logits": (beta_logits, (b, heads)),
        "state": (state, (b, heads, d, d)),
    }
    for name, (x, shape) in expected.items():
        if x.shape != shape:
            raise ValueError(f"{name} must be {list(shape)}, got {list(x.shape)}")


def kda_decode_step(
    qkv, conv_state, conv_weight, f, dt_bias, a_log, beta_logits, state, *, lower_bound, implementation=None,
    interpret=False,
):
    """Single-token KDA with everything around the core in the kernels; arguments and results as
    `kda_decode_step_reference`. Head dim 128 with a state of at least
    `decode_update_mosaic.MIN_STATE_BYTES` takes two kernels (`decode_update_mosaic`: the token vectors in Triton, the
    state update in Mosaic GPU); smaller states and other head dims the fused Triton step
    (`decode_fused_triton`).

    The Pallas kernels update `state` in place: donate it under jit, or XLA copies it first.
    """
    _check_decode_inputs(qkv, conv_state, conv_weight, f, dt_bias, a_log, beta_logits, state)
    d, kernel = state.shape[-1], conv_weight.shape[0]
    unsupported = None
    if not _power_of_two(d, 16, 128):
        unsupported = f"head dim must be a power of two in [16, 128], got {d}"
    elif not _power_of_two(kernel, 2, 8):  # the conv state is written as [channels, K] blocks
        unsupported = f"the conv's width K must be 2, 4 or 8, got {kernel}"
    if pick_implementation(implementation, unsupported, qkv.dtype, interpret=interpret) == "reference":
        return kda_decode_step_reference(
            qkv, conv_state, conv_weight, f, dt_bias, a_log, beta_logits, state, lower_bound=lower_bound
        )
    # Large states stream faster through the Mosaic GPU update (the state's loads by TMA, not through
    # L1: decode_update_mosaic's docstring); small ones, mostly served from L2, through the one fused kernel.
    two_kernels = d in decode_update_mosaic.STEP_HEAD_DIMS and state.size * 4 >= decode_update_mosaic.MIN_STATE_BYTES
    step = decode_update_mosaic.two_kernel_decode_step if two_kernels else decode_fused_triton.fused_decode_step
    return step(
        qkv, conv_state, conv_weight, f, dt_bias, a_log, beta_logits, state.astype(jnp.float32),
        lower_bound=lower_bound, interpret=interpret,
    )
