"""The Pallas KDA kernels (run in Pallas' interpreter on the CPU) against the pure-jnp references,
and the dispatch's argument checks.

Inputs are bf16 values; the chunked scan is compared in fp32 (inputs upcast) so that the error is
the kernel's, not the rounding of a bf16 output (one bf16 ulp at the largest output is up to 7.8e-3
of it); one test runs the real bf16 path. The interpreter computes the same bf16 products as the
GPU (fp32 operands as bf16 hi + lo halves); tests/kernels/test_kda_lowering.py lowers the kernels for the
GPU, and on the H200 the compiled kernels match the interpreter (docs/kda.md, bench/RESULTS.md).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import relative_error, traced_kernels
from kernel_case import KernelCase

from pallas_kernels import kda
from pallas_kernels.kda import (
    backward_chain_mosaic,
    chunk_backward,
    decode_fused_triton,
    decode_update_mosaic,
    prefill_chain_mosaic,
    prefill_intra_mosaic,
)

TOLERANCE = 2e-3


def bf16_valued(*xs):
    return [x.astype(jnp.bfloat16).astype(jnp.float32) for x in xs]


def scan_inputs(seed, b, t, h, d, *, gate="random"):
    ks = jax.random.split(jax.random.key(seed), 5)
    q, k, v = bf16_valued(*(jax.random.normal(kk, (b, t, h, d)) for kk in ks[:3]))
    if gate == "lower_bound":
        g = jnp.full((b, t, h, d), -5.0)
    else:
        g = -5.0 * jax.nn.sigmoid(2.0 * jax.random.normal(ks[3], (b, t, h, d)))
    (beta,) = bf16_valued(jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h))))
    return q, k, v, g, beta


SCAN_KERNELS = {"kda_intra": 1, "kda_chain": 1}
FUSED_DECODE_KERNELS = {"kda_decode_step": 1}
TWO_KERNEL_DECODE_KERNELS = {"kda_decode_token_vectors": 1, "kda_decode_update": 1}


def pallas_scan(*args, **kwargs):
    """The public scan with the kernels asked for, checked to reach them."""
    run = lambda: kda.kda_chunk_scan(*args, implementation="pallas", interpret=True, **kwargs)  # noqa: E731
    assert traced_kernels(run) == SCAN_KERNELS
    return run()


def assert_scan_matches(args, initial_state=None, lengths=None):
    o, s = pallas_scan(*args, initial_state, lengths=lengths)
    o_ref, s_ref = kda.kda_chunk_scan_reference(*args, initial_state, lengths=lengths)
    b, t = o.shape[:2]
    valid = np.ones((b, t), bool) if lengths is None else np.arange(t)[None, :] < np.asarray(lengths)[:, None]
    assert o.shape == o_ref.shape and s.shape == s_ref.shape
    assert relative_error(np.asarray(o)[valid], np.asarray(o_ref)[valid]) < TOLERANCE
    assert relative_error(s, s_ref) < TOLERANCE


# The default run keeps two of the grid (TestChunkScan covers one token and ragged chunk edges).
@pytest.mark.parametrize(
    "t, h, with_state",
    [(63, 4, True), (200, 1, False)]
    + [pytest.param(t, h, with_state, marks=pytest.mark.slow)
       for t in [1, 63, 64, 65, 200] for h in [1, 4] for with_state in [False, True]
       if (t, h, with_state) not in [(63, 4, True), (200, 1, False)]],
)
def test_chunk_scan_matches_reference(t, h, with_state):
    args = scan_inputs(t * 10 + h, 2, t, h, 64)
    s0 = jax.random.normal(jax.random.key(t), (2, h, 64, 64)) if with_state else None
    assert_scan_matches(args, s0)


def test_chunk_scan_head_dim_128_gates_at_the_lower_bound():
    """exp(-5 * 15) inside a sub-chunk is where the factored decays come closest to overflowing."""
    args = scan_inputs(1, 1, 130, 1, 128, gate="lower_bound")
    assert_scan_matches(args, jax.random.normal(jax.random.key(1), (1, 1, 128, 128)))


def test_chunk_scan_head_dim_128_random_gates():
    assert_scan_matches(scan_inputs(2, 1, 100, 2, 128))


@pytest.mark.parametrize("keys", ["repeated", "correlated"])
def test_chunk_scan_dense_within_a_chunk(keys):
    """No decay to speak of, beta = 1 and keys alike (a repeated token): A_kk is dense and its Neumann
    terms reach C(62, 31); the kernel's inverse must not go through them (an inverse by doubling gives inf)."""
    q, k, v, g, beta = scan_inputs(8, 1, 130, 2, 64)
    if keys == "repeated":
        k, g = jnp.broadcast_to(k[:, :1], k.shape), jnp.zeros_like(g)
    else:
        (k,) = bf16_valued(k + 3.0 * jax.random.normal(jax.random.key(8), (1, 1, 1, 64)))
        g = 0.01 * g
    assert_scan_matches((q, k, v, g, jnp.ones_like(beta)), jax.random.normal(jax.random.key(8), (1, 2, 64, 64)))


