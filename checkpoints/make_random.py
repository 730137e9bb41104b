"""Write a random GLM-5-Next checkpoint in the release format, at any size, without transformers.

    python checkpoints/make_random.py OUT [--layers 4] [--set moe_intermediate_size=256 ...] [--shard-gb 4] [--fp8]

The config is the released one (`glm5next_jax.Config()`: 45 layers, hidden 4096, 288 experts) with
`--layers` and any `--set name=value` changes; the tensors are named and shaped as the release
stores them (per-expert gate/up/down, q/k/v convs, `hc_attn_fn`, ...), bf16, in safetensors shards
of at most `--shard-gb` GB with `model.safetensors.index.json`. Tensors are drawn and written one at
a time (the host holds one tensor), so the released size (585 GiB) can be written where the disk
holds it. Weights ~ N(0, 0.02); norms 1; the gates', decays' and mHC's vectors drawn in ranges a
trained model has (A_log of rates 0.5-4, mHC scales 0.5-1.5), so the forward is well scaled.

`--fp8` writes the FP8 release's format instead: the linears it converts (release_fp8.converted)
as float8_e4m3fn with a float32 `weight_scale_inv` per 128 x 128 block (pallas_kernels.block_fp8's
quantizer: scale = amax / 448), config.json with the release's `quantization_config`. The draws are
the same as without it (one seed, one bf16 checkpoint and its FP8 form).
"""

import argparse
import ast
import json
import math
import os
import sys

import jax
import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from glm5next_jax import release_fp8  # noqa: E402
from glm5next_jax.config import DSA, Config  # noqa: E402
from glm5next_jax.safetensors_write import nbytes, plan_shards, write_shards  # noqa: E402
from pallas_kernels import block_fp8  # noqa: E402

PREFIX = "model.language_model."
def release_tensors(c: Config):
    """(name, shape, how it is drawn) of every text tensor, in the release naming."""
    d, ch, k = c.hidden_size, c.kda_dim, c.linear_conv_kernel_dim
    out = [("embed_tokens.weight", (c.vocab_size, d), "normal"), ("norm.weight", (d,), "ones")]
    width = (2 + c.hc_mult) * c.hc_mult
    for i in range(c.num_hidden_layers):
        L = f"layers.{i}."
        for site in ("attn", "ffn"):
            out += [(L + f"hc_{site}_fn", (width, c.hc_mult * d), "normal"), (L + f"hc_{site}_base", (width,), "unit"),
                    (L + f"hc_{site}_scale", (3,), "scale")]
        out += [(L + "input_layernorm.weight", (d,), "ones"), (L + "post_attention_layernorm.weight", (d,), "ones")]
        a = L + "self_attn."
        if c.layer_types[i] == DSA:
            ql, r, heads = c.q_lora_rank, c.kv_lora_rank, c.num_attention_heads
            out += [
                (a + "q_a_proj.weight", (ql, d), "normal"), (a + "q_a_layernorm.weight", (ql,), "ones"),
                (a + "q_b_proj.weight", (heads * c.qk_head_dim, ql), "normal"),
                (a + "kv_a_proj_with_mqa.weight", (r, d), "normal"), (a + "kv_a_layernorm.weight", (r,), "ones"),
                (a + "kv_b_proj.weight", (heads * (c.qk_nope_head_dim + c.v_head_dim), r), "normal"),
                (a + "o_proj.weight", (d, heads * c.v_head_dim), "normal"),
            ]
            if c.indexer_types[i] == "full":
                x, nh, hd = a + "indexer.", c.index_n_heads, c.index_head_dim
                out += [
                    (x + "wq_b.weight", (nh * hd, ql), "normal"), (x + "wk.weight", (hd, d), "normal"),
                    (x + "k_norm.weight", (hd,), "ones"), (x + "k_norm.bias", (hd,), "zeros"),
                    (x + "index_kpool_compress_gate", (hd, d), "normal"), (x + "weights_proj.weight", (nh, d), "normal"),
                    (x + "index_kpool_compress_ape", (c.index_kpool, hd), "unit"),
                ]
        else:
            h, dk = c.linear_num_heads, c.linear_head_dim
            out += [(a + f"{n}_proj.weight", (ch, d), "normal") for n in "qkv"]
            out += [(a + f"{n}_conv1d.weight", (ch, 1, k), "conv") for n in "qkv"]
            out += [
                (a + "f_a_proj.weight", (dk, d), "normal"), (a + "f_b_proj.weight", (ch, dk), "normal"),
                (a + "dt_bias", (ch,), "small"), (a + "A_log", (h,), "a_log"), (a + "b_proj.weight", (h, d), "normal"),
                (a + "g_a_proj.weight", (dk, d), "normal"), (a + "g_b_proj.weight", (ch, dk), "normal"),
                (a + "o_norm.weight", (dk,), "ones"), (a + "o_proj.weight", (d, ch), "normal"),
            ]
        m = L + "mlp."
        if c.mlp_layer_types[i] == "sparse":
            e, mi = c.n_routed_experts, c.moe_intermediate_size
            out += [(m + "gate.weight", (e, d), "normal"), (m + "gate.e_score_correction_bias", (e,), "small")]
            for j in range(e):
                x = m + f"experts.{j}."
                out += [(x + "gate_proj.weight", (mi, d), "normal"), (x + "up_proj.weight", (mi, d), "normal"),
                        (x + "down_proj.weight", (d, mi), "normal")]
            if c.n_shared_experts:
                si = mi * c.n_shared_experts
                out += [(m + "shared_experts.gate_proj.weight", (si, d), "normal"),
                        (m + "shared_experts.up_proj.weight", (si, d), "normal"),
                        (m + "shared_experts.down_proj.weight", (d, si), "normal")]
        else:
            out += [(m + "gate_proj.weight", (c.intermediate_size, d), "normal"),
                    (m + "up_proj.weight", (c.intermediate_size, d), "normal"),
                    (m + "down_proj.weight", (d, c.intermediate_size), "normal")]
    out = [(PREFIX + name, shape, how) for name, shape, how in out]
    if not c.tie_word_embeddings:
        out.append(("lm_head.weight", (c.vocab_size, d), "normal"))
    return out


