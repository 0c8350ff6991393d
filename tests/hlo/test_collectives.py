"""Collectives found in real modules JAX compiles on 8 simulated CPU devices, and in a fixture.

Expected values come from mesh arithmetic (numpy over device positions) and shape × dtype size,
never from the parser.
"""

from __future__ import annotations

import gzip
import inspect
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from stagetool.hlo import collectives as C
from stagetool.hlo import parser as hlo
from stagetool.report.model import to_jsonable

DATA = pathlib.Path(__file__).parent / "data"
F32 = 4


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


@pytest.fixture(scope="module")
def axes(mesh) -> C.MeshAxes:
    return C.MeshAxes.from_mesh(mesh)


def _abstract(mesh, shape, spec, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _np_axis_groups(sizes, axis: int) -> set[frozenset[int]]:
    """Device positions that differ only along ``axis`` of a row-major mesh."""
    pos = np.arange(int(np.prod(sizes))).reshape(sizes)
    moved = np.moveaxis(pos, axis, -1).reshape(-1, sizes[axis])
    return {frozenset(int(v) for v in row) for row in moved}


def _analyse(compiled, axes):
    module = hlo.parse_hlo_module(compiled.as_text())
    return module, C.find_collectives(module, axes)


def _line_of(fn, marker: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if marker in line)


def _param_number(module: hlo.HloModule, op_name: str) -> int:
    (p,) = [p for p in module.entry_parameters() if p.metadata and p.metadata.op_name == op_name]
    return p.parameter_number


# ---------------------------------------------------------------------------------------------
# Replica groups: the printed forms' device groups (expected values from numpy, independent of
# collectives.py)


def _np_groups(arr: np.ndarray) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(v) for v in row) for row in arr)


def test_explicit_groups_and_empty_means_all():
    assert C.expand_replica_groups("{{0,4},{1,5},{2,6},{3,7}}") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert C.expand_replica_groups("{}", num_devices=4) == ((0, 1, 2, 3),)
    assert C.expand_replica_groups("{}") is None


def test_iota_groups():
    assert C.expand_replica_groups("[2,4]<=[8]") == _np_groups(np.arange(8).reshape(2, 4))


def test_transposed_iota_groups():
    expected = _np_groups(np.arange(8).reshape(2, 4).transpose(1, 0).reshape(4, 2))
    assert C.expand_replica_groups("[4,2]<=[2,4]T(1,0)") == expected
    expected3 = _np_groups(np.arange(24).reshape(2, 3, 4).transpose(2, 0, 1).reshape(6, 4))
    assert C.expand_replica_groups("[6,4]<=[2,3,4]T(2,0,1)") == expected3


def _mesh_form(ids: np.ndarray, grouped: list[int]) -> tuple[tuple[int, ...], ...]:
    rest = [i for i in range(ids.ndim) if i not in grouped]
    size = int(np.prod([ids.shape[i] for i in grouped]))
    return _np_groups(ids.transpose(rest + grouped).reshape(-1, size))


def test_mesh_form_groups():
    ids = np.arange(8).reshape(2, 1, 4)
    assert C.expand_replica_groups("mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}") == _mesh_form(ids, [0])
    assert C.expand_replica_groups("mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_2'}") == _mesh_form(ids, [2])
    # several axes, in the order named
    assert C.expand_replica_groups("mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_2','axis_0'}") == _mesh_form(
        ids, [2, 0]
    )


def test_mesh_form_with_device_ids():
    ids = np.arange(8).reshape(2, 4).T.reshape(1, 4, 2)
    text = "mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}"
    assert C.expand_replica_groups(text) == _mesh_form(ids, [1])
    explicit = "mesh['a'=2,'b'=2], device_ids=(3,1,2,0) {'b'}"
    assert C.expand_replica_groups(explicit) == _mesh_form(np.array([3, 1, 2, 0]).reshape(2, 2), [1])


def test_mesh_form_sub_axes():
    # 'a':(2)2 is the middle factor of a = 8 split as [2, 2, 2]
    ids = np.arange(8).reshape(2, 2, 2)
    assert C.expand_replica_groups("mesh['a'=8] {'a':(2)2}") == _mesh_form(ids, [1])
    assert C.expand_replica_groups("mesh['a'=8] {'a':(1)2,'a':(4)2}") == _mesh_form(ids, [0, 2])


def test_bad_replica_groups_are_none():
    for text in ["[3,3]<=[8]", "mesh['a'=2] {'b'}", "garbage", "mesh['a'=2], device_ids=(0,1,2) {'a'}"]:
        assert C.expand_replica_groups(text) is None


@st.composite
def _mesh_and_axes(draw):
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    order = draw(st.permutations(range(len(sizes))))
    grouped = order[: draw(st.integers(0, len(sizes)))]
    device_ids = draw(st.permutations(range(int(np.prod(sizes)))))
    return tuple(sizes), tuple(grouped), np.array(device_ids).reshape(sizes)


@settings(max_examples=200, deadline=None, database=None)
@given(_mesh_and_axes())
def test_every_printed_form_of_mesh_axis_groups_expands_to_them(case):
    """The mesh, explicit and iota forms of one collective's groups mean the same groups, those
    that numpy computes from the device array; with the identity device order they name the axes."""
    sizes, grouped, ids = case
    names = [f"a{i}" for i in range(len(sizes))]
    expected = _mesh_form(ids, list(grouped))
    head = "mesh[" + ",".join(f"'{n}'={s}" for n, s in zip(names, sizes)) + "]"
    refs = "{" + ",".join(f"'{names[i]}'" for i in grouped) + "}"
    ids_text = ",".join(str(int(v)) for v in ids.flat)
    assert C.expand_replica_groups(f"{head}, device_ids=({ids_text}) {refs}") == expected
    explicit = "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in expected) + "}"
    assert C.expand_replica_groups(explicit) == expected
    # identity device order: the iota form, and the matcher names the grouped axes
    n, size = int(np.prod(sizes)), int(np.prod([sizes[i] for i in grouped]))
    rest = [i for i in range(len(sizes)) if i not in grouped]
    perm = ",".join(map(str, rest + list(grouped)))
    plain = _mesh_form(np.arange(n).reshape(sizes), list(grouped))
    assert C.expand_replica_groups(f"[{n // size},{size}]<=[{','.join(map(str, sizes))}]T({perm})") == plain
    assert C.expand_replica_groups(f"{head} {refs}") == plain
    mesh = C.MeshAxes(tuple(names), sizes)
    assert mesh.groups([names[i] for i in grouped]) == plain
    matched = C._AxisMatcher(mesh).match_groups(plain)
    if size == 1:
        assert matched == ()
    else:  # the same groups (as sets) as the grouped axes less those of size 1
        assert matched is not None
        assert {frozenset(g) for g in mesh.groups(matched)} == {frozenset(g) for g in plain}


def test_source_target_pairs():
    assert C.parse_source_target_pairs("{{0,1},{1,0}}") == ((0, 1), (1, 0))
    assert C.parse_source_target_pairs("{{0,1,2}}") is None
    assert C.parse_source_target_pairs(None) is None


# ---------------------------------------------------------------------------------------------
# MeshAxes


def test_mesh_axes_from_jax_meshes(mesh):
    assert C.MeshAxes.from_mesh(mesh) == C.MeshAxes(("data", "model"), (2, 4))
    abstract = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
    assert C.MeshAxes.from_mesh(abstract) == C.MeshAxes(("data", "model"), (2, 4))


def test_mesh_axes_groups_match_numpy():
    m = C.MeshAxes(("a", "b", "c"), (2, 3, 4))
    for k, name in enumerate(m.names):
        assert {frozenset(g) for g in m.groups((name,))} == _np_axis_groups((2, 3, 4), k)
    pos = np.arange(24).reshape(2, 3, 4)
    assert m.groups(("c", "a")) == tuple(tuple(int(v) for v in r) for r in pos.transpose(1, 2, 0).reshape(3, 8))
    with pytest.raises(ValueError):
        m.groups(("zz",))
    with pytest.raises(ValueError):
        C.MeshAxes(("a", "a"), (2, 2))


# ---------------------------------------------------------------------------------------------
# (a) data parallel: the gradient all-reduce over `data`


def _dp_step(params, x, y):
    def loss(p):
        h = jnp.tanh(x @ p["w1"])
        return jnp.mean((h @ p["w2"] - y) ** 2)

    g = jax.grad(loss)(params)
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, g)


