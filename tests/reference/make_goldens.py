"""Golden outputs from transformers' glm5_next (the ground truth), for the parity tests.

Runs in the reference env (Python 3.11, torch 2.13.0 CPU, transformers 5.23.0):

    python tests/reference/make_goldens.py OUT_DIR

Writes OUT_DIR/models/<name>/ (HF checkpoints of the variant configs), OUT_DIR/cases/<case>.npz
(input ids, mask, fp32 logits, model name), OUT_DIR/layers/<name>.npz (each module alone:
its state dict under the decoder-layer names, inputs and outputs), OUT_DIR/release/ (transformers'
reading of the published config.json, and the release's tensors), the FP8 checkpoint's goldens
(fp8_goldens.py) and autograd's gradients (gradient_goldens.py), then OUT_DIR/manifest.json last,
so an interrupted run is never mistaken for a complete one.
"""

import json
import os
import sys

import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration, Glm5NextTextConfig
from transformers.configuration_utils import _LEGACY_LAYER_TYPE_REMAP, ALLOWED_ATTN_LAYER_TYPES
from transformers.models.glm5_next import modeling_glm5_next as hf
from transformers.quantizers.quantizers_utils import should_convert_module
from transformers.utils.quantization_config import FineGrainedFP8Config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "checkpoints"))
from make_tiny import build  # noqa: E402
from release_tensors import PUBLISHED_CONFIG, release_tensors  # noqa: E402

SHIPPED = os.path.join(ROOT, "checkpoints", "glm5next-tiny")
KERNELS = os.path.join(ROOT, "checkpoints", "glm5next-tiny-kernels")

# Variant models: text-config overrides of checkpoints/make_tiny.py's tiny config.
VARIANTS = {
    # Two DSA layers in a row, the second reusing the first's selection ("shared").
    "shared": dict(
        num_hidden_layers=6,
        layer_types=["linear_attention", "indexed_attention", "indexed_attention"] * 2,
        indexer_types=["full", "full", "shared", "full", "full", "shared"],
    ),
    # Group-limited routing: 4 groups of 4 experts, the best 2 groups kept.
    "groups": dict(n_group=4, topk_group=2),
    # Pool size 16: top-k 64 tokens = 4 pools, tails up to 15 tokens.
    "kpool16": dict(index_kpool=16, index_topk=64),
    # No gate lower bound: the softplus forget gate.
    "nobound": dict(linear_lower_bound=None),
    # One config branch each, at rows past the selection reference's 256-query blocks.
    "kpool1": dict(index_kpool=1),  # pools of one token: no tail
    "notail": dict(index_kpool_always_select_tail=False),
    "tied": dict(tie_word_embeddings=True),
    "hc3": dict(hc_mult=3),
    "unnormed": dict(norm_topk_prob=False),
    "noshared": dict(n_shared_experts=0),
    "conv3": dict(linear_conv_kernel_dim=3),
}
# Rows of each variant's two cases (left- and right-padded). The branches after nobound get one
# left-padded case of two rows (LONG_ROWS and 37 fewer): a branch of the config, not of the padding.
VARIANT_LENGTHS = {"shared": 120, "groups": 120, "kpool16": 200, "nobound": 120}
LONG_ROWS = 320


# A discrete choice (experts of a token, pools of a query) whose last kept and first dropped
# candidates score closer than this, relative to the largest score of their row, can flip under
# fp32 rounding alone, and an exact tie is broken in an implementation-defined order; inputs that
# produce one are re-drawn. Relative, because the indexer's scores are small and shrink as rows grow.
MIN_DECISION_MARGIN = 1e-5


def _boundary_gap(scores, k, rows):
    """Smallest gap between the k-th and (k+1)-th best score of the selected rows (those with more than
    k candidates), relative to the row's largest |score|."""
    finite = torch.isfinite(scores) & (scores > torch.finfo(scores.dtype).min)
    rows = rows & (finite.sum(-1) > k)
    if not rows.any():
        return float("inf")
    candidates = scores[rows]
    top = candidates.topk(k + 1, dim=-1).values
    scale = torch.where(finite[rows], candidates.abs(), 0.0).amax(-1).clamp_min(torch.finfo(scores.dtype).tiny)
    return float(((top[:, k - 1] - top[:, k]) / scale).min())


