"""A constraint's origin is the user frame that called the wrapper (issue 30, item 5).

MaxText applies every activation constraint through one helper of its own project
(``maybe_shard_with_logical``, around its saved ``jax.lax.with_sharding_constraint``), which every
model file calls, some through a layer (``DenseGeneral``) that passes its own ``out_axes`` on.
The helper's line names no one constraint: each constraint's origin (the collectives' causes,
``why``, the sharding origins) must be its own call site. A shared line that writes its sharding
itself stays the origin; a library's wrapper (Flax's ``nn.with_logical_constraint``) names its caller.
"""

from __future__ import annotations

import pytest
from helpers import write

SHARDING = '''
"""The project's one constraint helper: a thin wrapper every model file calls."""
import jax
from jax.sharding import PartitionSpec as P

RULES = {"batch": "data", "embed": None, "mlp": "model"}
_original = jax.lax.with_sharding_constraint


def maybe_shard_with_logical(x, logical_axes):
    spec = P(*(RULES.get(a) for a in logical_axes))
    return _original(x, spec)
'''

LAYERS = '''
import jax
from jax.sharding import PartitionSpec as P

from mt_sharding import maybe_shard_with_logical


def dense(x, w, out_axes):
    return maybe_shard_with_logical(x @ w, out_axes)


def norm(x):
    return jax.lax.with_sharding_constraint(x / (1.0 + jax.numpy.abs(x)), P("data", None))
'''

MODEL = '''
import jax
import jax.numpy as jnp

from mt_layers import dense, norm
from mt_sharding import maybe_shard_with_logical


def step(w1, w2, w3, x):
    h = maybe_shard_with_logical(x @ w1, ("batch", "mlp"))
    h = jax.nn.relu(h)
    y = maybe_shard_with_logical(h @ w2, ("batch", "embed"))
    z = maybe_shard_with_logical(y * 2.0, ("embed", "mlp"))
    a = dense(norm(z), w3, ("batch", "mlp"))
    b = dense(norm(y), w3, ("embed", "mlp"))
    return jnp.sum(a) + jnp.sum(b)
'''

SPEC = '''
version: 1
mesh:
  axes: {data: 2, model: 4}
functions:
  step:
    target: mt_model.py:step
    args: ['f32[256,512] @ [model, data]', 'f32[512,256] @ [data, model]', 'f32[256,256] @ [model, null]',
           'f32[64,256] @ [model, null]']
'''


def _line_of(path, text: str) -> int:
    return next(i for i, t in enumerate(path.read_text().splitlines(), 1) if text in t)


def test_each_constraint_names_its_own_call_site(run_cli, tmp_path, monkeypatch):
    write(tmp_path, "mt_sharding.py", SHARDING)
    layers = write(tmp_path, "mt_layers.py", LAYERS)
    model = write(tmp_path, "mt_model.py", MODEL)
    write(tmp_path, "mt_model.stagetool.yaml", SPEC)
    monkeypatch.chdir(tmp_path)
    at = {name: f"mt_model.py:{_line_of(model, text)}" for name, text in (
        ("h", "h = maybe_shard"), ("y", "y = maybe_shard"), ("z", "z = maybe_shard"),
        ("a", "a = dense("), ("b", "b = dense("))}
    norm_line = "mt_layers.py:" + str(_line_of(layers, 'P("data", None)'))

    doc = run_cli("collectives", "mt_model.py:step", "--format", "json", check=0).json()
    section = doc["functions"][0]["collectives"]
    assert section["causes_unavailable"] is None
    constraints = {(c["line"], c["sharding"]) for c in section["origins"]["constraints"]}
    # the three call sites of the helper, each with the sharding it asked for; the two calls through
    # dense() (which passes its out_axes on) at their own lines; norm() writes its own sharding: its line
    assert constraints == {(at["h"], "P('data', 'model')"), (at["y"], "P('data', None)"),
                           (at["z"], "P(None, 'model')"), (at["a"], "P('data', 'model')"),
                           (at["b"], "P(None, 'model')"), (norm_line, "P('data', None)")}

    causes = [o for item in section["items"] if item.get("cause") for o in item["cause"]["origins"]
              if o["kind"] == "constraint"]
    assert causes and {o["source"] for o in causes} <= {*at.values(), norm_line}
    assert not [o for o in causes if "mt_sharding.py" in o["source"]]

    helper = "mt_sharding.py:" + str(_line_of(tmp_path / "mt_sharding.py", "return _original"))
    dense = "mt_layers.py:" + str(_line_of(layers, "return maybe_shard"))
    via = {c["line"]: c.get("via") for c in section["origins"]["constraints"]}
    assert via == {at["h"]: [helper], at["y"]: [helper], at["z"]: [helper], at["a"]: [helper, dense],
                   at["b"]: [helper, dense], norm_line: None}  # the wrappers walked past, innermost first

    text = run_cli("why", "mt_model.py:step", "--line", at["y"], check=0).stdout
    assert f"sharding constraint P('data', None) at {at['y']} (through {helper})" in text
    # the helper's own line: every constraint reached through it, each at its call site
    text = run_cli("why", "mt_model.py:step", "--line", helper, check=0).stdout
    for name in ("h", "y", "z", "a", "b"):
        assert f" at {at[name]} (through {helper}" in text
    assert f"sharding constraint P('data', None) at {norm_line}" not in text  # not reached through it