def test_chunk_scan_head_dim_64_two_chunks_exactly():
    assert_scan_matches(scan_inputs(9, 2, 128, 1, 64), jax.random.normal(jax.random.key(9), (2, 1, 64, 64)))


def test_chunk_scan_ragged_lengths_in_one_batch():
    args = scan_inputs(3, 3, 200, 2, 64)
    s0 = jax.random.normal(jax.random.key(3), (3, 2, 64, 64))
    assert_scan_matches(args, s0, lengths=jnp.array([200, 1, 77], jnp.int32))


@pytest.mark.parametrize(
    "t, lengths, h, d",
    [(150, [150, 1, 70], 2, 64), (1, [1, 1, 0], 1, 128), (128, [128, 64, 65], 1, 128)]
    + [pytest.param(*case, marks=pytest.mark.slow)
       for case in [(150, [150, 1, 70], 1, 128), (1, [1, 1, 0], 2, 64), (128, [128, 64, 65], 2, 64)]],
)
def test_intra_decay_against_a_float64_cumsum(t, lengths, h, d):
    """exp(G_last) per chunk, G the running sums of g that the intra kernel forms on the tensor cores
    (zero at or past each sequence's length): ragged lengths and tails, one token, an empty sequence."""
    b = 3
    q, k, v, g, beta = scan_inputs(t + h, b, t, h, d)
    lengths = np.array(lengths)
    args = (*(x.astype(jnp.bfloat16) for x in (q, k, v)), g, jnp.swapaxes(beta, 1, 2))
    decay = prefill_intra_mosaic.intra(*args, jnp.asarray(lengths, jnp.int32), qw_lo=False, interpret=True)[-1]
    padded = -(-t // 64) * 64
    x = np.where((np.arange(t) < lengths[:, None])[:, :, None, None], np.asarray(g, np.float64), 0.0)
    x = np.pad(x, [(0, 0), (0, padded - t), (0, 0), (0, 0)]).reshape(b, padded // 64, 64, h, d)
    want = np.exp(np.swapaxes(x.sum(axis=2), 1, 2))  # [B, H, chunks, d]
    # fp32 sums of up to 64 gates in [-5, 0]: a few fp32 ulps of |G| <= 320 (3e-5 each)
    assert decay.shape == want.shape
    np.testing.assert_allclose(decay, want, rtol=1e-4, atol=1e-37)


@pytest.mark.parametrize("o_products", [pytest.param(1, marks=pytest.mark.slow), 2])  # 2: a bf16 o's default
def test_chain_with_fewer_output_products(o_products):
    """q_w S in fewer bf16 products changes o alone: the state equals the three-product form's bit for
    bit, and o (fp32 here, to see the products' own error) stays within bf16's precision of the
    reference while the three-product form is well inside it (5e-4: the scores' tf32 products)."""
    b, t, h, d = 2, 130, 2, 64
    q, k, v, g, beta = scan_inputs(13, b, t, h, d)
    s0 = jax.random.normal(jax.random.key(13), (b, h, d, d))
    lengths = jnp.full((b,), t, jnp.int32)
    args = (*(x.astype(jnp.bfloat16) for x in (q, k, v)), g, beta, s0, lengths)
    o, s = prefill_chain_mosaic.chunk_scan(*args, out_dtype=jnp.float32, o_products=o_products, interpret=True)
    o3, s3 = prefill_chain_mosaic.chunk_scan(*args, out_dtype=jnp.float32, interpret=True)
    np.testing.assert_array_equal(s, s3)
    o_ref, _ = kda.kda_chunk_scan_reference(q, k, v, g, beta, s0, lengths=lengths)
    error, error3 = (relative_error(np.asarray(x[:, :t]), np.asarray(o_ref)) for x in (o, o3))
    assert error3 < 5e-4 and error < 4e-3, (error, error3)
    assert error > error3  # the fewer products do change o
    if o_products == 2:  # a bf16 o takes two products by default
        o_bf16, _ = prefill_chain_mosaic.chunk_scan(*args, out_dtype=jnp.bfloat16, interpret=True)
        np.testing.assert_array_equal(np.asarray(o_bf16, np.float32), np.asarray(o.astype(jnp.bfloat16), np.float32))


def test_intra_without_q_w_lo_half_writes_the_rest_unchanged():
    """intra(qw_lo=False), which a bf16 o's scan runs, writes every other output bit for bit as the
    full form does (q_w's hi half too); a three-product chain refuses the missing lo half."""
    b, t, h, d = 1, 70, 2, 64
    q, k, v, g, beta = scan_inputs(15, b, t, h, d)
    args = (*(x.astype(jnp.bfloat16) for x in (q, k, v)), g, jnp.swapaxes(beta, 1, 2), jnp.full((b,), t, jnp.int32))
    full = prefill_intra_mosaic.intra(*args, interpret=True)
    lean = prefill_intra_mosaic.intra(*args, qw_lo=False, interpret=True)
    assert lean[4] is None and full[4] is not None and np.abs(np.asarray(full[4], np.float32)).max() > 0
    for x, y in zip(full[:4] + full[5:], lean[:4] + lean[5:]):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    with pytest.raises(ValueError, match="qw_lo must be an array"):
        prefill_chain_mosaic.chain(*lean, jnp.zeros((b, h, d, d)), out_dtype=jnp.float32)


# Clusters of 2, 4 and 8 value blocks, each with u and A_qk u in one and two slots. The default run
# keeps one of the six (each case takes 10-30 s in the interpreter); the rest run with -m slow.
@pytest.mark.parametrize(
    "value_slots, d, block_v",
    [(2, 64, 32)]
    + [pytest.param(*case, marks=pytest.mark.slow)
       for case in [(1, 64, 32), (1, 128, 32), (2, 128, 32), (1, 128, 16), (2, 128, 16)]],
)
def test_chain_multicast_matches_separate_fetches(value_slots, d, block_v):
    """The chain with a head's value blocks in one cluster (tiles shared by TMA multicast, slots freed
    through a cluster barrier) computes what separate fetches do, bit for bit."""
    b, t, h = 1, 200, 2
    q, k, v, g, beta = scan_inputs(14, b, t, h, d)
    s0 = jax.random.normal(jax.random.key(14), (b, h, d, d))
    args = (*(x.astype(jnp.bfloat16) for x in (q, k, v)), g, beta, s0, jnp.full((b,), t, jnp.int32))
    run = functools.partial(
        prefill_chain_mosaic.chunk_scan, *args, out_dtype=jnp.bfloat16, block_v=block_v, value_slots=value_slots, interpret=True
    )
    o_mc, s_mc = run(multicast=True)
    o, s = run(multicast=False)
    np.testing.assert_array_equal(np.asarray(o_mc, np.float32), np.asarray(o, np.float32))
    np.testing.assert_array_equal(s_mc, s)


def test_chain_multicast_refuses_a_single_value_block():
    parts = [jnp.zeros((1, 1, 64, 64), jnp.bfloat16)] * 9 + [jnp.zeros((1, 1, 1, 64)), jnp.zeros((1, 1, 64, 64))]
    with pytest.raises(ValueError, match="multicast needs 2 to 8 value blocks"):
        prefill_chain_mosaic.chain(*parts, out_dtype=jnp.bfloat16, block_v=64, multicast=True)


# 64 columns in one slot: the default over several waves; 32 in one slot with multicast: an option.
@pytest.mark.parametrize("block_v, multicast", [pytest.param(32, True, marks=pytest.mark.slow), (64, False)])
def test_chain_with_one_value_slot_matches_two_slots(block_v, multicast):
    """The key tiles in two slots, u and A_qk u in one each (fetched anew once in registers): what
    the two-slot form computes, bit for bit at the same block width (at 64 columns the wgmmas sum in
    another order: within 1e-5 of 32 columns)."""
    b, t, h, d = 2, 200, 2, 128
    q, k, v, g, beta = scan_inputs(13, b, t, h, d)
    s0 = jax.random.normal(jax.random.key(13), (b, h, d, d))
    lengths = jnp.array([t, t - 61], jnp.int32)
    args = (*(x.astype(jnp.bfloat16) for x in (q, k, v)), g, beta, s0, lengths)
    run = functools.partial(prefill_chain_mosaic.chunk_scan, *args, out_dtype=jnp.bfloat16, multicast=multicast, interpret=True)
    o1, s1 = run(block_v=block_v, value_slots=1)
    o2, s2 = run(block_v=32, value_slots=2)
    valid = np.arange(t)[None, :] < np.asarray(lengths)[:, None]
    o1, o2 = (np.asarray(o[:, :t], np.float32)[valid] for o in (o1, o2))
    if block_v == 32:
        np.testing.assert_array_equal(o1, o2)
        np.testing.assert_array_equal(s1, s2)
    else:
        assert relative_error(s1, s2) < 1e-5
        assert np.abs(o1 - o2).max() <= 2**-7 * np.abs(o2).max()  # a bf16 rounding apart at most
    o_ref, s_ref = kda.kda_chunk_scan_reference(q, k, v, g, beta, s0, lengths=lengths)
    assert relative_error(o1, np.asarray(o_ref)[valid]) < 4e-3  # bf16 o
    assert relative_error(s1, s_ref) < 1e-4


@pytest.mark.parametrize(
    "b, h, d, out_dtype, chosen, want",
    [
        (1, 16, 128, jnp.bfloat16, {}, (32, 2, True)),  # 64 CTAs: one wave, clusters of a head's 4 blocks
        (1, 64, 128, jnp.bfloat16, {}, (64, 1, True)),  # 256 CTAs at 32 columns, 128 at 64: one wave
        (8, 16, 128, jnp.bfloat16, {}, (64, 1, False)),  # 256 CTAs at 64 columns: two waves
        (8, 16, 128, jnp.float32, {}, (32, 2, False)),  # q_w's lo half leaves no room for 64 columns
        (8, 16, 128, jnp.bfloat16, {"block_v": 32}, (32, 2, False)),
        (8, 16, 128, jnp.bfloat16, {"multicast": True, "value_slots": 1}, (64, 1, True)),
        (2, 80, 64, jnp.bfloat16, {}, (64, 1, False)),
        (2, 3, 64, jnp.bfloat16, {}, (32, 2, True)),
    ],
)
def test_chain_default_options_by_shape(b, h, d, out_dtype, chosen, want):
    assert prefill_chain_mosaic.default_options(b, h, d, out_dtype, sms=132, **chosen) == want


@pytest.mark.parametrize(
    "option, match",
    [
        (dict(value_slots=3), "value_slots must be 1 or 2"),
        (dict(o_products=4), "o_products must be 1, 2 or 3"),
        (dict(multicast=True, block_v=64), "multicast needs 2 to 8 value blocks"),
    ],
)
def test_chunk_scan_refuses_bad_chain_options_before_the_intra_kernel(monkeypatch, option, match):
    def intra_launched(*args, **kwargs):
        raise AssertionError("the intra kernel ran before the chain's options were checked")

    monkeypatch.setattr(prefill_intra_mosaic, "intra", intra_launched)
    b, t, h, d = 1, 64, 1, 64
    args = (*(jnp.zeros((b, t, h, d), jnp.bfloat16) for _ in range(3)), jnp.zeros((b, t, h, d)), jnp.zeros((b, t, h)))
    kwargs = dict(out_dtype=jnp.bfloat16, interpret=True) | option
    with pytest.raises(ValueError, match=match):
        prefill_chain_mosaic.chunk_scan(*args, jnp.zeros((b, h, d, d)), jnp.full((b,), t, jnp.int32), **kwargs)


def test_lengths_in_the_reference_stop_each_sequence_at_its_own_end():
    q, k, v, g, beta = scan_inputs(4, 2, 90, 2, 16)
    lengths = jnp.array([90, 37], jnp.int32)
    o, s = kda.kda_chunk_scan_reference(q, k, v, g, beta, lengths=lengths)
    o_short, s_short = kda.kda_chunk_scan_reference(*(x[1:, :37] for x in (q, k, v, g, beta)))
    assert relative_error(o[1, :37], o_short[0]) < 1e-5 and relative_error(s[1], s_short[0]) < 1e-5
    o_rec, s_rec = kda.kda_recurrent_reference(q, k, v, g, beta, lengths=lengths)
    assert relative_error(s_rec, s) < 1e-5
    assert relative_error(o_rec[0], o[0]) < 1e-5 and relative_error(o_rec[1, :37], o[1, :37]) < 1e-5


def test_chunk_scan_bf16_arrays():
    q, k, v, g, beta = scan_inputs(5, 1, 96, 2, 64)
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v, beta)]
    o, s = pallas_scan(*bf[:3], g, bf[3])
    o_ref, s_ref = kda.kda_chunk_scan_reference(q, k, v, g, beta)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    assert relative_error(o, o_ref) < 1e-2  # the bf16 rounding of o, at most one ulp
    assert relative_error(s, s_ref) < TOLERANCE


