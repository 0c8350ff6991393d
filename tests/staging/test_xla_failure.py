"""XLA's failure as XLA says it (issue 33, item 2): a partition XLA's verifier refuses (the SPMD
partitioner's invalid concatenate, jax-ml/jax#39301) is exit 3 with the user's line and XLA's whole
message, no frames of stagetool or its CLI and no install paths; ``--debug`` shows them."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import REPO, write
from jax.sharding import NamedSharding, PartitionSpec

MODEL = """\
import jax
from jax import lax


def f(x):
    a = lax.concatenate([lax.pad(x, 0., [(-3, 0, 0)]), lax.pad(x, 0., [(0, -1, 0)])], 0)
    b = lax.concatenate([lax.pad(x, 0., [(-1, 0, 0)]), lax.pad(x, 0., [(0, -3, 0)])], 0)  # CONCAT
    return a + b
"""
SPEC = """\
version: 1
mesh: {axes: {d: 4}}
functions:
  f:
    target: m.py:f
    args: ['f32[4] @ [d]']
"""


def _jax_message(tmp_path) -> str:
    """XLA's own message for the same function, compiled with JAX's API."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("m_concat", tmp_path / "m.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("d",))
    sharding = NamedSharding(mesh, PartitionSpec("d"))
    with pytest.raises(Exception) as info:
        jax.jit(mod.f, in_shardings=sharding).lower(jax.ShapeDtypeStruct((4,), np.float32)).compile()
    return str(info.value)


def test_refused_partition_is_xlas_message_and_the_users_line(run_cli, tmp_path):
    write(tmp_path, "m.py", MODEL)
    spec = write(tmp_path, "m.stagetool.yaml", SPEC)
    xla = _jax_message(tmp_path)
    first = xla.splitlines()[0]
    assert "Expected instruction to have shape" in first and "Failed after spmd-partitioning" in xla

    r = run_cli("cost", "--spec", str(spec), check=3)
    line = next(i for i, t in enumerate(MODEL.splitlines(), 1) if "# CONCAT" in t)
    err = r.stderr
    assert first.split("INTERNAL: ", 1)[1] in " ".join(err.split())  # XLA's words
    assert "Failed after spmd-partitioning" in err                    # its message whole, last line included
    assert f"(at m.py:{line} in f)" in " ".join(err.split())          # the user's line, from XLA's frames
    assert "m.py:7:8 [f]" in err
    for own in ("stagetool/", "typer", "click", "site-packages", str(REPO), "Traceback"):
        assert own not in err, own
    assert "frames of stagetool, its CLI and installed libraries left out; --debug shows them" in " ".join(err.split())

    debug = run_cli("cost", "--spec", str(spec), "--debug", check=3)
    assert "the message unfiltered:" in debug.stderr and "stagetool/staging/stages.py" in debug.stderr