def test_data_parallel_gradient_all_reduce(mesh, axes):
    shapes = {"w1": (16, 32), "w2": (32, 8)}
    params = {k: _abstract(mesh, s, P()) for k, s in shapes.items()}
    compiled = (
        jax.jit(_dp_step)
        .lower(params, _abstract(mesh, (64, 16), P("data")), _abstract(mesh, (64, 8), P("data")))
        .compile()
    )
    _, found = _analyse(compiled, axes)
    assert found and {c.kind for c in found} == {"all-reduce"}
    assert all(c.mesh_axes == ("data",) for c in found)
    data_groups = _np_axis_groups((2, 4), 0)
    for c in found:
        assert {frozenset(g) for g in c.replica_groups} == data_groups
        assert c.group_size == 2 and c.reduction == "add"
        assert c.executions == 1 and not c.in_loop and not c.in_conditional
    # the gradients, whole (params are replicated), may be combined into one variadic all-reduce
    grad_bytes = sum(int(np.prod(s)) * F32 for s in shapes.values())
    assert sum(c.bytes_per_device for c in found) == grad_bytes
    # one result per gradient (XLA may reduce a gradient in transposed form: compare sizes)
    got = sorted(hlo.parse_shape(t).element_count for c in found for t in c.result_types)
    assert got == sorted(int(np.prod(s)) for s in shapes.values())
    summary = C.summarize(found)
    (row,) = summary.by_mesh_axes
    assert (row.mesh_axes, row.count, row.bytes_per_device, row.executed_bytes_per_device) == (
        ("data",),
        len(found),
        grad_bytes,
        grad_bytes,
    )
    json.dumps(to_jsonable(found))  # the records serialise as the report does
    json.dumps(to_jsonable(summary))
    # the all-reduce sums gradients: it depends on every parameter but moves none of them
    module = hlo.parse_hlo_module(compiled.as_text())
    for name in ("params['w1']", "params['w2']"):
        n = _param_number(module, name)
        assert C.collectives_from_parameter(module, found, n) == ()
        assert C.collectives_from_parameter(module, found, n, through_compute=True) == found


# ---------------------------------------------------------------------------------------------
# (b) contracting dimension sharded over `model` -> all-reduce over `model`


def _matmul(a, b):
    return a @ b  # marker: contracting matmul


def _contracting_all_reduce(mesh, axes, m, k, n):
    compiled = (
        jax.jit(_matmul)
        .lower(_abstract(mesh, (m, k), P(None, "model")), _abstract(mesh, (k, n), P("model", None)))
        .compile()
    )
    _, found = _analyse(compiled, axes)
    (c,) = found
    return c


def test_contracting_dim_sharded_all_reduce_over_model(mesh, axes):
    m, k, n = 16, 64, 32
    c = _contracting_all_reduce(mesh, axes, m, k, n)
    assert c.kind == "all-reduce" and c.mesh_axes == ("model",)
    assert {frozenset(g) for g in c.replica_groups} == _np_axis_groups((2, 4), 1)
    assert c.bytes_per_device == m * n * F32
    assert c.result_types == (f"f32[{m},{n}]",)
    # (e) the source is this file's line of the matmul
    assert c.source.file == __file__
    assert c.source.line == _line_of(_matmul, "marker: contracting matmul")


@pytest.mark.jax_version(">=0.8", reason="jax 0.7 records one frame per op (source_file/source_line), no function")
def test_the_all_reduces_source_names_its_function(mesh, axes):
    assert _contracting_all_reduce(mesh, axes, 16, 64, 32).source.function == "_matmul"


# ---------------------------------------------------------------------------------------------
# (c) FSDP-style: parameters sharded over `data`, used unsharded -> all-gathers over `data`


def _fsdp_forward(mesh):
    full = NamedSharding(mesh, P())

    def forward(p, x):
        w1 = jax.lax.with_sharding_constraint(p["w1"], full)  # marker: gather w1
        w2 = jax.lax.with_sharding_constraint(p["w2"], full)  # marker: gather w2
        return jnp.tanh(x @ w1) @ w2

    return forward


@pytest.mark.jax_version("<0.12", reason="jaxlib 0.12 gives the inserted all-gather the parameter's "
                                          "metadata (op_name 'w', no source line)")
