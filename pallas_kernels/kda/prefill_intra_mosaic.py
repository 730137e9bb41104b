"""The chunk-parallel half of the chunked KDA scan on Hopper, in Pallas Mosaic GPU: for every 64-token
chunk of every head and sequence, independently, what the serial chain (`prefill_chain_mosaic`) needs.

One warpgroup per (chunk, head, sequence), its tiles brought in by TMA (rows past the end of the
sequence arrive as zeros, so callers need not pad) and its products on the tensor cores (wgmma). It
computes G, the running sums of the log decays g inside the chunk, and exp(G_last), the chain's
decay; the scores A_qk = tril(q . k decayed) and A_kk = strict_tril(beta k . k decayed), q and k
L2-normalised (q also scaled by dk^-0.5), the decays factored through reference tokens 16 apart;
T = (I + A_kk)^-1 by block forward substitution; the WY factors w = T diag(beta) (k exp(G)) and
u = T diag(beta) v; q_w = q exp(G) - A_qk w, A_qk u and k exp(G_last - G), so that the chain's output
is o = q_w S + A_qk u.

What holds: exact while every gate g >= MIN_GATE (-5, the model's bound); tokens at or past a
sequence's length neither decay nor write; the scores' products in tf32, every later product as
accurate as fp32 work to about 1e-5 of each product (fp32 operands as bf16 hi + lo halves); every
fp32 output leaves as two bf16 halves, w as bf16. The interpreter computes the same products (the
tf32 rounding is explicit), so the CPU tests check the GPU's numbers.

The phases, the precision, the memory plan and the measurements behind them: docs/kda.md.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.reference import L2_EPS
from pallas_kernels.kda.tiles_mosaic import COL, ROW, WGMMA, load, matmul, operand_smem, split

CHUNK = 64  # tokens per chunk of the scan
HALF = CHUNK // 2
# exp(16 |g|) times 128 channels stays finite in fp32 while |g| <= 5 (exp(80) * 128 = 7e36).
MIN_GATE = -5.0
HEAD_DIMS = (64, 128)
BLOCK_K = 64  # channels per step: every product is [64, 64] x [64, 64]
_SUB_BLOCK = 16  # rows of the inverse's diagonal blocks computed on the CUDA cores

_F32, _BF16 = jnp.float32, jnp.bfloat16
_MARK = 16  # G is kept at every 16th token's end (15, 31, 47, 63): the scores' reference tokens and the last
_MARKS = CHUNK // _MARK


def _mark_of(token):
    """The index of token 16 i + 15 among the marks."""
    return token // _MARK


def _iota(shape, dim):
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=WGMMA)


def _precise(shape, left, right):
    """left @ right for fp32 operands stored as bf16 (hi, lo) pairs: hi.hi + hi.lo + lo.hi."""
    return matmul(shape, [(left[0], right[0]), (left[0], right[1]), (left[1], right[0])])


def _store_tf32(x, ref):
    """x rounded to tf32 (10 fraction bits; nearest, ties away from zero, as cvt.rna.tf32.f32) into
    an fp32 operand: the tensor cores would drop the 13 low bits, and rounding here halves that
    error and makes the interpreter's products the GPU's."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    ref[...] = lax.bitcast_convert_type((bits + jnp.uint32(0x1000)) & jnp.uint32(0xFFFFE000), _F32)
    plgpu.commit_smem()


def _store_split(x, pair):
    hi, lo = split(x)
    pair[0][...] = hi
    pair[1][...] = lo
    plgpu.commit_smem()


