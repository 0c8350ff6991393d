"""A new user's trial on jax-ml/bonsai's Qwen3 (issue 49, items 3-5): its prefill step, written in
its shape in tests/data/bonsai_qwen3.py (Flax NNX weights with ``out_sharding`` metadata for a mesh
of Explicit axes the module builds at import, ``out_sharding=P(...)`` activations, a bare
``@jax.jit`` step taking a Python number ``pad_id``). The spec gives no axis types: the module's
own mesh gives them; ``pad_id`` is an ``s32[]`` argument as ``jax.jit`` makes it; every figure
equals raw JAX's compile of the same step."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import pytest
from helpers import REPO, raw_module, report_as_raw_jax_compiles_it, target_devices, write
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

DATA = REPO / "tests" / "data"


def _raw_compile(raw, devices):
    """bonsai's step compiled by raw JAX on an Explicit (fsdp, tp) mesh of ``devices``, the model and
    cache built abstractly under it (as the sharding test builds them under ``jax.set_mesh``)."""
    from flax import nnx

    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(AxisType.Explicit,) * 2, devices=devices)
    with jax.set_mesh(mesh):
        model, cache = nnx.eval_shape(raw.make_model), nnx.eval_shape(raw.make_cache)
        tokens = jax.ShapeDtypeStruct((raw.BATCH, raw.TOKENS), jnp.int32, sharding=NamedSharding(mesh, P("fsdp")))
        return raw.forward.trace(model, cache, tokens, 0).lower().compile()


@pytest.mark.parametrize("topology", [None, "v5e:2x4"])
def test_bonsai_qwen3_step_stages_as_raw_jax_compiles_it(run_cli, tmp_path, monkeypatch, topology):
    monkeypatch.chdir(tmp_path)
    fn, compiled = report_as_raw_jax_compiles_it(run_cli, tmp_path, "bonsai_qwen3", "forward", topology, _raw_compile)
    assert fn["mesh"]["axis_types"] == "explicit"  # the module's own mesh's, the spec giving none
    assert any("with Explicit axes (bonsai_qwen3.py:" in n for n in fn["notes"])
    assert fn["memory"]["record"]["peak_bytes_reported"] == compiled.memory_analysis().peak_memory_in_bytes
    (pad_id,) = [leaf for leaf in fn["inputs"] if leaf["path"] == "pad_id"]
    assert (pad_id["shape"], pad_id["dtype"], pad_id["unused"]) == ([], "int32", False)


def test_a_python_number_is_a_jit_argument_through_inspect():
    """``stagetool.inspect(forward, model, cache, tokens, 0)``: the 0 is an argument, 4 bytes of them,
    as in raw JAX's compile (it was folded in as a constant when the model made stagetool wrap the step)."""
    import stagetool
    from flax import nnx

    raw = raw_module(DATA / "bonsai_qwen3.py", "bonsai_qwen3_live")
    with jax.set_mesh(raw.mesh):
        model, cache = nnx.eval_shape(raw.make_model), nnx.eval_shape(raw.make_cache)
        tokens = jax.ShapeDtypeStruct((raw.BATCH, raw.TOKENS), jnp.int32, sharding=NamedSharding(raw.mesh, P("fsdp")))
        compiled = raw.forward.trace(model, cache, tokens, 0).lower().compile()
        report = stagetool.inspect(raw.forward, model, cache, tokens, 0, mesh=raw.mesh, peak=False)
    assert report.memory.record.argument_bytes == compiled.memory_analysis().argument_size_in_bytes


AUTO_SPEC = """\
version: 1
mesh: {axes: {fsdp: 4, tp: 2}, axis_types: auto}
functions:
  forward:
    target: bonsai_qwen3.py:forward
    args:
      - init: bonsai_qwen3.py:make_model
      - init: bonsai_qwen3.py:make_cache
      - 'i32[4,16] @ [fsdp]'
      - 0
"""


def test_explicit_axes_code_on_auto_axes_is_exit_2_naming_the_spec_key(run_cli, tmp_path, monkeypatch):
    shutil.copy(DATA / "bonsai_qwen3.py", tmp_path / "bonsai_qwen3.py")
    write(tmp_path, "bonsai_qwen3.stagetool.yaml", AUTO_SPEC)
    monkeypatch.chdir(tmp_path)
    result = run_cli("shardings", "bonsai_qwen3.py:forward", check=2)
    err = " ".join(result.stderr.split())
    assert "the code needs Explicit mesh axes" in err and "axis_types: explicit" in err
    assert "bonsai_qwen3.py:35" in err and "Traceback" not in err


BUILT_AT_IMPORT = """

jax.set_mesh(mesh)
model = make_model()
cache = make_cache()
"""


@pytest.mark.slow  # libtpu's compile-only client starts in the CLI process
def test_a_model_built_at_import_under_a_topology_says_what_to_write(run_cli, tmp_path, monkeypatch):
    target_devices("v5e:2x4")  # skips without libtpu
    (tmp_path / "bq.py").write_text((DATA / "bonsai_qwen3.py").read_text() + BUILT_AT_IMPORT)
    write(tmp_path, "bq.stagetool.yaml", """\
        version: 1
        mesh: {axes: {fsdp: 4, tp: 2}}
        functions:
          forward: {target: bq.py:forward, args: [{ref: bq.py:model}, {ref: bq.py:cache}, 'i32[4,16] @ [fsdp]', 0]}
        """)
    monkeypatch.chdir(tmp_path)
    result = run_cli("shardings", "bq.py:forward", "--topology", "v5e:2x4", check=2)
    err = " ".join(result.stderr.split())
    assert "compile-only" in err and "{init: model.py:make_model}" in err and "Traceback" not in err
