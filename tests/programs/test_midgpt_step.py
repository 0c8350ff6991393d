"""A new user's trial on an Equinox FSDP GPT (issue 49, item 2): AllanYangZhou/midGPT's shape,
reproduced in tests/data/midgpt_fsdp.py (weights built under ``eqx.filter_jit`` and laid out by a
sharding constraint, the optimizer state built eagerly by ``optimizer.init`` on the sharded model,
the step ``eqx.filter_jit(donate="all")``). The spec's ``init:`` route gives the optimizer state the
shardings the real eager ``optimizer.init`` gives it (each Adam moment placed like its parameter),
so every figure equals raw JAX's compile of the real objects; where nothing gives a leaf's
sharding, the report says so at the top with the bytes at stake and the memory verdict is a range."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import report_as_raw_jax_compiles_it
from jax.sharding import NamedSharding, PartitionSpec as P


def _mesh() -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


def test_an_init_on_sharded_inputs_places_its_results_as_it_runs_eagerly():
    """optax's Adam init on a sharded pytree: each moment as the real eager run places it (like its
    parameter); the count, made from nothing, stays unknown (nothing places it)."""
    import optax

    from stagetool.inputs.values import eager_dims

    mesh = _mesh()
    shardings = {"w": NamedSharding(mesh, P("data", "model")), "b": NamedSharding(mesh, P(None))}
    shapes = {"w": (16, 8), "b": (8,)}
    structs = {k: jax.ShapeDtypeStruct(shapes[k], jnp.float32, sharding=shardings[k]) for k in shapes}
    tx = optax.adam(1e-3)
    real = tx.init({k: jax.device_put(jnp.zeros(shapes[k]), shardings[k]) for k in shapes})

    def call(*leaves):
        return tx.init(jax.tree.unflatten(jax.tree.structure(structs), leaves))

    leaves = jax.tree.leaves(structs)
    n = len(jax.tree.leaves(real))
    dims = eager_dims(call, leaves, [None] * n, mesh)

    def trimmed(d):  # P(None) and P() alike
        return None if d is None else tuple(d)[:max([i + 1 for i, a in enumerate(d) if a is not None], default=0)]

    count, *moments = jax.tree.leaves(real)
    assert count.ndim == 0 and dims[0] is None  # jnp.zeros([]): one device, uncommitted when run
    assert [trimmed(d) for d in dims[1:]] == [trimmed(x.sharding.spec) for x in moments]
    assert ("data", "model") in dims
    # the jaxpr of the init under jax.jit says nothing of these (the zeros are constants)
    assert eager_dims(call, leaves, ["given"] * n, mesh) == ["given"] * n
    # nothing sharded among the inputs: nothing places the results, they stay unknown
    plain = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())) for x in leaves]
    assert eager_dims(call, plain, [None] * n, mesh) == [None] * n


def test_an_init_that_explicit_axes_refuse_stays_unknown():
    """A contraction over a sharded dimension: JAX's explicit-axes rules refuse it without
    ``out_sharding``, so the eager placement is not guessed."""
    from stagetool.inputs.values import eager_dims

    mesh = _mesh()
    w = jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=NamedSharding(mesh, P(None, "data")))
    x = jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=NamedSharding(mesh, P(None, "data")))
    assert eager_dims(lambda a, b: [b @ a.T], [w, x], [None], mesh) == [None]


def test_unknown_shardings_make_the_memory_verdict_a_range():
    """Pure: the bytes at stake and the verdict between the replicated and the fully split peak."""
    from types import SimpleNamespace as Leaf

    from stagetool.analysis.memory import fit_verdict, unknown_sharding, unknown_sharding_note

    leaves = [Leaf(path="opt/mu", shape=(1000, 2), bytes_global=8000, bytes_per_device=8000, sharding_source="unknown",
                   unused=False),
              Leaf(path="w", shape=(1000, 2), bytes_global=8000, bytes_per_device=1000, sharding_source="init",
                   unused=False),
              Leaf(path="opt/gone", shape=(200,), bytes_global=800, bytes_per_device=800, sharding_source="unknown",
                   unused=True),
              Leaf(path="opt/count", shape=(), bytes_global=4, bytes_per_device=4, sharding_source="unknown",
                   unused=False)]  # a scalar cannot be split: nothing rides on it
    u = unknown_sharding(leaves, 8)
    assert (u.paths, u.staged_bytes, u.least_bytes, u.at_stake_bytes) == (("opt/mu",), 8000, 1000, 7000)
    assert unknown_sharding(leaves, 1) is None
    from stagetool.core.units import format_bytes

    assert f"between {format_bytes(3000)} and {format_bytes(10_000)}" in unknown_sharding_note(u, 10_000)
    assert "1 input leaf (opt/mu)" in unknown_sharding_note(u, 10_000)
    assert fit_verdict(10_000, 12_000, unknown=u).fits is True  # fits even replicated
    assert fit_verdict(10_000, 2_000, unknown=u).fits is False  # not even split over every device
    between = fit_verdict(10_000, 5_000, unknown=u)
    assert between.fits is None and "fits only if they are sharded" in between.reason
    assert fit_verdict(10_000, 5_000).fits is False  # without the unknown leaves: the figure as it is


UNKNOWN = """\
import jax
import jax.numpy as jnp


def init():
    return {"table": jnp.zeros((1024, 256)), "scale": jnp.ones((256,))}


def step(state, x):
    return x @ state["table"] * state["scale"]
"""

UNKNOWN_SPEC = """\
version: 1
mesh:
  axes: {data: 8}
functions:
  step:
    target: unknown_state.py:step
    args:
      - init: unknown_state.py:init
      - 'f32[64,1024] @ [data, null]'
"""


def test_a_report_says_at_the_top_what_rides_on_an_unknown_sharding(run_cli, tmp_path, monkeypatch):
    (tmp_path / "unknown_state.py").write_text(UNKNOWN)
    (tmp_path / "unknown_state.stagetool.yaml").write_text(UNKNOWN_SPEC)
    monkeypatch.chdir(tmp_path)
    out = run_cli("memory", "unknown_state.py:step", "--device-memory", "1MiB", "--no-peak", check=0).stdout
    head = out.split("memory per device")[0]
    # table: 1 MiB replicated, 128 KiB if split over 8; scale: 1 KiB, 128 B; the peak 1,090,560 B less 918,400 B
    assert "sharding unknown for 2 input leaves (state/scale, state/table)" in " ".join(head.split())
    assert "1.00 MiB per device (128 KiB if split over every device)" in " ".join(head.split())
    assert "the peak is between 168 KiB and 1.04 MiB per device" in " ".join(head.split())
    doc = run_cli("memory", "unknown_state.py:step", "--device-memory", "1MiB", "--no-peak",
                  "--format", "json", check=0).json()
    (fn,) = doc["functions"]
    mem = fn["memory"]
    assert mem["unknown_sharding"] == {"paths": ["state/scale", "state/table"], "staged_bytes": 1024 * 1024 + 1024,
                                       "least_bytes": 1024 * 1024 // 8 + 1024 // 8}
    peak = mem["record"]["peak_bytes"]
    assert peak > 1024 * 1024 >= peak - (1024 * 1024 + 1024) * 7 // 8  # over replicated, under split
    assert mem["verdict"]["fits"] is None and "fits only if they are sharded" in mem["verdict"]["reason"]


def _raw_compile(raw, devices):
    """midGPT's step compiled by raw JAX on the real objects: the init run, the optimizer state built
    eagerly on the sharded model (the program's own mesh over the first 8 devices)."""
    import equinox as eqx

    model = eqx.filter_jit(raw.init_model)(jax.random.key(0))
    opt_state = raw.init_opt_state(model)
    batch = jax.device_put(np.zeros((raw.ACCUM, raw.BATCH, raw.SEQ), np.int32),
                           NamedSharding(raw.MESH, P(None, ("replica", "data"), None)))
    return raw.step.lower(model, opt_state, batch, batch).compile()


@pytest.mark.slow
def test_midgpt_opt_state_init_route_stages_as_the_real_program(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fn, _ = report_as_raw_jax_compiles_it(run_cli, tmp_path, "midgpt_fsdp", "step", None, _raw_compile)
    leaves = {leaf["path"]: leaf for leaf in fn["inputs"]}
    moment = leaves["opt_state/1/mu/blocks/up/weight"]
    assert (moment["compiled"], moment["sharding_source"]) == ("P(None, None, 'data')", "init")
    assert not any(leaf["sharding_source"] == "unknown" for leaf in fn["inputs"])
    assert "unknown_sharding" not in fn["memory"]