def _diagonal_block_inverses(a, rows_s):
    """(I + A)^-1 on the [16, 16] diagonal blocks of strictly lower fp32 [C, C] A, exactly in fp32 by
    forward substitution on the CUDA cores, all four blocks at once as a [C, 16] tile (row i holds its
    block's row): at step j, every row below row j of its block subtracts A[i, j] times row j, which
    is final by then. Row j reaches every thread through `rows_s`, an fp32 [C, 16] buffer. Returns
    the inverses in place on the diagonal of a [C, C] tile, zero elsewhere."""
    sub = _SUB_BLOCK
    tile = (a.shape[0], sub)
    row, col = _iota(tile, 0), _iota(tile, 1)
    offset, block = row % sub, row // sub
    blocks = range(a.shape[0] // sub)
    diagonal = a[:, :sub]  # A's diagonal blocks stacked: diagonal[i, j] = A[i, 16 block(i) + j]
    for k in blocks[1:]:
        diagonal = jnp.where(block == k, a[:, k * sub : (k + 1) * sub], diagonal)

    def step(j, inverse):
        rows_s[...] = inverse
        plgpu.commit_smem()
        pivot = None  # row j of each block, for that block's rows
        for k in blocks:
            row_j = lax.broadcast_in_dim(load(rows_s.at[k * sub + j], COL, optimized=False), tile, [1])
            pivot = row_j if pivot is None else jnp.where(block == k, row_j, pivot)
        coefficient = lax.broadcast_in_dim(jnp.sum(jnp.where(col == j, diagonal, 0.0), axis=1), tile, [0])
        plgpu.commit_smem()  # every warp has read row j before the next step rewrites the buffer
        return jnp.where(offset > j, inverse - coefficient * pivot, inverse)

    inverse = lax.fori_loop(0, sub - 1, step, jnp.where(col == offset, 1.0, 0.0))
    return jnp.concatenate([jnp.where(block == k, inverse, 0.0) for k in blocks], axis=1)


def _unit_lower_inverse(a, a_pair, t_pair, c_pair, rows_s):
    """(I + A)^-1 for strictly lower fp32 [C, C] A by block forward substitution: the [16, 16] diagonal
    blocks exactly in fp32 on the CUDA cores (`_diagonal_block_inverses`), then merges of neighbouring
    diagonal blocks, 16 -> 32 -> 64 rows, [[P, 0], [L, Q]]^-1 = [[P^-1, 0], [-Q^-1 L P^-1, Q^-1]],
    for all blocks at once as T <- T - T (L T), L = A on the merged blocks' lower-left quadrants.
    The factors are entries of A and of the inverse itself, so nothing grows past the inverse's own
    size; a Neumann series (computed by doubling) has terms like C(62, 31) a^32 when A is dense
    (slow decay, similar keys), which cancel to inf - inf. T is block diagonal, so L T is A T on
    those quadrants, bit for bit (the other products are exact zeros): A is split once, and T's halves
    serve as the right operand of A T and the left one of T (L T). `a_pair`, `t_pair` and `c_pair`
    are (hi, lo) pairs of [C, C] buffers for A, T and L T; `rows_s` an fp32 [C, 16] buffer. A loop,
    not unrolled: as straight-line code the kernel outgrows the instruction cache (most stalls on the
    H200 are then instruction fetches; docs/kda.md)."""
    shape = a.shape
    r, c = _iota(shape, 0), _iota(shape, 1)
    _store_split(a, a_pair)

    def merge(level, inverse):  # diagonal blocks of 2^level rows -> 2^(level + 1)
        lower_left = ((r ^ c) >> level == 1) & (r > c)
        _store_split(inverse, t_pair)
        coupling = jnp.where(lower_left, _precise(shape, a_pair, t_pair), 0.0)  # L T
        _store_split(coupling, c_pair)
        return inverse - _precise(shape, t_pair, c_pair)

    first = int(math.log2(_SUB_BLOCK))
    return lax.fori_loop(first, int(math.log2(CHUNK)), merge, _diagonal_block_inverses(a, rows_s))


class _Chunk:
    """What every phase of one program (one chunk of one head of one sequence) shares: its position,
    its channel blocks, the inputs and outputs in HBM, and k, G and beta in SMEM."""

    def __init__(self, refs, k_s, cum_s, beta_s):
        (self.lengths_ref, self.q_ref, self.k_ref, self.v_ref, self.g_ref, self.beta_ref, self.w_ref, self.u_hi_ref,
         self.u_lo_ref, self.qw_refs, self.au_hi_ref, self.au_lo_ref, self.kd_hi_ref, self.kd_lo_ref, self.decay_ref) = refs
        self.k_s, self.cum_s, self.beta_s = k_s, cum_s, beta_s
        self.n, self.h, self.b = lax.axis_index("n"), lax.axis_index("h"), lax.axis_index("b")
        self.dk = k_s.shape[1]
        self.blocks = [pl.ds(j * BLOCK_K, BLOCK_K) for j in range(self.dk // BLOCK_K)]
        self.tokens = pl.ds(self.n * CHUNK, CHUNK)
        self.square = (CHUNK, CHUNK)
        self.r, self.cl = _iota(self.square, 0), _iota(self.square, 1)

    def block_loop(self, body):
        """body(j, cols) over the channel blocks as a loop, not unrolled: code size."""
        pl.loop(0, len(self.blocks))(lambda j: body(j, pl.ds(pl.multiple_of(j * BLOCK_K, BLOCK_K), BLOCK_K)))

    def rows_of(self, x):
        return lax.broadcast_in_dim(x, self.square, [0])

    def cols_of(self, x):
        return lax.broadcast_in_dim(x, self.square, [1])

    def cum(self, cols):
        return load(self.cum_s.at[:, cols])

    def k(self, cols, scale):
        """L2-normalised k times a per-row scale."""
        return load(self.k_s.at[:, cols]).astype(_F32) * self.rows_of(scale)


def _gate_sums(p, ones_s, pieces, marks_s, decay_s):
    """G in place of g in `cum_s`: tril(1) g, g masked past the sequence's length and split into three
    bf16 pieces that sum to it exactly, so that each product is exact and only the fp32 sums round. G
    at tokens 15, 31, 47 and 63 into `marks_s`; exp(G_last) out (the chain's decay)."""
    r, cl, square = p.r, p.cl, p.square
    ones_s[...] = jnp.where(cl <= r, 1.0, 0.0).astype(_BF16)
    valid = p.lengths_ref[p.b] - p.n * CHUNK  # tokens at or past a sequence's length do not decay

    @p.block_loop
    def _(j, cols):
        rest = jnp.where(r < valid, p.cum(cols), 0.0)
        for piece in pieces:  # hi, mid, lo: 8 significant bits each, fp32's 24 in all
            part = rest.astype(_BF16)
            piece[...] = part
            rest = rest - part.astype(_F32)
        plgpu.commit_smem()  # the pieces are in; every warp has read g's block
        p.cum_s.at[:, cols][...] = matmul(square, [(ones_s, piece) for piece in pieces])
        # The marks from G's transpose, channels as rows: a row's own lanes hold its tokens, so
        # picking a token takes no exchange between warps (a column of G would: 2 barriers each).
        sums_t = matmul(square, [(piece.T, ones_s.T) for piece in pieces])
        for i in range(_MARKS):
            mark = jnp.sum(jnp.where(cl == _MARK * i + _MARK - 1, sums_t, 0.0), axis=1)
            marks_s.at[i, cols][...] = mark
        decay_s.at[cols][...] = jnp.exp(mark)

    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(decay_s, p.decay_ref.at[p.b, p.h, p.n])


def _scores(p, q_s, score_operands, marks_s, q_scale, k_scale, beta):
    """A_qk = tril(q . k decayed) and A_kk = strict_tril(beta k . k decayed), fp32 [C, C].

    exp(G_i - G_j) = exp(G_i - G_ref) exp(G_ref - G_j) per channel, in two passes (a loop, to keep the
    code small) with different references. Pass 0: the middle of each 32-token diagonal block, G at
    tokens 15 and 47 plus MIN_GATE / 2, which centres the factors' exponents (-80..75 about the
    token) on -77.5..77.5: fp32 and tf32 operands stay normal numbers for components down to 1e-4
    (at -80 a GPU or CPU that flushes subnormals loses 2.5e-3 of o). Pass 1: G at token 31, between
    the later queries and the earlier keys of the lower-left quadrant (both factors <= 1). An entry a
    pass does not keep may be inf (up to exp(155)) or NaN (0 x inf past a sequence's end); it is its
    own row of the left operand times its own row of the keys, and `where` drops it."""
    r, cl, square = p.r, p.cl, p.square
    key_s, left_s = score_operands
    diagonal = (r >= HALF) == (cl >= HALF)
    lower_left = (r >= HALF) & (cl < HALF)
    keys = key_s.T  # key rows as the right operand's columns

    def q(cols):  # L2-normalised, scaled by dk^-0.5
        return load(q_s.at[:, cols]).astype(_F32) * p.rows_of(q_scale)

    def reference(i, cols):
        """G_ref of pass i for each row, [C, 64]."""
        upper = _at_mark(p, marks_s, _mark_of(jnp.where(i == 0, HALF // 2 - 1, HALF - 1)), cols)  # token 15 / 31
        lower = _at_mark(p, marks_s, _mark_of(jnp.where(i == 0, HALF + HALF // 2 - 1, HALF - 1)), cols)  # token 47 / 31
        return jnp.where(r >= HALF, lower, upper) + jnp.where(i == 0, MIN_GATE / 2, 0.0)

    def score_pass(i, carry):
        a_qk, a_kk = carry

        def products(acc_qk, acc_kk):
            @p.block_loop
            def _(j, cols):  # the operands are rewritten per block, once the products have read them
                exponent = p.cum(cols) - reference(i, cols)
                _store_tf32(p.k(cols, k_scale) * jnp.exp(-exponent), key_s)
                query_factor = jnp.exp(exponent)
                for acc, left in ((acc_qk, q(cols)), (acc_kk, p.k(cols, k_scale * beta))):
                    _store_tf32(left * query_factor, left_s)
                    plgpu.wgmma(acc, left_s, keys)
                    plgpu.wgmma_wait(0)

            return acc_qk[...], acc_kk[...]

        qk, kk = pl.run_scoped(products, plgpu.ACC(square, _F32), plgpu.ACC(square, _F32))
        kept = jnp.where(i == 0, diagonal, lower_left)
        return a_qk + jnp.where(kept & (cl <= r), qk, 0.0), a_kk + jnp.where(kept & (cl < r), kk, 0.0)

    zeros = plgpu.layout_cast(jnp.zeros(square, _F32), WGMMA)
    return lax.fori_loop(0, 2, score_pass, (zeros, zeros))


def _at_mark(p, marks_s, i, cols):
    """G at token 16 i + 15, one value per column."""
    return p.cols_of(load(marks_s.at[i, cols], COL, optimized=False))


def _scores_and_kd(p, q_s, operands, marks_s, decay_s):
    """q, k, g and beta in; G; the rows' norms; A_qk and A_kk; k exp(G_last - G) out. `operands` holds
    the gate sums' operands, then the scores' fp32 key and left operands, then the (hi, lo) pairs of
    k exp(G_last - G) on their way out. Returns (A_qk, A_kk, q's and k's inverse norms)."""
    score_operands, (key_pair, left_pair), (ones_s, *pieces) = operands
    b, h, tokens = p.b, p.h, p.tokens
    with jax.named_scope("load"):
        plgpu.copy_gmem_to_smem(p.q_ref.at[b, tokens, h], q_s, p.loaded)
        for src, dst in ((p.k_ref, p.k_s), (p.g_ref, p.cum_s)):
            plgpu.copy_gmem_to_smem(src.at[b, tokens, h], dst, p.loaded)
        plgpu.copy_gmem_to_smem(p.beta_ref.at[b, h, tokens], p.beta_s, p.loaded)
        plgpu.barrier_wait(p.loaded)
    with jax.named_scope("gate_sums"):
        _gate_sums(p, ones_s, pieces, marks_s, decay_s)

    with jax.named_scope("norms"):

        def inverse_norm(ref, scale):
            squares = sum(jnp.sum(load(ref.at[:, cols]).astype(_F32) ** 2, axis=1) for cols in p.blocks)
            return scale / jnp.sqrt(squares + L2_EPS)

        q_scale, k_scale = inverse_norm(q_s, p.dk**-0.5), inverse_norm(p.k_s, 1.0)
        beta = load(p.beta_s, ROW)  # zero past the sequence's length
    with jax.named_scope("scores"):
        a_qk, a_kk = _scores(p, q_s, score_operands, marks_s, q_scale, k_scale, beta)

    with jax.named_scope("k_decayed_out"):  # k exp(G_last - G) as bf16 halves (the chain's left operand)
        for cols, pair in zip(p.blocks, (key_pair, left_pair)):
            _store_split(p.k(cols, k_scale) * jnp.exp(_at_mark(p, marks_s, _MARKS - 1, cols) - p.cum(cols)), pair)
            plgpu.copy_smem_to_gmem(pair[0], p.kd_hi_ref.at[b, h, tokens, cols])
            plgpu.copy_smem_to_gmem(pair[1], p.kd_lo_ref.at[b, h, tokens, cols])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # before the scope's SMEM is reused
    return a_qk, a_kk, q_scale, k_scale


def _wy_products(p, a_qk, a_kk, q_scale, k_scale, v_s, halves_hi, halves_lo, rows_s):
    """w = T_b (k exp(G)), u = T_b v, A_qk u and q_w = q exp(G) - A_qk w, T_b = T diag(beta); v
    arrives while w is computed. `halves_hi` and `halves_lo` hold two (hi, lo) pairs of [64, 64]
    operands: pair 0 and pair 1 serve the inverse and T_b, then carry channel block j's outputs;
    v's buffers hold A_kk's halves for the inverse."""
    c, b, h, tokens = CHUNK, p.b, p.h, p.tokens

    def pair(j):
        return halves_hi.at[j], halves_lo.at[j]

    def send(j, cols, value, *refs):  # block j's output through pair j: (hi, lo) halves, or hi alone
        if len(refs) == 2:
            _store_split(value, pair(j))
        else:
            halves_hi.at[j][...] = value.astype(_BF16)
            plgpu.commit_smem()
        for half, ref in zip((halves_hi.at[j], halves_lo.at[j]), refs):
            plgpu.copy_smem_to_gmem(half, ref.at[b, h, tokens, cols])

    pair_a, pair_b = pair(0), pair(1)
    with jax.named_scope("inverse"):
        t = _unit_lower_inverse(a_kk, (v_s.at[0], v_s.at[1]), pair_a, pair_b, rows_s) * p.cols_of(load(p.beta_s, COL))
        _store_split(t, pair_b)  # T_b: the left operand of w and u; every warp is past the inverse
    for j, cols in enumerate(p.blocks):
        plgpu.copy_gmem_to_smem(p.v_ref.at[b, tokens, h, cols], v_s.at[j], p.v_loaded)

    with jax.named_scope("w"):

        @p.block_loop
        def _(j, cols):  # k's block is read into pair_a before w's block takes its place
            _store_split(p.k(cols, k_scale) * jnp.exp(p.cum(cols)), pair_a)
            p.k_s.at[:, cols][...] = _precise((c, BLOCK_K), pair_b, pair_a).astype(_BF16)

        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(p.k_s, p.w_ref.at[b, h, tokens])
    plgpu.barrier_wait(p.v_loaded)

    with jax.named_scope("u"):

        @p.block_loop
        def _(j, cols):  # T_b is read before pair 1 takes u's last block
            send(j, cols, matmul((c, BLOCK_K), [(pair_b[0], v_s.at[j]), (pair_b[1], v_s.at[j])]), p.u_hi_ref, p.u_lo_ref)

    a_pair = (v_s.at[0], v_s.at[1])  # v has been read: its buffers take A_qk's halves
    with jax.named_scope("a_qk_u"):
        _store_split(a_qk, a_pair)

        @p.block_loop
        def _(j, cols):
            au = _precise((c, BLOCK_K), a_pair, pair(j))  # A_qk u from u's halves on their way out
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # u's halves are read
            send(j, cols, au, p.au_hi_ref, p.au_lo_ref)

    with jax.named_scope("q_w"):
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # A_qk u's halves are read: q comes back
        for j, cols in enumerate(p.blocks):
            plgpu.copy_gmem_to_smem(p.q_ref.at[b, tokens, h, cols], halves_lo.at[j], p.q_loaded)
        plgpu.barrier_wait(p.q_loaded)

        @p.block_loop
        def _(j, cols):  # q_w's halves take the place of q's block, once it is in registers
            a_w = matmul((c, BLOCK_K), [(a_pair[0], p.k_s.at[:, cols]), (a_pair[1], p.k_s.at[:, cols])])
            q_exp = load(halves_lo.at[j]).astype(_F32) * p.rows_of(q_scale) * jnp.exp(p.cum(cols))
            plgpu.commit_smem()  # every warp has read q's block before q_w's halves overwrite it
            send(j, cols, q_exp - a_w, *p.qw_refs)  # the chain's left operand

        plgpu.wait_smem_to_gmem(0)


def _intra_kernel(
    lengths_ref, q_ref, k_ref, v_ref, g_ref, beta_ref,
    w_ref, u_hi_ref, u_lo_ref, qw_refs, au_hi_ref, au_lo_ref, kd_hi_ref, kd_lo_ref, decay_ref,
    k_s, cum_s, beta_s, loaded, v_loaded, q_loaded,
):
    """One chunk of one head, in blocks of 64 channels: every product is [64, 64] x [64, 64]. k, G and
    beta stay in SMEM throughout; the rest is scoped per phase (the score passes, then the inverse and
    the WY products), 103 KB at dk = 128, so that two CTAs share an SM. Tiles are read back from SMEM
    where they are needed rather than kept in registers."""
    refs = (lengths_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_hi_ref, u_lo_ref, qw_refs, au_hi_ref, au_lo_ref,
            kd_hi_ref, kd_lo_ref, decay_ref)
    p = _Chunk(refs, k_s, cum_s, beta_s)
    p.loaded, p.v_loaded, p.q_loaded = loaded, v_loaded, q_loaded
    c, dk, square = CHUNK, p.dk, p.square

    def pair_smem():
        return operand_smem(square), operand_smem(square)

    # Unswizzled buffers after the swizzled ones: on the H200 one placed before the swizzled operands
    # gives wrong products in rows 8-15 of every 16 (bench/RESULTS.md).
    score_operands = (operand_smem(square, _F32), operand_smem(square, _F32))
    sum_operands = tuple(operand_smem(square) for _ in range(4))  # tril(1) and g's three pieces
    with jax.named_scope("kda_intra_scores"):
        a_qk, a_kk, q_scale, k_scale = pl.run_scoped(
            functools.partial(_scores_and_kd, p),
            operand_smem((c, dk)),
            plgpu.RefUnion(score_operands, (pair_smem(), pair_smem()), sum_operands),
            plgpu.SMEM((_MARKS, dk), _F32),
            plgpu.SMEM((dk,), _F32),
        )
    halves = (2, c, c)
    with jax.named_scope("kda_intra_wy"):
        pl.run_scoped(
            functools.partial(_wy_products, p, a_qk, a_kk, q_scale, k_scale),
            operand_smem(halves), operand_smem(halves), operand_smem(halves), plgpu.SMEM((c, _SUB_BLOCK), _F32),
        )


def intra(q, k, v, g, beta, lengths, *, qw_lo=True, interpret=False):
    """w (bf16), u (hi, lo), q_w (hi, lo), A_qk u (hi, lo), k exp(G_last - G) (hi, lo) [B, H, T', d]
    and exp(G_last) [B, H, T' / 64, dk] fp32; every (hi, lo) a pair of bf16 halves of an fp32 value,
    hi + lo; T' = T rounded up to whole chunks. `qw_lo` False: q_w's lo half is neither computed nor
    written (None in its place), for a chain that multiplies q_w's hi half alone (one or two o products).

    q, k, v [B, T, H, d] bf16 with d in HEAD_DIMS; g [B, T, H, d] fp32 (natural-log decays, each
    >= MIN_GATE); beta [B, H, T] fp32; lengths [B] int32 (tokens of each sequence, <= T)."""
    b, t, h, dk = q.shape
    c = CHUNK
    n_chunks = -(-t // c)
    padded = n_chunks * c
    beta = jnp.where(jnp.arange(t) < lengths[:, None, None], beta, 0.0)  # past a sequence's end: no writes
    g = g.astype(_F32)
    if t % 8:  # TMA needs whole 8-row tiles and 16-byte strides in HBM; the rows past T read as zeros anyway
        q, k, v, g = (jnp.pad(x, [(0, 0), (0, -t % 8), (0, 0), (0, 0)]) for x in (q, k, v, g))
        beta = jnp.pad(beta, [(0, 0), (0, 0), (0, -t % 8)])
    half = jax.ShapeDtypeStruct((b, h, padded, dk), _BF16)
    decay = jax.ShapeDtypeStruct((b, h, n_chunks, dk), _F32)
    kernel = plgpu.kernel(
        _intra_kernel,
        out_type=(half, half, half, (half, half) if qw_lo else (half,), half, half, half, half, decay),  # w, u, q_w, ...
        grid=(n_chunks, h, b),
        grid_names=("n", "h", "b"),
        scratch_types=(
            operand_smem((c, dk)),  # k, then w
            operand_smem((c, dk), _F32),  # g, then G
            plgpu.SMEM((c,), _F32),  # beta
            plgpu.Barrier(num_arrivals=4),  # q, k, g, beta
            plgpu.Barrier(num_arrivals=dk // BLOCK_K),  # v
            plgpu.Barrier(num_arrivals=dk // BLOCK_K),  # q again, for q_w
        ),
        # No automatic barriers (Mosaic GPU puts one before every TMA fetch and on both sides of every
        # register store to SMEM): the kernel's own commit_smem and wait_smem_to_gmem order each reuse
        # of a buffer, and on the H200 the scan takes 2-4% less time without them (bench/RESULTS.md).
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Lane, approx_math=True, unsafe_no_auto_barriers=True
        ),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="kda_intra",
    )
    w, u_hi, u_lo, qw, *rest = kernel(lengths, q, k, v, g, beta)
    return (w, u_hi, u_lo, qw[0], qw[1] if qw_lo else None, *rest)