@pytest.mark.parametrize(
    "lower_bound, b, h, d",
    [(-5.0, 2, 2, 64), (None, 1, 1, 128)]
    + [pytest.param(*case, marks=pytest.mark.slow)
       for case in [(-5.0, 3, 2, 16), (-5.0, 1, 1, 128), (None, 3, 2, 16), (None, 2, 2, 64)]],
)
def test_decode_step_matches_reference(lower_bound, b, h, d):
    x = kda.random_decode_inputs(jax.random.key(d + b), b, h, d)
    run = lambda: kda.kda_decode_step(**x, lower_bound=lower_bound, implementation="pallas", interpret=True)  # noqa: E731
    assert traced_kernels(run) == FUSED_DECODE_KERNELS
    got = run()
    want = kda.kda_decode_step_reference(**x, lower_bound=lower_bound)
    for name, a, r in zip(["o", "conv_state", "state"], got, want):
        assert a.shape == r.shape and a.dtype == r.dtype, name
        assert relative_error(a, r) < TOLERANCE, name


@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("b, h, d", [(2, 2, 64), (1, 1, 128)])
def test_two_kernel_decode_step_matches_reference(lower_bound, b, h, d):
    """`decode_update_mosaic.two_kernel_decode_step` (what `kda_decode_step` runs for states of MIN_STATE_BYTES and more,
    too large for the interpreter) at small shapes."""
    x = kda.random_decode_inputs(jax.random.key(d + b + 1), b, h, d)
    got = decode_update_mosaic.two_kernel_decode_step(**x, lower_bound=lower_bound, interpret=True)
    want = kda.kda_decode_step_reference(**x, lower_bound=lower_bound)
    for name, a, r in zip(["o", "conv_state", "state"], got, want):
        assert a.shape == r.shape and a.dtype == r.dtype, name
        assert relative_error(a, r) < TOLERANCE, name