def _indexer_scores(indexer, hidden, q_resid, mask):
    """The indexer's pool scores with non-candidates at -inf, recomputed with the module's own parts."""
    b, t = hidden.shape[:2]
    q = indexer.wq_b(q_resid).view(b, t, -1, indexer.head_dim)
    k = indexer.k_norm(indexer.wk(hidden))
    gate = torch.nn.functional.linear(hidden, indexer.index_kpool_compress_gate)
    packed = torch.cat([k, gate, mask.to(k.dtype)[..., None]], dim=-1)
    visible = indexer.get_visible_tokens(mask, t, t)
    pool_keys, pool_indices, pool_valid = indexer.get_pooled_states(packed)
    scores = torch.relu(torch.matmul(q.float(), pool_keys.transpose(-1, -2).float().unsqueeze(1)) * indexer.softmax_scale)
    weights = indexer.weights_proj(hidden).float() * indexer.n_heads**-0.5
    scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    ends = pool_indices[..., -1].clamp(0, t - 1)
    candidate = visible.gather(-1, ends[:, None, :].expand(b, t, -1)) & pool_valid[:, None]
    return scores.masked_fill(~candidate, float("-inf"))


@torch.no_grad()
def min_decision_margin(model, ids, mask):
    """Smallest boundary gap over every router and indexer decision of the real tokens."""
    gaps = []
    real = mask.bool()

    def router_hook(router, args, output):
        choice = torch.sigmoid(output[0]) + router.e_score_correction_bias
        gaps.append(_boundary_gap(choice, router.top_k, real.reshape(-1)))

    def indexer_hook(indexer, args, kwargs, output):
        scores = _indexer_scores(indexer, kwargs["hidden_states"], kwargs["q_resid"], kwargs["attention_mask"])
        gaps.append(_boundary_gap(scores, indexer.index_topk // indexer.index_kpool, real))

    handles = [m.register_forward_hook(router_hook) for m in model.modules() if isinstance(m, hf.Glm5NextTextTopkRouter)]
    handles += [
        m.register_forward_hook(indexer_hook, with_kwargs=True)
        for m in model.modules()
        if isinstance(m, hf.Glm5NextTextIndexer)
    ]
    model(input_ids=ids, attention_mask=mask)
    for h in handles:
        h.remove()
    return min(gaps, default=float("inf"))


def draw_ids(gen, model, mask):
    """Random ids (never 0/1: pad and eos) whose routing and token selection have no near-ties."""
    vocab = model.config.text_config.vocab_size
    for _ in range(50):
        ids = torch.randint(2, vocab, tuple(mask.shape), generator=gen)
        if min_decision_margin(model, ids, mask) > MIN_DECISION_MARGIN:
            return ids
    raise RuntimeError(f"could not draw inputs of shape {tuple(mask.shape)} without near-ties in routing or token selection")


def padded_mask(lengths, total, side):
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for row, n in enumerate(lengths):
        if side == "left":
            mask[row, total - n :] = 1
        else:
            mask[row, :n] = 1
    return mask


@torch.no_grad()
def logits_of(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask).logits.float().numpy()


def save_case(out, name, model_name, model, ids, mask, bf16_model=None):
    """fp32 logits, and transformers' own bf16 logits when a bf16 copy of the model is given."""
    extra = {} if bf16_model is None else {"logits_bf16": logits_of(bf16_model, ids, mask)}
    np.savez(
        os.path.join(out, "cases", name + ".npz"),
        ids=ids.numpy(), mask=mask.numpy(), logits=logits_of(model, ids, mask), model=model_name, **extra,
    )
    return name


def load(path, dtype):
    model = Glm5NextForConditionalGeneration.from_pretrained(path, dtype=dtype).eval()
    # transformers 5.23 leaves an FP8 checkpoint's unconverted weights in their stored bf16 whatever
    # dtype is asked (its dequantizing step takes every weight); widening them is exact
    return model.float() if dtype == torch.float32 else model


def model_cases(out):
    cases = []
    gen = torch.Generator().manual_seed(1234)
    base, kernels = load(SHIPPED, torch.float32), load(KERNELS, torch.float32)
    bf16_copies = {id(base): load(SHIPPED, torch.bfloat16), id(kernels): load(KERNELS, torch.bfloat16)}
    ones = lambda b, t: torch.ones(b, t, dtype=torch.long)  # noqa: E731

    def case(name, model_name, model, mask):
        bf16 = bf16_copies.get(id(model))
        cases.append(save_case(out, name, model_name, model, draw_ids(gen, model, mask), mask, bf16))

    # Dense regime: 35 = index_topk + pool - 1 visible tokens at most, so DSA equals dense attention.
    case("tiny_dense", "shipped", base, ones(2, 35))
    # Sparse regime: 150 tokens = 2 KDA chunks + 22, 37 pools + a 2-token tail, 8 pools selected.
    case("tiny_sparse", "shipped", base, ones(1, 150))
    case("tiny_left_pad", "shipped", base, padded_mask([100, 73, 41], 100, "left"))
    case("tiny_right_pad", "shipped", base, padded_mask([100, 66, 38], 100, "right"))
    case("tiny_one_token", "shipped", base, ones(2, 1))
    # Rows past the selection reference's 256-query blocks: 600 tokens, 149 pools, 3 KDA chunks + 24.
    case("tiny_long_left_pad", "shipped", base, padded_mask([600, 463], 600, "left"))
    case("tiny_long_right_pad", "shipped", base, padded_mask([517, 600], 600, "right"))
    # The checkpoint whose widths every kernel takes: 2 KDA chunks, 25 pools, sparse.
    case("kernels_left_pad", "kernels", kernels, padded_mask([100, 71], 100, "left"))
    case("kernels_right_pad", "kernels", kernels, padded_mask([83, 100], 100, "right"))

    # The shipped checkpoint again, in transformers' in-memory naming (a state_dict, two shards).
    inmem = os.path.join(out, "models", "shipped-inmemory")
    os.makedirs(inmem, exist_ok=True)
    state = {k: v.contiguous() for k, v in base.state_dict().items() if "visual" not in k}
    names = sorted(state)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, os.path.join(inmem, file))
    with open(os.path.join(inmem, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: file for file, keys in shards.items() for k in keys}}, f)
    base.config.save_pretrained(inmem)

    for seed, (name, overrides) in enumerate(VARIANTS.items(), start=10):
        model = build(overrides, seed=seed)
        model.save_pretrained(os.path.join(out, "models", name))
        length = VARIANT_LENGTHS.get(name, LONG_ROWS)
        case(f"{name}_left_pad", name, model, padded_mask([length, length - 37], length, "left"))
        if name in VARIANT_LENGTHS:
            case(f"{name}_right_pad", name, model, padded_mask([length - 29, length], length, "right"))
    return cases