def test_fsdp_all_gathers_full_parameters(mesh, axes):
    shapes = {"w1": (64, 128), "w2": (128, 32)}
    params = {k: _abstract(mesh, s, P("data")) for k, s in shapes.items()}
    fwd = _fsdp_forward(mesh)
    compiled = jax.jit(fwd).lower(params, _abstract(mesh, (16, 64), P("data"))).compile()
    module, found = _analyse(compiled, axes)
    gathers = [c for c in found if c.kind == "all-gather"]
    assert gathers and all(c.mesh_axes == ("data",) for c in gathers)
    full_bytes = {k: int(np.prod(s)) * F32 for k, s in shapes.items()}
    assert sum(c.bytes_per_device for c in gathers) == sum(full_bytes.values())
    assert sum(c.operand_bytes_per_device for c in gathers) == sum(full_bytes.values()) // 2
    for c in gathers:
        assert {frozenset(g) for g in c.replica_groups} == _np_axis_groups((2, 4), 0)

    # "why is w1 gathered?": the collectives fed by the parameter w1 are exactly its gathers
    w1 = _param_number(module, "p['w1']")
    from_w1 = C.collectives_from_parameter(module, found, w1)
    assert [c.result_types for c in from_w1 if c.kind == "all-gather"] == [("f32[64,128]",)]
    x = _param_number(module, "x")
    assert [c for c in C.collectives_from_parameter(module, found, x) if c.kind == "all-gather"] == []
    assert C.collectives_from_parameter(module, found, 99) == ()

    # (e) each gather points at the line that asked for the unsharded parameter (JAX 0.10.2
    # keeps the two gathers apart; a combined variadic gather would carry one of the lines)
    lines = {c.result_types: (c.source.file, c.source.line) for c in gathers}
    assert lines == {
        ("f32[64,128]",): (__file__, _line_of(fwd, "marker: gather w1")),
        ("f32[128,32]",): (__file__, _line_of(fwd, "marker: gather w2")),
    }


# ---------------------------------------------------------------------------------------------
# (d) a scan over layers: collectives in the loop, executions = trip count

LAYERS = 6


def _fsdp_scan(mesh):
    full = NamedSharding(mesh, P())

    def forward(ws, x):
        def layer(h, w):
            w = jax.lax.with_sharding_constraint(w, full)  # marker: gather layer weight
            return jnp.tanh(h @ w), None

        h, _ = jax.lax.scan(layer, x, ws)  # marker: scan over layers
        return h

    return forward


def test_scan_collectives_run_once_per_layer(mesh, axes):
    d = 32
    fwd = _fsdp_scan(mesh)
    compiled = (
        jax.jit(fwd)
        .lower(_abstract(mesh, (LAYERS, d, d), P(None, "data", None)), _abstract(mesh, (64, d), P("data")))
        .compile()
    )
    module, found = _analyse(compiled, axes)
    in_loop = [c for c in found if c.in_loop]
    assert in_loop
    for c in in_loop:
        assert c.executions == LAYERS
        assert c.executed_bytes_per_device == c.bytes_per_device * LAYERS
        assert c.computation != module.entry_name
    summary = C.summarize(found)
    assert summary.total.executions == sum(c.executions for c in found)
    assert summary.total.executed_bytes_per_device == sum(c.bytes_per_device * c.executions for c in found)
    assert summary.total.unknown_executions_count == 0
    # each layer gathers its whole [d, d] weight over `data`; the partitioner attaches the gather
    # to the constraint or (JAX 0.10.2) to the per-layer slice the scan takes: both lines are ours
    lines = {_line_of(fwd, "marker: gather layer weight"), _line_of(fwd, "marker: scan over layers")}
    gathers = [c for c in in_loop if c.kind == "all-gather"]
    assert gathers
    for c in gathers:
        assert c.mesh_axes == ("data",) and c.bytes_per_device == d * d * F32
        assert c.operand_bytes_per_device == d * d * F32 // 2
        assert c.source.file == __file__ and c.source.line in lines
    # the weights feed the loop's gathers; the activations do not (loop tuple elements tracked)
    ws, x = _param_number(module, "ws"), _param_number(module, "x")
    assert set(C.collectives_from_parameter(module, found, ws)) >= set(gathers)
    assert not set(C.collectives_from_parameter(module, found, x)) & set(gathers)

    # without XLA's known_trip_count the same count is derived from the loop itself
    stripped = re.sub(r', backend_config=\{[^\n]*"known_trip_count"[^\n]*\}', "", compiled.as_text())
    assert "known_trip_count" not in stripped
    again = C.find_collectives(hlo.parse_hlo_module(stripped), axes)
    assert [(c.name, c.executions) for c in again] == [(c.name, c.executions) for c in found]


