"""stagetool.gate.compare: tolerances, snapshot documents, compare rules, loading, spec ``check:``, renderers."""

from __future__ import annotations

import copy
import dataclasses
import json
import xml.etree.ElementTree as ET

import pytest

from stagetool import pipeline
from stagetool.core import tolerances
from stagetool.gate import compare as gate_compare
from stagetool.gate import snapshot
from stagetool.core.errors import BaselineError, SpecError, UsageError
from stagetool.report import Format
from stagetool.gate import render as render_changes

from helpers import EXAMPLES  # noqa: E402


# ------------------------------------------------------------------------------- tolerances


def test_parse_tolerance_forms():
    t = tolerances.parse_tolerance("2%")
    assert (t.fraction, t.absolute, t.text) == (0.02, None, "2%")
    t = tolerances.parse_tolerance("64KiB")
    assert (t.fraction, t.absolute) == (None, 65536.0)
    t = tolerances.parse_tolerance(1000)
    assert (t.fraction, t.absolute) == (None, 1000.0)
    assert tolerances.parse_tolerance("0.5 %").fraction == pytest.approx(0.005)
    for bad in ("two", "-1%", True, -3, "5 parsecs"):
        with pytest.raises(UsageError):
            tolerances.parse_tolerance(bad)


def test_tolerance_allows_is_the_larger_allowance():
    t = tolerances.Tolerance(0.01, 50.0)
    assert t.allows(1000, 1050)          # 5%, but within the absolute 50
    assert not t.allows(1000, 1051)
    assert t.allows(10_000, 10_100)      # exactly 1%
    assert not t.allows(10_000, 10_101)
    assert t.allows(100, 0)              # shrinking always passes
    assert not tolerances.Tolerance(0.0).allows(0, 1)


def test_tolerance_options_unknown_name_suggests():
    assert tolerances.parse_tolerance_options(["memory=2%", "memory=3%"])["memory"].fraction == pytest.approx(0.03)
    with pytest.raises(UsageError, match="did you mean 'memory'"):
        tolerances.parse_tolerance_options(["memroy=2%"])
    with pytest.raises(UsageError, match="NAME=VALUE"):
        tolerances.parse_tolerance_options(["memory"])


def test_effective_tolerances_precedence():
    check = type("C", (), {"tolerances": {"memory": tolerances.parse_tolerance("2%")},
                           "functions": {"f": {"memory": tolerances.parse_tolerance("3%")}}})()
    assert tolerances.effective_tolerances("g", spec_check=check)["memory"].fraction == pytest.approx(0.02)
    assert tolerances.effective_tolerances("f", spec_check=check)["memory"].fraction == pytest.approx(0.03)
    cli = {"memory": tolerances.parse_tolerance("9%")}
    assert tolerances.effective_tolerances("f", spec_check=check, cli=cli)["memory"].fraction == pytest.approx(0.09)
    assert tolerances.effective_tolerances("f")["flops"] == tolerances.DEFAULT_TOLERANCES["flops"]


# ------------------------------------------------------------------------------- snapshot documents


def _entry(**over):
    e = {
        "target": "m.py:f",
        "mesh": {"axes": [["data", 2], ["model", 4]], "axis_types": "auto", "platform": "cpu", "device_kind": "cpu",
                 "device_count": 8, "process_count": 1, "topology": None},
        "inputs": [{"path": "params/w", "shape": [512, 1024], "dtype": "float32", "sharding": "P(None, 'model')",
                    "bytes_per_device": 131072, "unused": False}],
        "outputs": [{"path": "out", "shape": [128, 1024], "dtype": "float32", "sharding": "P('data', 'model')",
                     "bytes_per_device": 16384, "unused": False}],
        "memory": {"argument_bytes": 1000, "output_bytes": 500, "alias_bytes": 400, "temp_bytes": 10000,
                   "peak_bytes": 11100},
        "cost": {"flops": 1_000_000, "transcendentals": 0, "bytes_accessed": 50_000},
        "collectives": [{"kind": "all-reduce", "axes": "model", "count": 2, "bytes_per_device": 4096}],
    }
    e.update(over)
    return e


