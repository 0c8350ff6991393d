"""Why each collective is there (issue 22), on hand-worked small programs through the real CLI.

The three-line program of the issue (``h = tanh(x @ w1); h = wsc(h, P('data', None)); h @ w2``) on a
2×4 ``data × model`` mesh, worked by hand:

* ``x @ w1``: x is ``P('data', None)``, w1 ``P(None, 'model')``: no conflict; the result is
  ``P('data', 'model')`` (``model`` from w1, ``data`` from the constraint, propagated backwards).
* the constraint asks for ``P('data', None)``: ``tanh``'s ``model`` axis (from w1) must go → an
  all-gather over ``model``, caused by the constraint (its line) and by w1 (its spec line);
* ``h @ w2``: w2 is sharded over ``model`` along the contracted dimension, h is not (it is sliced
  locally) → each device sums a part → an all-reduce over ``model``, caused by w2's spec line.

The FSDP layer ``tanh(x @ w)``, x ``P('data', None)`` and w ``P('data', None)`` on an 8-device
``data`` mesh: ``data`` shards x's batch dimension and w's contracted one; one op cannot split both →
w is all-gathered, caused by w's sharding (its spec line).

The kinds and axes of the collectives are checked against the module JAX compiles for the same
function; the causes against the hand-worked answers.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import CAUSES_MODEL, CAUSES_SPEC, JAXLIB_0_12_METADATA, run_subprocess, write

FSDP_SPEC = """\
version: 1
mesh:
  axes: {data: 8}
functions:
  fsdp:
    target: model.py:fsdp
    args:
      - 'f32[64,256] @ [data, null]'
      - 'f32[256,512] @ [data, null]'
