"""The candidates' scores on Hopper in Pallas Mosaic GPU (wgmma, TMA): each query's pool scores
sum_h w[h] relu(q_h . pool_key * scale), the heads' products summed in registers so that only the
[T, n_pools] scores reach memory.

Two forms, one warpgroup a CTA:
- queries (prefill): a CTA scores 64 queries against BLOCK_POOLS pools; its pool keys stay in
  shared memory while the queries' head tiles [64, hd] stream through a TMA pipeline, one wgmma a
  head. A block of pools that no query of the block sees yet is not multiplied.
- heads (decode, fewer than MIN_QUERIES queries): a CTA scores one query, its heads (padded to 64)
  the product's rows, against a stretch of the pools, whose key tiles stream through the pipeline:
  the pool keys, the bytes that bound a decode step's selection, are read once.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import sm_count

ROWS = 64  # wgmma's row block: queries of a CTA (queries form) or heads padded (heads form)
BLOCK_POOLS = 128  # pools a product covers
HEAD_DIMS = (64, 128)  # whole 64-column tiles of bf16
MAX_HEADS_AS_ROWS = ROWS
MIN_QUERIES = 16  # fewer queries: the heads form
STAGES = 3  # tiles in flight in either pipeline

_WGMMA = plgpu.Layout.WGMMA
_ROW, _COL = _WGMMA.reduce(1), _WGMMA.reduce(0)
_TILE = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def unsupported(q_idx, pool_keys):
    """Why the kernel cannot take a call, or None."""
    if q_idx.dtype != jnp.bfloat16 or pool_keys.dtype != jnp.bfloat16:
        return f"q_idx and pool_keys must be bf16, got {q_idx.dtype} and {pool_keys.dtype}"
    if q_idx.shape[-1] not in HEAD_DIMS:
        return f"the index head dim must be one of {HEAD_DIMS}, got {q_idx.shape[-1]}"
    if q_idx.shape[1] < MIN_QUERIES and q_idx.shape[2] > MAX_HEADS_AS_ROWS:
        return f"fewer than {MIN_QUERIES} queries take at most {MAX_HEADS_AS_ROWS} heads, got {q_idx.shape[2]}"
    return None


def _products(q_smem, keys_smem):
    """q [64, hd] times the pools' keys [BLOCK_POOLS, hd] transposed, fp32 [64, BLOCK_POOLS]."""
    with jax.named_scope("product"):

        def product(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, keys_smem.transpose((1, 0)))
            return acc_ref[...]

        return pl.run_scoped(product, plgpu.ACC((ROWS, BLOCK_POOLS), jnp.float32))


def _masked(scores, candidate):
    """-inf where not a candidate; -0.0 as +0.0, so that a ranking sees one zero."""
    return jnp.where(candidate, jnp.where(scores == 0, 0.0, scores), -jnp.inf)


