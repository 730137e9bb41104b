"""The serial half of the chunked KDA scan on Hopper, in Pallas Mosaic GPU: the fp32 state S carried
across the chunks that `prefill_intra_mosaic.intra` prepared.

One warpgroup per (value block, head, sequence) walks the chunks in order, the next chunk's tiles in
flight (TMA, two slots) while it works on the current one:
    v_new = u - w S,   o = q_w S + A_qk u,   S <- exp(G_last) S + (k exp(G_last - G))^T v_new.
Every product takes its left operand from SMEM (w, q_w and k exp(G_last - G) as they arrive) and
carries fp32 right operands (S, v_new) as bf16 halves, hi + lo; q_w and k exp(G_last - G) arrive as
halves too (hi.hi + hi.lo + lo.hi), w is bf16 as the intra kernel computed it, and u and A_qk u
arrive as halves that are added up in fp32. For a bf16 o, q_w S drops q_w's lo half (`o_products`).
A step (~4000 cycles on the H200) is bound by the latency of its own instruction stream, not by
memory (bench/RESULTS.md). The options, their SMEM and their measured reasons: docs/kda.md.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import sm_count
from pallas_kernels.kda import prefill_intra_mosaic
from pallas_kernels.kda.prefill_intra_mosaic import CHUNK
from pallas_kernels.kda.tiles_mosaic import ROW, load, matmul, operand_smem, split

_F32 = jnp.float32
BLOCK_V = 32  # value columns per program: two slots of its tiles fill most of the SMEM at dk = 128
WIDE_BLOCK_V = 64  # over several waves: one CTA per SM, u and A_qk u in one slot (`default_options`)
KEY_SLOTS = 2  # the next chunk's key tiles come in while this one's are worked on
CLUSTER_BLOCKS = range(2, 9)  # value blocks per head that multicast can run as one cluster


def _key_smem(shape, block_v):
    """A [.., 64, dk] bf16 left operand whose right operand is [.., block_v] wide: both need the swizzle
    of a block_v row."""
    swizzle = min(2 * block_v, 128)
    return plgpu.SMEM(
        shape, jnp.bfloat16, transforms=(plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))
    )


def _pair_value(hi_ref, lo_ref):
    """hi + lo in fp32 from a pair of bf16 halves."""
    return load(hi_ref).astype(_F32) + load(lo_ref).astype(_F32)


class _Chain:
    """What one program of the chain (one block of value columns of one head of one sequence) shares
    across its chunks: the tiles in HBM, their slots in SMEM, the barriers, and how they are fetched.
    With one slot of u and A_qk u under two of the key tiles (`early_values`), each is fetched anew as
    soon as it is in registers, a step ahead of its use, on a barrier of its own (values_arrived: u,
    A_qk u)."""

    def __init__(self, refs, scratch, barriers, *, n_chunks, o_products, multicast):
        (self.w_ref, self.u_hi_ref, self.u_lo_ref, self.qw_hi_ref, self.qw_lo_ref, self.au_hi_ref, self.au_lo_ref,
         self.kd_hi_ref, self.kd_lo_ref, self.decay_ref, self.s0_ref, self.o_ref, self.s_ref, self.states_ref) = refs
        (self.w_s, self.qw_hi_s, self.qw_lo_s, self.kd_hi_s, self.kd_lo_s, self.u_hi_s, self.u_lo_s, self.au_hi_s,
         self.au_lo_s, self.s_halves, self.v_halves, self.o_s) = scratch
        self.arrived, self.consumed, self.values_arrived = barriers
        self.n_chunks, self.o_products, self.multicast = n_chunks, o_products, multicast
        self.vb, self.h, self.b = lax.axis_index("v"), lax.axis_index("h"), lax.axis_index("b")
        self.slots, self.value_slots, (_, self.block_v) = self.w_s.shape[0], self.u_hi_s.shape[0], self.u_hi_s.shape[1:]
        self.early_values = self.value_slots < self.slots
        self.dk = self.w_s.shape[-1]
        self.cols = pl.ds(self.vb * self.block_v, self.block_v)
        self.u_pairs = ((self.u_hi_ref, self.u_hi_s), (self.u_lo_ref, self.u_lo_s))
        self.au_pairs = ((self.au_hi_ref, self.au_hi_s), (self.au_lo_ref, self.au_lo_s))

    def fetch_values(self, n, slot, pairs, barrier):
        for src, dst in pairs:
            plgpu.copy_gmem_to_smem(src.at[self.b, self.h, pl.ds(n * CHUNK, CHUNK), self.cols], dst.at[slot], barrier)

    def fetch(self, n, slot):
        tokens = pl.ds(n * CHUNK, CHUNK)
        keys = ((self.w_ref, self.w_s), (self.qw_hi_ref, self.qw_hi_s), (self.kd_hi_ref, self.kd_hi_s),
                (self.kd_lo_ref, self.kd_lo_s))
        for src, dst in keys + (((self.qw_lo_ref, self.qw_lo_s),) if self.o_products == 3 else ()):
            # With multicast, the head's value blocks (one cluster) each fetch a part of these tiles,
            # which every block of the cluster receives: one read from L2 for the head, not one per block.
            plgpu.copy_gmem_to_smem(
                src.at[self.b, self.h, tokens], dst.at[slot], self.arrived.at[slot],
                collective_axes="v" if self.multicast else None,
            )
        if not self.early_values:
            self.fetch_values(n, slot, self.u_pairs + self.au_pairs, self.arrived.at[slot])

    def refetch_values(self, n, pairs, barrier):
        """Chunk n + 1's u (or A_qk u, by `barrier` 0 or 1) into the buffer that chunk n's has just
        left for registers."""
        if self.early_values:
            plgpu.commit_smem()  # every thread has read them
            pl.when(n + 1 < self.n_chunks)(lambda: self.fetch_values(n + 1, 0, pairs, self.values_arrived.at[barrier]))


def _chain_step(p, n, s):
    """Chunk n on state s [dk, block_v] fp32: v_new = u - w S, o = A_qk u + q_w S out, and the next
    state exp(G_last) S + (k exp(G_last - G))^T v_new."""
    c, block_v = CHUNK, p.block_v
    slot = lax.rem(n, p.slots)
    with jax.named_scope("prefetch"):  # the next chunk's tiles come in while this one is worked on
        plgpu.commit_smem()  # every thread is done with the previous chunk's buffers

        @pl.when(n + 1 < p.n_chunks)
        def _():
            if p.multicast:  # every block of the cluster is done with chunk n - 1's slot
                pl.when(n >= 1)(lambda: plgpu.barrier_wait(p.consumed.at[1 - slot]))
            p.fetch(n + 1, 1 - slot)

    # exp(G_last) straight from HBM into registers (no SMEM), loaded early to hide the latency
    decay = load(p.decay_ref.at[p.b, p.h, n], ROW, optimized=False)
    if p.states_ref is not None:  # the state entering the chunk, kept for the backward
        p.states_ref.at[p.b, p.h, n, :, p.cols][...] = s
    plgpu.barrier_wait(p.arrived.at[slot])
    with jax.named_scope("v_new"):
        s_hi, s_lo = split(s)
        p.s_halves[0][...] = s_hi
        p.s_halves[1][...] = s_lo
        plgpu.commit_smem()
        w = p.w_s.at[slot]
        value_slot = lax.rem(n, p.value_slots)
        if p.early_values:
            plgpu.barrier_wait(p.values_arrived.at[0])
        u = _pair_value(p.u_hi_s.at[value_slot], p.u_lo_s.at[value_slot])
        v_new = u - matmul((c, block_v), [(w, p.s_halves[0]), (w, p.s_halves[1])])
        p.refetch_values(n, p.u_pairs, 0)
        v_hi, v_lo = split(v_new)
        p.v_halves[0][...] = v_hi
        p.v_halves[1][...] = v_lo
        plgpu.commit_smem()
    with jax.named_scope("o"):
        qw_hi = p.qw_hi_s.at[slot]
        o_pairs = [(qw_hi, p.s_halves[0]), (qw_hi, p.s_halves[1])][: p.o_products]
        if p.o_products == 3:
            o_pairs.append((p.qw_lo_s.at[slot], p.s_halves[0]))
        if p.early_values:
            plgpu.barrier_wait(p.values_arrived.at[1])
        o = _pair_value(p.au_hi_s.at[value_slot], p.au_lo_s.at[value_slot]) + matmul((c, block_v), o_pairs)
        p.refetch_values(n, p.au_pairs, 1)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous chunk's o is read
        p.o_s[...] = o.astype(p.o_s.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(p.o_s, p.o_ref.at[p.b, pl.ds(n * c, c), p.h, p.cols])
    with jax.named_scope("state"):
        kd_hi, kd_lo = p.kd_hi_s.at[slot].T, p.kd_lo_s.at[slot].T  # [dk, 64]: channels as rows
        written = matmul((p.dk, block_v), [(kd_hi, p.v_halves[0]), (kd_hi, p.v_halves[1]), (kd_lo, p.v_halves[0])])
        if p.multicast:  # chunk n + 2 will come into this slot: tell the cluster it is free

            @pl.when(n + 2 < p.n_chunks)
            def _():
                plgpu.commit_smem()
                plgpu.barrier_arrive(p.consumed.at[slot])

        return s * lax.broadcast_in_dim(decay, (p.dk, block_v), [0]) + written


def _chain_kernel(
    w_ref, u_hi_ref, u_lo_ref, qw_hi_ref, qw_lo_ref, au_hi_ref, au_lo_ref, kd_hi_ref, kd_lo_ref, decay_ref, s0_ref,
    o_ref, s_ref, *rest, n_chunks, o_products, multicast, keep_states,
):
    states_ref = rest[0] if keep_states else None
    (w_s, qw_hi_s, qw_lo_s, kd_hi_s, kd_lo_s, u_hi_s, u_lo_s, au_hi_s, au_lo_s, s_halves, v_halves, o_s,
     arrived, consumed, values_arrived) = rest[keep_states:]
    p = _Chain(
        (w_ref, u_hi_ref, u_lo_ref, qw_hi_ref, qw_lo_ref, au_hi_ref, au_lo_ref, kd_hi_ref, kd_lo_ref, decay_ref, s0_ref,
         o_ref, s_ref, states_ref),
        (w_s, qw_hi_s, qw_lo_s, kd_hi_s, kd_lo_s, u_hi_s, u_lo_s, au_hi_s, au_lo_s, s_halves, v_halves, o_s),
        (arrived, consumed, values_arrived),
        n_chunks=n_chunks, o_products=o_products, multicast=multicast,
    )
    p.fetch(0, 0)
    if p.early_values:
        p.fetch_values(0, 0, p.u_pairs, values_arrived.at[0])
        p.fetch_values(0, 0, p.au_pairs, values_arrived.at[1])
    s = lax.fori_loop(0, n_chunks, functools.partial(_chain_step, p), load(s0_ref.at[p.b, p.h, :, p.cols], optimized=False))
    s_ref.at[p.b, p.h, :, p.cols][...] = s
    plgpu.wait_smem_to_gmem(0)


def default_o_products(out_dtype):
    """q_w S's bf16 products for an o in `out_dtype`: 2 for bf16 (whose rounding is the larger error),
    3 for fp32."""
    return 2 if jnp.dtype(out_dtype) == jnp.bfloat16 else 3


def _check_options(dv, block_v, value_slots, o_products, multicast):
    """The chain's options, checked before any kernel of the scan runs (block_v already capped at dv)."""
    if o_products not in (1, 2, 3):
        raise ValueError(f"o_products must be 1, 2 or 3, got {o_products}")
    if value_slots not in (1, 2):
        raise ValueError(f"value_slots must be 1 or 2, got {value_slots}")
    if multicast and dv // block_v not in CLUSTER_BLOCKS:
        raise ValueError(f"multicast needs 2 to 8 value blocks per head (a cluster), got dv / block_v = {dv // block_v}")


