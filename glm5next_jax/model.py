"""The GLM-5-Next text model: embed -> hc_mult streams -> decoder layers -> stream mean -> norm -> lm_head."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .config import DSA, Config
from .errors import InputError
from .layers import hyper
from .layers.common import PRECISION, rms_norm
from .layers.dsa import dsa_layer
from .layers.indexer_loss import STAGES, indexer_kl
from .layers.kda import gate_log_decay, kda_layer
from .layers.mlp import dense_mlp, moe, router_scores, select_experts
from .params import is_fp8, param_axes
from .sharding import shard_batch

STREAMS = ("batch", "sequence", None, "embed")  # the mHC streams [B, T, hc_mult, D] between layers


def decoder_layer(p, streams, config: Config, layer: int, attend, implementation=None, interpret=False, layout=None):
    """One layer: mHC around the attention sublayer, then around the MLP sublayer.

    attend(attn_params, h) -> (y, aux) runs the attention sublayer (cached or not, KDA or DSA);
    implementation and interpret pick the MoE's grouped GEMM (as in `forward`), layout its experts'
    split; returns (streams, aux, internals). internals (see `forward`'s return_internals) are what
    the layer computes inside; a caller that drops them costs nothing under jit.
    """
    if layout is not None:
        streams = layout.constrain(streams, STREAMS)
    pre, post, comb = hyper.mapping(p["attn_hc"], streams, config)
    h = rms_norm(hyper.collapse(pre, streams), p["input_norm"], config.rms_norm_eps)
    y, aux = attend(p["attn"], h)
    internals = {"attention_mixing": {"pre": pre, "post": post, "comb": comb}, "attention_input": h, "attention_output": y}
    if config.layer_types[layer] != DSA:
        internals["forget_gate"] = gate_log_decay(p["attn"], h, config)
    streams = hyper.expand(post, comb, y, streams)

    pre, post, comb = hyper.mapping(p["ffn_hc"], streams, config)
    h = rms_norm(hyper.collapse(pre, streams), p["post_attention_norm"], config.rms_norm_eps)
    internals["mlp_mixing"] = {"pre": pre, "post": post, "comb": comb}
    if config.mlp_layer_types[layer] == "sparse":
        y = moe(p["mlp"], h, config, implementation, interpret, layout)
        scores = router_scores(p["mlp"], h.reshape(-1, h.shape[-1]))
        weights, experts = select_experts(p["mlp"], scores, config)
        internals["routing"] = {name: a.reshape(*h.shape[:-1], -1) for name, a in
                                (("weights", weights), ("experts", experts), ("scores", scores))}
    else:
        y = dense_mlp(p["mlp"], h, config, layout)
    return hyper.expand(post, comb, y, streams), aux, internals


def uncached_attention(
    config: Config, layer: int, padding_mask, shared_indices, implementation=None, interpret=False, layout=None,
    indexer_loss=None, segment_ids=None,
):
    """The attention sublayer of a whole-sequence forward (segment_ids: packed sequences); aux is (the
    DSA selection or None, the indexer's KL of `indexer_loss`'s stage on a full DSA layer or None)."""

    def attend(p, h):
        if config.layer_types[layer] == DSA:
            y, indices = dsa_layer(p, h, config, padding_mask, shared_indices, implementation, interpret, layout,
                                   segment_ids)
            kl = None
            if indexer_loss is not None and "indexer" in p:
                kl = indexer_kl(p, h, padding_mask, indices, config, indexer_loss, segment_ids)
            return y, (indices, kl)
        return kda_layer(p, h, config, padding_mask, implementation, interpret, layout, segment_ids), (None, None)

    return attend


def final_logits(params, streams, config: Config, layout=None):
    """Mean of the streams, final RMSNorm, lm_head; logits in fp32."""
    x = rms_norm(streams.mean(axis=-2), params["norm"], config.rms_norm_eps)
    logits = jnp.einsum("...d,dv->...v", x, params["lm_head"], precision=PRECISION, preferred_element_type=jnp.float32)
    if layout is not None:
        logits = layout.constrain(logits, ("batch",) + (None,) * (logits.ndim - 2) + ("vocab",))
    return logits


def embed(params, input_ids, config: Config, layout=None):
    """The token embeddings copied into the mHC streams [..., hc_mult, D]. Under a layout that splits
    the vocabulary, each device looks up the ids in its rows of the table and the rows are summed
    across devices (one device holds each): left to itself, XLA gathers the whole table to every
    device for a decode step of one token (1.18 GiB a step at the released size under tp-ep:8)."""
    table = params["embed_tokens"]
    table_axes, id_axes = ("vocab", "embed"), ("batch",) + (None,) * (input_ids.ndim - 1)
    split = () if layout is None else layout.mesh_axes("vocab", table_axes)
    if not split:
        x = jnp.take(table, input_ids, axis=0)
    else:

        def lookup(rows, ids):
            local = ids - jax.lax.axis_index(split) * rows.shape[0]
            held = (local >= 0) & (local < rows.shape[0])
            found = jnp.take(rows, jnp.where(held, local, 0), axis=0)
            return jax.lax.psum(jnp.where(held[..., None], found, jnp.zeros((), rows.dtype)), split)

        x = layout.shard_map(lookup, (table_axes, id_axes), id_axes + ("embed",))(table, input_ids)
    return jnp.broadcast_to(x[..., None, :], (*x.shape[:-1], config.hc_mult, x.shape[-1]))


# What a layer keeps for the backward pass (`forward`'s remat): everything, nothing (recomputed), or
# the products of its matmuls.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@functools.partial(
    jax.jit,
    static_argnames=("config", "implementation", "interpret", "layout", "return_internals", "remat", "indexer_loss"),
)
def _forward(
    params, config: Config, input_ids, attention_mask, implementation=None, interpret=False, layout=None,
    return_internals=False, remat="none", indexer_loss=None, segment_ids=None,
):
    padding_mask = attention_mask.astype(jnp.bool_)
    axes = param_axes(config, is_fp8(params)) if layout is not None and layout.fsdp else None
    if axes is not None:  # FSDP: the table, the final norm and lm_head gathered; the layers one by one
        top = [name for name in params if name != "layers"]
        params = {**params, **layout.gathered({n: params[n] for n in top}, {n: axes[n] for n in top})}
    streams = embed(params, input_ids, config, layout)
    indices, internals = None, []
    for i, p in enumerate(params["layers"]):

        def layer(p, streams, padding_mask, indices, segment_ids, i=i):
            if axes is not None:
                p = layout.gathered(p, axes["layers"][i])
            attend = uncached_attention(config, i, padding_mask, indices, implementation, interpret, layout, indexer_loss,
                                        segment_ids)
            return decoder_layer(p, streams, config, i, attend, implementation, interpret, layout)

        if remat != "none":
            layer = jax.checkpoint(layer, policy=REMAT_POLICIES[remat])
        streams, (indices, kl), inside = layer(p, streams, padding_mask, indices, segment_ids)
        inside = inside if indices is None else dict(inside, selected=indices)
        internals.append(inside if kl is None else dict(inside, indexer_loss=kl))
    logits = final_logits(params, streams, config, layout)
    return (logits, internals) if return_internals else logits


def forward(
    params, config: Config, input_ids, attention_mask=None, *, implementation=None, interpret=False, layout=None,
    return_internals=False, remat="none", indexer_loss=None, segment_ids=None,
):
    """Logits [B, T, vocab] (fp32) for int token ids [B, T] and an optional 0/1 mask [B, T].

    Padding may be on the left or the right; padded positions get logits but they carry no meaning.
    segment_ids (in place of attention_mask): packed sequences, an int [B, T] of document numbers,
    0 for padding (left or right), each document one run of tokens; every document's logits are
    those it gets alone (KDA's conv windows and states start afresh at each document, DSA's pools,
    selection and attention stay within it; the KDA scan then runs on its reference).
    implementation picks the kernels: None (Pallas where it applies on GPU, else the pure-jnp
    references), "reference" or "pallas"; interpret=True runs the kernels in Pallas' interpreter on any
    backend, None then choosing as on a GPU (`pallas_kernels.common.pick_implementation`).
    layout (`sharding.Layout`): the mesh the params are placed on (`shard_params`); the batch is split
    as its rules say, and every kernel runs on its own shards (None: one device).

    return_internals: also return what each layer computes inside, for analysis and plots: a list
    with a dict per layer of `attention_mixing` and `mlp_mixing` (mHC's pre [B, T, n], post [B, T, n]
    and Sinkhorn-normalised comb [B, T, n, n] around each sublayer; comb's rows index the input
    stream, its columns the output stream), `attention_input` (the sublayer's normalised input h, what
    `layers.kda.kda_inputs` or the DSA layer takes) and `attention_output` [B, T, D],
    `forget_gate` (KDA layers: the per-channel log decay g [B, T, H, dk]), `selected` (DSA layers:
    each query's selected token indices [B, T, W], -1 for none; a shared layer's are its
    neighbour's) and `routing` (MoE layers: `weights` and `experts` [B, T, k], and every expert's
    sigmoid `scores` [B, T, E]; expert e is in group e // config.experts_per_group), and with
    `indexer_loss` ("dense" or "sparse", `layers.indexer_loss`) on each full DSA layer `indexer_loss`:
    the mean KL [] from the layer's attention over pools to its indexer's, whose gradient reaches
    the indexer's parameters alone (None: not computed).

    remat (for training: what a layer keeps for the backward pass, `REMAT_POLICIES`): "none" (all
    its intermediates), "full" (only its inputs: the layer is recomputed) or "dots" (its matmuls'
    outputs). The values are the same whichever.
    """
    if remat not in REMAT_POLICIES:
        raise InputError(f"remat must be one of {tuple(REMAT_POLICIES)}, got {remat!r}")
    if indexer_loss not in (None, *STAGES):
        raise InputError(f"indexer_loss must be None or one of {STAGES}, got {indexer_loss!r}")
    check_token_batch(input_ids, attention_mask, config.vocab_size)
    if segment_ids is not None:
        if attention_mask is not None:
            raise InputError("pass segment_ids or attention_mask, not both: padding is segment 0")
        check_segment_ids(segment_ids, np.shape(input_ids))
        segment_ids = jnp.asarray(segment_ids).astype(jnp.int32)
        attention_mask = segment_ids > 0
    input_ids = jnp.asarray(input_ids)
    if attention_mask is None or input_ids.shape[1] == 1:
        # transformers ignores the mask of a single-token input (a lone token is never padding).
        attention_mask = jnp.ones(input_ids.shape, jnp.bool_)
    input_ids, attention_mask = input_ids.astype(jnp.int32), jnp.asarray(attention_mask)
    if layout is not None:
        input_ids, attention_mask = shard_batch(input_ids, layout), shard_batch(attention_mask, layout)
        segment_ids = None if segment_ids is None else shard_batch(segment_ids, layout)
    return _forward(params, config, input_ids, attention_mask, implementation, bool(interpret), layout,
                    bool(return_internals), remat, indexer_loss, segment_ids)


def check_segment_ids(segment_ids, shape):
    """Packed sequences' document numbers: integer [B, T] like input_ids, >= 0, padding (0) left or
    right, each nonzero number one run of tokens."""
    dtype = segment_ids.dtype if hasattr(segment_ids, "dtype") else np.asarray(segment_ids).dtype
    if np.shape(segment_ids) != shape or not np.issubdtype(dtype, np.integer):
        raise InputError(f"segment_ids must be an integer array of input_ids' shape {shape}, got {dtype} {np.shape(segment_ids)}")
    if isinstance(segment_ids, jax.core.Tracer):
        return
    ids = np.asarray(segment_ids)
    if ids.min() < 0:
        raise InputError(f"segment_ids must be >= 0 (0: padding), got {ids.min()}")
    padding(ids > 0)
    for b, row in enumerate(ids):
        changes = row[np.concatenate([[True], row[1:] != row[:-1]])]
        documents = changes[changes > 0]
        if len(np.unique(documents)) != len(documents):
            raise InputError(f"segment_ids row {b}: each document must be one run of tokens, got {changes.tolist()}")


def check_token_batch(input_ids, attention_mask, vocab_size):
    """Integer ids [B, T] (T >= 1) in [0, vocab_size) and an optional 0/1 mask of the same shape."""
    shape = np.shape(input_ids)
    dtype = input_ids.dtype if hasattr(input_ids, "dtype") else np.asarray(input_ids).dtype  # a tracer has one; lists need numpy
    if len(shape) != 2 or not np.issubdtype(dtype, np.integer):
        raise InputError(f"input_ids must be an integer array [B, T], got {dtype} {shape}")
    if shape[0] == 0 or shape[1] == 0:
        raise InputError(f"input_ids must hold at least one token per row and at least one row (B, T >= 1), got {shape}")
    check_ids_in_range(input_ids, vocab_size)
    if attention_mask is not None:
        if np.shape(attention_mask) != shape:
            raise InputError(f"attention_mask must match input_ids' shape {shape}, got {np.shape(attention_mask)}")
        if not isinstance(attention_mask, jax.core.Tracer):
            values = np.unique(np.asarray(attention_mask))
            if not np.isin(values, [0, 1]).all():
                raise InputError(f"attention_mask must hold only 0 and 1, got values {values[:8].tolist()}")
            padding(np.asarray(attention_mask).astype(bool))


def padding(mask):
    """(offset, count) of each row's real tokens in a bool mask [B, T]: every row is left-padded
    (its tokens at the end), right-padded (at the start) or empty; a row with a hole is refused."""
    count = mask.sum(1)
    offset = np.where(mask[:, 0] | (count == 0), 0, mask.shape[1] - count)
    contiguous = np.array([mask[b, offset[b] : offset[b] + count[b]].all() for b in range(len(mask))])
    if not contiguous.all():
        raise InputError(f"attention_mask rows {np.nonzero(~contiguous)[0].tolist()} are neither left- nor right-padded")
    return offset, count


def check_ids_in_range(input_ids, vocab_size, name="input_ids"):
    if isinstance(input_ids, jax.core.Tracer):
        return
    ids = np.asarray(input_ids)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise InputError(f"{name} must lie in [0, {vocab_size}), got values in [{ids.min()}, {ids.max()}]")
