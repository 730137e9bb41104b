"""Logical-axis annotations and the rules table; a sharded forward on 4 host devices."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import ROOT, SHIPPED

from glm5next_jax import Config, param_axes, param_shapes
from glm5next_jax.sharding import logical_to_spec


def test_every_parameter_dimension_is_annotated():
    config = Config.from_hf(SHIPPED)
    shapes = jax.tree.leaves(param_shapes(config))
    axes = jax.tree.leaves(param_axes(config), is_leaf=lambda x: isinstance(x, tuple))
    assert len(shapes) == len(axes)
    for shape, names in zip(shapes, axes):
        assert len(shape.shape) == len(names)


def test_rules_drop_missing_and_repeated_mesh_axes():
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("model",))
    assert logical_to_spec(("experts", "embed", None, "expert_mlp"), mesh) == jax.sharding.PartitionSpec(None, None, None, "model")
    assert logical_to_spec(("mlp", "mlp"), mesh) == jax.sharding.PartitionSpec("model", None)
    with pytest.raises(ValueError, match="no rule"):
        logical_to_spec(("nonsense",), mesh)


SHARDED_RUN = r"""
import json, sys
import jax, numpy as np
import glm5next_jax
from glm5next_jax.sharding import make_mesh, shard_params, shard_batch
case = np.load(sys.argv[2])
config, params = glm5next_jax.load_checkpoint(sys.argv[1], "float32")
out = {}
for name, mesh in {"data2_model2": make_mesh(data=2, model=2), "expert2_model2": make_mesh(expert=2, model=2)}.items():
    sharded = shard_params(params, config, mesh)
    ids, mask = shard_batch(case["ids"], mesh), shard_batch(case["mask"], mesh)
    logits = glm5next_jax.forward(sharded, config, ids, mask)
    real = case["mask"].astype(bool)
    err = float(np.abs(np.asarray(logits) - case["logits"])[real].max() / np.abs(case["logits"][real]).max())
    spec = sharded["layers"][4]["mlp"]["experts_gate_up"].sharding.spec
    out[name] = {"error": err, "expert_spec": str(spec), "devices": len(logits.sharding.device_set)}
print(json.dumps(out))
"""


def test_sharded_forward_matches_transformers(goldens, tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    data = dict(np.load(os.path.join(goldens, "cases", "tiny_right_pad.npz")))  # batch 3: add a 4th row
    padded = str(tmp_path / "batch4.npz")
    np.savez(padded, ids=np.concatenate([data["ids"], data["ids"][:1]]), mask=np.concatenate([data["mask"], data["mask"][:1]]),
             logits=np.concatenate([data["logits"], data["logits"][:1]]))
    result = subprocess.run([sys.executable, "-c", SHARDED_RUN, SHIPPED, padded], env=env, cwd=ROOT,
                            capture_output=True, text=True, check=True)
    out = json.loads(result.stdout.strip().splitlines()[-1])
    for name, r in out.items():
        assert r["error"] < 1e-4, (name, r)
        assert r["devices"] == 4
    assert "expert" in out["expert2_model2"]["expert_spec"]
