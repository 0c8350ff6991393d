"""The HTML report (issue 13): device → shard assignment, the page through the CLI, the Markdown's SVG
files, ``check --format html``, and the page in a real headless browser.

Expected assignments come from JAX itself: the same ``NamedSharding`` over ``jax.devices()`` laid
out as the mesh, and ``sharding.devices_indices_map(shape)``, compared with what stagetool computes
from the report's text alone.
"""

from __future__ import annotations

import html.parser
import math
import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import EXAMPLES, REPO, cli_environment, write
from stagetool.report import charts
from stagetool.report.layout import leaf_layout, parse_partition_spec, ranges_text

ARTIFACTS = REPO / "tests" / "artifacts"


def jax_assignment(axes: list[tuple[str, int]], spec: P, shape: tuple[int, ...]) -> dict[int, str]:
    """Device position in ``mesh.devices.flat`` → ``start:stop,...`` of what it holds, by JAX."""
    sizes = tuple(s for _, s in axes)
    mesh = Mesh(np.array(jax.devices()[:math.prod(sizes)]).reshape(sizes), tuple(n for n, _ in axes))
    index = NamedSharding(mesh, spec).devices_indices_map(shape)
    return {i: ",".join(f"{s.start or 0}:{n if s.stop is None else s.stop}" for s, n in zip(index[d], shape))
            for i, d in enumerate(mesh.devices.flat)}


def ours(axes, text, shape) -> dict[int, str]:
    layout = leaf_layout(shape, text, axes)
    assert layout is not None
    return {d.device: ranges_text(d.ranges) for d in layout.devices}


MESH_2x4 = [("data", 2), ("model", 4)]
MESH_3D = [("a", 2), ("b", 2), ("c", 2)]


@pytest.mark.parametrize("axes, text, spec, shape", [
    (MESH_2x4, "P('model')", P("model"), (16,)),                                   # 1-D
    (MESH_2x4, "P('data',)", P("data"), (6,)),
    (MESH_2x4, "P('data', 'model')", P("data", "model"), (8, 16)),                  # 2-D
    (MESH_2x4, "P('model', 'data')", P("model", "data"), (8, 16)),
    (MESH_2x4, "P(None, ('data', 'model'))", P(None, ("data", "model")), (3, 16)),
    (MESH_2x4, "P(None, None, 'model')", P(None, None, "model"), (2, 4, 8)),        # 3-D leaf, 2-D mesh
    (MESH_3D, "P(('a', 'c'), None, 'b')", P(("a", "c"), None, "b"), (8, 4, 6)),     # N-D: 3-D mesh, two axes on d0
    (MESH_3D, "P(('c', 'a'), 'b')", P(("c", "a"), "b"), (8, 4)),                   # minor axis first
    (MESH_3D, "P()", P(), (4, 4)),                                                 # replicated
    (MESH_2x4, "P()", P(), ()),                                                    # a scalar
])
def test_assignment_matches_jax(axes, text, spec, shape):
    assert ours(axes, text, shape) == jax_assignment(axes, spec, shape)


