"""The Python API: the same report as the CLI, as typed records; importing it does not import JAX."""

from __future__ import annotations

import subprocess
import sys

from helpers import REPO


def test_api_returns_the_report_the_cli_renders(run_cli, monkeypatch):
    monkeypatch.chdir(REPO)
    import stagetool

    report = stagetool.analyze(stagetool.Options(target="examples/mlp.py:train_step", mesh="2x4"),
                               [stagetool.Section.SHARDINGS, stagetool.Section.COST])
    (fn,) = report.functions
    assert isinstance(fn, stagetool.FunctionReport) and isinstance(fn.inputs[0], stagetool.LeafReport)
    assert fn.memory is None and fn.collectives is None        # only what was asked for
    doc = run_cli("shardings", "examples/mlp.py:train_step", "--mesh", "2x4", "--format", "json", check=0).json()
    assert [x["compiled"] for x in doc["functions"][0]["inputs"]] == [str(x.compiled) for x in fn.inputs]  # the report holds structure; JSON holds its text
    assert fn.cost.per_device.flops > 0


def test_import_stagetool_does_not_import_jax():
    code = "import stagetool, sys; stagetool.Options; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def _init_source():
    import ast

    return ast.parse((REPO / "stagetool/__init__.py").read_text())


def test_every_name_of_the_api_reference_is_importable_from_stagetool():
    """Each ``::: module.name`` of docs/api-reference.md is ``stagetool.name``, the very object the
    page documents, listed in ``__all__``; and every public name of ``stagetool`` is on the page."""
    import importlib
    import re

    import stagetool

    documented = re.findall(r"^::: ([\w.]+)$", (REPO / "docs/api-reference.md").read_text(), re.M)
    assert len(documented) >= 20
    for path in documented:
        module, _, name = path.rpartition(".")
        assert name in stagetool.__all__, f"{path}: not in stagetool.__all__"
        assert stagetool._EXPORTS[name] == module, f"{path}: stagetool imports it from {stagetool._EXPORTS[name]}"
        assert getattr(stagetool, name) is getattr(importlib.import_module(module), name), path
    assert sorted(p.rpartition(".")[2] for p in documented) == sorted(set(stagetool.__all__) - {"__version__"})


def test_type_checkers_see_every_lazy_export():
    """Type checkers and IDEs do not run ``__getattr__``: the ``if TYPE_CHECKING:`` block imports
    exactly the lazy exports (``from module import name as name``, an explicit re-export), and
    ``__all__`` is a literal list of them."""
    import ast

    import stagetool

    tree = _init_source()
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING")
    seen = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom), ast.unparse(node)
        for alias in node.names:
            assert alias.asname == alias.name, f"{ast.unparse(node)}: write 'import {alias.name} as {alias.name}'"
            seen[alias.name] = node.module
    assert seen == stagetool._EXPORTS
    (all_,) = [n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "__all__"]
    assert isinstance(all_.value, ast.List) and all(isinstance(e, ast.Constant) for e in all_.value.elts)
    assert [e.value for e in all_.value.elts] == ["__version__", *stagetool._EXPORTS]
