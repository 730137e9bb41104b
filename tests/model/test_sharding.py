"""Logical-axis annotations, the layouts' rules, and the model on 8 host devices under every layout
(tests/model/sharded_runs.py, in processes of their own): equal to one device, the cache placed by its
logical axes, no expert weight gathered, every kernel inside a shard_map."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import ROOT, SHIPPED, record, release_fp8_weights, sharded_run
from jax.sharding import PartitionSpec as P

from glm5next_jax import Config, param_axes, param_shapes
from glm5next_jax.sharding import abstract_layout, make_layout, make_mesh, param_shardings
from glm5next_jax.tensor_views import TensorFiles
from pallas_kernels import block_fp8


def test_every_parameter_dimension_is_annotated():
    config = Config.from_hf(SHIPPED)
    shapes = jax.tree.leaves(param_shapes(config))
    axes = jax.tree.leaves(param_axes(config), is_leaf=lambda x: isinstance(x, tuple))
    assert len(shapes) == len(axes)
    for shape, names in zip(shapes, axes):
        assert len(shape.shape) == len(names)


def test_presets_place_each_weight_as_documented():
    gate_up, down = ("experts", "embed", None, "expert_mlp"), ("experts", "expert_mlp", "embed")
    tp, tp_ep, dp_ep, three_d = (abstract_layout(s) for s in ("tp:8", "tp-ep:8", "dp-ep:8", "3d:2x2x2"))
    assert [x.mesh.shape for x in (tp, dp_ep, three_d)] == [
        {"data": 1, "expert": 1, "model": 8}, {"data": 8, "expert": 1, "model": 1}, {"data": 2, "expert": 2, "model": 2}]
    assert tp.spec(gate_up) == P(None, None, None, "model")  # a slice of every expert
    assert tp_ep.spec(gate_up) == P("model", None, None, None) and tp_ep.spec(down) == P("model", None, None)
    assert dp_ep.spec(gate_up) == P("data", None, None, None)
    assert three_d.spec(gate_up) == P("expert", None, None, "model")
    for layout in (tp, tp_ep):
        assert layout.spec(("embed", None, "kda_channels")) == P(None, None, "model")
        assert layout.spec(("q_lora", "heads_latent")) == P(None, "model")
        assert layout.spec(("batch", None)) == P(None, None)  # "data" has one device
    assert dp_ep.spec(("embed", None, "kda_channels")) == P(None, None, None)  # "model" has one device
    assert dp_ep.mesh_axes("kda_channels") == () and dp_ep.mesh_axes("batch") == ("data",)
    assert tp_ep.mesh_axes("expert_mlp", gate_up) == ()  # "model" is taken by the experts in that array
    with pytest.raises(ValueError, match="no rule"):
        tp.spec(("nonsense",))
    # FSDP keeps parameters split over data as well, where no rule of the layout's took "data".
    fsdp, dp_ep_fsdp = abstract_layout("3d:4x1x2", fsdp=True), abstract_layout("dp-ep:8", fsdp=True)
    assert fsdp.param_sharding(gate_up).spec == P(None, "data", None, "model")
    assert fsdp.spec(gate_up) == P(None, None, None, "model")  # computed on, once gathered
    assert fsdp.param_sharding(("q_lora", "heads_q")).spec == P("data", "model")
    assert dp_ep_fsdp.param_sharding(gate_up).spec == P("data", None, None, None)  # the experts hold "data"
    assert dp_ep_fsdp.param_sharding(("embed", None, "kda_channels")).spec == P("data", None, None)
    assert three_d.param_sharding(gate_up).spec == three_d.spec(gate_up)  # without fsdp: as computed on


def test_make_layout_names_what_it_cannot_make():
    assert make_layout("tp").mesh.shape == {"data": 1, "expert": 1, "model": 1}
    with pytest.raises(ValueError, match="unknown layout 'pp'"):
        make_layout("pp:8")
    with pytest.raises(ValueError, match="asks for 8 devices; 1 are available"):
        make_layout("tp-ep:8")
    with pytest.raises(ValueError, match="data x expert x model"):
        make_layout("3d:2x2")
    with pytest.raises(ValueError, match="!= 1 devices"):
        make_mesh(data=2)
    with pytest.raises(ValueError, match="needs its device count without devices to count, e.g. 'tp-ep:8'"):
        abstract_layout("tp-ep")
    with pytest.raises(ValueError, match="fsdp keeps the bf16 and fp32 forms split over data"):
        param_shardings(Config(), abstract_layout("3d:2x1x4", fsdp=True), fp8=True)


@pytest.mark.parametrize("layout", ["tp:8", "tp-ep:8", "dp-ep:8", "3d:2x2x2"])
def test_every_layout_equals_one_device(layout):
    """fp32 forward, a ragged prefill, 5 decode steps and greedy generation on 8 devices against one;
    every cache leaf placed as its logical axes say."""
    r = sharded_run("equal_to_one_device")[layout]
    assert max(r["forward"], r["prefill"], r["decode"]) < 1e-5, r
    assert r["tokens_equal"] and r["logits_devices"] == 8
    assert r["misplaced_cache_leaves"] == []
    kda_state, latents = {"tp:8": ("P(None, 'model')", "P()"), "tp-ep:8": ("P(None, 'model')", "P()"),
                          "dp-ep:8": ("P('data',)", "P('data',)"), "3d:2x2x2": ("P('data', 'model')", "P('data',)")}[layout]
    assert (r["state_spec"], r["latent_spec"]) == (kda_state, latents)


def test_the_fp8_form_on_every_layout_equals_one_device():
    """W8A8 on 8 devices against one (experts whole over the devices; split over data, expert and
    model at once), fp32 around the float8 linears: the experts' codes and block scales split alike;
    most tokens' logits are one device's bit for bit. Rows quantized again
    before a GEMM make W8A8 discontinuous: where summation order moves a value across an e4m3
    rounding boundary (or a group's amax by an ulp), a product moves by a step, and a few tokens by up
    to 0.11 of max |logit| (one in a hundred changes its argmax).

    A layout that cuts a weight's 128-blocks (experts 32 wide over 8 devices; the FP8 tiny checkpoint's
    over 4) holds its scales per element along the cut, and quantizes the activation groups that
    straddle devices whole (`quantize_split_rows`, bit for bit `quantize_rows`): its logits are one
    device's as closely, and loading such a layout straight from the files gives the arrays that
    placing the one-device load gives. The FP8 tiny checkpoint quantizes every linear (14 weights cut,
    attention's and KDA's among them) through four layers: where XLA:CPU sums a split product in
    another order than one device (it does on some CPUs: 4.6e-7 after its first layer), the
    requantized activations' flips compound layer by layer (median 2.2e-4 after four), within the
    2e-3 its bound allows; one block row of the last layer's experts_down scaled by its neighbour's
    scales moves the median token 1.0e-2 (W8A8 itself moves it 9e-2 from transformers' logits)."""
    r = sharded_run("fp8_equal_to_one_device")
    specs = {"tp-ep:8": "P('model', None, None)", "3d:2x2x2": "P('expert', None, 'model')",
             "tp:8, cut blocks": "P(None, None, 'model')"}
    for layout, spec in specs.items():
        record(f"fp8 form on {layout}: worst token's logits vs one device", r[layout]["worst_token"])
        assert r[layout]["median_token"] < 1e-6 and r[layout]["argmax_equal"] >= 0.95, (layout, r[layout])
        assert r[layout]["weight_spec"] == r[layout]["scale_spec"] == spec, (layout, r[layout])
    assert r["tp-ep:8"]["cut_weights"] == r["3d:2x2x2"]["cut_weights"] == 0
    cut = r["tp:8, cut blocks"]
    assert cut["cut_weights"] == 8 and cut["scale_shape"] == [16, 1, 32], cut  # experts_down [16, 128, 32]: per element on in
    loaded = r["loaded onto tp:4, cut blocks"]
    record("fp8 tiny checkpoint loaded onto tp:4 (cut blocks): worst token vs one device", loaded["worst_token"])
    assert loaded["identical_to_placed"] and loaded["cut_weights"] == 14, loaded
    assert loaded["down_shapes"] == [[8, 256, 128], [8, 2, 128]] and loaded["down_local"] == [[8, 256, 32], [8, 2, 32]], loaded
    assert loaded["median_token"] < 2e-3 and loaded["argmax_equal"] >= 0.95, loaded
    assert r["split_rows_identical"] == [True] * 4


@pytest.mark.slow  # a property of XLA's partitioning, not of the values: outside the default run's budget
def test_the_decode_step_gathers_no_expert_weights():
    """In the compiled bf16 decode step of every layout, each all-gather is far smaller than one
    device's share of an expert weight: the MoE moves tokens (and the cache writes their new rows),
    never weights."""
    r = sharded_run("collectives_of_the_decode_step")
    smallest_share = min(np.prod(shape) for shape in r.pop("expert_weights").values()) // 8
    for layout, found in r.items():
        sizes = [int(np.prod(dims)) for _, dims in found["all_gathers"]]
        assert max(sizes, default=0) * 8 <= smallest_share, (layout, found["all_gathers"])


def test_the_embedding_lookup_stays_in_each_devices_rows():
    """Where a layout splits the vocabulary (tp, tp-ep, 3d), the lookup is a shard_map over the table's
    rows with one psum of the looked-up rows: XLA, left to a plain gather, all-gathers the whole table
    for a one-token decode step (1.18 GiB a step at the released size, compiled for 8 H200s). The
    rows equal one device's bit for bit, the table's first and last rows included."""
    r = sharded_run("embedding_lookup")
    for layout, entries in r.items():
        split = layout != "dp-ep:8"
        for entry in entries.values():
            assert entry["equal"], (layout, entries)
            assert (entry["shard_maps"], entry["psums"]) == ((1, 1) if split else (0, 0)), (layout, entries)


def test_every_kernel_runs_inside_a_shard_map():
    """Chosen as on a GPU (interpreted), every kernel of forward, prefill and a decode step under every
    layout is enclosed by a shard_map (XLA would gather an enclosed-free kernel's inputs whole), and
    each layout launches the kernels its shards' widths take."""
    r = sharded_run("kernels_under_shard_map")
    dsa = {"candidate_pool_scores": 1, "top_pools": 1, "sparse_latent_attention": 1}
    for layout, entries in r.items():
        moe = {} if layout == "tp:8" else {"moe_grouped_matmul": 4}  # tp: each expert's width / 8 fits no tile
        assert entries["forward"]["all"] == entries["prefill"]["all"] == {"kda_intra": 1, "kda_chain": 1, **dsa, **moe}
        assert entries["decode"]["all"] == {"kda_decode_step": 1, **dsa, **moe}
        assert all(entry["outside_shard_map"] == {} for entry in entries.values()), (layout, entries)


def made_checkpoint(path, layers, settings, *options):
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "checkpoints", "make_random.py"), str(path), "--layers", str(layers),
         "--shard-gb", "0.25", *(f"--set={s}" for s in settings), *options],
        capture_output=True, text=True, check=True,
    )
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors")), done