@torch.no_grad()
def generation_case(out, path=SHIPPED, name="generate"):
    """transformers' own cached greedy generation: 32 new tokens for 2 prompts of different lengths
    (left-padded, as transformers' generate expects), drawn so that no EOS comes up."""
    from transformers import GenerationConfig

    model = load(path, torch.float32)
    gen = torch.Generator().manual_seed(77)
    lengths, new = [23, 40], 32
    mask = padded_mask(lengths, max(lengths), "left")
    settings = GenerationConfig(do_sample=False, max_new_tokens=new, eos_token_id=model.config.text_config.eos_token_id,
                                pad_token_id=0)
    for _ in range(40):
        ids = draw_ids(gen, model, mask)
        tokens = model.generate(input_ids=ids, attention_mask=mask, generation_config=settings)
        if tokens.shape[1] != mask.shape[1] + new:
            continue  # an EOS ended both rows early
        full_mask = torch.cat([mask, torch.ones(2, new, dtype=torch.long)], dim=1)
        logits = model(input_ids=tokens, attention_mask=full_mask).logits[:, mask.shape[1] - 1 : -1]
        top2 = logits.topk(2, dim=-1).values
        greedy_margin = float((top2[..., 0] - top2[..., 1]).min())
        no_eos = not (tokens[:, mask.shape[1]:] == settings.eos_token_id).any()
        agrees = bool((logits.argmax(-1) == tokens[:, mask.shape[1]:]).all())
        if no_eos and agrees and greedy_margin > 1e-4 and min_decision_margin(model, tokens, full_mask) > MIN_DECISION_MARGIN:
            break
    else:
        raise RuntimeError("no generation without near-ties")
    np.savez(os.path.join(out, "cases", name + ".npz"), ids=ids.numpy(), mask=mask.numpy(),
             new_tokens=tokens[:, mask.shape[1]:].numpy(), greedy_margin=greedy_margin)
    return name


