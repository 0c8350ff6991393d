"""Single-kernel programs of the step-time suite, each with its analytic work in the docstring (v5e:
197 TFLOP/s bf16 peak, 819 GB/s HBM, datasheet)."""
import jax
import jax.numpy as jnp


def elementwise(x, y):
    """bf16[8192, 8192] x2 -> bf16: x * sigmoid(x) + 0.5 * y. Memory-bound: reads 2 x 128 MiB, writes
    128 MiB; 67 M transcendentals."""
    return (jax.nn.silu(x.astype(jnp.float32)) + 0.5 * y.astype(jnp.float32)).astype(x.dtype)


def layernorm_softmax(x, g):
    """LayerNorm then softmax over the last axis of bf16[8, 4096, 4096] (statistics in f32): reads 256 MiB,
    writes 256 MiB; one exp per element (134 M)."""
    x32 = x.astype(jnp.float32)
    m = x32.mean(-1, keepdims=True)
    v = jnp.mean((x32 - m) ** 2, -1, keepdims=True)
    h = (x32 - m) * jax.lax.rsqrt(v + 1e-5) * (1 + g.astype(jnp.float32))
    return jax.nn.softmax(h, -1).astype(x.dtype)


def reduction(x):
    """Row sums and maxima of f32[16384, 8192] (512 MiB read): memory-bound."""
    return x.sum(-1), x.max(-1)


def chained_matmuls(x, w1, w2, w3, w4):
    """bf16[4096, 4096] through four bf16[4096, 4096] weights: 4 x 2 x 4096^3 = 5.5e11 FLOPs."""
    return (((x @ w1) @ w2) @ w3) @ w4


def matmul_f32_highest(a, b):
    """f32[4096, 4096] @ f32[4096, 4096] at Precision.HIGHEST: 1.37e11 FLOPs, several bf16 passes on TPU."""
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def matmul_int8(a, b):
    """s8[8192, 8192] @ s8[8192, 8192] -> s32: 1.1e12 integer OPs."""
    return jax.lax.dot(a, b, preferred_element_type=jnp.int32)


def embedding_scatter_add(table, ids, updates):
    """The gradient of an embedding lookup: updates f32[32768, 1024] added into rows ids (taken modulo
    the rows) of table f32[65536, 1024] (donated): 128 MiB of updates, 256 MiB table."""
    return table.at[ids % table.shape[0]].add(updates)


def topk_sampling(logits, key):
    """Top-k (k=64) sampling from logits f32[128, 128256]: lax.top_k, a softmax over the k, one draw per row."""
    vals, idx = jax.lax.top_k(logits, 64)
    choice = jax.random.categorical(key, vals, axis=-1)
    return jnp.take_along_axis(idx, choice[:, None], -1)[:, 0]


def long_attention(q, k, v):
    """Causal attention over one long sequence: q, k, v bf16[1, 8192, 8, 128] (XLA's implementation of
    jax.nn.dot_product_attention): 2 x 2 x 8192^2 x 8 x 128 = 2.7e11 FLOPs, a [8, 8192, 8192] score matrix."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)
