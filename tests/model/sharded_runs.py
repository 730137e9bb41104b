"""Runs on 8 host devices for tests/model/test_sharding.py, in a process of their own (the device count is
fixed when JAX starts): `python tests/model/sharded_runs.py NAME` prints one JSON line.

The model: the shipped checkpoint's widths with 8 KDA and 8 DSA heads (so that 8 devices split
them), 2 layers (KDA, DSA; each with a MoE), random fp32 parameters."""

import os
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
sys.path[:0] = [ROOT, TESTS]  # this tree's library (not an installed copy: the mutations run test copies), conftest
DEVICES = int(os.environ.get("SHARDED_RUNS_DEVICES", "8"))  # a process's devices (4 in the 2-process run)
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from conftest import traced_kernels  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import glm5next_jax  # noqa: E402
from glm5next_jax import inference  # noqa: E402
from glm5next_jax.cache import cache_axes, init_cache  # noqa: E402
from glm5next_jax.layers.common import quantize_split_rows  # noqa: E402
from glm5next_jax.sharding import fp8_cut_axes, host_values, make_layout, make_mesh, shard_params  # noqa: E402
from pallas_kernels import block_fp8  # noqa: E402

LAYOUTS = ["tp:8", "tp-ep:8", "dp-ep:8", "3d:2x2x2"]
FSDP_LAYOUT = "3d:4x1x2"  # with fsdp: parameters and moments over data x model, gathered a layer at a time
FP8_LAYOUTS = ["tp-ep:8", "3d:2x2x2"]  # experts whole over devices; split every way at once
BATCH, PROMPT, STEPS = 8, 37, 5


def model(dtype="float32"):
    config = glm5next_jax.Config.from_hf(os.path.join(ROOT, "checkpoints", "glm5next-tiny")).replace(
        num_hidden_layers=2,
        layer_types=("linear_attention", "indexed_attention"),
        mlp_layer_types=("sparse", "sparse"),
        indexer_types=("full",) * 2,
        linear_num_heads=8,
        linear_head_dim=16,
        num_attention_heads=8,
        num_key_value_heads=8,
    )
    return config, glm5next_jax.init_params(config, jax.random.key(0), dtype=dtype)


