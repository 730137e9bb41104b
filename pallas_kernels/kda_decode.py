"""The KDA decode step's state update in Pallas Mosaic GPU, after `kda_triton.token_vectors`
(`decode_step`); and the whole step in one warp-specialised launch (`fused_step`, not yet faster).

The step is a stream over the state. Loaded through L1, as a Triton kernel loads it, the slabs
stall under XLA's launch, which leaves 28 KiB of L1 per SM (85-88% of the state-bytes roofline at
best; bench/RESULTS.md, fifteenth session). Here each CTA (one warpgroup) takes one [dk, block_v]
slab of one head's state into shared memory by TMA, as swizzled [8, 32] fp32 tiles (unswizzled, the
WGMMA register layout's loads would conflict on the banks), updates it in registers and stores it
back in place by TMA: 89-93% on the H200 (bench/kda_decode_mosaic.py, sixteenth session; in the
step, seventeenth).

The token side (conv, SiLU, norms, gate, beta) runs before, in `kda_triton.token_vectors`: fused in
here, one channel per thread, the step ran at 53-63% of the roofline whether each slab's CTA or one
CTA per head computed it (bench/RESULTS.md, eighteenth session). Apart, it takes 0.015 / 0.050 ms
at batch 64 / 256 (H = 64, D = 128), the step 82-84% of the roofline in all (nineteenth session).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import kda_chain, kda_intra, kda_triton

BLOCK_V = 32  # the fastest slab width on the H200 (bench/RESULTS.md, sixteenth session)
HEAD_DIMS = (64, 128)  # dk: the WGMMA layout's 64-row tiles
# Where the two kernels beat the fused Triton step on the H200 (bench/RESULTS.md): from 64 MiB of
# state at D = 128 (H = 64, kernel ms: B = 8 0.0224 vs 0.0163, B = 16 0.0428 vs 0.0442, B = 64 0.155
# vs 0.161; seventeenth session); below it the state sits largely in the 50 MB L2, where one launch
# is cheaper. At D = 64 never: the token side weighs twice as much against a head's state, and the
# fused step was faster at every batch from 8 to 128 MiB (B = 512: 0.414 vs 0.434 ms with 64-column
# slabs, 0.488 with 32; eighteenth session).
MIN_STATE_BYTES = 64 * 2**20
STEP_HEAD_DIMS = (128,)

_F32 = jnp.float32
_SLAB = plgpu.Layout.WGMMA
_ROW, _COL = _SLAB.reduce(1), _SLAB.reduce(0)
SLAB_TRANSFORMS = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))


def update_slab(s_smem, rows_smem, v_smem, o_smem):
    """The delta rule on a [dk, block_v] slab in shared memory, written back there; o's block_v
    columns to o_smem. rows_smem [3, dk]: q (normalised, scaled), k' = sqrt(beta) k (k normalised),
    decay; v_smem [block_v]: v' = sqrt(beta) v (`kda.decode_token_vectors_reference`).

    With D = diag(decay): S <- D S + k' (v' - k'^T D S)^T, then o = q^T S."""
    dk, block_v = s_smem.shape
    s = plgpu.load(s_smem, layout=_SLAB)
    q, k, decay = (plgpu.load(rows_smem.at[i], layout=_ROW, optimized=False) for i in range(3))
    v = plgpu.load(v_smem, layout=_COL, optimized=False)

    def rows_of(x):
        return lax.broadcast_in_dim(x, (dk, block_v), [0])

    delta = v - jnp.sum(rows_of(k * decay) * s, axis=0)
    s = s * rows_of(decay) + rows_of(k) * lax.broadcast_in_dim(delta, (dk, block_v), [1])
    s_smem[...] = s
    o_smem[...] = jnp.sum(rows_of(q) * s, axis=0).astype(o_smem.dtype)


def _update_kernel(vectors_ref, s_ref, o_ref, s_smem, rows_smem, v_smem, o_smem, arrived):
    vb, h, b = lax.axis_index("v"), lax.axis_index("h"), lax.axis_index("b")
    block_v = s_smem.shape[1]
    cols = pl.ds(vb * block_v, block_v)
    plgpu.copy_gmem_to_smem(s_ref.at[b, h, :, cols], s_smem, arrived)
    plgpu.copy_gmem_to_smem(vectors_ref.at[b, h, pl.ds(0, 3)], rows_smem, arrived)
    plgpu.copy_gmem_to_smem(vectors_ref.at[b, h, 3, cols], v_smem, arrived)
    plgpu.barrier_wait(arrived)
    update_slab(s_smem, rows_smem, v_smem, o_smem)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(s_smem, s_ref.at[b, h, :, cols])
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, h, cols])
    plgpu.wait_smem_to_gmem(0)