@torch.no_grad()
def bf16_generation_case(out):
    """transformers' own greedy generation in bf16, on the kernels checkpoint: 12 new tokens for 2
    prompts of different lengths. A step is clear of bf16 rounding when the fp32 model's argmax on
    the same sequence leads its runner-up by more than twice the largest move of any logit between
    transformers' fp32 and bf16 forwards there (any bf16 implementation about as accurate then makes
    the same choice). Drawn so that every clear step's token is that argmax and each row's first
    MIN_CLEAR_STEPS steps are clear; saves the fp32 logits along the sequence, margins and moves."""
    from transformers import GenerationConfig

    model, model_bf16 = load(KERNELS, torch.float32), load(KERNELS, torch.bfloat16)
    gen = torch.Generator().manual_seed(78)
    lengths, new, min_clear_steps = [19, 30], 12, 3
    width = max(lengths)
    mask = padded_mask(lengths, width, "left")
    eos = model.config.text_config.eos_token_id
    settings = GenerationConfig(do_sample=False, max_new_tokens=new, eos_token_id=eos, pad_token_id=0)
    for _ in range(200):
        ids = torch.randint(2, model.config.text_config.vocab_size, tuple(mask.shape), generator=gen)
        tokens = model_bf16.generate(input_ids=ids, attention_mask=mask, generation_config=settings)
        new_tokens = tokens[:, width:]
        if new_tokens.shape[1] != new or (new_tokens == eos).any():
            continue
        full_mask = torch.cat([mask, torch.ones(2, new, dtype=torch.long)], dim=1)
        fp32 = model(input_ids=tokens, attention_mask=full_mask).logits[:, width - 1 : -1].float()
        bf16 = model_bf16(input_ids=tokens, attention_mask=full_mask).logits[:, width - 1 : -1].float()
        top2 = fp32.topk(2, dim=-1).values
        margin = top2[..., 0] - top2[..., 1]
        move = (bf16 - fp32).abs().amax(-1)
        clear = margin > 2 * move
        if (
            clear[:, :min_clear_steps].all()
            and (fp32.argmax(-1) == new_tokens)[clear].all()
            and min_decision_margin(model, tokens, full_mask) > MIN_DECISION_MARGIN
        ):
            break
    else:
        raise RuntimeError("no bf16 generation whose first steps are clear of bf16 rounding")
    np.savez(os.path.join(out, "cases", "generate_bf16.npz"), ids=ids.numpy(), mask=mask.numpy(),
             new_tokens=new_tokens.numpy(), logits=fp32.numpy(), margin=margin.numpy(), move=move.numpy())
    return "generate_bf16"


def state_of(module, prefix):
    return {prefix + k: v.detach().float().numpy() for k, v in module.state_dict().items()}


def save_layer(out, name, text_config, **arrays):
    def as_numpy(v):
        if not torch.is_tensor(v):
            return v
        return v.numpy() if v.dtype == torch.bool else v.detach().float().numpy()

    arrays = {k: as_numpy(v) for k, v in arrays.items()}
    np.savez(os.path.join(out, "layers", name + ".npz"), config=json.dumps(text_config.to_dict()), **arrays)
    return name


