"""Issue 29, item 3: one :class:`~stagetool.analysis.figures.Figures` per function, derived once when
the function's report is made, is what the report's tables print (text, Markdown, HTML), what the
snapshot stores and what a sweep row holds. Its numbers are raw JAX's own ``Compiled`` figures."""

from __future__ import annotations

import copy
import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import stagetool
from stagetool.analysis.figures import Figures
from stagetool.gate.snapshot import function_snapshot
from stagetool.report import render_html, render_markdown, render_text


def step(x, w):
    return jnp.sum(jnp.tanh(x @ w), axis=0)


def _staged():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=NamedSharding(mesh, P("data", None)))
    w = jax.ShapeDtypeStruct((128, 256), jnp.float32, sharding=NamedSharding(mesh, P(None, "model")))
    report = stagetool.inspect(step, x, w, mesh=mesh, peak=False, chip="tpu-v5e")
    return report.holding(report.functions[0]), jax.jit(step).lower(x, w).compile()


def test_figures_are_raw_jaxs_and_the_snapshots():
    """The record holds raw JAX's memory_analysis() and cost_analysis() figures, the collectives'
    bytes per step (one all-reduce over data of f32[256] sharded over model: 64 floats, 256 B), and
    the snapshot's memory and cost are that record as JSON."""
    doc, compiled = _staged()
    f = doc.functions[0]
    mem, cost = compiled.memory_analysis(), compiled.cost_analysis()
    assert f.figures == Figures.of(f.cost, f.memory, f.collectives)
    m = f.figures.memory
    assert (m.argument_bytes, m.output_bytes, m.alias_bytes, m.temp_bytes) == (
        mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.alias_size_in_bytes, mem.temp_size_in_bytes)
    assert m.peak_bytes == max(mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                               + mem.temp_size_in_bytes, mem.peak_memory_in_bytes)
    assert (f.figures.cost.flops, f.figures.cost.bytes_accessed) == (cost["flops"], cost["bytes accessed"])
    assert f.figures.collective_bytes_per_step == 256
    assert f.figures.chip == "tpu-v5e" and f.figures.roofline_step_seconds > 0
    snap = function_snapshot(f)
    assert snap["memory"]["peak_bytes"] == m.peak_bytes and snap["cost"]["flops"] == cost["flops"]


def test_the_tables_print_the_functions_figures():
    """With the function's Figures replaced by made-up numbers (and its sections as they were), the
    memory, cost and collectives tables and the roofline of the text, Markdown and HTML reports and the snapshot
    print the made-up numbers: they read the record, not the sections."""
    doc, _ = _staged()
    f = doc.functions[0]
    made_up = dataclasses.replace(
        f.figures, memory=dataclasses.replace(f.figures.memory, peak_bytes=987654321, temp_bytes=123456789),
        cost=dataclasses.replace(f.figures.cost, flops=4.25e15), collective_bytes_per_step=7 * 2**30,
        roofline_step_seconds=12.5)
    g = copy.copy(f)
    object.__setattr__(g, "figures", made_up)
    for render in (lambda d: render_text.render(d, color=False, width=200), render_markdown.render,
                   render_html.render):
        before, after = render(doc), render(doc.holding(g))
        for text in ("987654321", "123456789", "4.25 PFLOP", "7.00 GiB", "step ≥ 12.5 s"):
            assert text not in before and text in after, (render, text)
        assert str(f.figures.memory.peak_bytes) in before
    assert render_html.render(doc.holding(g)).count("step ≥ 12.5 s") == 2  # the roofline's heading and its note
    assert function_snapshot(g)["memory"]["peak_bytes"] == 987654321