@pytest.mark.parametrize("b, h, d, block_v", [(2, 2, 64, 32), (1, 1, 128, 64)])
def test_fused_triton_decode_step_at_the_mosaic_head_dims(b, h, d, block_v):
    """The fused Triton step at the head dims that large states send to the two kernels, value
    blocks narrower than the head."""
    x = kda.random_decode_inputs(jax.random.key(d + block_v), b, h, d)
    got = decode_fused_triton.fused_decode_step(**x, lower_bound=-5.0, block_v=block_v, interpret=True)
    want = kda.kda_decode_step_reference(**x, lower_bound=-5.0)
    for name, a, r in zip(["o", "conv_state", "state"], got, want):
        assert relative_error(a, r) < TOLERANCE, name


@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("b, h, d", [(2, 3, 32), (1, 1, 128)])
def test_the_two_kernel_references_compose_to_the_step_reference(lower_bound, b, h, d):
    """The token vectors' and the update's references, one after the other, give the step's."""
    x = kda.random_decode_inputs(jax.random.key(d + h + 7), b, h, d)
    vectors, conv_state = kda.decode_token_vectors_reference(*kda.decode_token_inputs(x), lower_bound=lower_bound)
    o, state = kda.decode_update_reference(vectors, x["state"], out_dtype=jnp.float32)
    o_want, conv_want, state_want = kda.kda_decode_step_reference(**x, lower_bound=lower_bound)
    np.testing.assert_array_equal(conv_state, conv_want)
    assert relative_error(state, state_want) < 1e-5
    assert o_want.dtype == jnp.bfloat16 and relative_error(o, o_want) < 2**-8  # o_want rounded to bf16


