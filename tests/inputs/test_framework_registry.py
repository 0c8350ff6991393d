"""The frameworks room (issue 29): a framework is one module plus one line in ``FRAMEWORKS``, and
every read of another library's private attribute is marked ``# private-api:``."""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import jax
import pytest

import stagetool.inputs.frameworks as frameworks
from stagetool.inputs.frameworks.dispatch import call_init, model_shardings, prepare_call

PACKAGE = Path(frameworks.__file__).parent


class Boxed:
    """A leaf of a made-up framework ``toyfw``: an array with the mesh axes it should be sharded over."""

    def __init__(self, value, names):
        self.value, self.names = value, names


Boxed.__module__ = "toyfw.core"
jax.tree_util.register_pytree_node(Boxed, lambda b: ((b.value,), b.names), lambda names, c: Boxed(c[0], names))


@pytest.fixture
def toyfw(monkeypatch):
    """``toyfw`` registered as a new framework is: its module, and its line in ``FRAMEWORKS``."""
    module = types.ModuleType("stagetool.inputs.frameworks.toy")
    module.is_box = lambda x: isinstance(x, Boxed)
    module.box_dims = lambda box, rules: tuple(box.names)
    module.init_kwargs = lambda cls, args, kwargs: {**kwargs, "seed": 7}
    module.has_state = lambda tree: isinstance(tree, Boxed)
    module.updated_state = lambda obj: obj.value * 2
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(frameworks.FRAMEWORKS, "toyfw", ("toy",))
    return module


def test_a_registered_framework_is_asked_by_dispatch(toyfw):
    x = jax.ShapeDtypeStruct((8, 4), jax.numpy.float32)
    tree = {"w": Boxed(x, ("data", None)), "b": x}
    assert model_shardings(tree, None) == [None, ("data", None)]  # leaves in key order: b, w

    class Model(Boxed):
        def __init__(self, seed=0):
            self.seed = seed

    assert call_init(Model, [], {}).seed == 7  # its init_kwargs hook

    def step(state, y):
        return y + 1

    prepared = prepare_call(step, (Boxed(x, ()), x), {}, {}, names=["state", "y"], donate_argnums=(),
                            donate_argnames=())
    assert prepared.state_outputs == ("state",)
    out = jax.eval_shape(prepared.fn, *prepared.args)
    assert set(out) == {"out", "state"} and out["state"].shape == (8, 4)  # updated_state: value * 2


def test_without_the_registration_line_nothing_asks_it():
    x = jax.ShapeDtypeStruct((8, 4), jax.numpy.float32)
    assert model_shardings({"w": Boxed(x, ("data", None))}, None) == [None]


def _private_reads(tree: ast.AST):
    """Where code reads another library's private attribute: ``x._name`` (not on ``self``, not
    stagetool's own ``_stagetool_wraps``), ``getattr(x, "_name")`` / ``__wrapped__`` / ``jitted_fn``,
    ``from lib._private import ...``, JAX's ``UnspecifiedValue`` by name."""
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and (n.attr == "jitted_fn" or n.attr.startswith("_") and not n.attr.startswith("__")) \
                and n.attr != "_stagetool_wraps" and not (isinstance(n.value, ast.Name) and n.value.id == "self"):
            yield n
        elif isinstance(n, ast.Call) and getattr(n.func, "id", None) == "getattr" and isinstance(n.args[1], ast.Constant) \
                and (n.args[1].value in ("__wrapped__", "jitted_fn", "fun") or n.args[1].value.startswith("_")
                     and not n.args[1].value.startswith("__")) and n.args[1].value != "_stagetool_wraps":
            yield n
        elif isinstance(n, ast.ImportFrom) and "._" in (n.module or ""):
            yield n
        elif isinstance(n, ast.Constant) and n.value == "UnspecifiedValue":
            yield n


def test_every_private_read_is_marked():
    files = sorted(PACKAGE.glob("*.py")) + [PACKAGE.parent / "own_jit.py"]
    unmarked, found = [], 0
    for path in files:
        text = path.read_text()
        lines = text.splitlines()
        for n in _private_reads(ast.parse(text)):
            found += 1
            if not any("private-api:" in line for line in lines[max(n.lineno - 2, 0):n.end_lineno]):
                unmarked.append(f"{path.name}:{n.lineno}: {lines[n.lineno - 1].strip()}")
    assert found >= 10 and not unmarked, "\n".join(unmarked)
    for name in ("_jit_info", "__wrapped__", "UnspecifiedValue", "_get_pure_args_kwargs", "_preprocess", "_cached"):
        assert name in frameworks.__doc__  # listed in the package docstring
