"""An ``init``'s results are sharded as its run gives them (issue 21, item 1): a nested
``jax.jit(..., out_shardings=...)``, ``jax.device_put`` / ``with_sharding_constraint`` on the results,
an ``nnx.jit`` that constrains the model's state, JAX's explicit sharding types; a leaf nothing
shards says so. Each form is checked against running the init for real on the simulated mesh.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import EXAMPLES, leaves_by_path, write

MODEL = '''
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

MESH = jax.make_mesh((2, 4), ("data", "model"))  # the job's mesh, as a MaxText-style script builds it

def init_fn(key):
    k1, k2 = jax.random.split(key)
    return {"w": jax.random.normal(k1, (16, 32)), "b": jnp.zeros((32,)), "e": jax.random.normal(k2, (64, 16))}

def nested_jit(key):
    return jax.jit(init_fn, out_shardings={"w": P(None, "model"), "b": P(), "e": P("model", None)})(key)

def nested_named(key):
    mesh = MESH
    out = {"w": P("data", "model"), "b": P("model"), "e": P()}
    return jax.jit(init_fn, out_shardings=jax.tree.map(lambda s: NamedSharding(mesh, s), out))(key)

def placed(key):
    p = init_fn(key)
    mesh = MESH
    return {"w": jax.lax.with_sharding_constraint(p["w"], P("data", "model")),
            "b": jax.device_put(p["b"], NamedSharding(mesh, P("model"))),
            "e": p["e"].astype(jnp.bfloat16)}

def cast_after(key):
    p = nested_jit(key)
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16), p)

@jax.jit
def typed_with_count(key):  # the JAX training cookbook's init: explicit types, an Adam count
    p = init_fn(key)
    return {"w": jax.sharding.reshard(p["w"], P(None, "model")), "b": p["b"], "e": p["e"], "count": jnp.array(0)}

def step(p, x):
    return jnp.sum(x @ p["e"].astype(jnp.float32) @ p["w"].astype(jnp.float32) + p["b"]) + p.get("count", 0)
'''

SPEC = '''
version: 1
mesh:
  axes: {{data: 2, model: 4}}
functions:
  step:
    target: model.py:step
    args:
      - init: model.py:{init}
        init_args: [key(0)]
      - 'f32[8,64] @ [data, null]'
'''


def mesh_2x4(kind=AxisType.Auto):
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(kind, kind))


def trimmed(dims) -> tuple:
    dims = list(dims)
    while dims and dims[-1] is None:
        dims.pop()
    return tuple(dims)


def eval_spec(text: str) -> tuple:
    return eval(text, {"P": lambda *a: a})  # noqa: S307 - our own output


def real_specs(init, mesh) -> dict:
    """Run the init for real under the mesh: ``{leaf: PartitionSpec entries}``."""
    with jax.set_mesh(mesh):
        out = init(jax.random.key(0))
    return {k: trimmed(v.sharding.spec) for k, v in out.items()}


@pytest.mark.parametrize("init,kind,source", [
    ("nested_jit", AxisType.Auto, {"w": "init", "b": "init", "e": "init"}),
    ("nested_jit", AxisType.Explicit, {"w": "init", "b": "init", "e": "init"}),
    ("nested_named", AxisType.Auto, {"w": "init", "b": "init", "e": "init"}),
    ("placed", AxisType.Auto, {"w": "init", "b": "init", "e": "unknown"}),
    ("cast_after", AxisType.Auto, {"w": "init", "b": "init", "e": "init"}),
    # trial 2 finding 8: the count's type names no mesh; run, it is NamedSharding(mesh, P()) (was "unknown")
    ("typed_with_count", AxisType.Explicit, {"w": "init", "b": "init", "e": "init", "count": "init"}),
])
def test_init_leaves_are_sharded_as_the_init_runs(run_cli, tmp_path, isolated_imports, init, kind, source):
    write(tmp_path, "model.py", MODEL)
    spec = write(tmp_path, "s.yaml", SPEC.format(init=init))
    # the spec says the axis types: left out, MODEL's own mesh (jax.make_mesh's default, Explicit) gives them
    spec.write_text(spec.read_text().replace("axes: {data: 2, model: 4}", "axes: {data: 2, model: 4}\n  axis_types: "
                                             + ("explicit" if kind == AxisType.Explicit else "auto")))
    doc = run_cli("shardings", "--spec", spec, "--format", "json", check=0).json()
    sys.path.insert(0, str(tmp_path))
    import model

    real = real_specs(getattr(model, init), mesh_2x4(kind))
    leaves = leaves_by_path(doc)
    for name, spec_dims in real.items():
        leaf = leaves[f"p/{name}"]
        assert trimmed(eval_spec(leaf["declared"])) == spec_dims, name
        assert trimmed(eval_spec(leaf["compiled"])) == spec_dims, name
        assert leaf["sharding_source"] == source[name], name
    # what the init shards is not replicated: the test would fail on the old silent P()
    assert real["w"] != ()


def test_unknown_sharding_is_said_on_the_leaf(run_cli, tmp_path, isolated_imports):
    write(tmp_path, "model.py", MODEL)
    spec = write(tmp_path, "s.yaml", SPEC.format(init="init_fn").replace("{data: 2, model: 4}",
                                                                        "{data: 2, model: 4}\n  axis_types: auto"))
    out = run_cli("shardings", "--spec", spec, check=0).stdout
    rows = [line for line in out.splitlines() if line.strip().startswith("p/")]
    assert len(rows) == 3 and all("sharding unknown" in r for r in rows), out
    assert "from model" not in out


def test_nnx_jit_init_with_sharding_constraint(run_cli, tmp_path, isolated_imports):
    """Flax's guide: an ``nnx.jit`` creates the model and constrains its state to the annotations."""
    pytest.importorskip("flax")
    from flax import nnx

    write(tmp_path, "nnxmodel.py", '''
        import jax, jax.numpy as jnp
        from flax import nnx
        from jax.sharding import PartitionSpec as P

        class MLP(nnx.Module):
            def __init__(self, rngs):
                self.up = nnx.Linear(64, 128, rngs=rngs)
                self.down = nnx.Linear(128, 64, rngs=rngs)

            def __call__(self, x):
                return self.down(jax.nn.relu(self.up(x)))

        SPECS = {"up": P(None, "model"), "down": P("model", None)}

        @nnx.jit
        def create():
            model = MLP(nnx.Rngs(0))
            state = nnx.state(model)
            specs = {"up": {"kernel": SPECS["up"], "bias": P("model")},
                     "down": {"kernel": SPECS["down"], "bias": P()}}
            state = jax.tree.map(lambda s, v: jax.lax.with_sharding_constraint(v, s), nnx.State(specs), state)
            nnx.update(model, state)
            return model

        def step(model, x):
            return jnp.sum(model(x))
    ''')
    spec = write(tmp_path, "s.yaml", '''
        version: 1
        mesh:
          axes: {data: 2, model: 4}
        functions:
          step:
            target: nnxmodel.py:step
            args:
              - init: nnxmodel.py:create
              - 'f32[8,64] @ [data, null]'
    ''')
    doc = run_cli("shardings", "--spec", spec, "--format", "json", check=0).json()
    sys.path.insert(0, str(tmp_path))
    import nnxmodel

    with jax.set_mesh(mesh_2x4()):
        model = nnxmodel.create()
        real = {"/".join(map(str, path)): trimmed(v.sharding.spec)
                for path, v in nnx.to_flat_state(nnx.state(model))}
    leaves = leaves_by_path(doc)
    assert real["up/kernel"] == (None, "model")
    for path, dims in real.items():
        leaf = leaves[f"model/{path}/value"]
        assert trimmed(eval_spec(leaf["declared"])) == dims, path
        assert leaf["sharding_source"] == "init", path


