"""Every Pallas kernel lowered for an H200 (no GPU needed), one text file per kernel launch: the
Mosaic GPU module or the Triton IR the custom call carries, printed without source locations. Two
runs' folders compare with `diff -r`: a change that leaves the kernels' lowering alone (a moved
module, a renamed helper, a named scope) leaves the files equal.

    python -m tools.lowered_kernels OUT_DIR
"""

import argparse
import os
import re

import jax
import jax.numpy as jnp
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir

from pallas_kernels import kda as kda_api
from pallas_kernels import latent_attention, moe_gemm, select_tokens
from pallas_kernels.common import lower_for_h200
from pallas_kernels.kda import prefill_chain_mosaic

sds = jax.ShapeDtypeStruct


def scan(b, t, h, d, **options):
    return (lambda *a: prefill_chain_mosaic.chunk_scan(*a, out_dtype=jnp.bfloat16, **options),
            prefill_chain_mosaic.scan_arg_shapes(b, t, h, d))


def decode(b, h, d):
    args = jax.eval_shape(lambda: kda_api.random_decode_inputs(jax.random.key(0), b, h, d))
    return lambda x: kda_api.kda_decode_step(**x, lower_bound=-5.0, implementation="pallas"), (args,)


def attention(b, t, s, splits, fp8=False, mosaic=False):
    config = (latent_attention.MosaicConfig if mosaic else latent_attention.KernelConfig)(splits=splits)
    if not fp8:
        return (lambda q, l, i: latent_attention.sparse_latent_attention(
            q, l, i, scale=1 / 16, implementation="pallas", config=config, distinct_indices=True),
            (sds((b, t, 64, 512), jnp.bfloat16), sds((b, s, 512), jnp.bfloat16), sds((b, t, 2051), jnp.int32)))
    pages = s // 64
    return (lambda q, l, sc, i, pt: latent_attention.sparse_latent_attention(
        q, l, i, scale=1 / 16, latent_scales=sc, page_table=pt, implementation="pallas", config=config),
        (sds((b, t, 64, 512), jnp.bfloat16), sds((b * pages, 64, 512), jnp.float8_e4m3fn),
         sds((b * pages, 64), jnp.float32), sds((b, t, 2051), jnp.int32), sds((b, pages), jnp.int32)))


def selection(b, t, s, backend="triton"):
    return (lambda q, w, k, m, p: select_tokens.select_tokens(
        q, w, k, m, p, index_topk=2048, pool_size=4, implementation="pallas", backend=backend),
        (sds((b, t, 32, 128), jnp.bfloat16), sds((b, t, 32), jnp.float32), sds((b, s // 4, 128), jnp.bfloat16),
         sds((b, s), jnp.bool_), sds((b, t), jnp.int32)))


def grouped_matmul(rows, block_rows, k, n):
    config = moe_gemm.GemmConfig(block_rows=block_rows)
    tiles = moe_gemm.max_tiles(rows, 288, block_rows)
    return (lambda *a: moe_gemm.grouped_matmul(*a, implementation="pallas", config=config),
            (sds((tiles * block_rows, k), jnp.bfloat16), sds((288, k, n), jnp.bfloat16), sds((tiles,), jnp.int32),
             sds((), jnp.int32)))


CASES = {
    "scan_2x130x2x64": scan(2, 130, 2, 64),
    "scan_1x16384x16x128": scan(1, 16384, 16, 128),
    "scan_2x130x80x64_wide": scan(2, 130, 80, 64),
    "scan_1x8192x64x128_one_slot_multicast": scan(1, 8192, 64, 128, block_v=64, value_slots=1, multicast=True),
    "scan_1x16384x16x128_multicast_two_slots": scan(1, 16384, 16, 128, value_slots=2, multicast=True),
    "scan_2x130x3x64_three_products": scan(2, 130, 3, 64, o_products=3),
    "scan_2x130x3x64_one_product": scan(2, 130, 3, 64, o_products=1),
    "decode_1x64x128_fused": decode(1, 64, 128),
    "decode_16x64x128_two_kernels": decode(16, 64, 128),
    "decode_3x2x64_fused": decode(3, 2, 64),
    "attention_prefill_4096": attention(1, 4096, 4096, 1),
    "attention_decode_8x32768": attention(8, 1, 32768, 32),
    "attention_decode_fp8_8x4096": attention(8, 1, 4096, None, fp8=True),
    "attention_prefill_4096_mosaic": attention(1, 4096, 4096, 1, mosaic=True),
    "attention_decode_fp8_64x32768_mosaic": attention(64, 1, 32768, 2, fp8=True, mosaic=True),  # 2 splits: the GPU's choice
    "selection_decode_8x4160": selection(8, 1, 4160),
    "selection_prefill_4096": selection(1, 4096, 4096),
    "selection_decode_64x131072_mosaic": selection(64, 1, 131072, backend="mosaic"),
    "selection_prefill_4096_mosaic": selection(1, 4096, 4096, backend="mosaic"),
    "grouped_matmul_65536_rows": grouped_matmul(65536, 128, 4096, 4096),
    "grouped_matmul_64_rows": grouped_matmul(64, 64, 2048, 4096),
}


def normalised(text):
    """What differs between two runs of the same kernels goes: the source files and lines Triton's IR
    keeps in its printed locations, and the number Mosaic GPU counts its dumps by within a process."""
    text = re.sub(r'"[^"]*\.py":\d+:\d+( to (\d+:)?\d+)?', '"<source>"', text)
    return re.sub(r'(dump_basename = "\w+?)_\d+"', r'\1"', text)


def kernel_texts(lowered):
    """(custom call target, the kernel's IR as text without locations) for each kernel launch."""
    found = []

    def walk(op):
        for region in op.regions:
            for block in region:
                for inner in block.operations:
                    if inner.operation.name == "stablehlo.custom_call":
                        found.append(inner.operation)
                    walk(inner.operation)

    walk(lowered.compiler_ir("stablehlo").operation)
    texts = []
    for call in found:
        target = ir.StringAttr(call.attributes["call_target_name"]).value
        if target == "mosaic_gpu_v2":
            module = ir.StringAttr(ir.DictAttr(call.attributes["mhlo.backend_config"])["module"]).value_bytes
        elif target == "__gpu$xla.gpu.triton":
            module = ir.StringAttr(ir.DictAttr(call.attributes["mhlo.backend_config"])["ir"]).value_bytes
        else:
            continue
        context = mlir.make_ir_context()
        context.allow_unregistered_dialects = True
        with context:
            texts.append((target, normalised(ir.Module.parse(module).operation.get_asm(enable_debug_info=False))))
    return texts


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="folder for the texts (created)")
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="only these cases")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for name in args.case or CASES:
        fn, fn_args = CASES[name]
        texts = kernel_texts(lower_for_h200(fn, *fn_args))
        for i, (target, text) in enumerate(texts):
            with open(os.path.join(args.out, f"{name}.{i}.{target.rsplit('.', 1)[-1]}.mlir"), "w") as f:
                f.write(text)
        print(f"{name}: {len(texts)} kernels ({', '.join(t for t, _ in texts)})", flush=True)


if __name__ == "__main__":
    main()
