"""Command line: `glm5next-jax {logits,info} ...` (see --help of each)."""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

DEFAULT_CHECKPOINT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", "glm5next-tiny")


def parse_id_batch(text: str) -> tuple[np.ndarray, np.ndarray]:
    """ "1 2 3, 4 5" -> right-padded ids [B, T] and mask [B, T] (rows separated by commas)."""
    rows = [[int(t) for t in row.split()] for row in text.split(",")]
    if not rows or any(not r for r in rows):
        raise ValueError(f"--ids needs at least one token per row, got {text!r}")
    width = max(len(r) for r in rows)
    ids = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        mask[i, : len(r)] = 1
    return ids, mask


def cmd_logits(args):
    import glm5next_jax

    config, params = glm5next_jax.load_checkpoint(args.checkpoint, args.dtype)
    ids, mask = parse_id_batch(args.ids)
    start = time.perf_counter()
    logits = np.asarray(glm5next_jax.forward(params, config, ids, mask))
    first = time.perf_counter() - start
    start = time.perf_counter()
    np.asarray(glm5next_jax.forward(params, config, ids, mask))
    again = time.perf_counter() - start
    if args.out:
        np.save(args.out, logits)
        print(f"wrote {args.out}: logits {logits.shape} {logits.dtype}")
    for b in range(ids.shape[0]):
        n = int(mask[b].sum())
        print(f"row {b}: {n} tokens, next-token argmax per position: {logits[b, :n].argmax(-1).tolist()}")
    print(f"forward {ids.shape}: {first:.2f} s with compilation, {again * 1e3:.1f} ms compiled "
          f"({mask.sum() / again:.0f} tokens/s)")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="glm5next-jax", description="GLM-5-Next in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("logits", help="logits of a batch of token-id prompts, to .npy")
    p.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT, help="HF checkpoint directory (default: the shipped tiny one)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--ids", required=True, help='token ids, rows separated by commas: "1 2 3, 4 5"')
    p.add_argument("--out", help="write the logits [B, T, vocab] here (.npy)")
    p.set_defaults(run=cmd_logits)
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"glm5next-jax {args.command}: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
