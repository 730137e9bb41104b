"""DSA's attention in the absorbed latent form over each query's selected tokens (`api`): the Triton
kernel (`sparse_attend_triton`), the Mosaic GPU one (`sparse_attend_mosaic`), their reference
(`reference`) and the kernels' gradient over the selection (`backward`)."""

from pallas_kernels.latent_attention.api import sparse_latent_attention
from pallas_kernels.latent_attention.backward import sparse_latent_attention_backward
from pallas_kernels.latent_attention.reference import sparse_latent_attention_reference
from pallas_kernels.latent_attention.sparse_attend_mosaic import MosaicConfig
from pallas_kernels.latent_attention.sparse_attend_triton import KernelConfig

__all__ = [
    "KernelConfig",
    "MosaicConfig",
    "sparse_latent_attention",
    "sparse_latent_attention_backward",
    "sparse_latent_attention_reference",
]