def _snap(entries, **over):
    doc = {"snapshot_schema": snapshot.SNAPSHOT_SCHEMA, "kind": "stagetool-snapshot", "stagetool_version": "0.1.0", "jax_version": "0.10.2",
           "jaxlib_version": "0.10.2", "spec": "m.stagetool.yaml", "functions": entries}
    doc.update(over)
    return doc


def _compare(before_entry, after_entry, **kw):
    return gate_compare.compare(_snap({"f": before_entry}), _snap({"f": after_entry}), **kw)


def test_identical_snapshots_have_no_changes():
    cmp = _compare(_entry(), _entry())
    assert [(f.name, f.status, f.changes) for f in cmp.functions] == [("f", "ok", ())]
    assert cmp.exit_code() == 0 and cmp.notices == ()


def test_sharding_change_is_a_regression_naming_leaf_and_both_shardings():
    after = _entry()
    after["inputs"] = [dict(after["inputs"][0], sharding="P('model', None)")]
    cmp = _compare(_entry(), after)
    (c,) = cmp.regressions
    assert (c.what, c.before, c.after) == ("input params/w: sharding", "P(None, 'model')", "P('model', None)")
    assert cmp.exit_code() == 1


def test_leaf_added_removed_shape_and_unused():
    after = _entry()
    after["inputs"] = [dict(after["inputs"][0], shape=[512, 2048], unused=True),
                       {"path": "params/b", "shape": [8], "dtype": "float32", "sharding": "P(None)",
                        "bytes_per_device": 32, "unused": False}]
    after["outputs"] = []
    whats = {(c.what, c.before, c.after) for c in _compare(_entry(), after).regressions}
    assert ("input params/w: shape", "f32[512,1024]", "f32[512,2048]") in whats
    assert ("input params/w: sharding", "P(None, 'model')", "unused") in whats
    assert ("input params/b", "—", "f32[8] P(None)") in whats
    assert ("output out", "f32[128,1024] P('data', 'model')", "—") in whats


def test_metric_growth_against_tolerance_and_improvements():
    after = _entry(memory={"argument_bytes": 1000, "output_bytes": 500, "alias_bytes": 300,
                           "temp_bytes": 10_050, "peak_bytes": 11_300},
                   cost={"flops": 900_000, "transcendentals": 0, "bytes_accessed": 50_000})
    cmp = _compare(_entry(), after)
    by = {c.what: c for c in cmp.functions[0].changes}
    assert by["memory.temp_bytes"].status == "changed"          # +0.5% within 1%
    assert by["memory.temp_bytes"].change == pytest.approx(0.005)
    assert by["memory.peak_bytes"].status == "regression"       # +1.8%
    assert by["memory.alias_bytes"].status == "regression"      # less aliasing is worse
    assert by["cost.flops"].status == "improvement"
    assert by["cost.flops"].change == pytest.approx(-0.1)
    # a looser tolerance turns the peak regression into a change; alias 400 -> 300 is -25%
    loose = {"memory": tolerances.parse_tolerance("30%")}
    cmp = _compare(_entry(), after, tolerances_for=lambda name: tolerances.effective_tolerances(name, cli=loose))
    assert cmp.regressions == [] and cmp.exit_code() == 0
    # an absolute tolerance
    absolute = {"memory": tolerances.parse_tolerance("200")}
    cmp = _compare(_entry(), after, tolerances_for=lambda name: tolerances.effective_tolerances(name, cli=absolute))
    assert [c.what for c in cmp.regressions] == []


def test_fewer_aliased_bytes_fail_only_when_outputs_lose_their_donated_buffer():
    # a finer mesh: arguments, outputs and aliased bytes halve; outputs needing their own buffer 100 -> 50
    finer = _entry(memory={"argument_bytes": 500, "output_bytes": 250, "alias_bytes": 200, "temp_bytes": 5000,
                           "peak_bytes": 5550})
    by = {c.what: c for c in _compare(_entry(), finer).functions[0].changes}
    assert by["memory.alias_bytes"].status == "changed" and "100 → 50 B" in by["memory.alias_bytes"].note
    # on the same finer mesh a donated output no longer aliased: outputs needing their own buffer 100 -> 150
    lost = _entry(memory={"argument_bytes": 500, "output_bytes": 250, "alias_bytes": 100, "temp_bytes": 5000,
                          "peak_bytes": 5650})
    by = {c.what: c for c in _compare(_entry(), lost).functions[0].changes}
    assert by["memory.alias_bytes"].status == "regression"


