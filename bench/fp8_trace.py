"""Where the FP8 grouped GEMM's cycles go: one call of `moe_gemm.grouped_matmul_fp8` at a bench.moe
shape, traced by Mosaic GPU's profiler (each compute warpgroup's named scopes, SM clock cycles), and
per config a table of cycles a K step in each scope: "scales" (the step's row and block scales),
"issue" (the product's wgmma), "await" (waiting for it), "promote" (scale and add into the running
sum), "store" (an item's output), and "between" (outside every scope: waiting for the step's slot
to be loaded, releasing it, the loop). The ideal is the step's products at the tensor cores' dense
FP8 rate, 4096 multiply-adds a cycle an SM, both warpgroups' products one after the other.

    python -m bench.fp8_trace [--tokens 8192] [--gemm gate_up] [--configs default,cluster=2,pingpong]
        [--ranges 1024] [--keep DIR]

With `--plain N` each config instead runs N plain calls (no profiler), for a hardware profiler to
read the kernel's counters, e.g.

    ncu --clock-control none --kernel-name regex:fp8 --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis python -m bench.fp8_trace --plain 2

Each warpgroup records its first `ranges` scopes (about 10 items of gate_up at the default 1024), so
the figures cover the start of every CTA's share, not its tail. Profiling adds about 12 cycles a
scope. Nothing goes to bench/results.jsonl: these are a kernel's insides, not a time to compare.
"""

import argparse
import collections
import dataclasses
import glob
import json
import os
import tempfile

import jax
import jax.numpy as jnp

from bench.common import log
from bench.moe import GEMMS, fp8_operands, routed_rows
from pallas_kernels import block_fp8, moe_gemm

SCOPES = ("scales", "issue", "await", "promote", "store", "between")
COMPUTE_WARPGROUPS = 2
TRACES_A_CTA = 3  # two compute warpgroups and the one feeding them
FP8_FMAS_A_CYCLE = 4096  # an SM's dense FP8 tensor-core rate


def parse_config(text, default):
    """"default", "pingpong", "no-overlap" or "field=value" joined by "+" (e.g. "block_cols=256+stages=3")."""
    changes = {}
    for part in text.split("+"):
        if part == "default":
            continue
        if part == "pingpong":
            changes["pingpong"] = True
        elif part == "no-overlap":
            changes["overlap_items"] = False
        else:
            field, value = part.split("=")
            changes[field] = int(value)
    return dataclasses.replace(default, **changes)


