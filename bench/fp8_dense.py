"""Dense W8A8 projections on the GPU: the block-scaled FP8 linear (rows quantized in 1 x 128 groups,
then `moe_gemm.grouped_matmul_fp8` over one group) against XLA at the shapes of GLM-5.3's converted
dense projections (DSA's q_a, q_b and kv_a, the shared expert, the dense MLPs) for decode (64 tokens)
and prefill (8192 tokens).

    python -m bench.fp8_dense [--tokens 64,8192] [--stages 3,4] [--results bench/results.jsonl]

Ours is the whole linear from bf16 rows: their quantization and the GEMM (the kernel alone is in
the row as `kernel`). Baselines: XLA's bf16 dot on the dequantized weights, and XLA dequantizing the
fp8 weights inside the jitted call before that dot (what a block-scaled checkpoint costs without a
kernel). Peer: XLA's dot on the fp8 operands with one scale per tensor (cuBLASLt; not block-scaled,
its speed is the ceiling of an FP8 product here). Times are medians of 20 jitted calls dispatched
back to back; the roofline is max(FLOPs / `common.FP8_MATMUL`, fp8 bytes / `common.HBM`); the
error is max|d| / max|ref| against the dequantized operands' fp32 product. Rows: op
`fp8_dense_gemm`, one per projection and token count.
"""

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import FP8_MATMUL, HBM, Results, add_results_argument, dispatched_ms, log, relative_error
from pallas_kernels import block_fp8, moe_gemm

PROJECTIONS = {  # name: (K, N), torch's [out = N, in = K]
    "dsa q_a": (4096, 1536),
    "dsa q_b": (1536, 16384),
    "dsa kv_a": (4096, 512),
    "shared expert gate_up": (4096, 4096),
    "shared expert down": (2048, 4096),
    "dense mlp gate_up": (4096, 24576),
    "dense mlp down": (12288, 4096),
}


def fp8_linear(x, w, w_s, *, implementation, config):
    """x [M, K] bf16 through the block-scaled weights w [N, K] e4m3 (w_s [N / 128, K / 128])."""
    x_q, x_s = block_fp8.quantize_rows(x)
    return moe_gemm.matmul_fp8(x_q, x_s, w, w_s, implementation=implementation, config=config)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="64,8192")
    parser.add_argument("--stages", default="", help="more pipeline depths of the kernel, comma-separated")
    add_results_argument(parser)
    args = parser.parse_args()
    results = Results(args.results)
    log("jax", jax.__version__, jax.devices())
    log("| tokens | projection | implementation | ms | TFLOP/s | x roofline | error |")
    log("| --- | --- | --- | --- | --- | --- | --- |")
    key = jax.random.key(3)
    for name, (k, n) in PROJECTIONS.items():
        kw, kx = jax.random.split(jax.random.fold_in(key, k * n))
        w, w_s = jax.jit(block_fp8.quantize_blocks)(jax.random.normal(kw, (n, k), jnp.float32) * 0.02)
        w_deq = block_fp8.dequantize_blocks(w, w_s)
        w_bf16 = w_deq.T.astype(jnp.bfloat16)
        for tokens in [int(t) for t in args.tokens.split(",")]:
            x = jax.random.normal(jax.random.fold_in(kx, tokens), (tokens, k), jnp.bfloat16)
            x_q, x_s = block_fp8.quantize_rows(x)
            want = np.asarray(jnp.dot(block_fp8.dequantize_rows(x_q, x_s), w_deq.T, precision="highest"))
            flops = 2 * tokens * k * n
            roof = max(flops / FP8_MATMUL, (n * k + n * k // 128**2 * 4 + tokens * (2 * k + 2 * n)) / HBM) * 1e3
            implementation = "pallas" if jax.default_backend() == "gpu" else "reference"
            default = moe_gemm.Fp8GemmConfig(block_rows=128 if tokens >= 128 else 64)
            configs = {dataclasses.replace(default, stages=s)
                       for s in {default.stages, *(int(v) for v in args.stages.split(",") if v)}}
            runs = {}
            for config in sorted(configs, key=lambda c: c.stages):
                f = jax.jit(functools.partial(fp8_linear, implementation=implementation, config=config))
                runs[f"ours ({implementation} {config.block_rows}x{config.stages})"] = functools.partial(f, x, w, w_s)
            m_pad = -(-tokens // 64) * 64
            kernel_only = jax.jit(functools.partial(
                moe_gemm.grouped_matmul_fp8, implementation=implementation,
                config=moe_gemm.Fp8GemmConfig(block_rows=64, stages=default.stages)))
            x_qp = jnp.pad(x_q, [(0, m_pad - tokens), (0, 0)])
            x_sp = jnp.pad(x_s, [(0, m_pad - tokens), (0, 0)], constant_values=1.0)
            tiles = jnp.zeros((m_pad // 64,), jnp.int32), jnp.int32(m_pad // 64)
            baselines = {
                "kernel (64-row tiles)": functools.partial(kernel_only, x_qp, x_sp, w[None], w_s[None], *tiles),
                "xla bf16 dot": functools.partial(jax.jit(jnp.dot), x, w_bf16),
                "xla dequantize then bf16 dot": functools.partial(
                    jax.jit(lambda x, w, s: jnp.dot(x, block_fp8.dequantize_blocks(w, s).T.astype(jnp.bfloat16))), x, w, w_s),
            }
            peers = {"xla fp8 dot, one scale a tensor": functools.partial(jax.jit(lambda a, b: jax.lax.dot_general(
                a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)), x_q, w)}
            timed = {}
            for label, call in {**runs, **baselines, **peers}.items():
                try:
                    out = jax.block_until_ready(call())
                    err = relative_error(np.asarray(out[:tokens], np.float32), want) if label in runs else None
                    timed[label] = ms = dispatched_ms(call)
                    err_text = "" if err is None else f"{err:.1e}"
                    log(f"| {tokens} | {name} | {label} | {ms:.4f} | {flops / ms / 1e9:.0f} | {ms / roof:.2f} | {err_text} |")
                    if label in runs and label.startswith("ours") and "error" not in timed:
                        timed["error"] = err
                except Exception as e:
                    log(f"| {tokens} | {name} | {label} | failed: {type(e).__name__}: {str(e)[:160]} | | | |")
            log(f"| {tokens} | {name} | roofline | {roof:.4f} | | 1.00 | |")
            ours = [label for label in runs if label in timed]
            if ours:
                best = min(ours, key=timed.get)
                results.add(
                    "fp8_dense_gemm", f"{name} K={k} N={n}, {tokens} tokens", timed[best],
                    metric="median ms a call, 20 jitted calls dispatched back to back",
                    peers={label: timed.get(label) for label in peers},
                    baselines={label: timed.get(label) for label in baselines},
                    roofline=roof, implementation=best, error=timed.get("error"),
                    configs={label: timed[label] for label in ours},
                )


if __name__ == "__main__":
    main()