def update_state(vectors, state, *, out_dtype, block_v=BLOCK_V, interpret=False):
    """vectors [B, H, 4, d] fp32 from `kda_triton.token_vectors` (q, sqrt(beta) k, decay,
    sqrt(beta) v), state [B, H, d, d] fp32 (d in HEAD_DIMS, a multiple of block_v in {32, 64}):
    (o [B, H, d] in out_dtype, the new state). The state is updated in place (donate it under jit,
    or XLA copies it first). One CTA per slab, the value block varying fastest in launch order, then
    the head: CTAs resident together stream one contiguous stretch of the state (with the batch
    fastest, 4 MiB apart, the step ran at 67-74% of the roofline on the H200 rather than the probe's
    92-93%). The oracle is `kda.decode_update_reference`."""
    b, h, dk, dv = state.shape
    if dk not in HEAD_DIMS or dv != dk or block_v not in (32, 64) or dv % block_v:
        raise ValueError(f"the state must be [B, H, d, d] with d one of {HEAD_DIMS}, a multiple of block_v in"
                         f" (32, 64); got dk = {dk}, dv = {dv}, block_v = {block_v}")
    if vectors.shape != (b, h, 4, dk) or vectors.dtype != _F32:
        raise ValueError(f"vectors must be float32 [{b}, {h}, 4, {dk}], got {vectors.dtype} {list(vectors.shape)}")
    kernel = plgpu.kernel(
        _update_kernel,
        out_type=jax.ShapeDtypeStruct((b, h, dv), out_dtype),
        grid=(b, h, dv // block_v),  # Mosaic GPU launches the last grid axis fastest
        grid_names=("b", "h", "v"),
        scratch_types=(
            plgpu.SMEM((dk, block_v), _F32, transforms=SLAB_TRANSFORMS),
            plgpu.SMEM((3, dk), _F32),
            plgpu.SMEM((block_v,), _F32),
            plgpu.SMEM((block_v,), out_dtype),
            plgpu.Barrier(num_arrivals=3),
        ),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="kda_decode_update",
    )
    # The state goes in as a mutable Ref: the kernel writes each slab back where it read it.
    state = jax.new_ref(state)
    o = kernel(vectors, state)
    return o, jax.freeze(state)


def decode_step(
    qkv, conv_state, conv_weight, f, dt_bias, a_log, beta_logits, state, *, lower_bound, block_v=BLOCK_V,
    token_warps=4, interpret=False,
):
    """The one-token KDA step in two kernels: `kda_triton.token_vectors`, then `update_state`. Shapes
    and results as `kda.kda_decode_step` (checked there)."""
    vectors, conv_state = kda_triton.token_vectors(
        qkv, conv_state, conv_weight, f, dt_bias, a_log, beta_logits, lower_bound=lower_bound, num_warps=token_warps,
        interpret=interpret,
    )
    o, state = update_state(vectors, state, out_dtype=qkv.dtype, block_v=block_v, interpret=interpret)
    return o, conv_state, state


def _default_programs(heads_total):
    """The persistent step's CTA count: the largest divisor of B * H up to one CTA an SM (one fits at
    3 heads' buffers of 64 KiB), so that every CTA walks the same number of heads."""
    sms = kda_chain.sm_count()
    return max(n for n in range(1, min(heads_total, sms) + 1) if heads_total % n == 0)


def _sum_of(ref):
    """The sum of a [n] fp32 vector in shared memory, read in full by every thread: Mosaic GPU reduces
    a vector to a scalar through a scratch buffer of the kernel's, which its lowering refuses with two
    warpgroups. A tree of independent loads, not a chain."""
    terms = [ref[i] for i in range(ref.shape[0])]
    while len(terms) > 1:
        terms = [a + b for a, b in zip(terms[::2], terms[1::2])]
    return terms[0]


def _token_side(inputs, conv_out_ref, rows_smem, v_smem, squares_smem, b, h, *, lower_bound):
    """One head's vectors into a slot (the token warpgroup, one channel a thread): rows_smem [3, d]
    gets q (normalised, scaled), sqrt(beta) k (k normalised) and the decay, v_smem [d] sqrt(beta) v,
    as `kda.decode_token_vectors_reference`; the head's new conv state goes to conv_out_ref. Every
    load comes before the first store: the compiler cannot move a load above a store to global
    memory that might alias it, and each such order costs a round trip to HBM."""
    qkv_ref, conv_ref, weight_ref, f_ref, dt_bias_ref, a_log_ref, beta_ref = inputs
    d, taps = v_smem.shape[0], weight_ref.shape[0]
    chans = pl.ds(h * d, d)
    windows = [[conv_ref[b, part, chans, j] for j in range(1, taps)] + [qkv_ref[b, part, chans]] for part in range(3)]
    weights = [[weight_ref[j, part, chans] for j in range(taps)] for part in range(3)]
    decay, beta = kda_triton.decay_and_beta(f_ref, dt_bias_ref, a_log_ref, beta_ref, b, h, chans, lower_bound)
    for part, window in enumerate(windows):
        for j, x in enumerate(window):
            conv_out_ref[b, part, chans, j] = x
    q, k, v = (
        kda_triton.silu_as(sum(x.astype(_F32) * w for x, w in zip(window, ws)), qkv_ref.dtype)
        for window, ws in zip(windows, weights)
    )
    squares_smem[0] = q * q
    squares_smem[1] = k * k
    plgpu.commit_smem()  # the squares, written one a thread, are summed by every thread
    root_beta = jnp.sqrt(beta)
    rows_smem[0] = q * (d**-0.5 / jnp.sqrt(_sum_of(squares_smem.at[0]) + kda_intra.L2_EPS))
    rows_smem[1] = k * (root_beta / jnp.sqrt(_sum_of(squares_smem.at[1]) + kda_intra.L2_EPS))
    rows_smem[2] = decay
    v_smem[...] = v * root_beta


def _fused_kernel(*refs, heads, programs, state_warpgroups, lower_bound, sides):
    inputs, (state_ref, o_ref, conv_out_ref) = refs[:7], refs[7:10]
    slabs, o_smem, rows_smem, v_smem, squares_smem, loaded, ready, free, drained = refs[10:]
    p, wg = lax.axis_index("p"), lax.axis_index("wg")
    stages, _, dk, block_v = slabs.shape
    slots = rows_smem.shape[0]  # heads' vectors the token warpgroup may run ahead by
    n_cols = state_ref.shape[-1] // block_v
    own = state_ref.shape[0] * heads // programs  # heads this CTA walks: p, p + programs, ...

    def batch_and_head(i):
        j = p + i * programs
        return j // heads, j % heads

    both = set(sides) == {"token", "state"}

    @pl.when(wg == 0)
    def _token_warpgroup():
        if "token" not in sides:
            return

        @pl.loop(0, own)
        def _(i):
            slot = i % slots
            if both:
                @pl.when(i >= slots)
                def _():
                    plgpu.barrier_wait(free.at[slot])  # the state warpgroups are done with head i - slots' vectors

            b, h = batch_and_head(i)
            _token_side(inputs, conv_out_ref, rows_smem.at[slot], v_smem.at[slot], squares_smem, b, h,
                        lower_bound=lower_bound)
            plgpu.commit_smem()
            if both:
                plgpu.barrier_arrive(ready.at[slot])

    @pl.when(wg >= 1)
    def _state_warpgroups():
        if "state" not in sides:
            return
        # Each state warpgroup updates its own stretch of a head's slabs; the first also loads them.
        first, cols_per_wg = wg == 1, n_cols // state_warpgroups
        mine = pl.ds((wg - 1) * cols_per_wg * block_v, cols_per_wg * block_v)

        def fetch(i):
            # A head's slabs all at once: its 512-byte rows are then read together, not a quarter at a
            # time a few microseconds apart (slab by slab, the stream alone ran at 78-81%).
            b, h = batch_and_head(i)
            for c in range(n_cols):
                plgpu.copy_gmem_to_smem(state_ref.at[b, h, :, pl.ds(c * block_v, block_v)], slabs.at[i % stages, c],
                                        loaded.at[i % stages])

        @pl.when(first)
        def _():
            for i in range(min(stages, own)):
                fetch(i)

        @pl.loop(0, own)
        def _(i):
            stage, slot = i % stages, i % slots
            b, h = batch_and_head(i)
            if both:
                plgpu.barrier_wait(ready.at[slot])
            plgpu.barrier_wait(loaded.at[stage])
            for c in range(cols_per_wg):
                col = (wg - 1) * cols_per_wg + c
                cols = pl.ds(col * block_v, block_v)
                update_slab(slabs.at[stage, col], rows_smem.at[slot], v_smem.at[slot, cols], o_smem.at[i % 2, cols])
            plgpu.commit_smem()
            if both:
                @pl.when(i + slots < own)  # the interpreter wants every arrival waited for
                def _():
                    plgpu.barrier_arrive(free.at[slot])
            for c in range(cols_per_wg):
                col = (wg - 1) * cols_per_wg + c
                plgpu.copy_smem_to_gmem(slabs.at[stage, col], state_ref.at[b, h, :, pl.ds(col * block_v, block_v)],
                                        commit_group=False)
            plgpu.copy_smem_to_gmem(o_smem.at[i % 2, mine], o_ref.at[b, h, mine], commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            # Refill the buffer of the head before this one once its stores have read it out, leaving
            # this head's in flight: waiting for these too stalled the stream at every head.
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)

            @pl.when((i >= 1) & (i - 1 + stages < own))
            def _():
                previous = (i - 1) % stages
                plgpu.barrier_arrive(drained.at[previous])

                @pl.when(first)
                def _():
                    plgpu.barrier_wait(drained.at[previous])  # every state warpgroup is done with the buffer
                    fetch(i - 1 + stages)

        plgpu.wait_smem_to_gmem(0)


def fused_step(
    qkv, conv_state, conv_weight, f, dt_bias, a_log, beta_logits, state, *, lower_bound, block_v=BLOCK_V, stages=3,
    programs=None, state_warpgroups=2, token_slots=2, sides=("token", "state"), interpret=False,
):
    """The one-token KDA step in one warp-specialised launch; shapes and results as
    `kda.kda_decode_step` (checked there), head dim 128. The state is updated in place (donate it
    under jit, or XLA copies it first).

    Persistent CTAs (`programs`, a divisor of B * H; by default the largest up to one an SM) each walk every
    programs-th head. A token warpgroup computes a head's vectors (conv, SiLU, norms, gate, beta,
    one channel a thread; the new conv state written out) into one of two slots while
    `state_warpgroups` more update the previous head, each its own stretch of the head's
    [dk, block_v] slabs. A head's slabs are loaded together by TMA into one of `stages` head
    buffers (64 KiB each) while earlier heads are updated.

    Not `kda_decode_step`'s choice: on the H200 (bench/RESULTS.md, twenty-first session) it ran,
    with one state warpgroup, at 78% / 82% of the state-bytes roofline at B = 64 / 256 (H = 64),
    the state side alone at 83%, where the two kernels (`decode_step`) reach 82% / 84%. One
    warpgroup updating a head's four slabs one after another was the measured limit; several split
    them (the default, 2, not yet timed).

    `sides` is for timing one warpgroup's work alone (bench/kda.py): ("token",) leaves the state
    warpgroups idle, ("state",) updates the state from whatever the slots hold. `interpret`: True,
    or the interpreter's `plgpu.InterpretGPUParams` (its race detector, say)."""
    b, h, dk, dv = state.shape
    if dk not in STEP_HEAD_DIMS or dv != dk or block_v not in (32, 64) or stages < 2:
        raise ValueError(f"fused_step takes dk = dv in {STEP_HEAD_DIMS}, block_v in (32, 64) and stages >= 2; got"
                         f" dk = {dk}, dv = {dv}, block_v = {block_v}, stages = {stages}")
    if token_slots < 1:
        raise ValueError(f"token_slots must be at least 1, got {token_slots}")
    if state_warpgroups < 1 or (dv // block_v) % state_warpgroups:
        raise ValueError(f"state_warpgroups must divide the {dv // block_v} slabs of a head, got {state_warpgroups}")
    programs = _default_programs(b * h) if programs is None else programs
    if programs < 1 or (b * h) % programs:
        raise ValueError(f"programs must divide B * H = {b * h}, got {programs}")
    kernel = plgpu.kernel(
        functools.partial(_fused_kernel, heads=h, programs=programs, state_warpgroups=state_warpgroups,
                          lower_bound=lower_bound, sides=tuple(sides)),
        out_type=(jax.ShapeDtypeStruct((b, h, dv), qkv.dtype), jax.ShapeDtypeStruct(conv_state.shape, qkv.dtype)),
        grid=(programs,),
        grid_names=("p",),
        num_threads=1 + state_warpgroups,
        thread_name="wg",
        scratch_types=(
            plgpu.SMEM((stages, dv // block_v, dk, block_v), _F32, transforms=SLAB_TRANSFORMS),
            plgpu.SMEM((2, dv), qkv.dtype),  # o: a head's store reads one while the next head fills the other
            plgpu.SMEM((token_slots, 3, dk), _F32),
            plgpu.SMEM((token_slots, dv), _F32),
            plgpu.SMEM((2, dk), _F32),
            plgpu.Barrier(num_arrivals=dv // block_v, num_barriers=stages),
            plgpu.Barrier(num_arrivals=1, num_barriers=token_slots),  # ready: a slot's vectors are written
            plgpu.Barrier(num_arrivals=state_warpgroups, num_barriers=token_slots),  # free: every state warpgroup has read them
            plgpu.Barrier(num_arrivals=state_warpgroups, num_barriers=stages),  # drained: a head buffer's stores have read it
        ),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret is True else interpret or None,
        kernel_name="kda_decode_fused_step",
    )
    state = jax.new_ref(state)
    o, conv_state = kernel(qkv, conv_state, conv_weight, f, dt_bias, a_log, beta_logits, state)
    return o, conv_state, jax.freeze(state)
