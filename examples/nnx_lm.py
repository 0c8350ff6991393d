"""A small Flax NNX language model and its train step, written as the Flax guides write them.

The model's own ``nnx.with_partitioning`` annotations shard its parameters (and the optimizer's
moments, which copy them); the ``@nnx.jit`` step updates ``model`` and ``optimizer`` in place.
``stagetool report examples/nnx_lm.py:train_step`` stages it with no wrapper and no rules.
"""

import jax
import optax
from flax import nnx

init = nnx.initializers.lecun_normal()


class MLP(nnx.Module):
    def __init__(self, d_model: int, d_ff: int, *, rngs: nnx.Rngs):
        self.up = nnx.Linear(d_model, d_ff, use_bias=False, rngs=rngs,
                             kernel_init=nnx.with_partitioning(init, (None, "model")))
        self.down = nnx.Linear(d_ff, d_model, use_bias=False, rngs=rngs,
                               kernel_init=nnx.with_partitioning(init, ("model", None)))

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


class LM(nnx.Module):
    def __init__(self, vocab: int = 256, d_model: int = 64, d_ff: int = 256, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d_model, rngs=rngs,
                               embedding_init=nnx.with_partitioning(nnx.initializers.normal(0.02), ("model", None)))
        self.norm = nnx.LayerNorm(d_model, rngs=rngs)
        self.mlp = MLP(d_model, d_ff, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = x + self.mlp(self.norm(x))
        return self.embed.attend(x)


def make_optimizer():
    return nnx.Optimizer(LM(rngs=nnx.Rngs(0)), optax.adamw(1e-3), wrt=nnx.Param)


@nnx.jit
def train_step(model: LM, optimizer: nnx.Optimizer, batch):
    def loss_fn(model):
        logits = model(batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss
