"""GLM-5-Next (GLM-5.3) in JAX: pure functions over a parameter pytree, loaded from transformers checkpoints."""

from .cache import init_cache
from .checkpoint import load_checkpoint
from .config import Config
from .errors import InputError, MissingFileError
from .generate import generate
from .inference import decode_step, prefill
from .model import forward
from .params import init_params, param_axes, param_shapes

__all__ = [
    "Config", "InputError", "MissingFileError", "decode_step", "forward", "generate", "init_cache", "init_params",
    "load_checkpoint", "param_axes", "param_shapes", "prefill",
]