def relative(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def prompt_mask():
    """Row b holds PROMPT - b tokens, right-padded."""
    return np.arange(PROMPT)[None] < PROMPT - np.arange(BATCH)[:, None]


def inference_run(params, config, ids, layout=None):
    """Prefill of the ragged prompt, STEPS decode steps, and greedy generation; returns (logits of
    each, tokens, the final cache)."""
    mask = prompt_mask().astype(np.int32)
    # generate's own cache has this shape too: its calls reuse these compiled steps
    cache = init_cache(config, BATCH, 64, dtype="float32", latent_dtype="float32", page_size=64, layout=layout)
    logits, cache = glm5next_jax.prefill(params, config, ids[:, :PROMPT], mask, cache, layout=layout)
    steps = [np.asarray(logits)]
    for i in range(STEPS):
        step, cache = glm5next_jax.decode_step(params, config, ids[:, PROMPT + i], cache, layout=layout)
        steps.append(np.asarray(step)[:, None])
    prompts = [row[: PROMPT - b].tolist() for b, row in enumerate(ids)]
    tokens = glm5next_jax.generate(params, config, prompts, 6, eos_token_id=[], latent_dtype="float32", layout=layout).tokens
    return steps, tokens, cache


def equal_to_one_device():
    """Every layout against one device: forward, prefill, decode steps and generate, and where the
    cache's leaves live."""
    config, params = model()
    ids = np.random.default_rng(0).integers(2, config.vocab_size, (BATCH, PROMPT + STEPS)).astype(np.int32)
    want_forward = np.asarray(glm5next_jax.forward(params, config, ids))
    want_steps, want_tokens, _ = inference_run(params, config, ids)
    real = prompt_mask()
    out = {}
    for spec in LAYOUTS:
        layout = make_layout(spec)
        sharded = shard_params(params, config, layout)
        forward = glm5next_jax.forward(sharded, config, ids, layout=layout)
        steps, tokens, cache = inference_run(sharded, config, ids, layout)
        expected = layout.shardings(cache_axes(cache))
        misplaced = [
            jax.tree_util.keystr(path)
            for (path, leaf), want in zip(jax.tree_util.tree_leaves_with_path(cache), jax.tree.leaves(expected))
            if not leaf.sharding.is_equivalent_to(want, leaf.ndim)
        ]
        out[spec] = {
            "forward": relative(forward, want_forward),
            "prefill": relative(steps[0][real], want_steps[0][real]),
            "decode": max(relative(a, b) for a, b in zip(steps[1:], want_steps[1:])),
            "tokens_equal": tokens == want_tokens,
            "misplaced_cache_leaves": misplaced,
            "state_spec": str(cache["layers"][0]["state"].sharding.spec),
            "latent_spec": str(cache["layers"][1]["latent"].sharding.spec),
            "logits_devices": len(forward.sharding.device_set),
        }
    return out


def train_step_equal_to_one_device():
    """A training step (AdamW) of the train form on every layout, and on FSDP_LAYOUT with fsdp, against
    one device: the loss, every gradient, the updated parameters (in units of the learning rate),
    where they and Adam's moments live, and the share of their bytes split over data. The gradients
    are read from the step itself: after its first step Adam's first moment is (1 - b1) x g."""
    import optax

    from glm5next_jax import train
    from glm5next_jax.sharding import param_shardings

    config, _ = model()
    params = glm5next_jax.init_params(config, jax.random.key(1), dtype="float32", form="train")
    ids = np.random.default_rng(3).integers(2, config.vocab_size, (BATCH, 20)).astype(np.int32)
    mask = (np.arange(20)[None] >= np.arange(BATCH)[:, None] % 3).astype(np.int32)  # left padding
    lr, b1 = 1e-3, 0.9
    optimizer = optax.adamw(lr, b1=b1)
    step = jax.jit(train.train_step, static_argnames=train.STATIC)

    def run(params, layout=None):
        state, metrics = step(train.init_train_state(params, optimizer), ids, mask, config=config, optimizer=optimizer,
                              layout=layout)
        grads = jax.tree.map(lambda mu: mu / (1 - b1), state.opt_state[0].mu)  # scale_by_adam's state first
        return metrics["loss"], grads, state.params, state.opt_state

    want_loss, want_grads, want_params = run(params)[:3]
    out = {}
    for spec, fsdp in [(spec, False) for spec in LAYOUTS] + [(FSDP_LAYOUT, True)]:
        layout = make_layout(spec, fsdp=fsdp)
        loss, grads, stepped, opt_state = run(shard_params(params, config, layout, form="train"), layout)
        shardings = param_shardings(config, layout, form="train")
        adam = opt_state[0]

        def misplaced(tree, shardings=shardings):
            return [jax.tree_util.keystr(path) for (path, leaf), want in
                    zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(shardings))
                    if not leaf.sharding.is_equivalent_to(want, leaf.ndim)]

        pairs = [(np.asarray(g, np.float64), np.asarray(w, np.float64))
                 for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads))]
        out[spec + (" fsdp" if fsdp else "")] = {
            "loss": abs(float(loss) / float(want_loss) - 1),
            "gradients_all": float(np.sqrt(sum(np.sum((g - w) ** 2) for g, w in pairs) / sum(np.sum(w**2) for _, w in pairs))),
            "gradients": max(float(np.linalg.norm(np.asarray(g) - np.asarray(w)) / max(np.linalg.norm(np.asarray(w)), 1e-30))
                             for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads))),
            "params_in_lr": max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) / lr
                                for a, b in zip(jax.tree.leaves(stepped), jax.tree.leaves(want_params))),
            "misplaced_params": misplaced(stepped),
            "misplaced_moments": misplaced(adam.mu) + misplaced(adam.nu),
            "bytes_over_data": sum(leaf.nbytes for leaf in jax.tree.leaves(stepped) if "data" in str(leaf.sharding.spec))
            / sum(leaf.nbytes for leaf in jax.tree.leaves(stepped)),
        }
    return out


