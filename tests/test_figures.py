"""Issue #10's inputs, end to end through the CLI: every figure true, or labelled as what it is."""

from __future__ import annotations

import json

from helpers import leaves_by_path, write

SGD = """
import jax, jax.numpy as jnp

def step(params, grads):
    new = jax.tree.map(lambda p, g: p - 0.1 * jnp.tanh(g) @ jnp.tanh(g).T @ p, params, grads)
    return new, jnp.sum(new["w"])
"""
SGD_SPEC = """
version: 1
functions:
  step:
    target: sgd.py:step
    args:
      - {w: 'f32[1024,1024]'}
      - {w: 'f32[1024,1024]'}
"""


def test_donation_is_no_peak_regression(run_cli, tmp_path, monkeypatch):
    """Snapshot the SGD step without donation, then check it with ``donate: [0]``: the gated peak is
    arguments + outputs - aliased + temporaries, 20.0 MiB (+20 B) both ways; XLA's
    peak_memory_in_bytes (12.0 MiB -> 8.0 MiB on CPU) is shown but not gated."""
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "sgd.py", SGD)
    write(tmp_path, "sgd.stagetool.yaml", SGD_SPEC)
    run_cli("snapshot", "--spec", "sgd.stagetool.yaml", "-o", "lock.json", check=0)
    before = json.loads((tmp_path / "lock.json").read_text())["functions"]["step"]["memory"]
    assert before["peak_bytes"] == 20 * 2**20 + 20
    write(tmp_path, "sgd.stagetool.yaml", SGD_SPEC + "    donate: [0]\n")
    r = run_cli("check", "--spec", "sgd.stagetool.yaml", "--baseline", "lock.json", "--format", "json", check=0)
    changes = {c["what"]: c for f in json.loads(r.stdout)["functions"] for c in f["changes"]}
    assert "memory.peak_bytes" not in changes or changes["memory.peak_bytes"]["status"] != "regression"
    r = run_cli("memory", "--spec", "sgd.stagetool.yaml", "--format", "json", check=0)
    rec = json.loads(r.stdout)["functions"][0]["memory"]["record"]
    assert rec["peak_bytes"] == 20 * 2**20 + 20 and rec["alias_bytes"] == 4 * 2**20
    assert rec["peak_bytes_reported"] != rec["peak_bytes"]
    r = run_cli("memory", "--spec", "sgd.stagetool.yaml", "--peak", check=0)
    assert "XLA peak_memory_in_bytes" in r.stdout and "gated" in r.stdout
