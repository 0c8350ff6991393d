"""stagetool.staging.gather: compiled shardings as PartitionSpecs over the spec's mesh, never raw
``GSPMDSharding`` text (issue 10.5), and the frozen value analysis reads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import write
from stagetool.core.sharding import Sharding
from stagetool.staging.gather import sharding_of


def _compiled_input_sharding(mesh, constraint, shape=(64, 32)):
    """The compiler's choice for an unsharded ('auto') input constrained inside the function."""
    def scale(x):
        return jax.lax.with_sharding_constraint(x * 2, NamedSharding(mesh, constraint))

    compiled = jax.jit(scale).trace(jax.ShapeDtypeStruct(shape, jnp.float32)).lower().compile()
    return compiled.input_shardings[0][0]


@pytest.mark.parametrize("sizes,constraint,expected", [
    ((2, 4), P("data", "model"), ("data", "model")),
    ((4, 2), P("data", "model"), ("data", "model")),
    ((2, 4), P(None, "model"), (None, "model")),
    ((2, 4), P(("data", "model"), None), (("data", "model"), None)),
    ((2, 4), P("model", "data"), ("model", "data")),
])
def test_a_compiler_chosen_sharding_is_a_partition_spec_over_the_mesh(sizes, constraint, expected):
    mesh = jax.make_mesh(sizes, ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    chosen = _compiled_input_sharding(mesh, constraint)
    got = sharding_of(chosen, 2, mesh)
    assert got == Sharding("spec", expected)
    # independently: JAX agrees the two are the same layout
    assert chosen.is_equivalent_to(NamedSharding(mesh, P(*expected)), 2)


def test_named_and_single_device_shardings_are_read_directly():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    assert sharding_of(NamedSharding(mesh, P("data")), 3, mesh) == Sharding("spec", ("data", None, None))
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    assert sharding_of(single, 2, mesh) == Sharding("spec", (None, None))
    assert str(sharding_of(single, 2, mesh)) == "P(None, None)"


def test_shardings_cli_shows_the_partition_spec_and_diff_sees_no_change(run_cli, tmp_path, monkeypatch):
    """Issue 10's input: an 'auto' input constrained to P('data', 'model') on data=2 × model=4."""
    write(tmp_path, "m.py", """
        import jax
        from jax.sharding import PartitionSpec as P


        def scale(x):
            return jax.lax.with_sharding_constraint(x * 2, P("data", "model"))
        """)
    write(tmp_path, "m.stagetool.yaml", """
        mesh:
          axes: {data: 2, model: 4}
        functions:
          scale:
            target: m.py:scale
            args: ['f32[64,32] @ auto']
        """)
    monkeypatch.chdir(tmp_path)
    doc = run_cli("shardings", "m.py:scale", "--format", "json", check=0).json()
    (x,) = doc["functions"][0]["inputs"]
    assert (x["compiled"], x["shard_shape"], x["bytes_per_device"]) == ("P('data', 'model')", [32, 8], 1024)
    r = run_cli("diff", "--spec", "m.stagetool.yaml", "--mesh-a", "2x4", "--mesh-b", "4x2", "--format", "json")
    assert r.code == 0, r.stderr
    (fn,) = r.json()["functions"]
    assert {c["what"] for c in fn["changes"]} == {"mesh"}  # the layouts are the same on both meshes
