"""A new user's trial on google-deepmind/nanodo (issue 49, item 1): its FSDP train step, written in
its shape in tests/data/nanodo_step.py (Flax linen with ``nn.with_partitioning`` initializers, a
``DenseGeneral`` attention kernel built flat, ``jax.jit(partial(step, mesh=mesh), in_shardings=...,
out_shardings=..., donate_argnames=...)``). Its code never sets a context mesh, and under one Flax's
``Partitioned.unbox()`` constrains the flat kernel with a rank-3 spec and fails: stagetool stages it
under none, as it runs, and every figure equals raw JAX's compile of the same step."""

from __future__ import annotations

import shutil
import warnings

import jax
import jax.numpy as jnp
import pytest
from helpers import REPO, report_as_raw_jax_compiles_it, write

DATA = REPO / "tests" / "data"


def _raw_compile(raw, devices):
    """nanodo's step compiled by raw JAX for ``devices``, under no context mesh (as its loop runs it)."""
    _, _, step = raw.build(devices)
    state = jax.eval_shape(raw.init_state, jax.random.key(0))
    with warnings.catch_warnings():  # nanodo donates the batch, which no output can take (stagetool: a note)
        warnings.simplefilter("ignore", UserWarning)
        lowered = step.trace(state, jax.ShapeDtypeStruct((raw.BATCH, raw.CONTEXT + 1), jnp.int32)).lower()
    return lowered.compile()


@pytest.mark.parametrize("topology", [None, "v5e:2x4"])
def test_nanodo_step_stages_as_raw_jax_compiles_it(run_cli, tmp_path, monkeypatch, topology):
    monkeypatch.chdir(tmp_path)
    fn, compiled = report_as_raw_jax_compiles_it(run_cli, tmp_path, "nanodo_step", "step", topology, _raw_compile)
    assert fn["memory"]["record"]["peak_bytes_reported"] == compiled.memory_analysis().peak_memory_in_bytes
    leaves = {leaf["path"]: leaf for leaf in fn["inputs"]}
    # nn.with_partitioning's names: the attention kernel (data, None, None) though Flax builds it flat
    assert leaves["state/params/blocks_0/Attention_0/q/kernel/value"]["compiled"] == "P('data', None, None)"


CONTEXT_ONLY = """\
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def step(x):
    y = jax.lax.with_sharding_constraint(x * 2, P("data"))  # a bare PartitionSpec: its run sets a mesh
    return y.sum()


def fails_under_a_context(x):
    if not jax.sharding.get_abstract_mesh().empty:
        raise ValueError("P('data', None, None) is only valid for values of rank at least 3")
    return x * 2
"""

CONTEXT_SPEC = """\
version: 1
mesh: {axes: {data: 8}}
functions:
  step: {target: ctx.py:step, args: ['f32[16]']}
  fails_under_a_context: {target: ctx.py:fails_under_a_context, args: ['f32[16]']}
"""


def test_the_context_mesh_is_the_codes(run_cli, tmp_path, monkeypatch):
    """Code that cannot trace without a context mesh (a bare PartitionSpec) gets the staged one; code
    that traces without one is staged without (its figures then raw JAX's); --context-mesh sets it
    and says, when the code fails only under it, that it does; --no-context-mesh refuses the first."""
    write(tmp_path, "ctx.py", CONTEXT_ONLY)
    write(tmp_path, "ctx.stagetool.yaml", CONTEXT_SPEC)
    monkeypatch.chdir(tmp_path)
    doc = run_cli("shardings", "ctx.py:step", "--format", "json", check=0).json()
    assert doc["functions"][0]["error"] is None
    run_cli("shardings", "ctx.py:fails_under_a_context", check=0)

    failed = run_cli("shardings", "ctx.py:fails_under_a_context", "--context-mesh", check=3)
    err = " ".join(failed.stderr.split())
    assert "rank at least 3" in err and "fails only under the staged mesh as the context mesh" in err
    assert "--no-context-mesh" in err

    refused = run_cli("shardings", "ctx.py:step", "--no-context-mesh", check=3)
    err = " ".join(refused.stderr.split())
    assert "requires a non-empty mesh in context" in err and "--context-mesh" in err

    write(tmp_path, "ctx.stagetool.yaml", CONTEXT_SPEC.replace("axes: {data: 8}", "axes: {data: 8}, context: maybe"))
    bad = run_cli("shardings", "ctx.py:step", check=2)
    assert "mesh.context" in bad.stderr and "maybe" in bad.stderr


def test_inspect_takes_the_context_mesh_option_and_the_callers_context():
    """``stagetool.inspect``: under none by default (the function traces), under the staged mesh with
    ``context_mesh=True`` (where it fails only there: said), and under the caller's own context mesh."""
    import stagetool
    from stagetool.core.errors import StagingError, UsageError

    def fails_under_a_context(x):
        if not jax.sharding.get_abstract_mesh().empty:
            raise ValueError("P('data', None, None) is only valid for values of rank at least 3")
        return x * 2

    x = jnp.zeros((16,))
    assert stagetool.inspect(fails_under_a_context, x, mesh="data=8", peak=False).memory is not None
    with pytest.raises(StagingError) as raised:
        stagetool.inspect(fails_under_a_context, x, mesh="data=8", peak=False, context_mesh=True)
    said = str(raised.value)
    assert "fails only under the staged mesh as the context mesh" in said and "context_mesh=False" in said
    assert "--no-context-mesh" not in said and "mesh.context" not in said  # in inspect's words
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh), pytest.raises(StagingError):  # the caller runs under a context mesh: so does the code
        stagetool.inspect(fails_under_a_context, x, mesh=mesh, peak=False)
    with pytest.raises(UsageError, match="context_mesh='yes' must be True, False or None"):
        stagetool.inspect(fails_under_a_context, x, mesh="data=8", context_mesh="yes")


def test_nanodo_under_a_context_mesh_asked_for_says_it_fails_only_there(run_cli, tmp_path, monkeypatch):
    """--context-mesh: nanodo's init fails as the issue found it (Partitioned.unbox() constrains the flat
    DenseGeneral kernel with P('data', None, None)), and the error says it fails only under that context."""
    for name in ("nanodo_step.py", "nanodo_step.stagetool.yaml"):
        shutil.copy(DATA / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    err = " ".join(run_cli("shardings", "nanodo_step.py:step", "--context-mesh", check=3).stderr.split())
    assert "is only valid for values of rank at least 3" in err
    assert "fails only under the staged mesh as the context mesh" in err and "--no-context-mesh" in err
