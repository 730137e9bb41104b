"""Sparse latent attention on Hopper in Pallas Mosaic GPU (wgmma, TMA).

One CTA attends one query with 64 heads over its selection (or one part of it, `splits`), in blocks
of `BLOCK_ROWS` selected rows, with three warpgroups:
- the producer gathers each block's rows by TMA, one copy per row, into a staging buffer (row-major:
  Hopper's TMA cannot write single rows into the 8-row tiles wgmma reads), and converts them to bf16
  in the tiled, swizzled operand buffer (a scaled row, fp8's, is multiplied by its scale there and
  rounded to bf16, as the reference reads the cache);
- two consumers each own half of the latent width R: the scores q . c are summed from their two
  halves through shared memory, then both keep the same online softmax (base 2) and each multiplies
  the probabilities into its half of the output.
Staging (`stages` deep) and operands (two) rotate, so the gathers of later blocks run under the
products of the current one. The latent cache is read once per query: FLOPs and bytes in the
selection's width W, not in the sequence.

With several splits each part leaves its normalised output, running max and sum for
`common.merge_splits`.
"""

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import sm_count
from pallas_kernels.latent_attention.splits import mark_repeats_empty, merge_splits

HEADS = 64  # wgmma's row block: heads are padded to a multiple of it, each group a CTA of its own
BLOCK_ROWS = 32  # selected rows per step: a [64, 32] score tile, and shared memory for two operands
TMA_COLUMNS = 256  # a row gathered in copies of at most this many columns: a TMA box's limit
VALUE_CHUNK = 128  # output columns a product of P and the values adds at a time
LATENT_DIMS = (128, 256, 512)  # halves of whole 64-column tiles for the two consumers
ROW_DTYPES = (jnp.bfloat16, jnp.float8_e4m3fn)  # the cache as it is read; other dtypes are cast first
MAX_SELECTED = 4096  # the per-CTA row ids and scales live in shared memory
# An H200 CTA's shared memory (232448 bytes), less a reserve for what Mosaic GPU adds to the
# kernel's buffers (barriers, alignment, its reductions' scratch: about 4 KiB at R = 512).
SMEM_BYTES = 232448 - 8192

_WGMMA = plgpu.Layout.WGMMA
_ROW, _COL = _WGMMA.reduce(1), _WGMMA.reduce(0)
# Every wgmma operand in one swizzle (Mosaic GPU's rule), the one a [64, 32] bf16 P tile allows.
_SWIZZLE = BLOCK_ROWS * 2
_OPERAND = (plgpu.TilingTransform((8, _SWIZZLE // 2)), plgpu.SwizzleTransform(_SWIZZLE))
_SCORES = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))  # fp32 [64, 32]: conflict-free


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """`stages` blocks of gathered rows in flight (None: as many as shared memory holds, at most 3);
    `splits` parts of each query's selection walked by CTAs of their own (None: enough to give every
    SM a CTA when (queries x head groups) are fewer)."""

    stages: int | None = None
    splits: int | None = None


def shared_bytes(r, row_dtype, steps, stages):
    """Bytes of one CTA's shared buffers (`_allocations`)."""
    buffers = [a for a in _allocations(r, row_dtype, steps, stages) if hasattr(a, "shape")]
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in buffers)


def unsupported(q_lat, indices):
    """Why the kernel cannot take a call, or None."""
    if q_lat.shape[-1] not in LATENT_DIMS:
        return f"the latent width R must be one of {LATENT_DIMS}, got {q_lat.shape[-1]}"
    if q_lat.dtype != jnp.bfloat16:
        return f"q_lat must be bf16, got {q_lat.dtype}"
    if indices.shape[-1] > MAX_SELECTED:
        return f"at most {MAX_SELECTED} selected tokens a query, got {indices.shape[-1]}"
    return None


