"""Training: the causal LM loss and the gradients of a checkpoint's own tensors."""

from .gradients import checkpoint_gradients, module_named_tensors, params_of_tensors
from .loss import next_token_loss

__all__ = ["checkpoint_gradients", "module_named_tensors", "next_token_loss", "params_of_tensors"]
