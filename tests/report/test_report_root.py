"""Paths in reports are relative to the spec's folder (issue 21, items 3 and 6).

The same command run from another working directory, or in another checkout of the same project,
prints the same paths; the facts cache keys source locations relative to the spec's folder, so an
entry made in one checkout is a hit in another, and reads there as that checkout's own compile. Files
elsewhere in the spec's project (a spec in `configs/`, the model in `src/`) read `../src/m.py`.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from helpers import EXAMPLES, REPO, run_subprocess
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

    # `compile` prints XLA's text with its callers' frames, so it keys on them (f0da482): A's compile
    # writes the entry B's compile reads
    assert run_subprocess("compile", target, "--cache-dir", cache, "--format", "json", cwd=a).code == 0
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


# ---- the project around the spec's folder: paths outside that folder, in the same project ---------------


def test_the_project_is_the_nearest_folder_with_a_marker_and_never_home_or_the_filesystem_root(tmp_path,
                                                                                              monkeypatch):
    from stagetool.core.paths import find_project

    (tmp_path / "home" / "me" / "repo" / "pkg" / "configs").mkdir(parents=True)
    home, repo = tmp_path / "home" / "me", tmp_path / "home" / "me" / "repo"
    monkeypatch.setattr(Path, "home", classmethod(lambda cls: home))
    configs = (repo / "pkg" / "configs").resolve()
    assert find_project(configs) is None                       # no marker up to the home folder
    (home / ".git").mkdir()                                    # a dotfiles repository in the home folder
    assert find_project(configs) is None
    (repo / ".git").write_text("gitdir: /elsewhere/.git/worktrees/repo\n")  # a worktree's .git is a file
    assert find_project(configs) == repo.resolve()
    for marker in ("pyproject.toml", "setup.py", "setup.cfg"):
        (repo / "pkg" / marker).write_text("")
        assert find_project(configs) == (repo / "pkg").resolve()  # the nearest wins
        (repo / "pkg" / marker).unlink()
    (configs / "setup.cfg").write_text("")
    assert find_project(configs) == configs                    # the spec's own folder can be the project
    # outside the home folder the search goes up to, but never to, the filesystem root
    monkeypatch.setattr(Path, "home", classmethod(lambda cls: tmp_path / "nobody"))
    (configs / "setup.cfg").unlink(), (repo / ".git").unlink()
    assert find_project(configs) == home.resolve()


def test_paths_in_the_project_outside_the_spec_folder_go_up_with_dotdot():
    root = ReportRoot("/home/me/proj/a/configs", (), "a/configs/m.stagetool.yaml", "/home/me/proj",
                      ("/mnt/link/proj",), ("/home/me/proj/.venv",), ("/home/me/proj/stagetool",))
    cases = {  # text: (relative, portable)
        "/home/me/proj/a/configs/m.py:3": ("m.py:3", f"{ROOT_TOKEN}/a/configs/m.py:3"),
        "/home/me/proj/a/src/m.py:27": ("../src/m.py:27", f"{ROOT_TOKEN}/a/src/m.py:27"),   # the shortest ../
        "/home/me/proj/src/m.py:27 ← /home/me/proj/a/configs2/x.py:1":
            ("../../src/m.py:27 ← ../configs2/x.py:1", f"{ROOT_TOKEN}/src/m.py:27 ← {ROOT_TOKEN}/a/configs2/x.py:1"),
        "/mnt/link/proj/src/m.py:4": ("../../src/m.py:4", f"{ROOT_TOKEN}/src/m.py:4"),     # through a link
        "a/configs/m.stagetool.yaml:14:13": ("m.stagetool.yaml:14:13", f"{ROOT_TOKEN}/a/configs/m.stagetool.yaml:14:13"),
        'loc("/home/me/proj/src/m.py":27:13)': ('loc("../../src/m.py":27:13)', f'loc("{ROOT_TOKEN}/src/m.py":27:13)'),
        # a Python environment in the project: absolute in reports, from the token in the cache
        "/home/me/proj/.venv/lib/python3.12/site-packages/flax/linen/linear.py:88":
            ("/home/me/proj/.venv/lib/python3.12/site-packages/flax/linen/linear.py:88",
             f"{ROOT_TOKEN}/.venv/lib/python3.12/site-packages/flax/linen/linear.py:88"),
        "/home/me/proj/a/configs/env/lib/python3.12/site-packages/optax/x.py:1":   # any site-packages
            ("/home/me/proj/a/configs/env/lib/python3.12/site-packages/optax/x.py:1",
             f"{ROOT_TOKEN}/a/configs/env/lib/python3.12/site-packages/optax/x.py:1"),
        "/home/me/proj/src/site_packages_notes.py:2": ("../../src/site_packages_notes.py:2",
                                                       f"{ROOT_TOKEN}/src/site_packages_notes.py:2"),
        # stagetool's own code in a checkout of stagetool: never rewritten
        "/home/me/proj/stagetool/pipeline.py:9": ("/home/me/proj/stagetool/pipeline.py:9",
                                                  "/home/me/proj/stagetool/pipeline.py:9"),
        # outside the project, or not a path start: unchanged
        "/home/me/proj2/m.py:1": ("/home/me/proj2/m.py:1", "/home/me/proj2/m.py:1"),
        "/x/home/me/proj/src/m.py:1": ("/x/home/me/proj/src/m.py:1", "/x/home/me/proj/src/m.py:1"),
        "/usr/lib/python3/x.py:1": ("/usr/lib/python3/x.py:1", "/usr/lib/python3/x.py:1"),
    }
    assert {k: (root.relative(k), root.portable(k)) for k in cases} == cases
    assert root.position == "a/configs" and root.base == "/home/me/proj"
    assert root.local(root.portable("/home/me/proj/src/m.py:27")) == "/home/me/proj/src/m.py:27"
    assert ReportRoot("/p", (), None, "/p").position == "." == ReportRoot("/p").position
    with pytest.raises(ValueError, match="does not hold"):
        ReportRoot("/p/configs", (), None, "/q")

    assert not ReportRoot('/p"x/configs', (), None, '/p"x').plain


def test_report_root_finds_the_project_its_links_and_the_environment_inside_it(tmp_path, monkeypatch):
    proj = tmp_path / "proj"
    (proj / "configs").mkdir(parents=True)
    (proj / "pyproject.toml").write_text("")
    (tmp_path / "link").symlink_to(proj)
    venv = proj / ".venv"
    monkeypatch.setattr("sys.prefix", str(venv))
    monkeypatch.setattr("sys.exec_prefix", str(venv))
    root = report_root(tmp_path / "link" / "configs" / "m.stagetool.yaml")
    real = proj.resolve()
    assert (root.folder, root.project) == (str(real / "configs"), str(real))
    assert root.aliases == (str(tmp_path / "link" / "configs"),) and root.project_aliases == (str(tmp_path / "link"),)
    assert str(real / ".venv") in root.environments
    assert root.relative(f"{tmp_path}/link/src/m.py:3") == "../src/m.py:3" == root.relative(f"{real}/src/m.py:3")
    assert root.relative(f"{real}/.venv/lib/python3.12/x.py:3") == f"{real}/.venv/lib/python3.12/x.py:3"
    # stagetool's own code, in a checkout of stagetool, is never rewritten (the cache key leaves it out)
    import stagetool

    own = Path(stagetool.__file__).resolve().parent
    here = report_root(EXAMPLES / "mlp.stagetool.yaml")
    assert here.project == str(REPO) and here.relative(f"{REPO}/examples/mlp.py:1") == "mlp.py:1"
    if REPO in own.parents:  # stagetool imported from this checkout (not an installed copy)
        assert str(own) in here.foreign
        assert here.relative(f"{own}/pipeline.py:9") == f"{own}/pipeline.py:9" == here.portable(f"{own}/pipeline.py:9")
    # no marker above the spec's folder: as before, only the folder itself
    (proj / "pyproject.toml").unlink()
    alone = report_root(proj / "configs" / "m.stagetool.yaml")
    assert alone.project is None and alone.relative(f"{real}/src/m.py:3") == f"{real}/src/m.py:3"


def _configs_project(folder: Path, *, marker: bool = True) -> Path:
    """A project laid out as many are: ``pyproject.toml``, ``configs/m.stagetool.yaml`` with
    ``target: ../src/m.py:train_step``, ``src/m.py`` (examples/mlp.py whose second layer calls a
    library in the project's own virtualenv, ``.venv/lib/python3.12/site-packages/mlplib.py``)."""
    (folder / "configs").mkdir(parents=True)
    (folder / "src").mkdir()
    site = folder / ".venv" / "lib" / "python3.12" / "site-packages"
    site.mkdir(parents=True)
    if marker:
        (folder / "pyproject.toml").write_text("[project]\nname = 'm'\n")
    (site / "mlplib.py").write_text("def dense(h, w, b):\n    return h @ w + b\n")
    model = (EXAMPLES / "mlp.py").read_text()
    model = model.replace("import jax\nimport jax.numpy as jnp\n", (
        "import pathlib\nimport sys\n\nimport jax\nimport jax.numpy as jnp\n\n"
        "sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / '.venv/lib/python3.12/site-packages'))\n"
        "from mlplib import dense  # noqa: E402\n"), 1)
    model = model.replace('logits = h @ params["w2"] + params["b2"]', 'logits = dense(h, params["w2"], params["b2"])')
    assert "dense(h" in model and "mlplib" in model
    (folder / "src" / "m.py").write_text(model)
    spec = (EXAMPLES / "mlp.stagetool.yaml").read_text().replace("mlp.py:", "../src/m.py:")
    (folder / "configs" / "m.stagetool.yaml").write_text(spec)
    return folder


@pytest.mark.slow
def test_a_spec_in_configs_beside_src_reads_the_same_in_two_checkouts_and_hits_the_cache(tmp_path):
    """Two copies of a project (configs/ + src/ + .venv/): JSON reports equal, every project path
    relative to configs/ (``../src/m.py:N``), the virtualenv's library absolute (each copy's own);
    the second copy's report is a cache hit equal to its own --no-cache run, its compiled text names
    only its own files; snapshots byte-identical."""
    a, b = _configs_project(tmp_path / "a" / "proj"), _configs_project(tmp_path / "b" / "proj")
    cache = tmp_path / "cache"
    report = ("report", "--spec", "configs/m.stagetool.yaml", "--peak", "--format", "json")

    cold_a = run_subprocess(*report, "--cache-dir", cache, cwd=a)
    assert cold_a.code == 0, cold_a.stderr
    assert cold_a.json()["functions"][0]["cached"] is False
    (entry,) = (cache / "facts").glob("*/*.json")
    assert str(a) not in entry.read_text() and f"{ROOT_TOKEN}/src/m.py" in entry.read_text()
    warm_b = run_subprocess("report", "--spec", "m.stagetool.yaml", "--peak", "--format", "json",  # another cwd
                            "--cache-dir", cache, cwd=b / "configs")
    assert warm_b.code == 0, warm_b.stderr
    assert warm_b.json()["functions"][0]["cached"] is True
    plain_b = run_subprocess(*report, "--no-cache", cwd=b)
    doc_a, doc_b, doc_b_plain = _doc(cold_a), _doc(warm_b), _doc(plain_b)
    # the virtualenv's library is each copy's own absolute path: the one place the reports differ
    lib_a, lib_b = (str(p.resolve() / ".venv/lib/python3.12/site-packages/mlplib.py") for p in (a, b))
    assert lib_b in json.dumps(doc_b) and lib_a in json.dumps(doc_a) and lib_a not in json.dumps(doc_b)
    assert json.loads(json.dumps(doc_a).replace(lib_a, lib_b)) == doc_b == doc_b_plain

    fn = doc_b["functions"][0]
    model = b / "src" / "m.py"
    layer2 = _line(model, 'logits = dense(h, params["w2"]')
    assert f"../src/m.py:{layer2}" in {item["source"] for item in fn["collectives"]["items"]}
    chain = [f["file"] for item in fn["collectives"]["items"] for f in item["collective"]["source_chain"]]
    assert "../src/m.py" in chain and lib_b in chain, chain
    spec = b / "configs" / "m.stagetool.yaml"
    w1 = next(x for x in fn["inputs"] if x["path"] == "params/w1")
    assert w1["source"] == f"m.stagetool.yaml:{_line(spec, 'params/w1$')}:13"
    text = json.dumps(doc_b).replace(lib_b, "")
    assert str(tmp_path) not in text and str(tmp_path.resolve()) not in text

    snaps = []
    for i, (cwd, cache_args) in enumerate(((a, ("--cache-dir", cache)), (b, ("--cache-dir", cache)),
                                           (b, ("--no-cache",)))):
        r = run_subprocess("snapshot", "--spec", "configs/m.stagetool.yaml", *cache_args, "-o",
                           tmp_path / f"s{i}.json", cwd=cwd)
        assert r.code == 0, r.stderr
        snaps.append((tmp_path / f"s{i}.json").read_bytes())
    assert snaps[0] == snaps[1] == snaps[2]

    # `compile` keys on its callers' frames too (f0da482): A's compile writes the entry B's reads
    assert run_subprocess("compile", "--spec", "configs/m.stagetool.yaml", "--cache-dir", cache,
                          "--format", "json", cwd=a).code == 0
    compiled = run_subprocess("compile", "--spec", "configs/m.stagetool.yaml", "--cache-dir", cache,
                              "--format", "json", cwd=b)
    assert compiled.code == 0, compiled.stderr
    (cfn,) = compiled.json()["functions"]
    assert cfn["cached"] is True
    text = cfn["module"]["text"]  # XLA's compiled text as XLA writes it: absolute paths, B's own
    files = set(re.findall(r'source_file="([^"]+)"', text)) | set(re.findall(r'"(/[^"]*\.py)"', text))
    assert {str(model.resolve()), lib_b} <= files, files
    assert not any(str(a) in f or str(a.resolve()) in f for f in files), files


@pytest.mark.slow
def test_without_a_project_marker_files_outside_the_spec_folder_stay_absolute(tmp_path):
    """No pyproject.toml, setup.py, setup.cfg or .git above the spec: only the spec's folder is the
    root, as before — ``../src/m.py`` is written absolute, and another copy misses the cache."""
    a, b = (_configs_project(tmp_path / x / "proj", marker=False) for x in "ab")
    cache = tmp_path / "cache"
    report = ("report", "--spec", "configs/m.stagetool.yaml", "--format", "json", "--cache-dir", cache)
    first = run_subprocess(*report, cwd=a)
    assert first.code == 0, first.stderr
    model = (a / "src" / "m.py").resolve()
    layer2 = _line(model, 'logits = dense(h, params["w2"]')
    fn = first.json()["functions"][0]
    assert f"{model}:{layer2}" in {item["source"] for item in fn["collectives"]["items"]}
    assert next(x for x in fn["inputs"] if x["path"] == "params/w1")["source"].startswith("m.stagetool.yaml:")
    other = run_subprocess(*report, cwd=b)
    assert other.code == 0 and other.json()["functions"][0]["cached"] is False
