"""Probe: the decode step's slab update compiled by XLA's Pallas Triton pipeline against the same
program compiled by the triton package, under Nsight Compute (registers, occupancy, DRAM throughput,
stall reasons and SASS). Each side runs its kernels a few times at B = 64, H = 64, D = 128:
  --side jax:   `kda_decode_state_only` (bench/kda_decode_parts.py) and the fused `kda_decode_step`;
  --side mosaic: the step in two kernels (`decode_update_mosaic.two_kernel_decode_step`: Triton token vectors, Mosaic GPU update);
  --side torch: `_state_only` in plain Triton (bench/kda_decode_torch.py) and fla's fused step.

    ncu --clock-control none -k 'regex:decode_update_mosaic|_state_only|fused_recurrent' --launch-count 8 \
        --section SpeedOfLight --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section SourceCounters --import-source no -o jax \
        python3 bench/kda_decode_ncu.py --side jax      # then --side torch; ncu -i jax.ncu-rep --page details
"""

import argparse
import functools


def jax_side(b, h, d):
    import jax
    import kda_decode_parts as parts

    from pallas_kernels import decode_fused_triton, kda

    x = kda.random_decode_inputs(jax.random.key(0), b, h, d, state_scale=0.01)
    fixed = {k_: v_ for k_, v_ in x.items() if k_ not in ("conv_state", "state")}
    q, k, v, decay, beta, _ = jax.jit(functools.partial(parts.token_vectors_of, lower_bound=-5.0))(x)
    state_only = jax.jit(lambda s: parts.state_only(q, k, v, decay, beta, s, block_v=64, num_warps=4)[1],
                         donate_argnums=0)
    step = jax.jit(lambda c, s: decode_fused_triton.fused_decode_step(conv_state=c, state=s, **fixed, lower_bound=-5.0)[1:],
                   donate_argnums=(0, 1))
    s = x["state"] + 0
    for _ in range(4):
        s = state_only(s)
    c = x["conv_state"] + 0
    for _ in range(4):
        c, s = step(c, s)
    jax.block_until_ready(s)


def mosaic_side(b, h, d):
    import jax

    from pallas_kernels import decode_update_mosaic, kda

    x = kda.random_decode_inputs(jax.random.key(0), b, h, d, state_scale=0.01)
    fixed = {k_: v_ for k_, v_ in x.items() if k_ not in ("conv_state", "state")}
    step = jax.jit(lambda c, s: decode_update_mosaic.two_kernel_decode_step(conv_state=c, state=s, **fixed, lower_bound=-5.0)[1:],
                   donate_argnums=(0, 1))
    c, s = x["conv_state"] + 0, x["state"] + 0
    for _ in range(4):
        c, s = step(c, s)
    jax.block_until_ready(s)


def torch_side(b, h, d):
    import torch
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    from kda_decode_torch import _state_only, fla_inputs, state_only_inputs

    gen = torch.Generator(device="cuda").manual_seed(0)
    state = torch.randn(b, h, d, d, device="cuda", generator=gen) * 0.01
    q, k, v, decay, beta, o = state_only_inputs(b, h, d, gen)
    for _ in range(4):
        _state_only[(d // 64, h, b)](q, k, v, decay, beta, state, o, H=h, D=d, BV=64, num_warps=4)
    qb, kb, vb, gg, betab = fla_inputs(b, h, d, gen)
    for _ in range(4):
        fused_recurrent_kda_fwd(qb, kb, vb, gg, betab, initial_state=state, output_final_state=True,
                                inplace_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--side", choices=("jax", "mosaic", "torch"), required=True)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    {"jax": jax_side, "mosaic": mosaic_side, "torch": torch_side}[args.side](args.batch, 64, 128)
