"""The MoE's grouped GEMM: each expert's rows times that expert's weight over an expert-tiled row
layout (`api`), in bf16 (`grouped_matmul_mosaic`, its weight gradient `expert_outer_mosaic`) and in
block-scaled FP8 (`grouped_matmul_fp8_mosaic`) on Mosaic GPU, and their references (`reference`)."""

from pallas_kernels.moe_gemm.api import (
    ExpertTiles,
    expert_outer_products,
    expert_tiles,
    grouped_matmul,
    grouped_matmul_fp8,
    matmul_fp8,
    max_tiles,
    plan,
    plan_fp8,
)
from pallas_kernels.moe_gemm.expert_outer_mosaic import OuterConfig
from pallas_kernels.moe_gemm.grouped_matmul_fp8_mosaic import Fp8GemmConfig
from pallas_kernels.moe_gemm.grouped_matmul_mosaic import GemmConfig
from pallas_kernels.moe_gemm.reference import (
    expert_outer_reference,
    grouped_matmul_fp8_reference,
    grouped_matmul_reference,
)

__all__ = [
    "ExpertTiles", "Fp8GemmConfig", "GemmConfig", "OuterConfig", "expert_outer_products", "expert_outer_reference",
    "expert_tiles", "grouped_matmul", "grouped_matmul_fp8", "grouped_matmul_fp8_reference", "grouped_matmul_reference",
    "matmul_fp8", "max_tiles", "plan", "plan_fp8",
]
