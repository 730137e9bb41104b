"""The published checkpoints as a user downloads them, checked without their data: full-size replicas of
the FP8 and BF16 releases (checkpoints/make_replica.py: every tensor's published name, dtype and shape
in the published number of shards, the data regions holes), `check` and `glm5next-jax check` on them,
and each kind of damage named."""

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from conftest import ROOT, sharded_run

import glm5next_jax
from glm5next_jax import InputError, cli, release_fp8
from glm5next_jax.checkpoint import check, form_views, plan_load
from glm5next_jax.params import Fp8Weight, param_shapes
from glm5next_jax.tensor_views import TensorFiles, View

sys.path.insert(0, os.path.join(ROOT, "checkpoints"))
import make_replica  # noqa: E402

PUBLISHED = make_replica.PUBLISHED_CONFIG
LAYOUTS = ("tp:8", "tp-ep:8")
SCALES = 37_338  # the FP8 release's weight_scale_inv tensors, the MTP layer's included
FILES = {"fp8": 62, "bf16": 120}
TEXT = "model.language_model."


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    root = tmp_path_factory.mktemp("replicas")
    for variant in FILES:
        make_replica.write(root / variant, variant)
    return root


@pytest.fixture(scope="module")
def reports(replicas):
    """check's report of each variant under each layout."""
    return {(v, layout): check(replicas / v, layout) for v in FILES for layout in LAYOUTS}


def test_the_manifest_is_transformers_list_of_the_release(goldens):
    with open(os.path.join(goldens, "release", "tensors.json")) as f:
        theirs = [(name, dtype, tuple(shape)) for name, dtype, shape in json.load(f)]
    assert make_replica.manifest() == theirs


def manifest_groups():
    """The BF16 release's tensors by what the loader does with them, from transformers' list alone."""
    groups = {"loaded": [], "MTP layer 45": [], "vision tower": []}
    for name, dtype, shape in make_replica.manifest():
        key = ("vision tower" if name.startswith("model.visual.") else "MTP layer 45" if name.startswith(TEXT + "layers.45.")
               else "loaded")
        groups[key].append((name, dtype, shape))
    return groups


def test_check_passes_on_both_published_variants_with_their_counts(replicas, reports):
    groups = manifest_groups()
    stored = len(make_replica.manifest())
    for variant in FILES:
        report = reports[variant, "tp:8"]
        assert report.ok, report.problems
        assert report.files == FILES[variant]
        assert report.tensors == stored + (SCALES if variant == "fp8" else 0)
        assert report.loaded[0] == len(groups["loaded"]) == 37_534
        assert {r: n for r, (n, _) in report.skipped.items()} == {r: len(groups[r]) for r in ("MTP layer 45", "vision tower")}
        assert report.scales == (SCALES if variant == "fp8" else 0)
    fp8, bf16 = reports["fp8", "tp:8"], reports["bf16", "tp:8"]
    assert fp8.by_dtype["float8_e4m3fn"][0] == SCALES and fp8.by_dtype["float32"][0] == SCALES + bf16.by_dtype["float32"][0]
    assert abs(fp8.file_bytes / 2**30 - 305.8) < 0.05  # the published sizes: 305.8 GiB and 643 GB
    assert abs(bf16.file_bytes / 1e9 - 643) < 0.5
    assert fp8.device_bytes_float8 < fp8.device_bytes and bf16.device_bytes_float8 is None


