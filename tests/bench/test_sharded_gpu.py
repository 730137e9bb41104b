"""bench/sharded_gpu.py's dry run on 8 CPU host devices at small widths (the script the 8-GPU run
uses, every phase): each phase reports, the check phase finds the layout computing what one device
does, and the rows it appends have the fields the results file requires."""

import json
import os
import subprocess
import sys

import pytest

from bench import common


@pytest.mark.slow
def test_dry_run_of_every_phase(tmp_path):
    results = tmp_path / "rows.jsonl"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    done = subprocess.run(
        [sys.executable, "-m", "bench.sharded_gpu", "run", "--checkpoint", str(tmp_path / "ckpt"), "--layers", "4",
         "--load-layers", "4", "--prefills", "128", "--decodes", "8x128,1x128", "--layouts", "tp-ep:8", "--dry-run",
         "--results", str(results)],
        cwd=common.ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "failed" not in done.stdout, done.stdout
    rows = {row["op"]: row for row in map(json.loads, results.read_text().splitlines())}
    assert set(rows) == {"sharded_load", "sharded_prefill", "sharded_decode", "sharded_check"}
    assert all(not common.missing_fields(row) for row in rows.values())
    assert rows["sharded_check"]["ours"] < 1e-5 and rows["sharded_check"]["equal_greedy_tokens"] == 1.0
    assert rows["sharded_prefill"]["roofline"] > 0 and rows["sharded_decode"]["tokens_per_s"] > 0
    assert rows["sharded_load"]["host_peak_bytes"] > 0
