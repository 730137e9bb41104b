"""The KDA references against each other: chunked vs recurrent vs the fused decode step; the chunked
scan's hand-derived backward against its vjp, and its gradients against finite differences."""

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from conftest import relative_error

from pallas_kernels import kda
from pallas_kernels.kda import chunk_backward


def random_inputs(key, b, t, h, d, *, gate="random", dtype=jnp.float32):
    kq, kk, kv, kg, kb = jax.random.split(key, 5)
    q = jax.random.normal(kq, (b, t, h, d), dtype)
    k = jax.random.normal(kk, (b, t, h, d), dtype)
    v = jax.random.normal(kv, (b, t, h, d), dtype)
    if gate == "lower_bound":
        g = jnp.full((b, t, h, d), -5.0)
    else:
        g = -5.0 * jax.nn.sigmoid(2.0 * jax.random.normal(kg, (b, t, h, d)))
    beta = jax.nn.sigmoid(jax.random.normal(kb, (b, t, h))).astype(dtype)
    return q, k, v, g, beta


# The default run keeps one case of each length; the rest of the grid is marked slow.
CHUNKED_DEFAULT = [(1, 1, False), (63, 4, True), (64, 1, True), (65, 4, False), (200, 4, True)]


@pytest.mark.parametrize(
    "t, h, with_state",
    CHUNKED_DEFAULT + [pytest.param(t, h, state, marks=pytest.mark.slow) for t in [1, 63, 64, 65, 200] for h in [1, 4]
                       for state in [False, True] if (t, h, state) not in CHUNKED_DEFAULT],
)
def test_chunked_equals_recurrent(t, h, with_state):
    key = jax.random.key(t * 10 + h)
    q, k, v, g, beta = random_inputs(key, 2, t, h, 16)
    s0 = jax.random.normal(jax.random.fold_in(key, 1), (2, h, 16, 16)) if with_state else None
    o_c, s_c = kda.kda_chunk_scan_reference(q, k, v, g, beta, s0)
    o_r, s_r = kda.kda_recurrent_reference(q, k, v, g, beta, s0)
    assert relative_error(o_c, o_r) < 1e-5 and relative_error(s_c, s_r) < 1e-5


def test_chunked_stable_with_gates_at_the_lower_bound():
    """exp(-5 * 64) underflows fp32: the chunked form must not form exp(+G) anywhere."""
    q, k, v, g, beta = random_inputs(jax.random.key(0), 1, 200, 2, 16, gate="lower_bound")
    o_c, s_c = kda.kda_chunk_scan_reference(q, k, v, g, beta)
    o_r, s_r = kda.kda_recurrent_reference(q, k, v, g, beta)
    assert relative_error(o_c, o_r) < 1e-5 and relative_error(s_c, s_r) < 1e-5


def test_chunks_compose_through_the_state():
    q, k, v, g, beta = random_inputs(jax.random.key(1), 2, 150, 3, 16)
    o_all, s_all = kda.kda_chunk_scan_reference(q, k, v, g, beta)
    o_a, s_a = kda.kda_chunk_scan_reference(q[:, :70], k[:, :70], v[:, :70], g[:, :70], beta[:, :70])
    o_b, s_b = kda.kda_chunk_scan_reference(q[:, 70:], k[:, 70:], v[:, 70:], g[:, 70:], beta[:, 70:], s_a)
    assert relative_error(jnp.concatenate([o_a, o_b], 1), o_all) < 1e-5
    assert relative_error(s_b, s_all) < 1e-5


