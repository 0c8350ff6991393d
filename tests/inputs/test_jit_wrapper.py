"""The target's own jit decides (issue 21, item 2): a ``jax.jit`` / ``nnx.jit`` / ``eqx.filter_jit``
target is staged with its own static arguments, donation, in/out shardings and compiler options,
merged with the spec's; each case compared with the framework's own jit lowering the same step.
"""

from __future__ import annotations

import inspect
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import leaves_by_path, write
from stagetool.inputs.own_jit import in_sharding_dims, jit_settings

STEPS = '''
import jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P

def _f(w, x, scale=1.0):
    h = jnp.tanh(x @ w)
    h = jnp.exp(h) * 2 + 1
    return jnp.sum(jnp.sin(h) * h, axis=0) * scale

plain = jax.jit(_f)
no_fusion = jax.jit(_f, compiler_options={"xla_disable_hlo_passes": "fusion"})
donated = jax.jit(_f, donate_argnums=(0,))
sharded = jax.jit(_f, in_shardings=(P(None, "model"), P("data", None)))
'''

SPEC = '''
version: 1
mesh:
  axes: {{data: 2, model: 4}}
functions:
  f:
    target: steps.py:{target}
{body}
'''

W = "f32[256,256]"
X = "f32[128,256]"


def mesh_2x4():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))


def stage(run_cli, tmp_path, target: str, body: str, *, check: int = 0, command: str = "report", extra=()):
    write(tmp_path, "steps.py", STEPS)
    spec = tmp_path / "s.yaml"
    spec.write_text(SPEC.format(target=target, body=body))
    r = run_cli(command, "--spec", spec, "--format", "json", *extra, check=check)
    return r.json()["functions"][0] if check == 0 else r


def real_compile(tmp_path, name: str, *args):
    sys.path.insert(0, str(tmp_path))
    import steps

    mesh = mesh_2x4()
    with jax.set_mesh(mesh):
        return getattr(steps, name).lower(*args).compile()


def structs(w_spec=P(None, "model"), x_spec=P("data", None)):
    mesh = mesh_2x4()
    return (jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=NamedSharding(mesh, w_spec)),
            jax.ShapeDtypeStruct((128, 256), jnp.float32, sharding=NamedSharding(mesh, x_spec)))


def test_settings_are_read_from_each_wrapper():
    """Pins what own_jit reads from jaxlib's jit object (a JAX upgrade that moves it fails here)."""
    def f(a, b, n=1):
        return a * n + b

    s = jit_settings(jax.jit(f, static_argnames=("n",), donate_argnums=(0,), keep_unused=True,
                             compiler_options={"xla_disable_hlo_passes": "fusion"},
                             in_shardings=(P("data"), None), out_shardings=P("data")))
    assert (s.kind, s.readable, s.fun) == ("jax.jit", True, f)
    assert (s.static_argnames, s.donate_argnums, s.keep_unused) == (("n",), (0,), True)
    assert s.compiler_options == {"xla_disable_hlo_passes": "fusion"}
    assert s.out_shardings == P("data")
    args = (jax.ShapeDtypeStruct((8,), jnp.float32), jax.ShapeDtypeStruct((8,), jnp.float32))
    assert in_sharding_dims(s, args) == [("data",), None]
    assert jit_settings(f).kind is None and jit_settings(jax.jit(f)).in_shardings is None


@pytest.mark.jax_version("<0.12", reason="XLA:CPU of jaxlib 0.12 gives the same temporaries with xla_disable_hlo_passes=fusion (256 B both ways), so the option moves no figure")
def test_compiler_options_hold_with_spec_donation(run_cli, tmp_path, isolated_imports):
    """``donate:`` in the spec on a target jitted with compiler_options: no nested-jit error, and the
    options hold (figures equal jax.jit(f, compiler_options=..., donate_argnums=0); not the plain jit's)."""
    body = f"    args: ['{W} @ [null, model]', '{X} @ [data, null]']\n    donate: [0]"
    fn = stage(run_cli, tmp_path, "no_fusion", body)
    sys.path.insert(0, str(tmp_path))
    import steps

    with jax.set_mesh(mesh_2x4()):
        real = jax.jit(steps._f, donate_argnums=(0,), compiler_options={"xla_disable_hlo_passes": "fusion"}) \
            .lower(*structs()).compile()
        plain = jax.jit(steps._f, donate_argnums=(0,)).lower(*structs()).compile()
    mem, cost = real.memory_analysis(), real.cost_analysis()
    record = fn["memory"]["record"]
    assert record["temp_bytes"] == mem.temp_size_in_bytes != plain.memory_analysis().temp_size_in_bytes
    assert fn["cost"]["per_device"]["bytes_accessed"] == cost["bytes accessed"]
    assert leaves_by_path({"functions": [fn]})["w"]["donated"]
    assert fn["compiler_options"] == [["xla_disable_hlo_passes", "fusion"]]


