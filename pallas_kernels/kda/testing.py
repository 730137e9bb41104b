"""Random inputs of the KDA decode step, for tests and benchmarks."""

import jax
import jax.numpy as jnp


def decode_token_inputs(step_kwargs):
    """Of `kda_decode_step`'s keyword arguments (a dict, as `random_decode_inputs` makes), those that
    `decode_token_vectors_reference` and the token kernel take, in their order."""
    return tuple(step_kwargs[n] for n in ("qkv", "conv_state", "conv_weight", "f", "dt_bias", "a_log", "beta_logits"))


def random_decode_inputs(key, b, h, d, *, state_scale=1.0):
    """Random keyword arguments of `kda_decode_step` (B = b, H = h, dk = dv = d, a width-4 conv), bf16
    activations as the model passes them: for tests and benchmarks."""
    c = h * d
    ks = jax.random.split(key, 8)
    return dict(
        qkv=jax.random.normal(ks[0], (b, 3, c), jnp.bfloat16),
        conv_state=jax.random.normal(ks[1], (b, 3, c, 4), jnp.bfloat16),
        conv_weight=0.5 * jax.random.normal(ks[2], (4, 3, c)),
        f=jax.random.normal(ks[3], (b, c), jnp.bfloat16),
        dt_bias=0.1 * jax.random.normal(ks[4], (c,)),
        a_log=0.3 * jax.random.normal(ks[5], (h,)),
        beta_logits=jax.random.normal(ks[6], (b, h), jnp.bfloat16),
        state=state_scale * jax.random.normal(ks[7], (b, h, d, d)),
    )