def dsa_case(out, name, model, randn):
    tc = model.config.text_config
    dsa = model.model.language_model.layers[3].self_attn
    h = randn(3, 150, tc.hidden_size)
    mask = padded_mask([150, 111, 60], 150, "left").bool()
    mask[2] = padded_mask([77], 150, "right")[0].bool()
    q_resid = dsa.q_a_layernorm(dsa.q_a_proj(h))
    topk = dsa.indexer(h, q_resid, mask, None)
    return save_layer(out, name, tc, h=h, mask=mask, y=dsa(h, mask)[0], topk=topk.numpy(), **state_of(dsa, "self_attn."))


def moe_case(out, name, model, randn):
    tc = model.config.text_config
    moe = model.model.language_model.layers[4].mlp
    x = randn(3, 90, tc.hidden_size, scale=3.0)
    _, weights, experts = moe.gate(x)
    return save_layer(out, name, tc, x=x, y=moe(x), route_weights=weights, route_experts=experts.numpy(), **state_of(moe, "mlp."))


@torch.no_grad()
def layer_cases(out):
    gen = torch.Generator().manual_seed(99)
    randn = lambda *shape, scale=1.0: scale * torch.randn(*shape, generator=gen)  # noqa: E731
    model = build(seed=50)
    tc = model.config.text_config
    lm = model.model.language_model
    b, t, d = 3, 90, tc.hidden_size
    mask = padded_mask([90, 61, 30], t, "left").bool()
    mask[2] = padded_mask([47], t, "right")[0].bool()
    layers = []

    x = randn(b, t, d, scale=3.0)
    layers.append(save_layer(out, "rms_norm", tc, x=x, y=lm.norm(x), weight=lm.norm.weight))
    ln = lm.layers[3].self_attn.indexer.k_norm
    x = randn(b, t, tc.index_head_dim, scale=2.0) + 0.5
    layers.append(save_layer(out, "layer_norm", tc, x=x, y=ln(x), weight=ln.weight, bias=ln.bias))
    x = randn(b, t, d, scale=20.0)  # large enough that the SwiGLU clamps engage
    layers.append(save_layer(out, "dense_mlp", tc, x=x, y=lm.layers[0].mlp(x), **state_of(lm.layers[0].mlp, "mlp.")))
    layers.append(moe_case(out, "moe", model, randn))
    layers.append(moe_case(out, "moe_groups", build(VARIANTS["groups"], seed=51), randn))
    streams = randn(b, t, tc.hc_mult, d)
    post, comb, collapsed = lm.layers[0].attn_hc(streams)
    hc_state = state_of(lm.layers[0].attn_hc, "attn_hc.")
    layers.append(save_layer(out, "hc", tc, streams=streams, post=post, comb=comb, collapsed=collapsed, **hc_state))

    kda = lm.layers[0].self_attn
    h = randn(b, t, d)
    layers.append(save_layer(out, "kda_layer", tc, h=h, mask=mask, y=kda(h, attention_mask=mask), **state_of(kda, "self_attn.")))
    layers.append(save_layer(out, "kda_layer_unmasked", tc, h=h, y=kda(h), **state_of(kda, "self_attn.")))
    heads, dk = 3, 32
    for name, length in (("kda_core", 130), ("kda_core_short", 5)):
        q, k, v = randn(2, length, heads, dk), randn(2, length, heads, dk), randn(2, length, heads, dk)
        g = -5.0 * torch.sigmoid(randn(2, length, heads, dk, scale=2.0))
        beta = torch.sigmoid(randn(2, length, heads))
        s0 = randn(2, heads, dk, dk)
        kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        o_chunk, s_chunk = hf.chunk_kimi_delta_attention(q, k, v, g, beta, **kw)
        o_rec, s_rec = hf.recurrent_kimi_delta_attention(q, k, v, g, beta, **kw)
        layers.append(save_layer(out, name, tc, q=q, k=k, v=v, g=g, beta=beta, s0=s0, o_chunk=o_chunk,
                                 s_chunk=s_chunk, o_recurrent=o_rec, s_recurrent=s_rec))

    layers.append(dsa_case(out, "dsa_layer", model, randn))
    layers.append(dsa_case(out, "dsa_layer_kpool16", build(VARIANTS["kpool16"], seed=52), randn))
    return layers


