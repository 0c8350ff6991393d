"""Arguments that share Flax NNX Variables (issue 21 item 2; trial 2, finding 1).

Flax's FSDP toy example (``examples/nnx_toy_examples/10_fsdp_and_optimizer.py``) has an ``SGD``
optimizer that holds *the model's own* ``nnx.Param`` Variables, and ``@nnx.jit train_step(model,
optimizer, x, y)``. ``nnx.jit`` splits all its arguments as one graph, so a shared Variable is one
input and one output, and the update lands on the model. Each test compares stagetool's staging
through the CLI with the framework's own jit lowering the same step on real objects.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import assert_memory_is_xlas, write

pytest.importorskip("flax")
pytest.importorskip("optax")

# The FSDP toy's pattern, small, in Flax's style: parameters annotated for the mesh, an optimizer over
# the model's own Params, the step under nnx.jit; the model and optimizer built at module level.
TOY = '''
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


class MLP(nnx.Module):
    def __init__(self, din, dmid, dout, rngs: nnx.Rngs):
        self.w1 = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (din, dmid)),
                            sharding_metadata=(None, "model"))
        self.b1 = nnx.Param(jnp.zeros((dmid,)), sharding_metadata=("model",))
        self.w2 = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (dmid, dout)),
                            sharding_metadata=("model", None))

    def __call__(self, x):
        return nnx.relu(x @ self.w1 + self.b1) @ self.w2


class SGDState(nnx.Variable):
    pass


class SGD(nnx.Pytree):
    def __init__(self, params, lr, decay=0.9):
        self.lr = lr
        self.params = nnx.data(params)
        self.momentum = nnx.data(jax.tree.map(lambda v: SGDState(jnp.zeros_like(v[...]), **v.get_metadata()),
                                              self.params, is_leaf=lambda x: isinstance(x, nnx.Variable)))
        self.decay = decay

    def update(self, grads):
        def update_fn(param, momentum, grad):
            momentum[...] = self.decay * momentum[...] + (1 - self.decay) * grad[...]
            param[...] -= self.lr * momentum[...]

        jax.tree.map(update_fn, self.params, self.momentum, grads, is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_sgd(model):
    return SGD(nnx.variables(model, nnx.Param), 0.01)


@nnx.jit
def create_model():
    model = MLP(16, 64, 16, rngs=nnx.Rngs(0))
    return model, make_sgd(model)


with jax.set_mesh(mesh):
    model, optimizer = create_model()


def plain_train_step(model, optimizer, x, y):
    def loss_fn(model):
        return jnp.mean((y - model(x)) ** 2)

    loss, grad = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(grad)
    return loss


train_step = nnx.jit(plain_train_step)
jax_train_step = jax.jit(plain_train_step)


class Tied(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(64, 32, rngs=rngs)
        self.mid = nnx.Linear(32, 32, rngs=rngs)
        self.head = self.embed.embedding  # tied weights: the same Param in two places

    def __call__(self, tokens):
        return nnx.relu(self.mid(self.embed(tokens))) @ self.head[...].T


tied = Tied(nnx.Rngs(0))


@nnx.jit
def tied_step(model, tokens):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(tokens) ** 2))(model)
    nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(model, nnx.Param), grads))
    return loss


@nnx.jit
def step_with(model, both, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((y - m(x)) ** 2))(model)
    both.update(grads)
    return loss
'''


def _spec(target: str, args: str) -> str:
    return f'''
version: 1
mesh:
  axes: {{data: 2, model: 4}}
functions:
  step:
    target: toy.py:{target}
    args:
{args}
      - 'f32[32,16] @ [data, null]'
      - 'f32[32,16] @ [data, null]'
'''


REFS = '''      - {ref: toy.py:model}
      - {ref: toy.py:optimizer}'''


def _staged(run_cli, tmp_path, target: str, args: str) -> dict:
    write(tmp_path, "toy.py", TOY)
    spec = write(tmp_path, "s.yaml", _spec(target, args))
    doc = run_cli("report", "--spec", spec, "--format", "json", check=0).json()
    sys.path.insert(0, str(tmp_path))
    return doc["functions"][0]


def _batch(toy):
    sharding = NamedSharding(toy.mesh, P("data", None))
    return jax.device_put(jnp.zeros((32, 16)), sharding), jax.device_put(jnp.zeros((32, 16)), sharding)


def _assert_same(fn: dict, compiled) -> None:
    assert_memory_is_xlas(fn["memory"]["record"], compiled)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert fn["cost"]["per_device"]["flops"] == cost["flops"]
    # jax.jit drops the inputs the program does not use (stagetool lists them as unused)
    assert len([x for x in fn["inputs"] if not x["unused"]]) == len(jax.tree_util.tree_leaves(compiled.input_shardings))
    assert len(fn["outputs"]) == len(jax.tree_util.tree_leaves(compiled.output_shardings))


@pytest.mark.parametrize("target", ["train_step", "plain_train_step"])
def test_refs_sharing_variables_are_one_graph_as_nnx_jit_splits_them(run_cli, tmp_path, isolated_imports, target):
    """``{ref:}`` to the module-level model and its SGD: 8 inputs (3 params, 3 momenta, x, y) and 7
    outputs, not 11/10 with the params staged twice and the update landing on a copy. A plain step
    (not jitted; stagetool stages its NNX updates in place) is staged as ``nnx.jit`` runs it."""
    fn = _staged(run_cli, tmp_path, target, REFS)
    import toy

    x, y = _batch(toy)
    compiled = toy.train_step.lower(toy.model, toy.optimizer, x, y).compile()
    _assert_same(fn, compiled)
    inputs = [leaf["path"] for leaf in fn["inputs"]]
    assert len(inputs) == 8
    # a shared Param is named by its first place in the graph (the model), as nnx.jit splits it
    assert not any(p.startswith("optimizer/params/") for p in inputs), inputs
    assert {"model/w1/value", "model/b1/value", "model/w2/value"} <= set(inputs)
    # the update lands on the model: its parameters are outputs of the program
    assert {"model/w1/value", "model/b1/value", "model/w2/value"} <= {leaf["path"] for leaf in fn["outputs"]}


def test_plain_jax_jit_gets_each_occurrence_as_jax_jit_does(run_cli, tmp_path, isolated_imports):
    """``jax.jit`` flattens each argument as a pytree: a shared Variable is an input per place it is
    found, and the in-place update is not returned (only the loss)."""
    fn = _staged(run_cli, tmp_path, "jax_train_step", REFS)
    import toy

    x, y = _batch(toy)
    compiled = toy.jax_train_step.lower(toy.model, toy.optimizer, x, y).compile()
    _assert_same(fn, compiled)
    assert fn["memory"]["record"]["output_bytes"] == 4  # the loss alone


@pytest.mark.parametrize("case", ["factory", "model_and_optimizer"])
def test_init_from_arg_shares_the_models_variables(run_cli, tmp_path, isolated_imports, case):
    """An optimizer built in the spec from ``{arg: 0}`` that holds the model's Variables (a factory of
    the toy's SGD; ``nnx.ModelAndOptimizer``) shares them with argument 0, as the real objects do."""
    import optax
    from flax import nnx

    model_init = '''      - init: toy.py:MLP
        init_args: [16, 64, 16, {call: flax.nnx:Rngs, args: [0]}]
'''
    if case == "factory":
        target, second = "train_step", '''      - init: toy.py:make_sgd
        init_args: [{arg: 0}]'''
    else:
        target, second = "step_with", '''      - init: flax.nnx:ModelAndOptimizer
        init_args: [{arg: 0}, {call: optax:sgd, args: [0.01]}]'''
    fn = _staged(run_cli, tmp_path, target, model_init + second)
    import toy

    x, y = _batch(toy)
    with jax.set_mesh(toy.mesh):
        model = toy.MLP(16, 64, 16, rngs=nnx.Rngs(0))
        other = toy.make_sgd(model) if case == "factory" else nnx.ModelAndOptimizer(model, optax.sgd(0.01))
        compiled = getattr(toy, target).lower(model, other, x, y).compile()
    _assert_same(fn, compiled)
    assert not any("/params/" in leaf["path"] or "/model/" in leaf["path"] for leaf in fn["inputs"])


