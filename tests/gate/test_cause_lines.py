"""The words of a cause of the model's own annotations (``gate.compare.find_causes``): the user's
module line that wrote the changed annotation comes first, the init's line (the spec's ``init:``, or
the init function building an optimizer whose moments copy the parameter's sharding) after.

The records are a snapshot's inputs as ``stagetool snapshot`` writes them for ``examples/nnx_lm.py``
(read from a real snapshot: the parameter's ``declared_at`` is the ``nnx.Linear`` line of ``down``,
19; its two Adam moments', ``make_optimizer``'s line, 40), before and after the edit
``tests/cli/test_cli_causes.py::test_nnx_with_partitioning_edit`` makes through the CLI.
"""

from __future__ import annotations

from stagetool.gate.compare import find_causes

_MOMENTS = ("optimizer/opt_state/0/mu/", "optimizer/opt_state/0/nu/")


def _inputs(down: str, at: dict[str, str]) -> list[dict]:
    rows = [("model/embed/embedding/value", "P('model', None)"), ("model/mlp/down/kernel/value", down),
            ("model/mlp/up/kernel/value", "P(None, 'model')")]
    rows += [(m + p.removeprefix("model/"), s) for m in _MOMENTS for p, s in rows[:3]]
    return [{"path": p, "declared": s, "declared_by": "model",
             "declared_at": next(v for k, v in at.items() if p.startswith(k))} for p, s in rows]


def _cause(at: dict[str, str]) -> str:
    before = {"inputs": _inputs("P('model', None)", at)}
    after = {"inputs": _inputs("P(None, 'model')", at)}
    causes, unexplained = find_causes("train_step", before, after, [])
    (cause,) = causes
    assert unexplained == [] and len(cause.edits) == 3
    return f"{cause.what} | where {cause.where}"


def test_the_modules_own_line_comes_before_the_init_line():
    at = {"model/embed": "nnx_lm.py:28", "model/mlp/down": "nnx_lm.py:19", "model/mlp/up": "nnx_lm.py:17",
          "optimizer/": "nnx_lm.py:40"}
    # was: "the model's sharding annotations (init at nnx_lm.py:19, nnx_lm.py:40)": the module's line as an init's
    assert _cause(at) == ("the model's sharding annotations at nnx_lm.py:19 (init at nnx_lm.py:40) changed the "
                          "declared sharding of 3 inputs | where nnx_lm.py:19, nnx_lm.py:40")


def test_the_order_holds_whichever_leaf_the_snapshot_lists_first():
    at = {"model/": "nnx_lm.py:19", "optimizer/": "nnx_lm.py:40"}
    before = {"inputs": _inputs("P('model', None)", at)[::-1]}
    after = {"inputs": _inputs("P(None, 'model')", at)[::-1]}
    (cause,), _ = find_causes("train_step", before, after, [])
    assert cause.what.startswith("the model's sharding annotations at nnx_lm.py:19 (init at nnx_lm.py:40) changed")


def test_a_spec_init_line_stays_an_init_line_and_a_module_line_alone_is_no_init():
    # the annotations credited to the spec's init: lines (Linen's logical axes, tunix's init lines)
    assert _cause({"model/": "m.stagetool.yaml:8", "optimizer/": "m.stagetool.yaml:9"}).startswith(
        "the model's sharding annotations (init at m.stagetool.yaml:8, m.stagetool.yaml:9) changed")
    # every changed leaf credited to one module line (moments' lines the same): that line, no init
    assert _cause({"model/": "m.py:19", "optimizer/": "m.py:19"}).startswith(
        "the model's sharding annotations at m.py:19 changed the declared sharding of 3 inputs")