def layer_type_as_read(spelling):
    """The layer type transformers' config makes of a spelling (None where it refuses it)."""
    try:
        return Glm5NextTextConfig(num_hidden_layers=1, layer_types=[spelling], mlp_layer_types=["dense"]).layer_types[0]
    except ValueError:
        return None


# The FP8 release's quantization_config (its modules_to_not_convert cut to a few), and module names
# against patterns of each kind transformers' skip rule takes: a prefix up to a module boundary, a
# regex, a suffix.
FP8_QUANTIZATION = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128],
                    "modules_to_not_convert": ["lm_head", "model.language_model.layers.0.self_attn.q_proj"]}
SKIP_PATTERNS = ["model.language_model.layers.1", r"model\.language_model\.layers\.[2-4]\.mlp\.experts\.\d+",
                 "mlp.gate", "kv_b_proj", "model.visual."]
SKIP_MODULES = [
    "model.language_model.layers.1.mlp.experts.3.up_proj", "model.language_model.layers.11.mlp.experts.3.up_proj",
    "model.language_model.layers.1", "model.language_model.layers.3.mlp.experts.17.down_proj",
    "model.language_model.layers.5.mlp.experts.17.down_proj", "model.language_model.layers.3.mlp.shared_experts.up_proj",
    "model.language_model.layers.7.mlp.gate", "model.language_model.layers.7.mlp.gate_proj",
    "model.language_model.layers.7.self_attn.kv_b_proj", "model.language_model.layers.7.self_attn.q_b_proj",
    "model.visual.blocks.0.attn.qkv", "model.visualiser.proj", "lm_head",
]


def release_case(out):
    """transformers' reading of the published config.json (the text config its model is built from), of
    every layer-type spelling its config takes (its forward runs the two its mask mapping holds:
    linear_attention and indexed_attention), of the FP8 release's quantization_config and of its rule
    for modules_to_not_convert; the release's tensors."""
    os.makedirs(os.path.join(out, "release"), exist_ok=True)
    text = Glm5NextConfig.from_json_file(PUBLISHED_CONFIG).text_config.to_dict()
    spellings = sorted({*_LEGACY_LAYER_TYPE_REMAP, *ALLOWED_ATTN_LAYER_TYPES})
    quantization = FineGrainedFP8Config.from_dict(FP8_QUANTIZATION)
    with open(os.path.join(out, "release", "config.json"), "w") as f:
        json.dump({
            "text_config": text, "layer_types": {s: layer_type_as_read(s) for s in spellings},
            "quantization_config": FP8_QUANTIZATION,
            "quantization": {
                k: getattr(quantization, k) for k in ("weight_block_size", "activation_scheme", "modules_to_not_convert")
            },
            "skip_patterns": SKIP_PATTERNS,
            "converted": {m: should_convert_module(m, SKIP_PATTERNS) for m in SKIP_MODULES},
        }, f, indent=1)
    with open(os.path.join(out, "release", "tensors.json"), "w") as f:
        json.dump(release_tensors(), f)
    return "release"


def main():
    out = sys.argv[1]
    for sub in ("cases", "layers", "models"):
        os.makedirs(os.path.join(out, sub), exist_ok=True)
    manifest = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cases": model_cases(out) + [generation_case(out), bf16_generation_case(out)],
        "layers": layer_cases(out),
        "release": release_case(out),
    }
    import fp8_goldens  # beside this file; they import this module's helpers
    import gradient_goldens

    fp8_goldens.add_to(manifest, out)
    gradient_goldens.add_to(manifest, out)
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(f"goldens in {out}: {len(manifest['cases'])} model cases, {len(manifest['layers'])} layer cases "
          f"(torch {torch.__version__}, transformers {transformers.__version__})")


if __name__ == "__main__":
    main()