@pytest.mark.parametrize("given", ["init", "ref"])
def test_tied_weights_in_one_argument_are_one_input(run_cli, tmp_path, isolated_imports, given):
    """A Module whose two attributes are one Param (tied embedding and output weights), built by an
    ``init:`` or named by ``{ref:}``: one input and one output, as ``nnx.jit`` splits it."""
    from flax import nnx

    write(tmp_path, "toy.py", TOY)
    arg = "{init: toy.py:Tied}" if given == "init" else "{ref: toy.py:tied}"
    spec = write(tmp_path, "s.yaml", f"""
        version: 1
        mesh:
          axes: {{data: 2, model: 4}}
        functions:
          step:
            target: toy.py:tied_step
            args: [{arg}, 'i32[16,8] @ [data, null]']
    """)
    fn = run_cli("report", "--spec", spec, "--format", "json", check=0).json()["functions"][0]
    sys.path.insert(0, str(tmp_path))
    import toy

    tokens = jax.device_put(jnp.zeros((16, 8), jnp.int32), NamedSharding(toy.mesh, P("data", None)))
    model = toy.tied if given == "ref" else toy.Tied(nnx.Rngs(0))
    _assert_same(fn, toy.tied_step.lower(model, tokens).compile())
    assert [leaf["path"] for leaf in fn["inputs"] if "embed" in leaf["path"] or "head" in leaf["path"]] == \
        ["model/embed/embedding/value"]


def test_nested_staging_says_the_shared_variables_are_staged_per_place(run_cli, tmp_path, isolated_imports):
    """Where the spec gives what ``nnx.jit``'s own program cannot take (here ``out_shardings``), the
    step runs nested and each place of a shared Variable is its own input: the report says so."""
    write(tmp_path, "toy.py", TOY)
    spec = write(tmp_path, "s.yaml", _spec("train_step", REFS).replace(
        "functions:\n  step:\n", "functions:\n  step:\n    out_shardings: {out: replicated, model: {like: 0}, "
        "optimizer: {like: 1}}\n"))
    fn = run_cli("report", "--spec", spec, "--format", "json", check=0).json()["functions"][0]
    assert len(fn["inputs"]) == 11  # 3 params twice, 3 momenta, x, y
    shared = [n for n in fn["notes"] if "share Flax NNX Variables" in n]
    assert shared and "optimizer/params/b1/value is model/b1/value; 3 in all" in shared[0], fn["notes"]
    own = _staged(run_cli, tmp_path, "train_step", REFS)
    assert not any("share Flax NNX Variables" in n for n in own["notes"])
