"""Arguments built from arguments (issue 21, item 4): ``{arg: N}`` in ``init_args`` is the value built
for another argument (an ``nnx.Optimizer`` over the model in three lines of YAML), ``{call: ...}``
inside an ``init`` is built in its trace under the spec's mesh, and ``init: flax.nnx:Rngs`` works;
each compared with ``nnx.jit`` lowering the same step on real objects.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType

from helpers import assert_memory_is_xlas, write

pytest.importorskip("flax")
pytest.importorskip("optax")

MODEL = '''
import jax, jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

class MLP(nnx.Module):
    def __init__(self, rngs):
        # an annotated model: built where a mesh is active (Flax's eager sharding needs one)
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
        self.up = nnx.Linear(64, 128, kernel_init=init, rngs=rngs)
        self.down = nnx.Linear(128, 64, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))

@nnx.jit(donate_argnums=(0, 1))
def step(model, optimizer, x):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)
    return loss

@nnx.jit
def noise(rngs):
    return jax.random.normal(rngs.params(), (4,))
'''

SPEC = '''
version: 1
mesh:
  axes: {data: 2, model: 4}
functions:
  step:
    target: model.py:step
    args:
      - init: model.py:MLP
        init_args: [{call: flax.nnx:Rngs, args: [0]}]
      - init: flax.nnx:Optimizer
        init_args: [{arg: 0}, {call: optax:adam, args: [0.001]}]
        init_kwargs: {wrt: {ref: flax.nnx:Param}}
      - 'f32[16,64] @ [data, null]'
  noise:
    target: model.py:noise
    args:
      - init: flax.nnx:Rngs
        init_args: [0]
'''


def test_optimizer_over_the_model_argument_and_rngs(run_cli, tmp_path, isolated_imports):
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    write(tmp_path, "model.py", MODEL)
    spec = write(tmp_path, "s.yaml", SPEC)
    doc = run_cli("report", "--spec", spec, "--format", "json", check=0).json()
    fns = {f["name"]: f for f in doc["functions"]}
    sys.path.insert(0, str(tmp_path))
    import model

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
    with jax.set_mesh(mesh):
        m = model.MLP(nnx.Rngs(0))
        opt = nnx.Optimizer(m, optax.adam(1e-3), wrt=nnx.Param)
        x = jax.device_put(jnp.zeros((16, 64)), NamedSharding(mesh, P("data", None)))
        real = model.step.lower(m, opt, x).compile()
        real_noise = model.noise.lower(nnx.Rngs(0)).compile()
    record = fns["step"]["memory"]["record"]
    assert_memory_is_xlas(record, real)
    assert fns["step"]["cost"]["per_device"]["flops"] == real.cost_analysis()["flops"]
    leaves = {x["path"]: x for x in fns["step"]["inputs"]}
    # the optimizer's moments of the annotated kernel are sharded as the model's (built from arg 0)
    mu = next(p for p in leaves if p.startswith("optimizer/") and "up/kernel" in p and "mu" in p)
    assert leaves[mu]["compiled"] == "P(None, 'model')"
    noise = fns["noise"]["memory"]["record"]
    assert noise["argument_bytes"] == real_noise.memory_analysis().argument_size_in_bytes
    assert noise["output_bytes"] == real_noise.memory_analysis().output_size_in_bytes


def test_arg_reference_to_a_later_argument_exits_2(run_cli, tmp_path, isolated_imports):
    write(tmp_path, "model.py", MODEL)
    spec = write(tmp_path, "s.yaml", SPEC.replace("[{arg: 0}, {call", "[{arg: 2}, {call"))
    r = run_cli("shardings", "--spec", spec)
    assert r.code == 2 and "s.yaml:11:21" in r.stderr and "{arg: 2}" in r.stderr, r.stderr


CONFIG_STEP = '''
import dataclasses
import jax, jax.numpy as jnp

@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Config:  # as the JAX training cookbook's: its constructor sets the global mesh
    width: int = 64

    def __post_init__(self):
        mesh = jax.make_mesh((8,), ("fsdp",), (jax.sharding.AxisType.Explicit,))
        jax.sharding.set_mesh(mesh)

def init(config):
    return {"w": jnp.zeros((config.width, config.width))}

@jax.jit
def step(config, params, x):
    return x @ params["w"]
'''


@pytest.mark.parametrize("first, init_arg", [
    ("{call: model.py:Config}", "{arg: 0}"),
    ("{call: model.py:Config}", "{call: model.py:Config}"),
    ("3", "{call: model.py:Config}"),
])
def test_call_that_cannot_run_in_the_init_trace_is_built_outside(run_cli, tmp_path, isolated_imports, first, init_arg):
    """Issue 30, item 6: a ``{call: ...}`` of init_args that cannot run inside the init's trace
    (``set_mesh`` in a config's constructor) and needs nothing traced is built before the trace, as
    the user's own code builds it; ``{arg: 0}`` hands over argument 0's config. Each stages, the
    params sharded as the init gives them, and the process's global mesh is its own again after."""
    write(tmp_path, "model.py", CONFIG_STEP)
    text = f'''
        version: 1
        mesh:
          axes: {{fsdp: 8}}
          axis_types: explicit
        functions:
          step:
            target: model.py:step
            args:
              - {first}
              - init: model.py:init
                init_args: [{init_arg}]
              - 'f32[16,64] @ [fsdp, null]'
    '''
    spec = write(tmp_path, "s.yaml", text)
    before = jax.sharding.get_mesh()
    doc = run_cli("shardings", "--spec", spec, "--format", "json", check=0).json()
    f = doc["functions"][0]
    assert f.get("error") is None
    leaves = {leaf["path"]: leaf for leaf in f["inputs"]}
    assert leaves["params/w"]["shape"] == [64, 64] and leaves["x"]["compiled"] == "P('fsdp', None)"
    assert jax.sharding.get_mesh() is before


def test_call_taking_a_traced_value_that_cannot_run_in_the_trace_says_so(run_cli, tmp_path, isolated_imports):
    """A ``{call: ...}`` that takes a traced value (an argument's array) and cannot run inside the trace stays
    exit 2 at its spec line, saying why."""
    write(tmp_path, "model.py", CONFIG_STEP + """
def scaled(x):
    return float(x.sum())  # a concrete value: not inside jax.jit

def init2(s):
    return {"w": jnp.zeros((64, 64)) * s}
""")
    text = '''
        version: 1
        mesh:
          axes: {fsdp: 8}
        functions:
          step:
            target: model.py:step
            args:
              - f32[4]
              - init: model.py:init2
                init_args: [{call: model.py:scaled, args: [{arg: 0}]}]
              - 'f32[16,64] @ [fsdp, null]'
    '''
    r = run_cli("shardings", "--spec", write(tmp_path, "s.yaml", text), check=2)
    assert "s.yaml:10:21: calling model.py:scaled failed:" in r.stderr
    assert "takes a traced value ({arg: N} or a leaf) but cannot run there" in r.stderr
