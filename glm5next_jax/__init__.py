"""GLM-5-Next (GLM-5.3) in JAX: pure functions over a parameter pytree, loaded from transformers checkpoints."""

from .checkpoint import load_checkpoint
from .config import Config
from .model import forward
from .params import init_params, param_axes, param_shapes

__all__ = ["Config", "forward", "init_params", "load_checkpoint", "param_axes", "param_shapes"]
