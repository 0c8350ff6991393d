"""``jax.Ref`` state (issue 21, item 4): a train step that takes Refs, as the JAX training cookbook
writes it, stages with no wrapper: an ``init`` returning Refs gives abstract refs
(``jax.ref.AbstractRef``), as raw JAX lowers a Ref argument; compared with ``jax.jit`` lowering the
step on the Refs the init really returns (explicit sharding mode: the Ref's type carries its sharding).
"""

from __future__ import annotations

import contextlib
import importlib
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import JAXLIB_0_12_METADATA, assert_memory_is_xlas, import_afresh, leaves_by_path, write

STEP = '''
import jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P

def init(key):
    params = {"w": jax.random.normal(key, (64, 64)), "b": jnp.zeros((64,))}
    params = {"w": jax.sharding.reshard(params["w"], P(None, "model")), "b": params["b"]}
    return jax.tree.map(jax.new_ref, params)

@jax.jit
def train_step(params, x):
    def loss(p):
        return jnp.mean((x @ p["w"] + p["b"]) ** 2)
    value = {k: r[...] for k, r in params.items()}
    l, g = jax.value_and_grad(loss)(value)
    for k in params:
        params[k][...] = value[k] - 0.1 * g[k]
    return l
'''


def _spec(tmp_path, module: str, *, explicit: bool = True, target: str = "train_step",
          x: str = "f32[16,64] @ [data, null]", extra: str = ""):
    """The spec of these tests: ``module``'s ``target`` over its ``init(key(0))`` and ``x``, on a
    data=2 × model=4 mesh with explicit (or auto) axes; ``extra``: more lines of the function."""
    axis_types = "\n          axis_types: explicit" if explicit else ""
    return write(tmp_path, "s.yaml", f"""
        version: 1
        mesh:
          axes: {{data: 2, model: 4}}{axis_types}
        functions:
          train_step:
            target: {module}.py:{target}
            args:
              - init: {module}.py:init
                init_args: [key(0)]
              - '{x}'
    """ + extra)


@contextlib.contextmanager
def _real(tmp_path, module: str, *, explicit: bool = True):
    """``(module, refs, x)`` for running the step for real, inside the spec's mesh: the module imported
    from ``tmp_path``, the Refs its ``init(key(0))`` returns, and ``x`` f32[16,64] over ``data``."""
    sys.path.insert(0, str(tmp_path))
    mod = importlib.import_module(module)
    kind = AxisType.Explicit if explicit else AxisType.Auto
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(kind, kind))
    with jax.set_mesh(mesh):
        yield mod, mod.init(jax.random.key(0)), jax.device_put(jnp.zeros((16, 64)), NamedSharding(mesh, P("data", None)))


def test_ref_train_step_is_the_real_program(run_cli, tmp_path, isolated_imports):
    write(tmp_path, "cook.py", STEP)
    fn = run_cli("report", "--spec", _spec(tmp_path, "cook"), "--format", "json", check=0).json()["functions"][0]
    with _real(tmp_path, "cook") as (cook, refs, x):
        real = cook.train_step.lower(refs, x).compile()
    record = fn["memory"]["record"]
    assert_memory_is_xlas(record, real)
    assert record["alias_bytes"] > 0  # the refs' new values are written in place
    assert fn["cost"]["per_device"]["flops"] == real.cost_analysis()["flops"]
    leaves = leaves_by_path({"functions": [fn]})
    assert leaves["params/w"]["compiled"] == "P(None, 'model')"
    real_in = jax.tree_util.tree_leaves(real.input_shardings)
    assert [tuple(s.spec) for s in real_in][:2] == [(None,), (None, "model")]


AUTO_STEP = STEP.replace('jax.sharding.reshard(params["w"], P(None, "model"))',
                         'jax.lax.with_sharding_constraint(params["w"], P(None, "model"))')


