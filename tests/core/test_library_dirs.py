"""Which source files are a library's, not the user's (stagetool.core.paths.library_dirs and
is_library_file): the folders are read once per set of imported libraries, not once per question.

A staging asks once per module or frame; with Keras imported the Keras leaf names alone asked for
every one of ~4,000 modules, and each answer re-read ``sysconfig`` and resolved every folder again
(about 9 s of CPU per staging in the test session)."""

from __future__ import annotations

import sys
import sysconfig
import types

from stagetool.core import paths


def test_the_folders_are_resolved_once_for_many_questions(monkeypatch, tmp_path):
    calls = []
    real = sysconfig.get_paths

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(sysconfig, "get_paths", counting)
    paths._library_dirs.cache_clear()
    user = tmp_path / "model.py"
    user.write_text("x = 1\n")
    answers = [paths.is_library_file(str(user)) for _ in range(200)]
    answers += [paths.is_library_file(sysconfig.__file__) for _ in range(200)]
    assert answers == [False] * 200 + [True] * 200
    assert len(calls) == 1


def test_a_library_imported_later_is_a_library_from_then_on(monkeypatch, tmp_path):
    folder = tmp_path / "chex"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    module_file = folder / "__init__.py"
    monkeypatch.delitem(sys.modules, "chex", raising=False)
    assert not paths.is_library_file(str(module_file))  # a folder of the user's, so far
    fake = types.ModuleType("chex")
    fake.__file__ = str(module_file)
    monkeypatch.setitem(sys.modules, "chex", fake)
    assert paths.is_library_file(str(module_file))
    assert str(folder.resolve()) + "/" in paths.library_dirs()
