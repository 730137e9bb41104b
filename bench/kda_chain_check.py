"""The Mosaic GPU chain on the GPU against the same kernel in Pallas' interpreter, on the same inputs
(the intra kernel's outputs, computed once in the interpreter on the CPU), for each chain config asked
for: a GPU-only difference in the chain shows here, apart from the intra kernel's. The last columns
compare each config with the first on both sides: a config that must change the numbers (fewer
products) but changes them on one side only points at an operand that is not what it should be there.

    PYTHONPATH=$PWD:$PWD/bench python3 bench/kda_chain_check.py [--cases "B,T,H,D;..."] [--configs default,o3]
"""

import argparse

import jax
import jax.numpy as jnp
import kda as bench
import numpy as np
from kda_intra_check import CASES, inputs

from pallas_kernels.kda import prefill_chain_mosaic, prefill_intra_mosaic


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=";".join(",".join(map(str, case)) for case in CASES[1:]))
    parser.add_argument("--configs", default="default,o3", help="among: " + ",".join(bench.CONFIGS))
    parser.add_argument("--out-dtype", default="float32", choices=("float32", "bfloat16"))
    options = parser.parse_args()
    cpu = jax.devices("cpu")[0]
    out_dtype = jnp.dtype(options.out_dtype)
    for case in (tuple(int(x) for x in case.split(",")) for case in options.cases.split(";")):
        q, k, v, g, beta, lengths = jax.device_put(inputs(*case), cpu)
        parts = jax.jit(lambda *a: prefill_intra_mosaic.intra(*a, interpret=True))(q, k, v, g, beta, lengths)
        s0 = jax.device_put(jax.random.normal(jax.random.key(1), (case[0], case[2], case[3], case[3])), cpu)
        first = None
        for name in options.configs.split(","):
            cfg = {"multicast": False, **bench.CONFIGS[name]}

            def chain(*a, interpret, cfg=cfg):
                return prefill_chain_mosaic.chain(*a, out_dtype=out_dtype, interpret=interpret, **cfg)

            got = jax.jit(lambda *a: chain(*a, interpret=False))(*jax.device_put((*parts, s0), jax.devices()[0]))
            want = jax.jit(lambda *a: chain(*a, interpret=True))(*parts, s0)
            got, want = [np.asarray(x, np.float32) for x in got], [np.asarray(x, np.float32) for x in want]
            first = first or (got, want)
            err = bench.relative_error
            print(
                f"{case} {name:8s} GPU vs interpreter: o {err(got[0], want[0]):.1e} state {err(got[1], want[1]):.1e}"
                f" | vs {options.configs.split(',')[0]}: GPU o {err(got[0], first[0][0]):.1e}"
                f" state {err(got[1], first[0][1]):.1e}, interpreter o {err(want[0], first[1][0]):.1e}"
                f" state {err(want[1], first[1][1]):.1e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