@pytest.mark.jax_version("<0.12", reason="XLA:CPU of jaxlib 0.12 gives the same temporaries with xla_disable_hlo_passes=fusion (256 B both ways), so the option moves no figure")
def test_compiler_options_in_header_snapshot_and_check(run_cli, tmp_path, isolated_imports):
    write(tmp_path, "steps.py", STEPS)
    body = f"    args: ['{W} @ [null, model]', '{X} @ [data, null]']"
    spec = tmp_path / "s.yaml"
    spec.write_text(SPEC.format(target="plain", body=body))
    run_cli("snapshot", "--spec", spec, "--output", tmp_path / "lock.json", check=0)
    spec.write_text(SPEC.format(target="no_fusion", body=body))
    out = run_cli("memory", "--spec", spec, check=0).stdout
    assert "compiler_options (the target's jit): xla_disable_hlo_passes=fusion" in out
    r = run_cli("check", "--spec", spec, "--baseline", tmp_path / "lock.json")
    assert r.code == 1, r.stdout
    assert "compiler_options" in r.stdout and "xla_disable_hlo_passes=fusion" in r.stdout
    assert "temp_bytes" in r.stdout


def test_wrapper_donation_is_kept_and_a_disagreeing_spec_exits_2(run_cli, tmp_path, isolated_imports):
    body = f"    args: ['{W} @ [null, model]', '{X} @ [data, null]']"
    fn = stage(run_cli, tmp_path, "donated", body)
    real = real_compile(tmp_path, "donated", *structs())
    assert leaves_by_path({"functions": [fn]})["w"]["donated"]
    assert fn["memory"]["record"]["argument_bytes"] == real.memory_analysis().argument_size_in_bytes
    r = stage(run_cli, tmp_path, "donated", body + "\n    donate: [1]", check=2, command="shardings")
    assert "donate" in r.stderr and "donate_argnums=[0]" in r.stderr and "[1]" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_in_shardings_target_with_kwargs_and_leaves_without_at(run_cli, tmp_path, isolated_imports):
    """``kwargs:`` are bound to positions; leaves without ``@`` take the target's in_shardings."""
    body = f"    kwargs: {{w: '{W}', x: '{X}'}}"
    fn = stage(run_cli, tmp_path, "sharded", body)
    real = real_compile(tmp_path, "sharded", *structs())
    leaves = leaves_by_path({"functions": [fn]})
    assert leaves["w"]["compiled"] == "P(None, 'model')" and leaves["w"]["sharding_source"] == "target"
    assert leaves["x"]["compiled"] == "P('data', None)"
    assert [tuple(s.spec) for s in jax.tree_util.tree_leaves(real.input_shardings)] == [(None, "model"), ("data", None)]
    assert fn["cost"]["per_device"]["flops"] == real.cost_analysis()["flops"]
    assert fn["memory"]["record"]["temp_bytes"] == real.memory_analysis().temp_size_in_bytes
    # a leaf whose '@' contradicts the target's in_shardings: exit 2 naming both
    r = stage(run_cli, tmp_path, "sharded", f"    args: ['{W} @ [model, null]', '{X}']", check=2, command="shardings")
    assert "P('model', None)" in r.stderr and "P(None, 'model')" in r.stderr, r.stderr


NNX_STEPS = '''
import jax, jax.numpy as jnp, optax
from flax import nnx

class MLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(64, 128, rngs=rngs)
        self.down = nnx.Linear(128, 64, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))

def make_opt():
    return nnx.Optimizer(MLP(nnx.Rngs(0)), optax.adam(1e-3), wrt=nnx.Param)

def _step(model, optimizer, x):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)
    return loss

jax_step = jax.jit(_step)
nnx_step = nnx.jit(_step, donate_argnums=(0, 1))
'''


