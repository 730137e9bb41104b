"""KDA on the GPU: our Pallas kernels against the pure-jnp reference and the peers, in one run.

    python -m bench.kda [--configs default,v32] [--skip check,prefill,decode] [--no-peers]
        [--prefill-shapes "1,16384,16;..."] [--decode-batches 1,64,256] [--decode-variants 64x4,m32]
        [--results bench/results.jsonl]

Prefill: `kda_chunk_scan` (Pallas Mosaic GPU: the intra kernel, then the chain) against fla-core
0.6.0 `chunk_kda` (Triton, torch) and jla 0.1.0 `kda` (Pallas Mosaic GPU) at (B, T, H) =
(1, 16384, 16), (1, 8192, 64), (8, 4096, 16), D = 128. Decode: the step (conv, gate and state
update) at batch 1, 64, 256 with H = 64 in both of `kda_decode_step`'s forms (the fused Triton step,
`64x4`; the Triton token vectors then the Mosaic GPU update, `m32`) against the state-bytes roofline,
XLA's in-place pass over the state and fla's `fused_recurrent_kda_fwd` (the core update only).

Errors are max|d| / max|ref| against the reference on the same bf16 inputs (the reference in fp32,
HIGHEST precision). Prefill times: ours and jla's as 20 jitted calls dispatched back to back
(`common.dispatched_ms`; the time in a jitted loop, where XLA may hoist loop-invariant work, is
printed beside it), fla's with triton.testing.do_bench (median). Decode steps: the kernels' own GPU
time in a profiler trace of 20 steps back to back (`common.kernel_ms`, `common.torch_kernel_ms` for
fla), the time a decoder's step costs inside a larger program; beside it the wall time a step of 20
unrolled in one jit (`common.chain_ms`) or captured in one CUDA graph (`common.torch_chain_ms`).

Rows for bench/results.jsonl: op `kda_prefill` per shape (ours: the default config; peers: fla, jla)
and `kda_decode` per batch (ours: the form `kda_decode_step` dispatches; peer: fla; baseline: XLA's
pass over the state; roofline: the state read and written once at `common.HBM`).

The peers come as wheels (../shared/peers/), installed on the GPU machine from a folder carried
with the tree:
    python3 -m pip install -q --no-index --no-deps --target .peers-site .peers/*.whl
    PYTHONPATH=$PWD/.peers-site python3 -m bench.kda
"""