"""


def _compiled_kinds(fn, mesh, *args) -> list[tuple[str, int]]:
    """(kind, group size) of each collective in the module JAX compiles, in text order."""
    shaped = [jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec)) for shape, spec in args]
    text = jax.jit(fn).lower(*shaped).compile().as_text()
    out = []
    for m in re.finditer(r"= \S+ (all-gather|all-reduce|reduce-scatter|all-to-all)\(.*?replica_groups=(\S+)", text):
        out.append(m.group(1))
    return out


def _origins(cause: dict) -> set[tuple]:
    return {(o["axis"], o["kind"], o["leaf"], o["source"].rsplit("/", 1)[-1] if o["source"] else None, o["how"])
            for o in cause["origins"]}


@pytest.mark.jax_version("<0.12", reason=JAXLIB_0_12_METADATA)
def test_three_line_program(tmp_path, monkeypatch, run_cli):
    write(tmp_path, "model.py", CAUSES_MODEL)
    write(tmp_path, "model.stagetool.yaml", CAUSES_SPEC)
    monkeypatch.chdir(tmp_path)
    doc = run_cli("collectives", "--format", "json", check=0).json()
    c = doc["functions"][0]["collectives"]
    assert c["causes_unavailable"] is None
    items = c["items"]
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)

    def three(x, w1, w2):
        h = jnp.tanh(x @ w1)
        h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P("data", None)))
        return h @ w2

    assert [x["collective"]["kind"] for x in items] == _compiled_kinds(
        three, mesh, ((16, 32), P("data", None)), ((32, 64), P(None, "model")), ((64, 32), P("model", None)))
    gather, reduce = items
    assert gather["collective"]["kind"] == "all-gather" and gather["collective"]["mesh_axes"] == ["model"]
    g = gather["cause"]
    assert g["op"] == "sharding_constraint" and g["line"].endswith("model.py:8")
    assert g["operands"][0]["name"] == "tanh at model.py:7" and g["operands"][0]["sharding"] == "P('data', 'model')"
    assert g["result"]["sharding"] == "P('data', None)"
    assert _origins(g) == {("model", "constraint", None, "model.py:8", None),
                           ("model", "input", "w1", "model.stagetool.yaml:9:9", "spec")}
    assert "all-gather of tanh at model.py:7 over `model`" in g["reason"]

    assert reduce["collective"]["kind"] == "all-reduce" and reduce["collective"]["mesh_axes"] == ["model"]
    r = reduce["cause"]
    assert r["op"] == "dot_general" and r["line"].endswith("model.py:9")
    assert [o["name"] for o in r["operands"]] == ["the constrained value at model.py:8", "w2"]
    assert [o["sharding"] for o in r["operands"]] == ["P('data', None)", "P('model', None)"]
    assert _origins(r) == {("model", "input", "w2", "model.stagetool.yaml:10:9", "spec")}
    assert r["reason"].startswith("contraction over a dimension of 64 split over `model`: w2 is sharded on it")
    assert r["reason"].endswith("the partial results are all-reduced")

    text = run_cli("collectives", check=0).stdout
    assert "why each collective is there" in text
    assert "from w2 (spec at model.stagetool.yaml:10)" in text
    md = run_cli("collectives", "--format", "markdown", check=0).stdout
    assert "#### Why each collective is there" in md and "— from the sharding constraint at model.py:8" in md


@pytest.mark.jax_version("<0.12", reason=JAXLIB_0_12_METADATA)
def test_fsdp_all_gather_comes_from_the_parameter(tmp_path, monkeypatch, run_cli):
    write(tmp_path, "model.py", CAUSES_MODEL)
    write(tmp_path, "model.stagetool.yaml", FSDP_SPEC)
    monkeypatch.chdir(tmp_path)
    doc = run_cli("collectives", "--format", "json", check=0).json()
    (item,) = doc["functions"][0]["collectives"]["items"]
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    assert _compiled_kinds(lambda x, w: jnp.tanh(x @ w), mesh, ((64, 256), P("data", None)),
                           ((256, 512), P("data", None))) == ["all-gather"]
    assert item["collective"]["kind"] == "all-gather"
    cause = item["cause"]
    assert cause["op"] == "dot_general" and cause["line"].endswith("model.py:13")
    assert cause["reason"].endswith("all-gather of w over `data`")
    # both shardings meet at this op: w's (the one gathered) and x's (the one kept)
    assert _origins(cause) == {("data", "input", "w", "model.stagetool.yaml:9:9", "spec"),
                               ("data", "input", "x", "model.stagetool.yaml:8:9", "spec")}
    assert cause["origins"][0]["leaf"] == "w"  # the gathered side first


def test_unfaithful_propagation_is_silent():
    """Where the rerun propagation and the compiled shardings differ, no cause is given."""
    from stagetool.analysis.causes import unfaithful_reason
    from stagetool.analysis.shardings import LeafReport
    from stagetool.core.sharding import Sharding
    from stagetool.facts import Propagation, ValueSharding

    def leaf(path, compiled, parameter):
        return LeafReport(path, (8, 4), "float32", Sharding("spec", (None, None)), compiled, False, (4, 4), 128, 64,
                          parameter=parameter)

    prop = Propagation((ValueSharding((("data",), ())),), ("x",), (ValueSharding((("data",), ())),), ())
    same = leaf("x", Sharding("spec", ("data", None)), 0)
    out = leaf("out", Sharding("spec", ("data",)), None)
    assert unfaithful_reason(prop, [same], [out]) is None
    other = leaf("x", Sharding("spec", (None, "data")), 0)
    why = unfaithful_reason(prop, [other], [out])
    assert "input x P('data', None)" in why and "unavailable" in why
    assert "unavailable" in unfaithful_reason(prop, [same], [leaf("out", Sharding("spec", ()), None)])
    # more results than outputs, none of them a Ref write-back: the user is told what they are
    two = Propagation(prop.inputs, prop.input_names, prop.outputs * 2, ())
    why = unfaithful_reason(two, [same], [out])
    assert why.startswith("the lowered module has 1 results more than the function's 1 output leaves: a function "
                          "given jax.Ref arguments also returns each Ref's new value (a Ref write-back)")
    assert unfaithful_reason(two, [same], [out, dataclasses.replace(out, path="x", ref_write_back=True)]) is None


KEYED = """\
import jax


def dropout(w, x, key):
    h = x @ w
    h = h * jax.random.bernoulli(key, 0.9, h.shape)
    return h.sum()