def test_assignment_by_hand():
    # device 5 of data=2 × model=4 is data=1, model=1; an [8,16] array over (data, model) gives it
    # rows 4:8 and columns 4:8; with (a, c) on d0 of a 2×2×2 mesh, device 5 (a=1, b=0, c=1) holds block 3.
    assert ours(MESH_2x4, "P('data', 'model')", (8, 16))[5] == "4:8,4:8"
    assert ours(MESH_3D, "P(('a', 'c'), None, 'b')", (8, 4, 6))[5] == "6:8,0:4,0:3"
    layout = leaf_layout((8, 4, 6), "P(('a', 'c'), None, 'b')", MESH_3D)
    assert (layout.shard_count, layout.replicas, layout.replicated_over) == (8, 1, ())
    layout = leaf_layout((8,), "P('model')", MESH_2x4)
    assert (layout.shard_count, layout.replicas, layout.replicated_over) == (4, 2, ("data",))
    assert [d.shard_id for d in layout.devices] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_replicated_unused_and_undrawable_leaves():
    rep = leaf_layout((4, 4), "P(None, None)", MESH_2x4)
    assert rep.shard_count == 1 and rep.replicas == 8 and {d.shard_id for d in rep.devices} == {0}
    assert all(ranges_text(d.ranges) == "0:4,0:4" for d in rep.devices)
    assert leaf_layout((4, 4), None, MESH_2x4) is None                     # unused: no compiled sharding
    assert leaf_layout((4, 4), "GSPMDSharding({devices=[2,1]<=[2]})", MESH_2x4) is None
    assert leaf_layout((4, 4), "P('fsdp')", MESH_2x4) is None              # not an axis of this mesh
    assert leaf_layout((6,), "P('model')", MESH_2x4) is None               # 6 is not divisible by 4
    assert parse_partition_spec("P('a', ('b', 'c'), None)", 4) == (("a",), ("b", "c"), (), ())
    assert parse_partition_spec("auto", 2) is None and parse_partition_spec("P('a', 'b')", 1) is None


def test_the_report_sharding_structure_is_read_as_its_text():
    from stagetool.core.sharding import AUTO, Sharding

    s = Sharding("spec", (("a", "c"), None, "b"))
    assert parse_partition_spec(s, 3) == parse_partition_spec(str(s), 3) == (("a", "c"), (), ("b",))
    assert ours(MESH_3D, s, (8, 4, 6)) == jax_assignment(MESH_3D, P(("a", "c"), None, "b"), (8, 4, 6))
    assert parse_partition_spec(AUTO, 2) is None and parse_partition_spec(Sharding("other", text="x"), 2) is None


def test_nd_mesh_grid_is_one_panel_per_leading_coordinate():
    grid = charts.device_grid(leaf_layout((8, 4, 6), "P(('a', 'c'), None, 'b')", MESH_3D), name="x")
    assert [p.label for p in grid.panels] == ["a=0", "a=1"]
    assert sorted(c.device for c in grid.cells) == list(range(8))
    assert (grid.row_label, grid.col_label) == ("b →", "c →")
    # device 6 = (a=1, b=1, c=0): second panel, second row, first column
    six = next(c for c in grid.cells if c.device == 6)
    first_of_panel_1 = next(c for c in grid.cells if c.device == 4)
    assert six.x == first_of_panel_1.x and six.y > first_of_panel_1.y
    assert six.lines == ("dev 6", "d0 4:6", "d2 3:6")


# ---- the page ------------------------------------------------------------------------------------


class Dom(html.parser.HTMLParser):
    """Layout figures and their grid cells, as parsed from the page (stdlib HTML parser)."""

    def __init__(self) -> None:
        super().__init__()
        self.figures: list[dict] = []
        self.ids: list[str] = []
        self.refs: list[str] = []
        self.text: list[str] = []
        self._figure: dict | None = None
        self._role: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.append(a["id"])
        for key in ("src", "href", "xlink:href", "action", "data"):
            if key in a:
                self.refs.append(a[key])
        if tag == "figure":
            self._figure = {"leaves": a.get("data-leaves", "").split(), "compiled": a.get("data-compiled"),
                            "grids": {}}
            self.figures.append(self._figure)
        elif tag == "svg" and "data-role" in a and self._figure is not None:
            self._role = a["data-role"]
            self._figure["grids"][self._role] = {}
        elif tag == "g" and "data-device" in a and self._figure is not None:
            self._figure["grids"][self._role][int(a["data-device"])] = a["data-shard"]

    def handle_endtag(self, tag):
        if tag == "figure":
            self._figure = None

    def handle_data(self, data):
        self.text.append(data)

    def figure(self, leaf: str) -> dict:
        return next(f for f in self.figures if leaf in f["leaves"])


@pytest.fixture(scope="module")
def transformer_html(tmp_path_factory, shared_facts_cache) -> Path:
    """``stagetool report examples/transformer.py:train_step --format html -o report.html`` through
    the CLI's entry point, in this process (once for the module; the compile's facts from the
    session's shared facts cache where another test compiled the same program)."""
    from stagetool.cli import main

    out = tmp_path_factory.mktemp("html") / "report.html"
    with cli_environment(EXAMPLES):
        code = main(["report", str(EXAMPLES / "transformer.py") + ":train_step", "--format", "html", "-o", str(out),
                     "--chip", "tpu-v5e", "--peak", "--cache-dir", str(shared_facts_cache)])
    assert code == 0
    return out


# The transformer spec's declared shardings (examples/transformer.stagetool.yaml) and shapes from its
# init_args (vocab 1024, d_model 256, 2 layers, d_ff 1024, max_seq 128; tokens i32[16,128]).
TRANSFORMER_LEAVES = [
    ("params/embed", P("model", None), (1024, 256)),
    ("params/layers/wq", P(None, None, "model"), (2, 256, 256)),
    ("params/layers/w_down", P(None, "model", None), (2, 1024, 256)),
    ("batch/tokens", P("data", None), (16, 128)),
    ("params/final_norm", P(), (256,)),
]


def test_transformer_page_draws_each_leafs_assignment(transformer_html):
    text = transformer_html.read_text()
    dom = Dom()
    dom.feed(text)
    for leaf, spec, shape in TRANSFORMER_LEAVES:
        fig = dom.figure(leaf)
        assert fig["grids"]["compiled"] == jax_assignment(MESH_2x4, spec, shape), leaf
    # the optimizer state shares the parameters' layouts, so it shares their picture
    assert {"params/embed", "opt_state/m/embed", "opt_state/v/embed"} <= set(dom.figure("params/embed")["leaves"])
    assert dom.figure("params/embed")["compiled"] == "P('model', None)"
    # pos_embed is 'auto' in the spec: marked as the compiler's choice; declared shardings are kept
    page = " ".join(dom.text)
    assert "chosen by the compiler" in text[text.index('data-leaves="params/pos_embed'):][:3000]
    assert "declared P('model', None) → compiled P('model', None)" in re.sub(r"\s+", " ", page)
    # every section of the report is there
    for heading in ("Layouts", "Memory per device", "Live at the peak", "Collectives (", "Cost", "Roofline on tpu-v5e"):
        assert heading in page, heading
    # self-contained: no reference leaves the file, no script, unique ids
    assert all(r.startswith("#") for r in dom.refs), dom.refs
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", text)
    assert "<script" not in text and "@import" not in text and "url(" not in text
    assert len(dom.ids) == len(set(dom.ids))


