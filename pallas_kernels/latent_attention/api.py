"""DSA attention in the absorbed latent form: each query attends to its selected tokens' latents.

Scores are q_lat . c (q_lat is the query mapped into the kv_lora space through q_absorb, c the
normalised latent); the output stays in latent space (o_absorb maps it to the hidden size). The keys
and the values are the same latents, so a query's whole work is one gather of its selected rows and
two products per block of them, for every head at once.

The latents are a whole sequence's [B, S, R], or an inference cache's pages [n_pages, page_size, R]
with a page table (token i of sequence b in page page_table[b, i // page_size]); either may carry
a per-token scale (the fp8 e4m3 cache's dequantisation). The rows are scaled and rounded to
q_lat's dtype before use, as a dense read of the cache would give them.

Three implementations behind `sparse_latent_attention`:
- `sparse_latent_attention_reference` (`reference`): dense scores over all S keys, masked to the selection (query
  blocks keep the [H, T, S] scores from being whole); any device, and the oracle of the kernel.
- the Pallas kernel (Triton backend, GPU; `sparse_attend_triton`): a gather of each query's
  selected rows with an online softmax, FLOPs and bytes in the selection's width W, not in S;
- the Pallas kernel on Mosaic GPU (Hopper: TMA row gathers, wgmma; `sparse_attend_mosaic`), the
  same walk for 64 heads a CTA, asked for by passing a `MosaicConfig`.
Selected indices may repeat (a token counts once); -1, and any index outside [0, S), marks an empty
slot. The kernel counts a repeated index once only when `distinct_indices` is False (the default), by
marking repeats empty before the launch (a sort of each row); the model's selections are distinct by
construction (whole disjoint pools and the tail after them) and say so.

The kernels differentiate (`jax.grad`) in q_lat and the latents through
`sparse_latent_attention_backward` (`backward.py`): blocks of queries gather their selected rows
again and scatter-add the rows' gradients, in XLA, FLOPs and bytes in W as the forward's (no
backward kernel yet). The reference differentiates by autodiff (dense scores, a block of queries at a
time). The indices, the pages and an fp8 cache's scales get no gradient.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.common import pick_implementation
from pallas_kernels.latent_attention import sparse_attend_mosaic, sparse_attend_triton
from pallas_kernels.latent_attention.backward import sparse_latent_attention_backward
from pallas_kernels.latent_attention.reference import sparse_latent_attention_reference
from pallas_kernels.latent_attention.sparse_attend_mosaic import MosaicConfig
from pallas_kernels.latent_attention.sparse_attend_triton import LATENT_DIMS, KernelConfig


def _kernel_unsupported(q_lat, latents, indices, config):
    if isinstance(config, MosaicConfig):
        return sparse_attend_mosaic.unsupported(q_lat, indices)
    r = q_lat.shape[-1]
    if r not in LATENT_DIMS:
        return f"the latent width R must be one of {LATENT_DIMS}, got {r}"
    if q_lat.dtype not in (jnp.bfloat16, jnp.float16):
        return f"q_lat must be bf16 or fp16, got {q_lat.dtype}"
    if latents.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn):
        return f"latents must be bf16, fp16, fp32 or fp8 e4m3, got {latents.dtype}"
    return None


def _check(q_lat, latents, indices, latent_scales, page_table, config):
    if q_lat.ndim != 4:
        raise ValueError(f"q_lat must be [B, T, H, R], got {q_lat.shape}")
    b, t, _, r = q_lat.shape
    if page_table is None:
        if latents.ndim != 3 or latents.shape[0] != b or latents.shape[2] != r:
            raise ValueError(f"latents must be [B, S, R] = [{b}, S, {r}], got {latents.shape}")
    else:
        if page_table.ndim != 2 or page_table.shape[0] != b or not jnp.issubdtype(page_table.dtype, jnp.integer):
            raise ValueError(
                f"page_table must be integers [B, pages_per_sequence] with B = {b}, got {page_table.dtype} {page_table.shape}"
            )
        if latents.ndim != 3 or latents.shape[2] != r:
            raise ValueError(f"latents must be pages [n_pages, page_size, {r}] with a page_table, got {latents.shape}")
    if latent_scales is not None and latent_scales.shape != latents.shape[:2]:
        raise ValueError(f"latent_scales must be {latents.shape[:2]} (one per latent row), got {latent_scales.shape}")
    if indices.ndim != 3 or indices.shape[:2] != (b, t) or not jnp.issubdtype(indices.dtype, jnp.integer):
        raise ValueError(f"indices must be integers [B, T, W] with B, T = {(b, t)}, got {indices.dtype} {indices.shape}")
    if not isinstance(config, (KernelConfig, MosaicConfig)):
        raise ValueError(f"config must be a KernelConfig (Triton) or a MosaicConfig (Mosaic GPU), got {config!r}")
    if isinstance(config, KernelConfig) and config.block_tokens not in (16, 32, 64, 128):
        raise ValueError(f"config.block_tokens must be 16, 32, 64 or 128, got {config.block_tokens}")
    if config.splits is not None and config.splits < 1:
        raise ValueError(f"config.splits must be None or at least 1, got {config.splits}")
    if isinstance(config, MosaicConfig) and config.stages is not None and config.stages not in (1, 2, 3):
        raise ValueError(f"config.stages must be None, 1, 2 or 3, got {config.stages}")


def sparse_latent_attention(
    q_lat, latents, indices, *, scale, latent_scales=None, page_table=None, implementation=None,
    config=KernelConfig(), distinct_indices=False, interpret=False,
):
    """o_lat [B, T, H, R] in q_lat.dtype; the arguments as `sparse_latent_attention_reference`'s.

    `implementation`: None (the kernel on GPU for bf16 q_lat, else the reference), "reference" or
    "pallas". `config` picks the kernel: a `KernelConfig` the Triton one, a `MosaicConfig` the
    Mosaic GPU one (wgmma; R in 128, 256, 512 and bf16 q_lat, else the automatic choice takes the
    reference). `distinct_indices`: the caller promises no row repeats an index (the kernel then skips
    marking repeats). `interpret` runs the kernel in Pallas' interpreter.
    """
    _check(q_lat, latents, indices, latent_scales, page_table, config)
    unsupported = _kernel_unsupported(q_lat, latents, indices, config)
    impl = pick_implementation(implementation, unsupported, q_lat.dtype, interpret=interpret)
    if impl == "reference":
        return sparse_latent_attention_reference(
            q_lat, latents, indices, scale=scale, latent_scales=latent_scales, page_table=page_table
        )
    return _kernel_attention(q_lat, latents, indices, latent_scales, page_table, (scale, config, distinct_indices, interpret))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _kernel_attention(q_lat, latents, indices, latent_scales, page_table, options):
    scale, config, distinct_indices, interpret = options
    backend = sparse_attend_mosaic if isinstance(config, MosaicConfig) else sparse_attend_triton
    return backend.sparse_latent_attention_kernel(
        q_lat, latents, indices, latent_scales, page_table, scale=scale, config=config,
        distinct_indices=distinct_indices, interpret=interpret,
    )


def _kernel_attention_fwd(q_lat, latents, indices, latent_scales, page_table, options):
    out = _kernel_attention(q_lat, latents, indices, latent_scales, page_table, options)
    return out, (q_lat, latents, indices, latent_scales, page_table)


def _kernel_attention_bwd(options, residuals, d_out):
    q_lat, latents, indices, latent_scales, page_table = residuals
    scale, _, distinct_indices, _ = options
    d_q, d_latents = sparse_latent_attention_backward(
        q_lat, latents, indices, d_out, scale=scale, latent_scales=latent_scales, page_table=page_table,
        distinct_indices=distinct_indices)
    return d_q, d_latents, None, None, None


_kernel_attention.defvjp(_kernel_attention_fwd, _kernel_attention_bwd)