@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("b, h, d", [(2, 3, 32), (1, 1, 128)])
def test_decode_token_vectors_match_the_reference(lower_bound, b, h, d):
    """`decode_fused_triton.token_vectors`: conv, norms, gate and beta against their reference."""
    x = kda.random_decode_inputs(jax.random.key(d + h), b, h, d)
    got = decode_fused_triton.token_vectors(*kda.decode_token_inputs(x), lower_bound=lower_bound, interpret=True)
    want = kda.decode_token_vectors_reference(*kda.decode_token_inputs(x), lower_bound=lower_bound)
    np.testing.assert_array_equal(got[1], want[1])
    assert got[0].shape == want[0].shape and got[0].dtype == want[0].dtype
    for i, name in enumerate(["q", "sqrt(beta) k", "decay", "sqrt(beta) v"]):
        assert relative_error(got[0][:, :, i], want[0][:, :, i]) < 1e-5, name


@pytest.mark.parametrize("b, h, d, block_v", [(2, 3, 64, 32), (1, 1, 128, 64), (3, 1, 128, 32)])
def test_decode_update_matches_the_reference(b, h, d, block_v):
    """`decode_update_mosaic.update_state` (the Mosaic GPU kernel) against its reference, the state updated in
    place under jit with donation."""
    x = kda.random_decode_inputs(jax.random.key(b * h + d), b, h, d)
    vectors, _ = kda.decode_token_vectors_reference(*kda.decode_token_inputs(x), lower_bound=-5.0)
    update = jax.jit(
        functools.partial(decode_update_mosaic.update_state, out_dtype=jnp.float32, block_v=block_v, interpret=True),
        donate_argnums=1,
    )
    o, state = update(vectors, x["state"] + 0)
    o_want, state_want = kda.decode_update_reference(vectors, x["state"], out_dtype=jnp.float32)
    assert relative_error(o, o_want) < 1e-5
    assert relative_error(state, state_want) < 1e-5


