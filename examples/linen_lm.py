"""A small Flax Linen language model with a ``TrainState`` and logical axis rules, as the Flax
guides write it: parameters carry logical names (``nn.with_logical_partitioning``), activations
``nn.with_logical_constraint``, and ``LOGICAL_AXIS_RULES`` maps the names onto the mesh.

``stagetool report examples/linen_lm.py:train_step`` stages it with no wrapper and no rules.
"""

import jax
import jax.numpy as jnp
import flax.linen as nn
import optax
from flax.training import train_state

LOGICAL_AXIS_RULES = (
    ("batch", "data"),
    ("vocab", "model"),
    ("embed", None),
    ("mlp", "model"),
)


class MLP(nn.Module):
    d_ff: int

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        h = nn.Dense(self.d_ff, use_bias=False, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
        h = nn.with_logical_constraint(jax.nn.gelu(h), ("batch", None, "mlp"))
        return nn.Dense(x.shape[-1], use_bias=False, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(h)


class LM(nn.Module):
    vocab: int = 256
    d_model: int = 64
    d_ff: int = 256

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab, self.d_model,
                         embedding_init=nn.with_logical_partitioning(nn.initializers.normal(0.02), ("vocab", "embed")))
        x = nn.with_logical_constraint(embed(tokens), ("batch", None, "embed"))
        x = x + MLP(self.d_ff)(nn.LayerNorm()(x))
        return embed.attend(x)


def create_state(key, batch: int = 16, seq: int = 32):
    model = LM()
    params = model.init(key, jnp.zeros((batch, seq), jnp.int32))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3))


@jax.jit
def train_step(state: train_state.TrainState, batch):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss
