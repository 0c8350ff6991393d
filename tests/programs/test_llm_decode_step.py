"""Findings of a new user's trial on an LLM decode step (jax-llm-examples' llama3 `decode_step`),
each on a small hand-written program of the same shape."""

from __future__ import annotations

import pytest
from helpers import write

from stagetool.analysis.cost import normalise_cost
from stagetool.devices import tpu_topology as topology

needs_libtpu = pytest.mark.skipif(not topology.libtpu_available(),
                                  reason="libtpu not installed: pip install -e '.[tpu]'")


def test_bytes_written_is_xlas_out_key_not_out_plus_its_elements():
    """XLA's ``out{}`` already holds a multi-output fusion's ``out{0}``, ``out{1}`` (HloCostAnalysis
    propagates the elements to the tuple's index): adding them counted those outputs twice."""
    raw = {"bytes accessed": 4096.0, "bytes accessedout{}": 1536.0, "bytes accessedout{0}": 512.0,
           "bytes accessedout{1}": 512.0, "bytes accessed0{}": 2048.0}
    rec = normalise_cost(raw, scope="per_device")
    assert rec.output_bytes_accessed == 1536.0
    # out{} absent (XLA omits a zero counter): the top-level elements, never a nested one twice
    rec = normalise_cost({"bytes accessed": 100.0, "bytes accessedout{0}": 8.0, "bytes accessedout{1}": 4.0,
                          "bytes accessedout{1,0}": 4.0}, scope="per_device")
    assert rec.output_bytes_accessed == 12.0


TWO_OUT = """\
import jax.numpy as jnp


def two_sums(x):
    return x.sum(1), (x * x).sum(1)   # one multi-output fusion on XLA:TPU
"""

TWO_OUT_SPEC = """\
version: 1
mesh: {axes: {d: 8}}
functions:
  two_sums:
    target: m.py:two_sums
    args: ['f32[1024,256] @ [d, null]']
"""


@needs_libtpu
def test_cost_on_v5e_reports_xlas_bytes_written(run_cli, tmp_path):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from stagetool.plan.target import parse_target

    write(tmp_path, "m.py", TWO_OUT)
    spec = write(tmp_path, "m.stagetool.yaml", TWO_OUT_SPEC)
    cost = run_cli("cost", "--spec", str(spec), "--topology", "v5e:2x4", "--format", "json",
                   check=0).json()["functions"][0]["cost"]["per_device"]

    topo = topology.tpu_topology(parse_target("v5e:2x4"))
    mesh = topology.topology_mesh(topo.devices, (8,), ("d",))
    x = jax.ShapeDtypeStruct((1024, 256), jnp.float32, sharding=NamedSharding(mesh, P("d", None)))
    raw = jax.jit(lambda x: (x.sum(1), (x * x).sum(1))).trace(x).lower().compile().cost_analysis()
    elements = [k for k in raw if k.startswith("bytes accessedout{") and k != "bytes accessedout{}"]
    assert elements, "the program no longer has a tuple-output instruction: the test checks nothing"
    assert cost["output_bytes_accessed"] == raw["bytes accessedout{}"]
    assert cost["output_bytes_accessed"] < raw["bytes accessedout{}"] + sum(raw[k] for k in elements)
    text = run_cli("cost", "--spec", str(spec), "--topology", "v5e:2x4", check=0).stdout
    assert "XLA's 'bytes accessedout{}'" in " ".join(text.split())


EXPLICIT_CODE = """\
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec as P, reshard

MESH = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))  # the code's own mesh, Explicit


def embed_step(table, tokens):
    x = table.at[tokens, :].get(out_sharding=P("d", None))   # EMBED
    return reshard(x.sum(-1), P())


def constrained(x):
    return jax.lax.with_sharding_constraint(x * 2, P("d"))   # CONSTRAIN
"""

EXPLICIT_SPEC = """\
version: 1
mesh: {{axes: {{d: 8}}{types}}}
functions:
  embed_step:
    target: m.py:embed_step
    args: ['f32[64,32] @ [null, null]', 'i32[16] @ [d]']
  constrained:
    target: m.py:constrained
    args: ['f32[64] @ [null]']
"""


def test_explicit_axes_code_on_auto_axes_is_exit_2_naming_the_spec_key(run_cli, tmp_path):
    m = write(tmp_path, "m.py", EXPLICIT_CODE)
    spec = write(tmp_path, "m.stagetool.yaml", EXPLICIT_SPEC.format(types=", axis_types: auto"))
    r = run_cli("shardings", "--spec", str(spec), "-f", "embed_step")
    assert r.code == 2, r.stderr
    err = " ".join(r.stderr.split())
    assert "cannot contain axis names that are of type Auto" in err  # JAX's own sentence, kept
    assert "with Auto axes" in err and "axis_types: explicit" in err  # what was staged, and the fix
    line = next(i for i, t in enumerate(m.read_text().splitlines(), 1) if "# EMBED" in t)
    assert f"m.py:{line}" in err
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("types", ["", ", axis_types: explicit"])
def test_explicit_axes_code_stages_with_axis_types_explicit_and_auto_code_is_named_the_other_way(run_cli, tmp_path,
                                                                                                  types):
    """``axis_types: explicit``, or none: the module's own mesh (Explicit) gives the axis types (issue 49)."""
    write(tmp_path, "m.py", EXPLICIT_CODE)
    spec = write(tmp_path, "m.stagetool.yaml", EXPLICIT_SPEC.format(types=types))
    doc = run_cli("shardings", "--spec", str(spec), "-f", "embed_step", "--format", "json", check=0).json()
    assert doc["functions"][0]["mesh"]["axis_types"] == "explicit"
    notes = " ".join(doc["functions"][0]["notes"])
    assert ("the spec gives no mesh.axis_types: staged with Explicit axes" in notes) == (not types), notes
    # the reverse: with_sharding_constraint is for Auto axes; on Explicit ones JAX refuses it
    r = run_cli("shardings", "--spec", str(spec), "-f", "constrained")
    err = " ".join(r.stderr.split())
    assert r.code == 2 and "with Explicit axes" in err and "axis_types: auto" in err, r.stderr


PREFETCH = """\
import jax.numpy as jnp


def mlp(x, w1, w2, w3):          # XLA:TPU prefetches the weights into on-chip memory (copy-start/done)
    for w in (w1, w2, w3):
        x = jnp.tanh(x @ w)
    return x


def tiny(a, b):                  # f32[3,5] takes whole tiles on v5e: 2,048 B, not 60
    return a * b + 1
"""

PREFETCH_SPEC = """\
version: 1
mesh: {axes: {d: 8}}
functions:
  mlp:
    target: m.py:mlp
    args: ['f32[8,256]', 'f32[256,256]', 'f32[256,256]', 'f32[256,256]']
  tiny:
    target: m.py:tiny
    args: ['f32[3,5]', 'f32[3,5]']
"""


def _raw_on_v5e(f, *shapes):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from stagetool.plan.target import parse_target

    mesh = topology.topology_mesh(topology.tpu_topology(parse_target("v5e:2x4")).devices, (8,), ("d",))
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, P())) for s in shapes]
    return jax.jit(f).trace(*args).lower().compile()


@needs_libtpu
def test_modules_bytes_add_up_to_xlas_on_v5e_with_prefetches_and_padded_tiles(run_cli, tmp_path):
    """The derived bytes counted an async copy's whole (dst, src, context) tuple on both halves (6 × the
    array where XLA:TPU counts 4 ×) and logical sizes where XLA:TPU counts whole tiles: the gap row held
    -2 × the weights per prefetch. Now it holds only XLA:TPU's own 4,608 B per copy pair."""
    import jax.numpy as jnp

    write(tmp_path, "m.py", PREFETCH)
    spec = write(tmp_path, "m.stagetool.yaml", PREFETCH_SPEC)
    doc = run_cli("modules", "--spec", str(spec), "--topology", "v5e:2x4", "--format", "json", check=0).json()
    mods = {f["name"]: f["modules"] for f in doc["functions"]}

    def mlp(x, w1, w2, w3):
        for w in (w1, w2, w3):
            x = jnp.tanh(x @ w)
        return x

    compiled = _raw_on_v5e(mlp, (8, 256), (256, 256), (256, 256), (256, 256))
    xla = compiled.cost_analysis()["bytes accessed"]
    pairs = compiled.as_text().count(" copy-start(")
    assert pairs >= 1, "no prefetch in the program any more: the test checks nothing"
    rows = mods["mlp"]["rows"]
    residual = sum(r["bytes_accessed"] for r in rows if r["phase"] == "difference")
    assert mods["mlp"]["xla_bytes_accessed"] == xla
    assert sum(r["bytes_accessed"] for r in rows) == pytest.approx(xla)
    assert 0 <= residual <= 4608 * pairs  # before: -2 × 256 KiB per prefetch
    assert any(r["phase"] == "compiler-inserted" and r["bytes_accessed"] > 0 for r in rows)
    assert not any(r["phase"] == "none" for r in rows)

    tiny = _raw_on_v5e(lambda a, b: a * b + 1, (3, 5), (3, 5)).cost_analysis()["bytes accessed"]
    assert tiny == 3 * 2048  # two f32[3,5] read and one written, each padded to whole tiles: 2,048 B, not 60
    assert mods["tiny"]["derived_bytes_accessed"] == tiny
    assert not any(r["phase"] == "difference" for r in mods["tiny"]["rows"])


HELPER = """\
import jax.numpy as jnp


def einsum(spec, x, w):                   # the shared helper every projection calls
    return jnp.einsum(spec, x, w)         # HELPER


def step(x, w_up, w_down, w_out):
    h = einsum("bd,df->bf", x, w_up)      # UP
    y = einsum("bf,fd->bd", h, w_down)    # DOWN: contracts f, split over model: an all-reduce
    return einsum("bd,de->be", y, w_out)  # OUT: contracts d, split over model: an all-reduce
"""

HELPER_SPEC = """\
version: 1
mesh: {axes: {data: 2, model: 4}}
functions:
  step:
    target: m.py:step
    args: ['f32[64,256] @ [data, null]', 'f32[256,512] @ [null, model]', 'f32[512,256] @ [model, null]',
           'f32[256,128] @ [model, null]']
"""


def test_longest_instructions_show_the_helper_callers_as_collectives_do(run_cli, tmp_path):
    m = write(tmp_path, "m.py", HELPER)
    spec = write(tmp_path, "m.stagetool.yaml", HELPER_SPEC)
    lines = {tag: i for i, t in enumerate(m.read_text().splitlines(), 1) for tag in ("HELPER", "DOWN", "OUT")
             if f"# {tag}" in t}
    cost = run_cli("cost", "--spec", str(spec), "--chip", "tpu-v5e", "--format", "json", check=0).json()
    top = {i["name"]: i for i in cost["functions"][0]["cost"]["step_time"]["top"]}
    coll = run_cli("collectives", "--spec", str(spec), "--format", "json", check=0).json()
    items = coll["functions"][0]["collectives"]["items"]
    reduces = [c for c in items if c["collective"]["kind"] == "all-reduce"]
    assert len(reduces) >= 2
    for c in reduces:  # the same op, the same chain, in both tables
        name = c["collective"]["name"]
        assert c["source"].endswith(f"m.py:{lines['HELPER']}")
        assert [v.rsplit(":", 1)[1] for v in c["via"]] in ([str(lines["DOWN"])], [str(lines["OUT"])])
        assert top[name]["source"] == c["source"] and top[name]["via"] == c["via"]
    text = " ".join(run_cli("cost", "--spec", str(spec), "--chip", "tpu-v5e", check=0).stdout.split())
    assert f"m.py:{lines['HELPER']} ← m.py:{lines['DOWN']}" in text
    assert f"m.py:{lines['HELPER']} ← m.py:{lines['OUT']}" in text


BF16 = """\
import jax.numpy as jnp


def mm(x, w):
    return jnp.tanh(x @ w)   # bf16: XLA:CPU computes it in f32, and a note says how to get the TPU's answer
"""

BF16_SPEC = """\
version: 1
mesh: {axes: {data: 2, model: 4}}
functions:
  mm:
    target: m.py:mm
    args: ['bf16[64,128] @ [data, null]', 'bf16[128,256] @ [null, model]']
"""


def test_a_note_keeps_its_command_whole_at_any_width(run_cli, tmp_path, monkeypatch):
    write(tmp_path, "m.py", BF16)
    spec = write(tmp_path, "m.stagetool.yaml", BF16_SPEC)
    command = "stagetool cost m.py:mm --topology v5e:2x4"
    doc = run_cli("cost", "--spec", str(spec), "--format", "json", check=0).json()
    notes = " ".join(n for n in doc["functions"][0]["notes"])
    assert command in notes  # the note the text wraps
    for width in range(60, 130, 3):
        monkeypatch.setenv("COLUMNS", str(width))
        out = run_cli("cost", "--spec", str(spec), check=0).stdout
        lines = [line for line in out.splitlines() if "XLA:CPU computes bf16" in line or "v5e:2x4" in line]
        assert any(command in line for line in out.splitlines()), f"width {width}:\n" + "\n".join(lines)
        # the rest of the note still wraps at the width (no line of it longer than the table's width)
        assert "the accelerator's answer" in " ".join(out.split())


OWN_EXPLICIT = """\
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

MESH = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))  # built at import, Explicit


def init():
    return jax.jit(lambda: jnp.zeros((64, 32)), out_shardings=NamedSharding(MESH, P("d", None)))()


def step(w):
    return (w * 2).sum(0)
"""


@pytest.mark.parametrize("types", ["", ", axis_types: explicit"])
def test_an_init_on_the_codes_explicit_mesh_says_the_axis_types_differ(run_cli, tmp_path, types):
    write(tmp_path, "e.py", OWN_EXPLICIT)
    spec = write(tmp_path, "e.stagetool.yaml", "version: 1\nmesh: {axes: {d: 8}" + types + "}\n"
                 "functions:\n  step:\n    target: e.py:step\n    args: [{init: e.py:init}]\n")
    f = run_cli("shardings", "--spec", str(spec), "--format", "json", check=0).json()["functions"][0]
    notes = " ".join(f["notes"])
    if types:  # the staged mesh is the code's: nothing to say
        assert "axis" not in notes and f["mesh"]["axis_types"] == "explicit"
    else:  # the module's own mesh gives the axis types (issue 49), and a note says so
        assert f["mesh"]["axis_types"] == "explicit"
        assert "with Explicit axes (e.py:5) and the spec gives no mesh.axis_types: staged with Explicit axes" in notes
