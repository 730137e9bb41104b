"""Generation: greedy or sampled (temperature, top-k, top-p, seed), EOS ids, a per-token callback."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from .cache import init_cache
from .config import Config
from .errors import InputError, checked_int
from .inference import decode_unchecked, prefill
from .model import check_ids_in_range
from .sharding import host_values


@dataclasses.dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per prompt (up to and including its EOS)
    finished: list[bool]  # stopped on an EOS id (else it ran out of max_new_tokens)
    cache: dict  # holds the prompts and every new token but the last (decode_step takes that one next)


def right_padded(prompts) -> tuple[np.ndarray, np.ndarray]:
    """Token-id lists of different lengths -> right-padded ids [B, T] and their 0/1 mask."""
    width = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), width), np.int32)
    mask = np.zeros((len(prompts), width), np.int32)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
        mask[b, : len(p)] = 1
    return ids, mask


@functools.partial(jax.jit, static_argnames=("temperature", "top_k", "top_p"))
def sample(logits, key, *, temperature: float, top_k: int | None, top_p: float | None):
    """Next tokens [B] from logits [B, V]: argmax at temperature 0, else softmax(logits / T) restricted
    to the top_k tokens and to the smallest set whose probability reaches top_p."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked above
        sorted_logits = jnp.where(before < top_p, sorted_logits, -jnp.inf)
        logits = jnp.full_like(logits, -jnp.inf).at[jnp.arange(logits.shape[0])[:, None], order].set(sorted_logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def check_sampling(max_new_tokens, temperature, top_k, top_p, seed, vocab_size):
    """`generate`'s sampling arguments, checked (an InputError names the first wrong one) and as the
    types it uses: (max_new_tokens, temperature, top_k, top_p, seed). vocab_size None: top_k is not
    bounded above (the CLI checks before it reads the checkpoint)."""
    max_new_tokens = checked_int("max_new_tokens", max_new_tokens, 1)
    if not isinstance(temperature, (int, float, np.number)) or not math.isfinite(temperature) or temperature < 0:
        raise InputError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None:
        top_k = checked_int("top_k", top_k, 1, vocab_size)
    if top_p is not None and not (isinstance(top_p, (int, float, np.number)) and 0.0 < top_p <= 1.0):
        raise InputError(f"top_p must be in (0, 1], got {top_p!r}")
    seed = checked_int("seed", seed, -(2**63), 2**63 - 1)  # JAX's keys take 64-bit seeds
    return max_new_tokens, float(temperature), top_k, None if top_p is None else float(top_p), seed


def generate(
    params,
    config: Config,
    prompts,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    eos_token_id=None,
    callback=None,
    latent_dtype="bfloat16",
    page_size: int = 64,
    implementation=None,
    interpret=False,
    layout=None,
) -> Generation:
    """Generate up to max_new_tokens for each prompt (a list of token-id lists, lengths may differ).

    eos_token_id: an id or ids that end a sequence (default: the config's). callback(step, tokens,
    finished) is called after each step with the new token of every sequence ([B] numpy arrays);
    returning True from it stops generation. implementation, interpret, layout: as in `forward` (the
    cache is made on the layout's mesh).
    """
    if not isinstance(prompts, (list, tuple)) or not prompts or any(len(p) == 0 for p in prompts):
        raise InputError("prompts must be a non-empty list of non-empty token-id lists")
    for b, prompt in enumerate(prompts):
        has_bool = any(isinstance(t, (bool, np.bool_)) for t in np.ravel(np.asarray(prompt, object)))
        if has_bool or not np.issubdtype(np.asarray(prompt).dtype, np.integer) or np.ndim(prompt) != 1:
            raise InputError(f"prompts[{b}] must be a list of integer token ids, got {list(prompt)[:8]!r}")
        check_ids_in_range(np.asarray(prompt), config.vocab_size, f"prompts[{b}]")
    max_new_tokens, temperature, top_k, top_p, seed = check_sampling(
        max_new_tokens, temperature, top_k, top_p, seed, config.vocab_size
    )
    eos = config.eos_token_id if eos_token_id is None else np.atleast_1d(eos_token_id).tolist()
    eos = np.asarray(sorted(eos), np.int64)

    batch = len(prompts)
    ids, mask = right_padded(prompts)
    width = ids.shape[1]
    max_len = -(-(width + max_new_tokens) // page_size) * page_size
    cache = init_cache(
        config, batch, max_len, latent_dtype=latent_dtype, page_size=page_size, dtype=params["embed_tokens"].dtype,
        layout=layout,
    )
    logits, cache = prefill(
        params, config, ids, mask, cache, implementation=implementation, interpret=interpret, layout=layout
    )
    last = jnp.take_along_axis(logits, jnp.asarray(mask.sum(1) - 1)[:, None, None], axis=1)[:, 0]

    key = jax.random.key(seed)
    out = [[] for _ in range(batch)]
    finished = np.zeros(batch, bool)
    for step in range(max_new_tokens):
        key, step_key = jax.random.split(key)
        tokens = sample(last, step_key, temperature=float(temperature), top_k=top_k, top_p=top_p)
        host = host_values(tokens)
        for b in np.nonzero(~finished)[0]:
            out[b].append(int(host[b]))
        finished |= np.isin(host, eos)
        stop = callback(step, host, finished.copy()) if callback is not None else False
        if finished.all() or stop or step == max_new_tokens - 1:
            break
        # The cache has room for every step by construction, so the per-step host checks are skipped.
        last, cache = decode_unchecked(params, config, tokens, cache, implementation, interpret, layout)
    return Generation(tokens=out, finished=finished.tolist(), cache=cache)
