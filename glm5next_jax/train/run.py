"""A fine-tuning run, what `glm5next-jax train` does: a checkpoint's train form, a JSON-lines file
packed into rows of whole documents (`data`), AdamW steps through `train_step` on `segment_ids`,
the run's state saved atomically every `save_every` steps and at the end, a resumed run continuing
where the saved state stopped (the same batches, the same optimizer state), then the loss curve
(`losses.json`, and `loss.png` where matplotlib is installed) and the fine-tuned parameters in the
inference form (`params/`, a folder `generate --checkpoint` reads).

With `lora` (a `lora.LoraSpec`) the base stays frozen and only adapters train (`lora_train_step`):
the state holds the adapters and their moments, the run ends with the adapters in PEFT's format
(`adapter/`, which `PeftModel.from_pretrained` and `lora.load_adapters` read), and `params/` (the
merged model) only when `merge` asks for it.

The folder `out` holds: state/ (`store.save_train_state`: params or adapters, AdamW's moments, the
step, the rows consumed), losses.json (each step's loss, rewritten with each save), loss.png,
params/, adapter/.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import jax
import numpy as np
import optax

from .. import lora as lora_adapters
from .. import store
from ..checkpoint import load_checkpoint
from ..errors import InputError
from .data import pack_rows, read_documents
from .step import LORA_STATIC, STATIC, inference_params, init_train_state, lora_train_step, train_step


def _write_json(path, value):
    """value as JSON at path (process 0's), replacing what is there only once it is whole on disk."""
    if jax.process_index() != 0:
        return
    partial = path + ".partial"
    with open(partial, "w") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


@functools.cache
def adamw(learning_rate):
    """One optimizer object a learning rate: the jitted step takes it as a static argument, so runs
    in one process with the same rate share its compiled program."""
    return optax.adamw(learning_rate)


_STEP = jax.jit(train_step, static_argnames=STATIC, donate_argnums=0)
_LORA_STEP = jax.jit(lora_train_step, static_argnames=LORA_STATIC, donate_argnums=0)


def plot_losses(losses, path):
    """The loss curve as a PNG; False where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(np.arange(1, len(losses) + 1), losses)
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def fine_tune(checkpoint, data, tokenizer, out, *, steps, batch=8, row_tokens=512, learning_rate=1e-4,
              save_every=50, resume=False, dtype="float32", layout=None, remat="none", field="text",
              progress="auto", log=None, lora=None, merge=False):
    """Run (or with `resume`, continue) a fine-tuning of `checkpoint` on `data` for `steps` steps in
    all; returns each step's loss. tokenizer: a `tokenizers.Tokenizer`; batch rows of row_tokens
    tokens a step; progress: "auto" (a bar with the loss, tokens/s and ETA when stderr is a
    terminal), True or False; log(line) gets the data's report and each save (default: stderr);
    lora: None (full fine-tuning) or a `lora.LoraSpec` (adapters alone; `merge`: also write the
    merged model into params/)."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    for name, value in (("steps", steps), ("batch", batch), ("row_tokens", row_tokens), ("save_every", save_every)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be an int >= 1, got {value!r}")
    if not learning_rate > 0:
        raise InputError(f"learning_rate must be > 0, got {learning_rate!r}")
    state_dir = os.path.join(out, "state")
    if os.path.exists(os.path.join(state_dir, store.TRAIN_META)) and not resume:
        raise InputError(f"{out} holds a run's state already: resume it (--resume) or choose another --out")
    os.makedirs(out, exist_ok=True)
    config, params = load_checkpoint(checkpoint, dtype, layout=layout, form="train", progress=progress)
    if not config.eos_token_id:
        raise InputError(f"{checkpoint}: the config names no eos_token_id to end each document with")
    documents = read_documents(data, tokenizer, eos_id=config.eos_token_id[0], max_tokens=row_tokens, field=field)
    ids, segments = pack_rows(documents.tokens, row_tokens, pad_id=config.pad_token_id or 0)
    skipped = ", ".join(f"{n} {why}" for why, n in sorted(documents.skipped.items())) or "none"
    log(f"{data}: {documents.lines} lines, {len(documents.tokens)} documents "
        f"({sum(len(d) for d in documents.tokens)} tokens) in {len(ids)} rows of {row_tokens}; skipped: {skipped}")

    optimizer = adamw(learning_rate)
    trained = params if lora is None else lora_adapters.init_adapters(params, config, lora, jax.random.key(0))
    state, position, losses = init_train_state(trained, optimizer), 0, []
    if layout is None:  # committed to the device, as a restored state is: both take one compiled step
        state = jax.device_put(state, jax.devices()[0])
    if resume and os.path.exists(os.path.join(state_dir, store.TRAIN_META)):
        _, state, position = store.restore_train_state(state_dir, state)
        if os.path.exists(os.path.join(out, "losses.json")):
            with open(os.path.join(out, "losses.json")) as f:
                losses = json.load(f)[: int(state.step)]
        log(f"resumed at step {int(state.step)} ({position} rows consumed)")

    def save():
        store.save_train_state(state_dir, state, config, data_position=position)
        _write_json(os.path.join(out, "losses.json"), losses)
        log(f"step {int(state.step)}/{steps}: loss {losses[-1]:.4f}; state saved in {state_dir}")

    from tqdm import tqdm

    shown = progress is True or (progress == "auto" and sys.stderr.isatty())
    bar = tqdm(total=steps, initial=int(state.step), unit="step", file=sys.stderr, disable=not shown)
    while int(state.step) < steps:
        rows = np.arange(position, position + batch) % len(ids)
        start = time.perf_counter()
        if lora is None:
            state, metrics = _STEP(state, ids[rows], config=config, optimizer=optimizer, layout=layout, remat=remat,
                                  segment_ids=segments[rows])
        else:
            state, metrics = _LORA_STEP(state, params, ids[rows], config=config, spec=lora, optimizer=optimizer,
                                       layout=layout, remat=remat, segment_ids=segments[rows])
        losses.append(float(metrics["loss"]))
        position += batch
        tokens_per_s = int(np.count_nonzero(segments[rows])) / (time.perf_counter() - start)
        bar.set_postfix(loss=f"{losses[-1]:.4f}", tokens_per_s=f"{tokens_per_s:.0f}")
        bar.update(1)
        if int(state.step) % save_every == 0 or int(state.step) == steps:
            save()
    bar.close()
    if plot_losses(losses, os.path.join(out, "loss.png")):
        log(f"loss curve: {os.path.join(out, 'loss.png')}")
    if lora is not None:
        lora_adapters.save_adapters(os.path.join(out, "adapter"), state.params, config, lora, base_model=checkpoint)
        log(f"adapters: {os.path.join(out, 'adapter')} (PEFT's format; lora.load_adapters reads them)")
        if not merge:
            return losses
    tuned = state.params if lora is None else lora_adapters.merge(params, state.params, lora)
    store.save_params(os.path.join(out, "params"), inference_params(tuned, config), config)
    log(f"fine-tuned parameters: {os.path.join(out, 'params')} (generate --checkpoint reads them)")
    return losses
