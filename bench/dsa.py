"""DSA's latent attention on the GPU: the Pallas kernels (`latent_attention.sparse_latent_attention`,
a gather of each query's selected latents with an online softmax: Triton with a `KernelConfig`,
Mosaic GPU with a `MosaicConfig`) against the reference (dense scores over every key, masked to the
selection) and jla's DSA attention (../shared/peers/, when importable; it takes head dims of 64 or
128 only, so at R = 512 it reports why not), at GLM-5.3's shapes: 64 heads, latent width R = 512,
index_topk 2048 in pools of P = 4 plus the tail (W = 2051 slots).

Selections come from the model's own `select_tokens` with random indexer scores (whole pools, so
the same runs of P tokens a trained indexer picks; a query that sees at most 2051 tokens selects them
all). Prefill: B = 1, every query of T over the same T keys (bf16). Decode: B sequences, one query
each at the end of S cached keys, read from an fp8 e4m3 paged cache (64-token pages in shuffled
order, per-token scales) as the model's decode step reads it (up to batch 128 over 131072 cached);
the reference dequantises the whole cache densely (what a decode step without the kernel reads),
timed where B x S is at most 2^24 tokens, and checks the first 8 sequences.

Times are medians of 20 jitted calls dispatched back to back (`common.dispatched_ms`), per call.
The roofline is max(FLOPs / `common.MATMUL`, gathered bytes / `common.HBM`): FLOPs = 4 H R per
selected token (scores and output), gathered bytes per selected token read once per query: 2 R in
bf16 (in prefill most of them from L2: neighbouring queries share pools), R + 4 in fp8 with its scale.
Errors are max|d| / max|ref| against the reference in fp32 (over the last 512 queries where the
reference over all of them is too slow). Rows for bench/results.jsonl: op `latent_attention` per case (ours: the default
`KernelConfig`; baseline: the reference, timed up to 4096 queries).

    python -m bench.dsa [--configs 64x8x2,mosaicx2] [--cases prefill4096,decode8] [--skip-check]
        [--skip-reference-time] [--results bench/results.jsonl]
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import HBM, MATMUL, Results, add_results_argument, dispatched_ms, log, relative_error
from pallas_kernels import latent_attention as la
from pallas_kernels.latent_attention.sparse_attend_mosaic import LATENT_DIMS as MOSAIC_LATENT_DIMS
from pallas_kernels.select_tokens import select_tokens_reference

HEADS, R, TOPK, POOL, PAGE = 64, 512, 2048, 4, 64
CASES = {  # name: (B, T queries, S keys)
    "prefill4096": (1, 4096, 4096),
    "prefill16384": (1, 16384, 16384),
    "decode8": (8, 1, 32768),
    "decode64": (64, 1, 32768),
    "decode128x128K": (128, 1, 131072),
}
CHECKED_SEQUENCES = 8  # decode: the reference checks this many sequences (a dense read of all is 17 GB at 128 x 128K)
MAX_REFERENCE_TOKENS = 1 << 24  # the reference is timed where B x S is at most this


def selection(b, t, s, seed=0):
    """[B, T, W] indices as the model's indexer makes them, from random scores; queries at S - T .. S - 1."""
    keys = jax.random.split(jax.random.key(seed), 3)
    n_pools = s // POOL
    q_idx = jax.random.normal(keys[0], (b, t, 1, 16))
    weights = jnp.ones((b, t, 1))
    pool_keys = jax.random.normal(keys[1], (b, n_pools, 16))
    positions = jnp.broadcast_to(jnp.arange(s - t, s, dtype=jnp.int32), (b, t))
    select = jax.jit(lambda *a: select_tokens_reference(*a, index_topk=TOPK, pool_size=POOL))
    return select(q_idx, weights, pool_keys, jnp.ones((b, s), bool), positions)


CHECKS = [  # (B, T, H, R, S, W): head padding and groups, ragged blocks, one row, empty rows
    (2, 3, 4, 64, 50, 7), (1, 4, 16, 512, 300, 100), (2, 2, 64, 512, 3000, 2051), (1, 3, 128, 256, 500, 200),
    (2, 2, 8, 512, 100, 1),
]


def check():
    """Both kernels on the GPU against the fp32 reference on random selections, repeats included;
    then the paged fp8 read (`tests/kernels/test_latent_attention.py::test_paged_cache` on the GPU)."""
    for config in (la.KernelConfig(), la.MosaicConfig()):
        check_kernel(config)


