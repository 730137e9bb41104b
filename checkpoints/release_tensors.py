"""The tensors of the published GLM-5.3-Flash-BF16, named, typed and shaped as the release stores them,
from transformers (run in the reference env: torch, transformers 5.23):

    python checkpoints/release_tensors.py [--config tests/model/fixtures/GLM-5.3-Flash.config.json]
        [--out checkpoints/GLM-5.3-Flash.tensors.json.gz]

The model is built on the meta device from the published config.json with the dtypes
`from_pretrained(dtype=bfloat16)` gives (its `_keep_in_fp32_modules_strict` in float32), and its state
dict is mapped to the names `save_pretrained` writes (`revert_weight_conversion`: per-expert tensors,
q/k/v convs, `hc_attn_fn`, ...). transformers drops the MTP layer on load (`layers.45.`,
`shared_head.`), so it is added: one decoder block of the layers' own kind for each of
`num_nextn_predict_layers` layers past the last (a DSA layer with its indexer, and a MoE), and the
DeepSeek-V3 MTP module's own tensors, which the release follows: `enorm`, `hnorm`, `eh_proj` over the
concatenated [embedding; hidden state] and `shared_head.norm`. Its head is the model's lm_head, as in
GLM-4.5's MTP: a [vocab, hidden] `shared_head.head` of its own would add 1.18 GiB, and the published
sizes (305.8 GiB for the FP8 release, 643 GB for the BF16) hold the rest to within 0.02 GiB of
headers without it. The vision tower is transformers' own.

The output is a gzipped JSON list of [name, safetensors dtype, shape] in the order of the names
(transformers' natural order): the manifest `checkpoints/make_replica.py` writes replicas from, so
that neither it nor the tests need torch. tests/reference/make_goldens.py computes the same list, and
a test holds the committed manifest to it.
"""

import argparse
import copy
import gzip
import json
import os

import torch
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration
from transformers.core_model_loading import build_glob_alternation, dot_natural_key, revert_weight_conversion
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextDecoderLayer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PUBLISHED_CONFIG = os.path.join(ROOT, "tests", "model", "fixtures", "GLM-5.3-Flash.config.json")
MANIFEST = os.path.join(ROOT, "checkpoints", "GLM-5.3-Flash.tensors.json.gz")
TEXT = "model.language_model."
SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32"}


def mtp_block_config(text, layers):
    """The text config extended by the MTP layers: each a DSA layer with a full indexer and a MoE."""
    extended = copy.deepcopy(text)
    extended.num_hidden_layers = text.num_hidden_layers + layers
    extended.layer_types = list(text.layer_types) + ["indexed_attention"] * layers
    extended.mlp_layer_types = list(text.mlp_layer_types) + ["sparse"] * layers
    extended.indexer_types = list(text.indexer_types) + ["full"] * layers
    return extended


def release_tensors(config_path=PUBLISHED_CONFIG):
    """[name, dtype, shape] of every tensor of the BF16 release, in transformers' natural order."""
    config = Glm5NextConfig.from_json_file(config_path)
    text = config.text_config
    n, mtp = text.num_hidden_layers, getattr(text, "num_nextn_predict_layers", 0)
    with torch.device("meta"):
        model = Glm5NextForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
        extended = mtp_block_config(text, mtp)
        blocks = {i: Glm5NextTextDecoderLayer(extended, i).to(torch.bfloat16) for i in range(n, n + mtp)}
    state = dict(model.state_dict())
    for i, block in blocks.items():
        state.update({f"{TEXT}layers.{i}.{k}": v for k, v in block.state_dict().items()})
    fp32, _, _ = build_glob_alternation(list(model._get_dtype_plan(torch.bfloat16)))
    state = {k: v.to(torch.float32) if fp32.search(k) else v for k, v in state.items()}
    saved = {k: (SAFETENSORS_DTYPES[v.dtype], list(v.shape)) for k, v in revert_weight_conversion(model, state).items()}
    d = text.hidden_size
    for i in range(n, n + mtp):
        layer = f"{TEXT}layers.{i}."
        saved.update({
            layer + "enorm.weight": ("BF16", [d]), layer + "hnorm.weight": ("BF16", [d]),
            layer + "eh_proj.weight": ("BF16", [d, 2 * d]), layer + "shared_head.norm.weight": ("BF16", [d]),
        })
    return [[name, *saved[name]] for name in sorted(saved, key=dot_natural_key)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=PUBLISHED_CONFIG, help="the published config.json")
    parser.add_argument("--out", default=MANIFEST)
    args = parser.parse_args()
    tensors = release_tensors(args.config)
    with open(args.out, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:  # reproducible bytes
        f.write(json.dumps(tensors, separators=(",", ":")).encode())
    print(f"wrote {args.out}: {len(tensors):,} tensors")


if __name__ == "__main__":
    main()
