"""Gradient goldens: transformers' own autograd through the fp32 model, made by make_goldens.py's
main in the reference env (after the variant models are saved).

For each case, `gradients/<case>.npz` holds the input ids and mask, the model's name, the loss (mean
next-token cross-entropy over positions whose token and target are both real) and, under
"grad:<name>", every gradient `loss.backward()` fills, keyed as `named_parameters()`.
"""

import os

import numpy as np
import torch
from make_goldens import KERNELS, SHIPPED, draw_ids, load, padded_mask

# case -> (model: "shipped" or a variant saved under OUT/models, mask)
CASES = {
    # Dense regime (35 tokens): DSA equals dense attention.
    "grad_tiny_dense": ("shipped", lambda: torch.ones(2, 35, dtype=torch.long)),
    # Sparse regime with pools and left padding: 150 tokens, 8 pools of 4 selected.
    "grad_tiny_sparse_left_pad": ("shipped", lambda: padded_mask([150, 113], 150, "left")),
    # A DSA layer sharing its neighbour's selection, right padding.
    "grad_shared_right_pad": ("shared", lambda: padded_mask([91, 120], 120, "right")),
    # Group-limited routing.
    "grad_groups": ("groups", lambda: torch.ones(1, 96, dtype=torch.long)),
    # The checkpoint whose widths every kernel takes (sparse, left padding): the bf16 kernel path's case.
    "grad_kernels_left_pad": ("kernels", lambda: padded_mask([100, 71], 100, "left")),
}
SHIPPED_MODELS = {"shipped": SHIPPED, "kernels": KERNELS}


def loss_of(model, ids, mask):
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    counted = (mask[:, :-1] * mask[:, 1:]).bool()
    log_probs = torch.log_softmax(logits[:, :-1], dim=-1)
    picked = log_probs.gather(-1, ids[:, 1:, None])[..., 0]
    return -(picked * counted).sum() / counted.sum()


def add_to(manifest, out):
    os.makedirs(os.path.join(out, "gradients"), exist_ok=True)
    gen = torch.Generator().manual_seed(2468)
    manifest["gradients"] = []
    for case, (model_name, mask_of) in CASES.items():
        model = load(SHIPPED_MODELS.get(model_name) or os.path.join(out, "models", model_name), torch.float32)
        mask = mask_of()
        ids = draw_ids(gen, model, mask)
        model.zero_grad()
        loss = loss_of(model, ids, mask)
        loss.backward()
        grads = {f"grad:{n}": p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
        np.savez(os.path.join(out, "gradients", case + ".npz"), ids=ids.numpy(), mask=mask.numpy(), model=model_name,
                 loss=np.float64(loss.item()), **grads)
        manifest["gradients"].append(case)
