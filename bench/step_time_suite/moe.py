"""A GShard-style mixture-of-experts layer (top-2 gating with capacity, one-hot dispatch and combine
einsums, expert FFNs as batched matmuls) forward and backward, for the step-time suite.
Groups G, tokens per group S, experts E, capacity C = 2 * S / E * 1.25."""
import jax
import jax.numpy as jnp

E, D, F = 8, 1024, 4096


def init_params(key, e=E, d=D, f=F):
    z = lambda *s: jnp.zeros(s, jnp.bfloat16)
    return {"gate": z(d, e), "w_in": z(e, d, f), "w_out": z(e, f, d)}


def _top2_dispatch(logits, capacity):
    """GShard top-2 routing: dispatch bool-like [G, S, E, C] and combine weights of the same shape."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), -1)                  # [G, S, E]
    e = probs.shape[-1]
    i1 = jnp.argmax(probs, -1)
    m1 = jax.nn.one_hot(i1, e, dtype=jnp.float32)
    i2 = jnp.argmax(probs * (1 - m1), -1)
    m2 = jax.nn.one_hot(i2, e, dtype=jnp.float32)
    pos1 = jnp.cumsum(m1, 1) - 1                                             # slot of each token per expert
    pos2 = jnp.cumsum(m2, 1) - 1 + jnp.sum(m1, 1, keepdims=True)
    m1, m2 = m1 * (pos1 < capacity), m2 * (pos2 < capacity)
    g1, g2 = (probs * m1).sum(-1), (probs * m2).sum(-1)
    denom = jnp.maximum(g1 + g2, 1e-9)
    g1, g2 = g1 / denom, g2 / denom
    oh = lambda pos, m: jax.nn.one_hot((pos * m).sum(-1).astype(jnp.int32), capacity) * m.sum(-1, keepdims=True)
    combine = (g1[..., None, None] * m1[..., None] * oh(pos1, m1)[..., None, :]
               + g2[..., None, None] * m2[..., None] * oh(pos2, m2)[..., None, :])
    return (combine > 0).astype(jnp.bfloat16), combine.astype(jnp.bfloat16)


def moe_layer(params, x):
    """x bf16[G, S, D] -> bf16[G, S, D]."""
    g, s, _ = x.shape
    capacity = int(2 * s / E * 1.25)
    dispatch, combine = _top2_dispatch(x @ params["gate"], capacity)
    xe = jnp.einsum("gsec,gsd->egcd", dispatch, x)
    h = jax.nn.gelu(jnp.einsum("egcd,edf->egcf", xe, params["w_in"]))
    ye = jnp.einsum("egcf,efd->egcd", h, params["w_out"])
    return jnp.einsum("gsec,egcd->gsd", combine, ye)


def train_step(params, x):
    """Forward and backward of the MoE layer on x bf16[G, S, D]; SGD update (params donated)."""
    l, g = jax.value_and_grad(lambda p: jnp.mean(moe_layer(p, x).astype(jnp.float32) ** 2))(params)
    return jax.tree.map(lambda p, g: p - (1e-3 * g).astype(p.dtype), params, g), l