def test_maxtext_example_is_the_real_program(run_cli, isolated_imports):
    """examples/maxtext_lm.py, staged with no rules, is the program jax.jit compiles for the
    parameters its init really returns (FLOPs, memory, collectives, every leaf's sharding)."""
    from test_frameworks import assert_same_program

    doc = run_cli("report", str(EXAMPLES / "maxtext_lm.py:train_step"), "--format", "json", check=0).json()
    fn = doc["functions"][0]
    sys.path.insert(0, str(EXAMPLES))
    import maxtext_lm

    mesh = mesh_2x4()
    with jax.set_mesh(mesh):
        params = maxtext_lm.init(jax.random.key(0))
        data = NamedSharding(mesh, P("data", None))
        batch = {"tokens": jax.device_put(jnp.zeros((16, 128), jnp.int32), data),
                 "targets": jax.device_put(jnp.zeros((16, 128), jnp.int32), data)}
        compiled = maxtext_lm.train_step.lower(params, batch).compile()
    assert_same_program(fn, compiled)
    leaves = leaves_by_path(doc)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for kp, x in flat:
        path = "params/" + "/".join(k.key for k in kp)
        assert trimmed(eval_spec(leaves[path]["declared"])) == trimmed(x.sharding.spec), path
        assert leaves[path]["sharding_source"] == "init"
        assert leaves[path]["donated"]
    assert leaves["params/layers/wq"]["declared"] == "P(None, 'data', 'model', None)"
    # sources: the one-line einsum helper every matmul goes through is a thin helper, so each of its
    # collectives shows the model line that called it (issue 21, item 6)
    import inspect

    helper_line = inspect.getsourcelines(maxtext_lm.einsum)[1] + 2  # the `return jnp.einsum(...)` line
    model_lines = {inspect.getsourcelines(f)[1] + i for f in (maxtext_lm.attention, maxtext_lm.mlp, maxtext_lm.forward)
                   for i in range(len(inspect.getsourcelines(f)[0]))}
    through = [x for x in fn["collectives"]["items"] if x["source"].endswith(f"maxtext_lm.py:{helper_line}")]
    assert through and all(x["via"] and int(x["via"][0].rsplit(":", 1)[1]) in model_lines for x in through)
    assert len({x["via"][0] for x in through}) >= 3  # several model lines, not one helper line for all


