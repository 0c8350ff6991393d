"""A decoder-only language model's FSDP train step written in the shape of google-deepmind/nanodo
(model.py, fsdp.py, train.py), in this project's own words and shrunk in size.

What is kept of nanodo's shape, because it is what issue 49 found: Flax linen modules whose
initializers are wrapped in ``nn.with_partitioning`` over one ``data`` axis (the attention
projections are ``nn.DenseGeneral`` with ``features=(heads, head_dim)``, so their kernel is created
flat and reshaped: under a context mesh Flax's ``Partitioned.unbox()`` would constrain it with a
rank-3 spec); a ``flax.training.train_state.TrainState`` with an optax optimizer; the shardings from
``nn.get_sharding`` of the abstract state; the step ``jax.jit(partial(train_step, mesh=mesh),
in_shardings=..., out_shardings=..., donate_argnames=(...))`` constraining its batch with a
``NamedSharding``. The training code never sets a context mesh.
"""
from functools import partial

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax.training import train_state
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

VOCAB, WIDTH, HEADS, CONTEXT, LAYERS, HIDDEN = 64, 32, 4, 16, 2, 64
BATCH = 8


def sharded(init, names):
    """An initializer laid over the ``data`` axis on one dimension (FSDP)."""
    return nn.with_partitioning(init, names)


class Attention(nn.Module):
    @nn.compact
    def __call__(self, x):
        head_dim = WIDTH // HEADS
        project = partial(nn.DenseGeneral, features=(HEADS, head_dim), axis=-1, use_bias=False,
                          kernel_init=sharded(nn.initializers.xavier_uniform(), ("data", None, None)))
        q, k, v = project(name="q")(x), project(name="k")(x), project(name="v")(x)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q / head_dim ** 0.5, k)
        causal = jnp.tril(jnp.ones((1, 1, x.shape[1], x.shape[1]), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(scores.dtype).min), axis=-1)
        mixed = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        return nn.DenseGeneral(features=WIDTH, axis=(-2, -1), use_bias=False, name="out",
                               kernel_init=sharded(nn.initializers.xavier_uniform(), (None, None, "data")))(mixed)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x + Attention()(nn.LayerNorm(use_bias=False)(x))
        dense = partial(nn.Dense, use_bias=False, kernel_init=sharded(nn.initializers.xavier_uniform(), ("data", None)))
        h = nn.LayerNorm(use_bias=False)(x)
        return x + dense(WIDTH)(jax.nn.gelu(dense(HIDDEN)(h)))


class Decoder(nn.Module):
    def setup(self):
        embed_init = sharded(nn.initializers.normal(1.0), (None, "data"))
        self.tokens = nn.Embed(VOCAB, WIDTH, embedding_init=embed_init)
        self.positions = nn.Embed(CONTEXT, WIDTH, embedding_init=embed_init)
        self.blocks = [Block() for _ in range(LAYERS)]
        self.norm = nn.LayerNorm(use_bias=False)

    def __call__(self, ids):
        x = self.tokens(ids) + self.positions(jnp.arange(ids.shape[1])[None])
        for block in self.blocks:
            x = block(x)
        return self.tokens.attend(self.norm(x))


model = Decoder()
optimizer = optax.adamw(1e-3)  # one object: the state's tree carries it, and the jit's shardings must match it


def init_state(rng):
    """The train state a run starts from: parameters (boxed with their partitioning) and AdamW."""
    params = model.init(rng, jnp.zeros((1, CONTEXT), jnp.int32))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optimizer)


def train_step(state, batch, mesh=None):
    """One next-token step: the batch constrained over ``data``, cross-entropy, AdamW."""
    if mesh is not None:
        batch = jax.lax.with_sharding_constraint(batch, NamedSharding(mesh, P("data")))

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def build(devices):
    """The mesh, the state's shardings and the jitted step, as the training loop makes them."""
    mesh = Mesh(mesh_utils.create_device_mesh((len(devices),), devices), ("data",))
    abstract = jax.eval_shape(init_state, jax.random.key(0))
    shardings = nn.get_sharding(abstract, mesh)
    step = jax.jit(partial(train_step, mesh=mesh), in_shardings=(shardings, NamedSharding(mesh, P())),
                   out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnames=("state", "batch"))
    return mesh, shardings, step


mesh, state_shardings, step = build(jax.devices())