def test_collective_axes_in_changes_are_written_as_the_collectives_table_writes_them():
    """``check`` and ``diff`` name a collective over two axes ``data × fsdp``, as ``collectives`` does
    (the snapshot keeps ``data,fsdp``)."""
    after = _entry(collectives=[{"kind": "all-reduce", "axes": "model", "count": 2, "bytes_per_device": 4096},
                                {"kind": "all-reduce", "axes": "data,fsdp", "count": 1, "bytes_per_device": 64},
                                {"kind": "all-gather", "axes": "-", "count": 1, "bytes_per_device": 64}])
    whats = [c.what for c in _compare(_entry(), after).regressions]
    assert whats == ["collective all-gather over (within a device)", "collective all-reduce over data × fsdp"]


def test_collectives_new_gone_and_growth():
    after = _entry(collectives=[{"kind": "all-gather", "axes": "data", "count": 1, "bytes_per_device": 2048},
                                {"kind": "all-reduce", "axes": "model", "count": 3, "bytes_per_device": 4100}])
    before = _entry(collectives=[{"kind": "all-reduce", "axes": "model", "count": 2, "bytes_per_device": 4096},
                                 {"kind": "reduce-scatter", "axes": "data", "count": 1, "bytes_per_device": 64}])
    changes = {c.what: c for c in _compare(before, after).functions[0].changes}
    assert changes["collective all-gather over data"].status == "regression"
    assert changes["collective all-gather over data"].note == "new collective"
    assert changes["collective reduce-scatter over data"].status == "improvement"
    assert changes["collective all-reduce over model: count"].status == "regression"
    assert changes["collective all-reduce over model: bytes"].status == "regression"   # 0% default
    tol = {"collective_bytes": tolerances.parse_tolerance("1%"), "collective_count": tolerances.parse_tolerance(1)}
    cmp = _compare(before, after, tolerances_for=lambda n: tolerances.effective_tolerances(n, cli=tol))
    assert [c.what for c in cmp.regressions] == ["collective all-gather over data"]


def test_a_new_or_gone_collective_group_reads_as_its_bytes_in_its_count():
    """Two all-gathers of 128 B each are 256 B in 2 (the snapshot's bytes are the group's sum), never
    '2× 256 B', which reads as 512 B (issue 40, item 5)."""
    after = _entry(collectives=[{"kind": "all-gather", "axes": "data", "count": 2, "bytes_per_device": 256}])
    before = _entry(collectives=[{"kind": "reduce-scatter", "axes": "data", "count": 1, "bytes_per_device": 64}])
    changes = {c.what: c for c in _compare(before, after).functions[0].changes}
    assert (changes["collective all-gather over data"].before, changes["collective all-gather over data"].after) == \
        ("—", "256 B in 2")
    assert changes["collective reduce-scatter over data"].before == "64 B in 1"


def test_collectives_missing_on_one_side_is_a_notice_not_a_failure():
    cmp = _compare(_entry(collectives=None), _entry())
    assert cmp.exit_code() == 0
    assert any("collectives are in only one" in n for n in cmp.notices)


def test_environment_mismatch_notice_and_widened_tolerance():
    before = _snap({"f": _entry()}, jax_version="0.9.0")
    grown = _entry(memory=dict(_entry()["memory"], temp_bytes=10_500),      # +5%: below the 10% floor
                   cost=dict(_entry()["cost"], flops=1_200_000))            # +20%: above it
    grown["inputs"] = [dict(grown["inputs"][0], sharding="P()")]
    cmp = gate_compare.compare(before, _snap({"f": grown}))
    assert any("jax 0.9.0 in the baseline, 0.10.2 now" in n for n in cmp.notices)
    status = {c.what: c.status for c in cmp.functions[0].changes}
    assert status["memory.temp_bytes"] == "changed"
    assert status["cost.flops"] == "regression"
    assert status["input params/w: sharding"] == "regression"
    kind = _entry()
    kind["mesh"] = dict(kind["mesh"], platform="tpu", device_kind="TPU v5 lite")
    notices = gate_compare.environment_notices(_snap({"f": _entry()}), _snap({"f": kind}))
    assert notices == ["device cpu:cpu in the baseline, tpu:TPU v5 lite now"]


