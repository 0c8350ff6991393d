"""A decoder stack scanned over its layers, with and without ``jax.checkpoint`` on the layer (remat):
the memory timeline's test program (tests/analysis/test_timeline.py).

Per layer: ``h + tanh(h @ w_up) @ w_down``. Without remat the backward scan keeps every layer's
``[B, S, F]`` activations from the forward scan; with remat it keeps only each layer's input ``h``
and recomputes the rest, so its peak is lower by about ``(L - 1) * B * S * F * 4`` bytes.
"""

import jax
import jax.numpy as jnp

L, B, S, D, F = 6, 8, 64, 128, 512


def init_params(key):
    k1, k2 = jax.random.split(key)
    return {"w_up": jax.random.normal(k1, (L, D, F), jnp.float32) / D ** 0.5,
            "w_down": jax.random.normal(k2, (L, F, D), jnp.float32) / F ** 0.5}


def _layer(h, w):
    return h + jnp.tanh(h @ w["w_up"]) @ w["w_down"], None


def _loss(params, x, remat):
    layer = jax.checkpoint(_layer) if remat else _layer
    h, _ = jax.lax.scan(layer, x, params)
    return jnp.mean(h * h)


def step_remat(params, x):
    """One SGD step with the layer rematerialised in the backward pass."""
    grads = jax.grad(_loss)(params, x, True)
    return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)


def step_plain(params, x):
    """The same step keeping every layer's activations."""
    grads = jax.grad(_loss)(params, x, False)
    return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)