def test_equinox_init_that_filter_shards(run_cli, tmp_path, isolated_imports):
    """An Equinox init that shards its model with ``eqx.filter_shard``: staged as the real init leaves it."""
    pytest.importorskip("equinox")
    import equinox as eqx

    write(tmp_path, "eqxm.py", '''
        import equinox as eqx, jax, jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P

        MESH = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

        def init(key):
            model = eqx.nn.MLP(64, 64, 128, 1, key=key)
            specs = jax.tree.map(lambda x: NamedSharding(MESH, P(*([None] * (x.ndim - 1)), "model")),
                                 eqx.filter(model, eqx.is_array))
            return eqx.filter_shard(model, specs)

        def step(model, x):
            return jnp.sum(jax.vmap(model)(x))
    ''')
    spec = write(tmp_path, "s.yaml", '''
        version: 1
        mesh:
          axes: {data: 2, model: 4}
        functions:
          step:
            target: eqxm.py:step
            args:
              - init: eqxm.py:init
                init_args: [key(0)]
              - 'f32[16,64] @ [data, null]'
    ''')
    doc = run_cli("shardings", "--spec", spec, "--format", "json", check=0).json()
    sys.path.insert(0, str(tmp_path))
    import eqxm

    with jax.set_mesh(mesh_2x4()):
        model = eqxm.init(jax.random.key(0))
    real = {"model" + "".join(f"/{getattr(k, 'name', getattr(k, 'idx', k))}" for k in kp): trimmed(x.sharding.spec)
            for kp, x in jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_array))[0]}
    leaves = leaves_by_path(doc)
    assert real["model/layers/0/weight"] == (None, "model")
    for path, dims in real.items():
        assert trimmed(eval_spec(leaves[path]["declared"])) == dims, path
        assert leaves[path]["sharding_source"] == "init", path


def test_a_constraint_with_an_unconstrained_dimension_does_not_say_the_dims():
    """An init that constrains a leaf with ``P.UNCONSTRAINED`` in it (``nnx.vmap(transform_metadata=
    {nnx.PARTITION_NAME: None})`` does so for a stacked layer axis) leaves that dimension to the
    partitioner: produced_dims says nothing for it (was: TypeError "'UnconstrainedSingleton' object is
    not iterable", exit 3 for a Flax NNX scanned model's init), and still reads a fully named one."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from stagetool.inputs.init_shardings import produced_dims

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def init():
        w = jax.lax.with_sharding_constraint(jnp.zeros((2, 16, 16)), NamedSharding(mesh, P(P.UNCONSTRAINED, None, "model")))
        b = jax.lax.with_sharding_constraint(jnp.zeros((2, 16)), NamedSharding(mesh, P(None, "model")))
        return w, b

    assert produced_dims(jax.make_jaxpr(init)()) == [None, (None, "model")]