def lora_step_equal_to_one_device():
    """A LoRA step (AdamW over adapters on every linear and the routed experts, base frozen) on two
    layouts against one device: the loss, the adapters' gradients (from Adam's first moment) and the
    stepped adapters (in units of the learning rate)."""
    import optax

    from glm5next_jax import lora, train

    config, _ = model()
    params = glm5next_jax.init_params(config, jax.random.key(1), dtype="float32", form="train")
    spec = lora.LoraSpec(rank=4, alpha=8.0)
    adapters = lora.init_adapters(params, config, spec, jax.random.key(2))
    keys = iter(jax.random.split(jax.random.key(3), len(jax.tree.leaves(adapters))))
    adapters = jax.tree.map(lambda ad: lora.Adapter(ad.a, 0.1 * jax.random.normal(next(keys), ad.b.shape)), adapters,
                            is_leaf=lambda x: isinstance(x, lora.Adapter))
    ids = np.random.default_rng(3).integers(2, config.vocab_size, (BATCH, 20)).astype(np.int32)
    lr, b1 = 1e-3, 0.9
    optimizer = optax.adamw(lr, b1=b1)
    step = jax.jit(train.lora_train_step, static_argnames=train.LORA_STATIC)

    def run(base, layout=None):
        state, metrics = step(train.init_train_state(adapters, optimizer), base, ids, config=config, spec=spec,
                              optimizer=optimizer, layout=layout)
        return metrics["loss"], jax.tree.map(lambda mu: mu / (1 - b1), state.opt_state[0].mu), state.params

    want_loss, want_grads, want_adapters = run(params)
    out = {}
    for spec_text in ("tp:8", "3d:2x2x2"):  # the experts' width split (their adapters' partial sums), then every way
        layout = make_layout(spec_text)
        loss, grads, stepped = run(shard_params(params, config, layout, form="train"), layout)
        out[spec_text] = {
            "loss": abs(float(loss) / float(want_loss) - 1),
            "gradients": max(float(np.linalg.norm(np.asarray(g) - np.asarray(w)) / max(np.linalg.norm(np.asarray(w)), 1e-30))
                             for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads))),
            "adapters_in_lr": max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) / lr
                                  for a, b in zip(jax.tree.leaves(stepped), jax.tree.leaves(want_adapters))),
        }
    return out


def fp8_equal_to_one_device():
    """The FP8 form (W8A8; fp32 elsewhere) on every layout against one device: each token's forward
    logits, and how its float8 weights are spread; the experts 1024 wide so that each layout cuts them
    at 128-block boundaries. Then the cuts inside blocks: the shipped widths (experts 32 wide) on tp:8;
    the FP8 tiny checkpoint loaded straight onto tp:4 against its one-device load placed by
    `shard_params`; and `quantize_split_rows` against `quantize_rows` over whole rows."""
    config, _ = model()
    config = config.replace(moe_intermediate_size=1024)
    out = {spec: _fp8_against_one_device(config, spec) for spec in FP8_LAYOUTS}
    narrow, _ = model()
    out["tp:8, cut blocks"] = _fp8_against_one_device(narrow, "tp:8")

    fp8_tiny = os.path.join(ROOT, "checkpoints", "glm5next-tiny-fp8")
    tiny, one = glm5next_jax.load_checkpoint(fp8_tiny, "float32")
    layout = make_layout("tp:4")
    _, loaded = glm5next_jax.load_checkpoint(fp8_tiny, "float32", layout=layout)
    placed = shard_params(one, tiny, layout)
    ids = np.random.default_rng(0).integers(2, tiny.vocab_size, (2, 16)).astype(np.int32)
    want = np.asarray(glm5next_jax.forward(one, tiny, ids))
    got = np.asarray(glm5next_jax.forward(loaded, tiny, ids, layout=layout), np.float64)
    down = loaded["layers"][-1]["mlp"]["experts_down"]
    out["loaded onto tp:4, cut blocks"] = {
        **_token_errors(got, want), "cut_weights": len(fp8_cut_axes(tiny, layout)),
        "identical_to_placed": all(
            a.shape == b.shape and a.sharding == b.sharding and np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(placed))
        ),
        "down_shapes": [list(down.weight.shape), list(down.scale.shape)],
        "down_local": [list(down.weight.addressable_shards[0].data.shape), list(down.scale.addressable_shards[0].data.shape)],
    }

    split_rows = []
    for devices, width in [(2, 128), (8, 32), (4, 400), (2, 200)]:
        mesh = make_mesh(1, 1, devices, devices=jax.devices()[:devices])
        x = jax.random.normal(jax.random.key(width), (5, width)) * jnp.exp(jax.random.normal(jax.random.key(1), (5, width)))
        q, scales = jax.jit(block_fp8.quantize_rows)(x)
        split = jax.jit(jax.shard_map(lambda v: quantize_split_rows(v, ("model",)), mesh=mesh, in_specs=P(None, "model"),
                                      out_specs=(P(None, "model"), P(None, "model"))))
        q_split, scales_split = split(x)
        split_rows.append(bool(np.array_equal(np.asarray(q).view(np.uint8), np.asarray(q_split).view(np.uint8))
                               and np.array_equal(block_fp8.expand_scales(scales, x.shape, (1,)), scales_split)))
    out["split_rows_identical"] = split_rows
    return out


def _token_errors(got, want):
    per_token = np.abs(got - want).max(-1) / np.abs(want).max()
    return {"median_token": float(np.median(per_token)), "worst_token": float(per_token.max()),
            "argmax_equal": float((got.argmax(-1) == want.argmax(-1)).mean())}


