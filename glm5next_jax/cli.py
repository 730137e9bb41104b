"""Command line: `glm5next-jax {generate,logits,convert,info,check,train}` (see --help of each).

--checkpoint takes a transformers checkpoint directory or an orbax directory made by `convert`;
--mesh spreads the model over devices by a layout (`sharding.make_layout`: "tp-ep:8", "3d:2x2x2").
generate and logits keep XLA's compiled programs in --compilation-cache (JAX's persistent cache), so
a second run with the same shapes loads them rather than compiling again.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np

from .errors import InputError

DEFAULT_CHECKPOINT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", "glm5next-tiny")
# JAX's own variable, when set, else the user's cache folder, one per host: XLA:CPU programs are
# built for the host's CPU features, and a home folder may be shared by machines that differ.
DEFAULT_COMPILATION_CACHE = os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "glm5next-jax", "xla",
    platform.node() or "host",
)


def parse_id_batch(text: str) -> list[list[int]]:
    """ "1 2 3, 4 5" -> [[1, 2, 3], [4, 5]] (rows separated by commas)."""
    try:
        rows = [[int(t) for t in row.split()] for row in text.split(",")]
    except ValueError:
        raise InputError(f"--ids must be integer token ids, rows separated by commas, got {text!r}") from None
    if not rows or any(not r for r in rows):
        raise InputError(f"--ids needs at least one token per row, got {text!r}")
    return rows


def check_output_file(path, option):
    """An output file's folder exists and is writable, before any work."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise InputError(f"{option}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise InputError(f"{option}: the folder {folder} is not writable")
    if os.path.isdir(path):
        raise InputError(f"{option}: {path} is a folder")


def read_tokenizer(path):
    from tokenizers import Tokenizer

    if not os.path.isfile(path):
        raise InputError(f"--tokenizer: no file at {path}")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the tokenizers package raises its own untyped errors
        raise InputError(f"--tokenizer: {path} is not a tokenizer.json ({e})") from None


PROGRESS = {"auto": "auto", "on": True, "off": False}


def layout_of(args):
    from .sharding import make_layout

    return None if args.mesh == "none" else make_layout(args.mesh)


def load_model(path, dtype, layout=None, progress="auto"):
    """(config, params) from a transformers checkpoint or an orbax directory written by `convert`,
    each device reading its own shards under a layout."""
    from .checkpoint import load_checkpoint
    from .store import META, restore_params

    if os.path.exists(os.path.join(path, META)):
        config, params = restore_params(path, layout=layout)
        if str(params["embed_tokens"].dtype) != dtype:
            raise InputError(f"{path} holds {params['embed_tokens'].dtype} params; pass --dtype {params['embed_tokens'].dtype}")
        return config, params
    return load_checkpoint(path, dtype, layout=layout, progress=progress)


def cmd_generate(args):
    from .generate import check_sampling, generate

    tokenizer = None
    if args.tokenizer:
        tokenizer = read_tokenizer(args.tokenizer)
        if not args.prompt:
            raise InputError("--tokenizer needs at least one --prompt")
        prompts = [tokenizer.encode(p).ids for p in args.prompt]
    elif args.ids:
        prompts = parse_id_batch(args.ids)
    else:
        raise InputError("give --ids, or --tokenizer with --prompt")
    check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, vocab_size=None)
    layout = layout_of(args)
    config, params = load_model(args.checkpoint, args.dtype, layout, PROGRESS[args.progress])
    stream = args.stream and len(prompts) == 1
    stamps = []

    def on_token(step, tokens, finished):
        stamps.append(time.perf_counter())
        if stream:
            text = tokenizer.decode([int(tokens[0])]) if tokenizer else f"{int(tokens[0])} "
            print(text, end="", flush=True)

    start = time.perf_counter()
    out = generate(
        params, config, prompts, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, callback=on_token, latent_dtype=args.latent_dtype, layout=layout,
    )
    seconds = time.perf_counter() - start
    if stream:
        print()
    for b, tokens in enumerate(out.tokens):
        shown = tokenizer.decode(tokens) if tokenizer else " ".join(map(str, tokens))
        print(f"[{b}] {shown}")
    n = sum(len(t) for t in out.tokens)
    # The second token waits for the decode step's compilation: the rate is timed from it on.
    report = f"{n} new tokens in {seconds:.2f} s: first token after {stamps[0] - start:.2f} s (prefill and compilation)"
    if len(stamps) > 1:
        report += f", the second {stamps[1] - stamps[0]:.2f} s later (the decode step's compilation)"
    if len(stamps) > 2 and stamps[-1] > stamps[1]:
        rate = (len(stamps) - 2) * len(prompts) / (stamps[-1] - stamps[1])
        report += f", then {rate:.1f} tokens/s (batch {len(prompts)}, {rate / len(prompts):.1f} steps/s)"
    print(f"{report}; {n / seconds:.1f} tokens/s overall", file=sys.stderr)


