"""A two-layer MLP train step: loss, gradient, SGD update, parameters donated.

    stagetool lower examples/mlp.py:train_step --mesh 2x4
    stagetool shardings examples/mlp.py:train_step

The spec beside this file (mlp.stagetool.yaml) builds the parameters with `init_params` through
`jax.eval_shape`, shards them with rules, and shards the batch over the `data` axis.
"""

import jax
import jax.numpy as jnp


def init_params(key, d_in: int, d_hidden: int, d_out: int):
    """Parameters of a two-layer MLP: {'w1': [d_in, d_hidden], 'b1': [d_hidden], 'w2': [d_hidden, d_out], 'b2': [d_out]}."""
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (d_in, d_hidden), jnp.float32) / jnp.sqrt(d_in),
        "b1": jnp.zeros((d_hidden,), jnp.float32),
        "w2": jax.random.normal(k2, (d_hidden, d_out), jnp.float32) / jnp.sqrt(d_hidden),
        "b2": jnp.zeros((d_out,), jnp.float32),
    }


def loss_fn(params, batch):
    h = jax.nn.relu(batch["x"] @ params["w1"] + params["b1"])
    logits = h @ params["w2"] + params["b2"]
    labels = jax.nn.one_hot(batch["y"], logits.shape[-1])
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * labels, axis=-1))


def train_step(params, batch, lr=1e-2):
    """One SGD step; returns (new params, loss)."""
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
    return params, loss