"""


def test_a_typed_prng_key_input_keeps_the_causes(tmp_path, monkeypatch, run_cli):
    """A typed key ``key<fry>[]`` is a ``u32[2]`` in the lowered module: Shardy's rerun says ``P(None)``
    for it, the compiled program ``P()`` for the key — the same sharding (``Sharding.is_equivalent_to``
    over the key's rank), so the causes are given. Worked by hand: ``h.sum()`` reduces the `model`
    dimension (w's columns) and the `data` one (x's rows) → one all-reduce per axis, each from its
    leaf's spec line."""
    write(tmp_path, "keyed.py", KEYED)
    write(tmp_path, "keyed.stagetool.yaml", CAUSES_SPEC.replace("three:", "dropout:").replace("model.py:three", "keyed.py:dropout")
          .replace("      - 'f32[16,32] @ [data, null]'\n      - 'f32[32,64] @ [null, model]'\n"
                   "      - 'f32[64,32] @ [model, null]'\n",
                   "      - 'f32[64,128] @ [null, model]'\n      - 'f32[32,64] @ [data, null]'\n"
                   "      - 'key<fry>[]'\n"))
    monkeypatch.chdir(tmp_path)
    c = run_cli("collectives", "--format", "json", check=0).json()["functions"][0]["collectives"]
    assert c["causes_unavailable"] is None
    got = {(tuple(x["collective"]["mesh_axes"]), x["collective"]["kind"]):
           {(o["leaf"], o["how"]) for o in x["cause"]["origins"]} for x in c["items"]}
    assert got == {(("model",), "all-reduce"): {("w", "spec")}, (("data",), "all-reduce"): {("x", "spec")}}


def test_equivalent_shardings_are_the_same_and_a_difference_is_named_not_guessed():
    """``P('data', None)`` and ``P('data')`` are one sharding; a leaf whose lowered rank is larger (a
    typed key's implementation dimension) compares over its unsplit trailing dimensions too; where the
    shardings do differ, the message names the leaf and both shardings and blames no partitioner."""
    from stagetool.analysis.causes import unfaithful_reason
    from stagetool.analysis.shardings import LeafReport
    from stagetool.core.sharding import Sharding
    from stagetool.facts import Propagation, ValueSharding

    def leaf(path, shape, compiled, parameter):
        return LeafReport(path, shape, "float32", Sharding("spec", (None,) * len(shape)), compiled, False, shape,
                          128, 128, parameter=parameter)

    key = leaf("key", (), Sharding("spec", ()), 0)
    x = leaf("x", (8, 4), Sharding("spec", ("data",)), 1)
    out = leaf("out", (), Sharding("spec", ()), None)
    prop = Propagation((ValueSharding(((),)), ValueSharding((("data",), ()))), ("key", "x"), (ValueSharding(()),), ())
    assert unfaithful_reason(prop, [key, x], [out]) is None
    split_key = Propagation((ValueSharding((("data",),)), ValueSharding((("data",), ()))), ("key", "x"),
                            (ValueSharding(()),), ())
    why = unfaithful_reason(split_key, [key, x], [out])
    assert why == ("Shardy's propagation rerun here gives input key P('data'), the compiled program P(): the rerun is "
                   "not the propagation the compile used, so the explanation is unavailable for this function")


LINEN = """\
import flax.linen as nn
import jax
import jax.numpy as jnp

RULES = (("batch", "data"), ("embed", None), ("mlp", "model"))


class Up(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        return nn.Dense(64, use_bias=False, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)


def init(key):
    return Up().init(key, jnp.zeros((16, 32)))["params"]


def grad(params, x):
    return jax.grad(lambda p: (Up().apply({"params": p}, x) ** 2).sum())(params)
"""

LINEN_SPEC = """\
version: 1
mesh:
  axes: {data: 2, model: 4}
logical_axis_rules: linen.py:RULES
functions:
  grad:
    target: linen.py:grad
    args:
      - init: linen.py:init
        init_args: [key(0)]
      - 'f32[16,32] @ [data, null]'
"""


def test_flax_unboxing_constraint_is_the_parameters_annotation(tmp_path, monkeypatch, run_cli):
    """Flax Linen applies a sharding constraint when it unboxes a ``with_logical_partitioning``
    parameter (``LogicallyPartitioned.unbox``, at the ``nn.Dense(...)`` call, forward and again
    transposed in the grad). It asks for the parameter's own declared sharding (``P(None, 'model')``:
    ``embed`` → None, ``mlp`` → model), so the axes it carries are the parameter's model annotation:
    no origin names a constraint at linen.py:13, and the snapshot records no constraint there (a rule
    edit is then one cause, not one per ``nn.Dense`` line)."""
    write(tmp_path, "linen.py", LINEN)
    write(tmp_path, "linen.stagetool.yaml", LINEN_SPEC)
    monkeypatch.chdir(tmp_path)
    c = run_cli("collectives", "--format", "json", check=0).json()["functions"][0]["collectives"]
    assert c["causes_unavailable"] is None and c["items"]
    # the kernel's gradient: x^T @ dy contracts the batch (`data`) → one all-reduce; dy and the result
    # carry `model`, which only the kernel's annotation (through Flax's unboxing constraint) gives them
    (item,) = c["items"]
    cause = item["cause"]
    assert item["collective"]["kind"] == "all-reduce" and item["collective"]["mesh_axes"] == ["data"]
    tensors = [*cause["operands"], cause["result"]]
    origins = {(o["axis"], o["kind"], o["leaf"], o["how"]) for t in tensors for o in t["origins"]}
    assert origins == {("data", "input", "x", "spec"), ("model", "input", "params/Dense_0/kernel/value", "model")}
    assert cause["result"]["sharding"] == "P('model', None)"
    run_cli("snapshot", "-o", "base.json", check=0)
    import json

    (entry,) = json.loads((tmp_path / "base.json").read_text())["functions"].values()
    assert entry["constraints"] == []


def test_the_reason_says_the_collectives_kind_and_every_axis():
    """A gather whose table is split over `model` along the gathered (reduction) dimension: XLA may sum
    masked partial lookups (an all-reduce) or gather the table (an all-gather); the reason says which
    happened, not "partial results are all-reduced" for an all-gather. A sum over a dimension split
    over `data` × `model` is all-reduced over both, and the reason names both."""
    from types import SimpleNamespace

    from stagetool.analysis.causes import cause_of
    from stagetool.analysis.shardings import LeafReport
    from stagetool.core.sharding import Sharding
    from stagetool.hlo.parser import SourceFrame
    from stagetool.facts import Operand, Propagation, PropagatedOp, ShardingRule, ValueSharding

    def leaf(path, shape, dims, parameter):
        s = Sharding("spec", dims)
        return LeafReport(path, shape, "float32", s, s, False, shape, 4, 4, parameter=parameter)

    at = (SourceFrame("/w/m.py", 5, "f", 12),)
    table = ValueSharding((("model",), ()), (("model", "input: 0"),))
    gather = PropagatedOp(0, "stablehlo.gather", "jit(f)/gather", at, (Operand(table, input=0), Operand(None, input=1)),
                          (None,), ShardingRule((("v", "e"), ("b",)), (("b", "e"),), ("v",), (("v", 1024),)))
    prop = Propagation((table, None), ("table", "ids"), (None,), (gather,))
    inputs = [leaf("table", (1024, 64), ("model", None), 0), leaf("ids", (16,), (None,), 1)]
    outputs = [leaf("out", (16, 64), (None, None), None)]

    def collective(kind, axes, op_name):
        return SimpleNamespace(kind=kind, mesh_axes=axes, source=at[0], source_chain=at, op_name=op_name, nearest=None,
                               network=None)

    gathered = cause_of(collective("all-gather", ("model",), "jit(f)/gather"), prop, inputs, outputs)
    assert gathered.reason == ("reduction over a dimension of 1024 split over `model`: table is sharded on it → "
                               "all-gather of table over `model` instead of summing a part on each device")
    summed = cause_of(collective("all-reduce", ("model",), "jit(f)/gather"), prop, inputs, outputs)
    assert summed.reason.endswith("→ each device sums a part; the partial results are all-reduced")

    # an operand made wholly inside a library (here JAX's own file) is named without a line
    lib = (SourceFrame(jax.numpy.__file__, 1, "f", 1),)
    const = PropagatedOp(0, "stablehlo.constant", "jit(f)/constant", lib, (), (None,), users=(1,))
    gather2 = dataclasses.replace(gather, index=1, operands=(Operand(table, input=0), Operand(None, producer=0)))
    named = cause_of(collective("all-gather", ("model",), "jit(f)/gather"), Propagation((table,), ("table",), (None,),
                                                                                         (const, gather2)),
                     inputs[:1], outputs)
    assert [t.name for t in named.operands] == ["table", "constant"]

    x = ValueSharding((("data", "model"), ()), (("data", "input: 0"), ("model", "input: 0")))
    reduce = PropagatedOp(0, "stablehlo.reduce", "jit(f)/reduce_sum", at, (Operand(x, input=0),), (None,),
                          ShardingRule((("i", "j"),), ((),), ("i", "j"), (("i", 64), ("j", 32))))
    prop = Propagation((x,), ("x",), (None,), (reduce,))
    both = cause_of(collective("all-reduce", ("data", "model"), "jit(f)/reduce_sum"), prop,
                    [leaf("x", (64, 32), (("data", "model"), None), 0)], [leaf("out", (), (), None)])
    assert both.reason == ("reduction over a dimension of 64 split over `data` × `model`: x is sharded on it → each "
                           "device sums a part; the partial results are all-reduced")
    assert {(o.axis, o.leaf) for o in both.origins} == {("data", "x"), ("model", "x")}


def test_an_all_reduce_over_two_axes_is_explained_over_both(tmp_path, monkeypatch, run_cli):
    """``x.sum()`` with x's rows split over `data` × `model`: one all-reduce over both axes (as JAX
    compiles it); the reason names both, the text gives x's spec line once."""
    write(tmp_path, "t.py", "def total(x):\n    return x.sum()\n")
    write(tmp_path, "t.stagetool.yaml", "version: 1\nmesh:\n  axes: {data: 2, model: 4}\nfunctions:\n  total:\n"
                                         "    target: t.py:total\n    args:\n      - 'f32[64,32] @ [[data, model], null]'\n")
    monkeypatch.chdir(tmp_path)
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    assert _compiled_kinds(lambda x: x.sum(), mesh, ((64, 32), P(("data", "model"), None))) == ["all-reduce"]
    (item,) = run_cli("collectives", "--format", "json", check=0).json()["functions"][0]["collectives"]["items"]
    assert item["collective"]["mesh_axes"] == ["data", "model"]
    assert item["cause"]["reason"] == ("reduction over a dimension of 64 split over `data` × `model`: x is sharded on "
                                       "it → each device sums a part; the partial results are all-reduced")
    text = run_cli("collectives", check=0).stdout
    assert text.count("from x (spec at t.stagetool.yaml:8)") == 1 and "); x (spec" not in text


def test_an_output_pinned_by_out_shardings_is_its_own_origin(tmp_path, monkeypatch, run_cli):
    """``out_shardings: [null, data]``: the result's `data` axis is the one the spec declares for it
    (Shardy: ``self`` on the result), recorded as ``output out``, not as an origin nobody named."""
    write(tmp_path, "model.py", CAUSES_MODEL)
    write(tmp_path, "model.stagetool.yaml", FSDP_SPEC + "    out_shardings: [null, data]\n")
    monkeypatch.chdir(tmp_path)
    run_cli("snapshot", "-o", "base.json", check=0)
    import json

    (entry,) = json.loads((tmp_path / "base.json").read_text())["functions"].values()
    ((out),) = entry["outputs"]
    assert out["sharding"] == "P(None, 'data')" and out["origins"] == ["output out"]


def _why(run_cli, *args: str) -> dict:
    return run_cli("why", *args, "--format", "json", check=0).json()["functions"][0]["why"]


@pytest.mark.jax_version("<0.12", reason=JAXLIB_0_12_METADATA)
def test_why_on_the_three_line_program(tmp_path, monkeypatch, run_cli):
    """Worked by hand (module docstring): w1's `model` axis reaches the constraint (all-gather 1), w2's
    contracted `model` axis makes the partial sums (all-reduce 2), the constraint's line is model.py:8."""
    write(tmp_path, "model.py", CAUSES_MODEL)
    write(tmp_path, "model.stagetool.yaml", CAUSES_SPEC)
    monkeypatch.chdir(tmp_path)
    w1 = _why(run_cli, "--leaf", "w1")
    assert w1["found"] == ["input w1: declared P(None, 'model') (the spec at model.stagetool.yaml:9); "
                           "compiled P(None, 'model')"]
    assert [(n, head) for n, head, _ in w1["collectives"]] == [(1, "all-gather over model at model.py:7")]
    w2 = _why(run_cli, "--leaf", "w2")
    assert [(n, head) for n, head, _ in w2["collectives"]] == [(2, "all-reduce over model at model.py:9")]
    line = _why(run_cli, "--line", "model.py:8")
    assert line["found"] == ["sharding constraint P('data', None) at model.py:8"]
    assert [n for n, _, _ in line["collectives"]] == [1]
    assert line["outputs"] == ["out"]  # the result's `data` axis comes from the constraint
    c1 = _why(run_cli, "--collective", "1")
    assert c1["found"][:3] == ["all-gather over model at model.py:7", "op sharding_constraint at model.py:8",
                               "operand tanh at model.py:7: P('data', 'model')"]
    assert {(o["axis"], o["kind"], o["leaf"]) for o in c1["origins"]} == {("model", "input", "w1"),
                                                                           ("data", "constraint", None)}
    assert c1["reason"].endswith("all-gather of tanh at model.py:7 over `model`")
    text = run_cli("why", "--collective", "2", check=0).stdout
    assert "because: contraction over a dimension of 64 split over `model`" in text
    md = run_cli("why", "--collective", "2", "--format", "markdown", check=0).stdout
    assert "### Why: collective 2" in md and "- because: contraction over" in md
    run_cli("why", "--collective", "2", "--format", "html", "-o", "why.html", check=0)
    assert '<ul class="why"><li class="">all-reduce over model at model.py:9</li>' in (tmp_path / "why.html").read_text()


@pytest.mark.jax_version("<0.12", reason=JAXLIB_0_12_METADATA)
def test_why_on_an_fsdp_layer(tmp_path, monkeypatch, run_cli):
    write(tmp_path, "model.py", CAUSES_MODEL)
    write(tmp_path, "model.stagetool.yaml", FSDP_SPEC)
    monkeypatch.chdir(tmp_path)
    w = _why(run_cli, "--leaf", "w")
    ((n, head, reason),) = w["collectives"]
    assert (n, head) == (1, "all-gather over data at model.py:13") and reason.endswith("all-gather of w over `data`")
    c = _why(run_cli, "--collective", "1")
    assert c["found"][2:4] == ["operand x: P('data', None)", "operand w: P('data', None)"]


def test_why_bad_questions_exit_2_before_staging(tmp_path, monkeypatch, run_cli):
    write(tmp_path, "model.py", CAUSES_MODEL)
    write(tmp_path, "model.stagetool.yaml", CAUSES_SPEC)
    monkeypatch.chdir(tmp_path)
    assert "exactly one of --leaf, --line, --collective" in run_cli("why", check=2).stderr
    assert "exactly one" in run_cli("why", "--leaf", "w1", "--collective", "1", check=2).stderr
    assert "FILE:LINE" in run_cli("why", "--line", "model.py", check=2).stderr
    assert "numbered from 1" in run_cli("why", "--collective", "0", check=2).stderr
    assert "--leaf 'w9' names no input or output leaf of three" in run_cli("why", "--leaf", "w9", check=2).stderr
    # an output name is checked against the traced outputs too (it used to pass on its "out" prefix and
    # compile, to answer "no answer")
    assert "--leaf 'outx' names no input or output leaf of three; close matches: out" in \
        run_cli("why", "--leaf", "outx", check=2).stderr


@pytest.mark.jax_version("<0.12", reason=JAXLIB_0_12_METADATA)
def test_why_questions_that_name_nothing_are_exit_2_with_close_matches(tmp_path, monkeypatch, run_cli):
    """Issue 35: --collective 99999 and --line nofile.py:3 answered nothing with exit 0, and
    --line /etc/passwd:1 matched any file named passwd; a path with a folder is matched whole."""
    write(tmp_path, "model.py", CAUSES_MODEL)
    write(tmp_path, "model.stagetool.yaml", CAUSES_SPEC)
    monkeypatch.chdir(tmp_path)
    r = run_cli("why", "--collective", "99999", check=2)
    assert "the program has 2 collective(s); there is no collective 99999; close: 1, 2" in r.stderr and not r.stdout
    r = run_cli("why", "--line", "nofile.py:3", check=2)
    assert "nothing at nofile.py:3" in r.stderr and "close: model.py:" in r.stderr
    run_cli("why", "--line", "/etc/model.py:8", check=2)  # the name matches, the folder does not
    assert _why(run_cli, "--line", str(tmp_path / "model.py") + ":8")["found"] == [
        "sharding constraint P('data', None) at model.py:8"]
    assert _why(run_cli, "--line", f"{tmp_path.name}/model.py:8")["found"] == _why(run_cli, "--line", "model.py:8")["found"]


def test_why_answers_for_every_output_leaf_name_equinox_marker_too(tmp_path, monkeypatch, run_cli, isolated_imports):
    """An ``eqx.filter_jit`` step's outputs are Equinox's ``marker`` and ``out/...``: ``why --leaf marker``
    answers with the marker's compiled sharding (it was refused: only names starting with ``out``
    passed the input-leaf check)."""
    pytest.importorskip("equinox")
    write(tmp_path, "e.py", """
        import equinox as eqx

        @eqx.filter_jit
        def double(x):
            return x * 2
    """)
    write(tmp_path, "e.stagetool.yaml", """
        version: 1
        mesh: {axes: {data: 2, model: 4}}
        functions:
          double: {target: e.py:double, args: ['f32[16,8] @ [data, null]']}
    """)
    monkeypatch.chdir(tmp_path)
    import sys

    sys.path.insert(0, str(tmp_path))
    import e

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    x = jax.device_put(jnp.zeros((16, 8)), NamedSharding(mesh, P("data", None)))
    marker, out = e.double.lower(x).compile().compiled.output_shardings[:2]
    assert (marker.spec, out.spec) == (P(), P("data", None))
    assert _why(run_cli, "--leaf", "marker")["found"] == ["output marker: compiled P()"]
    assert _why(run_cli, "--leaf", "out")["found"] == ["output out: compiled P('data', None)"]


def test_gspmd_compile_is_explained_by_nobody(tmp_path):
    """Faithful or silent: with the GSPMD partitioner (JAX_USE_SHARDY_PARTITIONER=0) the lowered module
    has no Shardy shardings, so no collective gets a cause and the section says why."""
    write(tmp_path, "model.py", CAUSES_MODEL)
    write(tmp_path, "model.stagetool.yaml", CAUSES_SPEC)
    r = run_subprocess("collectives", "--format", "json", "--no-cache", cwd=tmp_path,
                       env={"JAX_USE_SHARDY_PARTITIONER": "0"})
    assert r.code == 0, r.stderr
    doc = r.json()
    assert dict(doc["config"])["jax_use_shardy_partitioner"] == "False"
    c = doc["functions"][0]["collectives"]
    assert c["items"] and all(item["cause"] is None for item in c["items"])
    assert c["causes_unavailable"] == ("explanation unavailable: the lowered module has no Shardy mesh "
                                       "(GSPMD partitioner, or no mesh)")
    assert c["origins"] is None


SHARD_MAP = """\
import jax
from jax.sharding import PartitionSpec as P


def f(x, w):
    def local(xb, wb):
        return jax.lax.psum(xb @ wb, "model")
    return jax.shard_map(local, in_specs=(P("data", "model"), P("model", None)), out_specs=P("data", None))(x, w)
"""


def test_a_collective_written_in_shard_map_is_the_programs_own(tmp_path, monkeypatch, run_cli):
    write(tmp_path, "sm.py", SHARD_MAP)
    write(tmp_path, "sm.stagetool.yaml", CAUSES_SPEC.replace("three:", "f:").replace("model.py:three", "sm.py:f")
          .replace("      - 'f32[16,32] @ [data, null]'\n      - 'f32[32,64] @ [null, model]'\n"
                   "      - 'f32[64,32] @ [model, null]'\n",
                   "      - 'f32[16,64] @ [data, model]'\n      - 'f32[64,32] @ [model, null]'\n"))
    monkeypatch.chdir(tmp_path)
    (item,) = run_cli("collectives", "--format", "json", check=0).json()["functions"][0]["collectives"]["items"]
    assert item["collective"]["kind"] == "all-reduce" and item["collective"]["mesh_axes"] == ["model"]
    assert item["cause"]["op"] == "all_reduce" and item["cause"]["line"].endswith("sm.py:7")
    assert item["cause"]["reason"] == ("written in the program: all_reduce at sm.py:7, inside a manual computation "
                                       "(shard_map); the partitioner did not choose it")


HELPER = """\
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def mm(a, b):
    return jnp.matmul(a, b, out_sharding=P("data", None))


def two(x, w1, w2):
    h = jnp.tanh(mm(x, w1))
    return mm(h, w2)
"""


@pytest.mark.jax_version("<0.12", reason=JAXLIB_0_12_METADATA)
def test_a_helper_called_twice_gives_each_collective_its_own_call(tmp_path, monkeypatch, run_cli):
    """Both dots are on the helper's line (``t.py:6``), called from lines 10 and 11 (as the llama3
    of jax-llm-examples calls its ``einsum`` helper from attention and MLP); each contracts a
    dimension split over `model` (w1's 32 rows, then w2's 64) → an all-reduce each, as JAX compiles
    it (explicit axes). Worked by hand: the first from w1's spec line, over a dimension of 32; the
    second from w2's, over 64 — the call chain (``t.py:6 ← t.py:11``) tells the two ops apart, not
    the innermost line."""
    write(tmp_path, "t.py", HELPER)
    write(tmp_path, "t.stagetool.yaml", "version: 1\nmesh:\n  axes: {data: 2, model: 4}\n  axis_types: explicit\n"
                                         "functions:\n  two:\n    target: t.py:two\n    args:\n"
                                         "      - 'f32[16,32] @ [data, null]'\n      - 'f32[32,64] @ [model, null]'\n"
                                         "      - 'f32[64,48] @ [model, null]'\n")
    monkeypatch.chdir(tmp_path)
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)

    def mm(a, b):
        return jnp.matmul(a, b, out_sharding=P("data", None))

    with jax.sharding.set_mesh(mesh):
        assert _compiled_kinds(lambda x, w1, w2: mm(jnp.tanh(mm(x, w1)), w2), mesh, ((16, 32), P("data", None)),
                               ((32, 64), P("model", None)), ((64, 48), P("model", None))) == ["all-reduce"] * 2
    c = run_cli("collectives", "--format", "json", check=0).json()["functions"][0]["collectives"]
    assert c["causes_unavailable"] is None
    got = sorted((x["source"], x["cause"]["reason"].split(":")[0], {o["leaf"] for o in x["cause"]["origins"]} - {None})
                 for x in c["items"])
    assert got == [("t.py:6", "contraction over a dimension of 32 split over `model`", {"w1"}),
                   ("t.py:6", "contraction over a dimension of 64 split over `model`", {"w2"})]


