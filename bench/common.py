"""What the benchmarks share: timing on the GPU, error measures, and the result rows each appends to
bench/results.jsonl (the README's speed tables are generated from that file by bench/speed_table.py).

Times:
- `dispatched_ms`: n calls of a jitted function dispatched back to back, per call. JAX dispatches
  asynchronously, so for calls of a millisecond or more the host's time hides behind the GPU's.
- `loop_ms`: n calls in one jitted fori_loop (dispatch amortised; XLA may hoist loop-invariant work).
- `chain_ms`: n calls unrolled in one jit with the carry donated: back-to-back launches without the
  host round trip that XLA's while loop adds per iteration (~12 us on the H200).
- `kernel_ms`: the named kernels' own GPU time in a `jax.profiler` trace (CUPTI) of such a chain:
  what a step costs inside a larger jitted program, without the chain's dispatch (~20 us a step).
- `trace_kernels`: every kernel's GPU time a call, by name, from a trace of several calls.
- `torch_kernel_ms`, `torch_chain_ms`: the same two measures for a torch peer (profiler; CUDA graph).

Result rows (`Results`): one JSON object a line, written as each row is measured (a run cut by a
time limit keeps what it measured). Fields (`REQUIRED`): date (UTC, of the run), commit (of the
tree measured; "+uncommitted" when its library or bench files differ from it), device, op, shape,
metric and unit (what `ours`, the peers, the baselines and the roofline measure), ours, peers
({name: value}: other projects' kernels), baselines ({name: value}: this library's own non-kernel
path or a floor such as XLA's pass over the same bytes), roofline (null where none is defined),
command and source ("measured", or where a transcribed row came from); then what else the
benchmark knows (errors, other configs). On a machine without the repository's .git (the device
machine gets the working tree alone) set BENCH_COMMIT; BENCH_DATE overrides the date.
"""

import datetime
import functools
import glob
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from jax import lax

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results.jsonl"
HBM = 4.3e12  # bytes/s, read + written: a device-to-device copy on the H200 (the roofline's bandwidth)
MATMUL = 705e12  # FLOP/s: a plain bf16 matmul through XLA on the H200 (the roofline's compute rate)
FP8_MATMUL = 1580e12  # FLOP/s: dense e4m3 wgmma on the H200 (cuBLASLt's per-tensor FP8 GEMM at 8192^3)

REQUIRED = {  # field: the types its value may take
    "date": (str,),
    "commit": (str,),
    "device": (str,),
    "op": (str,),
    "shape": (str,),
    "metric": (str,),
    "unit": (str,),
    "ours": (int, float),
    "peers": (dict,),
    "baselines": (dict,),
    "roofline": (int, float, type(None)),
    "command": (str,),
    "source": (str,),
}


def log(*args):
    print(*args, flush=True)


def relative_error(got, want):
    """max |got - want| / max |want| (nan when got is not finite)."""
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


def median_ms(fn, reps=10):
    """Median wall ms of one call of `fn()` waited for, over `reps` calls after one to warm up."""
    return per_call_ms(lambda: jax.block_until_ready(fn()), 1, reps)


def loop_ms(step, carry, n=10, reps=5):
    """Per-call time of `step`, run n times in one jitted fori_loop (dispatch amortised)."""
    loop = jax.jit(lambda c: lax.fori_loop(0, n, lambda i, c: step(c), c))
    return per_call_ms(lambda: jax.block_until_ready(loop(carry)), n, reps)


def dispatched_ms(fn, *args, n=20, reps=5):
    """Per-call time of n calls of the jitted `fn` on the same arguments, dispatched back to back.
    Each call computes everything from its inputs; in `loop_ms`'s fori_loop XLA may hoist whatever
    depends only on loop-invariant inputs."""

    def run():  # only the last call's outputs are kept alive, as a caller's loop would
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)

    return per_call_ms(run, n, reps)


def chain_ms(call, carry, n=20, reps=7):
    """Per-call time of n calls of `call(*carry) -> carry` unrolled in one jit, the carry donated."""

    def chain(carry):
        for _ in range(n):
            carry = call(*carry)
        return carry

    run = jax.jit(chain, donate_argnums=0)
    state = [carry]

    def run_chain():
        state[0] = jax.block_until_ready(run(state[0]))

    return per_call_ms(run_chain, n, reps)