def test_new_removed_failed_functions():
    before = _snap({"f": _entry(), "gone": _entry()})
    after = _snap({"f": _entry(), "fresh": _entry()})
    cmp = gate_compare.compare(before, after, failed={"broken": "compile failed: boom"})
    assert {f.name: f.status for f in cmp.functions} == {"f": "ok", "fresh": "new", "broken": "failed",
                                                         "gone": "removed"}
    assert cmp.exit_code() == 3
    # with `only`, baseline functions that were not asked for are not "removed"
    cmp = gate_compare.compare(before, _snap({"f": _entry()}), only=["f"])
    assert [f.status for f in cmp.functions] == ["ok"] and cmp.exit_code() == 0


def test_a_function_missing_from_the_run_is_a_regression_a_new_one_is_not():
    before = _snap({"f": _entry(), "gone": _entry()})
    cmp = gate_compare.compare(before, _snap({"f": _entry()}))
    assert [(f.name, f.status) for f in cmp.functions] == [("f", "ok"), ("gone", "removed")]
    assert [(c.function, c.what, c.status) for c in cmp.regressions] == [("gone", "function", "regression")]
    assert cmp.exit_code() == 1 and cmp.exit_code(fail_on_regression=False) == 0
    # a rename: the old name fails, the new one is only shown
    cmp = gate_compare.compare(before, _snap({"f": _entry(), "renamed": _entry()}))
    assert {f.name: f.status for f in cmp.functions} == {"f": "ok", "renamed": "new", "gone": "removed"}
    assert [c.function for c in cmp.regressions] == ["gone"]
    # only new functions: shown, never failing
    cmp = gate_compare.compare(_snap({"f": _entry()}), _snap({"f": _entry(), "fresh": _entry()}))
    assert cmp.exit_code() == 0 and [f.status for f in cmp.functions] == ["ok", "new"]
    # `order` sorts the results (spec order) without restricting them
    cmp = gate_compare.compare(before, _snap({"f": _entry(), "h": _entry()}), order=["h", "f"])
    assert [f.name for f in cmp.functions] == ["h", "f", "gone"]


def test_a_missing_function_is_named_in_every_output():
    cmp = gate_compare.compare(_snap({"f": _entry(), "gone": _entry()}), _snap({"f": _entry()}))
    text = render_changes.render_text(cmp, width=200)
    row = next(line for line in text.splitlines() if line.strip().startswith("gone"))
    assert "function" in row and "present" in row and "regression" in row and "no longer staged" in row
    assert len([line for line in text.splitlines() if line.strip().startswith("gone")]) == 1
    md = render_changes.render_markdown(cmp)
    assert md.startswith("### ❌") and "| `gone` | `function` | `present` | `—` |" in md and "**regression**" in md
    doc = json.loads(render_changes.render_json(cmp))
    assert doc["regressions"] == 1
    gone = next(f for f in doc["functions"] if f["name"] == "gone")
    assert gone["status"] == "removed" and gone["changes"][0]["status"] == "regression"
    suite = ET.fromstring(render_changes.junit_xml(cmp)).find("testsuite")
    assert (suite.get("failures"), suite.get("skipped")) == ("1", "0")
    case = next(c for c in suite.findall("testcase") if c.get("name") == "gone")
    assert case.find("failure") is not None and "no longer staged" in case.find("failure").text


def test_mesh_change_is_a_regression_for_check_only():
    after = _entry()
    after["mesh"] = dict(after["mesh"], axes=[["data", 4], ["model", 2]])
    assert [c.what for c in _compare(_entry(), after).regressions] == ["mesh"]
    cmp = _compare(_entry(), after, same_mesh_expected=False)
    assert cmp.regressions == [] and cmp.functions[0].changes[0].after == "data=4 × model=2"


