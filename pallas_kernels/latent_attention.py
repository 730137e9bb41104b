"""DSA attention in the absorbed latent form: each query attends to its selected tokens' latents.

Scores are q_lat . c (q_lat is the query mapped into the kv_lora space through q_absorb, c the
normalised latent); the output stays in latent space (o_absorb maps it to the hidden size). The keys
and the values are the same latents, so a query's whole work is one gather of its selected rows and
two products per block of them, for every head at once.

The latents are a whole sequence's [B, S, R], or an inference cache's pages [n_pages, page_size, R]
with a page table (token i of sequence b in page page_table[b, i // page_size]); either may carry
a per-token scale (the fp8 e4m3 cache's dequantisation). The rows are scaled and rounded to
q_lat's dtype before use, as a dense read of the cache would give them.

Two implementations behind `sparse_latent_attention`:
- `sparse_latent_attention_reference`: dense scores over all S keys, masked to the selection (query
  blocks keep the [H, T, S] scores from being whole); any device, and the oracle of the kernel.
- the Pallas kernel (Triton backend, GPU): one program per (head group, query, sequence) walks the
  query's selection in blocks of `block_tokens`, gathers those rows through the page table (Triton
  pipelines the row loads into shared memory; Mosaic GPU's TMA cannot write single rows into the
  8-row tiles wgmma reads), dequantises them, and keeps an online softmax: FLOPs and bytes in the
  selection's width W, not in S. Where (head groups x queries) leave SMs idle (decode), each query's
  selection is split between programs and their partial softmaxes merged after.
Selected indices may repeat (a token counts once); -1, and any index outside [0, S), marks an empty
slot. The kernel counts a repeated index once only when `distinct_indices` is False (the default), by
marking repeats empty before the launch (a sort of each row); the model's selections are distinct by
construction (whole disjoint pools and the tail after them) and say so.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import pick_implementation
from pallas_kernels.kda_chain import sm_count
from pallas_kernels.query_blocks import map_query_blocks

HIGHEST = jax.lax.Precision.HIGHEST
QUERY_BLOCK = 256
MAX_BLOCK_HEADS = 64  # heads a program attends for: its fp32 output [64, R] fills the registers at R = 512
LATENT_DIMS = (64, 128, 256, 512)


def _sequence_latents(q_lat, latents, latent_scales, page_table):
    """Each sequence's latents [B, S, R] as the attention uses them: scaled, rounded to q_lat's dtype."""
    if page_table is not None:
        b = page_table.shape[0]
        latents = latents[page_table].reshape(b, -1, latents.shape[-1])
        latent_scales = None if latent_scales is None else latent_scales[page_table].reshape(b, -1)
    if latent_scales is not None:
        latents = latents.astype(jnp.float32) * latent_scales[..., None]
    return latents.astype(q_lat.dtype)


def sparse_latent_attention_reference(q_lat, latents, indices, *, scale, latent_scales=None, page_table=None):
    """q_lat [B, T, H, R]; latents [B, S, R], or pages [n_pages, page_size, R] with page_table
    [B, pages_per_sequence] int32 (then S = pages_per_sequence * page_size); latent_scales None or
    [B, S] / [n_pages, page_size] (multiplies each token's latent); indices [B, T, W] int32 into S
    (-1 or out of range = empty). Page-table entries must lie in [0, n_pages).

    Returns o_lat [B, T, H, R] in q_lat.dtype; a query with no selected token gets zeros.
    Queries are processed in blocks so the [H, T, S] score matrix is never whole.
    """
    b = q_lat.shape[0]
    keys = _sequence_latents(q_lat, latents, latent_scales, page_table).astype(jnp.float32)
    s = keys.shape[1]

    def attend(xs):
        q, idx = xs  # [B, block, H, R], [B, block, W]
        # Scatter the selection into a [B, block, S] mask; -1 goes out of bounds and is dropped.
        target = jnp.where(idx < 0, s, idx)
        rows = jnp.arange(q.shape[1])[None, :, None]
        batch = jnp.arange(b)[:, None, None]
        selected = jnp.zeros((b, q.shape[1], s), jnp.bool_).at[batch, rows, target].set(True, mode="drop")
        logits = jnp.einsum("bqhr,bsr->bhqs", q.astype(jnp.float32), keys, precision=HIGHEST) * scale
        logits = jnp.where(selected[:, None], logits, -jnp.inf)
        any_selected = selected.any(-1)[:, None, :, None]
        probs = jax.nn.softmax(jnp.where(any_selected, logits, 0.0), axis=-1)
        probs = jnp.where(selected[:, None] & any_selected, probs, 0.0)
        return jnp.einsum("bhqs,bsr->bqhr", probs, keys, precision=HIGHEST)

    return map_query_blocks(attend, (q_lat, indices), (0, -1), QUERY_BLOCK).astype(q_lat.dtype)


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
    output, running max and sum for `_merge_splits`."""
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


def _merge_splits(o, top, total):
    """The parts' normalised outputs [B, T, splits, H, R] weighed by their share of the softmax sum."""
    weight = total * jnp.exp2(top - top.max(axis=2, keepdims=True))  # [B, T, splits, H]
    norm = weight.sum(axis=2)
    merged = jnp.einsum("btsh,btshr->bthr", weight, o, precision=HIGHEST)
    return merged / jnp.where(norm > 0, norm, 1.0)[..., None]


def _mark_repeats_empty(indices):
    """Each row's repeated indices after their first as -1 (the order of a row does not matter)."""
    ordered = jnp.sort(indices, axis=-1)
    repeat = jnp.concatenate([jnp.zeros_like(ordered[..., :1], bool), ordered[..., 1:] == ordered[..., :-1]], axis=-1)
    return jnp.where(repeat, -1, ordered)


def _kernel_unsupported(q_lat, latents):
    r = q_lat.shape[-1]
    if r not in LATENT_DIMS:
        return f"the latent width R must be one of {LATENT_DIMS}, got {r}"
    if q_lat.dtype not in (jnp.bfloat16, jnp.float16):
        return f"q_lat must be bf16 or fp16, got {q_lat.dtype}"
    if latents.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn):
        return f"latents must be bf16, fp16, fp32 or fp8 e4m3, got {latents.dtype}"
    return None


