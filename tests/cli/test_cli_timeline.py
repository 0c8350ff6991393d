"""The memory timeline through the CLI (issue 24): ``memory.timeline`` and ``memory.timeline_peak``
in JSON, the sparkline in text, on the transformer example (CPU and a v5e topology) and on a scanned
decoder with and without remat.

The contract checked on each: the timeline's maximum plus the named differences is the gated peak
the same report gives (``memory.record.peak_bytes``), to the byte.
"""

from __future__ import annotations

import os

import pytest
from helpers import REPO, run_subprocess

from stagetool.core.units import format_bytes
from stagetool.devices import gpu_topology, tpu_topology as topology

DECODER = REPO / "tests" / "data" / "remat_decoder.stagetool.yaml"


def check_timeline(memory: dict) -> dict:
    """The invariants of one function's timeline; returns ``timeline_peak``."""
    points, tp = memory["timeline"], memory["timeline_peak"]
    assert tp["reason"] is None and points
    assert [p["position"] for p in points] == list(range(len(points))) == list(range(tp["steps"]))
    assert max(p["bytes"] for p in points) == tp["bytes"] == points[tp["position"]]["bytes"]
    assert min(p["bytes"] for p in points) >= tp["baseline_bytes"]
    assert tp["gated_peak_bytes"] == memory["record"]["peak_bytes"]
    assert tp["bytes"] + sum(d["bytes"] for d in tp["differences"]) == tp["gated_peak_bytes"]
    assert all(d["what"] for d in tp["differences"])
    assert tp["buffers"] and sum(b["bytes"] for b in tp["buffers"]) <= tp["bytes"]
    return tp


@pytest.mark.slow
def test_transformer_timeline_on_cpu(run_cli_shared, monkeypatch):
    monkeypatch.chdir(REPO)
    r = run_cli_shared("memory", "examples/transformer.py:train_step", "--format", "json", check=0)
    m = r.json()["functions"][0]["memory"]
    tp = check_timeline(m)
    rec = m["record"]
    # XLA:CPU allocates the arguments, the outputs not aliased to them and one temp block: the
    # timeline's allocations are those (read from the HloProto, XLA's figures from memory_analysis()).
    assert tp["allocated_bytes"] == rec["argument_bytes"] + rec["output_bytes"] - rec["alias_bytes"] + rec["temp_bytes"]
    assert tp["baseline_bytes"] == rec["argument_bytes"] + rec["output_bytes"] - rec["alias_bytes"]
    # The peak is in the backward scan (the while of transpose(jvp())), at the scan's line.
    assert tp["op"].endswith("transpose(jvp())/while") and tp["source_line"].endswith("transformer.py:106")
    # inside the loop's body: the gradient of the MLP's down-projection, `x + h @ layer["w_down"]`
    assert "transpose(jvp())/while/body" in tp["inside_op"] and tp["inside_source_line"].endswith("transformer.py:93")
    by_leaf = {b["leaf"]: b for b in m["timeline_peak"]["buffers"] if b["leaf"]}
    assert all(b["kind"].startswith("parameter") for b in by_leaf.values())
    text = run_cli_shared("memory", "examples/transformer.py:train_step", check=0).stdout
    line = next(ln for ln in text.splitlines() if ln.startswith("memory over time ("))
    assert f"({tp['steps']} steps, per device)" in line and f"peak {format_bytes(tp['bytes'])} at step {tp['position']}" in line
    spark = line.split(": ", 1)[1].split(" ", 1)[0]
    assert 0 < len(spark) <= 48 and set(spark) <= set("▁▂▃▄▅▆▇█") and "█" in spark


