"""examples/inspect.ipynb executed headless (nbclient + ipykernel): stagetool.inspect on a function and
arrays defined in its cells, on the CPU mesh and on the compile-only v5e:2x4; its saved output holds
the HTML report, and its figures are the CLI's on the same program (a spec of the same shapes and
shardings over the notebook's program cell, written to a file)."""

from __future__ import annotations

import html
import json
import os
import re

import pytest

from helpers import EXAMPLES, REPO, write

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from stagetool.devices import tpu_topology  # noqa: E402

SPEC = """\
version: 1
mesh:
  axes: {data: 2, model: 4}
functions:
  mlp:
    target: program.py:mlp
    args:
      - w1: 'f32[256,512] @ [null, model]'
        w2: 'f32[512,128] @ [model, null]'
      - 'f32[64,256] @ [data, null]'
"""


def _cell(nb, tag):
    (cell,) = [c for c in nb.cells if tag in c.metadata.get("tags", [])]
    return cell


def _figures(function: dict) -> dict:
    return {"memory": function["memory"]["record"], "cost": function["cost"]["per_device"],
            "collectives": [(c["collective"]["kind"], c["collective"]["mesh_axes"], c["collective"]["bytes_per_device"])
                            for c in function["collectives"]["items"]],
            "inputs": [(x["path"], x["compiled"], x["bytes_per_device"]) for x in function["inputs"]],
            # where the target was named is each caller's own words (inspect's topology=, the CLI's --topology)
            "mesh": {k: v for k, v in function["mesh"].items() if k != "target_from"}}


def _page(cell) -> str:
    """The HTML page a cell's saved output shows (the iframe's srcdoc, unescaped)."""
    (shown,) = [o for o in cell.outputs if o.output_type == "execute_result"]
    frame = shown.data["text/html"]
    assert frame.startswith('<iframe class="stagetool-report" sandbox=""'), frame[:200]
    return html.unescape(re.search(r'srcdoc="([^"]*)"', frame).group(1))


@pytest.mark.slow
@pytest.mark.skipif(not tpu_topology.libtpu_available(), reason="libtpu is not installed: no v5e:2x4 topology")
def test_the_notebook_shows_the_clis_report(tmp_path, run_cli, monkeypatch):
    nb = nbformat.read(EXAMPLES / "inspect.ipynb", as_version=4)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    nbformat.write(nb, tmp_path / "executed.ipynb")
    nb = nbformat.read(tmp_path / "executed.ipynb", as_version=4)  # what was saved

    write(tmp_path, "program.py", _cell(nb, "program").source)
    write(tmp_path, "program.stagetool.yaml", SPEC)
    monkeypatch.chdir(tmp_path)
    live = [json.loads(doc)["functions"][0] for doc in
            re.split(r"(?m)^(?=\{)", "".join(o.text for o in _cell(nb, "json").outputs if o.output_type == "stream"))
            if doc.strip()]
    assert len(live) == 2
    for function, extra in zip(live, ([], ["--topology", "v5e:2x4"])):
        cli = run_cli("report", "--format", "json", "--peak", *extra, check=0).json()["functions"][0]
        assert _figures(function) == _figures(cli)
        assert (function["mesh"]["target_from"], cli["mesh"]["target_from"]) == (
            ("topology=", "--topology") if extra else (None, None))
        assert function["collectives"]["items"], "the program has collectives to compare"
        # the saved HTML shows that report: the CLI's HTML page of the same program draws the same figures
        page = _page(_cell(nb, "tpu" if extra else "cpu"))
        cli_page = run_cli("report", "--format", "html", "--peak", *extra, check=0).stdout
        assert "<script" not in page and "Memory per device" in page and "Layouts" in page
        figures = lambda text: re.findall(r'<figure class="layout"[^>]*data-compiled="[^"]*"', text)  # noqa: E731
        assert figures(page) == figures(cli_page)
        numbers = lambda text: re.findall(r"<td class=\"r\">([^<]*)</td>", text)  # noqa: E731
        assert numbers(page) == numbers(cli_page)
    assert live[1]["mesh"]["topology"] == "v5e:2x4" and live[1]["mesh"]["device_kind"] == "TPU v5 lite"
    collectives = _page(_cell(nb, "collectives"))
    assert "Collectives" in collectives and "Memory per device" not in collectives
    assert "declared P(None, &#39;model&#39;)" in _page(_cell(nb, "why")) or "declared P(None, 'model')" in \
        _page(_cell(nb, "why"))


DISPLAYED = {
    "setup": """\
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import stagetool
mesh = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])
w = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=NamedSharding(mesh, P(None, "model")))
x = jax.ShapeDtypeStruct((32, 64), jnp.float32, sharding=NamedSharding(mesh, P("data", None)))
report = stagetool.inspect(lambda w, x: jnp.tanh(x @ w).sum(), w, x, peak=False)""",
    "report": "report",
    "memory": "report.memory",
    "two": "display(report.collectives)\ndisplay(report)",
}


def test_a_displayed_report_is_one_output(tmp_path, monkeypatch):
    """Each report or section displayed in a notebook is one output: the HTML page, with the text
    report as the text/plain of that same output (never Rich's own Jupyter display, one output a line)."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source, metadata={"tags": [tag]}) for tag, source in DISPLAYED.items()]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    for tag, kind, count in (("report", "execute_result", 1), ("memory", "execute_result", 1),
                             ("two", "display_data", 2)):
        outputs = _cell(nb, tag).outputs
        assert [o.output_type for o in outputs] == [kind] * count, [(o.output_type, list(o.get("data", {})))
                                                                   for o in outputs]
        for o in outputs:
            assert o.data["text/html"].startswith('<iframe class="stagetool-report"')
            assert "memory per device" in o.data["text/plain"] or "collectives" in o.data["text/plain"]
    assert "memory per device" in _cell(nb, "memory").outputs[0].data["text/plain"]
    assert "Memory per device" in _page(_cell(nb, "report"))
