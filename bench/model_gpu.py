"""The whole model on the GPU: parity with transformers' goldens and end-to-end timings.

    python -m bench.model_gpu [GOLDENS_DIR] [--mlps dense,moe]   # 1. (with GOLDENS_DIR) and 2.
    python -m bench.model_gpu --long 16384,32768     # 3. alone
    python -m bench.model_gpu --decode-profile [--mlps dense] [--kernels-only]   # 4. alone
    python -m bench.model_gpu --long-profile 16384    # 5. alone
    python -m bench.model_gpu --command-buffers [--mlps dense]   # 6. alone
    python -m bench.model_gpu --fp8 [--mlps moe]       # 7. alone

1. The shipped tiny checkpoint, fp32, through the pure-jnp references: logits against the
   transformers goldens; greedy generation against transformers' cached generation. (Its KDA head
   dim, 32, is below the chunked scan's (64, 128), so the kernels are checked on the wider config.)
2. A wider config (hidden 2048, 4 layers: 3 KDA + 1 DSA, 32 KDA heads of dim 128, 16 DSA heads;
   a dense MLP, then MoEs of 64 experts (8 a token, width 1024); random bf16 params): forward of
   1 x 4096 tokens and a decode step at batch 8 over 4096 cached tokens, median ms, and the Pallas
   path's logits against the references' (max|d| / max|ref|). The Pallas path runs every kernel:
   the KDA scan and decode step, the MoE's grouped GEMM and DSA's latent attention.
3. With --long: that MoE config's forward over one long sequence through the kernels alone.
4. With --decode-profile: where the wider configs' decode step (batch 8, 4096 cached) spends its
   time, for both implementations: the wall time of `decode_step` (host checks included) and of
   `decode_unchecked`, the GPU time of one step (the sum of its kernels in a profiler trace) and
   its costliest kernels.
5. With --long-profile T: the kernels of the MoE config's forward over one sequence of T tokens
   (through the kernels alone), costliest first, with each one's HLO result and op.
6. With --command-buffers: the kernels path's decode step compiled under each of
   `COMMAND_BUFFER_SETTINGS` (XLA's CUDA graphs), wall and GPU time a step.
7. With --fp8: the wider configs with the release's converted linears in block-scaled FP8
   (`init_params(..., fp8=True)`: W8A8 through the FP8 kernels) beside the same params dequantized
   to bf16: forward 1 x 4096 and the decode step at batch 8 over 4096 cached through the kernels,
   median ms, and the FP8 logits against the bf16 ones.

Rows for bench/results.jsonl (with --results, default bench/results.jsonl): 2. as op `model_forward`
and `model_decode` (ours: the kernels; baseline: the references), 3. as `model_forward`, 4. as
`model_decode` (`decode_step` and `decode_unchecked` wall, with the GPU ms a step beside them), 7.
as `model_forward_fp8` and `model_decode_fp8` (baseline: the same params in bf16).
"""

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import glm5next_jax
from bench.common import ROOT, Results, add_results_argument, fusion_sources, median_ms, trace_kernels


def rel(a, b, where=None):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if where is not None:
        a, b = a[where], b[where]
    return float(np.abs(a - b).max() / np.abs(b).max())


def parity(goldens):
    config, params = glm5next_jax.load_checkpoint(os.path.join(ROOT, "checkpoints", "glm5next-tiny"), "float32")
    rows = []
    for case in ("tiny_sparse", "tiny_left_pad", "tiny_right_pad"):
        data = np.load(os.path.join(goldens, "cases", case + ".npz"))
        real = data["mask"].astype(bool)
        logits = glm5next_jax.forward(params, config, data["ids"], data["mask"], implementation="reference")
        rows.append((case, "reference", rel(logits, data["logits"], real)))
    data = np.load(os.path.join(goldens, "cases", "generate.npz"))
    prompts = [r[m.astype(bool)].tolist() for r, m in zip(data["ids"], data["mask"])]
    out = glm5next_jax.generate(params, config, prompts, 32, latent_dtype="float32", implementation="reference")
    same = int((np.array(out.tokens) == data["new_tokens"]).sum())
    return rows, same