class Timeline(html.parser.HTMLParser):
    """The memory timeline's picture as drawn: the area's points, the peak marker, the stacked buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = False
        self.area: list[tuple[float, float]] = []
        self.peak: tuple[float, float] | None = None
        self.stack: list[tuple[float, float, str]] = []
        self.levels: list[tuple[str, float]] = []
        self._g = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "svg" and a.get("class") == "memory-timeline":
            self.inside = True
        if not self.inside:
            return
        if tag == "path" and a.get("class") == "timeline-area":
            self.area = [(float(x), float(y)) for x, y in re.findall(r"[ML]([\d.]+) ([\d.]+)", a["d"])]
        elif tag == "circle" and a.get("class") == "peak":
            self.peak = (float(a["cx"]), float(a["cy"]))
        elif tag == "g" and a.get("class") == "stacked-buffer":
            self._g = True
        elif tag == "rect" and self._g:
            self.stack.append((float(a["y"]), float(a["height"]), a["class"]))
        elif tag == "line" and a.get("class") in ("gated", "capacity"):
            self.levels.append((a["class"], float(a["y1"])))

    def handle_endtag(self, tag):
        if tag == "svg":
            self.inside = False
        elif tag == "g":
            self._g = False


def test_transformer_page_draws_the_memory_timeline(transformer_html):
    """The area's highest point is the peak marker, the buffers live at the peak are stacked up to
    the same height, and the figures in the text agree: the timeline's peak plus the named
    differences is the gated peak."""
    text = transformer_html.read_text()
    t = Timeline()
    t.feed(text)
    assert len(t.area) > 100 and t.peak is not None
    top = min(y for _, y in t.area)
    assert t.peak[1] == top
    peak_xs = [x for x, y in t.area if y == top]
    assert min(peak_xs) <= t.peak[0] <= max(peak_xs)
    stack_top = min(y for y, _, _ in t.stack)
    assert abs(stack_top - top) < 0.05 and {c for _, _, c in t.stack} >= {"args", "temps"}
    # the gated peak's dashed line lies above the area (CPU: the temp block is not full at the peak)
    (gated_y,) = [y for cls, y in t.levels if cls == "gated"]
    assert gated_y < top
    plain = re.sub(r"<[^>]+>", "", text)
    peak = int(re.search(r"Peak [\d.]+ \w+ \(([\d,]+) B\) at step", plain).group(1).replace(",", ""))
    gated = int(re.search(r"The gated peak \(([\d,]+) B\) is the timeline's peak plus", plain).group(1).replace(",", ""))
    parts = [int(x.replace(",", "")) for x in re.findall(r"([+-][\d,]+) B: ", plain)]
    assert parts and peak + sum(parts) == gated


def test_html_is_deterministic(run_cli, mlp_copy):
    from stagetool import Options, Section, analyze
    from stagetool.report import Format, render

    report = analyze(Options(target="mlp.py:train_step"), [Section.SHARDINGS, Section.MEMORY, Section.COLLECTIVES,
                                                           Section.COST])
    a, b = render(report, Format.html), render(report, Format.html)
    assert a == b and a.startswith("<!DOCTYPE html>")
    dom = Dom()
    dom.feed(a)
    # w1 is [null, model] over data=2 × model=4: columns split in four, each on two devices
    assert dom.figure("params/w1")["grids"]["compiled"] == jax_assignment(MESH_2x4, P(None, "model"), (512, 1024))


def test_markdown_report_links_its_pictures_as_svg_files(run_cli, mlp_copy):
    out = mlp_copy / "out" / "report.md"
    out.parent.mkdir()
    run_cli("report", "mlp.py:train_step", "--format", "markdown", "-o", out, check=0)
    files = sorted(p.name for p in (out.parent / "report-files").iterdir())
    assert files == ["train_step-collectives.svg", "train_step-layouts.svg", "train_step-memory.svg"]
    md = out.read_text()
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert sorted(links) == sorted(f"report-files/{f}" for f in files)
    assert md.index("train_step-layouts.svg") < md.index("### Collectives") < md.index("train_step-collectives.svg")
    for f in files:
        root = ET.fromstring((out.parent / "report-files" / f).read_text())  # well-formed standalone SVG
        assert root.tag == "{http://www.w3.org/2000/svg}svg"
    layouts = ET.fromstring((out.parent / "report-files" / "train_step-layouts.svg").read_text())
    first = next(e for e in layouts.iter("{http://www.w3.org/2000/svg}svg") if e.get("class") == "device-grid")
    cells = {int(g.get("data-device")): g.get("data-shard") for g in first.iter("{http://www.w3.org/2000/svg}g")
             if g.get("data-device") is not None}
    # the first layout drawn is params/b1 (P('model') over f32[1024])
    assert cells == jax_assignment(MESH_2x4, P("model"), (1024,))
    # stdout carries no picture links (nowhere to put the files)
    assert "![" not in run_cli("report", "mlp.py:train_step", "--format", "markdown", check=0).stdout
    # with the peak dump, memory over time is a picture of its own, under the memory section
    run_cli("report", "mlp.py:train_step", "--peak", "--format", "markdown", "-o", out, check=0)
    md = out.read_text()
    assert md.index("### Memory per device") < md.index("(report-files/train_step-memory.svg)") \
        < md.index("(report-files/train_step-timeline.svg)")
    timeline = ET.fromstring((out.parent / "report-files" / "train_step-timeline.svg").read_text())
    assert any(e.get("class") == "timeline-area" for e in timeline.iter("{http://www.w3.org/2000/svg}path"))


def test_check_html_draws_a_changed_sharding_before_and_after(run_cli, mlp_copy):
    run_cli("snapshot", "-o", "lock.json", check=0)
    spec = mlp_copy / "mlp.stagetool.yaml"
    spec.write_text(spec.read_text().replace("['params/w1$', [null, model]]", "['params/w1$', [model, null]]"))
    r = run_cli("check", "--baseline", "lock.json", "--format", "html", "-o", "check.html", check=1)
    del r
    text = (mlp_copy / "check.html").read_text()
    assert "input params/w1: sharding" in text and "regression" in text
    # the peak moved (a few bytes): both memory bars are drawn, on one scale
    if "memory.peak_bytes" in text:
        assert "Memory per device: before → after" in text and text.count('data-part="args"') == 2

    class Sides(html.parser.HTMLParser):
        grids: dict = {}

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if tag == "svg" and a.get("data-role") in ("before", "after"):
                self.role = a["data-role"]
                self.grids[self.role] = {}
            elif tag == "g" and "data-device" in a:
                self.grids[self.role][int(a["data-device"])] = a["data-shard"]

    sides = Sides()
    sides.feed(text)
    assert sides.grids["before"] == jax_assignment(MESH_2x4, P(None, "model"), (512, 1024))
    assert sides.grids["after"] == jax_assignment(MESH_2x4, P("model", None), (512, 1024))


# ---- in a real browser ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chromium_path() -> str:
    from chromium import find_chromium

    path = find_chromium()
    if path is None:
        pytest.skip("no Chromium installed (.ci/run installs Debian's 'chromium' package)")
    return path


def test_the_detectors_see_console_errors_and_requests(chromium_path, tmp_path):
    """A page that logs an error and fetches from the network is caught: the browser test can fail."""
    from chromium import Page

    page = write(tmp_path, "bad.html", """
        <!DOCTYPE html><html><body><img src="http://stagetool.invalid/x.png">
        <script>console.error("boom")</script></body></html>
    """)
    with Page(chromium_path) as p:
        p.load(page)
        assert "boom" in p.console_errors()
        assert "http://stagetool.invalid/x.png" in p.requests()


def test_sweep_page_in_headless_chromium(chromium_path, tmp_path):
    """``sweep --format html`` in a real browser: no error, no request, a bar per figure, the best row set apart."""
    from chromium import Page

    from stagetool.sweep.render import SweepFormat, render

    def row(i, mesh, peak, fits):
        return {"index": i, "id": f"mesh={mesh}", "values": {"mesh": mesh}, "status": "ok" if fits else "does not fit",
                "peak_bytes_per_device": peak, "capacity_bytes_per_device": 4096, "fits": fits,
                "collective_bytes_per_step": peak // 2, "collective_bytes_per_step_by_mesh_axes": {"data": peak // 2},
                "collectives_unknown_runs": 0, "flops_per_device_xla": 1e9, "while_loops": 0,
                "roofline_step_seconds": peak * 1e-6, "timings": {"compile_s": 1.0}, "error": None}

    doc = {"kind": "sweep", "function": "f", "target": "m.py:f", "axes": [["mesh", ["2x4", "4x2"]]],
           "options": {"chip": "tpu-v5e"}, "grid_size": 2, "shard": None, "best": "mesh=2x4", "ranked_by": "step",
           "ranking_note": None, "rows": [row(0, "2x4", 2048, True), row(1, "4x2", 8192, False)]}
    page = write(tmp_path, "sweep.html", render(doc, SweepFormat.html))
    with Page(chromium_path) as p:
        p.load(page)
        assert p.console_errors() == [] and p.requests() == [page.resolve().as_uri()]
        bars = p.evaluate("[...document.querySelectorAll('tr[data-config] svg.cell-bar')].map(s => "
                          "[s.closest('tr').dataset.config, s.getBoundingClientRect().width])")
        assert len(bars) == 6 and all(w > 100 for _, w in bars)
        best, other = p.evaluate("['mesh=2x4', 'mesh=4x2'].map(id => getComputedStyle("
                                 "document.getElementById(id)).backgroundColor)")
        assert best != other
        over = p.evaluate("getComputedStyle(document.querySelector('tr[data-config=\"mesh=4x2\"] rect.over')).fill")
        assert over == "rgb(207, 34, 46)"  # the light scheme's --bad: over its capacity


READ_GRID = """
[...document.querySelectorAll('figure.layout')]
  .filter(f => f.dataset.leaves.split(' ').includes(%r))
  .flatMap(f => [...f.querySelectorAll('svg[data-role=compiled] g.cell')])
  .map(g => [Number(g.dataset.device), g.dataset.shard,
             getComputedStyle(g.querySelector('rect')).fill])