def test_decode_update_refuses_unsupported_shapes():
    vectors = jnp.zeros((1, 1, 4, 64))
    with pytest.raises(ValueError, match="got dk = 32, dv = 32"):
        decode_update_mosaic.update_state(jnp.zeros((1, 1, 4, 32)), jnp.zeros((1, 1, 32, 32)), out_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="got dk = 64, dv = 128"):
        decode_update_mosaic.update_state(vectors, jnp.zeros((1, 1, 64, 128)), out_dtype=jnp.bfloat16)
    state = jnp.zeros((1, 1, 64, 64))
    with pytest.raises(ValueError, match="block_v = 16"):
        decode_update_mosaic.update_state(vectors, state, out_dtype=jnp.bfloat16, block_v=16)
    with pytest.raises(ValueError, match=r"vectors must be float32 \[1, 1, 4, 64\], got float32 \[1, 1, 3, 64\]"):
        decode_update_mosaic.update_state(jnp.zeros((1, 1, 3, 64)), state, out_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="vectors must be float32"):
        decode_update_mosaic.update_state(vectors.astype(jnp.bfloat16), state, out_dtype=jnp.bfloat16)


@pytest.mark.parametrize(
    "b, h, d, kernels",
    [
        (64, 64, 128, TWO_KERNEL_DECODE_KERNELS),  # a 256 MiB state: streamed through the Mosaic GPU update
        (1, 64, 128, FUSED_DECODE_KERNELS),  # 4 MiB, mostly in L2: one fused kernel
        (64, 64, 64, FUSED_DECODE_KERNELS),  # head dim 64: fused at every size
    ],
)
def test_decode_step_dispatch_by_state_size(b, h, d, kernels):
    """What the automatic choice launches on a GPU (the interpreter chooses as on one), by shapes alone."""
    x = jax.eval_shape(lambda: kda.random_decode_inputs(jax.random.key(0), b, h, d))
    step = lambda args: kda.kda_decode_step(**args, lower_bound=-5.0, interpret=True)  # noqa: E731
    assert traced_kernels(step, x) == kernels
    assert traced_kernels(lambda args: kda.kda_decode_step(**args, lower_bound=-5.0), x) == {}  # the CPU: reference


def test_auto_dispatch_on_cpu_is_the_reference():
    args = scan_inputs(6, 1, 70, 1, 16)
    o, s = kda.kda_chunk_scan(*args)
    o_ref, s_ref = kda.kda_chunk_scan_reference(*args)
    np.testing.assert_array_equal(o, o_ref)
    np.testing.assert_array_equal(s, s_ref)


def test_bad_arguments_raise_before_any_launch():
    q, k, v, g, beta = scan_inputs(7, 2, 10, 2, 16)
    with pytest.raises(ValueError, match="beta"):
        pallas_scan(q, k, v, g, beta[:, :, :1])
    with pytest.raises(ValueError, match="initial_state"):
        pallas_scan(q, k, v, g, beta, jnp.zeros((2, 2, 16, 8)))
    with pytest.raises(ValueError, match="lengths"):
        pallas_scan(q, k, v, g, beta, lengths=jnp.array([3], jnp.int32))
    for lengths in ([10, 11], [-1, 10]):  # T = 10
        with pytest.raises(ValueError, match=r"lengths must be in \[0, T\] = \[0, 10\]"):
            pallas_scan(q, k, v, g, beta, lengths=jnp.array(lengths, jnp.int32))
    with pytest.raises(ValueError, match="chunk_size"):
        pallas_scan(q, k, v, g, beta, chunk_size=32)
    with pytest.raises(ValueError, match="dk and dv must be equal and one of"):
        pallas_scan(q, k, v, g, beta)  # head dim 16
    with pytest.raises(ValueError, match="dk and dv must be equal and one of"):
        pallas_scan(*(jnp.concatenate([x, x], -1) for x in (q, k)), v, jnp.concatenate([g, g], -1), beta)
    with pytest.raises(ValueError, match="implementation"):
        kda.kda_chunk_scan(q, k, v, g, beta, implementation="triton")
    x = kda.random_decode_inputs(jax.random.key(8), 2, 2, 16)
    with pytest.raises(ValueError, match="state"):
        kda.kda_decode_step(**{**x, "state": x["state"][:, :1]}, lower_bound=-5.0, implementation="pallas")
    with pytest.raises(ValueError, match="conv_state"):
        kda.kda_decode_step(**{**x, "conv_state": x["conv_state"][..., :3]}, lower_bound=-5.0)
    width_3 = {**x, "conv_state": x["conv_state"][..., :3], "conv_weight": x["conv_weight"][:3]}
    with pytest.raises(ValueError, match="the conv's width K must be 2, 4 or 8, got 3"):
        kda.kda_decode_step(**width_3, lower_bound=-5.0, implementation="pallas")
    got = kda.kda_decode_step(**width_3, lower_bound=-5.0)  # on the CPU: the reference, which takes any K
    np.testing.assert_array_equal(got[2], kda.kda_decode_step_reference(**width_3, lower_bound=-5.0)[2])


