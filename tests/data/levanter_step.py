"""A Levanter-style train step (tests/inputs/test_haliax.py): haliax NamedArrays, ``hax.nn.Linear``, an
optax optimizer held as a static field, and the step as Levanter's trainer jits it —
``hax.named_jit(axis_resources=<parameter mapping>, donate_args=(True, False))``, the loss under
the compute mapping. ``lr_scale`` is a Python number: named_jit keeps it static (not an input)."""

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import optax

Batch = hax.Axis("batch", 16)
Embed = hax.Axis("embed", 64)
Hidden = hax.Axis("mlp", 256)

#: Levanter's parameter_axis_mapping and compute_axis_mapping
PARAMS = {"mlp": "model", "embed": "data"}
COMPUTE = {"batch": "data", "mlp": "model"}

OPTIMIZER = optax.adamw(1e-3)


class Mlp(eqx.Module):
    up: hnn.Linear
    down: hnn.Linear

    def __call__(self, x):
        return self.down(hnn.relu(self.up(x)))


class TrainState(eqx.Module):
    step: jax.Array
    model: Mlp
    opt_state: optax.OptState
    lr_scale: float  # a Python number: static under named_jit
    optimizer: optax.GradientTransformation = eqx.field(static=True)


def init_state(key):
    """The state, sharded by the parameter mapping (as Levanter's named_jit'd init leaves it)."""
    k_up, k_down = jax.random.split(key)
    model = Mlp(hnn.Linear.init(Embed, Hidden, key=k_up), hnn.Linear.init(Hidden, Embed, key=k_down))
    state = TrainState(jnp.zeros((), jnp.int32), model, OPTIMIZER.init(eqx.filter(model, eqx.is_array)), 0.5,
                       OPTIMIZER)
    return hax.shard(state, PARAMS)


def make_batch():
    """One batch of NamedArrays, batch over ``data``."""
    return hax.shard(hax.zeros((Batch, Embed)), COMPUTE)


def make_param_batch():
    """The batch as the parameter mapping lays it (``embed`` over ``data``), for :data:`fsdp_step`."""
    return hax.shard(hax.zeros((Batch, Embed)), PARAMS)


def loss_fn(model, x):
    return hax.mean((model(x) - x) ** 2).scalar()


def _train_step(state: TrainState, x):
    with hax.axis_mapping(COMPUTE):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(state.model, x)
    params = eqx.filter(state.model, eqx.is_array)
    updates, opt_state = state.optimizer.update(grads, state.opt_state, params)
    updates = jax.tree_util.tree_map(lambda u: u * state.lr_scale, updates)
    model = eqx.apply_updates(state.model, updates)
    return TrainState(state.step + 1, model, opt_state, state.lr_scale, state.optimizer), loss


@hax.named_jit(axis_resources=PARAMS, donate_args=(True, False))
def train_step(state: TrainState, x):
    return _train_step(state, x)


#: the FSDP form (``hax.fsdp``'s): inputs and outputs by the parameter mapping, traced under the compute one
fsdp_step = hax.named_jit(_train_step, axis_resources=COMPUTE, in_axis_resources=PARAMS, out_axis_resources=PARAMS,
                          donate_args=(True, False))
