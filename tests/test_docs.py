"""The documentation: the site builds in strict mode, and every ``stagetool ...`` example in it runs.

The documents are README.md and the site's pages (``mkdocs.yml``'s nav, ``docs/``; a page's
``--8<-- "file"`` includes read as that file's text). Their examples (docs/contributing.md,
"Writing the documentation"):

- a ``stagetool`` line of a ``sh``/``console``/``bash`` fenced block (``$ stagetool ...`` in a
  console block) is *run*, in document order, in a folder holding a copy of ``examples/`` and a
  ``stagetool.yaml`` (the MLP example's spec, as a user's own), and must exit 0 — unless the line
  just before the fence is ``<!-- illustration -->`` (not run) or ``<!-- tested-in: tests/x.py -->``
  (run by that test: its file must name the command's target and every option and value);
- every ``stagetool ...`` in the documents (fenced or inline, ``code`` spans too) is parsed by the
  CLI's own click command: a renamed or removed command or option fails here, without a compile;
- every ``python`` fenced block runs in a fresh Python (``<!-- illustration -->`` before it opts
  out), the reader's own names (``train_step``, ``params``...) from tests/data/docs_names.py;
- every path of the checkout the documents, ``.ci/run`` and the matrix's legs name exists.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import REPO

ILLUSTRATION = "<!-- illustration -->"
TESTED_IN = re.compile(r"<!-- tested-in: (\S+) -->")
RUN_LEXERS = {"sh", "console", "bash", "shell"}


@dataclasses.dataclass(frozen=True)
class Example:
    """One ``stagetool`` command of the documents: its arguments (after ``stagetool``), where it is
    written, how it is checked, and the file its stdout is redirected to (``> report.md``)."""

    argv: tuple[str, ...]
    where: str
    mode: str  # "run" | "illustration" | "tested-in:<path>" | "inline"
    redirect: str | None = None


def site_pages() -> list[Path]:
    """The site's pages in nav order (mkdocs.yml), ``docs/_incoming/`` never among them."""
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]

    def walk(node):
        if isinstance(node, str):
            yield node
        elif isinstance(node, list):
            for item in node:
                yield from walk(item)
        elif isinstance(node, dict):
            for value in node.values():
                yield from walk(value)

    return [REPO / "docs" / page for page in walk(nav)]


def documents() -> list[tuple[str, str]]:
    """``(name, text)`` of README.md and every page, snippet includes expanded."""
    out = [("README.md", (REPO / "README.md").read_text())]
    for page in site_pages():
        text = re.sub(r'^--8<-- "([^"]+)"$', lambda m: (REPO / m.group(1)).read_text(), page.read_text(),
                      flags=re.M)
        out.append((str(page.relative_to(REPO)), text))
    return out


def _command(line: str) -> tuple[tuple[str, ...], str | None] | None:
    """The arguments after ``stagetool`` in one shell line (``.venv/bin/stagetool`` too; environment
    assignments before it allowed), up to ``&&``/``|``/``;``, and the file of a ``>`` redirect."""
    line = line.split("  #")[0].strip()
    try:
        words = shlex.split(line)
    except ValueError:
        return None
    starts = [i for i, w in enumerate(words) if w == "stagetool" or w.endswith("/stagetool")]
    if not starts:
        return None
    argv = words[starts[0] + 1:]
    for stop in ("&&", "|", ";", "||"):
        if stop in argv:
            argv = argv[:argv.index(stop)]
    redirect = None
    if ">" in argv:
        redirect = argv[argv.index(">") + 1]
        argv = argv[:argv.index(">")]
    return tuple(argv), redirect