@pytest.mark.parametrize("target", ["jax_step", "nnx_step"])
def test_nnx_step_under_jax_jit_and_nnx_jit(run_cli, tmp_path, isolated_imports, target):
    """A plain ``jax.jit`` NNX step returns only its loss (no updated model/optimizer outputs);
    ``nnx.jit`` returns the updated state, donated as its ``donate_argnums`` say."""
    pytest.importorskip("flax")
    from flax import nnx

    write(tmp_path, "nnxsteps.py", NNX_STEPS)
    spec = write(tmp_path, "s.yaml", f'''
        version: 1
        mesh:
          axes: {{data: 2, model: 4}}
        functions:
          step:
            target: nnxsteps.py:{target}
            args:
              - init: nnxsteps.py:MLP
              - init: nnxsteps.py:make_opt
              - 'f32[16,64]'
    ''')
    fn = run_cli("memory", "--spec", spec, "--format", "json", check=0).json()["functions"][0]
    sys.path.insert(0, str(tmp_path))
    import nnxsteps

    with jax.set_mesh(mesh_2x4()):
        model = nnxsteps.MLP(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, __import__("optax").adam(1e-3), wrt=nnx.Param)
        mem = getattr(nnxsteps, target).lower(model, optimizer, jnp.zeros((16, 64))).compile().memory_analysis()
    record = fn["memory"]["record"]
    assert record["output_bytes"] == mem.output_size_in_bytes
    assert record["argument_bytes"] == mem.argument_size_in_bytes
    assert record["alias_bytes"] == mem.alias_size_in_bytes
    if target == "jax_step":
        assert record["output_bytes"] == 4  # the loss alone
    else:
        assert record["alias_bytes"] > 0


def test_equinox_filter_jit_is_staged_as_its_own_program(run_cli, tmp_path, isolated_imports):
    """``eqx.filter_jit(donate="all")``: the program is Equinox's own executable (its marker scalar
    included): FLOPs, the four memory figures, collectives and shardings equal
    ``eqx.filter_jit(f).lower(...).compile()``; every input donated."""
    pytest.importorskip("equinox")
    from test_frameworks import assert_same_program

    write(tmp_path, "eqxsteps.py", '''
        import equinox as eqx, jax, jax.numpy as jnp

        def init(key):
            return eqx.nn.MLP(64, 64, 128, 2, key=key)

        @eqx.filter_jit(donate="all")
        def step(model, x):
            grads = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
            return eqx.apply_updates(model, jax.tree.map(lambda g: -1e-3 * g, grads))
    ''')
    spec = write(tmp_path, "s.yaml", '''
        version: 1
        mesh:
          axes: {data: 2, model: 4}
        functions:
          step:
            target: eqxsteps.py:step
            args:
              - init: eqxsteps.py:init
                init_args: [key(0)]
              - 'f32[16,64] @ [data, null]'
    ''')
    fn = run_cli("report", "--spec", spec, "--format", "json", check=0).json()["functions"][0]
    sys.path.insert(0, str(tmp_path))
    import eqxsteps

    mesh = mesh_2x4()
    with jax.set_mesh(mesh):
        model = eqxsteps.init(jax.random.key(0))
        x = jax.device_put(jnp.zeros((16, 64)), NamedSharding(mesh, P("data", None)))
        compiled = eqxsteps.step.lower(model, x).compile().compiled
    assert_same_program(fn, compiled)
    record = fn["memory"]["record"]
    assert all(x["donated"] for x in fn["inputs"])
    assert record["alias_bytes"] > 0
    outputs = {x["path"]: x for x in fn["outputs"]}
    assert outputs["marker"]["shape"] == [] and outputs["marker"]["dtype"] == "int32"  # Equinox's own scalar
    model_bytes = 4 * (128 * 64 + 128 + 128 * 128 + 128 + 64 * 128 + 64)
    import math

    assert sum(4 * math.prod(x["shape"]) for p, x in outputs.items() if p != "marker") == model_bytes  # the new model
    assert set(leaves_by_path({"functions": [fn]})) == {"model/layers/0/weight", "model/layers/0/bias",
                                                        "model/layers/1/weight", "model/layers/1/bias",
                                                        "model/layers/2/weight", "model/layers/2/bias", "x"}


