"""Donation that XLA cannot use is a fact in the report, not a warning on stderr or a failure."""

from __future__ import annotations

from tests.helpers import write


def test_unusable_donation_is_reported_not_raised(run_cli, tmp_path):
    write(tmp_path, "m.py", "def f(a, b):\n    return (a @ b).sum(axis=0)\n")
    spec = write(tmp_path, "m.stagetool.yaml", """\
        version: 1
        mesh: {axes: {data: 2}}
        functions:
          f:
            target: m.py:f
            args: ['f32[8,3] @ [data, null]', 'f32[3,16]']
            donate: [0, 1]
    """)
    r = run_cli("memory", "--spec", str(spec), "--no-peak", "--format", "json", check=0)
    (f,) = r.json()["functions"]
    # Neither input has the size of the f32[16] output, so XLA can alias neither.
    assert {d["path"]: d["status"] for d in f["memory"]["donation"]} == {"a": "not usable", "b": "not usable"}
    assert f["memory"]["record"]["alias_bytes"] == 0
    assert any("donated buffers were not usable" in n for n in f["notes"])
    assert "donated" not in r.stderr