import argparse
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import (
    HBM,
    Results,
    add_results_argument,
    chain_ms,
    dispatched_ms,
    kernel_ms,
    log,
    loop_ms,
    relative_error,
    torch_chain_ms,
    torch_kernel_ms,
)
from pallas_kernels import kda
from pallas_kernels.kda import decode_fused_triton, decode_update_mosaic, prefill_intra_mosaic

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
RESULTS = None  # a common.Results where rows are written (none in --interpret runs)


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
    (one repeated key, no decay, beta = 1: the inverse's hardest case, where an inverse by doubling
    overflows), and a bf16 o over more than one wave of the chain (its default there: 64 value
    columns, one slot of u)."""
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
    for b, t, h, d in PREFILL_SHAPES:
        shape = f"B={b} T={t} H={h}"
        np_in = prefill_inputs(b, t, h, d)
        q, k, v, g, beta = to_jax(*np_in)
        o_ref, s_ref = jax.jit(kda.kda_chunk_scan_reference)(q.astype(jnp.float32), k, v, g, beta)
        o_ref, s_ref = np.asarray(o_ref, np.float32), np.asarray(s_ref)
        floor = relative_error(np.asarray(jnp.asarray(o_ref, jnp.bfloat16), np.float32), o_ref)
        log(f"{shape}: rounding the reference output to bf16 alone gives error {floor:.2e}")
        ROWS.append(("prefill", "reference rounded to bf16 (floor for bf16 o)", shape, floor, float("nan"), ""))
        ours, errors = {}, {}
        for name, cfg in configs.items():
            try:
                fn = jax.jit(lambda q, k, v, g, beta, cfg=cfg: kda.kda_chunk_scan(
                    q, k, v, g, beta, implementation="pallas", interpret=INTERPRET, **cfg))
                t0 = time.perf_counter()
                o, s = fn(q, k, v, g, beta)
                err = max(relative_error(o, o_ref), relative_error(s, s_ref))
                compile_s = time.perf_counter() - t0

                def step(c, cfg=cfg):
                    o, s = kda.kda_chunk_scan(q, k, v, g, beta + c.astype(beta.dtype) * 0, implementation="pallas",
                                              interpret=INTERPRET, **cfg)
                    return c + o[0, 0, 0, 0].astype(jnp.float32) * 0 + s[0, 0, 0, 0] * 0

                ms = dispatched_ms(fn, q, k, v, g, beta)
                loop = loop_ms(step, jnp.float32(0))
                ours[name], errors[name] = ms, err
                log(f"ours {name:9s} {shape}: {ms:.3f} ms ({loop:.3f} in a loop with only beta varying)  err o/state"
                    f" {relative_error(o, o_ref):.2e}/{relative_error(s, s_ref):.2e}  (first call {compile_s:.0f}s)")
                ROWS.append(("prefill", f"ours {name}", shape, err, ms, f"{loop:.3f} ms in a loop"))
            except Exception as e:
                traceback.print_exc()
                log(f"ours {name} {shape}: FAILED {type(e).__name__}")
        intra = split_timing(q, k, v, g, beta, shape)
        peers = peers_prefill(np_in, o_ref, s_ref, shape, d) if PEERS else {}
        if RESULTS is not None and "default" in ours:
            RESULTS.add(
                "kda_prefill", f"B={b} T={t} H={h} D={d}", ours["default"],
                metric="median ms a call, 20 jitted calls dispatched back to back (fla: do_bench)",
                peers={name: ms for name, (ms, _) in peers.items()},
                error=errors["default"], bf16_floor=floor, intra_ms=intra,
                peer_errors={name: err for name, (_, err) in peers.items()},
                configs={name: ms for name, ms in ours.items() if name != "default"},
            )


def intra_ms(q, k, v, g, beta, interpret=False):
    """Per-call time of the parallel half alone (the intra kernel): the rest of the scan's time is the
    serial chain."""
    b, t = q.shape[:2]
    lengths = jnp.full((b,), t, jnp.int32)
    fn = jax.jit(lambda q, k, v, g, beta: prefill_intra_mosaic.intra(  # as a bf16 o's scan runs it: q_w's hi half alone
        q, k, v, g, jnp.swapaxes(beta, 1, 2).astype(jnp.float32), lengths, qw_lo=False, interpret=interpret))
    return dispatched_ms(fn, q, k, v, g, beta)


def split_timing(q, k, v, g, beta, shape):
    """The intra kernel's time alone (None if it failed), logged with the bytes it moves."""
    b, t, h, d = q.shape
    try:
        ms = intra_ms(q, k, v, g, beta, INTERPRET)
    except Exception:
        traceback.print_exc()
        return None
    # The intra kernel reads q (twice), k, v (bf16), g (fp32), beta and writes w and q_w (bf16),
    # u, A_qk u and k exp(G_last - G) (bf16 halves), exp(G_last) once a chunk
    byts = b * t * h * (4 * 2 * d + 4 * d + 4 + 2 * 2 * d + 3 * 4 * d + 4 * d // 64)
    log(f"   intra kernel alone: {ms:.3f} ms ({byts / ms / 1e6:.0f} GB/s of its {byts / 1e9:.2f} GB)")
    ROWS.append(("prefill", "  ours: intra kernel alone", shape, float("nan"), ms, f"{byts / ms / 1e6:.0f} GB/s"))
    return ms


def peers_prefill(np_in, o_ref, s_ref, shape, d):
    """{peer: (ms, error)} for fla's chunk_kda and jla's kda on the same inputs (q and k L2-normalised
    in the peers' kernels, as ours does)."""
    timed = {}
    try:
        import torch
        import triton
        from fla.ops.kda import chunk_kda

        q, k, v, g, beta = (torch.from_numpy(x).cuda() for x in np_in)
        q, k, v, beta = q.bfloat16(), k.bfloat16(), v.bfloat16(), beta.bfloat16()
        name = "fla chunk_kda"
        fn = lambda: chunk_kda(  # noqa: E731
            q, k, v, g, beta, scale=d**-0.5, output_final_state=True, use_qk_l2norm_in_kernel=True)
        try:
            o, s = fn()
            err = max(relative_error(o.float().cpu().numpy(), o_ref), relative_error(s.float().cpu().numpy(), s_ref))
            ms = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
            timed[name] = (ms, err)
            log(f"{name} {shape}: {ms:.3f} ms  err {err:.2e}")
            ROWS.append(("prefill", name, shape, err, ms, "l2norm in kernel; do_bench"))
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
        name = "jla kda"
        try:
            fn = jax.jit(lambda q, k, v, g, b: jla_kda(q, k, v, g, b, scale=d**-0.5, output_final_state=True,
                                                       use_qk_l2norm=True))
            o, s = fn(q, k, v, g, beta)
            err = max(relative_error(o, o_ref), relative_error(s, s_ref))

            def step(c):
                o, s = jla_kda(q, k, v, g, beta + c.astype(beta.dtype) * 0, scale=d**-0.5, output_final_state=True,
                               use_qk_l2norm=True)
                return c + o[0, 0, 0, 0].astype(jnp.float32) * 0 + s[0, 0, 0, 0] * 0

            ms = dispatched_ms(fn, q, k, v, g, beta)
            loop = loop_ms(step, jnp.float32(0))
            timed[name] = (ms, err)
            log(f"{name} {shape}: {ms:.3f} ms ({loop:.3f} in a loop with only beta varying)  err {err:.2e}")
            ROWS.append(("prefill", name, shape, err, ms, f"{loop:.3f} ms in a loop"))
        except Exception as e:
            traceback.print_exc()
            log(f"{name} {shape}: FAILED {type(e).__name__}")
    except Exception:
        traceback.print_exc()
    return timed


def dispatched_variant(b, h, d):
    """The decode variant `kda.kda_decode_step` takes at these shapes, in `decode_variant`'s terms."""
    state_bytes = b * h * d * d * 4
    if d in decode_update_mosaic.STEP_HEAD_DIMS and state_bytes >= decode_update_mosaic.MIN_STATE_BYTES:
        return "mosaic", decode_update_mosaic.BLOCK_V, 4
    return 64, 4


def bench_decode(variants, d=128):
    h, d = (2, 64) if INTERPRET else (64, d)
    log(f"\n== decode step, H={h} D={d}")
    measured = {}  # batch -> {"xla": kernel ms, variant: (kernel ms, wall ms, error)}
    for b in DECODE_BATCHES:
        x = kda.random_decode_inputs(jax.random.key(0), b, h, d, state_scale=0.01)
        ref = kda.kda_decode_step_reference(**x, lower_bound=-5.0)
        fixed = {k_: v_ for k_, v_ in x.items() if k_ not in ("conv_state", "state")}
        roof = 2 * b * h * d * d * 4 / HBM * 1e3
        measured[b] = {}

        def report(name, err, kernel, wall, note=""):
            kernel_note = "" if kernel is None else f"kernel {kernel:.4f} ms ({roof / kernel * 100:.0f}% of roofline); "
            log(f"{name} B={b}: {kernel_note}{wall:.4f} ms per step by the wall ({roof / wall * 100:.0f}%) {note}")
            ROWS.append(("decode", name, f"B={b}", err, wall if kernel is None else kernel,
                         f"{kernel_note}{wall:.4f} ms by the wall ({roof / wall * 100:.0f}%) {note}"))

        # XLA's own elementwise pass over the state (read and written in place, the same bytes as the
        # step's state traffic), chained and donated the same way; the barrier keeps XLA from fusing
        # the 20 passes into one.
        xla_pass = lambda state: (jax.lax.optimization_barrier(state * 0.999 + 1e-6),)  # noqa: E731
        measured[b]["xla"] = None if INTERPRET else kernel_ms(xla_pass, (x["state"],), "fusion")
        report("XLA elementwise pass over the state", float("nan"), measured[b]["xla"], chain_ms(xla_pass, (x["state"] + 0,)))
        for variant in variants:
            if variant[0] == "mosaic":
                block_v, token_warps = variant[1:]
                name = (f"ours kda_decode_step (Triton token vectors, Mosaic GPU update) block_v={block_v}"
                        f" token warps={token_warps}")
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
                wall = chain_ms(step, tuple(a + 0 for a in carry))
                measured[b][variant] = (kernel, wall, err)
                report(name, err, kernel, wall,
                       " + ".join(f"{part} {ms:.4f}" for part, ms in per_kernel) if len(per_kernel) > 1 else "")
            except Exception:
                traceback.print_exc()
                log(f"{name} B={b}: FAILED")
    fla = decode_peer(h, d) if PEERS else {}
    if RESULTS is None:
        return
    for b, found in measured.items():
        ours = found.get(dispatched_variant(b, h, d))
        if ours is None or ours[0] is None:
            log(f"B={b}: the dispatched form {dispatched_variant(b, h, d)} was not timed: no result row")
            continue
        RESULTS.add(
            "kda_decode", f"B={b} H={h} D={d}", ours[0],
            metric="GPU kernel ms a step (profiler trace of 20 steps)",
            peers={"fla fused_recurrent_kda_fwd (core only)": fla.get(b)},
            baselines={"XLA in-place pass over the state": found["xla"]},
            roofline=2 * b * h * d * d * 4 / HBM * 1e3, error=ours[2], wall_ms=ours[1],
            variants={decode_variant_name(v): t[0] for v, t in found.items() if v != "xla" and t[0] is not None},
        )


def decode_peer(h, d):
    """{batch: kernel ms} of fla's `fused_recurrent_kda_fwd` (the core update alone: q, k, v, g, beta
    given), logged beside its wall time in a CUDA graph and by do_bench."""
    timed = {}
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
                q, k, v, gg, beta, initial_state=h0, output_final_state=True, inplace_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )
            per_call = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
            roof = 2 * b * h * d * d * 4 / HBM * 1e3
            kernel = torch_kernel_ms(fn, "fused_recurrent_kda")
            ms = torch_chain_ms(fn)
            timed[b] = kernel
            log(f"fla fused_recurrent_kda_fwd B={b}: kernel {kernel:.4f} ms ({roof / kernel * 100:.0f}% of roofline);"
                f" {ms:.4f} ms per step in a CUDA graph of 20 ({roof / ms * 100:.0f}%); {per_call:.4f} ms by do_bench")
            ROWS.append(("decode", "fla fused_recurrent_kda_fwd (core only)", f"B={b}", float("nan"), kernel,
                         f"kernel {roof / kernel * 100:.0f}%; {ms:.4f} ms per step in a CUDA graph ({roof / ms * 100:.0f}%);"
                         f" {per_call:.4f} ms by do_bench"))
    except Exception:
        traceback.print_exc()
    return timed