class TestChunkScan(KernelCase):
    """The chunked scan (intra, then chain) through `kda_chunk_scan`: one token; ragged sequences
    across chunk edges with an initial state; head dim 128 at the gates' lower bound.

    One token from a zero state gives o = beta (q . k) v: its k is drawn near q, since a random pair
    of 64-vectors is nearly orthogonal about once in a hundred draws, and then all of o, scaled by the
    cancelled product, is smaller than the bf16 rounding of q and k it is compared against."""

    cases = {
        "one token": dict(b=1, t=1, h=1, d=64, aligned=True),
        "ragged over chunk edges": dict(b=3, t=130, h=2, d=64, lengths=(130, 1, 64), state=True),
        "head dim 128, gates at the bound": dict(b=1, t=65, h=1, d=128, gate="lower_bound", state=True),
    }
    kernels = SCAN_KERNELS
    tolerance = TOLERANCE
    lowering_cases = {
        "the model's prefill": (dict(b=1, t=16384, h=16, d=128), ["mosaic_gpu_v2"] * 2),
        "over one wave": (dict(b=2, t=130, h=80, d=64), ["mosaic_gpu_v2"] * 2),
    }

    def inputs(self, key, b, t, h, d, lengths=None, state=False, gate="random", aligned=False):
        q, k, v, g, beta = scan_inputs(int(jax.random.randint(key, (), 0, 2**30)), b, t, h, d, gate=gate)
        if aligned:  # cos(q, k) about 0.9
            (k,) = bf16_valued(q + 0.5 * k)
        s0 = jax.random.normal(jax.random.fold_in(key, 1), (b, h, d, d)) if state else None
        return (q, k, v, g, beta, s0), dict(lengths=None if lengths is None else jnp.array(lengths, jnp.int32))

    def kernel(self, *args, interpret=True, **kwargs):
        return kda.kda_chunk_scan(*args, implementation="pallas", interpret=interpret, **kwargs)

    def reference(self, *args, **kwargs):
        return kda.kda_chunk_scan_reference(*args, **kwargs)

    def compare(self, got, want, b, t, lengths=None, **_):
        valid = np.ones((b, t), bool) if lengths is None else np.arange(t)[None, :] < np.array(lengths)[:, None]
        assert relative_error(got[0][valid], want[0][valid]) < TOLERANCE
        assert relative_error(got[1], want[1]) < TOLERANCE

    def lowering_args(self, b, t, h, d):
        q, k, v, g, beta, s0, _ = prefill_chain_mosaic.scan_arg_shapes(b, t, h, d)
        return (q, k, v, g, beta, s0), {}


class TestDecodeStep(KernelCase):
    """The decode step through `kda_decode_step`: the fused Triton step at small states, the two
    kernels (Triton token vectors, Mosaic GPU update) at 64 MiB of state and head dim 128."""

    cases = {"head dim 16, one sequence": dict(b=1, h=1, d=16), "head dim 64": dict(b=3, h=2, d=64)}
    kernels = FUSED_DECODE_KERNELS
    tolerance = TOLERANCE
    lowering_cases = {
        "batch 8 (fused)": (dict(b=8, h=64, d=128), ["__gpu$xla.gpu.triton"]),
        "batch 16 (two kernels)": (dict(b=16, h=64, d=128), ["__gpu$xla.gpu.triton", "mosaic_gpu_v2"]),
    }

    def inputs(self, key, b, h, d):
        return (), dict(kda.random_decode_inputs(key, b, h, d), lower_bound=-5.0)

    def kernel(self, *args, interpret=True, **kwargs):
        return kda.kda_decode_step(*args, implementation="pallas", interpret=interpret, **kwargs)

    def reference(self, *args, **kwargs):
        return kda.kda_decode_step_reference(*args, **kwargs)

    def lowering_args(self, b, h, d):
        names = ("qkv", "conv_state", "conv_weight", "f", "dt_bias", "a_log", "beta_logits", "state")
        shapes = jax.eval_shape(lambda: kda.random_decode_inputs(jax.random.key(0), b, h, d))
        return tuple(shapes[n] for n in names), dict(lower_bound=-5.0)


