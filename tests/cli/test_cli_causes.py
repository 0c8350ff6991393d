"""``check`` leads with causes (issue 22): each change under the edit that caused it.

Every test snapshots a program, makes one (or two) edits a user would make, and runs ``check``
through the real entry point: a rule of the spec, a sharding constraint in the model, the mesh, a
model's own annotation (Flax NNX ``with_partitioning``, Flax Linen logical axis rules), two edits at
once. The expected cause is the edit made; the expected consequences are the changes ``check``
reports, each asserted to be under that cause (or, where the snapshots record no link, said so).
"""

from __future__ import annotations

import pytest
import shutil
import xml.etree.ElementTree as ET

from helpers import CAUSES_MODEL, CAUSES_SPEC, EXAMPLES, JAXLIB_0_12_METADATA, import_afresh, write


def _check(run_cli, *args: str) -> dict:
    return run_cli("check", "--baseline", "base.json", "--format", "json", *args).json()


def _small(tmp_path, monkeypatch, run_cli):
    write(tmp_path, "model.py", CAUSES_MODEL)
    write(tmp_path, "model.stagetool.yaml", CAUSES_SPEC)
    monkeypatch.chdir(tmp_path)
    run_cli("snapshot", "-o", "base.json", check=0)


def _edit(path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new))


def _all_under_causes(f: dict) -> None:
    """Every change is either under a cause or unexplained, and nothing else."""
    listed = [c["what"] for cause in f["causes"] for c in cause["consequences"]] + [c["what"] for c in f["unexplained"]]
    assert sorted(set(listed)) == sorted(c["what"] for c in f["changes"])


