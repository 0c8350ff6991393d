"""Issue 48: no stagetool frame in a user's error. XLA's "Suspected Python Code Location" list marks
its last frame with ``[xla::PythonStackTrace='']``; such a frame of stagetool's survived the filter."""

from __future__ import annotations

from pathlib import Path

from helpers import write

import stagetool
from stagetool.staging.stages import xla_message

OWN = str(Path(stagetool.__file__).resolve().parent)


def test_xlas_annotated_last_frame_is_filtered_like_the_others():
    text = ("INTERNAL: custom_partitioner: ValueError: Mismatch in result shapes.\n\n"
            "Suspected Python Code Location:\n"
            "  e.py:24:11 [step]\n"
            f"  {OWN}/pipeline.py:300:5 [_stage]\n"
            f"  {OWN}/cli/entry.py:178:29 [main.<locals>.work] [xla::PythonStackTrace='']\n")
    kept, frame = xla_message(text)
    assert OWN not in kept and "PythonStackTrace" not in kept
    assert "  e.py:24:11 [step]" in kept and frame == "e.py:24 in step"
    assert "(2 frames of stagetool, its CLI and installed libraries left out; --debug shows them)" in kept


def test_a_users_xla_error_names_no_stagetool_frame(run_cli, tmp_path, monkeypatch):
    """A custom_partitioning rule whose lowered function returns the wrong shape: XLA's error, exit 3,
    the user's line, and no frame of stagetool's code."""
    write(tmp_path, "e.py", """\
        import jax.numpy as jnp
        from jax.experimental.custom_partitioning import custom_partitioning
        from jax.sharding import NamedSharding, PartitionSpec as P


        @custom_partitioning
        def my_op(x):
            return jnp.sin(x)


        def bad(mesh, arg_shapes, result_shape):
            rep = NamedSharding(mesh, P(None, None))
            return mesh, lambda x: jnp.sin(x)[:3], rep, (rep,)


        def infer(mesh, arg_shapes, result_shape):
            return NamedSharding(mesh, P(None, None))


        my_op.def_partition(partition=bad, infer_sharding_from_operands=infer, sharding_rule="i j -> i j")


        def step(x):
            return my_op(x) * 2
        """)
    write(tmp_path, "e.stagetool.yaml", "version: 1\nmesh: {axes: {data: 8}}\nfunctions:\n  step:\n"
          "    target: e.py:step\n    args: ['f32[1024,512] @ [data, null]']\n")
    monkeypatch.chdir(tmp_path)
    r = run_cli("collectives", "--no-cache")
    assert r.code == 3 and "Mismatch in result shapes" in r.stderr
    assert "Suspected Python Code Location" in r.stderr and "e.py:24:11 [step]" in r.stderr
    location = r.stderr.split("Suspected Python Code Location", 1)[1]
    assert OWN not in location and "stagetool/" not in location, location
