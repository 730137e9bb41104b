"""Goldens of the FP8 tiny checkpoint (checkpoints/glm5next-tiny-fp8, in the release's block-scaled FP8
format), made by make_goldens.py's main in the reference env.

transformers reads the checkpoint on a CPU by dequantizing each converted weight at load (e4m3 value x
its 128 x 128 block's weight_scale_inv, a float32 product), so its fp32 model is the checkpoint's
exact values. From it:
- cases/fp8_left_pad, fp8_right_pad: fp32 logits on 100-token rows (25 pools, so DSA is sparse);
- cases/fp8_generate: 32 greedy tokens, as make_goldens.generation_case;
- layers/fp8_quantizer: transformers' quantizer (`Fp8Quantize`, the release's) on every linear of the
  shipped bf16 checkpoint (checkpoints/glm5next-tiny) that the release converts and whose 128 x 128
  blocks are whole (it leaves the others unquantized): the e4m3 codes as bytes and the block scales,
  for `glm5next-jax convert --to fp8`;
- layers/fp8_weights: every converted weight as transformers holds it after the load, under the
  file's names (per-expert tensors split back by transformers' own save-time conversion), and the
  modules transformers' FP8 loading makes quantized where FP8 runs (a GPU) under the checkpoint's
  `modules_to_not_convert`: the checkpoint's float8 tensors must be exactly theirs.
"""

import os

import numpy as np
import torch
from make_goldens import ROOT, SHIPPED, draw_ids, generation_case, load, padded_mask, save_case, save_layer
from make_tiny import release_fp8  # checkpoints/ is on the path from make_goldens
from safetensors import safe_open
from transformers import FineGrainedFP8Config, Glm5NextConfig, Glm5NextForConditionalGeneration
from transformers.core_model_loading import revert_weight_conversion
from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear, Fp8Quantize
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

FP8 = os.path.join(ROOT, "checkpoints", "glm5next-tiny-fp8")


def fp8_modules():
    """The modules (transformers' names) that its FP8 loading replaces with FP8Linear / FP8Experts where
    FP8 runs: the quantizer's own preprocessing of the pre-quantized checkpoint, on the meta device."""
    config = Glm5NextConfig.from_pretrained(FP8)
    quantizer = FineGrainedFP8HfQuantizer(FineGrainedFP8Config(**config.quantization_config), pre_quantized=True)
    with torch.device("meta"):
        model = Glm5NextForConditionalGeneration(config)
    quantizer.preprocess_model(model)
    return sorted(name for name, module in model.named_modules() if isinstance(module, (FP8Linear, FP8Experts)))


@torch.no_grad()
def weights_case(out, model):
    """transformers' fp32 values of the converted weights, named as in the file."""
    with torch.device("meta"):
        unloaded = Glm5NextForConditionalGeneration(model.config)  # save-time names without the load's FP8 readers
    stored = revert_weight_conversion(unloaded, model.state_dict())
    weights = {name: stored[name].numpy() for name in float8_names()}
    return save_layer(out, "fp8_weights", model.config.text_config, modules=np.array(fp8_modules()), **weights)


def float8_names():
    """The checkpoint's float8 tensors, from the files' headers."""
    names = []
    for file in sorted(f for f in os.listdir(FP8) if f.endswith(".safetensors")):
        with safe_open(os.path.join(FP8, file), "pt") as f:
            names += [name for name in f.keys() if f.get_slice(name).get_dtype() == "F8_E4M3"]
    return names


@torch.no_grad()
def quantizer_case(out):
    """Fp8Quantize on the shipped checkpoint's converted linears with whole blocks, as make_tiny's save_fp8."""
    state = {}
    for file in sorted(f for f in os.listdir(SHIPPED) if f.endswith(".safetensors")):
        with safe_open(os.path.join(SHIPPED, file), "pt") as f:
            state.update({name: f.get_tensor(name) for name in f.keys()})
    config = FineGrainedFP8Config(**release_fp8.quantization_config(state))
    quantize = Fp8Quantize(FineGrainedFP8HfQuantizer(config))
    arrays = {}
    for name in release_fp8.converted(state):
        if all(n % release_fp8.BLOCK == 0 for n in state[name].shape):
            quantized = quantize.convert({name: state[name]})
            arrays[name] = quantized[name].view(torch.uint8).numpy()
            arrays[release_fp8.scale_name(name)] = quantized[release_fp8.scale_name(name)].numpy()
    return save_layer(out, "fp8_quantizer", Glm5NextConfig.from_pretrained(SHIPPED).text_config, **arrays)


def add_to(manifest, out):
    """The FP8 checkpoint's cases and weights, added to the manifest's lists."""
    model = load(FP8, torch.float32)
    gen = torch.Generator().manual_seed(4321)
    for name, mask in (("fp8_left_pad", padded_mask([100, 63], 100, "left")),
                       ("fp8_right_pad", padded_mask([71, 100], 100, "right"))):
        manifest["cases"].append(save_case(out, name, "fp8", model, draw_ids(gen, model, mask), mask))
    manifest["cases"].append(generation_case(out, FP8, "fp8_generate"))
    manifest["layers"].append(weights_case(out, model))
    manifest["layers"].append(quantizer_case(out))
