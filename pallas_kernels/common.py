"""What every op shares: the choice between a Pallas kernel and its pure-jnp reference, the device
facts the kernels size themselves by, lowering for an H200 without one, and the references' walk over
blocks of queries."""

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

HIGHEST = jax.lax.Precision.HIGHEST  # the references' products: fp32 accuracy on every backend
IMPLEMENTATIONS = (None, "reference", "pallas")


def pick_implementation(implementation, unsupported, dtype, *, interpret=False):
    """"pallas" or "reference": what runs one call of an op.

    implementation: None picks the kernel where it applies on a GPU (bf16 inputs, `unsupported` None),
    else the reference; "pallas" asks for the kernel and raises if `unsupported` says why it cannot
    take the call; "reference" asks for the pure-jnp reference. unsupported: None, or why the kernel
    cannot take this call. interpret: the kernels run in Pallas' interpreter, and None chooses as on a
    GPU whatever the backend (how the CPU tests reach the GPU's path); the reference ignores it.

    The kernels multiply bf16 operands (fp32 accumulation), so the automatic choice keeps fp32
    inputs on the fp32 reference: on the H200 the tiny fp32 model's logits move by 0.14-0.19
    (relative) through the kernels against 3.7e-6 through the reference.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation is None:
        on_gpu = interpret or jax.default_backend() == "gpu"
        return "pallas" if on_gpu and unsupported is None and jnp.dtype(dtype) == jnp.bfloat16 else "reference"
    if implementation == "pallas" and unsupported is not None:
        raise ValueError(f"the Pallas kernel does not support this call: {unsupported}")
    return implementation


def ignore(*_, **__):
    """A pipeline body or compute context that does nothing: what a warp-specialized pipeline is
    built with to ask for its allocations (`get_allocations`) before the real one runs."""
    return None


def warpgroup_kernel(body, out_type, *, name, ctas, interpret, cluster=None, profile=None):
    """`plgpu.kernel` of `ctas` CTAs (grid axis "sm"), three warpgroups each (axis "wg": two compute
    warpgroups and one that feeds them by TMA), in Warpgroup lowering; with `cluster`, CTAs in
    clusters of that many (axis "cluster"). `interpret`: True or `plgpu.InterpretGPUParams` runs it
    in Pallas' interpreter. `profile`: None, or (ranges, directory): each call writes a Perfetto trace
    of its named scopes per warpgroup (Mosaic GPU's profiler; the first `ranges` scopes a warpgroup
    enters, the rest dropped) into that directory."""
    clusters = {} if cluster is None else {"cluster": (cluster,), "cluster_names": ("cluster",)}
    if interpret and not isinstance(interpret, plgpu.InterpretGPUParams):
        interpret = plgpu.InterpretGPUParams()
    return plgpu.kernel(
        body, out_type=out_type, grid=(ctas,), grid_names=("sm",), **clusters, num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
            **({} if profile is None else {"profile_space": profile[0], "profile_dir": profile[1], "profile_bounds_check": True}),
        ),
        interpret=interpret or None, kernel_name=name,
    )


def sm_count():
    """SMs of the default device (132, the H200's, where JAX does not say: CPU lowering for it)."""
    return getattr(jax.devices()[0], "core_count", None) or 132


def lower_for_h200(fn, *args):
    """`fn` jitted and lowered for an abstract H200 (no GPU needed): the Mosaic GPU kernels go through
    their whole lowering (TMA shapes, layouts, wgmma operands) and the Triton ones through Triton's
    block-shape checks, which the interpreter does not do."""
    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h200)):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def query_blocks(x, fill, block):
    """[B, T, ...] -> [ceil(T / block), B, block, ...]: T padded with `fill` to whole blocks."""
    b, t = x.shape[:2]
    x = jnp.pad(x, [(0, 0), (0, -t % block)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return jnp.moveaxis(x.reshape(b, -1, block, *x.shape[2:]), 1, 0)


def join_query_blocks(y, t):
    """`query_blocks`' inverse: [n, B, block, ...] -> [B, t, ...], the padding dropped."""
    return jnp.moveaxis(y, 0, 1).reshape(y.shape[1], -1, *y.shape[3:])[:, :t]


def map_query_blocks(fn, xs, fills, block):
    """fn over blocks of `block` queries (fewer when T is shorter), so that what a query builds against
    every key or pool (scores, masks) is never whole for the sequence. xs: arrays [B, T, ...], padded
    on T to whole blocks with `fills` (one per array); fn(blocks of xs) -> a pytree of [B, block, ...].
    Returns that pytree as [B, T, ...]. Differentiated, each block is recomputed in the backward pass
    (`jax.checkpoint`), so that the map keeps its blocks' inputs, not every block's scores."""
    t = xs[0].shape[1]
    block = min(block, t)
    out = jax.lax.map(jax.checkpoint(fn), tuple(query_blocks(x, fill, block) for x, fill in zip(xs, fills)))
    return jax.tree.map(lambda y: join_query_blocks(y, t), out)