# ---------------------------------------------------------------------------------------------
# Device ids in the HLO are positions in mesh.devices.flat, also for a permuted device list


def _psum_model(x):
    return jax.lax.psum(x, "model")


def test_hlo_device_ids_are_mesh_positions_with_permuted_devices():
    devices = np.array(jax.devices())
    perm = [5, 2, 7, 0, 3, 6, 1, 4]
    mesh = Mesh(devices[perm].reshape(2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    axes = C.MeshAxes.from_mesh(mesh)
    f = jax.jit(jax.shard_map(_psum_model, mesh=mesh, in_specs=P("data", "model"), out_specs=P("data")))
    x = jnp.arange(8 * 3, dtype=jnp.float32).reshape(2, 12)
    x = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
    compiled = f.lower(x).compile()
    _, found = _analyse(compiled, axes)
    (c,) = found
    got = {frozenset(g) for g in c.replica_groups}
    by_position = _np_axis_groups((2, 4), 1)
    by_device_id = {frozenset(int(d.id) for d in row) for row in mesh.devices}
    assert by_position != by_device_id  # the permutation tells the two readings apart
    assert got == by_position
    assert c.mesh_axes == ("model",)
    # and the program really sums each mesh row (JAX semantics, checked at run time)
    out = np.asarray(compiled(x))
    xs = np.asarray(x).reshape(2, 4, 3)
    np.testing.assert_allclose(out, xs.sum(axis=1))


# ---------------------------------------------------------------------------------------------
# Fixture module: async pairs, TPU layouts, conditionals, async wrappers, all group forms


@pytest.fixture(scope="module")
def fixture_found():
    module = hlo.parse_hlo_module((DATA / "async_tpu_like.hlo").read_text())
    return module, C.find_collectives(module, C.MeshAxes(("data", "model"), (2, 4)))


def test_fixture_collectives(fixture_found):
    _, found = fixture_found
    by_name = {c.name: c for c in found}
    assert list(by_name) == ["all-gather-start", "ar", "cp-start", "all-to-all.1", "ag2", "rs"]
    bf16_full = 1024 * 4096 * 2
    ag = by_name["all-gather-start"]
    assert (ag.kind, ag.is_async, ag.done_name) == ("all-gather", True, "all-gather-done")
    assert ag.bytes_per_device == bf16_full and ag.operand_bytes_per_device == bf16_full // 4
    assert (ag.executions, ag.in_loop, ag.mesh_axes) == (5, True, ("model",))
    assert (ag.source.file, ag.source.line) == ("/src/model.py", 42)
    ar = by_name["ar"]
    assert (ar.mesh_axes, ar.executions, ar.bytes_per_device, ar.reduction) == (("data",), 5, 1024 * 4, "add")
    cp = by_name["cp-start"]
    assert (cp.kind, cp.done_name, cp.bytes_per_device) == ("collective-permute", "cp-done", 1024 * 4)
    assert (cp.executions, cp.in_conditional, cp.mesh_axes) == (None, True, ("model",))
    a2a = by_name["all-to-all.1"]
    assert (a2a.is_async, a2a.executions, a2a.mesh_axes, a2a.bytes_per_device) == (True, 1, ("data",), 8 * 128 * 4)
    ag2 = by_name["ag2"]
    assert (ag2.mesh_axes, ag2.executions, ag2.source.line, ag2.source.function) == (("model",), 1, 57, "forward")
    rs = by_name["rs"]
    assert (rs.kind, rs.bytes_per_device, rs.operand_bytes_per_device) == ("reduce-scatter", 256 * 4, 1024 * 4)


def test_fixture_summary(fixture_found):
    _, found = fixture_found
    s = C.summarize(found)
    bf16_full = 1024 * 4096 * 2
    assert s.total.count == 6
    assert s.total.unknown_executions_count == 1
    assert s.total.bytes_per_device == 2 * bf16_full + 4096 + 4096 + 4096 + 1024
    assert s.total.executed_bytes_per_device == 5 * (bf16_full + 4096) + 4096 + bf16_full + 1024
    assert [r.kind for r in s.by_kind] == sorted({c.kind for c in found})
    ag_row = next(r for r in s.by_kind if r.kind == "all-gather")
    assert (ag_row.count, ag_row.executions, ag_row.executed_bytes_per_device) == (2, 6, 6 * bf16_full)
    assert [r.mesh_axes for r in s.by_mesh_axes] == [("data",), ("model",)]
    model_row = s.by_mesh_axes[1]
    assert model_row.count == 4 and model_row.unknown_executions_count == 1


def test_fixture_explain(fixture_found):
    module, found = fixture_found
    names = lambda n: [c.name for c in C.collectives_from_parameter(module, found, n)]
    assert names(0) == ["all-gather-start", "ag2"]  # the weight, through the loop's tuple element 1
    assert names(1) == ["ar", "cp-start", "rs"]  # v: loop element 2, then the conditional branch
    assert names(2) == []  # the branch index is control, not data


def test_unmatched_groups_keep_groups():
    text = (
        "HloModule m, num_partitions=8\n\n"
        "%add (x: f32[], y: f32[]) -> f32[] {\n  %x = f32[] parameter(0)\n  %y = f32[] parameter(1)\n"
        "  ROOT %s = f32[] add(%x, %y)\n}\n\n"
        "ENTRY %e (p: f32[4]) -> f32[4] {\n  %p = f32[4]{0} parameter(0)\n"
        "  %odd = f32[4]{0} all-reduce(%p), channel_id=1, replica_groups={{0,3},{1,2},{4,7},{5,6}}, to_apply=%add\n"
        "  %all = f32[4]{0} all-reduce(%odd), channel_id=2, replica_groups={}, to_apply=%add\n"
        "  %one = f32[4]{0} all-reduce(%all), channel_id=3, replica_groups=[8,1]<=[8], to_apply=%add\n"
        "  ROOT %cp = f32[4]{0} collective-permute(%one), channel_id=4, source_target_pairs={{0,4},{4,0}}\n}\n"
    )
    module = hlo.parse_hlo_module(text)
    odd, all_, one, cp = C.find_collectives(module, C.MeshAxes(("data", "model"), (2, 4)))
    assert odd.mesh_axes is None and odd.replica_groups == ((0, 3), (1, 2), (4, 7), (5, 6))
    assert all_.mesh_axes == ("data", "model") and all_.replica_groups == (tuple(range(8)),)
    assert one.mesh_axes == () and one.group_size == 1
    assert cp.mesh_axes == ("data",)
    assert C.summarize([odd]).by_mesh_axes[0].mesh_axes is None
    # without a mesh nothing is named
    assert all(c.mesh_axes is None for c in C.find_collectives(module))


# ---------------------------------------------------------------------------------------------
# A real TPU module (compile-only v5e 2x4, written by data/make_tpu_fixture.py)

TPU_GEN = DATA / "make_tpu_fixture.py"
# generator constants: LAYERS, D, HEADS * D_HEAD, D_FF; bf16 weights
TPU_LAYERS, TPU_D, TPU_HD, TPU_FF, BF16 = 3, 256, 256, 1024, 2


@pytest.fixture(scope="module")
def tpu():
    text = gzip.decompress((DATA / "tpu_v5e_2x4_train_step.hlo.gz").read_bytes()).decode()
    module = hlo.parse_hlo_module(text)
    return text, module, C.find_collectives(module, C.MeshAxes(("data", "model"), (2, 4)))


def _gen_line(needle: str) -> int:
    lines = TPU_GEN.read_text().splitlines()
    return 1 + next(i for i, line in enumerate(lines) if needle in line)


def test_tpu_module_parses_completely(tpu):
    text, module, _ = tpu
    assert module.unparsed_lines == ()
    assert module.num_partitions == 8
    instrs = [i for c in module.computations for i in c.instructions]
    assert len(instrs) == sum(1 for line in text.splitlines() if re.match(r"\s+(ROOT )?%\S+ = ", line))
    assert all(i.shape is not None for i in instrs)
    assert any(":T(8,128)(2,1)" in (a.layout or "") for i in instrs if i.shape for a in hlo.array_leaves(i.shape))


def test_tpu_weight_gathers_explained(tpu):
    """Each FSDP weight is gathered exactly once over `data`, to its data-unsharded size."""
    _, module, found = tpu
    # global shape and which dim is sharded over `model` (4) for each parameter
    weights = {
        "wq": ((TPU_D, TPU_HD), 1), "wk": ((TPU_D, TPU_HD), 1), "wv": ((TPU_D, TPU_HD), 1),
        "wo": ((TPU_HD, TPU_D), 0), "w1": ((TPU_D, TPU_FF), 1), "w2": ((TPU_FF, TPU_D), 0),
    }  # fmt: skip
    needles = {"wq": 'x @ p["wq"]', "wk": 'x @ p["wk"]', "wv": 'x @ p["wv"]', "wo": '@ p["wo"]'}
    for name, (shape, model_dim) in weights.items():
        gathered = list(shape)
        gathered[model_dim] //= 4
        (c,) = C.collectives_from_parameter(module, found, _param_number(module, f"p['{name}']"))
        assert (c.kind, c.mesh_axes, c.group_size) == ("all-gather", ("data",), 2)
        assert c.bytes_per_device == gathered[0] * gathered[1] * BF16
        assert c.operand_bytes_per_device == c.bytes_per_device // 2
        assert pathlib.Path(c.source.file).name == TPU_GEN.name
        if name in needles:
            assert c.source.line == _gen_line(needles[name])
    # the scanned weights: one [1, D, D] layer per iteration, in the loop
    (c,) = C.collectives_from_parameter(module, found, _param_number(module, "p['ws']"))
    assert c.bytes_per_device == TPU_D * TPU_D * BF16 and c.in_loop
    assert c.source.line in {_gen_line("with_sharding_constraint(w, full)"), _gen_line("lax.scan(layer")}
    assert C.collectives_from_parameter(module, found, _param_number(module, "x")) == ()


def test_tpu_loop_trip_count_is_derived(tpu):
    text, _, found = tpu
    assert "known_trip_count" not in text  # TPU prints no trip count: it must be derived
    in_loop = [c for c in found if c.in_loop]
    assert in_loop and all(c.executions == TPU_LAYERS for c in in_loop)


def test_tpu_async_split_and_reduce_scatter_fusions(tpu):
    _, module, found = tpu
    keys = [(c.kind, c.channel_id) for c in found if c.channel_id is not None]
    assert len(keys) == len(set(keys))  # one record per collective
    split = [c for c in found if c.merged]
    assert split and all(c.is_async and c.fusion for c in split)
    for c in split:  # every piece is the same all-gather (same channel, groups, shape)
        for comp, name in c.merged:
            piece = module.computation(comp).instruction(name)
            assert piece.opcode == c.kind
            assert piece.attributes["channel_id"] == str(c.channel_id)
            assert piece.shape.type_text() == c.result_types[0]
    scatters = [c for c in found if c.kind == "reduce-scatter"]
    assert scatters
    for c in scatters:  # an all-reduce + slice fusion: the result is the slice, half over data
        assert c.fusion and module.computation(c.computation).instruction(c.name).opcode == "all-reduce"
        assert c.mesh_axes == ("data",) and c.bytes_per_device * 2 == c.operand_bytes_per_device


def test_groups_over_part_of_an_axis_name_the_sub_axis():
    """{0,1},{2,3},... on data=2 x model=4 runs over the minor half of `model` (XLA: {'axis':(2)2})."""
    from stagetool.hlo.collectives import MeshAxes, _AxisMatcher

    m = _AxisMatcher(MeshAxes(("data", "model"), (2, 4)))
    assert m.match_groups(((0, 1), (2, 3), (4, 5), (6, 7))) == ("model[minor 2 of 4]",)
    assert m.match_groups(((0, 2), (1, 3), (4, 6), (5, 7))) == ("model[major 2 of 4]",)
    assert m.match_groups(((0, 1, 2, 3), (4, 5, 6, 7))) == ("model",)       # whole axes first
    assert m.match_groups(((0, 5), (1, 4), (2, 7), (3, 6))) is None           # no axis set makes these