def test_dumps_is_deterministic_and_numbers_are_stable():
    assert snapshot._num(2.0) == 2 and isinstance(snapshot._num(2.0), int)
    assert snapshot._num(0.1 + 0.2) == 0.3
    assert snapshot._num(float("nan")) is None and snapshot._num(None) is None
    a = _snap({"z": _entry(), "a": _entry()})
    b = json.loads(json.dumps(a))
    b["functions"] = dict(reversed(list(b["functions"].items())))
    assert snapshot.dumps(a) == snapshot.dumps(b)
    assert snapshot.dumps(a).index('"a"') < snapshot.dumps(a).index('"z"')


# ------------------------------------------------------------------------------- loading


@pytest.mark.parametrize("content, match", [
    (None, "not found"),
    ("{not json", r":1:2: the baseline is not valid JSON"),
    ('{"kind": "report", "schema_version": 1}', "not a stagetool snapshot"),
    ('{"kind": "stagetool-snapshot", "snapshot_schema": 4}', "snapshot_schema 4 is not supported"),
    ('{"kind": "stagetool-snapshot", "snapshot_schema": 2}',
     "schema 2: its memory.peak_bytes is arguments \\+ outputs - aliased \\+ temporaries alone, which misses the "
     "temporaries XLA:TPU leaves out"),
    ('{"kind": "stagetool-snapshot", "snapshot_schema": 1}', "schema 1: its memory.peak_bytes is XLA's peak_memory_in_bytes or"),
    (('{"kind": "stagetool-snapshot", "snapshot_schema": 3, "jax_version": "x", "jaxlib_version": "x", '
      '"functions": {"f": {"mesh": {}}}}'), "functions.f: missing 'inputs'"),
])
def test_load_snapshot_errors(tmp_path, content, match):
    p = tmp_path / "lock.json"
    if content is not None:
        p.write_text(content)
    with pytest.raises(BaselineError, match=match) as info:
        snapshot.load_snapshot(p)
    assert info.value.exit_code == 2


def test_write_then_load_round_trip(tmp_path):
    doc = _snap({"f": _entry()})
    snapshot.write_snapshot(tmp_path / "lock.json", doc)
    assert snapshot.load_snapshot(tmp_path / "lock.json") == doc
    assert [p.name for p in tmp_path.iterdir()] == ["lock.json"]     # no temporary left behind


def test_a_memory_timeline_is_kept_checked_and_never_compared(tmp_path):
    timeline = {"bytes": [10, 30, 20], "steps": 3, "peak_bytes": 30, "peak_position": 1, "peak_instruction": "f",
                "gated_peak_bytes": 32}
    doc = _snap({"f": {**_entry(), "memory_timeline": timeline}})
    snapshot.write_snapshot(tmp_path / "lock.json", doc)
    assert snapshot.load_snapshot(tmp_path / "lock.json")["functions"]["f"]["memory_timeline"] == timeline
    other = _snap({"f": {**_entry(), "memory_timeline": {**timeline, "bytes": [10, 90, 20], "peak_bytes": 90}}})
    assert gate_compare.compare(doc, other).functions[0].changes == ()  # a picture, not a gated figure
    (tmp_path / "bad.json").write_text(json.dumps(_snap({"f": {**_entry(), "memory_timeline": {"bytes": "x"}}})))
    with pytest.raises(BaselineError, match="functions.f.memory_timeline.bytes: must be a list of integers, not a string"):
        snapshot.load_snapshot(tmp_path / "bad.json")


# ------------------------------------------------------------------------------- spec check:

_SPEC = """\
version: 1
mesh: {axes: {data: 8}}
functions:
  f:
    target: m.py:f
    args: ['f32[8] @ [data]']
"""


def test_spec_check_section(tmp_path):
    from stagetool.spec.parse import parse_spec

    spec = parse_spec(_SPEC + "check:\n  tolerances: {memory: 2%, collective_bytes: 64KiB}\n"
                      "  functions:\n    f: {tolerances: {flops: 5%}}\n", file="s.yaml", base_dir=tmp_path)
    assert spec.check.tolerances["memory"].fraction == pytest.approx(0.02)
    assert spec.check.tolerances["collective_bytes"].absolute == 65536
    assert spec.check.functions["f"]["flops"].fraction == pytest.approx(0.05)
    assert tolerances.effective_tolerances("f", spec_check=spec.check)["flops"].text == "5%"
    assert parse_spec(_SPEC, file="s.yaml", base_dir=tmp_path).check is None