def check_kernel(config):
    log(f"| check {config_name(config)} (B, T, H, R, S, W) | error, distinct | error, with repeats |")
    log("| --- | --- | --- |")
    rng = np.random.default_rng(0)
    for b, t, h, r, s, w in CHECKS:
        if isinstance(config, la.MosaicConfig) and r not in MOSAIC_LATENT_DIMS:
            continue
        q = jnp.asarray(rng.standard_normal((b, t, h, r)), jnp.bfloat16)
        latents = jnp.asarray(rng.standard_normal((b, s, r)), jnp.bfloat16)
        indices = np.stack([rng.permutation(s)[:w] for _ in range(b * t)]).reshape(b, t, w)
        indices[-1, -1, w // 2 :] = -1
        errors = []
        for repeats in (False, True):
            if repeats:
                indices[0, 0, 1 : max(2, w // 2)] = indices[0, 0, 0]
            idx = jnp.asarray(indices, jnp.int32)
            want = la.sparse_latent_attention_reference(q.astype(jnp.float32), latents.astype(jnp.float32), idx, scale=r**-0.5)
            got = la.sparse_latent_attention(q, latents, idx, scale=r**-0.5, implementation="pallas", config=config)
            errors.append(relative_error(got.astype(jnp.float32), want))
        log(f"| ({b}, {t}, {h}, {r}, {s}, {w}) | {errors[0]:.2e} | {errors[1]:.2e} |")
    for dtype in (jnp.bfloat16, jnp.float8_e4m3fn):  # 3 sequences of 10 shuffled pages of 16 tokens
        b, t, h, r, page, pages_per_seq = 3, 2, 64, 512, 16, 10
        page_table = jnp.asarray(rng.permutation(40)[:30].reshape(b, pages_per_seq), jnp.int32)
        pages = jnp.asarray(rng.standard_normal((40, page, r)) * 8, dtype)
        scales = jnp.asarray(rng.uniform(0.01, 0.1, (40, page)), jnp.float32)
        q = jnp.asarray(rng.standard_normal((b, t, h, r)), jnp.bfloat16)
        idx = jnp.asarray(np.stack([rng.permutation(180)[:100] for _ in range(b * t)]).reshape(b, t, 100), jnp.int32)
        kw = dict(scale=r**-0.5, page_table=page_table, latent_scales=scales)
        want = la.sparse_latent_attention_reference(q, pages, idx, **kw)
        got = la.sparse_latent_attention(q, pages, idx, implementation="pallas", config=config, **kw)
        log(f"| paged {jnp.dtype(dtype).name}, scaled ({b}, {t}, {h}, {r}, {pages_per_seq * page}, 100) |"
            f" {relative_error(got, want):.2e} | |")


def parse_config(text):
    """The Triton kernel's TOKENSxWARPSxSTAGES[xSPLITS], or the Mosaic GPU kernel's
    mosaic[xSTAGES[xSPLITS]] (STAGES 0: as shared memory allows); without SPLITS the kernel picks them."""
    if text.startswith("mosaic"):
        stages, splits = ([int(x) for x in text.split("x")[1:]] + [0, 0])[:2]
        return la.MosaicConfig(stages=stages or None, splits=splits or None)
    tokens, warps, stages, *splits = (int(x) for x in text.split("x"))
    return la.KernelConfig(block_tokens=tokens, num_warps=warps, num_stages=stages, splits=splits[0] if splits else None)


def config_name(config):
    """`parse_config`'s inverse."""
    if isinstance(config, la.MosaicConfig):
        return "mosaic" + "".join(f"x{v or 0}" for v in (config.stages, config.splits) if config.splits or v)
    splits = "" if config.splits is None else f"x{config.splits}"
    return f"{config.block_tokens}x{config.num_warps}x{config.num_stages}{splits}"


def jla_attention_ms(q, latents, indices, scale):
    """jla's DSA attention (`jla.ops.mosaic_gpu.dsa.dsa_attention`, from ../shared/peers/) with the
    latents as one shared key and value head, ms a call; or why it did not run."""
    try:
        from jla.ops.mosaic_gpu import dsa as jla_dsa
    except ImportError as e:
        return f"not importable: {e}"
    if q.shape[1] != latents.shape[1]:
        return "no decode form (its queries are its keys)"
    kv = latents[:, :, None, :]
    reason = jla_dsa.supported_attention(q, kv, kv)
    if reason is not None:
        return f"unsupported: {reason}"
    fn = jax.jit(lambda q, kv, i: jla_dsa.dsa_attention(q, kv, kv, i, scale=scale))
    try:
        return dispatched_ms(fn, q, kv, indices)
    except Exception as e:  # a peer that does not take this shape: say so
        return f"failed: {type(e).__name__}: {str(e)[:160]}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="64x8x2,64x8x2x1,64x8x3,64x16x2,mosaic,mosaicx2,mosaicx3")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--skip-reference-time", action="store_true")
    parser.add_argument("--skip-check", action="store_true")
    add_results_argument(parser)
    args = parser.parse_args()
    configs = [parse_config(c) for c in args.configs.split(",") if c]
    results = Results(args.results)
    log(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    if not args.skip_check:
        check()
    log("| case (B, T, S) | implementation | ms | TFLOP/s | roofline ms | error |")
    log("| --- | --- | --- | --- | --- | --- |")
    for name in filter(None, args.cases.split(",")):
        b, t, s = CASES[name]
        keys = jax.random.split(jax.random.key(1), 3)
        q = jax.random.normal(keys[0], (b, t, HEADS, R), jnp.bfloat16)
        paged, checked_b = {}, slice(None)
        if name.startswith("decode"):
            # fp8 pages in shuffled order, per-token scales; `latents` is the dense dequantised read
            # of the first CHECKED_SEQUENCES sequences (what the reference checks against).
            n_pages = b * s // PAGE
            page_table = jax.random.permutation(keys[1], n_pages).reshape(b, s // PAGE).astype(jnp.int32)
            pages = (jax.random.normal(keys[1], (n_pages, PAGE, R), jnp.bfloat16) * 64).astype(jnp.float8_e4m3fn)
            page_scales = jax.random.uniform(keys[2], (n_pages, PAGE), minval=0.005, maxval=0.02)
            paged = dict(page_table=page_table, latent_scales=page_scales)
            checked_b = slice(0, min(b, CHECKED_SEQUENCES))
            seen = page_table[checked_b]
            latents = (pages[seen].astype(jnp.float32) * page_scales[seen][..., None]).reshape(-1, s, R).astype(jnp.bfloat16)
        else:
            latents = jax.random.normal(keys[1], (b, s, R), jnp.bfloat16)
        indices = selection(b, t, s)
        chosen = int((indices >= 0).sum())
        flops = 4 * HEADS * R * chosen
        token_bytes = R + 4 if paged else 2 * R
        roofline = 1e3 * max(flops / MATMUL, token_bytes * chosen / HBM)
        scale = 256**-0.5
        checked = slice(max(0, t - 512), t) if t > 4096 else slice(0, t)
        want = jax.jit(lambda q, l, i: la.sparse_latent_attention_reference(q, l, i, scale=scale))(
            q[checked_b, checked].astype(jnp.float32), latents.astype(jnp.float32), indices[checked_b, checked]
        )
        source = pages if paged else latents  # what the kernel and the timed reference read
        reference_ms, timed = None, {}
        if not args.skip_reference_time and t <= 4096 and b * s <= MAX_REFERENCE_TOKENS:
            ref = jax.jit(lambda q, l, i, p: la.sparse_latent_attention_reference(q, l, i, scale=scale, **p))
            reference_ms = ms = dispatched_ms(ref, q, source, indices, paged, n=3, reps=3)
            log(f"| {name} ({b}, {t}, {s}) | reference (XLA, dense masked) | {ms:.3f} | {flops / ms / 1e9:.1f} |"
                f" {roofline:.3f} | |")
        for config in configs if la.KernelConfig() in configs else [la.KernelConfig()] + configs:
            fn = jax.jit(
                lambda q, l, i, p, config=config: la.sparse_latent_attention(
                    q, l, i, scale=scale, implementation="pallas", config=config, distinct_indices=True, **p
                )
            )
            try:
                got = fn(q, source, indices, paged)
                err = relative_error(got[checked_b, checked].astype(jnp.float32), want)
                ms = dispatched_ms(fn, q, source, indices, paged)
            except Exception as e:  # a config that does not compile: say so and go on
                log(f"| {name} ({b}, {t}, {s}) | kernel {config} | failed: {type(e).__name__}: {str(e)[:200]} | | | |")
                continue
            timed[config] = (ms, err)
            log(f"| {name} ({b}, {t}, {s}) | kernel {config} | {ms:.3f} | {flops / ms / 1e9:.1f} | {roofline:.3f} | {err:.2e} |")
        peer = jla_attention_ms(q, latents, indices, scale) if not paged else "no decode form (its queries are its keys)"
        log(f"| {name} ({b}, {t}, {s}) | jla dsa_attention | {peer if isinstance(peer, str) else f'{peer:.3f}'} | | | |")
        if la.KernelConfig() in timed:
            ms, err = timed[la.KernelConfig()]
            label = f"decode B={b} over {s} cached, fp8 paged" if paged else f"prefill B={b} T={t}"
            results.add(
                "latent_attention", label, ms, metric="median ms a call, 20 jitted calls dispatched back to back",
                baselines={"reference (dense masked scores)": reference_ms}, roofline=roofline, error=err,
                configs={config_name(config): ms for config, (ms, _) in timed.items() if config != la.KernelConfig()},
                peers={"jla dsa_attention": peer} if isinstance(peer, float) else {},
            )
        fn = jax.jit(lambda q, l, i, p: la.sparse_latent_attention(q, l, i, scale=scale, implementation="pallas", **p))
        ms = dispatched_ms(fn, q, source, indices, paged)
        log(f"| {name} ({b}, {t}, {s}) | kernel, repeats marked (sort) | {ms:.3f} | | | |")


if __name__ == "__main__":
    main()
