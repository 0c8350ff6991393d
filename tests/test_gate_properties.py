"""The gate's comparisons, property-tested (issue 47): every figure a snapshot holds, made better, worse
or left equal, gives an improvement, a regression (beyond its tolerance) or a change within it, or
nothing; never an error, in every format the gate writes.

The expectations are stated here from the documented rules (docs/ci-gate.md; the default tolerances
of :data:`stagetool.core.tolerances.DEFAULT_TOLERANCES` as the docs print them), not read from the
code under test.
"""

from __future__ import annotations

import copy
import json
import xml.etree.ElementTree as ET

from hypothesis import given, settings
from hypothesis import strategies as st

from stagetool.gate import render
from stagetool.gate.compare import compare
from stagetool.report import Format

_SETTINGS = dict(deadline=None, derandomize=True, database=None, max_examples=150)

#: every gated figure: (path in the entry, the tolerance the docs give it as a fraction, more is worse)
FIGURES = (
    (("memory", "argument_bytes"), 0.01, True),
    (("memory", "output_bytes"), 0.01, True),
    (("memory", "temp_bytes"), 0.01, True),
    (("memory", "peak_bytes"), 0.01, True),
    (("memory", "host_peak_bytes"), 0.01, True),
    (("memory", "alias_bytes"), 0.01, False),  # less aliasing is worse
    (("cost", "flops"), 0.01, True),
    (("cost", "transcendentals"), 0.01, True),
    (("cost", "bytes_accessed"), 0.01, True),
    (("cost", "loop_aware_flops"), 0.01, True),
    (("collectives", 0, "count"), 0.0, True),
    (("collectives", 0, "bytes_per_device"), 0.0, True),
    (("collectives", 0, "bytes_per_step"), 0.0, True),
    (("step_time", "seconds"), 0.05, True),
    (("dcn_bytes_per_step",), 0.0, True),
)


def entry() -> dict:
    """One function's snapshot entry with every gated figure (a TPU mesh, a step time on tpu-v5e)."""
    return {
        "mesh": {"axes": [["data", 2]], "platform": "tpu", "device_kind": "TPU v5 lite", "device_count": 2},
        "inputs": [{"path": "x", "shape": [8, 8], "dtype": "float32", "sharding": "P('data', None)",
                    "bytes_per_device": 128, "unused": False, "declared": "P('data', None)"}],
        "outputs": [{"path": "out", "shape": [8, 8], "dtype": "float32", "sharding": "P('data', None)",
                     "bytes_per_device": 128, "unused": False}],
        # own output bytes (output - alias) equal the aliased ones: an alias drop of d grows them by d
        "memory": {"argument_bytes": 1 << 20, "output_bytes": 1 << 21, "alias_bytes": 1 << 20, "temp_bytes": 1 << 22,
                   "peak_bytes": 1 << 23, "host_peak_bytes": 1 << 16},
        "cost": {"flops": 1e9, "transcendentals": 1e6, "bytes_accessed": 1e8, "loop_aware_flops": 2e9},
        "collectives": [{"kind": "all-reduce", "axes": "data", "count": 4, "bytes_per_device": 4096,
                         "bytes_per_step": 8192}],
        "step_time": {"chip": "tpu-v5e", "seconds": 1e-3, "overlapped_seconds": 9e-4, "serial_seconds": 1.1e-3,
                      "parts": {"compute": 8e-4, "ICI (data)": 2e-4}, "bound": "compute"},
        "dcn_bytes_per_step": 1 << 20,
    }


def doc(e: dict) -> dict:
    return {"kind": "stagetool-snapshot", "snapshot_schema": 3, "jax_version": "0.9", "jaxlib_version": "0.9",
            "functions": {"f": e}}


def _set(e: dict, path: tuple, value) -> None:
    for k in path[:-1]:
        e = e[k]
    e[path[-1]] = value


def _get(e: dict, path: tuple):
    for k in path:
        e = e[k]
    return e


def _every_format(cmp) -> None:
    """Every renderer writes the comparison (and the JSON and JUnit parse)."""
    for fmt in (Format.text, Format.markdown, Format.html):
        assert render.render(cmp, fmt)
    assert json.loads(render.render(cmp, Format.json))["functions"]
    ET.fromstring(render.junit_xml(cmp))


def _figure_changes(cmp, path):
    what = {"collectives": "collective all-reduce over data", "step_time": "step time",
            "dcn_bytes_per_step": "bytes over DCN per step"}.get(path[0], ".".join(map(str, path)))
    changes = list(cmp.functions[0].changes)
    if path[0] == "collectives":
        suffix = {"count": ": count", "bytes_per_device": ": bytes", "bytes_per_step": ": bytes per step"}[path[2]]
        return [c for c in changes if c.what == what + suffix]
    return [c for c in changes if c.what.startswith(what)]


@settings(**_SETTINGS)
@given(figure=st.sampled_from(FIGURES), direction=st.sampled_from(("better", "worse", "equal")),
       size=st.floats(min_value=1e-4, max_value=0.9))
def test_every_gated_figure_better_worse_or_equal(figure, direction, size):
    path, tolerance, more_is_worse = figure
    before = entry()
    after = copy.deepcopy(before)
    old = _get(before, path)
    grow = (direction == "worse") == more_is_worse
    new = old if direction == "equal" else old * (1 + size) if grow else old * (1 - size)
    if path[-1] == "count" and direction != "equal":
        new = old + 1 if grow else old - 1
    _set(after, path, new)
    cmp = compare(doc(before), doc(after))
    _every_format(cmp)
    found = _figure_changes(cmp, path)
    if direction == "equal":
        assert not cmp.functions[0].changes and cmp.exit_code() == 0
        return
    (change,) = found
    assert (change.before_value, change.after_value) == (old, new)
    if direction == "better":
        assert change.status == "improvement" and cmp.exit_code() == 0
        return
    beyond = abs(new - old) > tolerance * old * (1 + 1e-9)
    within = abs(new - old) < tolerance * old * (1 - 1e-9)
    if beyond:
        assert change.status == "regression" and cmp.exit_code() == 1, change
    elif within:
        assert change.status == "changed" and cmp.exit_code() == 0 and "within tolerance" in change.note, change


@settings(**_SETTINGS)
@given(figure=st.sampled_from(FIGURES), side=st.sampled_from(("baseline", "now")))
def test_a_figure_on_one_side_only_is_shown_never_an_error(figure, side):
    path = figure[0]
    before, after = entry(), entry()
    _set(before if side == "baseline" else after, path, None)
    cmp = compare(doc(before), doc(after))
    _every_format(cmp)
    assert cmp.exit_code() in (0, 1)
    if path != ("dcn_bytes_per_step",):  # no DCN figure is a single slice: 0 bytes between slices, compared
        assert all(c.status != "regression" for c in _figure_changes(cmp, path))