def test_bytes_a_device_are_what_the_layouts_devices_hold(reports):
    """Worked out without devices; the reference places the parameters on 8 host devices."""
    held = sharded_run("released_device_bytes", PUBLISHED, *LAYOUTS)
    for layout in LAYOUTS:
        assert reports["fp8", layout].device_bytes == reports["bf16", layout].device_bytes == max(held[layout])
    # Kept as stored, a parameter of float8 weights alone (the MLPs, q_a and kv_a; q_b and o are absorbed with kv_b,
    # which stays bf16) is 1 byte an element and a float32 a 128 x 128 block: under tp:8 each device holds 1/8 of the
    # MLPs' and all of q_a's and kv_a's.
    loaded = manifest_groups()["loaded"]
    fp8 = set(release_fp8.converted(n for n, _, _ in loaded))
    loaded8 = [(n, s) for n, _, s in loaded if n in fp8 and "q_b_proj" not in n and "o_proj" not in n]
    replicated = sum(math.prod(s) for n, s in loaded8 if "_a_proj" in n)
    per_device = (sum(math.prod(s) for _, s in loaded8) - replicated) / 8 + replicated
    report = reports["fp8", "tp:8"]
    assert report.device_bytes_float8 == pytest.approx(report.device_bytes - per_device * (2 - 1 - 4 / 128**2), abs=8)


def sparse_copy(src, dst):
    subprocess.run(["cp", "-r", "--sparse=always", str(src), str(dst)], check=True)
    return dst


def edit(path, name, change):
    """Rewrite the shard holding `name` with `change(entries)` (a list of (name, dtype, shape)), keeping
    the index in step."""
    with open(path / "model.safetensors.index.json") as f:
        index = json.load(f)
    file = index["weight_map"][name]
    entries = change(make_replica.read_shard(path / file))
    make_replica.write_shard(path / file, entries)
    kept = {n: f for n, f in index["weight_map"].items() if f != file}
    index["weight_map"] = kept | dict.fromkeys((e[0] for e in entries), file)
    with open(path / "model.safetensors.index.json", "w") as f:
        json.dump(index, f)


def drop(name):
    return lambda entries: [e for e in entries if e[0] != name]


def replace(name, dtype=None, shape=None):
    return lambda entries: [(n, dtype or d, shape or s) if n == name else (n, d, s) for n, d, s in entries]


