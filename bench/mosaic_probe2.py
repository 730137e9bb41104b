"""Debug (temporary): which step of kda_intra's start goes wrong on the GPU. Variants:
copy: g TMA -> SMEM -> TMA out (plain or swizzled SMEM); cum_reg: the running-sum product of a
g made in registers; cum_tma: of the TMA'd g."""
import functools
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from pallas_kernels.kda_intra import _COL, _Regs, _iota, _load, _matmul, _operand_smem, _split, _BF16, _F32

C = 64


def body(g_ref, out_ref, g_s, parts, out_s, loaded, *, mode):
    n, h, b = lax.axis_index("n"), lax.axis_index("h"), lax.axis_index("b")
    d = g_s.shape[1]
    tile, square = (C, d), (C, C)
    tokens = pl.ds(n * C, C)
    plgpu.copy_gmem_to_smem(g_ref.at[b, tokens, h], g_s, loaded)
    plgpu.barrier_wait(loaded)
    if mode.startswith("copy"):
        out_s[...] = _load(g_s)
    else:
        g = _load(g_s) if mode.startswith("cum_tma") else (_iota(tile, 0) * 0.01 + _iota(tile, 1) * 0.001).astype(_F32)
        g_hi = g.astype(_BF16)
        g_mid, g_lo = _split(g - g_hi.astype(_F32))
        for part, ref in zip((g_hi, g_mid, g_lo), parts):
            ref[...] = part
        plgpu.commit_smem()
        ones = jnp.where(_iota(square, 1) <= _iota(square, 0), 1.0, 0.0).astype(_BF16)
        out_s[...] = _matmul(tile, [(_Regs(ones), ref) for ref in parts], False)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_s, out_ref.at[b, h, tokens])
    plgpu.wait_smem_to_gmem(0)


def run(g, mode):
    b, t, h, d = g.shape
    swz = mode.endswith("swz")
    k = plgpu.kernel(
        functools.partial(body, mode=mode),
        out_type=jax.ShapeDtypeStruct((b, h, t, d), _F32),
        grid=(t // C, h, b), grid_names=("n", "h", "b"),
        scratch_types=(_operand_smem((C, d), _F32) if swz else plgpu.SMEM((C, d), _F32), tuple(_operand_smem((C, d)) for _ in range(3)),
                       plgpu.SMEM((C, d), _F32), plgpu.Barrier(num_arrivals=1)),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane, approx_math=True),
    )
    return k(g)


def main():
    for b, t, h, d in [(1, 64, 1, 128), (2, 128, 3, 64)]:
        g = -5.0 * jax.nn.sigmoid(2.0 * jax.random.normal(jax.random.key(0), (b, t, h, d)))
        gn = np.asarray(g, np.float64)
        reg = (np.arange(C)[:, None] * 0.01 + np.arange(d)[None, :] * 0.001)
        for mode in ("copy", "copy_swz", "cum_reg", "cum_tma", "cum_tma_swz"):
            out = np.asarray(run(g, mode), np.float64).transpose(0, 2, 1, 3)  # [b, t, h, d]
            if mode.startswith("copy"):
                want = gn
            elif mode == "cum_reg":
                want = np.broadcast_to(np.tile(np.cumsum(reg, 0), (t // C, 1))[None, :, None, :], gn.shape)
            else:
                want = np.cumsum(gn.reshape(b, t // C, C, h, d), axis=2).reshape(b, t, h, d)
            bad_rows = np.unique(np.nonzero(np.abs(out - want).max(axis=(0, 2, 3)) > 1e-3)[0] % C)
            print((b, t, h, d), mode, "err", np.abs(out - want).max(), "bad rows", bad_rows.tolist()[:12], flush=True)


if __name__ == "__main__":
    main()