def chain(
    w, u_hi, u_lo, qw_hi, qw_lo, au_hi, au_lo, kd_hi, kd_lo, decay, initial_state, *, out_dtype, block_v=BLOCK_V,
    value_slots=2, o_products=None, multicast=False, keep_states=False, interpret=False,
):
    """(o [B, T', H, dv] in out_dtype, final state [B, H, dk, dv] fp32) from `prefill_intra_mosaic.intra`'s
    outputs and the fp32 initial state [B, H, dk, dv]. Each chunk's key tiles (w, q_w, k exp(G_last -
    G)) come in, in two slots, while the previous chunk is worked on; u and A_qk u too with
    `value_slots` 2 (one CTA per SM at dk = 128 and 32 columns: 225,280 B of SMEM by the lowering, or
    192,512 B with two o products), or with 1 in one buffer each, fetched anew as soon as they are in
    registers (at 64 columns: 221,184 B rather than 248 KB; a one-slot form for two CTAs per SM, tiles
    fetched after each chunk, is slower at every shape than this one: docs/kda.md). `o_products`: q_w S
    as 3 bf16 products (hi.hi + hi.lo + lo.hi, as precise as fp32 work to about 1e-5), 2 (q_w's hi half times S's halves)
    or 1 (hi.hi); None: 3 for an fp32 o, 2 for a bf16 one (whose rounding is the larger error: on the
    H200 the output error stays at the bf16 floor and the scan is 5-7% faster). The state's products
    are always 3, so the state does not depend on it. `multicast`: the value blocks of a head run as
    one cluster and share each chunk's w, q_w and k exp(G_last - G) tiles (TMA multicast: one read
    from L2 per head rather than one per block), at the cost of a cluster barrier per chunk. `qw_lo`
    may be None (`prefill_intra_mosaic.intra(qw_lo=False)`) with one or two o products. `keep_states`:
    also return the state entering every chunk [B, H, N, dk, dv] fp32 (for the backward)."""
    o_products = default_o_products(out_dtype) if o_products is None else o_products
    b, h, padded, dk = w.shape
    dv = u_hi.shape[-1]
    block_v = min(block_v, dv)
    c = CHUNK
    _check_options(dv, block_v, value_slots, o_products, multicast)
    if o_products == 3 and qw_lo is None:
        raise ValueError("o_products=3 multiplies q_w's lo half: qw_lo must be an array, got None")
    kernel = plgpu.kernel(
        functools.partial(_chain_kernel, n_chunks=padded // c, o_products=o_products, multicast=multicast,
                          keep_states=keep_states),
        out_type=(
            jax.ShapeDtypeStruct((b, padded, h, dv), out_dtype),
            jax.ShapeDtypeStruct((b, h, dk, dv), _F32),
            *[jax.ShapeDtypeStruct((b, h, padded // c, dk, dv), _F32)] * keep_states,
        ),
        **(dict(grid=(h, b), grid_names=("h", "b"), cluster=(dv // block_v,), cluster_names=("v",)) if multicast
           else dict(grid=(dv // block_v, h, b), grid_names=("v", "h", "b"))),
        scratch_types=(
            *(_key_smem((KEY_SLOTS, c, dk), block_v) for _ in range(2)),  # w, q_w hi
            _key_smem((KEY_SLOTS, c, dk), block_v) if o_products == 3 else (),  # q_w lo
            *(_key_smem((KEY_SLOTS, c, dk), block_v) for _ in range(2)),  # k exp(G_last - G) hi/lo
            *(_key_smem((value_slots, c, block_v), block_v) for _ in range(4)),  # u and A_qk u, hi and lo
            tuple(_key_smem((dk, block_v), block_v) for _ in range(2)),  # S hi/lo
            tuple(_key_smem((c, block_v), block_v) for _ in range(2)),  # v_new hi/lo
            operand_smem((c, block_v), out_dtype),  # o on its way out
            plgpu.Barrier(
                num_arrivals=(5 if o_products == 3 else 4) + 4 * (value_slots == KEY_SLOTS), num_barriers=KEY_SLOTS
            ),
            plgpu.ClusterBarrier(collective_axes=("v",), num_barriers=KEY_SLOTS) if multicast else (),
            plgpu.Barrier(num_arrivals=2, num_barriers=2) if value_slots < KEY_SLOTS else (),  # u, A_qk u
        ),
        # No automatic barriers (Mosaic GPU puts one before every TMA fetch and on both sides of every
        # register store to SMEM): the kernel's own commit_smem and wait_smem_to_gmem order each reuse
        # of a buffer, and on the H200 the scan takes 2-4% less time without them (bench/RESULTS.md).
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Lane, approx_math=True, unsafe_no_auto_barriers=True
        ),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="kda_chain",
    )
    return kernel(w, u_hi, u_lo, qw_hi, qw_lo, au_hi, au_lo, kd_hi, kd_lo, decay, initial_state)


def scan_arg_shapes(b, t, h, d):
    """The shapes and dtypes `chunk_scan` takes (q, k, v, g, beta, initial_state, lengths) for b
    sequences of t tokens and h heads of dim d, as jax.ShapeDtypeStruct: to lower it without data."""
    sds = jax.ShapeDtypeStruct
    return (
        *(sds((b, t, h, d), jnp.bfloat16) for _ in range(3)),
        sds((b, t, h, d), _F32),
        sds((b, t, h), _F32),
        sds((b, h, d, d), _F32),
        sds((b,), jnp.int32),
    )


def default_options(b, h, dv, out_dtype, *, block_v=None, value_slots=None, multicast=None, sms=None):
    """The chain's options for B sequences of H heads, those left None picked by the shape: `block_v`
    32 value columns when the 32-column grid fits on the `sms` SMs in one wave; over several waves with
    a bf16 o, 64 columns in one CTA per SM, u and A_qk u in one slot (on the H200 the scan takes 1.56
    ms at (1, 8192, 64) and 1.60 at (8, 4096, 16), against 1.71 and 1.83 with 32 columns in two CTAs
    per SM: half the CTAs, each reading its left operands from SMEM once per 64 columns). `value_slots`:
    one above 32 columns (two would not fit), else two. `multicast`: clusters when the grid fits in one
    wave (on the H200 the chain takes 0.60 ms with multicast against 0.64 without at (1, 16384, 16),
    and is 3-15% slower with it over several waves). Returns (block_v, value_slots, multicast)."""
    sms = sms or sm_count()
    bf16_o = jnp.dtype(out_dtype) == jnp.bfloat16
    if block_v is None:
        over_one_wave = b * h * (dv // min(BLOCK_V, dv)) > sms
        block_v = WIDE_BLOCK_V if bf16_o and over_one_wave else BLOCK_V
    block_v = min(block_v, dv)
    value_blocks = dv // block_v
    one_wave = b * h * value_blocks <= sms
    if value_slots is None:
        value_slots = 1 if block_v > BLOCK_V else 2
    if multicast is None:
        multicast = one_wave and value_blocks in CLUSTER_BLOCKS
    return block_v, value_slots, multicast


def chunk_scan(
    q, k, v, g, beta, initial_state, lengths, *, out_dtype, block_v=None, value_slots=None, o_products=None,
    multicast=None, keep_states=False, interpret=False,
):
    """The chunked KDA scan on the GPU: `prefill_intra_mosaic.intra`, then `chain`. q, k, v [B, T, H, d] bf16 (d in
    prefill_intra_mosaic.HEAD_DIMS), g [B, T, H, d] fp32, beta [B, T, H], `initial_state` fp32 [B, H, d, d],
    `lengths` int32 [B]. Returns o [B, T', H, d] in `out_dtype` (T' = T rounded up to whole chunks;
    rows past T are meaningless) and the final state. `block_v`, `value_slots` and `multicast` None
    are picked by `default_options`; `o_products` as in `chain`; q_w's lo half is computed only for
    three. `keep_states` as in `chain`."""
    o_products = default_o_products(out_dtype) if o_products is None else o_products
    b, _, h, dv = v.shape
    block_v, value_slots, multicast = default_options(
        b, h, dv, out_dtype, block_v=block_v, value_slots=value_slots, multicast=multicast
    )
    _check_options(dv, block_v, value_slots, o_products, multicast)  # before the intra kernel runs
    parts = prefill_intra_mosaic.intra(
        q, k, v, g, jnp.swapaxes(beta, 1, 2).astype(_F32), lengths, qw_lo=o_products == 3, interpret=interpret
    )
    return chain(
        *parts, initial_state, out_dtype=out_dtype, block_v=block_v, value_slots=value_slots,
        o_products=o_products, multicast=multicast, keep_states=keep_states, interpret=interpret,
    )