def _fp8_against_one_device(config, spec):
    params = glm5next_jax.init_params(config, jax.random.key(0), "float32", fp8=True)
    ids = np.random.default_rng(0).integers(2, config.vocab_size, (BATCH, PROMPT)).astype(np.int32)
    want = np.asarray(glm5next_jax.forward(params, config, ids))
    layout = make_layout(spec)
    sharded = shard_params(params, config, layout)
    down = sharded["layers"][0]["mlp"]["experts_down"]
    got = np.asarray(glm5next_jax.forward(sharded, config, ids, layout=layout), np.float64)
    return {**_token_errors(got, want), "weight_spec": str(down.weight.sharding.spec),
            "scale_spec": str(down.scale.sharding.spec), "scale_shape": list(down.scale.shape),
            "cut_weights": len(fp8_cut_axes(config, layout))}


def collectives_of_the_decode_step():
    """The compiled bf16 decode step under each layout: its all-gathers (shape and bytes), and the
    sizes of the expert weights' local shards and whole arrays."""
    config, params = model("bfloat16")
    out = {}
    for spec in LAYOUTS:
        layout = make_layout(spec)
        sharded = shard_params(params, config, layout)
        cache = init_cache(config, BATCH, 64, page_size=16, layout=layout)
        tokens = jax.device_put(jnp.zeros(BATCH, jnp.int32), layout.sharding(("batch",)))
        hlo = inference._decode.lower(sharded, config, tokens, cache, None, False, layout).compile().as_text()
        gathers = re.findall(r"= (\w+)\[([\d,]*)\]\{[^}]*\} all-gather(?:-start)?\(", hlo)
        out[spec] = {"all_gathers": [[dtype, [int(d) for d in dims.split(",") if d]] for dtype, dims in gathers]}
    moe = params["layers"][1]["mlp"]
    out["expert_weights"] = {"gate_up": list(moe["experts_gate_up"].shape), "down": list(moe["experts_down"].shape)}
    return out


def embedding_lookup():
    """The bf16 embedding lookup of one decode token and of a prefill under each layout against one
    device's (bitwise), and whether it ran as a shard_map (its vocabulary split) with one psum."""
    from glm5next_jax.model import embed

    config, params = model("bfloat16")
    out = {}
    for spec in LAYOUTS:
        layout = make_layout(spec)
        sharded = shard_params(params, config, layout)
        entry = {}
        for name, shape in (("decode", (BATCH, 1)), ("prefill", (BATCH, 37))):
            ids = np.random.default_rng(shape[1]).integers(0, config.vocab_size, shape).astype(np.int32)
            ids[0, 0], ids[-1, -1] = 0, config.vocab_size - 1  # the table's first and last rows
            lookup = jax.jit(lambda p, i, layout=layout: embed(p, i, config, layout))
            got = np.asarray(lookup(sharded, jax.device_put(ids, layout.sharding(("batch", None)))), np.float32)
            want = np.asarray(embed(params, ids, config), np.float32)
            text = str(jax.make_jaxpr(lookup)(sharded, ids))
            entry[name] = {"equal": bool((got == want).all()), "shard_maps": text.count("shard_map"), "psums": text.count("psum")}
        out[spec] = entry
    return out


def kernels_under_shard_map():
    """Every kernel the bf16 model launches under each layout (chosen as on a GPU, interpreted) is
    inside a shard_map; at widths every kernel takes on its shards (KDA and DSA heads of 64, MoE
    widths 128), counted for forward, prefill and a decode step."""
    config, _ = model()
    config = config.replace(linear_head_dim=64, moe_intermediate_size=128, hidden_size=256)
    params = glm5next_jax.init_params(config, jax.random.key(0), dtype="bfloat16")
    ids = np.random.default_rng(0).integers(2, config.vocab_size, (BATCH, 70)).astype(np.int32)
    out = {}
    for spec in LAYOUTS:
        layout = make_layout(spec)
        sharded = shard_params(params, config, layout)
        cache = init_cache(config, BATCH, 128, page_size=16, layout=layout)
        entries = {
            "forward": lambda: glm5next_jax.forward(sharded, config, ids, interpret=True, layout=layout),
            "prefill": lambda: glm5next_jax.prefill(sharded, config, ids, None, cache, interpret=True, layout=layout),
            "decode": lambda: glm5next_jax.decode_step(sharded, config, ids[:, 0], cache, interpret=True, layout=layout),
        }
        out[spec] = {
            name: {"all": dict(traced_kernels(fn)), "outside_shard_map": dict(traced_kernels(fn, outside_shard_map=True))}
            for name, fn in entries.items()
        }
    return out