"""


def test_transformer_page_in_headless_chromium(chromium_path, transformer_html):
    from chromium import Page

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "html-report.png"
    with Page(chromium_path, width=1280, height=900) as p:
        p.load(transformer_html)
        assert p.console_errors() == []
        assert p.requests() == [transformer_html.resolve().as_uri()]  # the page itself, nothing else
        for leaf, spec, shape in TRANSFORMER_LEAVES:
            cells = p.evaluate(READ_GRID % leaf)
            assert {d: s for d, s, _ in cells} == jax_assignment(MESH_2x4, spec, shape), leaf
        # devices that hold the same shard are drawn in one colour, different shards in different ones
        cells = p.evaluate(READ_GRID % "params/embed")
        colour = {d: c for d, _, c in cells}
        assert colour[0] == colour[4] and len({colour[d] for d in range(4)}) == 4
        # light and dark: the page follows the reader's colour scheme
        light = p.evaluate("getComputedStyle(document.body).backgroundColor")
        p.send("Emulation.setEmulatedMedia", session=True,
               features=[{"name": "prefers-color-scheme", "value": "dark"}])
        dark = p.evaluate("getComputedStyle(document.body).backgroundColor")
        assert (light, dark) == ("rgb(255, 255, 255)", "rgb(13, 17, 23)")
        p.send("Emulation.setEmulatedMedia", session=True,
               features=[{"name": "prefers-color-scheme", "value": "light"}])
        p.screenshot(shot)
        # the memory timeline is drawn: an area of real size, its peak marker on its highest point
        box = p.evaluate("(() => { const r = document.querySelector('svg.memory-timeline path.timeline-area')"
                         ".getBoundingClientRect(); return [r.width, r.height, r.top]; })()")
        assert box[0] > 300 and box[1] > 100
        dot = p.evaluate("(() => { const r = document.querySelector('svg.memory-timeline circle.peak')"
                         ".getBoundingClientRect(); return [r.top + r.height / 2]; })()")
        assert abs(dot[0] - box[2]) < 1.5
        p.screenshot_of(ARTIFACTS / "memory-timeline.png", "div.timeline")
        assert p.console_errors() == []
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"screenshot: {shot}")
    shutil.copy(transformer_html, ARTIFACTS / "html-report.html")


def test_check_html_draws_both_memory_timelines(run_cli, mlp_copy):
    """A baseline taken with ``snapshot --peak`` holds the memory timeline; ``check --format html``
    records the current one and draws both, each peak at its step, on one bytes scale."""
    run_cli("snapshot", "--peak", "-o", "lock.json", check=0)
    import json

    lock = json.loads((mlp_copy / "lock.json").read_text())
    before = lock["functions"]["train_step"]["memory_timeline"]
    direct = run_cli("memory", "mlp.py:train_step", "--format", "json", check=0).json()["functions"][0]["memory"]
    assert before["peak_bytes"] == direct["timeline_peak"]["bytes"] == max(before["bytes"])
    assert before["steps"] == len(direct["timeline"]) == len(before["bytes"])  # under 400 steps: every one kept
    assert before["bytes"] == [p["bytes"] for p in direct["timeline"]]
    spec = mlp_copy / "mlp.stagetool.yaml"
    spec.write_text(spec.read_text().replace("['params/w1$', [null, model]]", "['params/w1$', [model, null]]"))
    run_cli("check", "--baseline", "lock.json", "--format", "html", "-o", "check.html", check=1)
    text = (mlp_copy / "check.html").read_text()
    sides = re.findall(r'<div data-side="(before|after)" class="timeline">(.*?)</div>', text, re.S)
    assert [s for s, _ in sides] == ["before", "after"]
    for side, body in sides:
        t = Timeline()
        t.feed(body)
        assert t.peak is not None and t.peak[1] == min(y for _, y in t.area)
    # one scale: the y axis' tick labels are the same on both sides
    ticks = [re.findall(r'<text class="axis" x="[\d.]+" y="[\d.]+" text-anchor="end">([^<]+)</text>', body)
             for _, body in sides]
    assert len(ticks[0]) == 5 and ticks[0] == ticks[1]
    assert f"peak {charts.format_bytes(before['peak_bytes'])} at step {before['peak_position']} of {before['steps']}" in text
    # a baseline without the timeline says how to record one
    run_cli("snapshot", "-o", "plain.json", check=0)
    run_cli("check", "--baseline", "plain.json", "--format", "html", "-o", "plain.html", check=0)
    assert "no memory timeline in this snapshot" in (mlp_copy / "plain.html").read_text()


def test_live_diff_html_draws_both_meshes_memory_over_time(run_cli, mlp_copy):
    """``diff --mesh-a --mesh-b --format html`` stages the spec on both meshes with the peak dump:
    each side's timeline is drawn, each peak as ``memory --mesh M`` gives it."""
    run_cli("diff", "--spec", "mlp.stagetool.yaml", "--mesh-a", "2x4", "--mesh-b", "8x1", "--format", "html",
            "-o", "diff.html", check=0)
    text = (mlp_copy / "diff.html").read_text()
    for side, mesh in (("before", "2x4"), ("after", "8x1")):
        body = re.search(rf'<div data-side="{side}" class="timeline">(.*?)</div>', text, re.S).group(1)
        tp = run_cli("memory", "mlp.py:train_step", "--mesh", mesh, "--format", "json",
                     check=0).json()["functions"][0]["memory"]["timeline_peak"]
        assert f"peak {charts.format_bytes(tp['bytes'])} at step {tp['position']} of {tp['steps']}" in body


