"""The MoE's grouped GEMM: each expert's rows times that expert's weight over an expert-tiled row
layout (`api`), the Mosaic GPU kernel (`grouped_matmul_mosaic`) and its reference (`reference`)."""

from pallas_kernels.moe_gemm.api import ExpertTiles, expert_tiles, grouped_matmul, max_tiles, plan
from pallas_kernels.moe_gemm.grouped_matmul_mosaic import GemmConfig
from pallas_kernels.moe_gemm.reference import grouped_matmul_reference

__all__ = ["ExpertTiles", "GemmConfig", "expert_tiles", "grouped_matmul", "grouped_matmul_reference", "max_tiles", "plan"]