def load_made_checkpoint(path, spec, logits_out):
    """Load a checkpoint in fp32 on one device ("none") or onto a layout, then logits of 2 x 16 tokens
    (saved to logits_out). Reports the peak RSS the load added beyond the bytes of the loaded arrays
    (host memory that staging used), and what the devices hold."""

    def status(field):  # this process's memory (VmRSS now, VmHWM its peak), in bytes
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    layout = None if spec == "none" else make_layout(spec)
    jax.block_until_ready(jnp.zeros(8))  # the runtime's own memory before the load
    # The peak from here on (getrusage's ru_maxrss would count the forking parent's size too).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    config, params = glm5next_jax.load_checkpoint(path, "float32", layout=layout)
    jax.block_until_ready(params)
    peak = status("VmHWM")
    held = sum(shard.data.nbytes for leaf in jax.tree.leaves(params) for shard in leaf.addressable_shards)
    ids = np.random.default_rng(0).integers(2, config.vocab_size, (2, 16)).astype(np.int32)
    logits = np.asarray(glm5next_jax.forward(params, config, ids, layout=layout))
    np.save(logits_out, logits)
    gate_up = next(layer["mlp"]["experts_gate_up"] for layer in params["layers"] if "experts_gate_up" in layer["mlp"])
    report = {"staging_bytes": peak - before - held, "held_bytes": held, "devices": len(gate_up.sharding.device_set),
              "expert_spec": str(getattr(gate_up.sharding, "spec", None))}
    if layout is not None:  # what `convert --mesh` writes, restored onto the layout by `store`
        import tempfile

        from glm5next_jax.store import restore_params, save_params

        with tempfile.TemporaryDirectory() as tmp:
            save_params(tmp, params, config)
            _, restored = restore_params(tmp, layout=layout)
        report["restored_identical"] = all(
            a.sharding == b.sharding and np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(restored))
        )
    return report


def two_processes(checkpoint, logits_out, process_id="single", port="0"):
    """Load a checkpoint onto a 2 x 2 x 2 mesh (its data axis across the processes when run as one of
    two: `jax.distributed.initialize`, CPU collectives through gloo), prefill a ragged batch and run 3
    decode steps; process 0 (or the single process) saves every logit."""
    if process_id != "single":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=int(process_id))
    layout = make_layout("3d:2x2x2")
    config, params = glm5next_jax.load_checkpoint(checkpoint, "float32", layout=layout)
    ids = np.random.default_rng(1).integers(2, config.vocab_size, (4, 24)).astype(np.int32)
    mask = (np.arange(20)[None] < np.array([[20], [17], [20], [9]])).astype(np.int32)
    cache = init_cache(config, 4, 32, dtype="float32", latent_dtype="float32", page_size=16, layout=layout)
    logits, cache = glm5next_jax.prefill(params, config, ids[:, :20], mask, cache, layout=layout)
    steps = [host_values(logits)[mask.astype(bool)]]
    for i in range(3):
        logits, cache = glm5next_jax.decode_step(params, config, ids[:, 20 + i], cache, layout=layout)
        steps.append(host_values(logits))
    if jax.process_index() == 0:
        np.save(logits_out, np.concatenate(steps))
    return {"process": jax.process_index(), "processes": jax.process_count(), "local_devices": jax.local_device_count(),
            "lengths": host_values(cache["lengths"]).tolist()}


def released_device_bytes(config_path, *layouts):
    """{layout: bytes each of its 8 devices holds of the parameters of a config.json, in bf16}, from each
    device's index into each parameter under the layout's sharding (no array made)."""
    from glm5next_jax.params import param_axes, param_shapes
    from glm5next_jax.sharding import is_axes

    config = glm5next_jax.Config.from_hf(config_path)
    shapes = jax.tree.leaves(param_shapes(config, "bfloat16"))
    axes = jax.tree.leaves(param_axes(config), is_leaf=is_axes)
    out = {}
    for spec in layouts:
        layout, held = make_layout(spec), {}
        for shape, names in zip(shapes, axes):
            for device, index in layout.sharding(names).devices_indices_map(shape.shape).items():
                count = int(np.prod([len(range(*s.indices(n))) for s, n in zip(index, shape.shape)]))
                held[device.id] = held.get(device.id, 0) + count * shape.dtype.itemsize
        out[spec] = [held[d] for d in sorted(held)]
    return out


if __name__ == "__main__":
    print(json.dumps(globals()[sys.argv[1]](*sys.argv[2:])))
