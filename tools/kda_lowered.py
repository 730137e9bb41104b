"""The KDA prefill scan's Mosaic GPU kernels as lowered for an H200, on any machine (no GPU): each
kernel's SMEM request, the size of its lowered module (a proxy for code size: an unrolled kernel can
outgrow the instruction cache) and a hash of the module printed without debug info, so that a change
can be shown to leave the GPU code unchanged (same hash) without a device run (tools/lowered_kernels.py
writes every kernel's whole text instead).

    python -m tools.kda_lowered [--shapes "B,T,H,D;..."] [--options '{"block_v": 64}']
"""

import argparse
import hashlib
import json

import jax.numpy as jnp
from jax._src.pallas.mosaic_gpu import lowering as pallas_lowering
from jax.experimental.mosaic.gpu import core as mosaic_core

from pallas_kernels.common import lower_for_h200
from pallas_kernels.kda import prefill_chain_mosaic


def lowered_kernels(shape, options):
    """[(kernel name, SMEM bytes requested, module text without debug info)] of the scan at `shape`."""
    requests, modules = [], []
    init, lower = pallas_lowering.ModuleContext.__init__, mosaic_core.lower_mgpu_module

    def record_request(self, *args, **kwargs):
        init(self, *args, **kwargs)
        requests.append((self.name, self.smem_requested_bytes))

    def record_module(module, *args, **kwargs):
        result = lower(module, *args, **kwargs)
        modules.append(module.operation.get_asm(enable_debug_info=False))
        return result

    args = prefill_chain_mosaic.scan_arg_shapes(*shape)
    pallas_lowering.ModuleContext.__init__, mosaic_core.lower_mgpu_module = record_request, record_module
    try:
        lower_for_h200(lambda *a: prefill_chain_mosaic.chunk_scan(*a, out_dtype=jnp.bfloat16, **options), *args)
    finally:
        pallas_lowering.ModuleContext.__init__, mosaic_core.lower_mgpu_module = init, lower
    return [(name, smem, text) for (name, smem), text in zip(requests, modules, strict=True)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="1,16384,16,128;2,130,3,64")
    parser.add_argument("--options", default="{}", help="keyword arguments of prefill_chain_mosaic.chunk_scan, as JSON")
    args = parser.parse_args()
    options = json.loads(args.options)
    print("| (B, T, H, D) | kernel | SMEM bytes | module bytes (printed) | sha256 of the module, first 16 |")
    print("| --- | --- | --- | --- | --- |")
    for spec in args.shapes.split(";"):
        shape = tuple(int(x) for x in spec.split(","))
        for name, smem, text in lowered_kernels(shape, options):
            digest = hashlib.sha256(text.encode()).hexdigest()[:16]
            print(f"| {shape} | {name} | {smem:,} | {len(text):,} | {digest} |")


if __name__ == "__main__":
    main()