def agreement(a, b):
    """Share of positions whose top logit is the same token."""
    return float((np.asarray(a).argmax(-1) == np.asarray(b).argmax(-1)).mean())


def wider_config(mlps):
    """mlps "dense": every MLP dense; "moe": a dense MLP, then MoEs."""
    moe = dict(mlp_layer_types=("dense",) + ("sparse",) * 3, n_routed_experts=64, moe_intermediate_size=1024)
    return glm5next_jax.Config(
        vocab_size=32768, hidden_size=2048, num_hidden_layers=4, intermediate_size=6144,
        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=768, kv_lora_rank=512,
        index_topk=2048, index_kpool=4, linear_num_heads=32,
        **(moe if mlps == "moe" else dict(mlp_layer_types=("dense",) * 4)),
    )


def prefilled_cache(params, config):
    """A cache of batch 8 holding 4096 random tokens a sequence, and the next tokens to decode."""
    cache = glm5next_jax.init_cache(config, 8, 4096 + 64, dtype="bfloat16", latent_dtype="float8_e4m3fn")
    prompt = jax.random.randint(jax.random.key(2), (8, 4096), 2, config.vocab_size)
    _, cache = glm5next_jax.prefill(params, config, prompt, None, cache)
    return cache, np.arange(8, dtype=np.int32) + 5


def timings(mlps):
    """Rows (workload, kernels, ms, max|d|/max|ref|, top-1 agreement) against the references, for
    `wider_config(mlps)`, yielded as each is measured (a device call's time limit may cut the rest:
    the reference forward alone compiles for minutes)."""
    config = wider_config(mlps)
    params = glm5next_jax.init_params(config, jax.random.key(0), "bfloat16")
    ids = jax.random.randint(jax.random.key(1), (1, 4096), 2, config.vocab_size)
    logits = {}
    for impl in ("reference", None):
        ms = median_ms(lambda: glm5next_jax.forward(params, config, ids, implementation=impl), reps=5)
        logits[impl] = glm5next_jax.forward(params, config, ids, implementation=impl)
        yield (f"{mlps}: forward 1x4096 bf16", impl or "auto (pallas)", ms, rel(logits[impl], logits["reference"]),
               agreement(logits[impl], logits["reference"]))
    cache, tokens = prefilled_cache(params, config)
    for impl in ("reference", None):
        # The first step from the prefilled cache gives the logits compared; the timed steps go on.
        logits[impl], _ = glm5next_jax.decode_step(params, config, tokens, jax.tree.map(jnp.copy, cache), implementation=impl)
        state = {"cache": jax.tree.map(jnp.copy, cache)}

        def step(impl=impl):
            out, state["cache"] = glm5next_jax.decode_step(params, config, tokens, state["cache"], implementation=impl)
            return out

        yield (f"{mlps}: decode step, batch 8, 4096 cached", impl or "auto (pallas)", median_ms(step),
               rel(logits[impl], logits["reference"]), agreement(logits[impl], logits["reference"]))


def fp8_timings(mlps):
    """Rows (workload, form, ms, max|d|/max|ref| and top-1 agreement against the bf16 form) for
    `wider_config(mlps)` in FP8 and in bf16 (the FP8 values dequantized), through the kernels."""
    config = wider_config(mlps)
    fp8 = glm5next_jax.init_params(config, jax.random.key(0), "bfloat16", fp8=True)
    forms = {"bf16": glm5next_jax.params.dequantize_params(fp8, config, "bfloat16"), "fp8": fp8}
    ids = jax.random.randint(jax.random.key(1), (1, 4096), 2, config.vocab_size)
    logits = {}
    for form, params in forms.items():
        ms = median_ms(lambda params=params: glm5next_jax.forward(params, config, ids), reps=5)
        logits[form] = glm5next_jax.forward(params, config, ids)
        yield (f"{mlps} MLPs, forward 1 x 4096", form, ms, rel(logits[form], logits["bf16"]),
               agreement(logits[form], logits["bf16"]))
    cache, tokens = prefilled_cache(forms["bf16"], config)
    for form, params in forms.items():
        logits[form], _ = glm5next_jax.decode_step(params, config, tokens, jax.tree.map(jnp.copy, cache))
        state = {"cache": jax.tree.map(jnp.copy, cache)}

        def step(params=params):
            out, state["cache"] = glm5next_jax.decode_step(params, config, tokens, state["cache"])
            return out

        yield (f"{mlps} MLPs, batch 8 over 4096 cached: decode_step", form, median_ms(step),
               rel(logits[form], logits["bf16"]), agreement(logits[form], logits["bf16"]))


