"""Paths in reports are relative to the spec's folder (issue 21, items 3 and 6).

The same command run from another working directory, or in another checkout of the same project,
prints the same paths; the facts cache keys source locations relative to the spec's folder, so an
entry made in one checkout is a hit in another, and reads there as that checkout's own compile.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from helpers import EXAMPLES, run_subprocess
from stagetool.core.paths import ROOT_TOKEN, ReportRoot, report_root


# ---- the root and its rewrites ----------------------------------------------------------------------


def test_the_root_is_the_spec_folder_however_the_spec_is_named(tmp_path):
    (tmp_path / "proj" / "models").mkdir(parents=True)
    folder = str((tmp_path / "proj" / "models").resolve())
    given = report_root("models/m.stagetool.yaml", cwd=tmp_path / "proj")
    assert given == ReportRoot(folder, (), "models/m.stagetool.yaml")
    assert report_root(tmp_path / "proj/models/m.stagetool.yaml").folder == folder
    assert report_root("./m.stagetool.yaml", cwd=tmp_path / "proj/models").spec == "m.stagetool.yaml"
    # no spec file (a spec built in Python): the first file target's folder, else the working directory
    assert report_root(None, ["pkg.mod:f", "models/m.py:f"], cwd=tmp_path / "proj").folder == folder
    assert report_root(None, ["pkg.mod:f"], cwd=tmp_path).folder == str(tmp_path.resolve())


def test_the_root_reached_through_a_link_is_the_same_root(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    root = report_root(tmp_path / "link" / "m.stagetool.yaml")
    assert root.folder == str((tmp_path / "real").resolve())
    assert root.relative(f"{tmp_path}/link/m.py:3") == "m.py:3" == root.relative(f"{root.folder}/m.py:3")


def test_relative_rewrites_paths_below_the_root_and_nothing_else():
    root = ReportRoot("/home/me/proj/models", (), "models/m.stagetool.yaml")
    cases = {
        "/home/me/proj/models/m.py:27": "m.py:27",
        "/home/me/proj/models/layers/attn.py:41 ← /home/me/proj/models/m.py:9": "layers/attn.py:41 ← m.py:9",
        "models/m.stagetool.yaml:14:13": "m.stagetool.yaml:14:13",          # a spec location as given
        "rule at models/m.stagetool.yaml:12": "rule at m.stagetool.yaml:12",
        'loc("/home/me/proj/models/m.py":27:13)': 'loc("m.py":27:13)',
        # not below the root, or not a path start: unchanged
        "/usr/lib/python3/site-packages/flax/linen/linear.py:88": "/usr/lib/python3/site-packages/flax/linen/linear.py:88",
        "/home/me/proj/models2/m.py:1": "/home/me/proj/models2/m.py:1",
        "/x/home/me/proj/models/m.py:1": "/x/home/me/proj/models/m.py:1",
        "othermodels/m.stagetool.yaml:3": "othermodels/m.stagetool.yaml:3",
        "jit(step)/dot_general": "jit(step)/dot_general",
    }
    assert {k: root.relative(k) for k in cases} == cases


def test_portable_and_local_carry_a_path_from_one_checkout_to_another():
    a = ReportRoot("/ci/a/proj", (), None)
    b = ReportRoot("/home/me/b/proj", (), "proj/m.stagetool.yaml")
    text = 'source_file="/ci/a/proj/m.py" source_line=27, /usr/lib/x.py'
    moved = a.portable(text)
    assert moved == f'source_file="{ROOT_TOKEN}/m.py" source_line=27, /usr/lib/x.py'
    assert b.local(moved) == 'source_file="/home/me/b/proj/m.py" source_line=27, /usr/lib/x.py'
    # the spec as given and as an absolute path are one key part
    assert b.portable("proj/m.stagetool.yaml:4:3") == b.portable("/home/me/b/proj/m.stagetool.yaml:4:3") \
        == f"{ROOT_TOKEN}/m.stagetool.yaml:4:3"
    assert not ReportRoot('/tmp/we"ird').plain and a.plain


# ---- the CLI: two working directories, two checkouts -------------------------------------------------


def _project(folder: Path) -> Path:
    """examples/mlp.py and its spec copied into ``folder/models``; returns ``folder``."""
    (folder / "models").mkdir(parents=True)
    for name in ("mlp.py", "mlp.stagetool.yaml"):
        shutil.copy(EXAMPLES / name, folder / "models" / name)
    return folder


def _line(path: Path, text: str) -> int:
    """The 1-based line of ``path`` holding ``text`` (found here, not by stagetool)."""
    (n,) = [i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line]
    return n


def _doc(result) -> dict:
    """The JSON report without what differs between two runs of one program: timings, and whether
    the facts came from the cache."""
    assert result.code == 0, result.stderr
    doc = json.loads(result.stdout)
    for fn in doc["functions"]:
        fn["timings"] = None
        fn["cached"] = None
        if (fn.get("memory") or {}).get("peak"):
            fn["memory"]["peak"]["dump_compile_seconds"] = None
    return doc


@pytest.mark.slow
def test_the_same_report_from_another_working_directory(tmp_path):
    """JSON and snapshot byte for byte the same from the project's folder and from elsewhere (spec
    named relative to each, and absolute); every user path is relative to the spec's folder."""
    proj = _project(tmp_path / "proj")
    (tmp_path / "elsewhere").mkdir()
    runs = [("models/mlp.py:train_step", proj), (f"{proj}/models/mlp.py:train_step", tmp_path),
            ("../proj/models/mlp.py:train_step", tmp_path / "elsewhere")]
    docs, snapshots = [], []
    for i, (target, cwd) in enumerate(runs):
        docs.append(_doc(run_subprocess("report", target, "--peak", "--format", "json", "--no-cache", cwd=cwd)))
        r = run_subprocess("snapshot", target, "--no-cache", "-o", tmp_path / f"snap{i}.json", cwd=cwd)
        assert r.code == 0, r.stderr
        snapshots.append((tmp_path / f"snap{i}.json").read_bytes())
    assert docs[0] == docs[1] == docs[2]
    assert snapshots[0] == snapshots[1] == snapshots[2]
    text = json.dumps(docs[0])
    assert str(tmp_path) not in text and str(tmp_path.resolve()) not in text
    fn = docs[0]["functions"][0]
    model = proj / "models" / "mlp.py"
    layer2 = _line(model, 'h @ params["w2"]')
    sources = {item["source"] for item in fn["collectives"]["items"]}
    assert f"mlp.py:{layer2}" in sources, sources  # the all-reduce of the second layer's contraction
    assert {f["file"] for item in fn["collectives"]["items"] for f in item["collective"]["source_chain"]
            if not f["file"].startswith("/")} == {"mlp.py"}
    spec = proj / "models" / "mlp.stagetool.yaml"
    w1 = next(x for x in fn["inputs"] if x["path"] == "params/w1")
    assert w1["source"] == f"mlp.stagetool.yaml:{_line(spec, 'params/w1$')}:13"
    buffers = fn["memory"]["peak"]["buffers"]
    assert any(b["file"] == "mlp.py" for b in buffers), buffers


