"""Training: the causal LM loss, a training step over the train form's parameters (or over LoRA
adapters on a frozen base), and the gradients of a checkpoint's own tensors keyed as transformers'."""

from .gradients import checkpoint_gradients, module_named_tensors, params_of_tensors
from .loss import expert_loads, next_token_loss, sequence_balance_loss, token_loss
from .step import (
    LORA_STATIC,
    STATIC,
    TrainState,
    balance_router,
    inference_params,
    init_train_state,
    lora_train_step,
    objective,
    train_step,
    trainable,
)

__all__ = [
    "LORA_STATIC", "STATIC", "TrainState", "balance_router", "checkpoint_gradients", "expert_loads", "inference_params",
    "init_train_state", "lora_train_step", "module_named_tensors", "next_token_loss", "objective", "params_of_tensors",
    "sequence_balance_loss", "token_loss", "train_step", "trainable",
]