class _Shared(NamedTuple):
    """One CTA's shared memory and barriers."""

    q: Any  # [2, 64, R / 2] bf16: q by halves of R, one per consumer (its output after)
    ids: Any  # [steps, BLOCK_ROWS] int32: this part's row of each selected slot, -1 where empty
    scales: Any  # [steps, BLOCK_ROWS] fp32: each slot's dequantisation (ones for a bf16 cache)
    staging: Any  # [stages, BLOCK_ROWS, R] rows as gathered, in the cache's dtype
    operands: Any  # [2, BLOCK_ROWS, R] bf16, tiled: the rows as both products read them
    exchange: Any  # [2, 2, 64, BLOCK_ROWS] fp32: each consumer's half of the scores
    probabilities: Any  # [2, 64, BLOCK_ROWS] bf16, tiled: each consumer's P
    loaded: Any  # q, ids and scales arrived
    gathered: Any  # [stages]: a staging buffer's rows arrived
    ready: Any  # [2]: an operand buffer written (producer -> consumers)
    consumed: Any  # [2]: an operand buffer read by both consumers (consumers -> producer)
    exchanged: Any  # [2]: both halves of a block's scores written


def _allocations(r, row_dtype, steps, stages):
    return _Shared(
        q=plgpu.SMEM((2, HEADS, r // 2), jnp.bfloat16, transforms=_OPERAND),
        ids=plgpu.SMEM((steps, BLOCK_ROWS), jnp.int32),
        scales=plgpu.SMEM((steps, BLOCK_ROWS), jnp.float32),
        staging=plgpu.SMEM((stages, BLOCK_ROWS, r), row_dtype),
        operands=plgpu.SMEM((2, BLOCK_ROWS, r), jnp.bfloat16, transforms=_OPERAND),
        exchange=plgpu.SMEM((2, 2, HEADS, BLOCK_ROWS), jnp.float32, transforms=_SCORES),
        probabilities=plgpu.SMEM((2, HEADS, BLOCK_ROWS), jnp.bfloat16, transforms=_OPERAND),
        loaded=plgpu.Barrier(num_arrivals=4),
        gathered=plgpu.Barrier(num_arrivals=BLOCK_ROWS * -(-r // TMA_COLUMNS), num_barriers=stages),
        ready=plgpu.Barrier(num_arrivals=1, num_barriers=2),
        consumed=plgpu.Barrier(num_arrivals=2, num_barriers=2),
        exchanged=plgpu.Barrier(num_arrivals=2, num_barriers=2),
    )


def _produce(rows_ref, shared: _Shared, *, scaled, steps, stages):
    """Gather each block's rows into staging (`stages` blocks ahead) and convert them into the
    operand ring for the consumers."""
    r = rows_ref.shape[-1]
    piece = min(r, TMA_COLUMNS)
    plgpu.barrier_wait(shared.loaded)

    def gather(step, stage):
        with jax.named_scope("gather"):
            for j in range(BLOCK_ROWS):
                row = jnp.maximum(shared.ids[step, j], 0)  # an empty slot reads row 0, masked later
                for start in range(0, r, piece):
                    cols = pl.ds(start, piece)
                    target = shared.staging.at[stage, pl.ds(j, 1), cols]
                    plgpu.copy_gmem_to_smem(rows_ref.at[pl.ds(row, 1), cols], target, shared.gathered.at[stage])

    for step in range(min(stages, steps)):
        gather(step, step)

    @pl.loop(0, steps)
    def _(step):
        stage, slot = step % stages, step % 2
        plgpu.barrier_wait(shared.gathered.at[stage])

        @pl.when(step >= 2)
        def _():
            plgpu.barrier_wait(shared.consumed.at[slot])

        with jax.named_scope("convert"):
            for tile in range(BLOCK_ROWS // 8):
                rows = pl.ds(tile * 8, 8)
                block = plgpu.load(shared.staging.at[stage, rows], layout=_copy_layout(r), optimized=False)
                if block.dtype != jnp.bfloat16:  # e4m3 -> f16: exact, the hardware's path
                    block = block.astype(jnp.float16)
                if scaled:  # the rows scaled, then rounded to bf16, as the reference reads the cache
                    layout = _copy_layout(r)
                    row_scales = plgpu.load(shared.scales.at[step, rows], layout=layout.reduce(1), optimized=False)
                    by_row = plgpu.layout_cast(lax.broadcast_in_dim(row_scales, block.shape, [0]), layout)
                    block = block.astype(jnp.float32) * by_row
                shared.operands[slot, rows] = block.astype(jnp.bfloat16)
        plgpu.commit_smem()
        plgpu.barrier_arrive(shared.ready.at[slot])

        @pl.when(step + stages < steps)
        def _():
            gather(step + stages, stage)

    for step in range(max(steps - 2, 0), steps):  # the last blocks' release, seen before exit
        plgpu.barrier_wait(shared.consumed.at[step % 2])


def _consume(shared: _Shared, wg, *, scale, steps):
    """One consumer's walk over the blocks: (its [64, R / 2] output in chunks of VALUE_CHUNK
    columns, the softmax's running max (base 2) and sum [64])."""
    half = shared.q.shape[-1]
    width = min(half, VALUE_CHUNK)
    c = scale * math.log2(math.e)
    plgpu.barrier_wait(shared.loaded)

    def step_fn(step, carry):
        acc, top, total = carry
        slot = step % 2
        operand = shared.operands.at[slot]
        plgpu.barrier_wait(shared.ready.at[slot])
        with jax.named_scope("scores"):

            def scores(acc_ref):
                plgpu.wgmma(acc_ref, shared.q.at[wg], operand.at[:, pl.ds(wg * half, half)].transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(scores, plgpu.ACC((HEADS, BLOCK_ROWS), jnp.float32))
            shared.exchange[slot, wg] = s
            plgpu.barrier_arrive(shared.exchanged.at[slot])
            plgpu.barrier_wait(shared.exchanged.at[slot])
            s = s + plgpu.load(shared.exchange.at[slot, 1 - wg], layout=_WGMMA)
        with jax.named_scope("softmax"):
            chosen = plgpu.load(shared.ids.at[step], layout=_COL, optimized=False) >= 0
            s = jnp.where(lax.broadcast_in_dim(chosen, s.shape, [1]), s * c, -jnp.inf)
            new_top = jnp.maximum(top, s.max(axis=1))
            alpha = jnp.exp2(top - new_top)
            p = jnp.exp2(s - lax.broadcast_in_dim(new_top, s.shape, [0]))
            total = total * alpha + p.sum(axis=1)
        with jax.named_scope("values"):
            # P goes through shared memory (from registers it would not, but Pallas' interpreter,
            # which the tests run, reads a product's A from memory).
            shared.probabilities[wg] = p.astype(jnp.bfloat16)
            plgpu.commit_smem()

            def values(chunk):
                def product(acc_ref):
                    plgpu.wgmma(acc_ref, shared.probabilities.at[wg], operand.at[:, pl.ds(wg * half + chunk * width, width)])
                    return acc_ref[...]

                return pl.run_scoped(product, plgpu.ACC((HEADS, width), jnp.float32))

            # Each product lands in a fresh accumulator and is added in registers: a [64, 128] fp32
            # chunk beside the running output fits them.
            acc = tuple(a * lax.broadcast_in_dim(alpha, a.shape, [0]) + values(i) for i, a in enumerate(acc))
        plgpu.barrier_arrive(shared.consumed.at[slot])
        return acc, new_top, total

    init = (
        tuple(plgpu.layout_cast(jnp.zeros((HEADS, width), jnp.float32), _WGMMA) for _ in range(half // width)),
        plgpu.layout_cast(jnp.full((HEADS,), -1e30, jnp.float32), _ROW),
        plgpu.layout_cast(jnp.zeros((HEADS,), jnp.float32), _ROW),
    )
    return lax.fori_loop(0, steps, step_fn, init)


def _kernel(q_ref, rows_ref, ids_ref, scales_ref, *out_refs, scale, scaled, steps, stages, splits):
    """Grid (query x head group, split); warpgroups 0 and 1 consume, 2 produces.

    q_ref [N, 64, R] bf16; rows_ref [n_rows, R] bf16 or fp8; ids_ref [N, splits, steps, BLOCK_ROWS]
    int32 (the row of each selected slot, -1 for an empty one); scales_ref the same shape, fp32."""
    n, split = lax.axis_index("query"), lax.axis_index("split")
    r = q_ref.shape[-1]
    half = r // 2

    def body(*buffers):
        shared = _Shared(*buffers)
        wg = lax.axis_index("wg")

        @pl.when(wg == 0)
        def _():
            for h in range(2):
                plgpu.copy_gmem_to_smem(q_ref.at[n, :, pl.ds(h * half, half)], shared.q.at[h], shared.loaded)
            plgpu.copy_gmem_to_smem(ids_ref.at[n, split], shared.ids, shared.loaded)
            plgpu.copy_gmem_to_smem(scales_ref.at[n, split], shared.scales, shared.loaded)

        @pl.when(wg == 2)
        def _():
            plgpu.set_max_registers(40, action="decrease")
            _produce(rows_ref, shared, scaled=scaled, steps=steps, stages=stages)

        @pl.when(wg < 2)
        def _():
            plgpu.set_max_registers(232, action="increase")
            acc, top, total = _consume(shared, wg, scale=scale, steps=steps)
            norm = lax.broadcast_in_dim(jnp.where(total > 0, total, 1.0), acc[0].shape, [0])
            width = acc[0].shape[1]
            with jax.named_scope("store"):
                if splits == 1:  # into this consumer's half of q, which it alone has read
                    for i, a in enumerate(acc):
                        shared.q[wg, :, pl.ds(i * width, width)] = (a / norm).astype(jnp.bfloat16)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(shared.q.at[wg], out_refs[0].at[n, :, pl.ds(wg * half, half)])
                    plgpu.wait_smem_to_gmem(0)
                else:
                    o_ref, top_ref, total_ref = out_refs
                    for i, a in enumerate(acc):
                        o_ref[n, split, :, pl.ds(wg * half + i * width, width)] = a / norm

                    @pl.when(wg == 0)
                    def _():
                        top_ref[n, split] = top
                        total_ref[n, split] = total

    pl.run_scoped(body, *_allocations(r, rows_ref.dtype, steps, stages), collective_axes="wg")


def _copy_layout(r):
    """The register layout of an [8, R] slab moved from row-major to tiled, swizzled shared memory."""
    return plgpu.Layout.SMEM_GMEM_COPY((8, r), jnp.bfloat16, _SWIZZLE)


def _row_ids(latents, indices, latent_scales, page_table):
    """Each selected slot's row in the cache's rows [n_rows, R] (-1 where empty) and its scale."""
    b = indices.shape[0]
    if page_table is None:  # each sequence is one page
        page_table = jnp.arange(b, dtype=jnp.int32)[:, None]
    n_pages, page_size = latents.shape[:2]
    keys = page_table.shape[1] * page_size
    key = jnp.clip(indices, 0, keys - 1)
    page = jnp.clip(jnp.take_along_axis(page_table, key.reshape(b, -1) // page_size, axis=1), 0, n_pages - 1)
    row = page.reshape(key.shape) * page_size + key % page_size
    row_ids = jnp.where((indices >= 0) & (indices < keys), row, -1).astype(jnp.int32)
    if latent_scales is None:
        return row_ids, None
    return row_ids, latent_scales.reshape(-1).astype(jnp.float32)[jnp.maximum(row_ids, 0)]


def sparse_latent_attention_kernel(
    q_lat, latents, indices, latent_scales, page_table, *, scale, config: MosaicConfig, distinct_indices, interpret
):
    """The arguments and result of `sparse_latent_attention` (checked there; q_lat bf16, R in
    LATENT_DIMS): the selection mapped to rows of the cache, heads padded to whole groups of 64, the
    kernel, and the splits merged."""
    b, t, h, r = q_lat.shape
    if not distinct_indices:
        indices = mark_repeats_empty(indices)
    row_ids, row_scales = _row_ids(latents, indices.astype(jnp.int32), latent_scales, page_table)
    rows = latents.reshape(-1, r)
    if rows.dtype not in ROW_DTYPES:  # fp16 / fp32 caches: as the reference reads them
        if row_scales is not None:
            rows = rows.astype(jnp.float32) * latent_scales.reshape(-1, 1)
            row_scales = None
        rows = rows.astype(jnp.bfloat16)
    groups = -(-h // HEADS)
    q = jnp.pad(q_lat, [(0, 0), (0, 0), (0, groups * HEADS - h), (0, 0)]).reshape(b * t * groups, HEADS, r)
    row_ids = jnp.repeat(row_ids.reshape(b * t, -1), groups, axis=0)
    scaled = row_scales is not None
    row_scales = jnp.ones(row_ids.shape, jnp.float32) if not scaled else jnp.repeat(row_scales.reshape(b * t, -1), groups, axis=0)

    queries = b * t * groups
    blocks = -(-row_ids.shape[1] // BLOCK_ROWS)
    # Off the GPU (the interpreter) one split unless asked: the tests pick theirs.
    sms = sm_count() if jax.default_backend() == "gpu" else 1
    splits = config.splits or max(1, min(blocks, sms // queries))
    steps = -(-blocks // splits)
    stages = config.stages or next((s for s in (3, 2) if shared_bytes(r, rows.dtype, steps, s) <= SMEM_BYTES), 1)
    if shared_bytes(r, rows.dtype, steps, stages) > SMEM_BYTES:
        raise ValueError(
            f"config.stages = {stages} needs {shared_bytes(r, rows.dtype, steps, stages) / 1024:.1f} KiB of shared memory"
            f" at R = {r}, {rows.dtype} rows and {steps * BLOCK_ROWS} selected a CTA; at most {SMEM_BYTES // 1024}"
        )
    pad = [(0, 0), (0, splits * steps * BLOCK_ROWS - row_ids.shape[1])]
    row_ids = jnp.pad(row_ids, pad, constant_values=-1).reshape(queries, splits, steps, BLOCK_ROWS)
    row_scales = jnp.pad(row_scales, pad).reshape(queries, splits, steps, BLOCK_ROWS)
    if splits == 1:
        out_type = jax.ShapeDtypeStruct((queries, HEADS, r), q.dtype)
    else:
        out_type = (
            jax.ShapeDtypeStruct((queries, splits, HEADS, r), jnp.float32),
            jax.ShapeDtypeStruct((queries, splits, HEADS), jnp.float32),
            jax.ShapeDtypeStruct((queries, splits, HEADS), jnp.float32),
        )
    kernel = plgpu.kernel(
        functools.partial(_kernel, scale=scale, scaled=scaled, steps=steps, stages=stages, splits=splits),
        out_type=out_type,
        grid=(queries, splits),
        grid_names=("query", "split"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=(interpret if isinstance(interpret, plgpu.InterpretGPUParams) else plgpu.InterpretGPUParams())
        if interpret else None,
        kernel_name="sparse_latent_attention_mosaic",
    )
    out = kernel(q, rows, row_ids, row_scales)
    if splits > 1:
        o, top, total = out
        out = merge_splits(o, top, total, axis=1).astype(q.dtype)
    return out.reshape(b, t, groups * HEADS, r)[:, :, :h]