@pytest.mark.slow
@pytest.mark.skipif(not topology.libtpu_available(), reason="libtpu not installed: pip install -e '.[tpu]'")
def test_transformer_timeline_on_v5e(run_cli_shared, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    args = ("memory", "examples/transformer.py:train_step", "--topology", "v5e:2x4")
    r = run_cli_shared(*args, "--format", "json", check=0)  # the one compile; text and HTML read the facts cache
    m = r.json()["functions"][0]["memory"]
    tp = check_timeline(m)
    # XLA:TPU keeps this small model's activations in VMEM (memory space 1): listed apart with their
    # space, never in the timeline's (HBM) bytes or its buffers (issue 41, item 5).
    assert all(b["memory_space"] == 0 for b in tp["buffers"])
    assert tp["on_chip_buffers"] and all(b["memory_space"] != 0 for b in tp["on_chip_buffers"])
    vmem = next(s for s in tp["on_chip"] if s["memory_space"] == 1)
    assert vmem["space"] == "VMEM" and vmem["max_bytes"] > tp["bytes"] >= tp["baseline_bytes"]
    assert sum(b["bytes"] for b in tp["on_chip_buffers"] if b["memory_space"] == 1) <= vmem["at_peak_bytes"]
    # XLA:TPU's own peak (its heap simulation over HBM and on-chip memory, with the executable's
    # code) is above the HBM live; the differences name the on-chip bytes as on-chip, and what it
    # counts beyond the allocations of every space holds the code.
    rec = m["record"]
    assert tp["bytes"] < rec["peak_bytes_reported"] == rec["peak_bytes"]
    first = tp["differences"][0]["what"]
    assert first.startswith("on-chip memory live at step") and "VMEM" in first
    assert not any("leaves out temporaries" in d["what"] for d in tp["differences"])
    beyond = tp["differences"][-1]
    assert "peak_memory_in_bytes" in beyond["what"] and beyond["bytes"] >= rec["generated_code_bytes"] > 0
    allocated_every_space = tp["allocated_bytes"] + sum(s["allocated_bytes"] for s in tp["on_chip"])
    assert beyond["bytes"] == rec["peak_bytes"] - allocated_every_space
    on_chip = f"on-chip memory, apart from these HBM bytes: VMEM {format_bytes(vmem['at_peak_bytes'])} live at the peak"
    text = run_cli_shared(*args, check=0).stdout
    assert "per device, HBM only): " in text and f"peak {format_bytes(tp['bytes'])} at step {tp['position']}" in text
    assert on_chip in text
    run_cli_shared(*args, "--format", "html", "-o", str(tmp_path / "m.html"), check=0)
    page = (tmp_path / "m.html").read_text()
    assert "<h4>Memory over time (HBM)</h4>" in page and on_chip.capitalize() in page


@pytest.mark.slow
@pytest.mark.parametrize("topology_name", [
    None,
    pytest.param("v5e:1x1", marks=pytest.mark.skipif(not topology.libtpu_available(),
                                                    reason="libtpu not installed: pip install -e '.[tpu]'")),
])
def test_scanned_decoder_with_remat(run_cli, topology_name):
    """Remat keeps one [B, S, D] input per layer instead of each layer's [B, S, F] activations: the
    timeline's peak drops by at least (L - 1) · B · S · F · 4 bytes, and each peak is in the backward
    scan, the remat one while it recomputes the layer (its op is under ``checkpoint``). On v5e:1x1
    XLA:TPU keeps these activations in VMEM: the drop is in the on-chip figure, and the timeline's
    HBM bytes (parameters and inputs) do not count it (issue 41, item 5; before, VMEM was added to
    them: 14,291,468 B against 25,432,588 B)."""
    where = ("--topology", topology_name) if topology_name else ()
    r = run_cli("memory", "--spec", DECODER, *where, "--format", "json", check=0)
    fs = {f["name"]: f["memory"] for f in r.json()["functions"]}
    remat, plain = check_timeline(fs["step_remat"]), check_timeline(fs["step_plain"])
    L, B, S, F = 6, 8, 64, 512
    saved = (L - 1) * B * S * F * 4
    if topology_name:
        def vmem(tp):
            return next(s["max_bytes"] for s in tp["on_chip"] if s["space"] == "VMEM")

        assert vmem(plain) - vmem(remat) >= saved
        assert abs(plain["bytes"] - remat["bytes"]) < saved
        return
    assert plain["bytes"] - remat["bytes"] >= saved
    for tp in (remat, plain):
        assert tp["op"].endswith("transpose(jvp())/while") and tp["source_line"].endswith("remat_decoder.py:27")
    assert "/checkpoint/" in remat["inside_op"] and "/checkpoint/" not in plain["inside_op"]


@pytest.mark.slow
@pytest.mark.skipif(not gpu_topology.cuda_plugin_available(),
                    reason="JAX's CUDA plugin is not installed: pip install -e '.[gpu-aot]'")
def test_transformer_timeline_on_h100():
    """A compile-only H100 target (in a fresh process: a GPU target's backend starts alone). XLA:GPU's
    peak_memory_in_bytes is its heap simulation's high-water mark: the timeline agrees within 0.1%."""
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != str(REPO)]
    r = run_subprocess("memory", "examples/transformer.py:train_step", "--topology", "h100:8", "--format", "json",
                       env={"PYTHONPATH": os.pathsep.join([str(REPO), *extra])}, timeout=900)
    assert r.code == 0, r.stderr
    m = r.json()["functions"][0]["memory"]
    tp = check_timeline(m)
    reported = m["record"]["peak_bytes_reported"]
    assert abs(tp["bytes"] - reported) <= 0.001 * reported