def cmd_logits(args):
    import glm5next_jax

    from .generate import right_padded

    ids, mask = right_padded(parse_id_batch(args.ids))
    if args.out:
        check_output_file(args.out, "--out")
    layout = layout_of(args)
    config, params = load_model(args.checkpoint, args.dtype, layout, PROGRESS[args.progress])
    start = time.perf_counter()
    logits = np.asarray(glm5next_jax.forward(params, config, ids, mask, layout=layout))
    seconds = time.perf_counter() - start
    if args.out:
        np.save(args.out, logits)
        print(f"wrote {args.out}: logits {logits.shape} {logits.dtype}")
    for b in range(ids.shape[0]):
        n = int(mask[b].sum())
        print(f"row {b}: {n} tokens, argmax per position: {logits[b, :n].argmax(-1).tolist()}")
    print(f"forward {ids.shape} in {seconds:.2f} s (compilation included)", file=sys.stderr)


def cmd_convert(args):
    if args.to == "fp8":
        from .check import size
        from .convert_fp8 import quantize_checkpoint

        if args.mesh != "none":
            raise InputError("--mesh: --to fp8 reads and writes a tensor at a time on this host, without devices")
        made = quantize_checkpoint(args.checkpoint, args.out, shard_bytes=int(args.shard_gb * 2**30),
                                   progress=PROGRESS[args.progress])
        print(f"wrote {args.out}: {made['files']} files, {made['tensors']:,} tensors ({made['float8']:,} float8 with "
              f"their block scales), {size(made['bytes_out'])} from {size(made['bytes_in'])}")
        return
    from .store import check_target, save_params

    check_target(args.out)
    config, params = load_model(args.checkpoint, args.dtype, layout_of(args), PROGRESS[args.progress])
    save_params(args.out, params, config)  # each process writes its own shards
    print(f"wrote {args.out} ({args.dtype})")


def cmd_info(args):
    import jax

    from .cache import bytes_per_token
    from .config import Config
    from .params import param_shapes, tree_bytes

    config = Config() if args.config == "released" else Config.from_hf(args.config)
    shapes = param_shapes(config, args.dtype)
    count = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))  # noqa: E731
    total = count(shapes)
    embeddings = count(shapes["embed_tokens"]) + count(shapes["lm_head"])
    routed = sum(count({k: v for k, v in l["mlp"].items() if k.startswith("experts_")}) for l in shapes["layers"])
    active = total - routed + routed * config.num_experts_per_tok // config.n_routed_experts
    cache = bytes_per_token(config, args.latent_dtype, args.dtype)
    kda = config.layer_types.count("linear_attention")
    print(f"config: {config.num_hidden_layers} layers ({kda} KDA, {config.num_hidden_layers - kda} DSA), "
          f"hidden {config.hidden_size}, {config.n_routed_experts} experts top-{config.num_experts_per_tok}")
    print(f"parameters:        {total:,} ({total / 1e9:.2f} B), of which routed experts {routed:,}, embeddings {embeddings:,}")
    print(f"active per token:  {active:,} ({active / 1e9:.2f} B; {(active - embeddings) / 1e9:.2f} B without embeddings)")
    held = {form: tree_bytes(param_shapes(config, args.dtype, fp8=form == "fp8")) for form in ("plain", "fp8")}
    print(f"weights as held:   {held['plain'] / 2**30:,.2f} GiB in {args.dtype}; {held['fp8'] / 2**30:,.2f} GiB with the "
          "release's converted linears in block-scaled FP8 (weights='checkpoint' on the FP8 release)")
    print(f"cache per token:   {cache['per_token']:,.0f} bytes ({args.latent_dtype} latents, {args.dtype} indexer keys)")
    print(f"KDA state:         {cache['kda_state_per_sequence']:,.0f} bytes per sequence (fixed)")


