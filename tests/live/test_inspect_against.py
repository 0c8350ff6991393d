"""``stagetool.inspect(..., against=TARGET)``: the CLI's ``--against`` from Python. The same function
staged by the CLI with ``report --against v5e:2x4 --format json`` and by ``inspect`` on the caller's
arrays gives the same ``against`` section (every difference, each side's figure) and the same
collective row marks; a bad target is the CLI's message naming ``against=``, before any trace."""

from __future__ import annotations

import importlib.util
import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from helpers import target_devices, write

import stagetool
from stagetool.core.errors import UsageError

CODE = """\
def at_set(x, y):
    return x.at[0:3].set(y)
"""

SPEC = """\
version: 1
mesh: {axes: {data: 2, model: 4}}
functions:
  at_set:
    target: m.py:at_set
    args: ['f32[1024,2048] @ [data, model]', 'f32[3,2048]']
"""


def _args():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:8])
    return mesh, (jax.ShapeDtypeStruct((1024, 2048), jnp.float32, sharding=NamedSharding(mesh, P("data", "model"))),
                  jax.ShapeDtypeStruct((3, 2048), jnp.float32, sharding=NamedSharding(mesh, P())))


@pytest.mark.parametrize("against,says", [
    ("v5e:2x2", "stagetool.inspect: against=v5e:2x2: v5e:2x2 has 4 devices, but the mesh data=2 × model=4 has 8"),
    ("cpu", "stagetool.inspect: against=cpu: hardware 'cpu' is neither a TPU generation nor a GPU"),
    ("", "stagetool.inspect: against='': an empty target name"),
    (3, "stagetool.inspect: against=3 must be a non-empty string or None"),
])
def test_a_bad_against_is_the_clis_message_naming_the_parameter(against, says):
    mesh, args = _args()
    traced = []
    with pytest.raises(UsageError) as e:
        stagetool.inspect(lambda x, y: traced.append(1) or x.at[0:3].set(y), *args, mesh=mesh, against=against)
    assert str(e.value.message).startswith(says), e.value.message
    assert "--against" not in f"{e.value.message} {e.value.hint}" and not traced  # before any trace


@pytest.mark.slow
def test_inspect_against_gives_the_clis_against_section(run_cli, tmp_path, monkeypatch):
    target_devices("v5e:2x4")  # skips without libtpu
    write(tmp_path, "m.py", CODE)
    write(tmp_path, "m.stagetool.yaml", SPEC)
    monkeypatch.chdir(tmp_path)
    cli = run_cli("report", "--against", "v5e:2x4", "--peak", "--no-cache", "--format", "json", check=0).json()["functions"][0]
    spec = importlib.util.spec_from_file_location("m", tmp_path / "m.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    mesh, args = _args()
    report = stagetool.inspect(module.at_set, *args, mesh=mesh, against="v5e:2x4")
    from stagetool.report import Format, render

    live = json.loads(render(report, Format.json))["functions"][0]
    assert live["against"] == cli["against"]
    # the figures are the two compiles' (XLA:CPU's 2 MiB whole-row all-gather, not on XLA:TPU), as
    # tests/analysis/test_against.py checks them against raw compiles
    assert live["against"]["target"] == "v5e:2x4" and live["against"]["here"] == "XLA:CPU"
    assert {d["key"] for d in live["against"]["differences"]} >= {"temporaries per device", "FLOPs per device"}
    marks = lambda f: [(i["collective"]["kind"], i.get("against")) for i in f["collectives"]["items"]]  # noqa: E731
    assert marks(live) == marks(cli) == [("all-gather", "not on v5e:2x4")]
    # a section shown alone is the marked one too
    assert [i.against for i in report.collectives.items] == ["not on v5e:2x4"]