def test_spec_check_errors_have_locations(tmp_path):
    from stagetool.spec.parse import parse_spec

    text = _SPEC + "check:\n  tolerances: {memroy: 2%, flops: lots}\n  functions:\n    g: {tolerances: {}}\n"
    with pytest.raises(SpecError) as info:
        parse_spec(text, file="s.yaml", base_dir=tmp_path)
    issues = info.value.issues
    assert any(i.startswith("s.yaml:8:16: check.tolerances: unknown tolerance 'memroy'") and "did you mean 'memory'"
               in i for i in issues), issues
    assert any(i.startswith("s.yaml:8:35: check.tolerances.flops: invalid tolerance 'lots'") for i in issues), issues
    assert any(i.startswith("s.yaml:10:5: check.functions: 'g' is not a function of this spec") for i in issues), issues


# ------------------------------------------------------------------------------- renderers


def _regressing_comparison():
    after = _entry()
    after["inputs"] = [dict(after["inputs"][0], sharding="P('model', None)")]
    after["cost"] = dict(after["cost"], flops=500_000)
    return gate_compare.compare(_snap({"f": _entry(), "g": _entry()}), _snap({"f": after, "g": _entry()}),
                      failed={"h": "trace failed: boom"})


@pytest.mark.parametrize("fmt", list(Format))
def test_every_format_renders_the_change(fmt):
    text = render_changes.render(_regressing_comparison(), fmt)
    if fmt == Format.html:
        import html

        text = html.unescape(text)  # quotes are escaped in HTML
    assert "params/w" in text and "P('model', None)" in text and "P(None, 'model')" in text
    if fmt == Format.json:
        doc = json.loads(text)
        assert doc["kind"] == "comparison" and doc["regressions"] == 1 and doc["failed"] == 1


def test_text_shows_improvement_and_summary():
    text = render_changes.render_text(_regressing_comparison(), width=160)
    assert "improvement" in text and "-50.0%" in text
    assert "3 functions: 1 with regressions (1 failing change), 1 failed to stage, 1 ok; 1 improvement" in text


def test_summary_counts_functions_and_changes_unambiguously():
    grown = _entry(memory=dict(_entry()["memory"], peak_bytes=22_200, temp_bytes=20_000))
    grown["inputs"] = [dict(grown["inputs"][0], sharding="P('model', None)")]
    cmp = _compare(_entry(), grown)      # one function, three regressions
    assert [c.status for c in cmp.regressions] == ["regression"] * 3
    assert render_changes.summary_line(cmp) == "1 function: 1 with regressions (3 failing changes)"
    two = gate_compare.compare(_snap({"f": _entry(), "g": _entry()}), _snap({"f": grown, "g": grown}))
    assert render_changes.summary_line(two) == "2 functions: 2 with regressions (6 failing changes)"
    small = _entry(cost=dict(_entry()["cost"], flops=1_005_000, bytes_accessed=40_000))   # +0.5%: within 1%
    cmp = gate_compare.compare(_snap({"f": _entry(), "gone": _entry()}), _snap({"f": small, "fresh": _entry()}))
    assert render_changes.summary_line(cmp) == ("3 functions: 1 removed (in the baseline, no longer staged), 1 ok, "
                                                "1 new (not in the baseline); 1 improvement, 1 change shown, not failing")
    assert render_changes.summary_line(_compare(_entry(), _entry())) == "1 function: 1 ok"
    # synthetic snapshots record no origins: the failing change has no identifiable cause, and says so
    assert render_changes.render_markdown(cmp).startswith("### ❌ 0 causes → 1 failing change · stagetool check: "
                                                          "3 functions: 1 removed")
    assert ET.fromstring(render_changes.junit_xml(two)).find("testsuite/testcase/failure").get("message") == \
        "0 causes → 3 failing changes"


