"""Target loading: file paths, module names, attribute paths, import like pytest, clear errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import write

from stagetool.core.errors import TargetError
from stagetool.inputs.target import load_target, split_target, user_frame

pytestmark = pytest.mark.usefixtures("isolated_imports")


def test_split_target():
    assert split_target("a/b.py:f") == ("a/b.py", "f")
    assert split_target("C:/x/m.py:obj.f") == ("C:/x/m.py", "obj.f")
    for bad in ("m.py", "m.py:", ":f"):
        with pytest.raises(TargetError, match="must be 'path/to/file.py:func'"):
            split_target(bad)


def test_file_target_with_sibling_import(tmp_path):
    write(tmp_path, "proj/util.py", "SCALE = 3\n")
    write(tmp_path, "proj/model.py", """
        import util

        def f(x):
            return x * util.SCALE

        class Holder:
            class Inner:
                @staticmethod
                def g(x):
                    return x + 1
    """)
    t = load_target("proj/model.py:f", base_dir=tmp_path)
    assert t.fn(2) == 6 and t.qualname == "f"
    assert Path(t.module_file) == tmp_path / "proj" / "model.py"
    assert str(tmp_path / "proj") in sys.path
    assert load_target("proj/model.py:Holder.Inner.g", base_dir=tmp_path).fn(1) == 2
    # Absolute paths need no base_dir.
    assert load_target(f"{tmp_path}/proj/model.py:f").fn(1) == 3


def test_file_in_a_package_imports_like_pytest(tmp_path):
    write(tmp_path, "pkg/__init__.py", "")
    write(tmp_path, "pkg/sub/__init__.py", "")
    write(tmp_path, "pkg/sub/helper.py", "def double(x):\n    return 2 * x\n")
    write(tmp_path, "pkg/sub/model.py", """
        from .helper import double
        from pkg.sub import helper

        def f(x):
            return double(x) + helper.double(x)
    """)
    t = load_target("pkg/sub/model.py:f", base_dir=tmp_path)
    assert t.fn(1) == 4
    assert sys.modules["pkg.sub.model"].__file__ == str(tmp_path / "pkg" / "sub" / "model.py")
    assert str(tmp_path) in sys.path            # the first folder above the packages, as pytest's rootdir


def test_module_target_from_the_working_directory(tmp_path, monkeypatch):
    write(tmp_path, "mymod_for_target.py", "class Obj:\n    attr = staticmethod(lambda x: x - 1)\n")
    monkeypatch.chdir(tmp_path)
    assert load_target("mymod_for_target:Obj.attr").fn(5) == 4


def test_two_files_with_the_same_name(tmp_path):
    write(tmp_path, "a/model.py", "def f():\n    return 'a'\n")
    write(tmp_path, "b/model.py", "def f():\n    return 'b'\n")
    assert load_target("a/model.py:f", base_dir=tmp_path).fn() == "a"
    assert load_target("b/model.py:f", base_dir=tmp_path).fn() == "b"


def test_missing_file_lists_close_matches(tmp_path):
    write(tmp_path, "model.py", "")
    write(tmp_path, "models.py", "")
    with pytest.raises(TargetError) as info:
        load_target("modle.py:f", base_dir=tmp_path)
    assert f"file {tmp_path / 'modle.py'} not found; close matches in {tmp_path}: model.py" in info.value.message
    with pytest.raises(TargetError) as info:
        load_target("nodir/model.py:f", base_dir=tmp_path)
    assert "not found" in info.value.message and "does not exist either" in info.value.hint


def test_missing_module_lists_close_matches():
    with pytest.raises(TargetError) as info:
        load_target("stagetool.inputs.targte:load_target")
    assert info.value.message == ("target 'stagetool.inputs.targte:load_target': no module named "
                                  "'stagetool.inputs.targte'; close matches: target")
    with pytest.raises(TargetError, match="no module named 'no_such_module_xyz'"):
        load_target("no_such_module_xyz:f")


def test_missing_attribute_lists_close_matches(tmp_path):
    write(tmp_path, "m.py", "def train_step():\n    pass\n\ndef eval_step():\n    pass\n\nclass C:\n    def method(self):\n        pass\n")
    with pytest.raises(TargetError) as info:
        load_target("m.py:train_stpe", base_dir=tmp_path)
    assert info.value.message == "target 'm.py:train_stpe': m has no attribute 'train_stpe'; close matches: train_step, eval_step"
    with pytest.raises(TargetError) as info:
        load_target("m.py:zzz", base_dir=tmp_path)
    assert "no attribute 'zzz'" in info.value.message
    assert info.value.hint == "callables there: C, eval_step, train_step"
    with pytest.raises(TargetError, match=r"m\.C has no attribute 'methd'; close matches: method"):
        load_target("m.py:C.methd", base_dir=tmp_path)


def test_not_callable(tmp_path):
    write(tmp_path, "m.py", "X = 3\n")
    with pytest.raises(TargetError, match="is a int, not a callable"):
        load_target("m.py:X", base_dir=tmp_path)


def test_import_failure_names_the_users_line(tmp_path):
    path = write(tmp_path, "broken.py", "import os\n\nVALUE = 1 / 0\n")
    with pytest.raises(TargetError) as info:
        load_target("broken.py:f", base_dir=tmp_path)
    assert "importing broken failed: ZeroDivisionError: division by zero" in info.value.message
    assert f"at {path}:3 in <module>" in info.value.message


def test_missing_dependency_of_the_users_module(tmp_path):
    write(tmp_path, "needs.py", "import not_installed_pkg_xyz\n")
    with pytest.raises(TargetError) as info:
        load_target("needs.py:f", base_dir=tmp_path)
    # Not "no module named needs": the user's module exists, its import failed.
    assert "importing needs failed: No module named 'not_installed_pkg_xyz'" in info.value.message


def test_syntax_error(tmp_path):
    path = write(tmp_path, "syn.py", "def f(:\n    pass\n")
    with pytest.raises(TargetError) as info:
        load_target("syn.py:f", base_dir=tmp_path)
    assert "SyntaxError" in info.value.message and f"at {path}:1" in info.value.message


def test_user_frame_prefers_the_users_file(tmp_path):
    path = write(tmp_path, "uf.py", "def inner():\n    raise ValueError('x')\n\ndef outer():\n    inner()\n")
    mod = load_target("uf.py:outer", base_dir=tmp_path)
    try:
        mod.fn()
    except ValueError as e:
        frame = user_frame(e, [str(path)])
    assert frame == f"{path}:2 in inner\n    raise ValueError('x')"


def test_user_frame_is_never_stagetools_own_code():
    import stagetool.inputs.target as target_module

    try:
        split_target("no-colon")
    except TargetError as e:
        # Even named as a user file, stagetool's frame is not the user's line: the caller's is.
        frame = user_frame(e, [target_module.__file__])
    assert frame.startswith(f"{Path(__file__).resolve()}:") and "in test_user_frame_is_never_stagetools_own_code" in frame


@pytest.mark.parametrize("dots, root", [(".", "src/proj"), ("..", "src")])
def test_relative_imports_in_a_folder_without_init_say_the_module_form(run_cli, tmp_path, monkeypatch, dots, root):
    """Issue 30, item 6: a file target in a folder without ``__init__.py`` whose module imports
    relative to its package is exit 2 naming the module form and the folder to run from (as deep as
    its relative imports reach); following the hint stages, with XLA's FLOPs of x @ w."""
    write(tmp_path, "src/proj/models/layers.py", "def dense(x, w):\n    return x @ w\n")
    write(tmp_path, "src/proj/layers.py", "def dense(x, w):\n    return x @ w\n")
    write(tmp_path, "src/proj/models/model.py", f"""
        from {dots}layers import dense

        def f(x, w):
            return dense(x, w)
    """)
    spec = write(tmp_path, "src/proj/models/model.stagetool.yaml", """
        version: 1
        functions:
          f:
            target: model.py:f
            args: ['f32[8,16]', 'f32[16,4]']
    """)
    monkeypatch.chdir(tmp_path)
    r = run_cli("cost", "src/proj/models/model.py:f", check=2)
    module = "models.model" if dots == "." else "proj.models.model"
    assert "attempted relative import" in r.stderr and "model.py:1 in <module>" in r.stderr
    assert f"name it in the module form, {module}:f" in r.stderr
    assert f"run stagetool from {tmp_path / root} " in r.stderr.replace("\n", " ")
    assert "Traceback" not in r.stderr

    spec.write_text(spec.read_text().replace("model.py:f", f"{module}:f"))
    monkeypatch.chdir(tmp_path / root)
    doc = run_cli("cost", "--spec", spec, "--format", "json", check=0).json()
    assert doc["functions"][0]["cost"]["per_device"]["flops"] == 2 * 8 * 16 * 4


