"""A small Equinox language model and its train step, written as the Equinox docs write them: the
model is an ``eqx.Module`` (arrays and static parts such as activation functions together), the
step an ``eqx.filter_jit`` function, the optimizer optax's.

``stagetool report examples/equinox_lm.py:train_step`` stages it with no wrapper.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

optimizer = optax.adamw(1e-3)


class LM(eqx.Module):
    embed: eqx.nn.Embedding
    norm: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP
    unembed: eqx.nn.Linear

    def __init__(self, key, vocab: int = 256, d_model: int = 64, d_ff: int = 256):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(vocab, d_model, key=k1)
        self.norm = eqx.nn.LayerNorm(d_model)
        self.mlp = eqx.nn.MLP(d_model, d_model, d_ff, depth=1, activation=jax.nn.gelu, key=k2)
        self.unembed = eqx.nn.Linear(d_model, vocab, use_bias=False, key=k3)

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens)
        x = x + jax.vmap(self.mlp)(jax.vmap(self.norm)(x))
        return jax.vmap(self.unembed)(x)


def init_opt_state(key):
    return optimizer.init(eqx.filter(LM(key), eqx.is_array))


@eqx.filter_jit
def train_step(model: LM, opt_state, tokens, targets):
    def loss_fn(model):
        logits = jax.vmap(model)(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss
