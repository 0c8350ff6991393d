"""Donation that XLA cannot use, and warnings raised while staging, are facts in the report."""

from __future__ import annotations

from helpers import write


def test_unusable_donation_is_reported(run_cli, tmp_path):
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
    # Neither input's per-device buffer (48 and 192 bytes) has the size of the f32[16] output (64
    # bytes), so XLA can alias neither.
    assert {d["path"]: d["status"] for d in f["memory"]["donation"]} == {"a": "not usable", "b": "not usable"}
    assert f["memory"]["record"]["alias_bytes"] == 0


def test_a_warning_while_staging_becomes_a_note(run_cli, tmp_path):
    write(tmp_path, "w.py", """\
        import warnings

        def f(x):
            warnings.warn("x is traced twice")
            return x * 2
    """)
    spec = write(tmp_path, "w.stagetool.yaml", "functions:\n  f: {target: w.py:f, args: ['f32[4]']}\n")
    r = run_cli("shardings", "--spec", str(spec), "--format", "json", check=0)
    assert r.json()["functions"][0]["notes"] == ["warning while staging: x is traced twice"]
    assert "traced twice" not in r.stderr