def _queries_kernel(q_ref, w_ref, keys_ref, valid_ref, visible_ref, seen_ref, out_ref, keys_smem, w_smem, visible_smem,
                    valid_smem, loaded, *, heads, scale):
    """Grid (pool block, query block, sequence). q_ref [B, Tp, nh * hd]; w_ref [B, Tp / 64, nh, 64]
    fp32 (each block's weights by head); keys_ref [B, Pp, hd]; valid_ref [B, Pp] int32; visible_ref
    [B, Tp] int32; seen_ref [B, Tp / 64] int32 (the most pools a query of the block sees)."""
    pb, tb, b = lax.axis_index("pools"), lax.axis_index("queries"), lax.axis_index("b")
    hd = keys_ref.shape[-1]
    pools = pl.ds(pb * BLOCK_POOLS, BLOCK_POOLS)
    tokens = pl.ds(tb * ROWS, ROWS)
    shape = (ROWS, BLOCK_POOLS)
    plgpu.copy_gmem_to_smem(visible_ref.at[b, tokens], visible_smem, loaded)
    plgpu.copy_gmem_to_smem(valid_ref.at[b, pools], valid_smem, loaded)
    plgpu.barrier_wait(loaded)
    pool = pb * BLOCK_POOLS + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=_WGMMA)
    visible = plgpu.load(visible_smem, layout=_ROW, optimized=False)
    valid = plgpu.load(valid_smem, layout=_COL, optimized=False)
    candidate = (lax.broadcast_in_dim(valid, shape, [1]) != 0) & (pool < lax.broadcast_in_dim(visible, shape, [0]))

    @pl.when(pb * BLOCK_POOLS < seen_ref[b, tb])
    def _():
        plgpu.copy_gmem_to_smem(keys_ref.at[b, pools], keys_smem, loaded)
        plgpu.copy_gmem_to_smem(w_ref.at[b, tb], w_smem, loaded)
        plgpu.barrier_wait(loaded)

        def head(indices, q_smem, total):
            (h,) = indices
            dots = _products(q_smem, keys_smem)
            with jax.named_scope("relu_weigh"):
                weight = plgpu.load(w_smem.at[h], layout=_ROW, optimized=False)
                return total + lax.broadcast_in_dim(weight, shape, [0]) * jnp.maximum(dots * scale, 0.0)

        pipeline = plgpu.emit_pipeline(
            head,
            grid=(heads,),
            in_specs=[plgpu.BlockSpec((ROWS, hd), lambda h: (tb, h), transforms=_TILE)],
            max_concurrent_steps=min(STAGES, heads),
            init_carry=plgpu.layout_cast(jnp.zeros(shape, jnp.float32), _WGMMA),
        )
        total = pipeline(q_ref.at[b])
        out_ref[b, tokens, pools] = _masked(total, candidate)

    @pl.when(pb * BLOCK_POOLS >= seen_ref[b, tb])
    def _():
        out_ref[b, tokens, pools] = plgpu.layout_cast(jnp.full(shape, -jnp.inf, jnp.float32), _WGMMA)


def _heads_kernel(q_ref, w_ref, keys_ref, valid_ref, visible_ref, out_ref, q_smem, w_smem, loaded, *, steps, scale):
    """Grid (stretch of pools, query, sequence). q_ref [B, T, 64, hd] (heads padded); w_ref [B, T, 64]
    fp32 (0 for padded heads); keys_ref [B, Pp, hd]; valid_ref [B, Pp] int32; visible_ref [B, T]
    int32. A CTA walks `steps` blocks of pools."""
    part, t, b = lax.axis_index("pools"), lax.axis_index("query"), lax.axis_index("b")
    hd = keys_ref.shape[-1]
    shape = (ROWS, BLOCK_POOLS)
    first = part * steps * BLOCK_POOLS
    plgpu.copy_gmem_to_smem(q_ref.at[b, t], q_smem, loaded)
    plgpu.copy_gmem_to_smem(w_ref.at[b, t], w_smem, loaded)
    plgpu.barrier_wait(loaded)
    weight = lax.broadcast_in_dim(plgpu.load(w_smem, layout=_ROW, optimized=False), shape, [0])
    visible = visible_ref[b, t]

    def block(indices, keys_smem, valid_smem):
        (i,) = indices
        dots = _products(q_smem, keys_smem)
        with jax.named_scope("relu_weigh"):
            scores = jnp.sum(weight * jnp.maximum(dots * scale, 0.0), axis=0)  # [BLOCK_POOLS]
        pools = pl.ds(first + i * BLOCK_POOLS, BLOCK_POOLS)
        pool = first + i * BLOCK_POOLS + plgpu.broadcasted_iota(jnp.int32, (BLOCK_POOLS,), 0, layout=_COL)
        valid = plgpu.load(valid_smem, layout=_COL, optimized=False)
        out_ref[b, t, pools] = _masked(scores, (valid != 0) & (pool < visible))

    plgpu.emit_pipeline(
        block,
        grid=(steps,),
        in_specs=[
            plgpu.BlockSpec((BLOCK_POOLS, hd), lambda i: (part * steps + i, 0), transforms=_TILE),
            plgpu.BlockSpec((BLOCK_POOLS,), lambda i: (part * steps + i,)),
        ],
        max_concurrent_steps=min(STAGES, steps),
    )(keys_ref.at[b], valid_ref.at[b])


