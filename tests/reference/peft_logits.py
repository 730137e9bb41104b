"""PEFT's reading of a LoRA adapter folder, for tests/model/test_lora.py (run in the reference env):

    peft_logits.py CHECKPOINT ADAPTER IDS.npy OUT.npz

loads transformers' fp32 model of CHECKPOINT, wraps it with `PeftModel.from_pretrained(model,
ADAPTER)`, and writes into OUT.npz the logits of IDS [B, T] (all tokens real) through the adapted
model ("adapted"), after `merge_and_unload()` ("merged"), and of the base alone ("base"), plus the
names of the modules PEFT wrapped ("wrapped")."""

import sys

import numpy as np
import torch
from peft import PeftModel
from transformers import Glm5NextForConditionalGeneration


def main(checkpoint, adapter, ids_path, out):
    ids = torch.from_numpy(np.load(ids_path)).long()
    model = Glm5NextForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        base = model(input_ids=ids).logits.float().numpy()
        peft_model = PeftModel.from_pretrained(model, adapter).eval()
        wrapped = sorted(name for name, module in peft_model.named_modules() if hasattr(module, "lora_A")
                         and len(module.lora_A))
        adapted = peft_model(input_ids=ids).logits.float().numpy()
        merged = peft_model.merge_and_unload()(input_ids=ids).logits.float().numpy()
    np.savez(out, base=base, adapted=adapted, merged=merged, wrapped=np.array(wrapped))


if __name__ == "__main__":
    main(*sys.argv[1:])