def examples() -> list[Example]:
    """Every ``stagetool`` command of the documents, in order."""
    found: list[Example] = []
    for name, text in documents():
        lines = text.splitlines()
        i = 0
        prose: list[str] = []
        while i < len(lines):
            fence = re.match(r"^(\s*)```(\w*)", lines[i])
            if not fence:
                prose.append(lines[i])
                i += 1
                continue
            before = next((ln.strip() for ln in reversed(lines[:i]) if ln.strip()), "")
            lexer, start = fence.group(2), i
            i += 1
            body: list[str] = []
            while i < len(lines) and not lines[i].strip().startswith("```"):
                body.append(lines[i])
                i += 1
            i += 1
            if lexer not in RUN_LEXERS:
                continue
            mode = "run"
            if before == ILLUSTRATION:
                mode = "illustration"
            elif TESTED_IN.fullmatch(before):
                mode = "tested-in:" + TESTED_IN.fullmatch(before).group(1)
            joined = "\n".join(body).replace("\\\n", " ")
            for n, line in enumerate(joined.splitlines()):
                if lexer == "console":
                    if not line.startswith("$ "):
                        continue
                    line = line[2:]
                cmd = _command(line)
                if cmd is not None:
                    found.append(Example(cmd[0], f"{name}:{start + 1} (block)", mode, cmd[1]))
        for span in re.findall(r"`((?:\S+/)?stagetool [^`]+)`", "\n".join(prose)):
            cmd = _command(span)
            if cmd is not None:
                found.append(Example(cmd[0], f"{name}: `{span}`", "inline", cmd[1]))
    return found


def _click_command():
    import typer.main

    from stagetool.cli import app

    return typer.main.get_command(app)


def parse(argv: tuple[str, ...]) -> str | None:
    """Check ``argv`` against the CLI's click commands (their option tables; a value of an option
    with choices against its choices): None when it fits, else what is wrong. Nothing runs. Prose
    placeholders (``<command>``, ``...``, ``[--flag]``) are allowed, and a fragment may end on an
    option without its value (``stagetool why --leaf``)."""
    def options(command) -> dict:  # Typer's click (it vendors one): its options by duck type
        table = {o: p for p in command.params if p.param_type_name == "option" for o in p.opts + p.secondary_opts}
        table.update({h: None for h in ("-h", "--help")})
        return table

    def consume(table: dict, args: list[str], where: str) -> str | None:
        while args:
            word = args.pop(0)
            if not word.startswith("-") or word == "-" or re.fullmatch(r"-\d.*", word):
                continue
            name, eq, value = word.partition("=")
            if name not in table:
                close = [o for o in table if o.lstrip("-")[:3] == name.lstrip("-")[:3]]
                return f"{where} has no option {name}" + (f" (it has {', '.join(close)})" if close else "")
            param = table[name]
            if param is None or param.is_flag or param.count:
                continue
            if not eq:
                if not args:
                    return None  # a fragment that names the option alone
                value = args.pop(0)
            choices = getattr(param.type, "choices", None)
            if choices and not re.fullmatch(r"<[^>]*>|\w*\|.*", value):
                try:
                    param.type.convert(value, param, None)
                except Exception as e:  # click's BadParameter
                    return f"{where} {name}: {getattr(e, 'format_message', e.__str__)()}"
        return None

    group = _click_command()
    args = [a[1:-1] if a.startswith("[") and a.endswith("]") else a for a in argv if a not in ("...", "…")]
    root: list[str] = []
    while args and args[0].startswith("-"):
        root.append(args.pop(0))
        if root[-1] in ("--coordinator", "--num-processes", "--process-id") and args:
            root.append(args.pop(0))
    if (why := consume(options(group), root, "stagetool")) is not None:
        return why
    if not args:
        return None if argv else "no command"
    name, rest = args[0], args[1:]
    if re.fullmatch(r"<\w+>", name):
        return None
    command = group.commands.get(name)
    if command is None:
        return f"no command {name!r} (commands: {', '.join(group.commands)})"
    return consume(options(command), [a for a in rest if not re.fullmatch(r"<[^>]*>", a)], f"stagetool {name}")


EXAMPLES = examples()


def test_the_documents_hold_command_examples_of_every_kind():
    """The scan finds what the documents hold: a test that scanned nothing could not fail."""
    modes = {e.mode.split(":")[0] for e in EXAMPLES}
    assert modes == {"run", "illustration", "tested-in", "inline"}, modes
    assert sum(e.mode == "run" for e in EXAMPLES) >= 15
    assert any(e.argv[:1] == ("fit",) for e in EXAMPLES)


def test_every_command_example_parses_with_the_clis_own_options():
    """A renamed command or option breaks this test, not the reader (fenced and inline examples alike)."""
    bad = [f"{e.where}: stagetool {shlex.join(e.argv)}\n    {why}" for e in EXAMPLES if (why := parse(e.argv))]
    assert not bad, "\n".join(bad)


