"""Issue 32, what fits: a refused compile explained, the largest batch per knob setting (``fit``),
and what-if changes on an out-of-memory, each compiled."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import write

from stagetool.devices import tpu_topology as topology

DATA = Path(__file__).resolve().parent / "data"
needs_libtpu = pytest.mark.skipif(not topology.libtpu_available(), reason="libtpu not installed: pip install -e '.[tpu]'")

ATTENTION_SPEC = """
version: 1
mesh:
  axes: {data: 8}
functions:
  attention:
    target: attention_scores.py:attention
    args:
      - 'f32[${batch},16,1024,128] @ [data, null, null, null]'
      - 'f32[${batch},16,1024,128] @ [data, null, null, null]'
      - 'f32[${batch},16,1024,128] @ [data, null, null, null]'
    static: {remat: '${remat}'}
"""


def _scores_line() -> int:
    lines = (DATA / "attention_scores.py").read_text().splitlines()
    return next(i for i, line in enumerate(lines, start=1) if line.rstrip().endswith("# scores"))


@pytest.fixture
def attention_dir(tmp_path, monkeypatch, isolated_imports):
    monkeypatch.chdir(tmp_path)
    shutil.copy(DATA / "attention_scores.py", tmp_path / "attention_scores.py")
    return tmp_path


@needs_libtpu
def test_a_refused_compile_names_its_largest_buffer_and_line(run_cli, attention_dir):
    """Batch 2048 on data=8 (256 per device): the scores are f32[256,16,1024,1024] = 16 GiB per device,
    q, k, v and the output 2 GiB each: 24 GiB, over a v5e's 15.75 GiB. XLA refuses the compile; the
    buffers come from the dump it wrote before refusing, and the largest is the scores, made on the
    ``# scores`` line."""
    write(attention_dir, "a.stagetool.yaml", ATTENTION_SPEC.replace("${batch}", "2048").replace("${remat}", "none"))
    r = run_cli("memory", "--spec", "a.stagetool.yaml", "--topology", "v5e:2x4", "--no-cache", "--format", "json",
                check=0)
    m = r.json()["functions"][0]["memory"]
    assert m["verdict"]["fits"] is False and m["out_of_memory"]["needed_bytes"] == 24 * 2**30
    peak = m["peak"]
    assert peak["reason"] is None and "refused" in peak["note"]
    top = peak["buffers"][0]
    per_device_batch = 2048 // 8
    assert top["shape"] == f"f32[{per_device_batch},16,1024,1024]"
    assert top["size_bytes"] == per_device_batch * 16 * 1024 * 1024 * 4
    assert top["file"].endswith("attention_scores.py") and top["line"] == _scores_line()
    assert peak["peak_bytes"] == top["size_bytes"] + 4 * per_device_batch * 16 * 1024 * 128 * 4
    # the inputs are named by their leaf paths (q, k, v)
    assert {b["op_name"] for b in peak["buffers"]} >= {"q", "k", "v"}
    text = run_cli("memory", "--spec", "a.stagetool.yaml", "--topology", "v5e:2x4", "--no-cache", check=0).stdout
    assert "over by 8.25 GiB" in text and f"attention_scores.py:{_scores_line()}" in text
    assert "buffers of the program XLA refused" in text
