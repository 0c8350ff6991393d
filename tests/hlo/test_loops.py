"""Loop-aware cost (hlo/loops.py): each while body × its trip count, held against XLA.

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

from stagetool.hlo.collectives import while_loops
from stagetool.hlo.loops import counted_cost, loop_aware_cost
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


@pytest.mark.jax_version("<0.12", reason="XLA of jaxlib 0.12 keeps the recomputation in the unrolled program "
                                          "too: both count 371,998,720 FLOPs at 4 layers")
def test_the_unrolled_checkpointed_program_drops_the_recomputation():
    _, est = estimate(compiled_step(4, unroll=False, remat=True))
    _, unrolled = estimate(compiled_step(4, unroll=True, remat=True))
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


# ---- sanity checks on backend figures (issue #10 item 8)

from stagetool.analysis import cost as cost_mod  # noqa: E402
from stagetool.analysis import sections  # noqa: E402
from stagetool.hlo.loops import dot_flops_lower_bound  # noqa: E402


def _matmul_module():
    a = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    b = jax.ShapeDtypeStruct((128, 32), jnp.float32)
    compiled = jax.jit(lambda a, b: a @ b).trace(a, b).lower().compile()
    return compiled, parse_hlo_module(compiled.as_text())


def test_flops_below_the_dot_lower_bound_are_suspect():
    compiled, module = _matmul_module()
    assert dot_flops_lower_bound(module) == 2 * 64 * 32 * 128 == compiled.cost_analysis()["flops"]
    ok = cost_mod.normalise_cost(compiled.cost_analysis(), scope="per_device")
    whole = cost_mod.normalise_cost(compiled.cost_analysis(), scope="whole_program")
    pd, _ = sections._cross_checked(ok, whole, module, 1)
    assert pd.suspects == ()
    low = cost_mod.normalise_cost({"flops": 1000.0, "bytes accessed": 4e4}, scope="per_device")
    pd, _ = sections._cross_checked(low, whole, module, 1)
    assert [s.field for s in pd.suspects] == ["flops"] and "dot/convolution" in pd.suspects[0].reason


def test_lowered_and_compiled_figures_apart_beyond_partitioning_are_suspect():
    def rec(flops, scope):
        return cost_mod.normalise_cost({"flops": flops, "bytes accessed": 1e6}, scope=scope)

    def flagged(pd, whole, devices):
        a, b = sections._cross_checked(pd, whole, None, devices)
        return [s.reason for s in a.suspects + b.suspects if s.field == "flops"]

    whole = rec(8e6, "whole_program")
    assert flagged(rec(1e6, "per_device"), whole, 8) == []   # fully sharded: 8 devices × 1e6 = whole
    assert flagged(rec(8e6, "per_device"), whole, 8) == []   # replicated: every device does it all
    assert "partitioning does not explain it" in flagged(rec(1e5, "per_device"), whole, 8)[0]
    assert "more than twice the whole program" in flagged(rec(3e7, "per_device"), whole, 8)[0]


def test_all_zero_memory_analysis_with_inputs_is_suspect():
    import types

    from stagetool.analysis import memory
    from stagetool.analysis.shardings import LeafReport

    zero = types.SimpleNamespace(argument_size_in_bytes=0, output_size_in_bytes=0, alias_size_in_bytes=0,
                                 temp_size_in_bytes=0, generated_code_size_in_bytes=0, peak_memory_in_bytes=0)
    leaf = LeafReport.__new__(LeafReport)
    object.__setattr__(leaf, "bytes_per_device", 4096)
    object.__setattr__(leaf, "unused", False)
    rec = sections._memory_suspects(memory.normalise_memory(zero), (leaf,))
    assert [s.field for s in rec.suspects] == ["argument_bytes"] and "4096 bytes" in rec.suspects[0].reason
    object.__setattr__(leaf, "bytes_per_device", 0)
    assert sections._memory_suspects(memory.normalise_memory(zero), (leaf,)).suspects == ()


@pytest.mark.parametrize("layers", [4, 12])
def test_loop_aware_bytes_stay_near_the_unrolled_program(layers):
    """Bytes do not compose as exactly as FLOPs (the unrolled program fuses across layers, the loop
    re-reads its carry each iteration): the estimate stays within 2× of the unrolled figure, where a
    count of each sliced stack whole would be 3-6× (slices read what they keep, XLA's rule)."""
    xla, est = estimate(compiled_step(layers, unroll=False, remat=False))
    xla_unrolled, _ = estimate(compiled_step(layers, unroll=True, remat=False))
    assert xla["bytes accessed"] < est.bytes_accessed
    assert 0.9 * xla_unrolled["bytes accessed"] <= est.bytes_accessed <= 2.0 * xla_unrolled["bytes accessed"]
