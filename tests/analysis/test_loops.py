"""Loop-aware cost (analysis/loops.py): each while body × its trip count, held against XLA.

References, all XLA's own ``Compiled.cost_analysis()`` figures:

* without rematerialisation, the same program with ``scan(..., unroll=True)`` (within 2%);
* with ``jax.checkpoint`` the unrolled program is no reference (XLA drops the recomputation
  there, the loop does it): XLA's figure + (L − 1) × XLA's cost of one loop body, where one body
  is measured by ``jax.jit`` of the layer alone (the forward loop's body) plus ``jax.jit`` of its
  ``vjp`` (the backward loop's body: recompute forward, then backward).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from stagetool.analysis.collectives import while_loops
from stagetool.analysis.loops import counted_cost, loop_aware_cost
from stagetool.hlo.parser import parse_hlo_module

D, B = 256, 64


def layer(x, w):
    h = jnp.tanh(x @ w["a"]) * jax.nn.sigmoid(x @ w["b"])
    return x + h @ w["c"], None


def compiled_step(layers: int, *, unroll: bool, remat: bool):
    body = jax.checkpoint(layer) if remat else layer

    def loss(ws, x):
        y, _ = jax.lax.scan(body, x, ws, unroll=unroll)
        return jnp.sum(y ** 2)

    def step(ws, x):  # x is differentiated too (as an embedding's output is): every layer's dx is needed
        gw, gx = jax.grad(loss, argnums=(0, 1))(ws, x)
        return jax.tree.map(lambda w, g: w - 0.1 * g, ws, gw), gx

    ws = {k: jax.ShapeDtypeStruct((layers, D, D), jnp.float32) for k in "abc"}
    x = jax.ShapeDtypeStruct((B, D), jnp.float32)
    return jax.jit(step).trace(ws, x).lower().compile()


def estimate(compiled):
    module = parse_hlo_module(compiled.as_text())
    cost = compiled.cost_analysis()
    return cost, loop_aware_cost(module, dict(while_loops(module)), flops=cost.get("flops"),
                                 transcendentals=cost.get("transcendentals"),
                                 bytes_accessed=cost.get("bytes accessed"))


@pytest.mark.parametrize("layers", [4, 12])
def test_scan_estimate_matches_the_unrolled_program(layers):
    xla_scan, est = estimate(compiled_step(layers, unroll=False, remat=False))
    xla_unrolled, flat = estimate(compiled_step(layers, unroll=True, remat=False))
    assert flat.loops == () and flat.flops == xla_unrolled["flops"]  # no loop: XLA's figure as it is
    assert [n for _, n, _ in est.loops] == [layers, layers]
    assert xla_scan["flops"] < 0.5 * xla_unrolled["flops"]  # what XLA alone says: one layer
    assert est.flops == pytest.approx(xla_unrolled["flops"], rel=0.02)
    assert est.transcendentals == pytest.approx(xla_unrolled["transcendentals"], rel=0.02)
    assert est.source == "derived estimate" and est.reason is None


@pytest.mark.parametrize("layers", [4, 12])
def test_checkpointed_scan_estimate_is_one_body_times_the_trip_count(layers):
    w = {k: jax.ShapeDtypeStruct((D, D), jnp.float32) for k in "abc"}
    x = jax.ShapeDtypeStruct((B, D), jnp.float32)
    fwd = jax.jit(lambda x, w: layer(x, w)[0]).trace(x, w).lower().compile().cost_analysis()["flops"]
    vjp = jax.jit(lambda x, w, ct: jax.vjp(lambda x, w: layer(x, w)[0], x, w)[1](ct)).trace(
        x, w, x).lower().compile().cost_analysis()["flops"]
    xla, est = estimate(compiled_step(layers, unroll=False, remat=True))
    assert est.flops == pytest.approx(xla["flops"] + (layers - 1) * (fwd + vjp), rel=1e-4)
    _, unrolled = estimate(compiled_step(layers, unroll=True, remat=True))
    assert est.flops > 1.2 * unrolled.flops  # the loop recomputes; the unrolled program does not


def test_the_counter_agrees_with_xla_without_loops():
    """With every body counted once the count is XLA's own (dot, element-wise, transcendental, reduce)."""
    compiled = compiled_step(4, unroll=False, remat=True)
    counted = counted_cost(parse_hlo_module(compiled.as_text()))
    cost = compiled.cost_analysis()
    assert counted.flops == pytest.approx(cost["flops"], rel=1e-6)
    assert counted.transcendentals == pytest.approx(cost["transcendentals"], rel=1e-6)


def test_unknown_trip_count_counts_once_and_says_so():
    def f(x):
        return jax.lax.while_loop(lambda c: jnp.sum(c) < 1e6, lambda c: c @ c + 1.0, x)

    compiled = jax.jit(f).trace(jax.ShapeDtypeStruct((64, 64), jnp.float32)).lower().compile()
    cost, est = estimate(compiled)
    assert est.loops and est.loops[0][1] is None
    assert est.flops == cost["flops"] and "trip count unknown" in est.reason