def scope_cycles(trace_path):
    """{warpgroup: {scope: [cycles of each range]}} and {warpgroup: [span of each CTA's trace]}, over the
    top-level scopes of the compute warpgroups' traces (a trace's ts are cycles / 1000)."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    by_trace = collections.defaultdict(list)
    for event in events:
        by_trace[event["tid"]].append(event)
    scopes = collections.defaultdict(lambda: collections.defaultdict(list))
    spans = collections.defaultdict(list)
    for tid, trace in by_trace.items():
        wg = (tid - 1) % TRACES_A_CTA
        stack, outside, last_end = [], 0.0, None
        for event in trace:
            ts = event["ts"] * 1e3
            if event["ph"] == "B":
                if not stack and last_end is not None:
                    outside += ts - last_end
                stack.append((event["name"], ts))
            else:
                name, start = stack.pop()
                if not stack:
                    scopes[wg][name].append(ts - start)
                    last_end = ts
        scopes[wg]["between"].append(outside)
        spans[wg].append(trace[-1]["ts"] * 1e3 - trace[0]["ts"] * 1e3)
    return scopes, spans


def profile_config(config, operands, ranges, directory):
    """The path of the trace one call of the kernel with `config` writes into `directory`."""
    traced = dataclasses.replace(config, profile=(ranges, directory))
    before = set(glob.glob(os.path.join(directory, "*-trace.json")))
    call = jax.jit(lambda *a: moe_gemm.grouped_matmul_fp8(*a, implementation="pallas", config=traced))
    jax.block_until_ready(call(*operands))
    (path,) = set(glob.glob(os.path.join(directory, "*-trace.json"))) - before
    return path


class GemmCase:
    """One bench.moe FP8 GEMM shape's operands: weights, their scales, the routed group sizes and the
    rows quantized; `tiled(config)` their tiled layout for a config's tile height."""

    def __init__(self, gemm, tokens):
        self.k, self.n = GEMMS[gemm]
        key = jax.random.key(2)
        self.w, self.w_s = fp8_operands(self.k, self.n, jax.random.fold_in(key, self.k))
        self.sizes = routed_rows(tokens)
        self.rows = int(self.sizes.sum())
        x = jax.random.normal(jax.random.fold_in(key, tokens), (self.rows, self.k), jnp.bfloat16)
        self.x_q, self.x_s = jax.jit(block_fp8.quantize_rows)(x)
        _, self.default = moe_gemm.plan_fp8(None, (self.w,), rows=self.rows)

    def tiled(self, config):
        """(x [M, K] e4m3, x_scales [M, K / 128], tiles) in the layout of `config.block_rows`."""
        tiles = moe_gemm.expert_tiles(jnp.asarray(self.sizes), self.rows, config.block_rows)
        m = tiles.tile_experts.shape[0] * config.block_rows
        x_tiled = jnp.zeros((m, self.k), self.x_q.dtype).at[tiles.slots].set(self.x_q)
        s_tiled = jnp.ones((m, self.k // 128), jnp.float32).at[tiles.slots].set(self.x_s)
        return x_tiled, s_tiled, tiles


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--gemm", default="gate_up", choices=sorted(GEMMS))
    parser.add_argument("--configs", default="default,pingpong,cluster=2")
    parser.add_argument("--ranges", type=int, default=1024, help="scopes a warpgroup records")
    parser.add_argument("--keep", default=None, help="a directory to keep the Perfetto traces in")
    parser.add_argument("--plain", type=int, default=0, help="run each config this many times, untraced")
    args = parser.parse_args()
    case = GemmCase(args.gemm, args.tokens)
    if args.plain:
        for text in args.configs.split(","):
            config = parse_config(text, case.default)
            x_tiled, s_tiled, tiles = case.tiled(config)
            call = jax.jit(lambda *a, config=config: moe_gemm.grouped_matmul_fp8(*a, implementation="pallas",
                                                                                 config=config))
            for _ in range(args.plain):
                jax.block_until_ready(call(x_tiled, s_tiled, case.w, case.w_s, tiles.tile_experts, tiles.used_tiles))
            log(f"{text}: {args.plain} calls")
        return
    directory = args.keep or tempfile.mkdtemp(prefix="fp8_trace")
    os.makedirs(directory, exist_ok=True)
    log(f"{jax.devices()[0].device_kind}; {args.gemm} K={case.k} N={case.n}, {args.tokens} tokens; traces in {directory}")
    log("\n| config | warpgroup | steps traced | cycles a step | ideal | "
        + " | ".join(SCOPES) + " |")
    log("|" + " --- |" * 11)
    for text in args.configs.split(","):
        config = parse_config(text, case.default)
        x_tiled, s_tiled, tiles = case.tiled(config)
        try:
            path = profile_config(config, (x_tiled, s_tiled, case.w, case.w_s, tiles.tile_experts, tiles.used_tiles), args.ranges,
                                 directory)
        except Exception as e:  # a config that does not fit with the profiler's buffer, say
            log(f"| {text} | failed: {type(e).__name__}: {str(e)[:200]} |")
            continue
        scopes, spans = scope_cycles(path)
        wg_m, wg_n = (64, config.block_cols) if config.block_rows == 128 else (config.block_rows, config.block_cols // 2)
        parts = max(wg_n // 128, 1)  # products a step (the kernel's scale blocks a warpgroup)
        ideal = COMPUTE_WARPGROUPS * wg_m * wg_n * 128 / FP8_FMAS_A_CYCLE
        for wg in range(COMPUTE_WARPGROUPS):
            steps = len(scopes[wg]["issue"]) / (1 if config.rescale else parts)  # rescaled: one scope a step
            if not steps:
                continue
            a_step = {name: sum(v) / steps for name, v in scopes[wg].items()}
            span = sum(spans[wg]) / steps
            cells = " | ".join(f"{a_step.get(name, 0.0):.0f}" for name in SCOPES)
            log(f"| {text} | {wg} | {steps:.0f} | {span:.0f} | {ideal:.0f} | {cells} |")


if __name__ == "__main__":
    main()
