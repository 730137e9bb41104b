"""KDA on the GPU: our Pallas kernels against the pure-jnp reference and the peers, in one run.

Prefill: `kda_chunk_scan` (Pallas Mosaic GPU: the intra kernel, then the chain) vs fla-core 0.6.0 `chunk_kda` (Triton, torch) and
jla 0.1.0 `kda` (Pallas Mosaic GPU) at (B, T, H) = (1, 16384, 16), (1, 8192, 64), (8, 4096, 16), D = 128.
Decode: the step (conv + gate + state update) at batch 1, 64, 256 with H = 64 in both of
`kda_decode_step`'s forms (the fused Triton step, `64x4`; the Triton token vectors then the Mosaic
GPU update, `m32`) vs the state-bytes roofline and fla's `fused_recurrent_kda_fwd` (core update only,
as probe_kda_decode.py).

Errors are max|d| / max|ref| against the reference on the same bf16 inputs (the reference in fp32,
HIGHEST precision). Times are medians: ours and jla's prefill as 20 jitted calls dispatched back to
back (`dispatched_ms`; the time in a jitted loop, where XLA may hoist loop-invariant work, is printed
beside it), fla's prefill with triton.testing.do_bench. Decode steps are measured by the kernel's
own GPU time, read from a profiler trace (CUPTI) of 20 steps back to back (`kernel_ms` for ours and
XLA's in-place pass, `torch_kernel_ms` for fla): the time a decoder's step costs inside a larger
program. Beside it, the wall time per step of 20 calls unrolled in one jit (`chain_ms`) or captured
in one CUDA graph (`torch_chain_ms`), which adds the dispatch of the whole chain (~20 us a step for
ours at n = 20, ~1 us for fla's graph).

On the GPU machine, from the repository root, with the peers' wheels in .peers/:
    python3 -m pip install -q --no-index --no-deps --target .peers-site .peers/*.whl
    PYTHONPATH=$PWD:$PWD/.peers-site python3 bench/kda.py
"""

import argparse
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import decode_fused_triton, decode_update_mosaic, kda, prefill_intra_mosaic

PREFILL_SHAPES = [(1, 16384, 16, 128), (1, 8192, 64, 128), (8, 4096, 16, 128)]
DECODE_BATCHES = [1, 64, 256]
CONFIGS = {  # the serial chain's options (prefill_chain_mosaic.chunk_scan): value columns per program, buffering
    "default": {},
    "v16": {"block_v": 16},
    "v32": {"block_v": 32},  # 32 columns, u and A_qk u in two slots: the default in one wave
    "o3": {"o_products": 3},  # q_w S in three bf16 products (the default for fp32 o; bf16 o takes 2)
    "o1": {"o_products": 1},  # q_w S as one bf16 product
    "mc": {"multicast": True},  # a head's value blocks as one cluster, sharing their tiles by TMA multicast
    "mc0": {"multicast": False},  # (the default: multicast when the chain's grid fits in one wave)
    "v16mc0": {"block_v": 16, "multicast": False},
    # 64 value columns, u and A_qk u in one slot, each refetched once in registers: half the CTAs,
    # each with twice the columns per wgmma (the default over several waves)
    "v64k2": {"block_v": 64, "value_slots": 1},
    "v64k2mc0": {"block_v": 64, "value_slots": 1, "multicast": False},
}
DECODE_VARIANTS = "64x4,m32"  # see --decode-variants
ROWS = []  # (section, name, shape, error, ms, note)
INTERPRET = False  # --interpret: a CPU smoke run of this script on tiny shapes
PEERS = True


def log(*args):
    print(*args, flush=True)


def relative_error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.isfinite(got).all():
        return float("nan")
    return float(np.abs(got - want).max() / np.abs(want).max())


def per_call_ms(run, n, reps):
    """Median wall time of `run()` (n calls, finished when it returns) over `reps` runs, per call in
    ms; one run first to compile and warm up."""
    run()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / n * 1e3


def loop_ms(step, carry, n=10, reps=5):
    """Per-call time of `step`, run n times in one jitted fori_loop (dispatch amortised)."""
    loop = jax.jit(lambda c: lax.fori_loop(0, n, lambda i, c: step(c), c))
    return per_call_ms(lambda: jax.block_until_ready(loop(carry)), n, reps)


