"""lowering/shardy: Shardy's propagation rerun with sharding origins, on its own.

Each expectation is worked by hand for the program and checked against what JAX compiles for the
same function (``Compiled.input_shardings`` / ``output_shardings``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from stagetool.staging.shardy import ShardyUnavailable, parse_location, propagate, propagate_lowered

MESH = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def _sds(shape, spec):
    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(MESH, spec))


def three_lines(x, w1, w2):
    h = jnp.tanh(x @ w1)
    h = jax.lax.with_sharding_constraint(h, NamedSharding(MESH, P("data", None)))
    return h @ w2


ARGS = (_sds((16, 32), P("data", None)), _sds((32, 64), P(None, "model")), _sds((64, 32), P("model", None)))


def _lowered(fn, *args):
    return jax.jit(fn).lower(*args)


def _dims(s):
    return tuple(tuple(d) for d in s.dims) if s is not None else None


def test_three_line_program_origins():
    lowered = _lowered(three_lines, *ARGS)
    prop = propagate(lowered.as_text(debug_info=True))
    assert prop.mesh_axes == (("data", 2), ("model", 4))
    assert prop.input_names == ("x", "w1", "w2")
    ops = {(op.name, op.frames[0].line): op for op in prop.ops if op.frames}
    line = three_lines.__code__.co_firstlineno
    first_dot = ops[("stablehlo.dot_general", line + 1)]
    # the example: x @ w1 gets `data` from the constraint (propagated backwards) and `model` from w1
    assert _dims(first_dot.results[0]) == (("data",), ("model",))
    assert dict(first_dot.results[0].origins) == {"data": "constraint_0", "model": "input: 1"}
    assert first_dot.rule.operands == (("i", "k"), ("k", "j")) and first_dot.rule.reductions == ("k",)
    constraint = ops[("sdy.sharding_constraint", line + 2)]
    assert constraint.origin_name == "constraint_0" and prop.constraint("constraint_0") is constraint
    second_dot = ops[("stablehlo.dot_general", line + 3)]
    assert [o.input for o in second_dot.operands] == [None, 2]
    assert second_dot.operands[0].producer == constraint.index
    assert constraint.index in prop.ops[first_dot.users[0]].users  # tanh → constraint
    # the final entry shardings are the compiled program's
    compiled = lowered.compile()
    want_in = [tuple((a,) if a else () for a in s.spec) for s in compiled.input_shardings[0]]
    assert [_dims(s) for s in prop.inputs] == want_in
    assert _dims(prop.outputs[0]) == (("data",), ())
    assert compiled.output_shardings.spec == P("data", None)


def test_nested_jit_calls_are_propagated_through():
    """A nested jax.jit lowers to func.call; without turning calls into named computations, the
    callee's ops would get no sharding from the caller's arguments."""

    @jax.jit
    def inner(a, w):
        return jnp.tanh(a @ w)

    def outer(x, w1, w2):
        return inner(inner(x, w1), w2)

    lowered = _lowered(outer, _sds((16, 32), P("data", None)), _sds((32, 64), P(None, "model")),
                       _sds((64, 32), P(None, None)))
    text = lowered.as_text(debug_info=True)
    assert "call @inner" in text  # func.call, printed in the func dialect's short form
    prop = propagate(text)
    assert all(op.name != "func.call" for op in prop.ops)
    assert sum(op.name == "sdy.named_computation" for op in prop.ops) == 2
    tanh_ops = [op for op in prop.ops if op.name == "stablehlo.tanh"]
    assert dict(tanh_ops[0].results[0].origins) == {"data": "input: 0", "model": "input: 1"}
    compiled = lowered.compile()
    assert _dims(prop.outputs[0]) == tuple((a,) if a else () for a in compiled.output_shardings.spec) + \
        ((),) * (2 - len(compiled.output_shardings.spec))


def test_loop_carried_input_is_traced():
    def scanned(x, ws):
        def body(c, w):
            return jnp.tanh(c @ w), None
        return jax.lax.scan(body, x, ws)[0]

    lowered = _lowered(scanned, _sds((16, 32), P("data", None)), _sds((3, 32, 32), P(None, None, "model")))
    prop = propagate(lowered.as_text(debug_info=True))
    dots = [op for op in prop.ops if op.name == "stablehlo.dot_general"]
    assert len(dots) == 1 and dict(dots[0].results[0].origins)["model"] == "input: 1"


def test_gspmd_lowering_is_unavailable():
    text = "module @m { func.func public @main(%arg0: tensor<4xf32> {mhlo.sharding = \"{replicated}\"}) -> tensor<4xf32> " \
           "{ return %arg0 : tensor<4xf32> } }"
    with pytest.raises(ShardyUnavailable, match="no Shardy mesh"):
        propagate(text)


def test_unparsable_module_is_unavailable_not_a_crash():
    prop, why = propagate_lowered(type("L", (), {"as_text": lambda self, debug_info=False: "sdy.mesh garbage"})())
    assert prop is None and why.startswith("Shardy's propagation could not be rerun")


def test_parse_location():
    name, frames = parse_location('loc("jit(f)/dot_general"(callsite("f"("/m.py":8:17 to :23) at '
                                  '"<module>"("/run.py":14:5 to :31))))')
    assert name == "jit(f)/dot_general"
    assert [(f.file, f.line, f.function, f.column) for f in frames] == [("/m.py", 8, "f", 17),
                                                                         ("/run.py", 14, "<module>", 5)]
    assert parse_location("loc(unknown)") == (None, ())


def test_the_rerun_beside_the_compile_runs_in_its_own_thread_and_never_raises(monkeypatch):
    """stagetool.staging.shardy.propagate_beside: the lowered text is printed in the caller's thread, the
    propagation runs in a thread of its own while XLA compiles, and what it raises becomes the reason
    there are no causes (as propagate_lowered gives it), never an exception in the command."""
    import threading
    import types

    from stagetool.staging import shardy

    class Lowered:
        def as_text(self, debug_info=False):
            assert debug_info and threading.current_thread() is threading.main_thread()
            return "module {}"

    staged = types.SimpleNamespace(lowered=Lowered())
    # a module without a Shardy mesh: the reason propagate gives, from the thread
    assert shardy.propagate_beside(staged.lowered, top_k_rule=True)() == (
        None, "the lowered module has no Shardy mesh (GSPMD partitioner, or no mesh)")
    ran_in = []

    def boom(text, top_k_rule=True):
        ran_in.append((threading.current_thread().name, top_k_rule))
        raise RuntimeError("boom")

    monkeypatch.setattr(shardy, "propagate", boom)
    assert shardy.propagate_beside(staged.lowered, top_k_rule=False)() == (
        None, "Shardy's propagation could not be rerun: RuntimeError: boom")
    assert ran_in == [("stagetool-propagation", False)]  # (TPU's: no top-k rule)

    class Unprintable:
        def as_text(self, debug_info=False):
            raise ValueError("no text")

    assert shardy.propagate_beside(Unprintable())() == (
        None, "the lowered module could not be printed: no text")