def test_the_parser_check_fails_a_renamed_option():
    assert parse(("collectives", "examples/mlp.py:train_step", "--explain", "w1")) is None
    assert "has no option --explian" in parse(("collectives", "examples/mlp.py:train_step", "--explian", "w1"))
    assert "--format" in parse(("report", "examples/mlp.py:train_step", "--format", "markdwn"))
    assert "has no option --rank" in parse(("sweep", "--rank", "step"))
    assert "no command 'colectives'" in parse(("colectives", "examples/mlp.py:train_step"))


def test_examples_marked_tested_in_another_test_are_in_it():
    """``<!-- tested-in: FILE -->``: that test file names the command, its target and each option
    (by one of its names) and value, so the example cannot drift from what the test runs."""
    group = _click_command()
    for e in (e for e in EXAMPLES if e.mode.startswith("tested-in:")):
        text = (REPO / e.mode.split(":", 1)[1]).read_text()
        command = group.commands[e.argv[0]]
        names = {o: p.opts + p.secondary_opts for p in command.params for o in p.opts + p.secondary_opts}
        for word in e.argv:
            alternatives = names.get(word, [word])
            assert any(f'"{a}"' in text for a in alternatives), (e.where, word, e.mode)


def test_the_getting_started_page_has_the_readmes_commands():
    """The install and test commands and the quick start's commands are written twice (README.md and
    docs/getting-started.md): the same."""
    readme = (REPO / "README.md").read_text()
    page = (REPO / "docs/getting-started.md").read_text()
    for after in ("Install and run the main job", "Install and run the tests", "Then:"):
        blocks = [re.search(re.escape(after) + r".*?```sh\n(.*?)```", t, re.S) for t in (readme, page)]
        assert blocks[0] and blocks[1] and blocks[0].group(1) == blocks[1].group(1), after


def _needs(argv: tuple[str, ...]) -> str | None:
    """What an example needs that this environment lacks (a skip reason), or None."""
    text = " ".join(argv)
    for marker, module, extra in (("nnx_lm", "flax", "flax"), ("linen_lm", "flax", "flax"),
                                  ("equinox_lm", "equinox", "equinox")):
        if marker in text and importlib.util.find_spec(module) is None:
            return f"{module} is not installed (the {extra} extra)"
    if re.search(r"--topology[ =]v\d", text) or "--topology" in text and "v5" in text:
        if importlib.util.find_spec("libtpu") is None:
            return "libtpu is not installed (the tpu extra)"
    return None


@pytest.mark.slow
def test_every_fenced_command_example_runs(run_cli, tmp_path, monkeypatch):
    """Each ``stagetool`` line of a runnable fenced block, once (a line written on several pages runs
    once), in document order (``check`` after the ``snapshot`` that writes its baseline), exits 0.
    README.md's quick start writes the lock file and a Markdown report that begins with the
    function's heading."""
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    spec = (REPO / "examples/mlp.stagetool.yaml").read_text().replace(" mlp.py:", " examples/mlp.py:")
    (tmp_path / "stagetool.yaml").write_text(spec)
    monkeypatch.chdir(tmp_path)
    # the facts cache on (the suite turns it off): one function staged by several commands compiles once
    monkeypatch.delenv("STAGETOOL_NO_CACHE", raising=False)
    monkeypatch.setenv("STAGETOOL_CACHE_DIR", str(tmp_path / "facts-cache"))
    elsewhere = {e.argv for e in EXAMPLES if e.mode.startswith("tested-in:")}  # run by that test
    runnable = [e for e in EXAMPLES if e.mode == "run" and e.argv not in elsewhere]
    quick_start = [e for e in runnable if e.where.startswith("README.md")]
    assert len(quick_start) >= 8
    seen: set[tuple] = set()
    skipped: list[str] = []
    timings: list[tuple[float, str]] = []
    for e in runnable:
        if (e.argv, e.redirect) in seen:
            continue
        seen.add((e.argv, e.redirect))
        if (why := _needs(e.argv)) is not None:
            skipped.append(f"{e.where}: {why}")
            continue
        t0 = time.perf_counter()
        r = run_cli(*e.argv)
        timings.append((time.perf_counter() - t0, shlex.join(e.argv)))
        assert r.code == 0, f"{e.where}: stagetool {shlex.join(e.argv)}\n{r.stderr}"
        if e.redirect is not None:
            (tmp_path / e.redirect).write_text(r.stdout)
    assert (tmp_path / "stagetool.lock.json").exists()
    report = (tmp_path / "report.md").read_text()  # whose decisions (no hardware named), then the function
    assert report.startswith("> **XLA:CPU's decisions on 8 simulated CPU devices")
    assert report.split("\n\n", 1)[1].startswith("## `train_step`")
    if os.environ.get("STAGETOOL_DOCS_TIMINGS"):
        print("\n".join(f"{s:6.1f} s  {c}" for s, c in sorted(timings, reverse=True)), file=sys.stderr)
    if skipped:
        pytest.skip("ran the others; not run here: " + "; ".join(skipped))