@pytest.mark.jax_version("<0.12", reason="XLA:CPU of jaxlib 0.12 gives the same temporaries with xla_disable_hlo_passes=fusion (256 B both ways), so the option moves no figure")
def test_the_targets_compiler_options_are_part_of_the_cache_key(run_cli, tmp_path, isolated_imports):
    """The same function jitted with and without a pass-disabling option lowers to the same text;
    the facts cache must still miss (and the figures differ), then hit for each."""
    write(tmp_path, "steps.py", STEPS)
    body = f"    args: ['{W} @ [null, model]', '{X} @ [data, null]']"
    spec = tmp_path / "s.yaml"
    cache = tmp_path / "cache"
    seen = {}
    for target in ("plain", "no_fusion", "plain", "no_fusion"):
        spec.write_text(SPEC.format(target=target, body=body))
        fn = run_cli("memory", "--spec", spec, "--cache-dir", cache, "--format", "json", check=0).json()["functions"][0]
        cached = fn["cached"]
        assert cached == (target in seen), target
        temp = fn["memory"]["record"]["temp_bytes"]
        assert seen.setdefault(target, temp) == temp
    assert seen["plain"] != seen["no_fusion"]


NNX_SHARDED = '''
import jax, jax.numpy as jnp, optax
from flax import nnx
from jax.sharding import PartitionSpec as P

class MLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(64, 128, rngs=rngs)
        self.down = nnx.Linear(128, 64, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))

def make_opt(model):
    return nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

def _step(model, optimizer, x):
    def loss_fn(m):
        y = m(x)
        return jnp.mean(y ** 2), y
    (loss, y), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss, y

KERNELS = nnx.StateSharding({nnx.PathContains("kernel"): P(None, "model"), ...: P()})
IN = (KERNELS, KERNELS, P("data", None))
OUT = (P(), P("data", "model"))
step = nnx.jit(_step, in_shardings=IN, out_shardings=OUT)
step_in_only = nnx.jit(_step, in_shardings=IN)
'''


def nnx_sharded_spec(tmp_path, extra: str = "", x: str = "f32[16,64]", target: str = "step"):
    write(tmp_path, "nnxsharded.py", NNX_SHARDED)
    return write(tmp_path, "s.yaml", f'''
        version: 1
        mesh:
          axes: {{data: 2, model: 4}}
        functions:
          step:
            target: nnxsharded.py:{target}
            args:
              - init: nnxsharded.py:MLP
              - init: nnxsharded.py:make_opt
                init_args: [{{arg: 0}}]
              - '{x}'
{extra}    ''')


def nnx_sharded_compiled(tmp_path, **jit_options):
    """``nnx.jit`` itself lowering and compiling the step on abstract model/optimizer/batch."""
    from flax import nnx

    sys.path.insert(0, str(tmp_path))
    import nnxsharded

    step = nnx.jit(nnxsharded._step, **{"in_shardings": nnxsharded.IN, "out_shardings": nnxsharded.OUT,
                                         **jit_options}) if jit_options else nnxsharded.step
    with jax.set_mesh(mesh_2x4()):
        model, opt = nnx.eval_shape(lambda: (lambda m: (m, nnxsharded.make_opt(m)))(nnxsharded.MLP(nnx.Rngs(0))))
        return step.lower(model, opt, jax.ShapeDtypeStruct((16, 64), jnp.float32)).compile()


@pytest.mark.parametrize("donate", [False, True])
def test_nnx_jit_in_and_out_shardings_decide_the_program(run_cli, tmp_path, isolated_imports, donate):
    """``nnx.jit(step, in_shardings=(StateSharding, StateSharding, P), out_shardings=...)``: FLOPs,
    the four memory figures, collectives by kind and every input/output sharding equal ``nnx.jit``'s
    own lowering; the leaves say the shardings come from the target. With the spec's ``donate``
    the step is jitted once with it (equal to ``nnx.jit(..., donate_argnums=(0, 1))``)."""
    pytest.importorskip("flax")
    from test_frameworks import assert_same_program

    spec = nnx_sharded_spec(tmp_path, "            donate: [0, 1]\n" if donate else "")
    fn = run_cli("report", "--spec", spec, "--format", "json", check=0).json()["functions"][0]
    compiled = nnx_sharded_compiled(tmp_path, **({"donate_argnums": (0, 1)} if donate else {}))
    assert_same_program(fn, compiled)
    leaves = leaves_by_path({"functions": [fn]})
    assert leaves["model/up/kernel/value"]["compiled"] == "P(None, 'model')"
    assert leaves["model/up/kernel/value"]["sharding_source"] == "target"
    assert leaves["optimizer/opt_state/0/mu/down/kernel/value"]["compiled"] == "P(None, 'model')"
    assert leaves["x"]["compiled"] == "P('data', None)" and leaves["x"]["sharding_source"] == "target"
    outputs = {x["path"]: x for x in fn["outputs"]}
    assert outputs["out/1"]["compiled"] == "P('data', 'model')"
    assert outputs["model/down/kernel/value"]["compiled"] == "P(None, 'model')"  # as the in_shardings say
    assert len(outputs) == len(jax.tree_util.tree_leaves(compiled.output_shardings))
    if donate:
        assert fn["memory"]["record"]["alias_bytes"] > 0 and all(x["donated"] for x in fn["inputs"][:-1])