def _launch(body, out_shape, grid, grid_names, scratch, name, interpret):
    return plgpu.kernel(
        body,
        out_type=out_shape,
        grid=grid,
        grid_names=grid_names,
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=(interpret if isinstance(interpret, plgpu.InterpretGPUParams) else plgpu.InterpretGPUParams())
        if interpret else None,
        kernel_name=name,
    )


def candidate_scores_kernel(q_idx, head_weights, pool_keys, pool_valid, visible, *, interpret=False):
    """`candidate_scores_reference` as one Mosaic GPU launch (`unsupported` says what it takes).
    Queries and pools are padded to whole blocks (padded queries see no pool, padded pools are not
    valid); in the heads form, heads to 64 (padded heads weigh 0)."""
    b, t, nh, hd = q_idx.shape
    n_pools = pool_keys.shape[1]
    scale = hd**-0.5
    w = head_weights.astype(jnp.float32)
    visible = visible.astype(jnp.int32)
    if t < MIN_QUERIES:
        blocks = -(-n_pools // BLOCK_POOLS)
        sms = sm_count() if jax.default_backend() == "gpu" else 1
        parts = max(1, min(blocks, 2 * sms // (b * t)))  # every SM busy, each CTA a stretch of blocks
        steps = -(-blocks // parts)
        padded = parts * steps * BLOCK_POOLS
        q = jnp.pad(q_idx, [(0, 0), (0, 0), (0, ROWS - nh), (0, 0)])
        w = jnp.pad(w, [(0, 0), (0, 0), (0, ROWS - nh)])
        keys = jnp.pad(pool_keys, [(0, 0), (0, padded - n_pools), (0, 0)])
        valid = jnp.pad(pool_valid.astype(jnp.int32), [(0, 0), (0, padded - n_pools)])
        kernel = _launch(
            functools.partial(_heads_kernel, steps=steps, scale=scale),
            jax.ShapeDtypeStruct((b, t, padded), jnp.float32),
            (parts, t, b), ("pools", "query", "b"),
            (plgpu.SMEM((ROWS, hd), jnp.bfloat16, transforms=_TILE), plgpu.SMEM((ROWS,), jnp.float32),
             plgpu.Barrier(num_arrivals=2)),
            "candidate_pool_scores_mosaic", interpret,
        )
        return kernel(q, w, keys, valid, visible)[:, :, :n_pools]

    pad_t, pad_p = -t % ROWS, -n_pools % BLOCK_POOLS
    tp, pp = t + pad_t, n_pools + pad_p
    q = jnp.pad(q_idx, [(0, 0), (0, pad_t), (0, 0), (0, 0)]).reshape(b, tp, nh * hd)
    w = jnp.pad(w, [(0, 0), (0, pad_t), (0, 0)]).reshape(b, tp // ROWS, ROWS, nh).transpose(0, 1, 3, 2)
    keys = jnp.pad(pool_keys, [(0, 0), (0, pad_p), (0, 0)])
    valid = jnp.pad(pool_valid.astype(jnp.int32), [(0, 0), (0, pad_p)])
    visible = jnp.pad(visible, [(0, 0), (0, pad_t)])
    seen = visible.reshape(b, tp // ROWS, ROWS).max(-1)
    kernel = _launch(
        functools.partial(_queries_kernel, heads=nh, scale=scale),
        jax.ShapeDtypeStruct((b, tp, pp), jnp.float32),
        (pp // BLOCK_POOLS, tp // ROWS, b), ("pools", "queries", "b"),
        (plgpu.SMEM((BLOCK_POOLS, hd), jnp.bfloat16, transforms=_TILE), plgpu.SMEM((nh, ROWS), jnp.float32),
         plgpu.SMEM((ROWS,), jnp.int32), plgpu.SMEM((BLOCK_POOLS,), jnp.int32), plgpu.Barrier(num_arrivals=2)),
        "candidate_pool_scores_mosaic", interpret,
    )
    return kernel(q, w, keys, valid, visible, seen)[:, :t, :n_pools]