def long_forward(tokens):
    """The MoE config's forward over one sequence of `tokens` through the kernels alone (the
    references' dense DSA scores are quadratic in it): median ms and tokens per second."""
    config = wider_config("moe")
    params = glm5next_jax.init_params(config, jax.random.key(0), "bfloat16")
    ids = jax.random.randint(jax.random.key(1), (1, tokens), 2, config.vocab_size)
    ms = median_ms(lambda: glm5next_jax.forward(params, config, ids), reps=3)
    logits = glm5next_jax.forward(params, config, ids)
    return ms, bool(jnp.isfinite(logits).all())


def long_profile(tokens, top=25):
    """The MoE config's forward over one sequence of `tokens`, kernels alone, from a profiler trace
    of 3 calls: (GPU ms a call, kernels a call, [(ms, launches, name, HLO result and op)] costliest
    first)."""
    from glm5next_jax import model

    config = wider_config("moe")
    params = glm5next_jax.init_params(config, jax.random.key(0), "bfloat16")
    ids = jax.random.randint(jax.random.key(1), (1, tokens), 2, config.vocab_size)
    per_name, launches = trace_kernels(lambda: glm5next_jax.forward(params, config, ids), 3)
    sources = fusion_sources(model._forward.lower(params, config, ids, jnp.ones(ids.shape, jnp.bool_)).compile().as_text())
    ranked = sorted(((ms, launches[name], name, sources.get(name, "")) for name, ms in per_name.items()), reverse=True)
    return sum(per_name.values()), sum(launches.values()), ranked[:top]


def decode_profile(mlps, impls=("reference", None), top=12):
    """Wall ms of `decode_step` and of `decode_unchecked`, and the kernels of one step from a
    `jax.profiler` trace (CUPTI) of `steps` steps, for each of `impls`: (implementation, wall, wall
    unchecked, GPU ms a step, kernels a step, [(ms a step, launches a step, name, HLO result and op)]
    costliest first)."""
    from glm5next_jax import inference

    config = wider_config(mlps)
    params = glm5next_jax.init_params(config, jax.random.key(0), "bfloat16")
    cache, tokens = prefilled_cache(params, config)
    device_tokens = jnp.asarray(tokens)
    results, steps = [], 10
    for impl in impls:
        state = {"cache": jax.tree.map(jnp.copy, cache)}

        def checked(impl=impl):
            out, state["cache"] = glm5next_jax.decode_step(params, config, tokens, state["cache"], implementation=impl)
            return out

        def unchecked(impl=impl):
            out, state["cache"] = inference.decode_unchecked(params, config, device_tokens, state["cache"], impl)
            return out

        wall, wall_unchecked = median_ms(checked), median_ms(unchecked)
        per_name, launches = trace_kernels(unchecked, steps)
        hlo = inference._decode.lower(params, config, device_tokens, state["cache"], impl).compile().as_text()
        sources = fusion_sources(hlo)
        ranked = sorted(((ms, launches[name], name, sources.get(name, "")) for name, ms in per_name.items()), reverse=True)
        results.append((impl or "auto (pallas)", wall, wall_unchecked, sum(per_name.values()),
                        sum(launches.values()), ranked[:top]))
    return results


