"""Make the small HF-format GLM-5-Next checkpoints with transformers (run in the reference env).

    python checkpoints/make_tiny.py checkpoints/glm5next-tiny
    python checkpoints/make_tiny.py checkpoints/glm5next-tiny-kernels --shape kernels --seed 1
    python checkpoints/make_tiny.py checkpoints/glm5next-tiny-fp8 --shape fp8 --fp8 --seed 2

glm5next-tiny is the released structure at toy width; glm5next-tiny-kernels has widths that every
Pallas kernel takes (KDA head dim 64, latent width 64, MoE widths the grouped GEMM's blocks divide),
so the model runs end to end through the kernels in Pallas' interpreter. glm5next-tiny-fp8 is in the
FP8 release's format (`--fp8`, see `save_fp8`).

transformers' own initialisation leaves several parameters at constants (ape zeros, compress gate
ones, router bias zeros, A_log zeros, mHC base zeros and scale ones); `randomise_special` draws
them at random so that every code path carries a signal. Weights are stored in bf16 like the
released checkpoint. `build` is shared with tests/reference/make_goldens.py.
"""

import argparse
import importlib.util
import json
import math
import os

import torch
from transformers import FineGrainedFP8Config, Glm5NextConfig, Glm5NextForConditionalGeneration
from transformers.core_model_loading import revert_weight_conversion
from transformers.integrations.finegrained_fp8 import Fp8Quantize
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

# The package's release split, by its path: this env has no JAX for the package's __init__.
_spec = importlib.util.spec_from_file_location(
    "release_fp8", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "glm5next_jax", "release_fp8.py")
)
release_fp8 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(release_fp8)

# Structure of the released model at toy width: 8 layers (DSA at 3 and 7), 3 dense MLP layers,
# 4 mHC streams, pool size 4, top-k 32 tokens (8 pools) so that sequences past 35 tokens are sparse.
TINY_TEXT = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=32,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_shared_experts=1,
    kv_lora_rank=64,
    q_lora_rank=96,
    qk_nope_head_dim=32,
    v_head_dim=32,
    index_topk=32,
    index_head_dim=32,
    index_n_heads=16,
    index_kpool=4,
    linear_num_heads=4,
    linear_head_dim=32,
    pad_token_id=0,
    eos_token_id=1,
    initializer_range=0.06,
)
TINY_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, projection_intermediate_size=32)


# Widths every kernel takes, in three layers: KDA (scan: head dim 64 or 128), a full DSA layer and the
# shared one after it (latent width 64; indexer heads of 32), MoEs of 16 experts of 64 rows of a
# 128-wide hidden state (the grouped GEMM's 64-row tiles, 64-deep K blocks and 128-wide column blocks).
KERNELS_TEXT = dict(
    TINY_TEXT,
    num_hidden_layers=3,
    layer_types=["linear_attention", "indexed_attention", "indexed_attention"],
    mlp_layer_types=["dense", "sparse", "sparse"],
    indexer_types=["full", "full", "shared"],
    moe_intermediate_size=64,
    linear_num_heads=2,
    linear_head_dim=64,
)
# Every linear the FP8 release converts in whole 128 x 128 blocks (transformers' quantizer leaves any
# other shape unquantized): hidden, q_lora, kv_lora, heads x head dims and both MLP widths multiples of
# 128, hidden 256 so that each spans several blocks. Four layers: three KDA, then DSA; a dense MLP,
# then MoEs of 8 experts (top 2) with a shared expert. No MTP layer: transformers' model has none.
FP8_TEXT = dict(
    TINY_TEXT,
    hidden_size=256,
    num_hidden_layers=4,
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    q_lora_rank=128,
    kv_lora_rank=128,
)
SHAPES = {"tiny": TINY_TEXT, "kernels": KERNELS_TEXT, "fp8": FP8_TEXT}


def tiny_text_config(shape="tiny", **overrides):
    return {**SHAPES[shape], **overrides}


@torch.no_grad()
def randomise_special(model, seed):
    g = torch.Generator().manual_seed(seed)

    def draw(t, lo, hi):
        t.copy_(lo + (hi - lo) * torch.rand(t.shape, generator=g, dtype=torch.float32).to(t.dtype))

    for name, p in model.named_parameters():
        if "index_kpool_compress_ape" in name:
            draw(p, -1.0, 1.0)
        elif "index_kpool_compress_gate" in name:
            draw(p, -0.3, 0.3)
        elif name.endswith("A_log"):
            draw(p, math.log(0.5), math.log(4.0))
        elif name.endswith("_hc.base"):
            draw(p, -1.0, 1.0)
        elif name.endswith("_hc.scale"):
            draw(p, 0.5, 1.5)
        elif name.endswith("o_norm.weight") or name.endswith("layernorm.weight") or name.endswith("k_norm.weight"):
            draw(p, 0.7, 1.3)
        elif name.endswith("k_norm.bias"):
            draw(p, -0.2, 0.2)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            draw(b, -0.1, 0.1)


def build(text_overrides=None, seed=0, shape="tiny"):
    text = tiny_text_config(shape, **(text_overrides or {}))
    tied = text.get("tie_word_embeddings", False)  # read by the multimodal model from its top level
    vision = dict(TINY_VISION, out_hidden_size=text["hidden_size"])  # the merger's output joins the text embeddings
    config = Glm5NextConfig(text_config=text, vision_config=vision, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration(config).eval()
    randomise_special(model, seed + 1)
    return model


def save_fp8(model, out, max_shard_size):
    """`model` saved in the FP8 release's format, with transformers' own save path: the state dict in
    the file's names as `save_pretrained` makes them (`revert_weight_conversion`: per-expert tensors,
    q/k/v convs, ...), the release's converted linears (release_fp8.converted) through transformers'
    quantizer (`Fp8Quantize`: e4m3 values and a float32 `weight_scale_inv` per 128 x 128 block),
    written by `save_pretrained` with the release's quantization_config. (transformers quantizes on
    the fly only on a GPU; this is the same quantizer, called on the state dict.)"""
    state = revert_weight_conversion(model, model.state_dict())
    config = release_fp8.quantization_config(state)
    quantize = Fp8Quantize(FineGrainedFP8HfQuantizer(FineGrainedFP8Config(**config)))
    for name in release_fp8.converted(state):
        quantized = quantize.convert({name: state[name]})
        if release_fp8.scale_name(name) not in quantized:
            raise ValueError(f"{name} {tuple(state[name].shape)}: not whole 128 x 128 blocks, which transformers' "
                             "quantizer leaves unquantized; choose a --shape whose converted linears are")
        state.update(quantized)
    model.config.quantization_config = config
    model.save_pretrained(out, state_dict=state, save_original_format=False, max_shard_size=max_shard_size)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="output directory")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="the base text config")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overrides", default="{}", help="JSON dict of text-config overrides")
    parser.add_argument("--fp8", action="store_true", help="store as the FP8 release does (see save_fp8)")
    args = parser.parse_args()
    model = build(json.loads(args.overrides), args.seed, args.shape).to(torch.bfloat16)
    os.makedirs(args.out, exist_ok=True)
    if args.fp8:
        save_fp8(model, args.out, max_shard_size="1MB")
    else:
        model.save_pretrained(args.out, max_shard_size="1MB")
    n = sum(p.numel() for k, p in model.state_dict().items() if "visual" not in k)
    print(f"wrote {args.out}: {n} text parameters")


if __name__ == "__main__":
    main()