def _mkdocs(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


needs_mkdocs = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("mkdocs", "material", "mkdocstrings_handlers")),
    reason="the docs extra is not installed (pip install -e '.[docs]')")


@needs_mkdocs
def test_the_site_builds_in_strict_mode(tmp_path):
    """``mkdocs build --strict``: a broken link or anchor, a page missing from the nav, a docstring
    mkdocstrings cannot render or an include that is not there fails it."""
    r = _mkdocs("build", "--strict", "--site-dir", str(tmp_path / "site"), cwd=REPO)
    assert r.returncode == 0, r.stderr[-4000:]
    site = tmp_path / "site"
    assert (site / "html-report.png").exists() and (site / "memory-timeline.png").exists()
    assert 'src="../html-report.png"' in (site / "html-report/index.html").read_text()
    api = (site / "api-reference/index.html").read_text()
    assert "stagetool.live.inspect" in api and "LiveReport" in api and "timeout_s" in api
    assert not (site / "_incoming").exists()


@needs_mkdocs
def test_a_broken_anchor_fails_the_strict_build(tmp_path):
    """The site's own settings (mkdocs.yml) make a link to a missing anchor an error: a copy of the
    site with one such link added does not build."""
    shutil.copytree(REPO / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("_incoming"))
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    config["plugins"] = ["search"]  # the API reference needs the source; the anchors are what is tested
    config["nav"] = ["index.md", "limits.md", "commands.md"]
    config["validation"]["omitted_files"] = "info"
    for ext in config["markdown_extensions"]:  # includes are read from the repository
        if isinstance(ext, dict) and "pymdownx.snippets" in ext:
            ext["pymdownx.snippets"]["base_path"] = [str(REPO)]
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    (tmp_path / "docs/index.md").write_text("# Home\n\nSee [the exit codes](commands.md#exit-codes).\n")
    assert _mkdocs("build", "--strict", "--site-dir", str(tmp_path / "a"), cwd=tmp_path).returncode == 0
    (tmp_path / "docs/index.md").write_text("# Home\n\nSee [the exit codes](commands.md#exit-code).\n")
    r = _mkdocs("build", "--strict", "--site-dir", str(tmp_path / "b"), cwd=tmp_path)
    assert r.returncode == 1 and "does not contain an anchor '#exit-code'" in r.stderr, r.stderr[-2000:]


#: A repository path as the documents write one: a top folder of the checkout, then a file or folder.
REPO_PATH = re.compile(r"(?<![\w./~-])((?:\.\./)*(?:tests|examples|bench|stagetool|docs|action|\.ci|shared)/[\w./-]*)")
#: Paths the documents name that are not files of the checkout, and why.
NOT_FILES = {
    "tests/test_x.py": "a placeholder for a test file",
    "tests/x.py": "a placeholder (<!-- tested-in: tests/x.py -->)",
    "docs/_incoming/": "made when Markdown is handed in for a page (docs/contributing.md); empty otherwise",
}