def draw(rng, shape, how):
    n = math.prod(shape)
    if how == "normal":
        x = rng.standard_normal(n, np.float32) * np.float32(0.02)
    elif how == "ones":
        x = np.ones(n, np.float32)
    elif how == "zeros":
        x = np.zeros(n, np.float32)
    elif how == "unit":
        x = rng.uniform(-1, 1, n).astype(np.float32)
    elif how == "scale":
        x = rng.uniform(0.5, 1.5, n).astype(np.float32)
    elif how == "small":
        x = rng.uniform(-0.1, 0.1, n).astype(np.float32)
    elif how == "a_log":
        x = np.log(rng.uniform(0.5, 4.0, n)).astype(np.float32)
    elif how == "conv":
        x = rng.standard_normal(n, np.float32) * np.float32(0.5)
    else:
        raise ValueError(how)
    return x.astype(ml_dtypes.bfloat16).reshape(shape)


def stored(name, shape, fp8_names):
    """[(name, safetensors dtype, shape)] that a drawn tensor is written as: itself in bf16, or, where
    it is one of `fp8_names`, its e4m3 values and their block scales."""
    if name in fp8_names:
        return [(name, "F8_E4M3", shape), (release_fp8.scale_name(name), "F32", release_fp8.scale_shape(shape))]
    return [(name, "BF16", shape)]


def write(out, config: Config, shard_bytes: int, seed: int = 0, fp8: bool = False):
    """The checkpoint at `out`: config.json, the shards, the index; returns the tensors' bytes."""
    os.makedirs(out, exist_ok=True)
    tensors = release_tensors(config)
    names = [name for name, _, _ in tensors]
    how = {name: how for name, _, how in tensors}
    fp8_names = set(release_fp8.converted(names)) if fp8 else set()
    groups = [stored(name, shape, fp8_names) for name, shape, _ in tensors]
    rng = np.random.default_rng(seed)
    quantize = jax.jit(block_fp8.quantize_blocks)

    def arrays_of(group):
        name, _, shape = group[0]
        x = draw(rng, shape, how[name])
        return [np.asarray(a) for a in quantize(x.astype(np.float32))] if name in fp8_names else [x]

    write_shards(out, plan_shards(groups, shard_bytes), arrays_of)
    total = sum(nbytes(group) for group in groups)
    text_config = {**config.to_dict(), "model_type": "glm5_next_text", "eos_token_id": list(config.eos_token_id)}
    quantization = {"quantization_config": release_fp8.quantization_config(names)} if fp8 else {}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
                   "tie_word_embeddings": config.tie_word_embeddings, **quantization, "text_config": text_config}, f, indent=1)
    return total


def config_of(layers=None, settings=()):
    """The released config with `layers` layers and `name=value` settings (Python literals)."""
    changes = {}
    for setting in settings:
        name, _, value = setting.partition("=")
        changes[name] = ast.literal_eval(value)
    if layers is not None:
        changes["num_hidden_layers"] = layers
        for name in ("layer_types", "mlp_layer_types", "indexer_types"):
            changes.setdefault(name, ())  # re-derived for the new depth
    return Config(**{**Config().to_dict(), **changes})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, help="num_hidden_layers (default: the released 45)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE", help="a config field, e.g. moe_intermediate_size=256"
    )
    parser.add_argument("--shard-gb", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fp8", action="store_true", help="the FP8 release's format (block-scaled float8 linears)")
    args = parser.parse_args()
    config = config_of(args.layers, args.set)
    total = write(args.out, config, int(args.shard_gb * 2**30), args.seed, args.fp8)
    print(f"wrote {args.out}: {total / 2**30:.2f} GiB, {config.num_hidden_layers} layers, "
          f"{sum(math.prod(s) for _, s, _ in release_tensors(config)) / 1e9:.2f} B parameters")


if __name__ == "__main__":
    main()
