import jax, jax.numpy as jnp, numpy as np
from pallas_kernels import kda
b, t, h, d = 2, 1000, 4, 128
ks = jax.random.split(jax.random.key(0), 8)
bf = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
q, k, v = (bf(jax.random.normal(kk, (b, t, h, d))) for kk in ks[:3])
g = -5.0 * jax.nn.sigmoid(2 * jax.random.normal(ks[3], (b, t, h, d)))
beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h)))
s0 = 0.1 * jax.random.normal(ks[5], (b, h, d, d)); d_o = bf(jax.random.normal(ks[6], q.shape)); d_s = jax.random.normal(ks[7], s0.shape)
lengths = jnp.array([1000, 700], jnp.int32)
def vjp(impl):
    f = lambda *x: kda.kda_chunk_scan(*x, lengths=lengths, implementation=impl)
    return jax.jit(lambda *a: jax.vjp(f, *a[:6])[1]((a[6], a[7])))(q, k, v, g, beta, s0, d_o, d_s)
got, want = vjp("pallas"), vjp("reference")
for n, a, w in zip("q k v g beta s0".split(), got, want):
    print("gpu vjp", n, float(jnp.abs(a - w).max() / jnp.abs(w).max()))
