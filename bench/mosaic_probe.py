"""Probes of Mosaic GPU building blocks used by kda_intra, compiled vs interpreted (GPU bisection aid):
the running-sum product tril(ones) @ x with x split into bf16 parts, in separate SMEM buffers or one
[parts, C, D] buffer. On the H200 (2026-11-30) a [3, 64, 128] bf16 buffer gave garbage (1e37) where
three [64, 128] buffers and a [2, 64, 128] one were right; kda_intra uses separate buffers.

    PYTHONPATH=$PWD python3 bench/mosaic_probe.py
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda_intra import _COL, _Regs, _iota, _load, _matmul, _operand_smem, _split

C, D = 64, 128
F32, BF16 = jnp.float32, jnp.bfloat16


def kernel_tril(x_ref, o_ref, row_ref, x_s, parts_s, o_s, bar, *, interpret, n_parts, separate, same):

    plgpu.copy_gmem_to_smem(x_ref, x_s, bar)
    plgpu.barrier_wait(bar)
    x = _load(x_s)
    parts, rest = [], x
    for i in range(n_parts):
        p = rest.astype(BF16)
        rest = rest - p.astype(F32)
        part_ref(parts_s, i, separate)[...] = p
    plgpu.commit_smem()
    ones = jnp.where(_iota((C, C), 1) <= _iota((C, C), 0), 1.0, 0.0).astype(BF16)
    cum = _matmul((C, D), [(_Regs(ones), part_ref(parts_s, 0 if same else i, separate)) for i in range(n_parts)], interpret)
    o_s[...] = cum
    plgpu.commit_smem()
    row_ref[...] = _load(o_s.at[C - 1], _COL)
    plgpu.copy_smem_to_gmem(o_s, o_ref)
    plgpu.wait_smem_to_gmem(0)


def part_ref(parts_s, i, separate):
    return parts_s[i] if separate else parts_s.at[i]


def run_tril(interpret, n_parts, x_plain, separate=False, same=False):
    scratch = (
        plgpu.SMEM((C, D), F32) if x_plain else _operand_smem((C, D), F32),
        tuple(_operand_smem((C, D)) for _ in range(n_parts)) if separate else _operand_smem((n_parts, C, D)),
        plgpu.SMEM((C, D), F32),
        plgpu.Barrier(num_arrivals=1),
    )
    return plgpu.kernel(
        functools.partial(kernel_tril, interpret=interpret, n_parts=n_parts, separate=separate, same=same),
        out_type=(jax.ShapeDtypeStruct((C, D), F32), jax.ShapeDtypeStruct((D,), F32)),
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane, approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )


def main():
    x = -5.0 * jax.nn.sigmoid(jax.random.normal(jax.random.key(0), (C, D)))
    want = np.cumsum(np.asarray(x, np.float64), axis=0)
    for n_parts, separate, same in [(1, False, False), (2, False, False), (3, False, False), (3, True, False), (2, True, False), (3, False, True), (3, True, True)]:
        for interpret in (True, False):
            try:
                cum, row = jax.jit(run_tril(interpret, n_parts, True, separate, same))(x)
            except Exception as e:
                print(f"parts={n_parts} separate={separate} same={same} interpret={interpret}: {type(e).__name__} {str(e)[:200]}")
                continue
            cum, row = np.asarray(cum), np.asarray(row)
            print(f"tril@x parts={n_parts} separate={separate} same_part={same} interpret={interpret}: "
                  f"cum err {np.abs(cum - want).max():.2e}  row63 err {np.abs(row - want[-1]).max():.2e}  cum[5,:3] {cum[5, :3]}", flush=True)


if __name__ == "__main__":
    main()
