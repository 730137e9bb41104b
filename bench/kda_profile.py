"""The KDA kernels' workload for Nsight Compute: one prefill scan at (1, 16384, 16, 128) and one
decode step at batch 64, H = 64 (each compiled, then run once), so that ncu sees each kernel.

On the GPU machine (Firecracker runtime, where ncu reads the counters), from the repository root:
    PYTHONPATH=$PWD ncu --clock-control none --kernel-name regex:kda --launch-count 3 \\
        --section LaunchStats --section Occupancy --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats python3 bench/kda_profile.py
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
import kda as bench  # noqa: E402

from pallas_kernels import decode_fused_triton, kda, prefill_chain_mosaic  # noqa: E402


def main():
    b, t, h, d = 1, 16384, 16, 128
    q, k, v, g, beta = bench.to_jax(*bench.prefill_inputs(b, t, h, d))
    lengths = jnp.full((b,), t, jnp.int32)
    s0 = jnp.zeros((b, h, d, d), jnp.float32)
    scan = jax.jit(lambda *a: prefill_chain_mosaic.chunk_scan(*a, out_dtype=jnp.bfloat16))
    jax.block_until_ready(scan(q, k, v, g, beta, s0, lengths))
    x = kda.random_decode_inputs(jax.random.key(0), 64, 64, 128, state_scale=0.01)
    fixed = {name: a for name, a in x.items() if name not in ("conv_state", "state")}
    step = jax.jit(lambda c, s: decode_fused_triton.fused_decode_step(conv_state=c, state=s, **fixed, lower_bound=-5.0))
    jax.block_until_ready(step(x["conv_state"], x["state"]))
    print("ran prefill_intra_mosaic, prefill_chain_mosaic and kda_decode_step once each")


if __name__ == "__main__":
    main()
