"""Write a full-size replica of a published GLM-5.3-Flash checkpoint: every tensor of the release
(text model, MTP layer, vision tower) with its published name, dtype and shape, in the published
number of shards, with model.safetensors.index.json and config.json; each shard a safetensors header
followed by a hole the size of its data (a sparse file: hundreds of GB on paper, a few MB on disk).

    python checkpoints/make_replica.py OUT --variant fp8     # GLM-5.3-Flash: 62 files, ~305.8 GiB
    python checkpoints/make_replica.py OUT --variant bf16    # GLM-5.3-Flash-BF16: 120 files, ~643 GB

No tensor holds values: a replica serves `glm5next-jax check` and the loader's dry run, which read
headers alone. The tensors come from `checkpoints/GLM-5.3-Flash.tensors.json.gz` (the BF16 release,
made by checkpoints/release_tensors.py with transformers), so this script needs neither torch nor
transformers. The FP8 variant stores as float8_e4m3fn, each with its float32 `weight_scale_inv` of
[ceil(out/128), ceil(in/128)] blocks, the dense MLPs, the routed and shared experts and the DSA
layers' q_a, q_b, kv_a and o projections, the MTP layer's included; everything else stays as in the
BF16 release (KDA layers, kv_b, the indexer, the router, embeddings, lm_head, the MTP layer's eh_proj
and head, the vision tower), and config.json's quantization_config lists those modules in
`modules_to_not_convert`. Shards hold whole tensors in manifest order, a scale right after its weight,
cut where the running total of bytes crosses each 1/N of the whole.
"""

import argparse
import gzip
import json
import os
import struct
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from glm5next_jax import release_fp8  # noqa: E402
from glm5next_jax.config import Config  # noqa: E402
from glm5next_jax.safetensors_write import nbytes, shard_header  # noqa: E402

MANIFEST = os.path.join(ROOT, "checkpoints", "GLM-5.3-Flash.tensors.json.gz")
PUBLISHED_CONFIG = os.path.join(ROOT, "tests", "model", "fixtures", "GLM-5.3-Flash.config.json")
FILES = {"fp8": 62, "bf16": 120}  # the published shard counts


def manifest():
    """[(name, dtype, shape)] of the BF16 release."""
    with gzip.open(MANIFEST, "rt") as f:
        return [(name, dtype, tuple(shape)) for name, dtype, shape in json.load(f)]


def release(variant):
    """[(name, dtype, shape)] of a variant's tensors, in order (a scale right after its weight)."""
    tensors = manifest()
    if variant == "bf16":
        return tensors
    fp8, out = set(release_fp8.converted(name for name, _, _ in tensors)), []
    for name, dtype, shape in tensors:
        if name in fp8:
            out += [(name, "F8_E4M3", shape), (release_fp8.scale_name(name), "F32", release_fp8.scale_shape(shape))]
        else:
            out.append((name, dtype, shape))
    return out


def shards(tensors, files):
    """The tensors cut into `files` runs of whole tensors, each starting where the running total of
    bytes reaches its share of the whole."""
    total = nbytes(tensors)
    out, start = [[] for _ in range(files)], 0
    for tensor in tensors:
        out[min(files - 1, start * files // total)].append(tensor)
        start += nbytes([tensor])
    if any(not shard for shard in out):
        raise ValueError(f"a tensor spans more than 1/{files} of the checkpoint: {files} shards cannot all hold one")
    return out


def write_shard(file, tensors):
    """A safetensors header for `tensors` [(name, dtype, shape)], then a hole of their data's size.
    Returns the data's bytes."""
    head, size = shard_header(tensors)
    with open(file, "wb") as f:
        f.write(head)
        f.truncate(len(head) + size)
    return size


def read_shard(file):
    """[(name, dtype, shape)] of a shard written by write_shard, in order."""
    with open(file, "rb") as f:
        length = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(length))
    entries = sorted(((v["data_offsets"][0], k, v) for k, v in header.items() if k != "__metadata__"))
    return [(name, v["dtype"], tuple(v["shape"])) for _, name, v in entries]


def write(out, variant):
    """The replica at `out`: config.json, the shards, the index. Returns {files, tensors, bytes}."""
    with open(PUBLISHED_CONFIG) as f:
        config_json = json.load(f)
    Config.from_hf(config_json)  # the published config reads
    tensors = release(variant)
    if variant == "fp8":
        config_json["quantization_config"] = release_fp8.quantization_config(name for name, _, _ in manifest())
    os.makedirs(out, exist_ok=True)
    parts = shards(tensors, FILES[variant])
    weight_map, total = {}, 0
    for i, part in enumerate(parts):
        file = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        total += write_shard(os.path.join(out, file), part)
        weight_map.update(dict.fromkeys((name for name, _, _ in part), file))
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        f.write(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config_json, f, indent=2)
    return {"files": len(parts), "tensors": len(tensors), "bytes": total}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--variant", choices=sorted(FILES), required=True)
    args = parser.parse_args()
    made = write(args.out, args.variant)
    print(f"wrote {args.out}: {made['files']} files, {made['tensors']:,} tensors, {made['bytes'] / 2**30:,.2f} GiB "
          f"({made['bytes'] / 1e9:,.1f} GB) of data as holes")


if __name__ == "__main__":
    main()