def check_sharded_load(tmp_path, layers, settings, layout):
    """A random release-format checkpoint loaded onto `layout` over 8 host devices: logits equal to
    an unsharded load of the same files; the host memory the load stages (beyond the loaded arrays
    themselves, which on host devices live in host memory) under 25% of the checkpoint; saved by
    `store` and restored onto the layout bit for bit."""
    size, _ = made_checkpoint(tmp_path / "ckpt", layers, settings)
    runs = {}
    for spec in ("none", layout):
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        out = tmp_path / f"logits-{spec.replace(':', '_')}.npy"
        done = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "model", "sharded_runs.py"), "load_made_checkpoint",
                               str(tmp_path / "ckpt"), spec, str(out)], env=env, cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[spec] = {**json.loads(done.stdout.strip().splitlines()[-1]), "logits": np.load(out)}
    sharded, single = runs[layout], runs["none"]
    error = float(np.abs(sharded["logits"] - single["logits"]).max() / np.abs(single["logits"]).max())
    record(f"sharded load ({size / 2**30:.2f} GiB): logits vs one device", error)
    record(f"sharded load ({size / 2**30:.2f} GiB): host staging / checkpoint", sharded["staging_bytes"] / size)
    assert error < 1e-5, error
    assert sharded["devices"] == 8 and sharded["held_bytes"] > size  # fp32: twice the bf16 files
    assert sharded["restored_identical"]  # saved to orbax from the shards, restored onto the layout
    assert sharded["staging_bytes"] < 0.25 * size, (sharded["staging_bytes"], size)
    return size, sharded, error


