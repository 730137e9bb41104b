"""Probe: the decode step's slab update compiled by XLA's Pallas Triton pipeline against the same
program compiled by the triton package, under Nsight Compute (registers, occupancy, DRAM throughput,
stall reasons and SASS). Each side runs its kernels a few times at B = 64, H = 64, D = 128:
  --side jax:   `kda_decode_state_only` (bench/kda_decode_parts.py) and the fused `kda_decode_step`;
  --side torch: `_state_only` in plain Triton (bench/kda_decode_torch.py) and fla's fused step.

    ncu --clock-control none -k regex:'kda_decode|_state_only|fused_recurrent' --launch-skip 2 \
        --launch-count 2 --section ... -o rep python3 bench/kda_decode_ncu.py --side jax
"""

import argparse
import functools


def jax_side(b, h, d):
    import jax

    import kda_decode_parts as parts
    from pallas_kernels import kda, kda_triton

    x = kda.random_decode_inputs(jax.random.key(0), b, h, d, state_scale=0.01)
    fixed = {k_: v_ for k_, v_ in x.items() if k_ not in ("conv_state", "state")}
    q, k, v, decay, beta, _ = jax.jit(functools.partial(parts.token_vectors, lower_bound=-5.0))(
        x["qkv"], x["conv_state"], *(fixed[n] for n in ("conv_weight", "f", "dt_bias", "a_log", "beta_logits")))
    state_only = jax.jit(lambda s: parts.state_only(q, k, v, decay, beta, s, block_v=64, num_warps=4)[1],
                         donate_argnums=0)
    step = jax.jit(lambda c, s: kda_triton.decode_step(conv_state=c, state=s, **fixed, lower_bound=-5.0)[1:],
                   donate_argnums=(0, 1))
    s = x["state"] + 0
    for _ in range(4):
        s = state_only(s)
    c, s = x["conv_state"] + 0, s
    for _ in range(4):
        c, s = step(c, s)
    jax.block_until_ready(s)


def torch_side(b, h, d):
    import torch

    from kda_decode_torch import _state_only
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    gen = torch.Generator(device="cuda").manual_seed(0)
    state = torch.randn(b, h, d, d, device="cuda", generator=gen) * 0.01
    q, k, v = (torch.randn(b, h, d, device="cuda", generator=gen) for _ in range(3))
    decay = torch.exp(-5.0 * torch.sigmoid(torch.randn(b, h, d, device="cuda", generator=gen)))
    beta = torch.sigmoid(torch.randn(b, h, device="cuda", generator=gen))
    o = torch.empty(b, h, d, device="cuda", dtype=torch.bfloat16)
    for _ in range(4):
        _state_only[(d // 64, h, b)](q, k, v, decay, beta, state, o, H=h, D=d, BV=64, num_warps=4)
    qb, kb, vb = (torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    gg = -5.0 * torch.sigmoid(torch.randn(b, 1, h, d, device="cuda", generator=gen))
    betab = torch.sigmoid(torch.randn(b, 1, h, device="cuda", generator=gen)).bfloat16()
    for _ in range(4):
        fused_recurrent_kda_fwd(qb, kb, vb, gg, betab, initial_state=state, output_final_state=True,
                                inplace_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--side", choices=("jax", "torch"), required=True)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    (jax_side if args.side == "jax" else torch_side)(args.batch, 64, 128)