def decode_command_buffers(mlps, settings, steps=10):
    """The kernels path's decode step (batch 8, 4096 cached) compiled once per XLA setting of
    `settings` ({name: compiler options}, e.g. {"xla_gpu_enable_command_buffer": ""}: CUDA graphs
    off) in one process, yielded as measured: (name, compile s, median wall ms a step, GPU ms a step,
    kernels a step, max |d| of the first step's logits against the first setting's)."""
    from glm5next_jax import inference

    config = wider_config(mlps)
    params = glm5next_jax.init_params(config, jax.random.key(0), "bfloat16")
    cache, tokens = prefilled_cache(params, config)
    tokens = jnp.asarray(tokens)
    first = None
    for name, options in settings.items():
        start = time.perf_counter()
        compiled = inference._decode.lower(params, config, tokens, cache).compile(compiler_options=options)
        compile_s = time.perf_counter() - start
        logits, _ = compiled(params, tokens, jax.tree.map(jnp.copy, cache))
        first = logits if first is None else first
        state = {"cache": jax.tree.map(jnp.copy, cache)}

        def step(compiled=compiled):
            out, state["cache"] = compiled(params, tokens, state["cache"])
            return out

        wall = median_ms(step, reps=20)
        per_name, launches = trace_kernels(step, steps)
        yield (name, compile_s, wall, sum(per_name.values()), sum(launches.values()),
               float(jnp.abs(logits.astype(jnp.float32) - first.astype(jnp.float32)).max()))