def test_nnx_jit_shardings_that_disagree_with_the_spec_exit_2(run_cli, tmp_path, isolated_imports):
    pytest.importorskip("flax")
    spec = nnx_sharded_spec(tmp_path, x="f32[16,64] @ [null, model]")
    r = run_cli("shardings", "--spec", spec, check=2)
    assert "P(None, 'model')" in r.stderr and "gives P('data')" in r.stderr and "nnx.jit(in_shardings" in r.stderr, r.stderr
    spec = nnx_sharded_spec(tmp_path, "            out_shardings: [replicated, replicated]\n")
    r = run_cli("shardings", "--spec", spec, check=2)
    assert "out_shardings" in r.stderr and "nnx.jit(out_shardings=...)" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_nnx_split_is_read_from_the_wrapper(tmp_path, isolated_imports):
    """Pins what own_jit reads from flax's nnx.jit object: ``in_shardings``/``out_shardings``,
    ``jitted_fn`` and the private ``_get_pure_args_kwargs`` (the same leaves, grouped by filter)."""
    pytest.importorskip("flax")
    from flax import nnx

    from stagetool.inputs.leaves import keypath_str
    from stagetool.inputs.frameworks.nnx import nnx_program

    write(tmp_path, "nnxsharded.py", NNX_SHARDED)
    sys.path.insert(0, str(tmp_path))
    import nnxsharded

    s = jit_settings(nnxsharded.step)
    assert (s.kind, s.in_shardings, s.out_shardings) == ("nnx.jit", nnxsharded.IN, nnxsharded.OUT)
    with jax.set_mesh(mesh_2x4()):
        model, opt = nnx.eval_shape(lambda: (lambda m: (m, nnxsharded.make_opt(m)))(nnxsharded.MLP(nnx.Rngs(0))))
        args = (model, opt, jax.ShapeDtypeStruct((16, 64), jnp.float32))
        program = nnx_program(s, args, {}, ["model", "optimizer", "x"])
        assert program is not None
        ours = jax.tree_util.tree_leaves(args)
        split = jax.tree_util.tree_leaves(program.args)
        assert sorted(map(id, split)) == sorted(map(id, ours)) and split != ours  # kernels first: regrouped
        assert [x.shape for x in split[:2]] == [(128, 64), (64, 128)]
        program.input_paths = ([["m/" + str(i) for i in range(4)], ["o/" + str(i) for i in range(10)], []], {})
        paths = program.output_paths(program.trace(*program.args).out_info, keypath_str)
    assert paths == [*program.input_paths[0][0], *program.input_paths[0][1], "out/0", "out/1"]
    if "graph" in inspect.signature(nnx.jit).parameters:  # Flax >= 0.12.x: nnx.jit(graph=False) is staged nested
        assert nnx_program(jit_settings(nnx.jit(nnxsharded._step, graph=False)), args, {}, []) is None