def test_every_file_the_documents_and_ci_name_exists():
    """A path of the checkout named in README.md, a page, ``.ci/run`` or ``tests/matrix.py``'s legs is
    there (``stagetool/__init__`` as a module: with ``.py``), and none points outside it (``../``).
    Placeholders with ``<...>`` are not paths."""
    sys.path.insert(0, str(REPO / "tests"))
    try:
        import matrix
    finally:
        sys.path.remove(str(REPO / "tests"))
    texts = [*documents(), (".ci/run", (REPO / ".ci/run").read_text()),
             ("tests/matrix.py LEG_TESTS", " ".join(matrix.LEG_TESTS))]
    missing, named = [], 0
    for name, text in texts:
        for m in REPO_PATH.finditer(text):
            path = m.group(1).rstrip(".")
            if text[m.end():m.end() + 1] in "<*" or path in NOT_FILES:
                continue
            named += 1
            if path.startswith("../") or not ((REPO / path).exists() or (REPO / f"{path}.py").exists()):
                missing.append(f"{name}: {path}")
    assert named >= 50, named  # the scan finds paths: a test that read nothing could not fail
    assert not missing, "\n".join(missing)


# ---- the documents' Python examples --------------------------------------------------------------

#: The names a ```python block may take as the reader's own (tests/data/docs_names.py defines them).
GIVEN = REPO / "tests/data/docs_names.py"


@dataclasses.dataclass(frozen=True)
class PythonBlock:
    """One ```python block of the documents: where it is, its code, and whether it is run."""

    where: str
    code: str
    run: bool


def python_blocks() -> list[PythonBlock]:
    """Every ```python block of README.md and the pages (an indented one, in a list, dedented); one
    marked ``<!-- illustration -->`` on the line before its fence is not run."""
    import textwrap

    found = []
    for name, text in documents():
        lines = text.splitlines()
        i = 0
        while i < len(lines):
            fence = re.match(r"^(\s*)```python\s*$", lines[i])
            if not fence:
                i += 1
                continue
            before = next((ln.strip() for ln in reversed(lines[:i]) if ln.strip()), "")
            start, i = i, i + 1
            body = []
            while i < len(lines) and not lines[i].strip().startswith("```"):
                body.append(lines[i])
                i += 1
            found.append(PythonBlock(f"{name}:{start + 1}", textwrap.dedent("\n".join(body)) + "\n",
                                     before != ILLUSTRATION))
    return found


#: Run in a fresh process per block: the block (after tests/data/docs_names.py when it uses a name
#: defined there), then each ``test_*`` function it defines, with ``stagetool_snapshot`` standing for
#: the fixture (it stages as stagetool.inspect does).
_RUNNER = """
import ast, inspect, sys
given, where, code = sys.argv[1], sys.argv[2], sys.stdin.read()
top = ast.parse(open(given).read()).body
names = {t.id for n in top for t in getattr(n, "targets", []) if isinstance(t, ast.Name) and t.id[0] != "_"}
names |= {n.name for n in top if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | {"stagetool"}
used = {n.id for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Name)}
ns = {"__name__": "__docs__", "__file__": given}
if used & names:
    exec(compile(open(given).read(), given, "exec"), ns)
before = set(ns)
exec(compile(code, where, "exec"), ns)
import stagetool
for name, fn in list(ns.items()):
    if name.startswith("test_") and name not in before and callable(fn):
        params = inspect.signature(fn).parameters
        fn(**{p: stagetool.inspect for p in params if p == "stagetool_snapshot"})
        print("ran", name)
"""


PYTHON_BLOCKS = python_blocks()


def test_the_documents_hold_python_examples():
    """The scan finds the blocks (one indented in a list among them): a scan that found none could not fail."""
    assert len(PYTHON_BLOCKS) >= 6 and sum(b.run for b in PYTHON_BLOCKS) >= 6
    assert any(b.where.startswith("README.md") for b in PYTHON_BLOCKS)
    assert any("cfg = Config(" in b.code and b.code.startswith("cfg") for b in PYTHON_BLOCKS)


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in PYTHON_BLOCKS if b.run], ids=lambda b: b.where)
def test_every_python_example_runs(block, tmp_path):
    """Each ```python block runs to the end in a fresh Python (imports, calls and asserts as written),
    from the checkout's root (``examples/mlp.py`` is there), the names of tests/data/docs_names.py
    given. ``<!-- illustration -->`` before the fence opts a block out (it needs what is not here)."""
    if 'topology="v' in block.code and importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (the tpu extra)")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "STAGETOOL_NO_CACHE": "1"}
    r = subprocess.run([sys.executable, "-c", _RUNNER, str(GIVEN), block.where], input=block.code, cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{block.where}:\n{block.code}\n{r.stderr[-3000:]}"