@pytest.mark.jax_version("<0.12", reason=JAXLIB_0_12_METADATA)
def test_transformer_rule_edit_is_one_cause(tmp_path, monkeypatch, run_cli):
    """The issue's edit: rule '/layers/(wo|w_down)$' from [null, model, null] to [null, null, model]."""
    for name in ("transformer.py", "transformer.stagetool.yaml"):
        shutil.copy(EXAMPLES / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    run_cli("snapshot", "-o", "base.json", check=0)
    _edit(tmp_path / "transformer.stagetool.yaml", "['/layers/(wo|w_down)$', [null, model, null]]",
          "['/layers/(wo|w_down)$', [null, null, model]]")
    doc = run_cli("check", "--baseline", "base.json", "--format", "json", check=1).json()
    (f,) = doc["functions"]
    (cause,) = f["causes"]
    assert cause["kind"] == "declared" and cause["where"] == "transformer.stagetool.yaml:14"
    assert cause["what"] == "the rule at transformer.stagetool.yaml:14 changed the declared sharding of 6 inputs"
    assert sorted(e.split(":")[0] for e in cause["edits"]) == sorted(
        f"{arg}layers/{w}" for arg in ("params/", "opt_state/m/", "opt_state/v/") for w in ("w_down", "wo"))
    assert all(e.endswith("P(None, 'model', None) → P(None, None, 'model')") for e in cause["edits"])
    assert f["unexplained"] == []
    _all_under_causes(f)
    under = {c["what"]: (c, linked) for c, linked in zip(cause["consequences"], cause["linked"])}
    # every failing change is under the one cause
    assert sum(c["status"] == "regression" for c, _ in under.values()) == doc["regressions"] > 0
    # the new collectives are linked to it (their causes name a leaf of the rule), each with its model lines
    for kind in ("all-gather", "all-to-all"):
        c, linked = under[f"collective {kind} over model"]
        assert c["status"] == "regression" and linked
        assert c["note"].startswith("new collective at transformer.py:")
    count, linked = under["collective all-reduce over model: count"]
    assert count["status"] == "regression" and linked
    assert under["input params/layers/wo: sharding"][1]
    md = run_cli("check", "--baseline", "base.json", "--format", "markdown", check=1).stdout
    assert md.startswith(f"### ❌ 1 cause → {doc['regressions']} failing changes · stagetool check")
    assert "#### cause 1 · train_step: the rule at transformer.stagetool.yaml:14 changed" in md
    run_cli("check", "--baseline", "base.json", "--format", "html", "-o", "check.html", check=1)
    page = (tmp_path / "check.html").read_text()
    assert f"data-headline>1 cause → {doc['regressions']} failing changes<" in page
    assert page.count('class="cause" data-cause=') == 1


@pytest.mark.jax_version("<0.12", reason=JAXLIB_0_12_METADATA)
def test_constraint_edit_is_its_line(tmp_path, monkeypatch, run_cli):
    _small(tmp_path, monkeypatch, run_cli)
    _edit(tmp_path / "model.py", "P('data', None))", "P(None, 'model'))")
    r = _check_afresh(run_cli, "model", "--format", "json", check=1)
    (f,) = r.json()["functions"]
    (cause,) = f["causes"]
    assert cause["kind"] == "constraint" and cause["where"] == "model.py:8"
    assert cause["edits"] == ["model.py:8: P('data', None) → P(None, 'model')"]
    _all_under_causes(f)
    linked = {c["what"]: k for c, k in zip(cause["consequences"], cause["linked"])}
    # the all-gather of tanh's `model` axis at the constraint is gone: linked through its recorded cause
    assert linked["collective all-gather over model"] is True


def test_mesh_edit(tmp_path, monkeypatch, run_cli):
    _small(tmp_path, monkeypatch, run_cli)
    doc = _check(run_cli, "--mesh", "4x2")
    (f,) = doc["functions"]
    kinds = [c["kind"] for c in f["causes"]]
    assert kinds == ["mesh"]
    assert f["causes"][0]["what"] == "the mesh changed: data=2 × model=4 → data=4 × model=2"
    assert f["unexplained"] == []
    _all_under_causes(f)


def test_two_independent_edits_are_two_causes(tmp_path, monkeypatch, run_cli):
    _small(tmp_path, monkeypatch, run_cli)
    _edit(tmp_path / "model.stagetool.yaml", "'f32[64,32] @ [model, null]'", "'f32[64,32] @ [null, model]'")
    _edit(tmp_path / "model.py", "P('data', None))", "P('data', 'model'))")
    r = _check_afresh(run_cli, "model", "--format", "json", check=1)
    (f,) = r.json()["functions"]
    causes = {c["kind"]: c for c in f["causes"]}
    assert set(causes) == {"declared", "constraint"}
    assert causes["declared"]["where"] == "model.stagetool.yaml:10"
    assert causes["declared"]["edits"] == ["w2: P('model', None) → P(None, 'model')"]
    assert causes["constraint"]["edits"] == ["model.py:8: P('data', None) → P('data', 'model')"]
    _all_under_causes(f)
    # w2's own sharding change is under its spec line; nothing is attributed by elimination with two causes
    decl = dict(zip([c["what"] for c in causes["declared"]["consequences"]], causes["declared"]["linked"]))
    assert decl["input w2: sharding"] is True
    assert all(causes[k]["linked"] and all(causes[k]["linked"]) for k in causes)
    _check_afresh(run_cli, "model", "--junit-xml", "j.xml", check=1)
    suite = ET.parse(tmp_path / "j.xml").getroot().find("testsuite")
    failure = suite.find("testcase/failure")
    assert failure.get("message").startswith("2 causes → ")
    assert suite.find("properties/property[@name='summary']").get("value") == failure.get("message")
    assert failure.text.startswith("cause: ")


def _check_afresh(run_cli, module: str, *args: str, check: int):
    """``check --baseline base.json ARGS`` in this process, after an edit of ``module``'s file: it is
    imported anew, as the fresh process CI runs ``check`` in imports it."""
    import_afresh(module)
    return run_cli("check", "--baseline", "base.json", *args, check=check)


def _example(tmp_path, monkeypatch, run_cli, name: str):
    for f in (f"{name}.py", f"{name}.stagetool.yaml"):
        shutil.copy(EXAMPLES / f, tmp_path / f)
    monkeypatch.chdir(tmp_path)
    run_cli("snapshot", "-o", "base.json", check=0)


def test_nnx_with_partitioning_edit(tmp_path, monkeypatch, run_cli):
    _example(tmp_path, monkeypatch, run_cli, "nnx_lm")
    _edit(tmp_path / "nnx_lm.py", 'kernel_init=nnx.with_partitioning(init, ("model", None)))',
          'kernel_init=nnx.with_partitioning(init, (None, "model")))')
    r = _check_afresh(run_cli, "nnx_lm", "--format", "json", check=1)
    (f,) = r.json()["functions"]
    # one edit of the model's code: the parameter and its two optimizer moments, built by two inits
    (cause,) = [c for c in f["causes"] if c["kind"] == "declared"]
    # credited to the model's lines that wrote the annotation (issue 49): the nnx.Linear of `down` and
    # make_optimizer, whose moments take the parameter's sharding; not the spec's init: lines
    assert cause["what"] == ("the model's sharding annotations at nnx_lm.py:19 (init at nnx_lm.py:40) "
                             "changed the declared sharding of 3 inputs")
    assert sorted(e.split(":")[0] for e in cause["edits"]) == [
        "model/mlp/down/kernel/value", "optimizer/opt_state/0/mu/mlp/down/kernel/value",
        "optimizer/opt_state/0/nu/mlp/down/kernel/value"]
    assert all(e.endswith("P('model', None) → P(None, 'model')") for e in cause["edits"])
    _all_under_causes(f)


def test_linen_logical_rule_edit(tmp_path, monkeypatch, run_cli):
    _example(tmp_path, monkeypatch, run_cli, "linen_lm")
    _edit(tmp_path / "linen_lm.py", '("mlp", "model"),', '("mlp", None),')
    r = _check_afresh(run_cli, "linen_lm", "--format", "json", check=1)
    (f,) = r.json()["functions"]
    declared = [c for c in f["causes"] if c["kind"] == "declared"]
    assert len(declared) == 1 and declared[0]["what"].startswith("the model's sharding annotations (init at "
                                                                  "linen_lm.stagetool.yaml:")
    assert any("MLP_0/Dense_0/kernel/value: P(None, 'model') → P(None, None)" in e for e in declared[0]["edits"])
    # the rule also resolves the model's with_logical_constraint: those lines are edits of their own; the
    # constraints Flax applies when it unboxes the parameters (at the nn.Dense lines 28 and 30) are the
    # parameters' own annotations, already under the declared cause, not edits of their own
    assert {c["where"] for c in f["causes"] if c["kind"] == "constraint"} == {"linen_lm.py:29"}
    # the collectives the edit changes are linked to the parameters, not to the Dense lines
    assert not any(c["kind"] == "constraint" and c["where"] in ("linen_lm.py:28", "linen_lm.py:30")
                   for c in f["causes"])
    _all_under_causes(f)
