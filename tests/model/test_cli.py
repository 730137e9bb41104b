"""The console script, run as a user would."""

import shutil
import subprocess
import sys

import numpy as np
from conftest import ROOT, SHIPPED


def cli(*args):
    result = subprocess.run([sys.executable, "-m", "glm5next_jax", *args], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout, result.stderr


def test_generate_from_ids_and_from_a_converted_orbax_checkpoint(tmp_path):
    out, err = cli("generate", "--ids", "5 17 301 42 8, 9 10 11", "--max-new-tokens", "6")
    rows = [line for line in out.splitlines() if line.startswith("[")]
    assert len(rows) == 2 and all(len(r.split()) == 7 for r in rows)
    # The rate is timed after the decode step's compilation, which the second token waits for.
    assert "(the decode step's compilation), then" in err and "tokens/s" in err, err
    _, err = cli("convert", "--checkpoint", SHIPPED, "--dtype", "float32", "--out", str(tmp_path / "orbax"), "--progress", "on")
    assert "reading: 100%" in err  # the bar of the bytes read reached the end
    again, _ = cli(
        "generate", "--checkpoint", str(tmp_path / "orbax"), "--ids", "5 17 301 42 8, 9 10 11", "--max-new-tokens", "6"
    )
    assert again.splitlines()[-2:] == out.splitlines()[-2:]


def test_generate_text_with_a_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(512)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w2"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    out, _ = cli("generate", "--tokenizer", str(tmp_path / "tokenizer.json"), "--prompt", "w5 w17 w301",
                 "--max-new-tokens", "5", "--stream")
    line = [l for l in out.splitlines() if l.startswith("[0]")][0]
    words = line.split()[1:]
    assert len(words) == 5 and all(w.startswith("w") for w in words)
    ids_out, _ = cli("generate", "--ids", "5 17 301", "--max-new-tokens", "5")
    assert [int(w[1:]) for w in words] == [int(t) for t in ids_out.splitlines()[-1].split()[1:]]


def test_logits_to_npy(tmp_path):
    cli("logits", "--ids", "5 17 301, 9", "--out", str(tmp_path / "l.npy"))
    logits = np.load(tmp_path / "l.npy")
    assert logits.shape == (2, 3, 512) and logits.dtype == np.float32


def test_info_of_the_released_config():
    out, _ = cli("info")
    assert "45 layers (34 KDA, 11 DSA)" in out and "288 experts top-8" in out
    assert "active per token" in out and "cache per token" in out


def test_bad_input_is_a_clear_error():
    result = subprocess.run([sys.executable, "-m", "glm5next_jax", "generate", "--ids", "5 99999"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 2 and "prompts[0] must lie in [0, 512), got values in [5, 99999]" in result.stderr


def test_generate_keeps_its_compiled_programs_for_the_next_run(tmp_path):
    """--compilation-cache: the first run writes the prefill's and the decode step's programs, the
    second loads them and generates the same tokens, as does a run with "none" (no cache)."""
    cache = tmp_path / "xla"
    args = ("generate", "--ids", "5 17 301", "--max-new-tokens", "4")
    first, _ = cli(*args, "--compilation-cache", str(cache))
    written = {p.name.split("-")[0] for p in cache.iterdir()}  # programs that took over a second to compile
    assert {"jit__decode", "jit__prefill"} <= written, written
    second, _ = cli(*args, "--compilation-cache", str(cache))
    assert second == first
    uncached, _ = cli(*args, "--compilation-cache", "none")
    assert uncached == first


def test_check_of_the_shipped_checkpoint_and_of_a_damaged_copy(tmp_path):
    out, _ = cli("check", SHIPPED, "--mesh", "tp-ep:4")
    assert "459 loaded" in out and "25 skipped: vision tower" in out and "under tp-ep:4" in out and "problems:     none" in out
    damaged = tmp_path / "damaged"
    shutil.copytree(SHIPPED, damaged)
    shard = sorted(damaged.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    result = subprocess.run([sys.executable, "-m", "glm5next_jax", "check", str(damaged)], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 2 and f"{shard}: truncated: " in result.stdout and "problems:     1" in result.stdout