def test_equinox_split_is_read_from_the_wrapper():
    """Pins what own_jit reads from Equinox's filter_jit object (``_signature``, ``_dynamic_fun``,
    ``_static_fun``, ``_cached``, ``donate_first/rest``) and its private ``_preprocess``: the abstract
    leaves come back as the jit's dynamic arguments (donated as ``donate=`` says), the rest static."""
    pytest.importorskip("equinox")
    import equinox as eqx

    from stagetool.inputs.frameworks.equinox import eqx_program

    @eqx.filter_jit(donate="all-except-first")
    def f(a, b, act=jax.nn.relu, n=2):
        return act(a) * n + b

    a, b = jax.ShapeDtypeStruct((8,), jnp.float32), jax.ShapeDtypeStruct((8,), jnp.float32)
    program = eqx_program(jit_settings(f, 2), (a, b), {"n": 3})
    assert program is not None
    donate, keep = program.args
    assert jax.tree_util.tree_leaves(keep) == [a] and jax.tree_util.tree_leaves(donate) == [b]
    assert 3 in jax.tree_util.tree_leaves(program.static)  # a Python number is static to Equinox
    traced = program.trace(*program.args)
    assert [x.shape for x in jax.tree_util.tree_leaves(traced.out_info)] == [(), (8,)]  # the marker, the output
    closes_over = eqx.filter_jit(eqx.Partial(lambda w, x: w * x, jnp.ones(8)))
    assert eqx_program(jit_settings(closes_over, 1), (a,), {}) is None  # its array is an input the spec does not name


def test_nnx_jit_nested_keeps_its_shardings_at_the_boundary(run_cli, tmp_path, isolated_imports):
    """A spec ``out_shardings`` on an ``nnx.jit(in_shardings=...)`` step stages it nested (nnx.jit
    takes no out_shardings for the updated state): the arguments still take its in_shardings and
    the updated model/optimizer come back as they say, the output as the spec says; the boundary
    (input and output shardings, argument and output bytes) equals ``nnx.jit(..., out_shardings=...)``."""
    pytest.importorskip("flax")
    spec = nnx_sharded_spec(tmp_path, "            out_shardings: [replicated, [data, model]]\n", target="step_in_only")
    fn = run_cli("report", "--spec", spec, "--format", "json", check=0).json()["functions"][0]
    compiled = nnx_sharded_compiled(tmp_path, out_shardings=(P(), P("data", "model")))  # as the spec's
    record, mem = fn["memory"]["record"], compiled.memory_analysis()
    assert (record["argument_bytes"], record["output_bytes"]) == (mem.argument_size_in_bytes, mem.output_size_in_bytes)
    from collections import Counter

    from test_frameworks import eval_spec, trimmed

    for ours, theirs in (("inputs", compiled.input_shardings), ("outputs", compiled.output_shardings)):
        assert Counter(trimmed(eval_spec(x["compiled"])) for x in fn[ours]) == \
            Counter(trimmed(tuple(s.spec)) for s in jax.tree_util.tree_leaves(theirs)), ours
    outputs = {x["path"]: x["compiled"] for x in fn["outputs"]}
    assert outputs["model/up/kernel/value"] == "P(None, 'model')" and outputs["out/1"] == "P('data', 'model')"


def test_nnx_jit_traces_a_python_number_as_nnx_jit_does(run_cli, tmp_path, isolated_imports):
    """A Python number for a non-static parameter of an ``nnx.jit`` step is a traced scalar input (as
    jax.jit, which nnx.jit is, traces it), not a constant: arguments 4 bytes more than the arrays."""
    pytest.importorskip("flax")
    from flax import nnx

    write(tmp_path, "nnxnum.py", '''
        import jax.numpy as jnp
        from flax import nnx

        @nnx.jit
        def step(model, x, scale):
            return jnp.sum(model(x)) * scale
    ''')
    spec = write(tmp_path, "s.yaml", '''
        version: 1
        mesh:
          axes: {data: 2, model: 4}
        functions:
          step:
            target: nnxnum.py:step
            args:
              - {init: flax.nnx:Linear, init_args: [64, 128]}
              - 'f32[16,64]'
              - 2.0
    ''')
    fn = run_cli("report", "--spec", spec, "--format", "json", check=0).json()["functions"][0]
    sys.path.insert(0, str(tmp_path))
    import nnxnum

    with jax.set_mesh(mesh_2x4()):
        model = nnx.eval_shape(lambda: nnx.Linear(64, 128, rngs=nnx.Rngs(0)))
        mem = nnxnum.step.lower(model, jax.ShapeDtypeStruct((16, 64), jnp.float32), 2.0).compile().memory_analysis()
    assert fn["memory"]["record"]["argument_bytes"] == mem.argument_size_in_bytes == 4 * (64 * 128 + 128 + 16 * 64 + 1)
    assert leaves_by_path({"functions": [fn]})["scale"]["shape"] == []
