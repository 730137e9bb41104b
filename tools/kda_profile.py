"""The KDA kernels' workload for Nsight Compute: one prefill scan at (1, 16384, 16, 128) and the
decode step at batch 64, H = 64 in both its forms (the fused Triton step; the token vectors, then the
Mosaic GPU update), each compiled, then run once, so that ncu sees each kernel once.

On the GPU machine (Firecracker runtime, where ncu reads the counters), from the repository root:
    ncu --clock-control none --kernel-name regex:kda --launch-count 3 \\
        --section LaunchStats --section Occupancy --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats python3 -m tools.kda_profile
"""

import jax
import jax.numpy as jnp

from bench.kda import prefill_inputs, to_jax
from pallas_kernels import kda
from pallas_kernels.kda import decode_fused_triton, decode_update_mosaic, prefill_chain_mosaic


def main():
    b, t, h, d = 1, 16384, 16, 128
    q, k, v, g, beta = to_jax(*prefill_inputs(b, t, h, d))
    lengths = jnp.full((b,), t, jnp.int32)
    s0 = jnp.zeros((b, h, d, d), jnp.float32)
    scan = jax.jit(lambda *a: prefill_chain_mosaic.chunk_scan(*a, out_dtype=jnp.bfloat16))
    jax.block_until_ready(scan(q, k, v, g, beta, s0, lengths))
    x = kda.random_decode_inputs(jax.random.key(0), 64, 64, 128, state_scale=0.01)
    fixed = {name: a for name, a in x.items() if name not in ("conv_state", "state")}
    for step in (decode_fused_triton.fused_decode_step, decode_update_mosaic.two_kernel_decode_step):
        call = jax.jit(lambda c, s, step=step: step(conv_state=c, state=s, **fixed, lower_bound=-5.0))
        jax.block_until_ready(call(x["conv_state"], x["state"]))
    print("ran kda_intra, kda_chain, kda_decode_step, kda_decode_token_vectors and kda_decode_update once each")


if __name__ == "__main__":
    main()