# A model of 4 layers (3 KDA + dense MLP, then DSA + MoE: the released order) at a quarter of the
# released widths.
SMALL_MADE = ["hidden_size=1024", "intermediate_size=3072", "n_routed_experts=64", "moe_intermediate_size=256",
              "vocab_size=8192", "linear_num_heads=8", "num_attention_heads=8", "num_key_value_heads=8"]


def test_loading_a_made_checkpoint_straight_into_shards(tmp_path):
    check_sharded_load(tmp_path, 4, SMALL_MADE, "tp-ep:8")


# 4 layers (3 KDA + dense MLP, then DSA + MoE) whose converted linears end in partial blocks (q_lora 192,
# experts 96 wide, dense MLPs 384) and span several (hidden 256, kv_lora 512, heads x 256).
FP8_MADE = ["hidden_size=256", "intermediate_size=384", "n_routed_experts=4", "num_experts_per_tok=2",
            "moe_intermediate_size=96", "vocab_size=1024", "q_lora_rank=192", "num_attention_heads=2",
            "num_key_value_heads=2", "linear_num_heads=2", "index_n_heads=4"]


def test_a_made_fp8_checkpoint_is_the_release_format(tmp_path):
    """make_random --fp8 writes the release's FP8 format: float8 exactly for the dense MLPs, the experts,
    the shared expert and DSA's q_a, q_b, kv_a and o projections; every other tensor byte for byte the
    bf16 checkpoint of the same seed; each float8 value times its block's scale the bf16 draw within
    half an e4m3 step (1/16 of it, or 2^-10 of the scale among e4m3's subnormals), the block's largest
    |value| 448 (scale = amax / 448)."""
    made_checkpoint(tmp_path / "bf16", 4, FP8_MADE)
    made_checkpoint(tmp_path / "fp8", 4, FP8_MADE, "--fp8")
    fp8, files = release_fp8_weights(tmp_path / "fp8")
    layer = "model.language_model.layers."
    mlp = ("gate_proj", "up_proj", "down_proj")
    want = [f"{layer}{i}.mlp.{p}.weight" for i in range(3) for p in mlp]
    want += [f"{layer}3.mlp.{e}.{p}.weight" for e in ("experts.0", "experts.1", "experts.2", "experts.3", "shared_experts")
             for p in mlp]
    want += [f"{layer}3.self_attn.{p}.weight" for p in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")]
    assert fp8 == sorted(want)
    bf16 = TensorFiles(tmp_path / "bf16")
    assert set(bf16.names()) == set(files.names()) - {name + "_scale_inv" for name in fp8}
    for name in bf16.names():
        if name not in fp8:
            assert bf16.dtype(name) == files.dtype(name) and np.array_equal(bf16.get(name), files.get(name)), name
    worst = 0.0
    for name in fp8:
        q, scale = files.get_stored(name), files.get(name + "_scale_inv")
        drawn = bf16.get(name).astype(np.float32)
        values = np.asarray(block_fp8.dequantize_blocks(q, scale))
        scales = np.asarray(block_fp8.dequantize_blocks(np.ones_like(q), scale))  # each value's block scale
        error = np.abs(values - drawn)
        assert (error <= np.maximum(np.abs(drawn) / 16, scales / 1024)).all(), name
        worst = max(worst, float((error / np.abs(drawn).max()).max()))
        amax = np.abs(q.astype(np.float32))
        for rows in range(0, q.shape[0], 128):
            for cols in range(0, q.shape[1], 128):
                assert amax[rows:rows + 128, cols:cols + 128].max() == 448, (name, rows, cols)
    record("make_random --fp8: max |fp8 x scale - bf16 draw| / max |draw|", worst)


@pytest.mark.slow
def test_loading_released_widths_straight_into_shards(tmp_path):
    """Hidden 4096, 288 experts, the released vocabulary and heads; each expert 256 wide (not 2048)
    so that two fp32 loads fit this machine's memory: 6.5 GB of bf16 files."""
    check_sharded_load(tmp_path, 4, ["moe_intermediate_size=256"], "tp-ep:8")


TWO_PROCESS_MADE = ["hidden_size=256", "intermediate_size=512", "n_routed_experts=16", "moe_intermediate_size=64",
                    "vocab_size=1024", "linear_num_heads=4", "linear_head_dim=64", "num_attention_heads=4",
                    "num_key_value_heads=4", "q_lora_rank=128", "kv_lora_rank=64", "qk_nope_head_dim=32", "v_head_dim=32",
                    "index_topk=16", "index_n_heads=4", "index_head_dim=32"]


def test_two_processes_equal_one(tmp_path):
    """`jax.distributed.initialize` over 2 processes of 4 host devices (CPU collectives through gloo),
    the mesh's data axis across them: a sharded load, a ragged prefill and 3 decode steps give the
    logits of one process of 8 devices."""
    import socket

    made_checkpoint(tmp_path / "ckpt", 4, TWO_PROCESS_MADE)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = str(s.getsockname()[1])
    script = [sys.executable, os.path.join(ROOT, "tests", "model", "sharded_runs.py"), "two_processes", str(tmp_path / "ckpt")]
    env = dict(os.environ, JAX_PLATFORMS="cpu", SHARDED_RUNS_DEVICES="4")
    procs = [subprocess.Popen(script + [str(tmp_path / "two.npy"), str(i), port], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert [(r["process"], r["processes"], r["local_devices"]) for r in reports] == [(0, 2, 4), (1, 2, 4)]
    single = subprocess.run(script + [str(tmp_path / "one.npy")], env=dict(os.environ, JAX_PLATFORMS="cpu"), cwd=ROOT,
                            capture_output=True, text=True)
    assert single.returncode == 0, single.stderr[-3000:]
    assert reports[0]["lengths"] == reports[1]["lengths"] == json.loads(single.stdout.strip().splitlines()[-1])["lengths"]
    two, one = np.load(tmp_path / "two.npy"), np.load(tmp_path / "one.npy")
    error = record("two processes vs one: prefill and decode logits", float(np.abs(two - one).max() / np.abs(one).max()))
    assert error < 1e-5


@pytest.mark.parametrize("layout", ["tp:8", "tp-ep:8", "dp-ep:8", "3d:2x2x2", "3d:4x1x2 fsdp"])
def test_train_step_on_every_layout_equals_one_device(layout):
    """One AdamW step of the train form on 8 host devices against one device: the loss, the gradients
    (all together, and the worst tensor's relative L2), the stepped parameters (within 5% of the
    learning rate: an update is about lr x sign(g)), their placement and Adam's moments'. With fsdp
    the parameters and moments are kept split over data as well (gathered a layer at a time for the
    compute): over 90% of their bytes."""
    r = sharded_run("train_step_equal_to_one_device")[layout]
    record(f"train step {layout}: gradients vs one device", r["gradients_all"])
    assert r["loss"] < 1e-5 and r["gradients_all"] < 1e-5 and r["gradients"] < 3e-5, r
    assert r["params_in_lr"] < 0.05 and r["misplaced_params"] == r["misplaced_moments"] == [], r
    if layout.endswith("fsdp"):
        assert r["bytes_over_data"] > 0.9, r


def test_lora_step_on_layouts_equals_one_device():
    """One AdamW step of LoRA adapters (every linear and the routed experts, whose adapters run inside
    the experts' shard_map, split with them) over the frozen train form on 8 host devices (tp:8, the
    experts' width split; 3d:2x2x2, split every way; all four layouts agreed within 2.2e-6 in
    development) against one device: the loss, every adapter's gradient, the stepped adapters (within 5% of the learning rate)."""
    for layout, r in sharded_run("lora_step_equal_to_one_device").items():
        record(f"LoRA step {layout}: worst adapter gradient vs one device", r["gradients"])
        assert r["loss"] < 1e-5 and r["gradients"] < 3e-5 and r["adapters_in_lr"] < 0.05, (layout, r)
