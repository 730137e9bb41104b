"""Training: the causal LM loss, a training step over the train form's parameters, and the
gradients of a checkpoint's own tensors keyed as transformers'."""

from .gradients import checkpoint_gradients, module_named_tensors, params_of_tensors
from .loss import next_token_loss
from .step import STATIC, TrainState, inference_params, init_train_state, train_step, trainable

__all__ = [
    "STATIC", "TrainState", "checkpoint_gradients", "inference_params", "init_train_state", "module_named_tensors",
    "next_token_loss", "params_of_tensors", "train_step", "trainable",
]