def _sparse_latent_attention_kernel(q_lat, latents, indices, latent_scales, page_table, *, scale, config, distinct_indices, interpret):
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
        indices = _mark_repeats_empty(indices)
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
        out = _merge_splits(*out).astype(q.dtype)
    return out[:, :, :h]


def _check(q_lat, latents, indices, latent_scales, page_table, config):
    if q_lat.ndim != 4:
        raise ValueError(f"q_lat must be [B, T, H, R], got {q_lat.shape}")
    b, t, _, r = q_lat.shape
    if page_table is None:
        if latents.ndim != 3 or latents.shape[0] != b or latents.shape[2] != r:
            raise ValueError(f"latents must be [B, S, R] = [{b}, S, {r}], got {latents.shape}")
    else:
        if page_table.ndim != 2 or page_table.shape[0] != b or not jnp.issubdtype(page_table.dtype, jnp.integer):
            raise ValueError(f"page_table must be integers [B, pages_per_sequence] with B = {b}, got {page_table.dtype} {page_table.shape}")
        if latents.ndim != 3 or latents.shape[2] != r:
            raise ValueError(f"latents must be pages [n_pages, page_size, {r}] with a page_table, got {latents.shape}")
    if latent_scales is not None and latent_scales.shape != latents.shape[:2]:
        raise ValueError(f"latent_scales must be {latents.shape[:2]} (one per latent row), got {latent_scales.shape}")
    if indices.ndim != 3 or indices.shape[:2] != (b, t) or not jnp.issubdtype(indices.dtype, jnp.integer):
        raise ValueError(f"indices must be integers [B, T, W] with B, T = {(b, t)}, got {indices.dtype} {indices.shape}")
    if config.block_tokens not in (16, 32, 64, 128):
        raise ValueError(f"config.block_tokens must be 16, 32, 64 or 128, got {config.block_tokens}")
    if config.splits is not None and config.splits < 1:
        raise ValueError(f"config.splits must be None or at least 1, got {config.splits}")


def sparse_latent_attention(
    q_lat, latents, indices, *, scale, latent_scales=None, page_table=None, implementation=None,
    config=KernelConfig(), distinct_indices=False, interpret=False,
):
    """o_lat [B, T, H, R] in q_lat.dtype; the arguments as `sparse_latent_attention_reference`'s.

    `implementation`: None (the kernel on GPU for bf16 q_lat, else the reference), "reference" or
    "pallas". `distinct_indices`: the caller promises no row repeats an index (the kernel then skips
    marking repeats). `interpret` runs the kernel in Pallas' interpreter.
    """
    _check(q_lat, latents, indices, latent_scales, page_table, config)
    impl = pick_implementation(implementation, _kernel_unsupported(q_lat, latents), q_lat.dtype, interpret=interpret)
    if impl == "reference":
        return sparse_latent_attention_reference(
            q_lat, latents, indices, scale=scale, latent_scales=latent_scales, page_table=page_table
        )
    return _sparse_latent_attention_kernel(
        q_lat, latents, indices, latent_scales, page_table, scale=scale, config=config,
        distinct_indices=distinct_indices, interpret=interpret,
    )