def cmd_check(args):
    from .checkpoint import check

    report = check(args.path, None if args.mesh == "none" else args.mesh, args.dtype)
    print(report)
    return 0 if report.ok else 2


def cmd_train(args):
    from .train.run import fine_tune

    tokenizer_path = args.tokenizer or os.path.join(args.checkpoint, "tokenizer.json")
    if not args.tokenizer and not os.path.isfile(tokenizer_path):
        raise InputError(f"{args.checkpoint} holds no tokenizer.json: name one with --tokenizer")
    tokenizer = read_tokenizer(tokenizer_path)
    spec = None
    if args.lora is not None:
        from .lora import TARGETS, LoraSpec

        targets = tuple(t for t in args.lora_targets.split(",") if t) if args.lora_targets else TARGETS
        spec = LoraSpec(rank=args.lora, alpha=args.lora_alpha or 2.0 * args.lora, targets=targets)
    elif args.merge or args.lora_alpha or args.lora_targets:
        raise InputError("--merge, --lora-alpha and --lora-targets go with --lora RANK")
    losses = fine_tune(
        args.checkpoint, args.data, tokenizer, args.out, steps=args.steps, batch=args.batch, row_tokens=args.seq_len,
        learning_rate=args.lr, save_every=args.save_every, resume=args.resume, dtype=args.dtype, layout=layout_of(args),
        remat=args.remat, field=args.field, progress=PROGRESS[args.progress], lora=spec, merge=args.merge,
    )
    if losses:
        print(f"loss {losses[0]:.4f} at step 1, {losses[-1]:.4f} at step {len(losses)}")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="glm5next-jax", description="GLM-5-Next in JAX")
    sub = parser.add_subparsers(dest="command", required=True)

    def model_args(p, dtype="float32"):
        p.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT, help="checkpoint directory (default: the shipped tiny one)")
        p.add_argument("--dtype", default=dtype, choices=["float32", "bfloat16"])
        p.add_argument("--progress", default="auto", choices=sorted(PROGRESS),
                       help="a bar of the bytes read, with ETA (auto: when stderr is a terminal)")
        p.add_argument(
            "--mesh", default="none", metavar="LAYOUT",
            help='spread the model over devices: a preset and its size ("tp:8", "tp-ep:8", "dp-ep:8") or "3d:DxExM"',
        )

    def compilation_cache_arg(p):
        p.add_argument(
            "--compilation-cache", default=DEFAULT_COMPILATION_CACHE, metavar="DIR",
            help=f'keep compiled programs here for later runs ("none": compile every run; default {DEFAULT_COMPILATION_CACHE})',
        )

    p = sub.add_parser("generate", help="generate from token-id prompts (or text, with --tokenizer)")
    model_args(p)
    compilation_cache_arg(p)
    p.add_argument("--ids", help='prompts as token ids, rows separated by commas: "1 2 3, 4 5"')
    p.add_argument("--tokenizer", help="a tokenizer.json; then prompts are --prompt text and output is text")
    p.add_argument("--prompt", action="append", help="a text prompt (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--latent-dtype", default="bfloat16", choices=["bfloat16", "float32", "float8_e4m3fn"])
    p.add_argument("--stream", action="store_true", help="print tokens as they come (one prompt)")
    p.set_defaults(run=cmd_generate)

    p = sub.add_parser("logits", help="logits of a batch of token-id prompts, to .npy")
    model_args(p)
    compilation_cache_arg(p)
    p.add_argument("--ids", required=True, help='token ids, rows separated by commas: "1 2 3, 4 5"')
    p.add_argument("--out", help="write the logits [B, T, vocab] here (.npy)")
    p.set_defaults(run=cmd_logits)

    p = sub.add_parser("convert", help="transformers checkpoint -> orbax directory, or -> the FP8 release's format")
    model_args(p, dtype="bfloat16")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--to", default="orbax", choices=["orbax", "fp8"],
                   help="orbax: params for fast restores; fp8: a transformers checkpoint with the release's linears "
                        "in block-scaled FP8 (128 x 128 blocks, scale = amax / 448)")
    p.add_argument("--shard-gb", type=float, default=5.0, help="with --to fp8: the safetensors files' size")
    p.set_defaults(run=cmd_convert)

    p = sub.add_parser("info", help="parameter counts, active parameters and cache bytes per token")
    p.add_argument("--config", default="released", help='"released" (transformers defaults) or a config.json / checkpoint dir')
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--latent-dtype", default="float8_e4m3fn", choices=["bfloat16", "float32", "float8_e4m3fn"])
    p.set_defaults(run=cmd_info)

    p = sub.add_parser("check", help="what loading a checkpoint will do, and every problem, from its headers alone")
    p.add_argument("path", help="checkpoint directory (config.json, model.safetensors.index.json, the shards)")
    p.add_argument("--mesh", default="none", metavar="LAYOUT",
                   help='bytes a device under this layout, worked out without its devices ("tp:8", "tp-ep:8", "3d:2x2x2")')
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="of the loaded parameters")
    p.set_defaults(run=cmd_check)

    p = sub.add_parser("train", help="fine-tune on a JSON-lines file of texts, packed; resumable")
    p.add_argument("checkpoint", nargs="?", default=DEFAULT_CHECKPOINT,
                   help="checkpoint directory (default: the shipped tiny one)")
    p.add_argument("--data", required=True, help='a JSON-lines file, one {"text": ...} document a line')
    p.add_argument("--out", required=True, help="the run's folder: state/, losses.json, loss.png, params/ or adapter/")
    p.add_argument("--tokenizer", help="a tokenizer.json (default: the checkpoint's)")
    p.add_argument("--field", default="text", help="the records' text field")
    p.add_argument("--steps", type=int, default=100, help="steps in all (a resumed run counts the saved ones)")
    p.add_argument("--batch", type=int, default=8, help="rows a step")
    p.add_argument("--seq-len", type=int, default=512, help="tokens a row (documents are packed whole)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW's learning rate")
    p.add_argument("--save-every", type=int, default=50, help="save the run's state every this many steps")
    p.add_argument("--resume", action="store_true", help="continue the run saved in --out")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--remat", default="none", choices=["none", "full", "dots"], help="what a layer keeps for the backward")
    p.add_argument("--progress", default="auto", choices=sorted(PROGRESS),
                   help="a bar with the loss, tokens/s and ETA (auto: when stderr is a terminal)")
    p.add_argument("--mesh", default="none", metavar="LAYOUT", help='train over devices: "tp:8", "3d:2x2x2", ...')
    p.add_argument("--lora", type=int, metavar="RANK", help="train LoRA adapters of this rank, the base frozen; "
                   "writes adapter/ in PEFT's format")
    p.add_argument("--lora-alpha", type=float, help="LoRA's alpha (default: 2 x RANK); the adapters' scale is alpha / RANK")
    p.add_argument("--lora-targets", help="comma-separated module names (default: every attention, MLP and expert "
                   "projection: " + "q_proj,k_proj,...,experts.gate_up_proj,experts.down_proj)")
    p.add_argument("--merge", action="store_true", help="with --lora: also write the merged model into params/")
    p.set_defaults(run=cmd_train)

    args = parser.parse_args(argv)
    if getattr(args, "compilation_cache", "none") != "none":
        import jax

        # On the CPU the tiny checkpoint's README command spends 8 + 5 s compiling its prefill and
        # decode step; with the programs cached, a second run's first two tokens come after 3.6 + 2.0 s.
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
    try:
        return args.run(args) or 0
    except (InputError, OSError) as err:  # what the user can fix: one line, no traceback
        print(f"glm5next-jax {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
