"""Where the scan kernels' instructions go, from the PTX that Mosaic GPU compiles: for each kernel its
ptxas registers and spills, its instruction count, and each loop (a backward branch) with its size,
the loops inside it and its commonest opcodes and source lines. A loop's instructions run once per
trip: multiply by the trip counts (the intra kernel's score passes 3 x 2 channel blocks, its inverse 6
merge steps, its WY loops 2 blocks each; the chain's loop one trip per chunk).

    python3 -m tools.kda_ptx [--shape B,T,H]   # on the GPU: compiles the scan, dumps, reads
    python3 -m tools.kda_ptx --read DIR        # anywhere: reads an earlier dump
"""

import argparse
import collections
import os
import re
import tempfile
from pathlib import Path


def dump(shape, into):
    """Compiles and runs the scan once with Mosaic GPU's PTX, ptxas and SASS dumps going to `into` (the
    SASS needs nvdisasm, which the H200 machine has in /usr/local/cuda/bin, off its PATH)."""
    os.environ.update(
        MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_SASS="1", MOSAIC_GPU_DUMP_TO=str(into),
        PATH=os.environ.get("PATH", "") + ":/usr/local/cuda/bin",
    )
    import jax
    import jax.numpy as jnp

    from bench.kda import prefill_inputs, to_jax
    from pallas_kernels.kda import prefill_chain_mosaic

    b, t, h = shape
    q, k, v, g, beta = to_jax(*prefill_inputs(b, t, h, 128))
    scan = jax.jit(lambda *a: prefill_chain_mosaic.chunk_scan(*a, out_dtype=jnp.bfloat16))
    jax.block_until_ready(scan(q, k, v, g, beta, jnp.zeros((b, h, 128, 128)), jnp.full((b,), t, jnp.int32)))


def instructions(ptx):
    """(source line, opcode, branch target or None) per instruction, and the label positions."""
    files = {n: Path(name).name for n, name in re.findall(r'^\s*\.file\s+(\d+)\s+"([^"]+)"', ptx, re.M)}
    rows, labels, line = [], {}, "?"
    for text in ptx.splitlines():
        text = text.strip()
        if text.startswith(".loc"):
            number, at = text.split()[1:3]
            line = f"{files.get(number, number)}:{at}"
        elif re.match(r"^\$L__BB[\w]+:$", text):
            labels[text[:-1]] = len(rows)
        elif text.endswith(";") and not text.startswith(("//", ".", "{", "}")):
            opcode = re.sub(r"^@!?%?\w+\s+", "", text).split()[0]
            target = re.search(r"bra(?:\.uni)?\s+(\$L__BB\w+);", text)
            rows.append((line, opcode, target and target.group(1)))
    return rows, labels


def report(path):
    rows, labels = instructions(path.read_text())
    ptxas = path.with_suffix(".ptxas")
    print(f"\n## {path.stem}: {len(rows)} PTX instructions")
    if ptxas.exists():
        for text in ptxas.read_text().splitlines():
            if "Used" in text or "spill stores" in text:
                print(text.split(":", 1)[-1].strip() + "  ")
    loops = sorted(
        (labels[target], end) for end, (_, _, target) in enumerate(rows) if target in labels and labels[target] < end
    )
    print("| loop (first-last instruction) | size | inside | commonest opcodes | commonest source lines |")
    print("| --- | --- | --- | --- | --- |")
    for start, end in loops:
        body = rows[start:end + 1]
        inside = [f"{s}-{e}" for s, e in loops if start <= s and e <= end and (s, e) != (start, end)]
        ops = collections.Counter(op for _, op, _ in body).most_common(6)
        lines = collections.Counter(line for line, _, _ in body).most_common(6)
        print(f"| {start}-{end} | {len(body)} | {', '.join(inside) or '-'} | "
              f"{', '.join(f'{op} {n}' for op, n in ops)} | {', '.join(f'{line}: {n}' for line, n in lines)} |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="1,16384,16", help="B,T,H at D = 128")
    parser.add_argument("--read", help="a directory of an earlier dump")
    args = parser.parse_args()
    into = Path(args.read or tempfile.mkdtemp(prefix="kda_ptx_"))
    if not args.read:
        dump(tuple(int(x) for x in args.shape.split(",")), into)
    for path in sorted(into.glob("*.ptx")):
        report(path)
    print(f"\n(dump in {into})")


if __name__ == "__main__":
    main()
