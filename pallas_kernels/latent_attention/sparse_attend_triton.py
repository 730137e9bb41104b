"""Sparse latent attention on the GPU, in Pallas' Triton backend.

One program per (head group, query, sequence) walks the query's selection in blocks of
`block_tokens`, gathers those rows through the page table (Triton pipelines the row loads into
shared memory; Mosaic GPU's TMA cannot write single rows into the 8-row tiles wgmma reads),
dequantises them, and keeps an online softmax: FLOPs and bytes in the selection's width W, not in S.
Where (head groups x queries) leave SMs idle (decode), each query's selection is split between
programs and their partial softmaxes merged after.
A repeated index counts once: `sparse_latent_attention_kernel` marks repeats empty before the
launch unless the caller promises distinct indices.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import sm_count
from pallas_kernels.latent_attention.splits import mark_repeats_empty, merge_splits

MAX_BLOCK_HEADS = 64  # heads a program attends for: its fp32 output [64, R] fills the registers at R = 512
LATENT_DIMS = (64, 128, 256, 512)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """The kernel's tiling: `block_tokens` selected rows per step, `num_warps` per program (8: two
    warpgroups share the [heads, R] fp32 output), `num_stages` row blocks in flight, `splits` parts
    of each query's selection walked by programs of their own (None: enough to give every SM two
    programs when (head groups x queries) are fewer; their partial softmaxes are merged after)."""

    block_tokens: int = 64
    num_warps: int = 8
    num_stages: int = 2
    splits: int | None = None


def _attend_kernel(q_ref, rows_ref, *refs, scaled, scale, heads, block_tokens, splits, page_size, keys):
    """One group of `heads` heads of one query (and one part of its selection): an online softmax
    (base 2) over the selected rows, block by block. `rows_ref` [n_pages * page_size, R] holds every
    page's rows; then come their scales (when `scaled`), the page table, the indices and the outputs.
    With one split the output is normalised here; with several, each part leaves its normalised
    output, running max and sum for `splits.merge_splits`."""
    scales_ref, page_table_ref, indices_ref, *out_refs = refs if scaled else (None, *refs)
    gs, t, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    g, split = gs // splits, gs % splits
    r = q_ref.shape[3]
    q = q_ref[b, t, pl.ds(g * heads, heads), :]  # [heads, R]
    c = scale * math.log2(math.e)
    steps = indices_ref.shape[2] // block_tokens // splits

    def step(i, carry):
        acc, top, total = carry
        idx = indices_ref[b, t, pl.ds((split * steps + i) * block_tokens, block_tokens)]
        chosen = (idx >= 0) & (idx < keys)
        key = jnp.clip(idx, 0, keys - 1)
        page = jnp.clip(page_table_ref[b, key // page_size], 0, rows_ref.shape[0] // page_size - 1)  # in bounds
        row = page * page_size + key % page_size
        latent = rows_ref[row, :]  # the gather: [block_tokens, R]
        if scales_ref is not None:
            latent = latent.astype(jnp.float32) * scales_ref[row][:, None]
        latent = latent.astype(q.dtype)
        s = jnp.dot(q, latent.T, preferred_element_type=jnp.float32) * c
        s = jnp.where(chosen[None, :], s, -jnp.inf)
        new_top = jnp.maximum(top, jnp.max(s, axis=1))
        alpha = jnp.exp2(top - new_top)
        p = jnp.exp2(s - new_top[:, None])
        total = total * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + jnp.dot(p.astype(q.dtype), latent, preferred_element_type=jnp.float32)
        return acc, new_top, total

    init = (jnp.zeros((heads, r), jnp.float32), jnp.full((heads,), -1e30, jnp.float32), jnp.zeros((heads,), jnp.float32))
    acc, top, total = jax.lax.fori_loop(0, steps, step, init)
    out = acc / jnp.where(total > 0, total, 1.0)[:, None]
    rows = pl.ds(g * heads, heads)
    if splits == 1:
        out_refs[0][b, t, rows, :] = out.astype(out_refs[0].dtype)
    else:
        o_ref, top_ref, total_ref = out_refs
        o_ref[b, t, split, rows, :] = out
        top_ref[b, t, split, rows] = top
        total_ref[b, t, split, rows] = total


def sparse_latent_attention_kernel(
    q_lat, latents, indices, latent_scales, page_table, *, scale, config, distinct_indices, interpret
):
    b, t, h, r = q_lat.shape
    bt = config.block_tokens
    # Triton's dots want power-of-two blocks of at least 16 rows: heads are padded up to one.
    block_heads = min(MAX_BLOCK_HEADS, max(16, 1 << (h - 1).bit_length()))
    padded_heads = -(-h // block_heads) * block_heads
    groups = padded_heads // block_heads
    q = jnp.pad(q_lat, [(0, 0), (0, 0), (0, padded_heads - h), (0, 0)])
    if page_table is None:  # each sequence is one page
        page_table = jnp.arange(b, dtype=jnp.int32)[:, None]
    page_size = latents.shape[1]
    rows = latents.reshape(-1, r)
    scales = None if latent_scales is None else latent_scales.reshape(-1).astype(jnp.float32)
    if not distinct_indices:
        indices = mark_repeats_empty(indices)
    blocks = -(-indices.shape[-1] // bt)
    # Off the GPU (the interpreter) one split unless asked: the tests pick theirs.
    programs = 2 * sm_count() if jax.default_backend() == "gpu" else 1
    splits = config.splits or max(1, min(blocks, programs // (groups * t * b)))
    blocks = -(-blocks // splits) * splits  # every split walks as many blocks
    indices = jnp.pad(indices.astype(jnp.int32), [(0, 0), (0, 0), (0, blocks * bt - indices.shape[-1])], constant_values=-1)
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    else:
        out_shape = (
            jax.ShapeDtypeStruct((b, t, splits, padded_heads, r), jnp.float32),
            jax.ShapeDtypeStruct((b, t, splits, padded_heads), jnp.float32),
            jax.ShapeDtypeStruct((b, t, splits, padded_heads), jnp.float32),
        )
    kernel = functools.partial(
        _attend_kernel, scaled=scales is not None, scale=scale, heads=block_heads, block_tokens=bt, splits=splits,
        page_size=page_size, keys=page_table.shape[1] * page_size,
    )
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(groups * splits, t, b),
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="sparse_latent_attention",
    )(q, rows, *(() if scales is None else (scales,)), page_table.astype(jnp.int32), indices)
    if splits > 1:
        out = merge_splits(*out, axis=2).astype(q.dtype)
    return out[:, :, :h]
