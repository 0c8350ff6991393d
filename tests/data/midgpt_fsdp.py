"""A GPT trained with fully sharded data parallelism in Equinox, shaped as AllanYangZhou/midGPT
trains it (written anew for stagetool's tests; sizes shrunk): the weights built under
``eqx.filter_jit`` and laid out by a sharding constraint (the last dimension of every large leaf
over ``data``), the optimizer state built eagerly by ``optimizer.init`` on the sharded model (each
Adam moment placed like its parameter, its scalar counts put back to ``P()``), the step
``eqx.filter_jit(donate="all")`` over gradient-accumulation micro-batches."""

from functools import partial

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

VOCAB, SEQ, WIDTH, HEADS, DEPTH = 128, 32, 64, 4, 2
BATCH, ACCUM = 8, 2
SHARD_ABOVE = 2**10  # leaves with more elements are split over `data` (midGPT: 2**18)


def make_mesh(devices=None):
    devices = jax.devices()[:8] if devices is None else devices
    return jax.sharding.Mesh(np.array(devices).reshape(1, 8), ("replica", "data"))


MESH = make_mesh()


def layout(tree, mesh=MESH, constrain=jax.lax.with_sharding_constraint):
    def place(x):
        dims = (None,) * x.ndim
        if x.size > SHARD_ABOVE:
            dims = (None,) * (x.ndim - 1) + ("data",)
        return constrain(x, NamedSharding(mesh, P(*dims)))
    arrays, rest = eqx.partition(tree, eqx.is_array)
    return eqx.combine(jax.tree.map(place, arrays), rest)


class Block(eqx.Module):
    qkv: eqx.nn.Linear
    out: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    norm1: eqx.nn.RMSNorm
    norm2: eqx.nn.RMSNorm

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.qkv = eqx.nn.Linear(WIDTH, 3 * WIDTH, use_bias=False, key=k[0])
        self.out = eqx.nn.Linear(WIDTH, WIDTH, use_bias=False, key=k[1])
        self.up = eqx.nn.Linear(WIDTH, 4 * WIDTH, use_bias=False, key=k[2])
        self.down = eqx.nn.Linear(4 * WIDTH, WIDTH, use_bias=False, key=k[3])
        self.norm1 = eqx.nn.RMSNorm(WIDTH)
        self.norm2 = eqx.nn.RMSNorm(WIDTH)

    def __call__(self, x):  # x: (SEQ, WIDTH)
        q, k, v = jnp.split(jax.vmap(self.qkv)(jax.vmap(self.norm1)(x)), 3, axis=-1)
        heads = lambda t: t.reshape(SEQ, HEADS, WIDTH // HEADS).transpose(1, 0, 2)
        scores = heads(q) @ heads(k).transpose(0, 2, 1) / jnp.sqrt(WIDTH // HEADS)
        scores = jnp.where(jnp.tril(jnp.ones((SEQ, SEQ), bool)), scores, -jnp.inf)
        att = (jax.nn.softmax(scores, axis=-1) @ heads(v)).transpose(1, 0, 2).reshape(SEQ, WIDTH)
        x = x + jax.vmap(self.out)(att)
        return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(jax.vmap(self.norm2)(x))))


class GPT(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: Block  # stacked over DEPTH (filter_vmap), scanned
    norm: eqx.nn.RMSNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        kb, ke, kh = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(VOCAB, WIDTH, key=ke)
        self.blocks = eqx.filter_vmap(Block)(jax.random.split(kb, DEPTH))
        self.norm = eqx.nn.RMSNorm(WIDTH)
        self.head = eqx.nn.Linear(WIDTH, VOCAB, use_bias=False, key=kh)

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens)
        arrays, rest = eqx.partition(self.blocks, eqx.is_array)

        def body(h, layer):
            return eqx.combine(layer, rest)(h), None
        x, _ = jax.lax.scan(jax.checkpoint(body), x, arrays)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def init_model(key):
    return layout(GPT(key))


optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(b2=0.99),
                        optax.add_decayed_weights(0.1), optax.scale(-1e-3))


def init_opt_state(model):
    """As the training script does it, eagerly, on the model already laid out."""
    state = optimizer.init(eqx.filter(model, eqx.is_array))
    scalars_replicated = lambda x: jax.device_put(x, NamedSharding(MESH, P())) if x.ndim == 0 else x
    return jax.tree.map(scalars_replicated, state)


def loss_fn(params, rest, x, y):
    logits = jax.vmap(eqx.combine(params, rest))(x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@partial(eqx.filter_jit, donate="all")
def step(model, opt_state, x, y):  # x, y: (ACCUM, BATCH, SEQ)
    params, rest = eqx.partition(model, eqx.is_array)

    def micro(total, xy):
        loss, grad = jax.value_and_grad(loss_fn)(params, rest, *xy)
        grad = layout(grad)
        return jax.tree.map(jnp.add, total, grad), loss

    grad, losses = jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, params), (x, y))
    grad = jax.tree.map(lambda g: g / ACCUM, grad)
    updates, opt_state = optimizer.update(grad, opt_state, params)
    return eqx.combine(optax.apply_updates(params, updates), rest), opt_state, losses.mean()