def gpu_events(run):
    """[(trace line name, kernel name, ms)] of the GPU events in a `jax.profiler` trace of `run()`
    (its result waited for inside the trace)."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(run())
        (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        data = jax.profiler.ProfileData.from_file(path)
        return [
            (line.name, event.name, event.duration_ns / 1e6)
            for plane in data.planes if plane.name.startswith("/device:GPU")
            for line in plane.lines for event in line.events
        ]


def kernel_ms(call, carry, name_part, n=20, per_part=None):
    """Median GPU time of the kernels named `*name_part*` in n calls of `call(*carry) -> carry`
    unrolled in one jit (the carry donated). `name_part` a tuple: the sum of each one's median, for a
    step of several kernels; each one's (name, median) is appended to the list `per_part` if given."""
    run = jax.jit(lambda c: functools.reduce(lambda c, _: call(*c), range(n), c), donate_argnums=0)
    carry = [jax.block_until_ready(run(tuple(x + 0 for x in carry)))]  # compile and warm up
    events = gpu_events(lambda: run(carry[0]))
    total = 0.0
    for part in (name_part,) if isinstance(name_part, str) else name_part:
        times = [ms for _, name, ms in events if part in name]
        if len(times) != n:
            raise RuntimeError(f"expected {n} kernels named *{part}* in the trace, found {len(times)}")
        total += statistics.median(times)
        if per_part is not None:
            per_part.append((part, statistics.median(times)))
    return total


def trace_kernels(run, steps):
    """({kernel name: GPU ms a call}, {kernel name: launches a call}) over `steps` calls of run()
    back to back after one outside the trace (compilation and autotuning stay out of it)."""
    import collections

    jax.block_until_ready(run())

    def calls():
        for _ in range(steps):
            out = run()
        return out

    per_name, launches = collections.defaultdict(float), collections.defaultdict(float)
    for line, name, ms in gpu_events(calls):
        if line.startswith("XLA"):  # the op and module lines span the kernels
            continue
        per_name[name] += ms / steps
        launches[name] += 1 / steps
    return dict(per_name), dict(launches)


def fusion_sources(hlo_text):
    """{kernel name: its HLO instruction's result type and op name} from a compiled module's text
    (a trace names kernels by their instructions, with '.' as '_'; the type says which array a
    memory-bound kernel walks)."""
    import re

    sources = {}
    for line in hlo_text.splitlines():
        found = re.match(r"\s*(?:ROOT )?%?([\w.-]+) = (\S+) .*op_name=\"([^\"]*)\"", line)
        if found:
            name, result, op_name = found.groups()
            where = f"{result.split('{')[0]} {'/'.join(op_name.split('/')[-3:])}"
            sources.setdefault(name, where)
            sources.setdefault(name.replace(".", "_"), where)
    return sources


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


def torch_chain_ms(fn, n=20, reps=7):
    """Per-call time of n calls of `fn` captured back to back in one CUDA graph: the same measure as
    `chain_ms` for ours (do_bench times one call at a time, each after flushing the L2)."""
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


def commit():
    """The tree's commit: $BENCH_COMMIT, else git's HEAD with "+uncommitted" when the library or the
    benchmarks differ from it, else "unknown"."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        changed = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "glm5next_jax", "pallas_kernels",
                                  "bench"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+uncommitted" if changed else "")


def run_child(cmd, limit, label):
    """The JSON of the last line `cmd` prints (run from the repository root), or None after printing
    why there is none as a table row that starts with `label`: a child process per measurement keeps
    each one's memory, and its failure, its own."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, cwd=ROOT)
    except subprocess.TimeoutExpired:
        print(f"| {label} | not done in {limit:.0f} s |", flush=True)
        return None
    if done.returncode:
        lines = done.stderr.strip().splitlines() or ["(no output)"]
        raised = [line for line in lines if re.match(r"[\w.]+(Error|Exception)\b", line)]  # the exception's line
        print(f"| {label} | failed: {(raised or lines)[-1][:300]} |", flush=True)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def add_results_argument(parser):
    parser.add_argument("--results", default=str(RESULTS),
                        help="append result rows to this JSON-lines file ('none': write none; default %(default)s)")


class Results:
    """Result rows appended to `path` as each is measured (`path` None or 'none': kept in `rows` only)."""

    def __init__(self, path, *, device=None):
        self.path = None if path in (None, "none") else Path(path)
        self.rows = []
        self.date = os.environ.get("BENCH_DATE") or datetime.datetime.now(datetime.UTC).date().isoformat()
        self.commit = commit()
        self.device = device or jax.devices()[0].device_kind
        self.command = f"python -m bench.{Path(sys.argv[0]).stem} {shlex.join(sys.argv[1:])}".strip()

    def add(self, op, shape, ours, *, metric, unit="ms", peers=None, baselines=None, roofline=None, **extra):
        """Append one row; peers and baselines {name: value}, values in `unit` (None values dropped)."""
        row = dict(
            date=self.date, commit=self.commit, device=self.device, op=op, shape=shape, metric=metric, unit=unit,
            ours=float(ours), peers=_present(peers), baselines=_present(baselines),
            roofline=None if roofline is None else float(roofline), command=self.command, source="measured", **extra,
        )
        self.rows.append(row)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        return row


def _present(values):
    return {name: float(v) for name, v in (values or {}).items() if v is not None and np.isfinite(v)}


def read_rows(path=RESULTS):
    """The rows of a results file, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def missing_fields(row):
    """The REQUIRED fields that `row` lacks or holds with the wrong type (bools are not numbers)."""
    return [name for name, types in REQUIRED.items()
            if name not in row or isinstance(row[name], bool) or not isinstance(row[name], types)]
