"""What every op's dispatch shares: the choice between a Pallas kernel and its pure-jnp reference."""

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = (None, "reference", "pallas")


def pick_implementation(implementation, unsupported, dtype, *, interpret=False):
    """"pallas" or "reference": what runs one call of an op.

    implementation: None picks the kernel where it applies on a GPU (bf16 inputs, `unsupported` None),
    else the reference; "pallas" asks for the kernel and raises if `unsupported` says why it cannot
    take the call; "reference" asks for the pure-jnp reference. unsupported: None, or why the kernel
    cannot take this call. interpret: the kernels run in Pallas' interpreter, and None chooses as on a
    GPU whatever the backend (how the CPU tests reach the GPU's path); the reference ignores it.

    The kernels multiply bf16 operands (fp32 accumulation), so the automatic choice keeps fp32
    inputs on the fp32 reference: on the H200 the tiny fp32 model's logits moved by 0.14-0.19
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