def test_junit_xml_one_testcase_per_function():
    root = ET.fromstring(render_changes.junit_xml(_regressing_comparison()))
    suite = root.find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("3", "1", "1")
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    assert set(cases) == {"f", "g", "h"}
    failure = cases["f"].find("failure")
    assert failure.get("message") == "0 causes → 1 failing change"
    assert "unexplained (no recorded edit leads to these):" in failure.text
    assert "input params/w: sharding: P(None, 'model') -> P('model', None)" in failure.text
    assert "cost.flops" in cases["f"].find("system-out").text
    assert cases["g"].find("failure") is None and cases["g"].find("error") is None
    assert cases["h"].find("error").text == "trace failed: boom"


# ------------------------------------------------------------------------------- against JAX


def test_snapshot_figures_match_jax_and_arithmetic(mlp_copy):
    from stagetool.pipeline import Options, staged_functions

    opts = Options(spec=mlp_copy / "mlp.stagetool.yaml")
    run = pipeline.take_snapshot(opts)
    assert run.failed == {} and run.functions == ("train_step",)
    entry = run.snapshot["functions"]["train_step"]
    leaves = {x["path"]: x for x in entry["inputs"]}
    # w1 is f32[512,1024] over model=4 on its columns: 512*1024*4/4 bytes per device
    assert leaves["params/w1"] == {"path": "params/w1", "shape": [512, 1024], "dtype": "float32",
                                   "sharding": "P(None, 'model')", "bytes_per_device": 512 * 1024 * 4 // 4,
                                   "unused": False, "declared": "P(None, 'model')", "declared_by": "rule",
                                   "declared_at": "mlp.stagetool.yaml:12"}
    assert leaves["batch/x"]["bytes_per_device"] == 128 * 512 * 4 // 2
    (_, _, staged), = staged_functions(opts)
    mem = staged.compiled.memory_analysis()
    assert entry["memory"]["temp_bytes"] == mem.temp_size_in_bytes
    assert entry["memory"]["argument_bytes"] == mem.argument_size_in_bytes
    assert entry["memory"]["alias_bytes"] == mem.alias_size_in_bytes
    cost = staged.compiled.cost_analysis()
    assert entry["cost"]["flops"] == pytest.approx(cost["flops"], rel=1e-11)
    assert entry["cost"]["bytes_accessed"] == pytest.approx(cost["bytes accessed"], rel=1e-11)
    assert entry["mesh"]["axes"] == [["data", 2], ["model", 4]]
    import jax

    assert run.snapshot["jax_version"] == jax.__version__
    assert copy.deepcopy(run.snapshot) == snapshot.validate_snapshot(json.loads(snapshot.dumps(run.snapshot)))


def test_function_snapshot_takes_collectives_from_the_report(mlp_copy):
    """The collectives rows are the report's collectives section by kind × mesh axes (count and bytes
    per device summed over its items, the user lines of its collectives), and a collective that
    appears is a regression naming kind and axes."""
    from stagetool.pipeline import Options, Section, analyze

    report = analyze(Options(spec=mlp_copy / "mlp.stagetool.yaml"), (Section.COLLECTIVES,))
    fr = report.functions[0]
    full = snapshot.snapshot_from_report(report)
    rows = full["functions"]["train_step"]["collectives"]
    items = fr.collectives.items
    assert [(r["kind"], r["axes"], r["count"], r["bytes_per_device"]) for r in rows] == [
        ("all-reduce", axes, sum(1 for i in items if i.collective.mesh_axes == (axes,)),
         sum(i.collective.bytes_per_device for i in items if i.collective.mesh_axes == (axes,)))
        for axes in ("data", "model")]
    assert [r["lines"] for r in rows] == [["mlp.py:26"], ["mlp.py:27"]]
    assert full["functions"]["train_step"]["inputs"] is None  # not asked for: None, not []
    without = dataclasses.replace(fr.collectives, items=tuple(i for i in items if i.collective.mesh_axes != ("model",)))
    before = snapshot.snapshot_from_report(
        dataclasses.replace(report, functions=(dataclasses.replace(fr, collectives=without),)))
    (c,) = gate_compare.compare(before, full).regressions
    assert (c.what, c.note) == ("collective all-reduce over model", "new collective at mlp.py:27")