def dispatched_ms(fn, *args, n=20, reps=5):
    """Per-call time of n calls of the jitted `fn` on the same arguments, dispatched back to back
    (JAX dispatches asynchronously, so the GPU runs them one after another and the host's time is
    hidden behind calls of a millisecond or more). Each call computes everything from its inputs;
    in `loop_ms`'s fori_loop XLA may hoist whatever depends only on loop-invariant inputs (for a
    scan timed with only beta varying: the gates' cumsum)."""

    def run():  # only the last call's outputs are kept alive, as a caller's loop would
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)

    return per_call_ms(run, n, reps)


def chain_ms(call, carry, n=20, reps=7):
    """Per-call time of n calls of `call(*carry) -> carry` unrolled in one jit, the carry donated:
    back-to-back launches, without the host round trip that XLA's while loop adds per iteration
    (about 12 us on the H200, which is 6-10% of a decode step at batch 64)."""

    def chain(carry):
        for _ in range(n):
            carry = call(*carry)
        return carry

    run = jax.jit(chain, donate_argnums=0)
    state = [carry]

    def run_chain():
        state[0] = jax.block_until_ready(run(state[0]))

    return per_call_ms(run_chain, n, reps)


def kernel_ms(call, carry, name_part, n=20, per_part=None):
    """Median GPU time of the kernels named `*name_part*` in n calls of `call(*carry) -> carry`
    (name_part a tuple: the sum of each one's median, for a step of several kernels; each one's
    (name, median) appended to the list `per_part` if given)
    unrolled in one jit (the carry donated), read from a `jax.profiler` trace (CUPTI): the kernel's
    own time, without the ~0.4 ms that dispatching and waiting for the whole jitted chain add to
    `chain_ms` (~20 us a step at n = 20). A decoder's step inside a larger jitted program pays the
    kernel's time, not that."""
    import functools
    import glob
    import tempfile

    run = jax.jit(lambda c: functools.reduce(lambda c, _: call(*c), range(n), c), donate_argnums=0)
    carry = jax.block_until_ready(run(tuple(x + 0 for x in carry)))  # compile and warm up
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(run(carry))
        (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        data = jax.profiler.ProfileData.from_file(path)
    total = 0.0
    for part in (name_part,) if isinstance(name_part, str) else name_part:
        times = [
            event.duration_ns / 1e6
            for plane in data.planes if plane.name.startswith("/device:GPU")
            for line in plane.lines for event in line.events if part in event.name
        ]
        if len(times) != n:
            raise RuntimeError(f"expected {n} kernels named *{part}* in the trace, found {len(times)}")
        total += statistics.median(times)
        if per_part is not None:
            per_part.append((part, statistics.median(times)))
    return total


def torch_kernel_ms(fn, name_part, n=20):
    """Median GPU time of the CUDA kernels named `*name_part*` in n calls of `fn`, read from a
    torch.profiler trace (CUPTI), as `kernel_ms` reads ours."""
    import torch

    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    times = [e.time_range.elapsed_us() / 1e3 for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA and name_part in e.name]
    if len(times) != n:
        raise RuntimeError(f"expected {n} kernels named *{name_part}* in the trace, found {len(times)}")
    return statistics.median(times)


def prefill_inputs(b, t, h, d, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((b, t, h, d), np.float32) for _ in range(3))
    g = (-5.0 / (1.0 + np.exp(-rng.standard_normal((b, t, h, d), np.float32)))).astype(np.float32)
    beta = (1.0 / (1.0 + np.exp(-rng.standard_normal((b, t, h), np.float32)))).astype(np.float32)
    return q, k, v, g, beta


def to_jax(q, k, v, g, beta):
    bf = jnp.bfloat16
    return jnp.asarray(q, bf), jnp.asarray(k, bf), jnp.asarray(v, bf), jnp.asarray(g), jnp.asarray(beta, bf)


def check_small():
    """Ragged lengths, initial state, gates at the lower bound, T not a multiple of 64, a dense A_kk
    (one repeated key, no decay, beta = 1: where the old doubling inverse overflowed), and a bf16 o
    over more than one wave of the chain (its default there: 64 value columns, one slot of u)."""
    log("\n== small parity checks on the GPU (ours vs reference)")
    f32, bf16 = jnp.float32, jnp.bfloat16
    cases = [
        (3, 200, 4, 128, "random", f32), (2, 130, 2, 64, "lower_bound", f32), (1, 1, 1, 128, "random", f32),
        (1, 130, 2, 128, "dense", f32), (2, 130, 80, 64, "random", bf16),
    ]
    for b, t, h, d, gate, dtype in [cases[1], cases[3]] if INTERPRET else cases:
        q, k, v, g, beta = prefill_inputs(b, t, h, d, seed=t)
        if gate == "lower_bound":
            g = np.full_like(g, -5.0)
        if gate == "dense":
            k, g, beta = np.broadcast_to(k[:, :1], k.shape), np.zeros_like(g), np.ones_like(beta)
        q, k, v, g, beta = to_jax(q, k, v, g, beta)
        x = [a.astype(dtype) for a in (q, k, v, beta)]
        s0 = jax.random.normal(jax.random.key(t), (b, h, d, d))
        lengths = jnp.array([t, max(t // 3, 1), max(t - 17, 1)][:b], jnp.int32)
        o, s = kda.kda_chunk_scan(*x[:3], g, x[3], s0, lengths=lengths, implementation="pallas", interpret=INTERPRET)
        ref = [a.astype(f32) for a in x]
        o_r, s_r = kda.kda_chunk_scan_reference(*ref[:3], g, ref[3], s0, lengths=lengths)
        valid = np.arange(t)[None, :] < np.asarray(lengths)[:, None]
        e_o = relative_error(np.asarray(o.astype(f32))[valid], np.asarray(o_r)[valid])
        e_s = relative_error(s, s_r)
        name = jnp.dtype(dtype).name
        shape = f"B={b} T={t} H={h} D={d}"
        log(f"{shape} gate={gate} {name} in, lengths={list(map(int, lengths))}: o {e_o:.2e}  state {e_s:.2e}")
        ROWS.append(("check", "ours small", f"{shape} {gate}", max(e_o, e_s), float("nan"), f"{name} in"))


def bench_prefill(configs):
    log("\n== prefill")
    results = {}
    for b, t, h, d in PREFILL_SHAPES:
        shape = f"B={b} T={t} H={h}"
        np_in = prefill_inputs(b, t, h, d)
        q, k, v, g, beta = to_jax(*np_in)
        o_ref, s_ref = jax.jit(kda.kda_chunk_scan_reference)(q.astype(jnp.float32), k, v, g, beta)
        o_ref, s_ref = np.asarray(o_ref, np.float32), np.asarray(s_ref)
        floor = relative_error(np.asarray(jnp.asarray(o_ref, jnp.bfloat16), np.float32), o_ref)
        log(f"{shape}: rounding the reference output to bf16 alone gives error {floor:.2e}")
        ROWS.append(("prefill", "reference rounded to bf16 (floor for bf16 o)", shape, floor, float("nan"), ""))
        for name, cfg in configs.items():
            try:
                fn = jax.jit(lambda q, k, v, g, beta, cfg=cfg: kda.kda_chunk_scan(q, k, v, g, beta, implementation="pallas", interpret=INTERPRET, **cfg))
                t0 = time.perf_counter()
                o, s = fn(q, k, v, g, beta)
                err = max(relative_error(o, o_ref), relative_error(s, s_ref))
                compile_s = time.perf_counter() - t0

                def step(c, cfg=cfg):
                    o, s = kda.kda_chunk_scan(q, k, v, g, beta + c.astype(beta.dtype) * 0, implementation="pallas", interpret=INTERPRET, **cfg)
                    return c + o[0, 0, 0, 0].astype(jnp.float32) * 0 + s[0, 0, 0, 0] * 0

                ms = dispatched_ms(fn, q, k, v, g, beta)
                loop = loop_ms(step, jnp.float32(0))
                results[(shape, name)] = ms
                log(f"ours {name:9s} {shape}: {ms:.3f} ms ({loop:.3f} in a loop with only beta varying)  err o/state"
                    f" {relative_error(o, o_ref):.2e}/{relative_error(s, s_ref):.2e}  (first call {compile_s:.0f}s)")
                ROWS.append(("prefill", f"ours {name}", shape, err, ms, f"{loop:.3f} ms in a loop"))
            except Exception as e:
                traceback.print_exc()
                log(f"ours {name} {shape}: FAILED {type(e).__name__}")
        split_timing(q, k, v, g, beta, shape)
        if PEERS:
            peers_prefill(np_in, o_ref, s_ref, shape, b, t, h, d)
    return results


def intra_ms(q, k, v, g, beta, interpret=False):
    """Per-call time of the parallel half alone (the intra kernel): the rest of the scan's time is the
    serial chain."""
    b, t = q.shape[:2]
    lengths = jnp.full((b,), t, jnp.int32)
    fn = jax.jit(lambda q, k, v, g, beta: prefill_intra_mosaic.intra(  # as a bf16 o's scan runs it: q_w's hi half alone
        q, k, v, g, jnp.swapaxes(beta, 1, 2).astype(jnp.float32), lengths, qw_lo=False, interpret=interpret))
    return dispatched_ms(fn, q, k, v, g, beta)


def split_timing(q, k, v, g, beta, shape):
    b, t, h, d = q.shape
    try:
        ms = intra_ms(q, k, v, g, beta, INTERPRET)
        # The intra kernel reads q (twice), k, v (bf16), g (fp32), beta and writes w and q_w (bf16),
        # u, A_qk u and k exp(G_last - G) (bf16 halves), exp(G_last) once a chunk
        byts = b * t * h * (4 * 2 * d + 4 * d + 4 + 2 * 2 * d + 3 * 4 * d + 4 * d // 64)
        log(f"   intra kernel alone: {ms:.3f} ms ({byts / ms / 1e6:.0f} GB/s of its {byts / 1e9:.2f} GB)")
        ROWS.append(("prefill", "  ours: intra kernel alone", shape, float("nan"), ms, f"{byts / ms / 1e6:.0f} GB/s"))
    except Exception:
        traceback.print_exc()


def peers_prefill(np_in, o_ref, s_ref, shape, b, t, h, d):
    try:
        import torch
        import triton
        from fla.ops.kda import chunk_kda

        q, k, v, g, beta = (torch.from_numpy(x).cuda() for x in np_in)
        q, k, v, beta = q.bfloat16(), k.bfloat16(), v.bfloat16(), beta.bfloat16()
        variants = {
            "fla chunk_kda l2norm in kernel": lambda: chunk_kda(q, k, v, g, beta, scale=d**-0.5, output_final_state=True, use_qk_l2norm_in_kernel=True),
        }
        for name, fn in variants.items():
            try:
                o, s = fn()
                err = float("nan")
                if "l2norm" in name:
                    err = max(relative_error(o.float().cpu().numpy(), o_ref), relative_error(s.float().cpu().numpy(), s_ref))
                ms = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
                log(f"{name} {shape}: {ms:.3f} ms  err {err:.2e}")
                ROWS.append(("prefill", name, shape, err, ms, ""))
            except Exception as e:
                traceback.print_exc()
                log(f"{name} {shape}: FAILED {type(e).__name__}")
        del q, k, v, g, beta
        torch.cuda.empty_cache()
    except Exception:
        traceback.print_exc()
    try:
        from jla.ops.mosaic_gpu.kda import kda as jla_kda

        q, k, v, g, beta = to_jax(*np_in)
        for name, kk, l2 in [("jla kda l2norm", k, True)]:
            try:
                fn = jax.jit(lambda q, k, v, g, b, l2=l2: jla_kda(q, k, v, g, b, scale=d**-0.5, output_final_state=True, use_qk_l2norm=l2))
                o, s = fn(q, kk, v, g, beta)
                err = max(relative_error(o, o_ref), relative_error(s, s_ref)) if l2 else float("nan")

                def step(c, l2=l2, kk=kk):
                    o, s = jla_kda(q, kk, v, g, beta + c.astype(beta.dtype) * 0, scale=d**-0.5, output_final_state=True, use_qk_l2norm=l2)
                    return c + o[0, 0, 0, 0].astype(jnp.float32) * 0 + s[0, 0, 0, 0] * 0

                ms = dispatched_ms(fn, q, kk, v, g, beta)
                loop = loop_ms(step, jnp.float32(0))
                log(f"{name} {shape}: {ms:.3f} ms ({loop:.3f} in a loop with only beta varying)  err {err:.2e}")
                ROWS.append(("prefill", name, shape, err, ms, f"{loop:.3f} ms in a loop"))
            except Exception as e:
                traceback.print_exc()
                log(f"{name} {shape}: FAILED {type(e).__name__}")
    except Exception:
        traceback.print_exc()


def bench_decode(hbm, variants, d=128):
    h, d = (2, 64) if INTERPRET else (64, d)
    log(f"\n== decode step, H={h} D={d}")
    for b in DECODE_BATCHES:
        x = kda.random_decode_inputs(jax.random.key(0), b, h, d, state_scale=0.01)
        ref = kda.kda_decode_step_reference(**x, lower_bound=-5.0)
        fixed = {k_: v_ for k_, v_ in x.items() if k_ not in ("conv_state", "state")}
        roof = 2 * b * h * d * d * 4 / hbm * 1e3

        def report(name, err, kernel, wall, note=""):
            kernel_note = "" if kernel is None else f"kernel {kernel:.4f} ms ({roof / kernel * 100:.0f}% of roofline); "
            log(f"{name} B={b}: {kernel_note}{wall:.4f} ms per step by the wall ({roof / wall * 100:.0f}%) {note}")
            ROWS.append(("decode", name, f"B={b}", err, wall if kernel is None else kernel,
                         f"{kernel_note}{wall:.4f} ms by the wall ({roof / wall * 100:.0f}%) {note}"))

        # XLA's own elementwise pass over the state (read and written in place, the same bytes as the
        # step's state traffic), chained and donated the same way; the barrier keeps XLA from fusing
        # the 20 passes into one.
        xla_pass = lambda state: (jax.lax.optimization_barrier(state * 0.999 + 1e-6),)  # noqa: E731
        report("XLA elementwise pass over the state", float("nan"),
               None if INTERPRET else kernel_ms(xla_pass, (x["state"],), "fusion"), chain_ms(xla_pass, (x["state"] + 0,)))
        for variant in variants:
            if variant[0] == "mosaic":
                block_v, token_warps = variant[1:]
                name = f"ours kda_decode_step (Triton token vectors, Mosaic GPU update) block_v={block_v} token warps={token_warps}"
                kernels = ("kda_decode_token_vectors", "kda_decode_update")

                def call(conv_state, state, block_v=block_v, token_warps=token_warps):
                    return decode_update_mosaic.two_kernel_decode_step(
                        conv_state=conv_state, state=state, **fixed, lower_bound=-5.0, block_v=block_v,
                        token_warps=token_warps, interpret=INTERPRET,
                    )
            else:
                block_v, warps = variant  # decode_step takes min(block_v, d)
                name = f"ours kda_decode_step (Triton) block_v={block_v} warps={warps}"
                kernels = "kda_decode_step"

                def call(conv_state, state, block_v=block_v, warps=warps):
                    return decode_fused_triton.fused_decode_step(
                        conv_state=conv_state, state=state, **fixed, lower_bound=-5.0, block_v=block_v, num_warps=warps,
                        interpret=INTERPRET,
                    )

            try:
                got = jax.jit(call)(x["conv_state"], x["state"])
                err = max(relative_error(a.astype(jnp.float32), r.astype(jnp.float32)) for a, r in zip(got, ref))
                step = lambda *carry, call=call: call(*carry)[1:]  # noqa: E731
                carry = (x["conv_state"], x["state"])
                per_kernel = []
                kernel = None if INTERPRET else kernel_ms(step, carry, kernels, per_part=per_kernel)
                report(name, err, kernel, chain_ms(step, tuple(a + 0 for a in carry)),
                       " + ".join(f"{part} {ms:.4f}" for part, ms in per_kernel) if len(per_kernel) > 1 else "")
            except Exception:
                traceback.print_exc()
                log(f"{name} B={b}: FAILED")
    if not PEERS:
        return
    try:
        import torch
        import triton
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

        for b in DECODE_BATCHES:
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
            gg = -5.0 * torch.sigmoid(torch.randn(b, 1, h, d, device="cuda", generator=gen))
            beta = torch.sigmoid(torch.randn(b, 1, h, device="cuda", generator=gen)).bfloat16()
            h0 = torch.randn(b, h, d, d, device="cuda", dtype=torch.float32, generator=gen) * 0.01
            fn = lambda: fused_recurrent_kda_fwd(  # noqa: E731
                q, k, v, gg, beta, initial_state=h0, output_final_state=True, inplace_final_state=True, use_qk_l2norm_in_kernel=True
            )
            per_call = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
            roof = 2 * b * h * d * d * 4 / hbm * 1e3
            kernel = torch_kernel_ms(fn, "fused_recurrent_kda")
            ms = torch_chain_ms(fn)
            log(f"fla fused_recurrent_kda_fwd B={b}: kernel {kernel:.4f} ms ({roof / kernel * 100:.0f}% of roofline);"
                f" {ms:.4f} ms per step in a CUDA graph of 20 ({roof / ms * 100:.0f}%); {per_call:.4f} ms by do_bench")
            ROWS.append(("decode", "fla fused_recurrent_kda_fwd (core only)", f"B={b}", float("nan"), kernel,
                         f"kernel {roof / kernel * 100:.0f}%; {ms:.4f} ms per step in a CUDA graph ({roof / ms * 100:.0f}%);"
                         f" {per_call:.4f} ms by do_bench"))
    except Exception:
        traceback.print_exc()


def torch_chain_ms(fn, n=20, reps=7):
    """Per-call time of n calls of `fn` captured back to back in one CUDA graph: the same measure as
    `chain_ms` for ours, the steady state of a decoder's step after step (do_bench times one call
    at a time, each after flushing the L2)."""
    import torch

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()

    def replay():
        graph.replay()
        torch.cuda.synchronize()

    return per_call_ms(replay, n, reps)


def decode_variant(text):
    """'64x4' -> (64, 4): the fused Triton step; 'm32w2' -> ('mosaic', 32, 2): the two-kernel step."""
    if text.startswith("m"):
        block_v, _, warps = text[1:].partition("w")
        return "mosaic", int(block_v), int(warps or 4)
    return tuple(int(x) for x in text.split("x"))


HBM = 4.3e12  # bytes/s, read + write, measured on this machine (KINDS.md): the roofline's bandwidth


def main():
    global INTERPRET, PREFILL_SHAPES, DECODE_BATCHES, PEERS
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="default", help="scan configs to time, among: " + ",".join(CONFIGS))
    parser.add_argument("--skip", default="", help="comma list of sections to skip: check,prefill,decode")
    parser.add_argument("--interpret", action="store_true", help="CPU smoke run: tiny shapes, Pallas interpreter")
    parser.add_argument("--no-peers", action="store_true", help="time our kernels only")
    parser.add_argument("--prefill-shapes", default=";".join(",".join(map(str, x[:3])) for x in PREFILL_SHAPES),
                        help="B,T,H;B,T,H;... at D = 128")
    parser.add_argument("--decode-batches", default=",".join(map(str, DECODE_BATCHES)), help="decode batch sizes, at H = 64")
    parser.add_argument("--decode-dim", type=int, default=128, help="decode head dim dk = dv")
    parser.add_argument("--decode-variants", default=DECODE_VARIANTS,
                        help="decode launch shapes: value columns x warps (the fused Triton step), or mN[wW] (Triton token"
                             " vectors in W warps, default 4, then the Mosaic GPU update in N columns)")
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    PEERS = not args.no_peers
    PREFILL_SHAPES = [(*map(int, shape.split(",")), 128) for shape in args.prefill_shapes.split(";")]
    DECODE_BATCHES = [int(b) for b in args.decode_batches.split(",")]
    if args.interpret:
        INTERPRET, PREFILL_SHAPES, DECODE_BATCHES = True, [(1, 128, 2, 64)], [2]
    log("jax", jax.__version__, jax.devices())
    hbm = HBM
    sections = {
        "check": check_small,
        "decode": lambda: bench_decode(hbm, [decode_variant(v) for v in args.decode_variants.split(",")], args.decode_dim),
        "prefill": lambda: bench_prefill({name: CONFIGS[name] for name in args.configs.split(",")}),
    }
    for name, run in sections.items():
        if name not in skip:
            started = time.perf_counter()
            run()
            log(f"({name}: {time.perf_counter() - started:.0f} s, compilation included)")  # for planning device calls
    log("\n| section | implementation | shape | error | ms | note |\n| --- | --- | --- | --- | --- | --- |")
    for section, name, shape, err, ms, note in ROWS:
        log(f"| {section} | {name} | {shape} | {err:.1e} | {ms:.4f} | {note} |")


if __name__ == "__main__":
    main()