@pytest.mark.parametrize("static", [False, True])
def test_refs_under_auto_axes_keep_the_sharding_their_value_has(run_cli, tmp_path, isolated_imports, static):
    """Under auto axes a Ref's type carries no sharding, but ``jax.jit`` on a real Ref takes its
    value's placement as the input sharding; stagetool gives the abstract Ref the sharding the init
    gives it (through the jit's in_shardings) and stages the same program: memory four figures,
    FLOPs and input shardings equal ``train_step.lower(init(key), x).compile()``. A spec ``static``
    value is closed over (jax.jit takes no keywords with in_shardings)."""
    assert AUTO_STEP != STEP
    step = AUTO_STEP.replace("def train_step(params, x):", "def train_step(params, x, lr=0.1):") \
        .replace("- 0.1 * g[k]", "- lr * g[k]")
    assert step != AUTO_STEP
    write(tmp_path, "cook.py", step if static else AUTO_STEP)
    spec = _spec(tmp_path, "cook", explicit=False, extra="        static: {lr: 0.2}\n" if static else "")
    fn = run_cli("report", "--spec", spec, "--format", "json", check=0).json()["functions"][0]
    with _real(tmp_path, "cook", explicit=False) as (cook, refs, x):
        assert refs["w"][...].sharding.spec == P(None, "model")  # the real Ref's value is sharded
        if static:
            real = jax.jit(cook.train_step.__wrapped__, static_argnames=("lr",)).lower(refs, x, lr=0.2).compile()
        else:
            real = cook.train_step.lower(refs, x).compile()
    record = fn["memory"]["record"]
    assert_memory_is_xlas(record, real)
    assert record["argument_bytes"] == 4 * (64 * 64 // 4 + 64 + 16 * 64 // 2)  # w split over model, x over data
    assert fn["cost"]["per_device"]["flops"] == real.cost_analysis()["flops"]
    leaves = leaves_by_path({"functions": [fn]})
    assert leaves["params/w"]["compiled"] == "P(None, 'model')" and leaves["params/w"]["sharding_source"] == "init"
    real_in = [tuple(s.spec) for s in jax.tree_util.tree_leaves(real.input_shardings)]
    assert real_in[1] == (None, "model")


WRITES_TWO_OF_THREE = '''
import jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P

def init(key):
    params = {"w": jax.sharding.reshard(jax.random.normal(key, (64, 64)), P(None, "model")),
              "b": jnp.zeros((64,)),
              "frozen": jax.sharding.reshard(jnp.ones((64,)), P("model"))}
    return jax.tree.map(jax.new_ref, params)

@jax.jit
def train_step(params, x):
    frozen = params["frozen"][...]   # read, never written: JAX writes it back all the same
    def loss(p):
        return jnp.mean((x @ p["w"] + p["b"] + frozen) ** 2)
    value = {k: params[k][...] for k in ("w", "b")}
    l, g = jax.value_and_grad(loss)(value)
    for k in value:
        params[k][...] = value[k] - 0.1 * g[k]
    return {"loss": l, "y": x * 2}
'''


def test_ref_write_backs_are_outputs_with_their_real_shardings(run_cli, tmp_path, isolated_imports):
    """Trial 2, finding 4: the function's outputs get their compiled shardings and bytes (jax 0.10.2's
    ``Compiled.output_shardings`` raises for a Ref-writing program), and each written Ref is an output
    of its own, named by its input path (JAX writes back every Ref argument it keeps, a Ref it only
    reads too); compared with running the step for real."""
    write(tmp_path, "cook2.py", WRITES_TWO_OF_THREE)
    spec = _spec(tmp_path, "cook2")
    doc = run_cli("report", "--spec", spec, "--format", "json", check=0).json()
    outputs = doc["functions"][0]["outputs"]
    with _real(tmp_path, "cook2") as (cook2, refs, x):
        real_mem = cook2.train_step.lower(refs, x).compile().memory_analysis()
        real_out_bytes = real_mem.output_size_in_bytes
        result = cook2.train_step(refs, x)  # the step run for real: its outputs, and the Refs it wrote
    real = {"out/loss": result["loss"].sharding, "out/y": result["y"].sharding,
            **{f"params/{k}": refs[k].sharding for k in refs}}
    assert [(o["path"], o["ref_write_back"]) for o in outputs] == [
        ("out/loss", False), ("out/y", False), ("params/b", True), ("params/frozen", True), ("params/w", True)]
    for o in outputs:
        sharding = real[o["path"]]
        dims = tuple(sharding.spec) + (None,) * (len(o["shape"]) - len(sharding.spec))
        assert o["compiled"] == f"P({', '.join(repr(d) for d in dims)})", o["path"]
        assert tuple(o["shard_shape"]) == sharding.shard_shape(tuple(o["shape"])), o["path"]
        assert not o["unused"]
    # XLA's output bytes also count the result tuple's table of 8-byte buffer pointers
    assert sum(o["bytes_per_device"] for o in outputs) + 8 * len(outputs) == real_out_bytes == \
        doc["functions"][0]["memory"]["record"]["output_bytes"]

    text = run_cli("report", "--spec", spec, check=0).stdout
    assert "unused (pruned)" not in text  # the loss was reported pruned before
    shardings = run_cli("shardings", "--spec", spec, check=0).stdout
    assert shardings.count("Ref write-back (in place)") == 3


def test_ref_write_backs_are_not_failed_donation(run_cli, tmp_path, isolated_imports):
    """Trial 2, finding 7: a Ref's in-place write is named as such, not as donation that did not take;
    the aliased bytes are the write-backs' (XLA's alias figure from the real compile)."""
    write(tmp_path, "cook4.py", WRITES_TWO_OF_THREE)
    spec = _spec(tmp_path, "cook4")
    fn = run_cli("report", "--spec", spec, "--format", "json", check=0).json()["functions"][0]
    with _real(tmp_path, "cook4") as (cook4, refs, x):
        real_alias = cook4.train_step.lower(refs, x).compile().memory_analysis().alias_size_in_bytes
    donation = fn["memory"]["donation"]
    assert [(d["path"], d["status"], d["aliased_to"]) for d in donation] == [
        (f"params/{k}", "Ref write-back", [f"params/{k}"]) for k in ("b", "frozen", "w")]
    assert fn["memory"]["record"]["alias_bytes"] == real_alias == sum(
        o["bytes_per_device"] for o in fn["outputs"] if o["ref_write_back"])
    for fmt in ("text", "markdown"):
        out = run_cli("memory", "--spec", spec, "--no-peak", "--format", fmt, check=0).stdout
        assert "did not take" not in out.lower() and "aliased without request" not in out
        assert "aliased (Ref write-backs)" in out
        assert "Ref write-backs: 3 jax.Ref arguments are written in place" in out


COOKBOOK_STYLE = '''
import jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P

def init(key):
    k1, k2 = jax.random.split(key)
    params = {"w1": jax.sharding.reshard(jax.random.normal(k1, (64, 256)), P("fsdp", None)),
              "w2": jax.sharding.reshard(jax.random.normal(k2, (256, 64)), P(None, "fsdp"))}
    return jax.tree.map(jax.new_ref, {"params": params, "opt": {"count": jnp.array(0)}})

@jax.jit
def train_step(state, x):
    def loss(p):
        h = jnp.einsum("bsd,dh->bsh", x, p["w1"], out_sharding=P("fsdp", None, None))
        y = jnp.einsum("bsh,hd->bsd", jax.nn.gelu(h), p["w2"], out_sharding=P("fsdp", None, None))
        return jnp.mean(y ** 2)
    params = jax.tree.map(jax.ref.get, state["params"])
    l, g = jax.value_and_grad(loss)(params)
    for k in params:
        state["params"][k][...] = params[k] - 0.1 * g[k]
    state["opt"]["count"][...] += 1
    return {"train_loss": l}
'''


@pytest.mark.jax_version("<0.12", reason=JAXLIB_0_12_METADATA)
def test_ref_step_collectives_have_causes_and_check_names_the_constraint(run_cli, tmp_path, monkeypatch):
    """Trial 2, finding 6: a Ref step's collectives are explained (the lowered module's extra results
    are the Ref write-backs), and after editing an einsum's ``out_sharding=`` ``check`` names that
    line as the cause."""
    write(tmp_path, "cook3.py", COOKBOOK_STYLE)
    write(tmp_path, "cook3.stagetool.yaml", '''
        version: 1
        mesh:
          axes: {fsdp: 8}
          axis_types: explicit
        functions:
          train_step:
            target: cook3.py:train_step
            args:
              - init: cook3.py:init
                init_args: [key(0)]
              - 'f32[16,8,64] @ [fsdp, null, null]'
    ''')
    monkeypatch.chdir(tmp_path)
    section = run_cli("collectives", "--format", "json", check=0).json()["functions"][0]["collectives"]
    assert section["causes_unavailable"] is None
    assert section["items"] and all(i["cause"] is not None for i in section["items"])
    run_cli("snapshot", "-o", "base.json", check=0)
    text = (tmp_path / "cook3.py").read_text()
    line = 1 + text.splitlines().index(
        '        h = jnp.einsum("bsd,dh->bsh", x, p["w1"], out_sharding=P("fsdp", None, None))')
    (tmp_path / "cook3.py").write_text(text.replace('p["w1"], out_sharding=P("fsdp", None, None)',
                                                    'p["w1"], out_sharding=P(None, None, "fsdp")'))
    import_afresh("cook3")  # the edited file imported anew, as the fresh process CI runs check in does
    r = run_cli("check", "--baseline", "base.json", "--format", "json", check=1)
    (f,) = r.json()["functions"]
    (cause,) = f["causes"]  # before: "0 causes"
    assert cause["kind"] == "constraint" and cause["where"] == f"cook3.py:{line}"
    edit, *follows = cause["edits"]
    before, after = edit.split(" → ")
    assert edit.startswith(f"cook3.py:{line}: ")
    assert "P(None, None, 'fsdp')" not in before and "P(None, None, 'fsdp')" in after
    assert "P('fsdp', None, None)" in before
    # under explicit axes every op's result type is a constraint: the next line, which applies gelu to
    # the edited value, changes too, and is listed under the edit, not as an edit of its own
    assert follows and all(e.endswith(f"(follows cook3.py:{line}: the sharding types of its values)")
                           for e in follows)
    # a second, independent edit (the next einsum's own out_sharding) is a cause of its own
    text = (tmp_path / "cook3.py").read_text()
    (tmp_path / "cook3.py").write_text(text.replace('p["w2"], out_sharding=P("fsdp", None, None)',
                                                    'p["w2"], out_sharding=P(None, "fsdp", None)'))
    import_afresh("cook3")
    r = run_cli("check", "--baseline", "base.json", "--format", "json")
    assert r.code == 1, r.stderr
    assert [c["where"] for c in r.json()["functions"][0]["causes"]] == [f"cook3.py:{line}", f"cook3.py:{line + 1}"]


def test_refs_take_the_targets_in_shardings(run_cli, tmp_path, isolated_imports):
    """A Ref step jitted with ``in_shardings`` (auto axes, an init that shards nothing): the Refs take
    the target's shardings (``from target``) and stay Refs; the program equals raw ``jax.jit`` lowering
    the same jitted step on abstract refs (``jax.ref.AbstractRef``)."""
    write(tmp_path, "cook.py", AUTO_STEP.replace(
        'params = {"w": jax.lax.with_sharding_constraint(params["w"], P(None, "model")), "b": params["b"]}', "")
        + '\nsharded_step = jax.jit(train_step.__wrapped__, in_shardings=({"b": P(), "w": P(None, "model")}, '
          'P("data", None)))\n')
    spec = _spec(tmp_path, "cook", explicit=False, target="sharded_step", x="f32[16,64]")
    fn = run_cli("report", "--spec", spec, "--format", "json", check=0).json()["functions"][0]
    sys.path.insert(0, str(tmp_path))
    import cook

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
    with jax.set_mesh(mesh):
        ref = lambda *shape: jax.ref.AbstractRef(jax.core.ShapedArray(shape, jnp.float32))  # noqa: E731
        real = cook.sharded_step.lower({"b": ref(64), "w": ref(64, 64)},
                                       jax.ShapeDtypeStruct((16, 64), jnp.float32)).compile()
    record = fn["memory"]["record"]
    assert_memory_is_xlas(record, real)
    assert record["alias_bytes"] > 0  # still Refs, written in place
    assert fn["cost"]["per_device"]["flops"] == real.cost_analysis()["flops"]
    leaves = leaves_by_path({"functions": [fn]})
    assert leaves["params/w"]["compiled"] == "P(None, 'model')" and leaves["params/w"]["sharding_source"] == "target"
    assert leaves["x"]["compiled"] == "P('data', None)"


VALIDATING = '''
"""The shape of JEP 28845's stateful PRNG used in a dropout step: a frozen dataclass pytree holding a
typed key and a counter, whose __post_init__ refuses anything but a typed key array."""
import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Draws:
    key: jax.Array
    count: jax.Array

    def __post_init__(self):
        if not (isinstance(self.key, jax.Array) and jnp.issubdtype(self.key.dtype, jax.dtypes.prng_key)):
            raise ValueError(f"Draws wants a typed PRNG key; got {self.key}")


def make_draws(seed):
    return Draws(jax.random.key(seed), jnp.zeros((), jnp.int32))


@jax.jit
def step(w, draws, x):
    keep = jax.random.bernoulli(jax.random.fold_in(draws.key, draws.count), 0.9, (x.shape[0], w.shape[1]))
    return jnp.mean(jnp.where(keep, x @ w, 0.0))
'''


def test_an_argument_whose_class_refuses_abstract_leaves_is_exit_2(run_cli, tmp_path, monkeypatch, isolated_imports):
    """A ``{call:}`` object whose class checks its leaves as it is built (the stateful PRNG of
    ``jax.experimental.random``) cannot be rebuilt around abstract values: raw JAX's
    ``jit(...).lower()`` of the step on the real object fails inside JAX the same way. It was
    "unexpected ValueError ... report it" (exit 3, stagetool blamed); it is now exit 2 naming the
    spec's line, the argument, the class and its words, before any compile, with its hint (a spec
    problem's hint was dropped on the way to the CLI)."""
    module = write(tmp_path, "vd.py", VALIDATING)
    write(tmp_path, "vd.stagetool.yaml", '''
version: 1
mesh: {axes: {data: 8}}
functions:
  step:
    target: vd.py:step
    args: ['f32[16,32]', {call: vd.py:make_draws, args: [0]}, 'f32[64,16] @ [data, null]']
''')
    monkeypatch.chdir(tmp_path)
    r = run_cli("memory", "vd.py:step", "--no-peak", check=2)
    assert "vd.stagetool.yaml:6:" in r.stderr and "draws: Draws refuses abstract values" in r.stderr, r.stderr
    assert "Draws wants a typed PRNG key" in r.stderr and "unexpected" not in r.stderr
    assert "hint: pass the arrays the object holds as the step's arguments" in r.stderr  # the SpecError's own hint
    assert "Traceback" not in r.stderr

    import importlib.util

    spec = importlib.util.spec_from_file_location("_raw_vd", module)
    raw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(raw)
    with pytest.raises(ValueError, match="Draws wants a typed PRNG key"):  # raw JAX cannot lower it either
        raw.step.lower(jnp.zeros((16, 32)), raw.make_draws(0), jnp.zeros((64, 16)))
