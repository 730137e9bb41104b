"""Training: the causal LM loss, a training step over the train form's parameters, and the
gradients of a checkpoint's own tensors keyed as transformers'."""

from .gradients import checkpoint_gradients, module_named_tensors, params_of_tensors
from .loss import expert_loads, next_token_loss, sequence_balance_loss, token_loss
from .step import STATIC, TrainState, balance_router, inference_params, init_train_state, train_step, trainable

__all__ = [
    "STATIC", "TrainState", "balance_router", "checkpoint_gradients", "expert_loads", "inference_params",
    "init_train_state", "module_named_tensors", "next_token_loss", "params_of_tensors", "sequence_balance_loss",
    "token_loss", "train_step", "trainable",
]