def test_the_gate_compares_device_and_host_memory_apart():
    """Offloading to pinned_host moves bytes from the device peak to the host peak: undoing it is a
    device-peak regression (it no longer passes as an improvement), and host growth is one too."""
    offloaded = _entry(memory={**_entry()["memory"], "peak_bytes": 11100, "host_peak_bytes": 4096})
    undone = _entry(memory={**_entry()["memory"], "peak_bytes": 15196, "host_peak_bytes": 0})
    changes = {c.what: c for f in _compare(offloaded, undone).functions for c in f.changes}
    assert changes["memory.peak_bytes"].status == "regression"
    assert changes["memory.host_peak_bytes"].status == "improvement"
    more_host = _entry(memory={**_entry()["memory"], "peak_bytes": 11100, "host_peak_bytes": 8192})
    changes = {c.what: c for f in _compare(offloaded, more_host).functions for c in f.changes}
    assert changes["memory.host_peak_bytes"].status == "regression" and "memory.peak_bytes" not in changes


# ---- causes (issue 22): grouping changes under the edit that caused them


def _declared(entry, declared, at="m.stagetool.yaml:12", by="rule", sharding=None, causes=("input params/w",)):
    e = dict(entry)
    e["inputs"] = [dict(entry["inputs"][0], declared=declared, declared_by=by, declared_at=at,
                        sharding=sharding or declared)]
    e["collectives"] = [dict(r, causes=list(causes), lines=["m.py:5"]) for r in entry["collectives"]]
    e["constraints"] = []
    return e


def test_a_baseline_without_origins_gives_unexplained_changes():
    """Schema-2 baselines written before issue 22 record no declared shardings: nothing is guessed."""
    grown = _entry(memory=dict(_entry()["memory"], peak_bytes=22_200, temp_bytes=20_000))
    grown["inputs"] = [dict(grown["inputs"][0], sharding="P('model', None)")]
    (f,) = _compare(_entry(), grown).functions
    assert f.causes == () and [c.what for c in f.unexplained] == [c.what for c in f.changes]
    assert render_changes.render_markdown(_compare(_entry(), grown)).startswith("### ❌ 0 causes → 3 failing changes")


def test_environment_is_a_cause_and_only_edit_takes_the_rest():
    after = _entry(cost=dict(_entry()["cost"], flops=1_200_000))
    cmp = gate_compare.compare(_snap({"f": _entry()}), _snap({"f": after}, jax_version="0.10.3"))
    (f,) = cmp.functions
    (cause,) = f.causes
    assert cause.kind == "environment" and cause.what == "the environment changed: jax 0.10.2 in the baseline, 0.10.3 now"
    assert [c.what for c in cause.consequences] == ["cost.flops"] and cause.linked == (False,)
    assert f.unexplained == () and cmp.headline() == "1 cause → 1 failing change"


def test_declared_edit_links_its_leaf_and_collectives_and_leaves_the_rest_apart_with_two_edits():
    before = _declared(_entry(), "P(None, 'model')")
    after = _declared(_entry(), "P('model', None)")
    after["collectives"] = [{"kind": "all-gather", "axes": "model", "count": 1, "bytes_per_device": 8192,
                             "causes": ["input params/w"], "lines": ["m.py:7"]}] + after["collectives"]
    after["memory"] = dict(after["memory"], peak_bytes=99_999)
    after["constraints"] = [{"line": "m.py:9", "sharding": "P('data', None)"}]
    (f,) = _compare(before, after).functions
    kinds = [(c.kind, c.where) for c in f.causes]
    assert kinds == [("declared", "m.stagetool.yaml:12"), ("constraint", "m.py:9")]
    declared = f.causes[0]
    assert declared.what == "the rule at m.stagetool.yaml:12 changed the declared sharding of 1 input"
    assert declared.edits == ("params/w: P(None, 'model') → P('model', None)",)
    linked = {c.what: k for c, k in zip(declared.consequences, declared.linked)}
    assert linked == {"input params/w: sharding": True, "collective all-gather over model": True}
    new = next(c for c in declared.consequences if c.what == "collective all-gather over model")
    assert new.note == "new collective at m.py:7"
    # two edits: the peak growth is linked to neither, so it is listed apart rather than guessed
    assert [c.what for c in f.unexplained] == ["memory.peak_bytes"]
    assert f.causes[1].edits == ("m.py:9: none → P('data', None)",) and f.causes[1].what.endswith("added")
