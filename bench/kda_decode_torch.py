"""Probe: is the decode step's gap to the roofline in the kernel, or in how XLA compiles and launches
it? The same work on the torch side of the GPU machine, measured as bench/kda.py measures fla's step
(the kernel's GPU time from a torch.profiler trace of 20 calls; the wall time per step of 20 calls
in one CUDA graph beside it), beside fla's own step (H = 64, D = 128, ms and % of the state-bytes
roofline):
  - torch's in-place multiply of the state (torch's floor, as XLA's pass is ours);
  - `state only` written in plain Triton, compiled by the triton package (not by XLA's pipeline):
    the same slab update as `decode_fused_triton.slab_update` and bench/kda_decode_parts.py's state-only
    Pallas kernel, the token vectors given in fp32; with and without floating-point contraction
    (fused multiply-adds), which XLA's pipeline does not do, and with the SM's shared memory
    carveout at 100% (the split between L1 and shared memory that XLA's launches get), 0 and the
    driver's default;
  - fla's `fused_recurrent_kda_fwd` (core only).
Run beside bench/kda_decode_parts.py to compare with the Pallas kernels timed through XLA.

    python3 -m pip install -q --no-index --no-deps --target .peers-site .peers/*.whl
    PYTHONPATH=$PWD:$PWD/bench:$PWD/.peers-site python3 bench/kda_decode_torch.py [--batches 64,256]
"""

import argparse

import kda as bench
import torch
import triton
import triton.language as tl


@triton.jit
def _state_only(q, k, v, decay, beta, s, o, H: tl.constexpr, D: tl.constexpr, BV: tl.constexpr):
    vb, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = b * H + h
    ks = tl.arange(0, D)
    cols = vb * BV + tl.arange(0, BV)
    slab = s + row.to(tl.int64) * D * D + ks[:, None] * D + cols[None, :]
    state = tl.load(slab)
    q_ = tl.load(q + row * D + ks)
    k_ = tl.load(k + row * D + ks)
    d_ = tl.load(decay + row * D + ks)
    predicted = tl.sum((k_ * d_)[:, None] * state, axis=0)
    out = tl.sum((q_ * d_)[:, None] * state, axis=0)
    delta = (tl.load(v + row * D + cols) - predicted) * tl.load(beta + row)
    tl.store(slab, state * d_[:, None] + k_[:, None] * delta[None, :])
    tl.store(o + row * D + cols, (out + tl.sum(q_ * k_) * delta).to(tl.bfloat16))


def state_only_inputs(b, h, d, gen):
    """q and k normalised (q scaled), v, decay, beta in fp32 and o's buffer for `_state_only`."""
    q, k, v = (torch.randn(b, h, d, device="cuda", generator=gen) for _ in range(3))
    q, k = q / q.norm(dim=-1, keepdim=True) * d**-0.5, k / k.norm(dim=-1, keepdim=True)
    decay = torch.exp(-5.0 * torch.sigmoid(torch.randn(b, h, d, device="cuda", generator=gen)))
    beta = torch.sigmoid(torch.randn(b, h, device="cuda", generator=gen))
    return q, k, v, decay, beta, torch.empty(b, h, d, device="cuda", dtype=torch.bfloat16)


def fla_inputs(b, h, d, gen):
    """One token's q, k, v (bf16), gate and beta for fla's `fused_recurrent_kda_fwd`."""
    qb, kb, vb = (torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    gg = -5.0 * torch.sigmoid(torch.randn(b, 1, h, d, device="cuda", generator=gen))
    return qb, kb, vb, gg, torch.sigmoid(torch.randn(b, 1, h, device="cuda", generator=gen)).bfloat16()


def set_carveout(compiled, percent):
    """Prefer `percent` of the SM's unified L1 / shared memory as shared memory for a compiled Triton
    kernel's launches (-1: the driver's default, as the triton package launches)."""
    import ctypes

    compiled._init_handles()
    status = ctypes.CDLL("libcuda.so.1").cuFuncSetAttribute(
        ctypes.c_void_p(compiled.function), ctypes.c_int(9), ctypes.c_int(percent)  # 9: PREFERRED_SHARED_MEMORY_CARVEOUT
    )
    if status:
        raise RuntimeError(f"cuFuncSetAttribute failed: CUresult {status}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--shapes", default="64x4,32x4", help="state-only launch shapes: block_v x warps")
    args = parser.parse_args()
    h, d = 64, 128
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    for b in (int(x) for x in args.batches.split(",")):
        gen = torch.Generator(device="cuda").manual_seed(0)
        roof = 2 * b * h * d * d * 4 / bench.HBM * 1e3

        def report(name, fn, kernel_name):
            kernel, wall = bench.torch_kernel_ms(fn, kernel_name), bench.torch_chain_ms(fn)
            bench.log(f"B={b} {name}: kernel {kernel:.4f} ms ({roof / kernel * 100:.0f}% of the {roof:.4f} ms roofline);"
                      f" wall {wall:.4f} ms per step ({roof / wall * 100:.0f}%)")

        state = torch.randn(b, h, d, d, device="cuda", generator=gen) * 0.01
        report("torch in-place multiply of the state", lambda: state.mul_(0.999), "elementwise")
        q, k, v, decay, beta, o = state_only_inputs(b, h, d, gen)
        start = state.clone()
        want = start * decay[..., None]  # the update by torch, to check the kernel once
        delta = (v - torch.einsum("bhk,bhkv->bhv", k, want)) * beta[..., None]
        want += k[..., None] * delta[..., None, :]
        for shape in args.shapes.split(","):
            block_v, warps = (int(n) for n in shape.split("x"))
            grid = (d // block_v, h, b)
            got = start.clone()
            _state_only[grid](q, k, v, decay, beta, got, o, H=h, D=d, BV=block_v, num_warps=warps)
            bench.log(f"B={b} state only (plain Triton) {shape}: max |error| {(got - want).abs().max().item():.1e}")
            for fusion in (True, False):  # without contraction, as XLA compiles a Pallas Triton kernel
                report(f"state only (plain Triton{'' if fusion else ', no fp contraction'}) {shape}",
                       lambda: _state_only[grid](q, k, v, decay, beta, state, o, H=h, D=d, BV=block_v, num_warps=warps,
                                                 enable_fp_fusion=fusion),
                       "_state_only")
            compiled = _state_only[grid](q, k, v, decay, beta, state, o, H=h, D=d, BV=block_v, num_warps=warps)
            for carveout in (100, 0, -1):  # the SM's shared memory / L1 split: XLA's launches get all the shared memory
                set_carveout(compiled, carveout)
                report(f"state only (plain Triton, shared memory carveout {carveout}) {shape}",
                       lambda: _state_only[grid](q, k, v, decay, beta, state, o, H=h, D=d, BV=block_v, num_warps=warps),
                       "_state_only")
        qb, kb, vb, gg, betab = fla_inputs(b, h, d, gen)
        report("fla fused_recurrent_kda_fwd", lambda: fused_recurrent_kda_fwd(
            qb, kb, vb, gg, betab, initial_state=state, output_final_state=True, inplace_final_state=True,
            use_qk_l2norm_in_kernel=True), "fused_recurrent_kda")


if __name__ == "__main__":
    main()