def test_an_attribute_named_as_a_module_is_named_in_the_hint(run_cli, tmp_path, monkeypatch):
    """New-user trial (docs/trials.md, miniGPT): ``{call: flax.nnx.metrics:Average}`` (the spelling
    ``nnx.metrics.Average`` suggests) said only "no module named 'flax.nnx.metrics'" with a hint about
    file targets; ``metrics`` is an attribute of ``flax.nnx``, and the hint now names the target that
    loads."""
    nnx = pytest.importorskip("flax.nnx")
    with pytest.raises(TargetError) as e:
        load_target("flax.nnx.metrics:Average", need_callable=False)
    assert e.value.message == "target 'flax.nnx.metrics:Average': no module named 'flax.nnx.metrics'"
    assert e.value.hint == ("metrics is an attribute of the module flax.nnx, not a module of its own: name it "
                            "flax.nnx:metrics.Average")
    assert load_target("flax.nnx:metrics.Average", need_callable=False).fn is nnx.metrics.Average
    # a real missing module keeps the file-target hint
    with pytest.raises(TargetError) as e:
        load_target("flax.nnx.nope:f")
    assert e.value.hint.startswith("a file target needs its path and .py")
    # through the CLI, at the spec's line, before any compile
    write(tmp_path, "m.py", "def f(m, x):\n    return x\n")
    write(tmp_path, "m.stagetool.yaml", """
        version: 1
        functions:
          f:
            target: m.py:f
            args:
              - {call: flax.nnx.metrics:Average, args: [loss]}
              - f32[4]
        """)
    monkeypatch.chdir(tmp_path)
    r = run_cli("shardings", check=2)
    assert "m.stagetool.yaml:6:" in r.stderr and "name it flax.nnx:metrics.Average" in r.stderr
