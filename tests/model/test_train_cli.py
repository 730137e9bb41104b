"""`glm5next-jax train` on the shipped tiny checkpoint and its tokenizer: bad lines skipped and counted
by reason, documents packed, the state saved, a resumed run equal to an unbroken one step for step,
the loss curve and the fine-tuned parameters written."""

import json

import jax
import numpy as np
import optax
import pytest
from conftest import SHIPPED

from glm5next_jax import cli, load_checkpoint, lora, store, train

TEXTS = [
    "The model reads its weights from the checkpoint.",
    "Kimi Delta Attention keeps a state per head.",
    "Sparse attention selects pools of keys.",
    "Experts are chosen by a sigmoid router.",
    "Hyper-connections mix four residual streams.",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    lines = [json.dumps({"text": t}).encode() for t in TEXTS]
    lines[1:1] = [b"", b"\xff\xfe not UTF-8", b'{"title": "no text field"}', b"not JSON",
                  json.dumps({"text": " ".join(TEXTS * 4)}).encode()]
    path = tmp_path_factory.mktemp("data") / "texts.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def run(capsys, data, out, *args):
    code = cli.main(["train", "--data", str(data), "--out", str(out), "--batch", "2", "--seq-len", "32",
                     "--lr", "3e-3", "--save-every", "2", "--progress", "off", *args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_a_resumed_run_equals_an_unbroken_one(capsys, data, tmp_path):
    code, log = run(capsys, data, tmp_path / "unbroken", "--steps", "4")
    assert code == 0, log
    assert ("10 lines, 5 documents" in log
            and "skipped: 1 empty, 1 no 'text' string, 1 not JSON, 1 not UTF-8, 1 over 32 tokens" in log), log
    assert run(capsys, data, tmp_path / "broken", "--steps", "2")[0] == 0
    code, log = run(capsys, data, tmp_path / "broken", "--steps", "4", "--resume")
    assert code == 0 and "resumed at step 2 (4 rows consumed)" in log, log
    unbroken = json.loads((tmp_path / "unbroken" / "losses.json").read_text())
    resumed = json.loads((tmp_path / "broken" / "losses.json").read_text())
    assert len(unbroken) == 4 and resumed == unbroken
    assert (tmp_path / "unbroken" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The fine-tuned parameters: the inference form of the saved state's, moved from the checkpoint's.
    config, tuned = store.restore_params(str(tmp_path / "unbroken" / "params"))
    _, start = load_checkpoint(SHIPPED, "float32", form="train")
    like = jax.eval_shape(lambda: train.init_train_state(start, optax.adamw(3e-3)))
    _, state, position = store.restore_train_state(str(tmp_path / "unbroken" / "state"), like)
    assert int(state.step) == 4 and position == 8
    np.testing.assert_array_equal(tuned["embed_tokens"], train.inference_params(state.params, config)["embed_tokens"])
    _, loaded = load_checkpoint(SHIPPED, "float32")
    assert not np.array_equal(tuned["embed_tokens"], loaded["embed_tokens"])


def test_bad_runs_are_refused_before_any_step(capsys, data, tmp_path):
    assert run(capsys, data, tmp_path / "run", "--steps", "2")[0] == 0
    code, log = run(capsys, data, tmp_path / "run", "--steps", "4")
    assert code == 2 and "--resume" in log
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"\n\xff\n")
    code, log = run(capsys, empty, tmp_path / "other", "--steps", "2")
    assert code == 2 and "no usable document (2 lines: 1 empty, 1 not UTF-8)" in log, log


def test_lora_run_resumes_and_writes_peft_adapters(capsys, data, tmp_path):
    """`train --lora 4`: the adapters alone train (the state holds them and their moments), a resumed
    run equals an unbroken one, and adapter/ reads back as the state's adapters; no params/ without
    --merge."""
    lora_args = ("--lora", "4", "--lora-targets", "o_proj,gate_proj,up_proj,down_proj,experts.gate_up_proj")
    code, log = run(capsys, data, tmp_path / "unbroken", "--steps", "3", *lora_args)
    assert code == 0 and "adapters: " in log, log
    assert run(capsys, data, tmp_path / "broken", "--steps", "2", *lora_args)[0] == 0
    code, log = run(capsys, data, tmp_path / "broken", "--steps", "3", "--resume", *lora_args)
    assert code == 0 and "resumed at step 2" in log, log
    unbroken = json.loads((tmp_path / "unbroken" / "losses.json").read_text())
    assert json.loads((tmp_path / "broken" / "losses.json").read_text()) == unbroken and len(unbroken) == 3
    assert not (tmp_path / "unbroken" / "params").exists()

    config, base = load_checkpoint(SHIPPED, "float32", form="train")
    adapters, spec = lora.load_adapters(str(tmp_path / "unbroken" / "adapter"), base, config)
    assert spec.rank == 4 and spec.alpha == 8.0 and "experts.down_proj" not in spec.targets
    like = jax.eval_shape(lambda: train.init_train_state(adapters, optax.adamw(3e-3)))
    _, state, _ = store.restore_train_state(str(tmp_path / "unbroken" / "state"), like)
    for got, want in zip(jax.tree.leaves(adapters), jax.tree.leaves(state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert any(np.any(np.asarray(a.b) != 0) for layer in adapters["layers"] for a in layer.values())
    code, log = run(capsys, data, tmp_path / "other", "--steps", "2", "--merge")
    assert code == 2 and "go with --lora RANK" in log, log