class TestChunkScanBackward(KernelCase):
    """jax.vjp through the Pallas scan (interpreted: intra, then the chain keeping every chunk's
    entering state; backward: `backward_chain_mosaic`'s d S recurrence, the rest in XLA) against
    jax.vjp of the reference, cotangents for o and the final state: one token; ragged sequences
    across chunk edges (T not a multiple of the chunk, a length on a chunk boundary, one of a single
    token) with an initial state; head dim 128 with every gate at the lower bound."""

    cases = {
        "one token": dict(b=1, t=1, h=1, d=64),
        "ragged over chunk edges": dict(b=3, t=130, h=2, d=64, lengths=(130, 1, 64)),
        "head dim 128, gates at the bound": dict(b=1, t=65, h=1, d=128, gate="lower_bound"),
    }
    kernels = {"kda_intra": 1, "kda_chain": 1, "kda_chain_backward": 1}
    tolerance = 2e-4  # the backward's own arithmetic is fp32's; the states it takes carry the forward's tf32 scores
    lowering_cases = {"the model's prefill": (dict(b=1, t=16384, h=16, d=128), ["mosaic_gpu_v2"] * 3)}

    def inputs(self, key, b, t, h, d, lengths=None, gate="random"):
        q, k, v, g, beta = scan_inputs(int(jax.random.randint(key, (), 0, 2**30)), b, t, h, d, gate=gate)
        keys = jax.random.split(jax.random.fold_in(key, 1), 3)
        state = 0.1 * jax.random.normal(keys[0], (b, h, d, d))
        d_o, d_state = bf16_valued(jax.random.normal(keys[1], q.shape), jax.random.normal(keys[2], state.shape))
        return (q, k, v, g, beta, state, d_o, d_state), dict(lengths=None if lengths is None else jnp.array(lengths))

    def _vjp(self, q, k, v, g, beta, state, d_o, d_state, **kwargs):
        scan = lambda *x: kda.kda_chunk_scan(*x, **kwargs)  # noqa: E731
        return jax.vjp(scan, q, k, v, g, beta, state)[1]((d_o, d_state))

    def kernel(self, *args, interpret=True, **kwargs):
        return self._vjp(*args, implementation="pallas", interpret=interpret, **kwargs)

    def reference(self, *args, **kwargs):
        return self._vjp(*args, implementation="reference", **kwargs)

    def lowering_args(self, b, t, h, d):
        q, k, v, g, beta, s0, _ = prefill_chain_mosaic.scan_arg_shapes(b, t, h, d)
        return (q, k, v, g, beta, s0, q, s0), {}


@pytest.mark.parametrize("b, h, n, d, block_v", [(1, 1, 1, 64, 32), (2, 3, 3, 64, 64), (1, 2, 2, 128, 32)])
def test_backward_chain_matches_its_reference(b, h, n, d, block_v):
    """`backward_chain_mosaic.state_gradients` (interpreted) against `state_gradients_reference`: one
    chunk; several sequences, heads and chunks in one value block; head dim 128 in four."""
    ks = jax.random.split(jax.random.key(n * d + h), 6)
    args = (jax.random.normal(ks[0], (b, h, n, 64, d)), jax.random.normal(ks[1], (b, h, n, d, d)),
            0.1 * jax.random.normal(ks[2], (b, h, n, 64, d)), 0.1 * jax.random.normal(ks[3], (b, h, n, 64, d)),
            jnp.exp(-jax.random.uniform(ks[4], (b, h, n, d))), jax.random.normal(ks[5], (b, h, d, d)))
    got = backward_chain_mosaic.state_gradients(*args, block_v=block_v, interpret=True)
    want = chunk_backward.state_gradients_reference(*args)
    for name, a, w in zip(["d v'", "d S'", "d S0"], got, want, strict=True):
        assert a.shape == w.shape and a.dtype == w.dtype, name
        assert relative_error(a, w) < 2e-5, (name, relative_error(a, w))