def test_every_planted_problem_is_named_by_check_and_by_the_loader(replicas, tmp_path, capsys, monkeypatch):
    path = sparse_copy(replicas / "fp8", tmp_path / "damaged")
    L = TEXT + "layers."
    b_proj, surprise, norm = L + "0.self_attn.b_proj.weight", L + "3.self_attn.surprise.weight", L + "1.input_layernorm.weight"
    a_log, up, gate = L + "2.self_attn.A_log", L + "5.mlp.experts.7.up_proj.weight", L + "8.mlp.shared_experts.gate_proj.weight"
    down, q_a = L + "6.mlp.experts.9.down_proj.weight", L + "3.self_attn.q_a_proj.weight"
    with open(path / "model.safetensors.index.json") as f:
        weight_map = json.load(f)["weight_map"]
    planted = {weight_map[n] for n in (b_proj, norm, a_log, up, gate, down, q_a, L + "4.mlp.experts.0.gate_proj.weight")}
    missing, truncated = sorted(set(weight_map.values()) - planted)[-2:]
    edit(path, b_proj, drop(b_proj))
    edit(path, norm, lambda entries: replace(norm, shape=(4095,))(entries) + [(surprise, "BF16", (8,))])
    edit(path, a_log, replace(a_log, dtype="I32"))
    edit(path, up, drop(up + "_scale_inv"))
    edit(path, gate, drop(gate))
    edit(path, down, replace(down, dtype="BF16"))
    edit(path, q_a, replace(q_a + "_scale_inv", shape=(12, 33)))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"].append(L + "4.mlp.experts.0.gate_proj")
    (path / "config.json").write_text(json.dumps(config))
    (path / missing).unlink()
    os.truncate(path / truncated, os.path.getsize(path / truncated) // 2)
    expected = [
        f"{path / missing}: listed in the index but missing on disk", f"{path / truncated}: truncated: ",
        f"missing: {b_proj}", f"unexpected: {surprise}", f"mis-shaped: {norm}: expected (4096,), found (4095,)",
        f"not floating-point: {a_log}: int32", f"float8 weight without its scale: {up} (no {up}_scale_inv)",
        f"missing: {gate}", f"scale without its weight: {gate}_scale_inv (no {gate})",
        f"scale without a float8 weight: {down}_scale_inv ({down} is bfloat16)",
        f"scale grid does not match its weight: {q_a}_scale_inv: expected (12, 32) for (1536, 4096) in (128, 128) blocks, "
        "found (12, 33)",
        f"converted though modules_to_not_convert lists it: {L}4.mlp.experts.0.gate_proj (float8)",
    ]
    assert cli.main(["check", str(path), "--mesh", "tp-ep:8"]) == 2
    listed = [line[len("    - "):] for line in capsys.readouterr().out.splitlines() if line.startswith("    - ")]
    assert len(listed) == len(expected) and all(any(p.startswith(e) for p in listed) for e in expected), listed

    def no_reads(*args):
        raise AssertionError("tensor data read")

    monkeypatch.setattr(os, "pread", no_reads)
    with pytest.raises(InputError, match=f"has {len(expected)} problems") as err:
        glm5next_jax.load_checkpoint(path)
    assert sorted(str(err.value).splitlines()[1:]) == sorted(f"  {p}" for p in listed)


def test_the_fp8_release_maps_onto_the_fp8_form_without_reading_data(replicas, monkeypatch):
    """Every converted linear of the released size keeps its stored codes and block scales: the views
    have the FP8 form's shapes and dtypes, the codes views read float8 weights alone and the scales
    views their weight_scale_inv tensors, and nothing is read to find out."""
    def no_reads(*args):
        raise AssertionError("tensor data read")

    monkeypatch.setattr(os, "pread", no_reads)
    plan = plan_load(replicas / "fp8")
    fp8, views = form_views(plan, "checkpoint")
    assert fp8
    shapes = param_shapes(plan.config, "bfloat16", fp8=True)
    flat_views = jax.tree.leaves(views, is_leaf=lambda v: isinstance(v, View))
    for (path, want), view in zip(jax.tree_util.tree_flatten_with_path(shapes)[0], flat_views, strict=True):
        assert view.shape == want.shape, jax.tree_util.keystr(path)
    is_node = lambda x: isinstance(x, Fp8Weight)  # noqa: E731
    nodes = [x for x in jax.tree.leaves(views, is_leaf=is_node) if is_node(x)]
    kept = 0
    for node in nodes:
        codes, scales = node.weight.stored(), node.scale.stored()
        assert node.weight.dtype == jnp.float8_e4m3fn and node.scale.dtype == jnp.float32
        assert [t.name + "_scale_inv" for t in codes] == [t.name for t in scales]
        assert all(t.dtype == jnp.float8_e4m3fn for t in codes)
        kept += len(codes)
    # every float8 weight of the text layers but DSA's q_b and o (absorbed with kv_b)
    assert kept == len(plan.float8_loaded()) - 2 * plan.config.layer_types.count("indexed_attention")


def test_a_float8_weight_without_a_quantization_config_is_named_and_never_read(replicas, tmp_path):
    path = sparse_copy(replicas / "bf16", tmp_path / "bf16")
    name = TEXT + "layers.3.mlp.experts.0.up_proj.weight"
    edit(path, name, replace(name, dtype="F8_E4M3"))
    report = check(path)
    assert report.problems == [f"1 tensors are float8 (e.g. {name}) but config.json has no quantization_config to say how "
                               "they are scaled"]
    with pytest.raises(InputError, match=f"{name} is float8_e4m3fn: block-scaled FP8 weights are read with their scales"):
        TensorFiles(str(path)).get(name)


def test_the_cli_prints_the_summary_and_exits_0(replicas, capsys):
    assert cli.main(["check", str(replicas / "bf16"), "--mesh", "tp-ep:8"]) == 0
    out = capsys.readouterr().out
    assert "120 safetensors" in out and "73.79 GiB under tp-ep:8" in out and "problems:     none" in out, out
