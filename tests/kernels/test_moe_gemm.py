"""The MoE's grouped GEMM: the expert-tiled row layout against a plain numpy construction, the kernel
(Pallas' interpreter on the CPU) and the reference against fp32 numpy products per expert, the MoE
layer through the kernel against the layer through the reference, the combine of the experts'
rows against the reference's `index_add_` loop in numpy, the kernel lowered for the H200, and the
argument checks."""

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from conftest import relative_error, traced_kernels
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # the race detector's findings
from jax.experimental.pallas import mosaic_gpu as plgpu
from kernel_case import KernelCase

from glm5next_jax.config import Config
from glm5next_jax.layers import mlp
from pallas_kernels import block_fp8, moe_gemm
from pallas_kernels.common import lower_for_h200

# bf16 outputs: one ulp of the largest is 2^-8 of it; the kernel and the reference round the same
# fp32 sums, so they differ by accumulation order only.
TOLERANCE = 5e-3


def numpy_tiles(sizes, block_rows):
    """(slots, tile_experts of the used tiles) built row by row."""
    slots, tile_experts, tile = [], [], 0
    for expert, size in enumerate(sizes):
        tiles = -(-size // block_rows)
        slots += [tile * block_rows + r for r in range(size)]
        tile_experts += [expert] * tiles
        tile += tiles
    return np.array(slots, np.int32), np.array(tile_experts, np.int32)


@pytest.mark.parametrize("block_rows", [1, 64, 128])
@pytest.mark.parametrize("sizes", [[0, 5, 0, 64, 65, 1], [300], [0, 0, 1], [128, 127, 129, 0]])
def test_expert_tiles_match_a_row_by_row_layout(sizes, block_rows):
    rows = sum(sizes)
    tiles = moe_gemm.expert_tiles(jnp.array(sizes), rows, block_rows)
    slots, tile_experts = numpy_tiles(sizes, block_rows)
    used = len(tile_experts)
    assert int(tiles.used_tiles) == used
    assert tiles.tile_experts.shape[0] == moe_gemm.max_tiles(rows, len(sizes), block_rows) >= used
    np.testing.assert_array_equal(tiles.slots, slots)
    np.testing.assert_array_equal(tiles.tile_experts[:used], tile_experts)


def test_expert_tiles_have_no_loop_on_the_gpu():
    """A rolled loop lowers to a while loop, which on the GPU copies its condition to the host at each
    step: searchsorted's default bisection makes 21 of them in the wider MoE config's decode step on
    the H200 (bench/RESULTS.md)."""
    lowered = jax.jit(lambda sizes: moe_gemm.expert_tiles(sizes, 64, 64)).trace(jnp.ones(64, jnp.int32)).lower(
        lowering_platforms=("cuda",))
    assert "stablehlo.while" not in lowered.as_text()


def tiled_operands(seed, sizes, k, n, block_rows):
    kx, kw = jax.random.split(jax.random.key(seed))
    rows = sum(sizes)
    tiles = moe_gemm.expert_tiles(jnp.array(sizes, jnp.int32), rows, block_rows)
    x = jax.random.normal(kx, (rows, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (len(sizes), k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
    x_tiled = jnp.zeros((tiles.tile_experts.shape[0] * block_rows, k), jnp.bfloat16).at[tiles.slots].set(x)
    return x, w, tiles, x_tiled


def numpy_products(x, w, sizes):
    """Each expert's rows times its weight in fp32, packed order."""
    x, w = np.asarray(x, np.float32), np.asarray(w, np.float32)
    starts = np.cumsum([0] + list(sizes))
    return np.concatenate([x[starts[g]:starts[g + 1]] @ w[g] for g in range(len(sizes))])


@pytest.mark.parametrize("block_rows", [1, 64])
def test_reference_matches_numpy(block_rows):
    sizes = [3, 0, 70, 1]
    x, w, tiles, x_tiled = tiled_operands(0, sizes, 64, 128, block_rows)
    out = moe_gemm.grouped_matmul_reference(x_tiled, w, tiles.tile_experts, tiles.used_tiles)
    assert out.shape == (x_tiled.shape[0], 128) and out.dtype == jnp.bfloat16
    assert relative_error(np.asarray(out)[np.asarray(tiles.slots)], numpy_products(x, w, sizes)) < TOLERANCE


KERNEL_CASES = [
    # sizes, K, N, config (block_rows x block_cols x block_k x stages)
    ([100, 0, 1, 64, 135], 128, 256, (64, 256, 64, 2)),  # empty expert, one row, a full tile, ragged tails
    ([1], 64, 128, (64, 128, 64, 3)),  # one row; K one step (fewer steps than stages)
    ([0, 0, 130], 192, 256, (128, 256, 64, 3)),  # 128-row tiles, a 2-row tail; K three steps
    ([40, 90, 7, 0, 128, 300], 128, 512, (128, 256, 64, 2)),  # two column blocks per tile; more items than CTAs
]


@pytest.mark.parametrize("sizes, k, n, config", KERNEL_CASES)
def test_kernel_matches_numpy_and_reference(sizes, k, n, config):
    config = moe_gemm.GemmConfig(*config)
    x, w, tiles, x_tiled = tiled_operands(len(sizes) + k, sizes, k, n, config.block_rows)
    args = (x_tiled, w, tiles.tile_experts, tiles.used_tiles)
    # The race detector checks the pipeline: a slot refilled before the warpgroups are done with it.
    run = lambda: moe_gemm.grouped_matmul(  # noqa: E731
        *args, implementation="pallas", config=config, interpret=plgpu.InterpretGPUParams(detect_races=True)
    )
    assert traced_kernels(run) == {"moe_grouped_matmul": 1}
    out = run()
    assert not gpu_callbacks.get_races().races_found
    ref = moe_gemm.grouped_matmul(*args, implementation="reference")
    assert out.shape == ref.shape == (x_tiled.shape[0], n) and out.dtype == jnp.bfloat16
    used_rows = int(tiles.used_tiles) * config.block_rows
    assert relative_error(np.asarray(out)[np.asarray(tiles.slots)], numpy_products(x, w, sizes)) < TOLERANCE
    assert relative_error(out[:used_rows], ref[:used_rows]) < TOLERANCE


def test_expert_outer_reference_matches_numpy():
    sizes, block_rows = [3, 0, 70, 1], 64
    x, _, tiles, x_tiled = tiled_operands(1, sizes, 64, 128, block_rows)
    y = jax.random.normal(jax.random.key(2), (sum(sizes), 96), jnp.float32).astype(jnp.bfloat16)
    y_tiled = jnp.zeros((x_tiled.shape[0], 96), jnp.bfloat16).at[tiles.slots].set(y)
    out = moe_gemm.expert_outer_reference(x_tiled, y_tiled, tiles.tile_experts, tiles.used_tiles, len(sizes))
    starts = np.cumsum([0] + sizes)
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    want = np.stack([x[starts[g]:starts[g + 1]].T @ y[starts[g]:starts[g + 1]] for g in range(len(sizes))])
    assert out.shape == want.shape and out.dtype == jnp.bfloat16
    assert relative_error(out, want) < TOLERANCE


def test_reference_gradients_are_checked_numerically():
    """The grouped GEMM's reference against finite differences (the outer products' reference is a
    gradient itself: XLA's ragged dot does not differentiate its ragged-contracting form)."""
    _, w, tiles, x_tiled = tiled_operands(3, [5, 0, 9], 16, 8, 1)
    x, w = x_tiled.astype(jnp.float32), w.astype(jnp.float32)
    jax.test_util.check_grads(lambda x, w: moe_gemm.grouped_matmul_reference(x, w, tiles.tile_experts, tiles.used_tiles),
                              (x, w), order=1, modes=["rev"])


class TestExpertOuter(KernelCase):
    """`expert_outer_products` (the grouped GEMM's weight gradient) through its kernel: 64- and
    128-row tiles, empty and one-row experts (zeros), an empty last expert, ragged tails, more items
    than CTAs, one tile under three stages in 256 columns."""

    cases = {
        "64-row tiles, empty and one-row experts": dict(sizes=(100, 0, 1, 64, 135), k=128, n=256, block_rows=64),
        "128-row tiles, an empty last expert": dict(sizes=(40, 300, 7, 0), k=256, n=256, block_rows=128),
        "one tile under three stages, 256 columns": dict(sizes=(1,), k=128, n=256, block_rows=64, block_cols=256,
                                                         stages=3),
    }
    kernels = {"moe_expert_outer": 1}
    tolerance = TOLERANCE
    lowering_cases = {
        "prefill's gate_up": (dict(rows=65536, block_rows=128, k=4096, n=4096), ["mosaic_gpu_v2"]),
        "decode's down": (dict(rows=512, block_rows=64, k=2048, n=4096), ["mosaic_gpu_v2"]),
    }

    def inputs(self, key, sizes, k, n, block_rows, block_cols=128, stages=2):
        rows = sum(sizes)
        tiles = moe_gemm.expert_tiles(jnp.array(sizes, jnp.int32), rows, block_rows)
        m = tiles.tile_experts.shape[0] * block_rows
        kx, ky = jax.random.split(key)
        x = jnp.zeros((m, k), jnp.bfloat16).at[tiles.slots].set(jax.random.normal(kx, (rows, k)).astype(jnp.bfloat16))
        y = jax.random.normal(ky, (m, n)).astype(jnp.bfloat16)  # padding rows too: the kernel sums them
        config = moe_gemm.OuterConfig(block_rows=block_rows, block_cols=block_cols, stages=stages)
        return (x, y, tiles.tile_experts, tiles.used_tiles, len(sizes)), dict(config=config)

    def kernel(self, *args, interpret=True, config=None):
        if interpret:
            interpret = plgpu.InterpretGPUParams(detect_races=True)
        out = moe_gemm.expert_outer_products(*args, implementation="pallas", config=config, interpret=interpret)
        if interpret and not isinstance(out, jax.core.Tracer):
            assert not gpu_callbacks.get_races().races_found
        return out

    def reference(self, *args, config=None):
        return moe_gemm.expert_outer_reference(*args)

    def lowering_args(self, rows, block_rows, k, n):
        tiles, sds = moe_gemm.max_tiles(rows, 288, block_rows), jax.ShapeDtypeStruct
        m = tiles * block_rows
        args = (sds((m, k), jnp.bfloat16), sds((m, n), jnp.bfloat16), sds((tiles,), jnp.int32), sds((), jnp.int32))
        return args, dict(config=moe_gemm.OuterConfig(block_rows=block_rows))

    def test_lowers_for_an_h200(self, lowering_case):
        shape, calls = self.lowering_cases[lowering_case]
        args, kwargs = self.lowering_args(**shape)
        text = lower_for_h200(lambda *a: self.kernel(*a, 288, interpret=False, **kwargs), *args).as_text()
        assert text.count("custom_call @mosaic_gpu") == len(calls)


@pytest.mark.parametrize("sizes, k, n, config", [
    ([100, 0, 1, 64, 135], 128, 256, (64, 256, 64, 2)),  # empty and one-row experts, 64-row tiles
    ([40, 90, 7, 0, 128, 300], 256, 512, (128, 256, 64, 2)),  # 128-row tiles, rows' gradient in 256 columns
    ([0, 0, 130], 192, 256, (128, 256, 64, 3)),  # K = 192: the backward through the reference's vjp
    ([40, 300, 0, 7], 128, 512, (64, 256, 64, 2, True)),  # each expert's tiles fastest, forward and d_lhs
])
def test_kernel_gradients_match_the_references_vjp(sizes, k, n, config):
    """jax.vjp through the kernel (its custom_vjp: the transposed-weights kernel and the outer
    products' kernel) against jax.vjp of the reference, a cotangent on every row (those past the used
    tiles reach nothing)."""
    config = moe_gemm.GemmConfig(*config)
    _, w, tiles, x_tiled = tiled_operands(len(sizes) + n, sizes, k, n, config.block_rows)
    d_out = jax.random.normal(jax.random.key(k), (x_tiled.shape[0], n)).astype(jnp.bfloat16)

    def grads(implementation, interpret=False):
        f = lambda x, w: moe_gemm.grouped_matmul(  # noqa: E731
            x, w, tiles.tile_experts, tiles.used_tiles, implementation=implementation, config=config, interpret=interpret)
        return jax.vjp(f, x_tiled, w)[1](d_out)

    backward_kernels = {"moe_grouped_matmul": 2, "moe_expert_outer": 1} if k % 128 == 0 else {"moe_grouped_matmul": 1}
    assert traced_kernels(lambda: grads("pallas", True)) == backward_kernels
    (d_x, d_w), (want_x, want_w) = grads("pallas", True), grads("reference")
    assert d_x.dtype == want_x.dtype == d_w.dtype == want_w.dtype == jnp.bfloat16
    assert relative_error(d_x, want_x) < TOLERANCE and relative_error(d_w, want_w) < TOLERANCE
    assert not np.asarray(d_x[int(tiles.used_tiles) * config.block_rows:]).any()


def moe_params(seed, d, width, experts):
    ks = jax.random.split(jax.random.key(seed), 3)
    return dict(
        router=jax.random.normal(ks[0], (d, experts), jnp.float32),
        router_bias=jnp.zeros(experts, jnp.float32),
        experts_gate_up=(jax.random.normal(ks[1], (experts, d, 2, width)) * d**-0.5).astype(jnp.bfloat16),
        experts_down=(jax.random.normal(ks[2], (experts, width, d)) * width**-0.5).astype(jnp.bfloat16),
    )


@pytest.mark.parametrize("tokens", [1, 37 * 3])  # decode's shape (64-row tiles), prefill's
def test_moe_layer_through_the_kernel_matches_the_reference(tokens):
    config = Config().replace(
        hidden_size=128, moe_intermediate_size=64, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=0
    )
    p = moe_params(tokens, 128, 64, 16)
    x = jax.random.normal(jax.random.key(7), (1, tokens, 128), jnp.float32).astype(jnp.bfloat16)
    run = lambda: mlp.moe(p, x, config, implementation="pallas", interpret=True)  # noqa: E731
    assert traced_kernels(run) == {"moe_grouped_matmul": 2}  # gate_up, down
    got = run()
    want = mlp.moe(p, x, config, implementation="reference")
    assert got.shape == x.shape and got.dtype == x.dtype
    assert relative_error(got, want) < TOLERANCE


def test_moe_layer_gradients_through_the_kernels_match_the_reference():
    """jax.grad of the routed experts' output through the forward and backward kernels (interpreted)
    against the reference path's: the experts' weights, the router's and the input's gradients."""
    config = Config().replace(
        hidden_size=128, moe_intermediate_size=128, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=0
    )
    p = moe_params(5, 128, 128, 16)
    x = jax.random.normal(jax.random.key(8), (1, 111, 128), jnp.float32).astype(jnp.bfloat16)
    r = jax.random.normal(jax.random.key(9), x.shape, jnp.float32)

    def grads(implementation, interpret=False):
        loss = lambda p, x: jnp.sum(mlp.moe(p, x, config, implementation=implementation, interpret=interpret) * r)  # noqa: E731
        return jax.grad(loss, argnums=(0, 1))(p, x)

    run = lambda: grads("pallas", True)  # noqa: E731
    assert traced_kernels(run) == {"moe_grouped_matmul": 4, "moe_expert_outer": 2}  # forward 2, backward 2 + 2
    got, want = run(), grads("reference")
    for name in ("experts_gate_up", "experts_down", "router"):
        assert relative_error(got[0][name], want[0][name]) < 2 * TOLERANCE, name
    assert relative_error(got[1], want[1]) < 2 * TOLERANCE


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_combine_adds_the_experts_as_the_reference_does(dtype):
    """transformers' loop: for each expert in ascending order, final[tokens] += (row * weight) cast to
    the activations' dtype, rounding after every add. fp32: bit for bit (the order is checked: the
    same sums in the order of the routing's choices differ in the last bits)."""
    rng = np.random.default_rng(0)
    tokens, k, experts, d = 50, 6, 16, 64
    chosen = np.stack([rng.permutation(experts)[:k] for _ in range(tokens)]).astype(np.int32)  # by score, not index
    weights = rng.uniform(0.1, 2.0, (tokens, k)).astype(np.float32)
    slots = rng.permutation(tokens * k + 30)[: tokens * k].reshape(tokens, k).astype(np.int32)
    rows = (rng.standard_normal((tokens * k + 30, d)) * np.exp(rng.uniform(-3, 3, (tokens * k + 30, 1)))).astype(dtype)

    want = np.zeros((tokens, d), dtype)
    for expert in range(experts):
        token, choice = np.nonzero(chosen == expert)
        product = rows[slots[token, choice]].astype(np.float32) * weights[token, choice, None]
        want[token] = (want[token].astype(np.float32) + product.astype(dtype).astype(np.float32)).astype(dtype)
    got = np.asarray(mlp.combine(jnp.asarray(rows), jnp.asarray(slots), jnp.asarray(chosen), jnp.asarray(weights), dtype))
    assert got.dtype == want.dtype
    if dtype == np.float32:
        np.testing.assert_array_equal(got, want)
        in_choice_order = sum((rows[slots[:, j]] * weights[:, j, None]).astype(np.float32) for j in range(k))
        assert np.any(in_choice_order != want)
    else:  # XLA may keep a bf16 sum's intermediates in fp32 (excess precision): one rounding apart
        assert relative_error(got, want) < 2 * 2.0**-8


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_token_rows_differentiate_as_their_autodiff(dtype):
    """The tokens' rows in the tiled layout (`tokens[token_of_slot]`) differentiate by gathering each
    token's choices' row gradients, as autodiff's scatter-add does: padding slots (reading token 0,
    their gradient zero, as the MoE's always is) and choices held elsewhere (no slot) add nothing.
    Against autodiff in fp32: fp32 within rounding, bf16 (summed in fp32, rounded once) within one
    rounding, where autodiff's bf16 scatter-add rounds after every addition."""
    rng = np.random.default_rng(2)
    tokens, k, d, slots_count = 40, 4, 32, 200
    present = rng.uniform(size=(tokens, k)) < 0.8
    slot_of_choice = rng.permutation(slots_count)[: tokens * k].reshape(tokens, k).astype(np.int32)
    slot_of_choice = np.where(present, slot_of_choice, slots_count + 3)
    token_of_slot = np.zeros(slots_count, np.int32)
    token_of_slot[slot_of_choice[present]] = np.nonzero(present)[0]
    slots = mlp._Slots(jnp.asarray(token_of_slot), jnp.asarray(slot_of_choice), jnp.asarray(present))
    x = jnp.asarray(rng.standard_normal((tokens, d)), dtype)
    used = np.zeros(slots_count, bool)
    used[slot_of_choice[present]] = True
    d_rows = jnp.asarray(np.where(used[:, None], rng.standard_normal((slots_count, d)), 0), dtype)
    got, vjp = jax.vjp(lambda x: mlp._token_rows(x, slots), x)
    want, vjp_autodiff = jax.vjp(lambda x: x[jnp.asarray(token_of_slot)], x.astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    (d_x,), (d_want,) = vjp(d_rows), vjp_autodiff(d_rows.astype(jnp.float32))
    assert d_x.dtype == dtype
    assert relative_error(d_x, d_want) < (1e-6 if dtype == np.float32 else 2.0**-8)
    assert not np.asarray(d_x)[~present.any(1)].any()


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_combine_differentiates_as_its_autodiff(dtype):
    """combine's gradient (a gather a slot) against jax.vjp of the same sum left to autodiff (which
    scatter-adds into the rows): unused slots, choices held elsewhere (their slots out of range),
    fp32 and bf16 rows; fp32 within rounding, bf16 within one ulp."""
    rng = np.random.default_rng(1)
    tokens, k, experts, d, slots_count = 40, 4, 12, 32, 200
    chosen = np.stack([rng.permutation(experts)[:k] for _ in range(tokens)]).astype(np.int32)
    weights = jnp.asarray(rng.uniform(0.1, 2.0, (tokens, k)), jnp.float32)
    present = chosen < 9  # experts 9-11 held elsewhere
    slots = rng.permutation(slots_count)[: tokens * k].reshape(tokens, k).astype(np.int32)
    slots = jnp.asarray(np.where(present, slots, slots_count + 7))
    rows = jnp.asarray(rng.standard_normal((slots_count, d)), dtype)
    d_out = jnp.asarray(rng.standard_normal((tokens, d)), dtype)

    def autodiff(rows, weights):
        by_expert = jnp.argsort(chosen, axis=-1)
        s, w, here = (jnp.take_along_axis(jnp.asarray(x), by_expert, axis=-1) for x in (slots, weights, present))
        out = jnp.zeros((tokens, d), dtype)
        for j in range(k):
            term = (rows[jnp.clip(s[:, j], 0, slots_count - 1)] * w[:, j, None]).astype(dtype)
            out = out + jnp.where(here[:, j, None], term, 0)
        return out

    ours = jax.vjp(lambda r, w: mlp.combine(r, slots, jnp.asarray(chosen), w, dtype, jnp.asarray(present)), rows, weights)
    ref = jax.vjp(autodiff, rows, weights)
    np.testing.assert_array_equal(np.asarray(ours[0], np.float32), np.asarray(ref[0], np.float32))
    for got, want in zip(ours[1](d_out), ref[1](d_out), strict=True):
        assert got.dtype == want.dtype
        assert relative_error(got, want) < (1e-6 if dtype == np.float32 else 2.0**-8)
    assert np.all(np.asarray(ours[1](d_out)[0])[np.setdiff1d(np.arange(slots_count), np.asarray(slots))] == 0)


@pytest.mark.parametrize("rows, block_rows", [(65536, 128), (64, 64)])
def test_kernel_lowers_for_the_gpu_at_the_model_shapes(rows, block_rows):
    """GLM-5.3's gate_up and down products: the lowering checks SMEM, TMA shapes and wgmma operands."""
    for k, n in [(4096, 4096), (2048, 4096)]:
        config = moe_gemm.GemmConfig(block_rows=block_rows)
        tiles = moe_gemm.max_tiles(rows, 288, block_rows)
        shapes = [
            jax.ShapeDtypeStruct((tiles * block_rows, k), jnp.bfloat16),
            jax.ShapeDtypeStruct((288, k, n), jnp.bfloat16),
            jax.ShapeDtypeStruct((tiles,), jnp.int32),
            jax.ShapeDtypeStruct((), jnp.int32),
        ]
        text = lower_for_h200(
            lambda *a: moe_gemm.grouped_matmul(*a, implementation="pallas", config=config), *shapes
        ).as_text()
        assert text.count("custom_call @mosaic_gpu") == 1


def test_plan_picks_tiles_by_rows_per_expert():
    x = jnp.zeros((8, 4096), jnp.bfloat16)
    weights = (jax.ShapeDtypeStruct((288, 4096, 4096), jnp.bfloat16), jax.ShapeDtypeStruct((288, 2048, 4096), jnp.bfloat16))
    assert moe_gemm.plan("pallas", x, weights, rows=65536) == ("pallas", moe_gemm.GemmConfig(block_rows=128))
    assert moe_gemm.plan("pallas", x, weights, rows=64) == ("pallas", moe_gemm.GemmConfig(block_rows=64))
    assert moe_gemm.plan("reference", x, weights, rows=64) == ("reference", moe_gemm.GemmConfig(block_rows=1))
    # On the CPU the automatic choice is the reference.
    assert moe_gemm.plan(None, x, weights, rows=64)[0] == "reference"


def test_bad_arguments_are_named():
    x, w, tiles, x_tiled = tiled_operands(0, [3, 5], 64, 128, 64)
    args = (x_tiled, w, tiles.tile_experts, tiles.used_tiles)
    with pytest.raises(ValueError, match="weights \\[G, K, N\\]"):
        moe_gemm.grouped_matmul(x_tiled[:, :32], *args[1:])
    with pytest.raises(ValueError, match="tile_experts must be \\[T\\]"):
        moe_gemm.grouped_matmul(x_tiled[:-1], *args[1:])
    with pytest.raises(ValueError, match="used_tiles must be a scalar"):
        moe_gemm.grouped_matmul(*args[:3], tiles.tile_experts)
    with pytest.raises(ValueError, match="implementation must be one of"):
        moe_gemm.grouped_matmul(*args, implementation="triton")
    with pytest.raises(ValueError, match="bf16 x and weights"):
        moe_gemm.grouped_matmul(x_tiled.astype(jnp.float32), w, *args[2:], implementation="pallas")
    with pytest.raises(ValueError, match="N = 128 must be a multiple of block_cols = 256"):
        moe_gemm.grouped_matmul(*args, implementation="pallas", config=moe_gemm.GemmConfig(block_rows=64))
    with pytest.raises(ValueError, match="T \\* block_rows"):
        moe_gemm.grouped_matmul(
            *args, implementation="pallas", config=moe_gemm.GemmConfig(block_rows=128, block_cols=128)
        )


class TestGroupedMatmul(KernelCase):
    """Through `grouped_matmul`: empty experts, one row, ragged tails, 64- and 128-row tiles, more
    items than CTAs; the rows of used tiles."""

    cases = {
        "64-row tiles, empty and one-row experts": dict(sizes=(100, 0, 1, 64, 135), k=128, n=256, block_rows=64),
        "128-row tiles, two column blocks": dict(sizes=(40, 90, 7, 0, 128, 300), k=128, n=512, block_rows=128),
        "each expert's tiles fastest": dict(sizes=(200, 0, 1, 130, 64), k=128, n=768, block_rows=64, tiles_fastest=True),
    }
    kernels = {"moe_grouped_matmul": 1}
    tolerance = TOLERANCE
    lowering_cases = {
        "prefill's gate_up": (dict(rows=65536, block_rows=128, k=4096, n=4096), ["mosaic_gpu_v2"]),
        "decode's down": (dict(rows=64, block_rows=64, k=2048, n=4096), ["mosaic_gpu_v2"]),
        "prefill's gate_up, tiles fastest": (dict(rows=65536, block_rows=128, k=4096, n=4096, tiles_fastest=True),
                                             ["mosaic_gpu_v2"]),
    }

    def inputs(self, key, sizes, k, n, block_rows, tiles_fastest=False):
        _, w, tiles, x_tiled = tiled_operands(int(jax.random.randint(key, (), 0, 2**30)), list(sizes), k, n, block_rows)
        config = moe_gemm.GemmConfig(block_rows=block_rows, tiles_fastest=tiles_fastest)
        return (x_tiled, w, tiles.tile_experts, tiles.used_tiles), dict(config=config)

    def kernel(self, *args, interpret=True, config=None):
        return moe_gemm.grouped_matmul(*args, implementation="pallas", config=config, interpret=interpret)

    def reference(self, *args, config=None):
        return moe_gemm.grouped_matmul_reference(*args)

    def compare(self, got, want, sizes, block_rows, **_):
        used = sum(-(-size // block_rows) for size in sizes) * block_rows  # rows past the used tiles: unwritten
        assert got.shape == want.shape and got.dtype == want.dtype
        assert relative_error(got[:used], want[:used]) < TOLERANCE

    def lowering_args(self, rows, block_rows, k, n, tiles_fastest=False):
        tiles, sds = moe_gemm.max_tiles(rows, 288, block_rows), jax.ShapeDtypeStruct
        args = (sds((tiles * block_rows, k), jnp.bfloat16), sds((288, k, n), jnp.bfloat16), sds((tiles,), jnp.int32),
                sds((), jnp.int32))
        return args, dict(config=moe_gemm.GemmConfig(block_rows=block_rows, tiles_fastest=tiles_fastest))


def fp8_operands(key, sizes, k, n, block_rows):
    """Rows and weights quantized block by block from values whose blocks differ in size by up to
    2^12 (a scale read from the wrong block shows), with an all-zero weight block and a zero row."""
    kx, kw, ksx, ksw = jax.random.split(key, 4)
    rows, kb, nb = sum(sizes), -(-k // 128), -(-n // 128)
    x = jax.random.normal(kx, (rows, k)) * jnp.exp2(jax.random.randint(ksx, (rows, kb), -6, 6)).repeat(128, 1)[:, :k]
    w = jax.random.normal(kw, (len(sizes), n, k)) * k**-0.5
    w = w * jnp.exp2(jax.random.randint(ksw, (len(sizes), nb, kb), -6, 6)).repeat(128, 1).repeat(128, 2)[:, :n, :k]
    x = x.at[0].set(0)
    w = w.at[-1, :128, :128].set(0)
    x_q, x_s = block_fp8.quantize_rows(x)
    w_q, w_s = block_fp8.quantize_blocks(w)
    tiles = moe_gemm.expert_tiles(jnp.array(sizes, jnp.int32), rows, block_rows)
    m = tiles.tile_experts.shape[0] * block_rows
    x_tiled = jnp.zeros((m, k), x_q.dtype).at[tiles.slots].set(x_q)
    s_tiled = jnp.ones((m, x_s.shape[1]), jnp.float32).at[tiles.slots].set(x_s)
    return (x_q, x_s, w_q, w_s), tiles, (x_tiled, s_tiled, w_q, w_s, tiles.tile_experts, tiles.used_tiles)


@pytest.mark.parametrize("k, n", [(256, 128), (200, 70)])  # whole blocks; partial blocks in both dimensions
def test_fp8_reference_matches_numpy(k, n):
    """The reference against fp8 values times their block's scale, multiplied per expert in numpy."""
    sizes = [3, 0, 70, 1]
    (x_q, x_s, w_q, w_s), tiles, args = fp8_operands(jax.random.key(k), sizes, k, n, 64)
    out = moe_gemm.grouped_matmul_fp8_reference(*args)
    x = np.asarray(x_q, np.float32) * np.repeat(np.asarray(x_s), 128, 1)[:, :k]
    w = np.asarray(w_q, np.float32) * np.repeat(np.repeat(np.asarray(w_s), 128, 1), 128, 2)[:, :n, :k]
    assert out.shape == (args[0].shape[0], n) and out.dtype == jnp.bfloat16
    got = np.asarray(out, np.float32)[np.asarray(tiles.slots)]
    assert relative_error(got, numpy_products(x, np.swapaxes(w, 1, 2), sizes)) < TOLERANCE


@pytest.mark.parametrize("per_element", [(1,), (2,), (1, 2)])  # N, K, both
def test_fp8_reference_takes_scales_per_element(per_element, kernel_seed):
    """Scales per element on N or K (as a device holds them where a mesh cuts a block; x's with the
    weight's K) give the block scales' product exactly; the automatic choice takes the reference for
    them, and the kernel, asked for, names why it cannot."""
    sizes = [5, 0, 40]
    (x_q, x_s, w_q, w_s), tiles, args = fp8_operands(jax.random.key(kernel_seed), sizes, 256, 384, 64)
    x, xs, w, ws, tile_experts, used = args
    ws_element = block_fp8.expand_scales(ws, w.shape, per_element)
    xs_element = block_fp8.expand_scales(xs, x.shape, (1,)) if 2 in per_element else xs
    want = moe_gemm.grouped_matmul_fp8_reference(*args)
    got = moe_gemm.grouped_matmul_fp8(x, xs_element, w, ws_element, tile_experts, used, interpret=True)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert traced_kernels(lambda *a: moe_gemm.grouped_matmul_fp8(*a, interpret=True),
                          x, xs_element, w, ws_element, tile_experts, used) == {}
    with pytest.raises(ValueError, match="scales are per element on an axis"):
        moe_gemm.grouped_matmul_fp8(x, xs_element, w, ws_element, tile_experts, used, implementation="pallas")
    dense = moe_gemm.matmul_fp8(x_q[:20], block_fp8.expand_scales(x_s[:20], (20, 256), (1,)), w_q[0], ws_element[0],
                                interpret=True)
    np.testing.assert_array_equal(np.asarray(dense, np.float32), np.asarray(
        moe_gemm.matmul_fp8(x_q[:20], x_s[:20], w_q[0], w_s[0], implementation="reference"), np.float32))


class TestGroupedMatmulFp8(KernelCase):
    """Through `grouped_matmul_fp8`: 64-row tiles (the warpgroups split the columns) and 128-row
    tiles (they split the rows), empty and one-row experts, ragged tails, two K steps and two
    column blocks, one K step under three stages, more items than CTAs, a CTA with a single item,
    items whose loads run on into the next and items that each fill and drain their own pipeline, a
    zero weight block and a zero row; block scales spread over 2^12."""

    cases = {
        "64-row tiles, empty and one-row experts": dict(sizes=(100, 0, 1, 64, 135), k=256, n=256, block_rows=64, stages=2),
        "128-row tiles, more items than CTAs": dict(sizes=(40, 90, 7, 0, 128, 300), k=128, n=384, block_rows=128, stages=3),
        "clusters of two sharing rows": dict(sizes=(70, 0, 200, 1), k=384, n=512, block_rows=128, stages=2, cluster=2),
        "256-column tiles, 128 rows": dict(sizes=(130, 3, 0, 64), k=256, n=512, block_rows=128, stages=2, block_cols=256),
        "256-column tiles, 64 rows, clusters": dict(sizes=(65, 1, 0), k=128, n=512, block_rows=64, stages=3,
                                                    block_cols=256, cluster=2),
        "loads running on into the next item": dict(sizes=(130, 5, 64), k=512, n=256, block_rows=64, stages=2),
        "a single item a CTA": dict(sizes=(0, 50), k=512, n=256, block_rows=128, stages=2),
        "each item its own pipeline": dict(sizes=(100, 30), k=512, n=256, block_rows=64, stages=2, overlap=False),
        "warpgroups taking turns": dict(sizes=(150, 0, 64, 9), k=384, n=256, block_rows=128, stages=2, pingpong=True),
        "taking turns, 64-row tiles of 256 columns": dict(sizes=(70, 1), k=256, n=512, block_rows=64, stages=2,
                                                          block_cols=256, overlap=False, pingpong=True),
        "rescaled sums, 256-column tiles in clusters": dict(sizes=(130, 0, 3, 64), k=512, n=1024, block_rows=128,
                                                            stages=3, block_cols=256, cluster=2, rescale=True),
        "rescaled sums, 64-row tiles, own pipelines": dict(sizes=(65, 1), k=384, n=256, block_rows=64, stages=2,
                                                           overlap=False, rescale=True),
        "column blocks fastest": dict(sizes=(300, 0, 130, 7, 64), k=256, n=384, block_rows=64, stages=2,
                                      tiles_fastest=False),
        "experts of several tiles, rescaled in clusters": dict(sizes=(260, 1, 0, 129), k=384, n=1024, block_rows=128,
                                                               stages=3, block_cols=256, cluster=2, rescale=True),
    }
    kernels = {"moe_grouped_matmul_fp8": 1}
    tolerance = TOLERANCE
    lowering_cases = {
        "prefill's gate_up": (dict(rows=65536, block_rows=128, k=4096, n=4096), ["mosaic_gpu_v2"]),
        "decode's down": (dict(rows=512, block_rows=64, k=2048, n=4096), ["mosaic_gpu_v2"]),
        "prefill's gate_up in clusters of two": (dict(rows=65536, block_rows=128, k=4096, n=4096, cluster=2),
                                                 ["mosaic_gpu_v2"]),
        "prefill's down in 256-column tiles": (dict(rows=65536, block_rows=128, k=2048, n=4096, block_cols=256,
                                                    stages=3), ["mosaic_gpu_v2"]),
        "prefill's gate_up, warpgroups taking turns": (dict(rows=65536, block_rows=128, k=4096, n=4096,
                                                            pingpong=True), ["mosaic_gpu_v2"]),
        "prefill's gate_up, rescaled 256-column sums": (dict(rows=65536, block_rows=128, k=4096, n=4096, block_cols=256,
                                                             stages=3, cluster=2, rescale=True), ["mosaic_gpu_v2"]),
        "prefill's gate_up, column blocks fastest": (dict(rows=65536, block_rows=128, k=4096, n=4096,
                                                          tiles_fastest=False), ["mosaic_gpu_v2"]),
    }

    def inputs(self, key, sizes, k, n, block_rows, stages, cluster=1, block_cols=128, overlap=True, pingpong=False,
               rescale=False, tiles_fastest=True):
        _, _, args = fp8_operands(key, list(sizes), k, n, block_rows)
        config = moe_gemm.Fp8GemmConfig(block_rows=block_rows, block_cols=block_cols, stages=stages, cluster=cluster,
                                        overlap_items=overlap, pingpong=pingpong, rescale=rescale,
                                        tiles_fastest=tiles_fastest)
        return args, dict(config=config)

    def kernel(self, *args, interpret=True, config=None):
        if interpret:  # the race detector checks the pipeline's slots
            interpret = plgpu.InterpretGPUParams(detect_races=True)
        out = moe_gemm.grouped_matmul_fp8(*args, implementation="pallas", config=config, interpret=interpret)
        if interpret and not isinstance(out, jax.core.Tracer):  # run, not traced
            assert not gpu_callbacks.get_races().races_found
        return out

    def reference(self, *args, config=None):
        return moe_gemm.grouped_matmul_fp8_reference(*args)

    def compare(self, got, want, sizes, block_rows, **_):
        used = sum(-(-size // block_rows) for size in sizes) * block_rows  # rows past the used tiles: unwritten
        assert got.shape == want.shape and got.dtype == want.dtype
        assert relative_error(got[:used], want[:used]) < TOLERANCE

    def lowering_args(self, rows, block_rows, k, n, cluster=1, block_cols=128, stages=4, pingpong=False, rescale=False,
                      tiles_fastest=True):
        tiles, sds, fp8 = moe_gemm.max_tiles(rows, 288, block_rows), jax.ShapeDtypeStruct, jnp.float8_e4m3fn
        m = tiles * block_rows
        args = (sds((m, k), fp8), sds((m, k // 128), jnp.float32), sds((288, n, k), fp8),
                sds((288, n // 128, k // 128), jnp.float32), sds((tiles,), jnp.int32), sds((), jnp.int32))
        config = moe_gemm.Fp8GemmConfig(block_rows=block_rows, block_cols=block_cols, stages=stages, cluster=cluster,
                                        pingpong=pingpong, rescale=rescale, tiles_fastest=tiles_fastest)
        return args, dict(config=config)


def test_fp8_bad_arguments_are_named():
    _, _, args = fp8_operands(jax.random.key(0), [3, 5], 256, 128, 64)
    x, x_s, w, w_s, tile_experts, used = args
    with pytest.raises(ValueError, match="weights \\[G, N, K\\]"):
        moe_gemm.grouped_matmul_fp8(x[:, :128], x_s, w, w_s, tile_experts, used)
    with pytest.raises(ValueError, match="x_scales must be \\[M, ceil\\(K / 128\\)\\]"):
        moe_gemm.grouped_matmul_fp8(x, x_s[:, :1], w, w_s, tile_experts, used)
    with pytest.raises(ValueError, match="weight_scales must be \\[G, ceil\\(N / 128\\), ceil\\(K / 128\\)\\]"):
        moe_gemm.grouped_matmul_fp8(x, x_s, w, w_s[:, :, :1], tile_experts, used)
    with pytest.raises(ValueError, match="x must be float8_e4m3fn"):
        moe_gemm.grouped_matmul_fp8(x.astype(jnp.bfloat16), x_s, w, w_s, tile_experts, used)
    with pytest.raises(ValueError, match="N = 200 must be a multiple of block_cols = 128 and K = 256 of 128"):
        moe_gemm.grouped_matmul_fp8(x, x_s, jnp.zeros((2, 200, 256), w.dtype), jnp.ones((2, 2, 2)), tile_experts, used,
                                    implementation="pallas")
    with pytest.raises(ValueError, match="T \\* block_rows"):
        moe_gemm.grouped_matmul_fp8(*args, implementation="pallas", config=moe_gemm.Fp8GemmConfig(block_rows=128))


def test_fp8_plan_picks_tiles_by_rows_per_expert_and_items_per_sm():
    w = (jax.ShapeDtypeStruct((288, 4096, 4096), jnp.float8_e4m3fn),)
    assert moe_gemm.plan_fp8("pallas", w, rows=65536) == ("pallas", moe_gemm.Fp8GemmConfig(block_rows=128))
    assert moe_gemm.plan_fp8("pallas", w, rows=512) == ("pallas", moe_gemm.Fp8GemmConfig(block_rows=64))
    dense = lambda n: (jax.ShapeDtypeStruct((1, n, 4096), jnp.float8_e4m3fn),)  # noqa: E731
    assert moe_gemm.plan_fp8("pallas", dense(4096), rows=8192)[1].block_rows == 128  # 64 tiles x 32 columns
    assert moe_gemm.plan_fp8("pallas", dense(512), rows=8192)[1].block_rows == 64  # 64 x 4: 2 items an SM
    assert moe_gemm.plan_fp8(None, w, rows=512)[0] == "reference"  # on the CPU