COMMAND_BUFFER_SETTINGS = {
    "XLA's default": {},
    "command buffers off": {"xla_gpu_enable_command_buffer": ""},
    "+ while, conditional; graphs from 1 op": {
        "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL",
        "xla_gpu_graph_min_graph_size": 1,
    },
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("goldens", nargs="?", help="a goldens folder (its cases/): the tiny checkpoint's parity first")
    parser.add_argument("--mlps", default="dense,moe", help="the wider configs to run: dense, moe or both")
    parser.add_argument("--long", help="only the MoE config's forward over these sequence lengths, comma-separated")
    parser.add_argument("--decode-profile", action="store_true", help="only the decode step's wall and kernels")
    parser.add_argument("--kernels-only", action="store_true", help="with --decode-profile: not the references' step")
    parser.add_argument("--long-profile", type=int, metavar="T", help="only the kernels of the forward over T tokens")
    parser.add_argument("--command-buffers", action="store_true", help="only the decode step under XLA's CUDA graphs")
    parser.add_argument("--fp8", action="store_true", help="only the FP8 configs beside bf16")
    add_results_argument(parser)
    args = parser.parse_args()
    print("devices:", jax.devices(), "XLA_FLAGS:", os.environ.get("XLA_FLAGS", ""))
    mlps_configs = tuple(args.mlps.split(","))
    results = Results(args.results)
    workload = "batch 8 over 4096 cached"
    if args.decode_profile:
        impls = (None,) if args.kernels_only else ("reference", None)
        for mlps in mlps_configs:
            measured = {}
            for impl, wall, unchecked, gpu, kernels, ranked in decode_profile(mlps, impls):
                measured[impl] = (wall, unchecked, gpu, kernels)
                print(f"\n{mlps} MLPs, {impl}: decode_step {wall:.3f} ms wall, decode_unchecked {unchecked:.3f} ms, "
                      f"GPU {gpu:.3f} ms in {kernels:.0f} kernels a step")
                print("| ms a step | launches a step | kernel | result, op (HLO) |\n|---|---|---|---|")
                for ms, n, name, source in ranked:
                    print(f"| {ms:.4f} | {n:.0f} | {name[:110]} | {source} |")
            ours, ref = measured.get("auto (pallas)"), measured.get("reference")
            if ours:
                for i, call in enumerate(("decode_step", "decode_unchecked")):
                    results.add(
                        "model_decode", f"{mlps} MLPs, {workload}: {call}", ours[i], metric="median wall ms a step (10 steps)",
                        baselines={"references": ref[i] if ref else None}, gpu_ms=ours[2], kernels=ours[3],
                        reference_gpu_ms=ref[2] if ref else None,
                    )
        return
    if args.command_buffers:
        for mlps in mlps_configs:
            print(f"\n{mlps} MLPs, kernels path, decode step batch 8 over 4096 cached, by XLA setting")
            print("| setting | compile s | median wall ms a step | GPU ms a step | kernels a step |"
                  " logits max |d| vs the first |")
            print("|---|---|---|---|---|---|", flush=True)
            for name, compile_s, wall, gpu, kernels, err in decode_command_buffers(mlps, COMMAND_BUFFER_SETTINGS):
                print(f"| {name} | {compile_s:.0f} | {wall:.3f} | {gpu:.3f} | {kernels:.0f} | {err:.2e} |", flush=True)
        return
    if args.fp8:
        print("\n| workload | form | median ms | logits max|d|/max|ref| vs bf16 | top-1 agreement |\n|---|---|---|---|---|")
        for mlps in mlps_configs:
            bf16_ms = {}
            for name, form, ms, err, same in fp8_timings(mlps):
                print(f"| {name} | {form} | {ms:.3f} | {err:.2e} | {same:.4f} |", flush=True)
                if form == "bf16":
                    bf16_ms[name] = ms
                    continue
                forward = "forward" in name
                results.add(
                    "model_forward_fp8" if forward else "model_decode_fp8", name, ms,
                    metric=f"median wall ms a {'call (5 calls)' if forward else 'step (10 steps)'}",
                    baselines={"bf16": bf16_ms.get(name)}, logits_difference=err, top1_agreement=same,
                )
        return
    if args.long_profile:
        gpu, kernels, ranked = long_profile(args.long_profile)
        print(f"\nmoe config, forward 1 x {args.long_profile}, kernels: GPU {gpu:.2f} ms in {kernels:.0f} kernels a call")
        print("| ms a call | launches a call | kernel | result, op (HLO) |\n|---|---|---|---|")
        for ms, n, name, source in ranked:
            print(f"| {ms:.4f} | {n:.0f} | {name[:110]} | {source} |")
        return
    if args.long:  # only the long forwards
        print("\n| moe config: forward 1 x T, kernels | median ms | tokens / s | logits finite |")
        print("|---|---|---|---|")
        for tokens in map(int, args.long.split(",")):
            ms, finite = long_forward(tokens)
            print(f"| T = {tokens} | {ms:.1f} | {tokens / ms * 1e3:.0f} | {finite} |", flush=True)
            if finite:
                results.add("model_forward", f"moe MLPs, forward 1 x {tokens}", ms, metric="median wall ms a call (3 calls)")
        return
    if args.goldens:
        rows, same = parity(args.goldens)
        print("\n| case | kernels | max|d|/max|ref| vs transformers fp32 |")
        print("|---|---|---|")
        for case, impl, err in rows:
            print(f"| {case} | {impl} | {err:.2e} |")
        print(f"\ngreedy generation, 2 x 32 tokens: {same}/64 identical to transformers' cached generation")
    print("\n| workload | kernels | median ms | logits max|d|/max|ref| vs the references | top-1 agreement |")
    print("|---|---|---|---|---|")
    for mlps in mlps_configs:
        reference_ms = {}
        for name, impl, ms, err, same in timings(mlps):
            print(f"| {name} | {impl} | {ms:.2f} | {err:.2e} | {same:.4f} |", flush=True)
            if impl == "reference":
                reference_ms[name] = ms
                continue
            forward = "forward" in name
            results.add(
                "model_forward" if forward else "model_decode",
                f"{mlps} MLPs, forward 1 x 4096" if forward else f"{mlps} MLPs, {workload}: decode_step", ms,
                metric=f"median wall ms a {'call (5 calls)' if forward else 'step (10 steps)'}",
                baselines={"references": reference_ms.get(name)}, logits_difference=err, top1_agreement=same,
            )


if __name__ == "__main__":
    main()