def test_a_library_wrapper_names_its_caller(run_cli, tmp_path, monkeypatch):
    """Flax's nn.with_logical_constraint is a library's: its caller's line is the origin."""
    pytest.importorskip("flax.linen")
    model = write(tmp_path, "lx.py", '''
        import jax.numpy as jnp
        import flax.linen as nn

        RULES = (("batch", "data"), ("mlp", "model"))


        def step(w1, w2, x):
            h = nn.with_logical_constraint(x @ w1, ("batch", "mlp"), rules=RULES)
            y = nn.with_logical_constraint(h @ w2, ("batch", None), rules=RULES)
            return jnp.sum(y)
        ''')
    write(tmp_path, "lx.stagetool.yaml", SPEC.replace("mt_model.py", "lx.py").replace(
        ", 'f32[256,256] @ [model, null]'", ""))
    monkeypatch.chdir(tmp_path)
    doc = run_cli("collectives", "lx.py:step", "--format", "json", check=0).json()
    lines = [c["line"] for c in doc["functions"][0]["collectives"]["origins"]["constraints"]]
    assert lines == [f"lx.py:{_line_of(model, 'h = nn.')}", f"lx.py:{_line_of(model, 'y = nn.')}"]


def test_forwards_parameter_reads_the_call_on_the_line(tmp_path):
    from stagetool.analysis.causes import forwards_parameter

    f = write(tmp_path, "fw.py", '''
        import jax
        from jax.sharding import PartitionSpec as P


        def thin(x, *axes):
            return jax.lax.with_sharding_constraint(x, P(*axes))


        class Dense:
            def __call__(self, x, w):
                return thin(x @ w, *self.out_axes)


        def fixed(x):
            return jax.lax.with_sharding_constraint(x, P("data", None))


        def multi(x, spec):
            return jax.lax.with_sharding_constraint(
                x,
                spec)


        def local(x, axes):
            spec = P(*axes)
            y = x * 2
            return jax.lax.with_sharding_constraint(y, spec)


        def local_fixed(x):
            spec = P("data")
            y = x * 2
            return jax.lax.with_sharding_constraint(y, spec)
        ''')
    lines = f.read_text().splitlines()
    where = lambda text: next(i for i, t in enumerate(lines, 1) if text in t)  # noqa: E731
    assert forwards_parameter(str(f), where("P(*axes)"))
    assert forwards_parameter(str(f), where("*self.out_axes"))
    assert not forwards_parameter(str(f), where('P("data", None)'))
    x_line = next(i for i, t in enumerate(lines, 1) if t.strip() == "x,")  # a call over three lines: any of them
    assert forwards_parameter(str(f), x_line) and forwards_parameter(str(f), x_line + 1)
    assert forwards_parameter(str(f), where("(y, spec)")) and not forwards_parameter(str(f), where("(y, spec)") + 5)
    assert not forwards_parameter(str(f), where("import jax")) and not forwards_parameter(str(tmp_path / "no.py"), 3)