def test_short_conv_state_carries_across_calls():
    key = jax.random.key(2)
    x = jax.random.normal(key, (2, 11, 3, 8))
    w = jax.random.normal(jax.random.fold_in(key, 1), (4, 3, 8))
    y_all, s_all = kda.causal_short_conv(x, w)
    y_a, s_a = kda.causal_short_conv(x[:, :6], w)
    y_b, s_b = kda.causal_short_conv(x[:, 6:], w, s_a)
    np.testing.assert_allclose(jnp.concatenate([y_a, y_b], 1), y_all, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(s_b, s_all)
    np.testing.assert_array_equal(s_all, jnp.moveaxis(x[:, -4:], 1, -1))


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_decode_steps_equal_the_sequence(lower_bound):
    """Decode steps one token at a time reproduce conv + gate + chunked core over the whole sequence."""
    b, t, h, d = 2, 9, 2, 16
    c = h * d
    key = jax.random.split(jax.random.key(3), 6)
    qkv = jax.random.normal(key[0], (b, t, 3, c))
    conv_w = 0.5 * jax.random.normal(key[1], (4, 3, c))
    f = jax.random.normal(key[2], (b, t, c))
    dt_bias = 0.1 * jax.random.normal(key[3], (c,))
    a_log = 0.3 * jax.random.normal(key[4], (h,))
    beta_logits = jax.random.normal(key[5], (b, t, h))

    y, _ = kda.causal_short_conv(qkv, conv_w)
    q, k, v = (y[:, :, i].reshape(b, t, h, d) for i in range(3))
    g = kda.forget_gate(f, dt_bias, a_log, lower_bound=lower_bound)
    o_seq, s_seq = kda.kda_chunk_scan_reference(q, k, v, g, jax.nn.sigmoid(beta_logits))

    conv_state = jnp.zeros((b, 3, c, 4))
    state = jnp.zeros((b, h, d, d))
    outs = []
    for i in range(t):
        o, conv_state, state = kda.kda_decode_step_reference(
            qkv[:, i], conv_state, conv_w, f[:, i], dt_bias, a_log, beta_logits[:, i], state, lower_bound=lower_bound
        )
        outs.append(o)
    assert relative_error(jnp.stack(outs, 1), o_seq) < 1e-5
    assert relative_error(state, s_seq) < 1e-5


# Segment runs of each row: a one-token segment, boundaries inside and on chunk edges, a last segment
# ending the row (its state is the row's final state).
SEGMENT_RUNS = [[40, 1, 89, 20], [64, 86]]


def segments_of(runs, t):
    ids = np.zeros((len(runs), t), np.int32)
    for row, lengths in enumerate(runs):
        ids[row] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
    return ids


@pytest.mark.parametrize("scan", ["chunked", "recurrent"])
def test_segments_run_as_sequences_apart(scan):
    """Packed sequences: each segment's outputs are those it gets alone (the first continuing the
    initial state), and the final state is the last segment's."""
    t = 150
    q, k, v, g, beta = random_inputs(jax.random.key(5), 2, t, 2, 16)
    s0 = jax.random.normal(jax.random.key(6), (2, 2, 16, 16))
    ids = segments_of(SEGMENT_RUNS, t)
    run = kda.kda_chunk_scan_reference if scan == "chunked" else kda.kda_recurrent_reference
    o, state = run(q, k, v, g, beta, s0, segment_ids=jnp.asarray(ids))
    for row, lengths in enumerate(SEGMENT_RUNS):
        start = 0
        for n in lengths:
            part = slice(start, start + n)
            init = s0[row : row + 1] if start == 0 else None
            o_alone, s_alone = kda.kda_recurrent_reference(
                *(x[row : row + 1, part] for x in (q, k, v, g, beta)), init
            )
            assert relative_error(o[row : row + 1, part], o_alone) < 1e-5, (row, start)
            start += n
        assert relative_error(state[row : row + 1], s_alone) < 1e-5
    # Without the segments the later ones would see their predecessors' state.
    o_whole, _ = run(q, k, v, g, beta, s0)
    assert relative_error(o_whole[:, 41:], o[:, 41:]) > 1e-2


def test_the_short_conv_stays_within_a_segment():
    t = 150
    x = jax.random.normal(jax.random.key(8), (2, t, 3, 8))
    weight = jax.random.normal(jax.random.key(9), (4, 3, 8))
    state = jax.random.normal(jax.random.key(10), (2, 3, 8, 4))
    ids = segments_of(SEGMENT_RUNS, t)
    y, _ = kda.causal_short_conv(x, weight, state, segment_ids=jnp.asarray(ids))
    for row, lengths in enumerate(SEGMENT_RUNS):
        start = 0
        for n in lengths:
            alone, _ = kda.causal_short_conv(x[row : row + 1, start : start + n], weight,
                                             state[row : row + 1] if start == 0 else None)
            np.testing.assert_allclose(y[row : row + 1, start : start + n], alone, rtol=1e-6, atol=1e-6)
            start += n


def test_the_pallas_scan_declines_segments():
    q, k, v, g, beta = random_inputs(jax.random.key(11), 1, 64, 1, 128, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="no segment_ids"):
        kda.kda_chunk_scan(q, k, v, g, beta, segment_ids=jnp.ones((1, 64), jnp.int32), implementation="pallas",
                           interpret=True)


@pytest.mark.parametrize("t, gate, lengths", [
    (1, "random", None),                   # T = 1
    (150, "random", (150, 97)),            # T not a multiple of the chunk, ragged lengths
    (128, "lower_bound", (128, 64)),       # every gate at the lower bound, a length on a chunk boundary
])
def test_hand_derived_backward_is_the_references_vjp(kernel_seed, t, gate, lengths):
    """`kda_chunk_scan_backward` (the Pallas scan's backward) against jax.vjp of the chunked reference
    in float64, with an initial state and cotangents for o and the final state, on fresh random
    inputs: within 2e-5 of it, but d g with every gate at the bound within 1e-4 (a sum that cancels
    to a few percent of its terms: up to 3.2e-5 over 8 draws, the fp32 reference's own vjp 6.8e-6)."""
    key = jax.random.key(kernel_seed)
    q, k, v, g, beta = random_inputs(key, 2, t, 3, 32, gate=gate)
    keys = jax.random.split(jax.random.fold_in(key, 1), 3)
    state = 0.1 * jax.random.normal(keys[0], (2, 3, 32, 32))
    d_o, d_state = jax.random.normal(keys[1], q.shape), jax.random.normal(keys[2], state.shape)
    lengths = None if lengths is None else jnp.array(lengths, jnp.int32)
    scan = lambda *x: kda.kda_chunk_scan_reference(*x, lengths=lengths)  # noqa: E731
    inputs, cotangents = (q, k, v, g, beta, state), (d_o, d_state)
    with jax.enable_x64(True):
        wide = lambda xs: [jnp.asarray(np.asarray(x), jnp.float64) for x in xs]  # noqa: E731
        exact = jax.vjp(scan, *wide(inputs))[1](tuple(wide(cotangents)))
        exact = [np.asarray(x) for x in exact]
    got = jax.jit(lambda *x: kda.kda_chunk_scan_backward(*x, lengths=lengths))(*inputs, *cotangents)
    for name, a, x, want in zip(["q", "k", "v", "g", "beta", "initial_state"], got, inputs, exact, strict=True):
        assert a.shape == x.shape and a.dtype == x.dtype, name
        bound = 1e-4 if name == "g" and gate == "lower_bound" else 2e-5
        assert relative_error(a, want) < bound, (name, relative_error(a, want), bound)


def test_chunked_reference_gradients_check_numerically():
    """The chunked reference's own gradients against finite differences (jax.test_util.check_grads,
    first order, reverse mode, float64 off: fp32 tolerances)."""
    q, k, v, g, beta = random_inputs(jax.random.key(3), 1, 20, 2, 8)
    state = 0.1 * jax.random.normal(jax.random.key(4), (1, 2, 8, 8))

    def scan(q, k, v, g, beta, state):
        o, final = kda.kda_chunk_scan_reference(q, k, v, g, beta, state, chunk_size=8)
        return jnp.sum(o * jnp.cos(o)) + jnp.sum(final**2)

    jax.test_util.check_grads(scan, (q, k, v, g, beta, state), order=1, modes=["rev"], atol=5e-2, rtol=5e-2, eps=1e-2)


def test_hand_derived_backward_in_groups_of_chunks(monkeypatch):
    """The backward's chunk-parallel passes taken a group of chunks at a time (GROUP_CHUNKS small:
    three groups of one chunk of all 6 sequences and heads) give the gradients of one pass over all."""
    q, k, v, g, beta = random_inputs(jax.random.key(5), 2, 150, 3, 32)
    state = 0.1 * jax.random.normal(jax.random.key(6), (2, 3, 32, 32))
    d_o, d_state = jax.random.normal(jax.random.key(7), q.shape), jax.random.normal(jax.random.key(8), state.shape)
    lengths = jnp.array([150, 97], jnp.int32)
    backward = lambda: kda.kda_chunk_scan_backward(q, k, v, g, beta, state, d_o, d_state, lengths=lengths)  # noqa: E731
    whole = backward()
    monkeypatch.setattr(chunk_backward, "GROUP_CHUNKS", 6)
    assert chunk_backward._groups(3, 6) == 3
    for name, a, b in zip(["q", "k", "v", "g", "beta", "initial_state"], backward(), whole, strict=True):
        assert relative_error(a, b) < 1e-6, (name, relative_error(a, b))