def test_html_report_has_the_timeline_without_asking_and_no_second_compile(run_cli, monkeypatch):
    """Issue 33, item 5: ``report --format html`` draws the memory timeline by default (the peak dump
    comes from the one compile); text keeps it off; ``--no-peak`` turns it off; the help says what it costs."""
    import jax

    compiles = []
    original = jax.stages.Lowered.compile

    def counting(self, *a, **k):
        compiles.append(1)
        return original(self, *a, **k)

    monkeypatch.setattr(jax.stages.Lowered, "compile", counting)
    page = run_cli("report", "examples/mlp.py:train_step", "--format", "html", "--no-cache", check=0).stdout
    assert "memory over time" in page.lower() and len(compiles) == 1
    off = run_cli("report", "examples/mlp.py:train_step", "--format", "html", "--no-peak", check=0).stdout
    assert "memory over time" not in off.lower()
    text = run_cli("report", "examples/mlp.py:train_step", "--format", "json", check=0).json()
    assert text["functions"][0]["memory"]["timeline"] is None
    help_text = " ".join(run_cli("report", "--help", check=0).stdout.split())
    assert "No second compile" in help_text and "Default: on for --format html" in help_text


def test_a_group_of_peak_buffers_reads_as_its_count_not_a_multiple():
    """The chart draws a group's summed bytes: its label says how many buffers, never ``×3`` (which
    reads as three of the size drawn; issue 40, item 5)."""
    from stagetool.analysis.timeline import BufferGroup
    from stagetool.report.render_html import _group_label

    assert _group_label(BufferGroup("/work/m.py:12", "temporary", 3 * 1024, 3)) == "m.py:12 (3 buffers)"
    assert _group_label(BufferGroup("params/w", "parameter", 1024, 1)) == "params/w"