@pytest.mark.slow
def test_a_cache_entry_from_another_checkout_is_a_hit_and_reads_as_this_checkout(tmp_path):
    """Checkout A writes the entry; checkout B (same cache folder) hits it: "cached" in its report,
    which equals B's report without the cache and A's; B's compiled text names B's files, not A's;
    an edit of B's model misses."""
    a, b = _project(tmp_path / "a" / "proj"), _project(tmp_path / "b" / "proj")
    cache = tmp_path / "cache"
    target = "models/mlp.py:train_step"
    report = ("report", target, "--peak", "--format", "json")

    cold_a = run_subprocess(*report, "--cache-dir", cache, cwd=a)
    assert json.loads(cold_a.stdout)["functions"][0]["cached"] is False
    entries = sorted((cache / "facts").glob("*/*.json"))
    assert len(entries) == 1
    assert str(a) not in entries[0].read_text() and ROOT_TOKEN in entries[0].read_text()

    warm_b = run_subprocess(*report, "--cache-dir", cache, cwd=b)
    assert json.loads(warm_b.stdout)["functions"][0]["cached"] is True  # a hit: nothing compiled
    plain_b = run_subprocess(*report, "--no-cache", cwd=b)
    assert _doc(warm_b) == _doc(plain_b) == _doc(cold_a)

    snaps = {}
    for name, cwd, cache_args in (("a", a, ("--cache-dir", cache)), ("b", b, ("--cache-dir", cache)),
                                  ("b-cold", b, ("--no-cache",))):
        r = run_subprocess("snapshot", target, *cache_args, "-o", tmp_path / f"{name}.json", cwd=cwd)
        assert r.code == 0, r.stderr
        snaps[name] = (tmp_path / f"{name}.json").read_bytes()
    assert snaps["a"] == snaps["b"] == snaps["b-cold"]

    compiled = run_subprocess("compile", target, "--cache-dir", cache, "--format", "json", cwd=b)
    assert compiled.code == 0, compiled.stderr
    (fn,) = compiled.json()["functions"]
    assert fn["cached"] is True
    text = fn["module"]["text"]  # XLA's compiled text as XLA writes it: absolute paths, B's own
    files = set(re.findall(r'source_file="([^"]+)"', text)) | set(re.findall(r'"(/[^"]*mlp\.py)"', text))
    assert str((b / "models" / "mlp.py").resolve()) in files and not any(str(a) in f for f in files), files

    model = b / "models" / "mlp.py"
    model.write_text("\n" + model.read_text())  # every line moves down one
    moved = run_subprocess(*report, "--cache-dir", cache, cwd=b)
    doc = json.loads(moved.stdout)["functions"][0]
    assert doc["cached"] is False
    layer2 = _line(model, 'h @ params["w2"]')
    assert f"mlp.py:{layer2}" in {item["source"] for item in doc["collectives"]["items"]}