@pytest.mark.slow
def test_buffers_live_at_the_peak_are_the_timelines_peak(run_cli_shared, monkeypatch):
    """One peak (trial 2, finding 10): the "live at the peak" table is taken at the timeline's peak,
    and its buffers, summed, are the bytes the timeline has at that step. On the transformer XLA's
    live-range dump names another position (205: it sums HLO values in another way); the note says so."""
    monkeypatch.chdir(REPO)
    r = run_cli_shared("memory", "examples/transformer.py:train_step", "--top", "1000", "--format", "json", check=0)
    m = r.json()["functions"][0]["memory"]
    tp, peak = check_timeline(m), m["peak"]
    assert peak["step"] == tp["position"] and peak["position"] == tp["schedule_position"]
    assert len(peak["buffers"]) == peak["buffer_count"] == tp["buffer_count"]
    assert all(b["memory_space"] == "device" for b in peak["buffers"])
    summed = sum(b["size_bytes"] for b in peak["buffers"])
    assert summed == peak["peak_bytes"] == tp["bytes"] == m["timeline"][tp["position"]]["bytes"]
    # XLA's own moment is elsewhere, and fewer bytes are live there than at the timeline's peak.
    assert peak["xla_position"] != peak["position"]
    assert peak["xla_listed_bytes"] < tp["bytes"]
    assert f"XLA's live-range dump calls schedule position {peak['xla_position']} its peak" in peak["note"]
    text = run_cli_shared("memory", "examples/transformer.py:train_step", check=0).stdout
    assert f"live at the peak (step {tp['position']}: {format_bytes(tp['bytes'])} device" in text
    assert f"peak {format_bytes(tp['bytes'])} at step {tp['position']}" in text


@pytest.mark.slow
@pytest.mark.skipif(not topology.libtpu_available(), reason="libtpu not installed: pip install -e '.[tpu]'")
def test_xla_tpu_memory_spaces_are_named_as_xla_names_them(run_cli_shared, monkeypatch):
    """Trial 2, finding 14d: the transformer on v5e:2x4 holds scalars in XLA:TPU's memory space 6,
    which XLA's memory-usage report calls ``color_6``: the title says "XLA memory space 6 (unnamed)"
    with the bytes of its buffers, and the note says what is known once."""
    monkeypatch.chdir(REPO)
    r = run_cli_shared("memory", "examples/transformer.py:train_step", "--topology", "v5e:2x4", "--top", "1000",
                "--format", "json", check=0)
    m = r.json()["functions"][0]["memory"]
    peak, tp = m["peak"], check_timeline(m)
    other = dict(peak["other_bytes"])
    assert other["XLA memory space 6 (unnamed)"] == sum(
        b["size_bytes"] for b in peak["buffers"] if b["memory_space"] == "XLA memory space 6 (unnamed)") > 0
    assert not any(k.startswith("memory space") for k in other)
    assert peak["note"].count("XLA's public sources name only 0 (device), 1 (fast, VMEM on TPU) and 5") == 1
    # the table's device bytes are the timeline's (HBM) bytes at that step; each on-chip space is the
    # timeline's on-chip figure there, apart (issue 41, item 5)
    assert peak["peak_bytes"] == tp["bytes"]
    assert {s["space"]: s["at_peak_bytes"] for s in tp["on_chip"] if s["at_peak_bytes"]} == other
    # a copy-start in a parameter's HBM buffer (XLA:TPU's prefetch into VMEM) is that buffer, in device memory
    assert all(b["memory_space"] == "device" for b in peak["buffers"] if b["value_name"].startswith("copy-start")
               and any(v.startswith("param") for v in b["shared_with"]))
