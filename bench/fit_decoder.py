"""Llama-3-shaped decoders (tests/data/llama3_8b.py's layer: scanned layers, bf16 parameters, f32
Adam moments) with a remat knob, for ``stagetool fit`` (issue 32; docs/sweeps-fit.md, "What fits").

``size`` (static, and ``init_state``'s keyword): a key of :data:`SHAPES` — ``8b`` (Llama 3 8B:
D 4096, F 14336, 32 heads, 8 KV heads, 32 layers) or ``70b`` (Llama 3 70B: D 8192, F 28672, 64
heads, 8 KV heads, 80 layers); both have head dimension 128 and vocabulary 128256.

``remat`` (static): ``none`` keeps every layer's activations for the backward pass; ``dots`` saves
only the matmul outputs without batch dimensions (``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``);
``full`` saves nothing but each layer's input (``jax.checkpoint_policies.nothing_saveable``).
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Shape(NamedTuple):
    """A decoder's dimensions: model D, feed-forward F, vocabulary V, layers L, heads H, KV heads KV,
    head dimension HD."""

    D: int
    F: int
    V: int
    L: int
    H: int
    KV: int
    HD: int


SHAPES = {"8b": Shape(D=4096, F=14336, V=128256, L=32, H=32, KV=8, HD=128),
          "70b": Shape(D=8192, F=28672, V=128256, L=80, H=64, KV=8, HD=128)}

POLICIES = {"dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
            "full": jax.checkpoint_policies.nothing_saveable}


def init_state(key, size="8b"):
    s = SHAPES[size]
    bf = jnp.bfloat16
    z = lambda *d: jnp.zeros(d, bf)
    L, D, F, H, KV, HD = s.L, s.D, s.F, s.H, s.KV, s.HD
    layers = {"wq": z(L, D, H * HD), "wk": z(L, D, KV * HD), "wv": z(L, D, KV * HD), "wo": z(L, H * HD, D),
              "w1": z(L, D, F), "w3": z(L, D, F), "w2": z(L, F, D), "n1": z(L, D), "n2": z(L, D)}
    params = {"embed": z(s.V, D), "layers": layers, "norm": z(D), "head": z(D, s.V)}
    f32 = lambda t: jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), t)
    return {"params": params, "m": f32(params), "v": f32(params)}


def _rms(x, w):
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-5).astype(x.dtype) * w


def _layer(s, x, p):
    b, t, _ = x.shape
    h = _rms(x, p["n1"])
    q = (h @ p["wq"]).reshape(b, t, s.H, s.HD)
    k = jnp.repeat((h @ p["wk"]).reshape(b, t, s.KV, s.HD), s.H // s.KV, axis=2)
    v = jnp.repeat((h @ p["wv"]).reshape(b, t, s.KV, s.HD), s.H // s.KV, axis=2)
    a = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, s.H * s.HD)
    x = x + a @ p["wo"]
    h = _rms(x, p["n2"])
    return x + (jax.nn.silu(h @ p["w1"]) * (h @ p["w3"])) @ p["w2"], None


def loss(params, tokens, remat, size="8b"):
    layer = functools.partial(_layer, SHAPES[size])
    if remat != "none":
        layer = jax.checkpoint(layer, policy=POLICIES[remat])
    x = params["embed"][tokens]
    x, _ = jax.lax.scan(layer, x, params["layers"])
    logits = _rms(x, params["norm"]) @ params["head"]
    return -jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 0])


def train_step(state, tokens, remat="none", size="8b"):
    g = jax.grad(loss)(state["params"], tokens, remat, size)
    m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, state["m"], g)
    v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, state["v"], g)
    p = jax.tree.map(lambda p, m, v: (p - 1e-4 * m / (jnp.sqrt(v) + 1e-8)).astype(p.dtype), state["params"], m, v)
    return {"params": p, "m": m, "v": v}