def decode_variant(text):
    """'64x4' -> (64, 4): the fused Triton step; 'm32w2' -> ('mosaic', 32, 2): the two-kernel step."""
    if text.startswith("m"):
        block_v, _, warps = text[1:].partition("w")
        return "mosaic", int(block_v), int(warps or 4)
    return tuple(int(x) for x in text.split("x"))


def decode_variant_name(variant):
    """`decode_variant`'s inverse: ('mosaic', 32, 4) -> 'm32w4', (64, 4) -> '64x4'."""
    if variant[0] == "mosaic":
        return f"m{variant[1]}w{variant[2]}"
    return "x".join(map(str, variant))


def main():
    global INTERPRET, PREFILL_SHAPES, DECODE_BATCHES, PEERS, RESULTS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="default", help="scan configs to time, among: " + ",".join(CONFIGS))
    parser.add_argument("--skip", default="", help="comma list of sections to skip: check,prefill,decode")
    parser.add_argument("--interpret", action="store_true", help="CPU smoke run: tiny shapes, Pallas interpreter, no rows")
    parser.add_argument("--no-peers", action="store_true", help="time our kernels only")
    parser.add_argument("--prefill-shapes", default=";".join(",".join(map(str, x[:3])) for x in PREFILL_SHAPES),
                        help="B,T,H;B,T,H;... at D = 128")
    parser.add_argument("--decode-batches", default=",".join(map(str, DECODE_BATCHES)), help="decode batch sizes, at H = 64")
    parser.add_argument("--decode-dim", type=int, default=128, help="decode head dim dk = dv")
    parser.add_argument("--decode-variants", default=DECODE_VARIANTS,
                        help="decode launch shapes: value columns x warps (the fused Triton step), or mN[wW] (Triton token"
                             " vectors in W warps, default 4, then the Mosaic GPU update in N columns)")
    add_results_argument(parser)
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    PEERS = not args.no_peers
    PREFILL_SHAPES = [(*map(int, shape.split(",")), 128) for shape in args.prefill_shapes.split(";")]
    DECODE_BATCHES = [int(b) for b in args.decode_batches.split(",")]
    if args.interpret:
        INTERPRET, PREFILL_SHAPES, DECODE_BATCHES = True, [(1, 128, 2, 64)], [2]
    else:
        RESULTS = Results(args.results)
    log("jax", jax.__version__, jax.devices())
    sections = {
        "check": check_small,
        "decode": lambda: bench_decode([decode_variant(v) for v in args.decode_variants.split(",")], args.decode_dim),
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
