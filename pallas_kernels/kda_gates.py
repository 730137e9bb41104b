"""The first stage of the chunked KDA scan on the GPU: G, the running sum of the log decays g inside
each 64-token chunk, with G at every 8th token (the intra kernel's reference tokens) and exp(G_last)
(the chain's decay per chunk). A memory-bound pass (g in, G out, fp32), in Pallas Mosaic GPU;
`gate_sums_reference` is the same in jnp.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

CHUNK = 64  # tokens per chunk of the scan
MARK = 8  # G is also passed at every MARK-th token
_THREADS = 128  # one warpgroup


def _gate_sums_kernel(lengths_ref, g_ref, cum_ref, tile, loaded, *, block):
    """One [64, block] tile of one sequence's [T, H dk] gates: each thread keeps the running sums of
    block / 128 columns and walks the 64 rows, in place in SMEM (the sums in g's own order, as a
    sequential cumsum adds them)."""
    n, col, b = lax.axis_index("n"), lax.axis_index("c"), lax.axis_index("b")
    tokens, cols = pl.ds(n * CHUNK, CHUNK), pl.ds(col * block, block)
    plgpu.copy_gmem_to_smem(g_ref.at[b, tokens, cols], tile, loaded)  # rows past T arrive as zeros
    valid = lengths_ref[b] - n * CHUNK  # tokens at or past a sequence's length do not decay
    layout = plgpu.Layout.WG_STRIDED((block,), vec_size=block // _THREADS)
    plgpu.barrier_wait(loaded)

    def row(i, running):
        running = running + jnp.where(i < valid, plgpu.load(tile.at[i], layout=layout), 0.0)
        tile.at[i][...] = running
        return running

    lax.fori_loop(0, CHUNK, row, plgpu.layout_cast(jnp.zeros((block,), jnp.float32), layout))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(tile, cum_ref.at[b, tokens, cols])
    plgpu.wait_smem_to_gmem(0)


def gate_sums(g, lengths, padded, *, block=None, interpret=False):
    """G [B, T', H, dk] fp32, zero-extended past each sequence's length; G at every 8th token
    [B, T' / 8, H, dk]; exp(G_last) [B, H, T' / 64, dk]. g [B, T, H, dk] fp32 (natural-log decays),
    lengths [B] int32 (<= T), T' = `padded` (T rounded up to whole chunks). Each CTA sums a
    [64, block] tile: block 128 or 256 (TMA copies at most 256 per dimension); None takes 256 where it
    divides the padded width, else 128. The two measured within noise of each other on the H200
    (0.092-0.103 ms at (1, 16384, 16), 2.8-3.5 TB/s at the three benchmark shapes); 32 or 64 KB of
    SMEM, so that several CTAs share an SM and keep HBM busy."""
    b, t, h, dk = g.shape
    width = h * dk
    columns = -(-width // _THREADS) * _THREADS  # every thread owns a column: H dk = 64 is padded to 128
    if block is None:
        block = 2 * _THREADS if columns % (2 * _THREADS) == 0 else _THREADS
    if block not in (_THREADS, 2 * _THREADS) or columns % block:
        raise ValueError(
            f"block must be 128 or 256 and divide {columns} (H * dk = {width}, padded to whole 128s), got {block}"
        )
    kernel = plgpu.kernel(
        functools.partial(_gate_sums_kernel, block=block),
        out_type=jax.ShapeDtypeStruct((b, padded, columns), jnp.float32),
        grid=(padded // CHUNK, columns // block, b),
        grid_names=("n", "c", "b"),
        scratch_types=(plgpu.SMEM((CHUNK, block), jnp.float32), plgpu.Barrier(num_arrivals=1)),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="kda_gate_sums",
    )
    g = jnp.pad(g.astype(jnp.float32).reshape(b, t, width), [(0, 0), (0, 0), (0, columns - width)])
    cum = kernel(lengths, g)[:, :, :width]
    return marks_and_decay(cum.reshape(b, padded, h, dk))


def gate_sums_reference(g, lengths, padded):
    """`gate_sums` in jnp, in two levels: running sums inside 8-token blocks plus the running totals
    of the blocks (G at every 8th token)."""
    b, _, h, dk = g.shape
    x = gates_by_chunk(g, lengths, padded).reshape(b, padded // CHUNK, CHUNK // MARK, MARK, h * dk)
    inner = jnp.cumsum(x, axis=3)
    totals = jnp.cumsum(inner[:, :, :, -1], axis=2)  # G at every 8th token
    before = jnp.pad(totals[:, :, :-1], [(0, 0), (0, 0), (1, 0), (0, 0)])  # the earlier blocks' total
    return marks_and_decay((inner + before[:, :, :, None]).reshape(b, padded, h, dk))


def marks_and_decay(cum):
    """(G, G at every 8th token, exp(G_last) [B, H, T' / 64, dk]) from G [B, T', H, dk]."""
    return cum, cum[:, MARK - 1 :: MARK], jnp.exp(jnp.swapaxes(cum[:, CHUNK - 1 :: CHUNK], 1, 2))


def gates_by_chunk(g, lengths, padded):
    """g as [B, T' / 64, 64, H * dk] fp32, T' = `padded` tokens: zero at or past a sequence's length
    (those tokens do not decay) and in the padding."""
    b, t, h, dk = g.shape
    g = jnp.where((jnp.arange(t) < lengths[:, None])[:, :, None, None], g.astype(jnp.float32), 0.0)
    return jnp.pad(g, [(0, 0), (0, padded - t), (0, 0), (0, 0)]).reshape(b, padded // CHUNK, CHUNK, h * dk)