def test_a_mesh_axis_of_size_1_splits_nothing():
    """The compiled ``P('x', None)`` over a mesh whose ``x`` has size 1 is Shardy's ``P(None, None)``
    (its propagation leaves such an axis out): the same sharding, so the causes stay; over ``x=2``
    the two differ and the explanation is withheld."""
    from stagetool.analysis.causes import unfaithful_reason
    from stagetool.analysis.shardings import LeafReport
    from stagetool.core.sharding import Sharding
    from stagetool.facts import Propagation, ValueSharding

    tokens = LeafReport("tokens", (8, 1), "int32", Sharding("spec", ("x", None)), Sharding("spec", ("x", None)),
                        False, (8, 1), 32, 32, parameter=0)
    out = LeafReport("out", (8,), "int32", Sharding("spec", (None,)), Sharding("spec", (None,)), False, (8,), 32, 32)
    got = ((ValueSharding(((), ())),), ("tokens",), (ValueSharding(((),)),), ())
    assert unfaithful_reason(Propagation(*got, mesh_axes=(("x", 1), ("y", 4))), [tokens], [out]) is None
    why = unfaithful_reason(Propagation(*got, mesh_axes=(("x", 2), ("y", 4))), [tokens], [out])
    assert why.startswith("Shardy's propagation rerun here gives input tokens P(None, None), the compiled program "
                          "P('x', None)")
