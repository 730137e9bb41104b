"""The Mosaic GPU scan on the GPU: the intra kernel compiled against the same kernel in Pallas'
interpreter (which runs the same bf16 products in numpy), output by output, so that a GPU-only
difference shows where it is; then the whole scan (intra and chain) against the fp32 reference.
Since the scores take tf32 operands, the hi halves differ by up to ~3e-3 of their maxima (the GPU's
approximate exp and numpy's exp round to different tf32 values now and then) and the lo halves by up
to 1; the scan's errors against the reference are the criterion (bench/RESULTS.md, eleventh session).
The interpreter runs on the CPU: on the GPU backend XLA's excess precision drops the bf16 rounding
that splits an fp32 operand into halves (the lo halves come out zero).

    PYTHONPATH=$PWD python3 bench/kda_intra_check.py [--cases "B,T,H,D;..."] [--gate -5] [--interpret]

(`--interpret`: no GPU; the intra kernel's outputs in the interpreter as one sha256 digest, and the
scan, in the interpreter, against the reference: the numbers to compare two checkouts by.)
"""

import argparse
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import kda, prefill_intra_mosaic

CASES = [(1, 1, 1, 128), (2, 128, 1, 64), (1, 130, 2, 64), (3, 200, 4, 128)]
NAMES = ("w", "u hi", "u lo", "q_w hi", "q_w lo", "A_qk u hi", "A_qk u lo", "kd hi", "kd lo", "exp(G_last)")


def inputs(b, t, h, d, seed=0, gate=None):
    """Random inputs; `gate` a constant log decay for every channel (the lower bound, -5, stretches the
    scores' factors the most) instead of random ones in (-5, 0)."""
    ks = jax.random.split(jax.random.key(seed), 5)
    q, k, v = (jax.random.normal(key, (b, t, h, d)).astype(jnp.bfloat16) for key in ks[:3])
    if gate is None:
        g = -5.0 * jax.nn.sigmoid(2.0 * jax.random.normal(ks[3], (b, t, h, d)))
    else:
        g = jnp.full((b, t, h, d), gate)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, h, t)))
    lengths = jnp.array([t, max(t // 3, 1), max(t - 17, 1)][:b], jnp.int32)
    return q, k, v, g, beta, lengths


interpreted_intra = jax.jit(lambda *a: prefill_intra_mosaic.intra(*a, interpret=True))


def compare_intra(case, args):
    """The intra kernel compiled against interpreted, output by output (max|d| / max|interpreted|)."""
    valid = np.arange(-(-case[1] // 64) * 64)[None, :] < np.asarray(args[-1])[:, None]  # [B, T']
    got = jax.jit(prefill_intra_mosaic.intra)(*args)
    cpu_args = jax.device_put(args, jax.devices("cpu")[0])
    want = interpreted_intra(*cpu_args)
    line = []
    for name, x, y in zip(NAMES, got, want):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if name != "exp(G_last)":  # [B, H, T', d]: the valid tokens only
            x, y = np.swapaxes(x, 1, 2)[valid], np.swapaxes(y, 1, 2)[valid]
        bad = int((~np.isfinite(x)).sum())
        finite = np.isfinite(x)
        err = float(np.abs(x - y)[finite].max() / max(np.abs(y).max(), 1e-30)) if finite.any() else float("nan")
        line.append(f"{name} {err:.1e}" + (f" ({bad} non-finite)" if bad else ""))
    print(case, " | ".join(line), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=";".join(",".join(map(str, case)) for case in CASES))
    parser.add_argument("--gate", type=float, default=None, help="one log decay for every channel (default: random)")
    parser.add_argument(
        "--interpret", action="store_true", help="no GPU: intra's outputs as a digest, the scan against the reference"
    )
    options = parser.parse_args()
    cases = [tuple(int(x) for x in case.split(",")) for case in options.cases.split(";")]
    for case in cases:
        args = inputs(*case, gate=options.gate)
        if options.interpret:
            outputs = interpreted_intra(*args)
            digest = hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in outputs)).hexdigest()[:16]
            print(f"{case} intra's outputs in the interpreter: sha256 {digest}", flush=True)
        else:
            compare_intra(case, args)
        q, k, v, g, beta, lengths = args
        s0 = jax.random.normal(jax.random.key(1), (case[0], case[2], case[3], case[3]))
        f32 = [x.astype(jnp.float32) for x in (q, k, v)] + [g, jnp.swapaxes(beta, 1, 2)]
        o, s = jax.jit(lambda *a: kda.kda_chunk_scan(
            *a[:6], lengths=a[6], implementation="pallas", interpret=options.interpret))(*f32, s0, lengths)
        o_r, s_r = kda.kda_chunk_scan_reference(*f32, s0, lengths=lengths)
        ok = np.arange(case[1])[None, :] < np.asarray(lengths)[:, None]
        o, o_r = np.asarray(o, np.float64)[ok], np.asarray(o_r, np.float64)[ok]
        print(f"{case} scan against the reference: o {np.abs(o - o_r).max() / np.abs(o_r).max():.1e}"
              f"  state {float(jnp.abs(s - s_r).max() / jnp.abs(s_r).max()):.1e}", flush=True)


if __name__ == "__main__":
    main()
