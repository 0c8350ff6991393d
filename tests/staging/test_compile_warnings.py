"""XLA's own compile warnings (absl log lines on fd 2) are facts of the compile (issue 21, item 3):
collected, shown as notes, cached with the entry and shown on a cache hit as on a miss.

A warning XLA:CPU gives on every compile with the GSPMD partitioner (``jax_use_shardy_partitioner``
off): "GSPMD sharding propagation is going to be deprecated" (sharding_propagation.cc).
"""

from __future__ import annotations

import jax
import pytest

from helpers import write
from stagetool.staging.stages import _split_xla_log


def test_xla_log_lines_are_split_from_other_text():
    text = ("W1201 15:01:34.736827   26628 sharding_propagation.cc:3132] GSPMD is going away.\n"
            "some other text\n"
            "E1201 15:01:35.000001   26628 xla/service/spmd/spmd_partitioner.cc:630] Involuntary full rematerialization.\n"
            "W1201 15:01:36.736827   26629 sharding_propagation.cc:3132] GSPMD is going away.\n")
    found, rest = _split_xla_log(text)
    assert found == ["XLA warning (sharding_propagation.cc:3132): GSPMD is going away.",
                     "XLA error (spmd_partitioner.cc:630): Involuntary full rematerialization."]
    assert rest == "some other text\n"


@pytest.fixture
def gspmd():
    before = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    yield
    jax.config.update("jax_use_shardy_partitioner", before)


def test_compile_warnings_on_a_miss_and_on_a_cache_hit(run_cli, tmp_path, isolated_imports, gspmd):
    write(tmp_path, "wg.py", '''
        def f(x):
            return x.reshape(8 * 12, 20) * 2
    ''')
    spec = write(tmp_path, "s.yaml", '''
        version: 1
        mesh:
          axes: {data: 2, model: 4}
        functions:
          f:
            target: wg.py:f
            args: ['f32[8,12,20] @ [data, model, null]']
    ''')
    cache = tmp_path / "cache"
    notes = []
    for _ in range(2):
        r = run_cli("memory", "--spec", spec, "--cache-dir", cache, "--format", "json", check=0)
        fn = r.json()["functions"][0]
        notes.append([n for n in fn["notes"] if n.startswith("warning while staging: XLA warning")])
        assert "sharding_propagation.cc:3132]" not in r.stderr  # the raw log line is not left on stderr
    assert fn["cached"]
    assert notes[0] == notes[1] and len(notes[0]) == 1
    assert "GSPMD sharding propagation is going to be deprecated" in notes[0][0]
