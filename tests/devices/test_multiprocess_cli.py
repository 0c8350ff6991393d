"""Two real processes on loopback run `stagetool shardings` as one 2x4 mesh (gloo, 4 CPU devices each).

Host-local shapes in the spec (`avals: local`) must become the global shapes that
`jax.experimental.multihost_utils.host_local_array_to_global_array` gives, and the report must
equal a single-process run on 8 devices that simulates the same two hosts (`--processes 2`).
Only process 0 writes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from helpers import REPO as ROOT  # noqa: E402

TIMEOUT_S = 120

SPEC = """\
version: 1
mesh: {axes: {data: 2, model: 4}}
avals: local
functions:
  loss:
    target: mlp.py:loss_fn
    args:
      - {w1: 'f32[64,32] @ [null, model]', b1: 'f32[32] @ [model]', w2: 'f32[32,8]', b2: 'f32[8]'}
      - {x: 'f32[16,64] @ [data, null]', y: 'i32[16] @ [data]'}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _facts(doc: dict) -> list[tuple]:
    f = doc["functions"][0]
    return [(x["path"], x["shape"], x["local_shape"], x["compiled"], x["bytes_per_device"]) for x in f["inputs"]] + \
        [(x["path"], x["shape"], x["compiled"]) for x in f["outputs"]] + [f["mesh"]["process_count"]]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_match_a_simulated_two_host_run(tmp_path):
    # Process 1 loads the module seconds after process 0: process 0, which serves the coordinator,
    # must still wait for it to finish (without jax.distributed.shutdown's barrier process 0 ended
    # first and JAX's client in process 1 aborted with SIGABRT).
    slow = "import os as _os, time as _time\nif _os.environ.get('MLP_SLOW_S'):\n    _time.sleep(float(_os.environ['MLP_SLOW_S']))\n"
    (tmp_path / "mlp.py").write_text(slow + (ROOT / "examples" / "mlp.py").read_text())
    spec = tmp_path / "local.stagetool.yaml"
    spec.write_text(SPEC)
    port = _free_port()
    procs = []
    for i in range(2):
        out = tmp_path / f"p{i}.json"
        cmd = [sys.executable, "-m", "stagetool", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
               "--process-id", str(i), "shardings", "--spec", str(spec), "--format", "json", "-o", str(out)]
        env = _env() | ({"MLP_SLOW_S": "8"} if i == 1 else {})
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True))
    try:
        results = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert [p.returncode for p in procs] == [0, 0], results
    assert (tmp_path / "p0.json").exists()
    assert not (tmp_path / "p1.json").exists()  # only process 0 writes
    distributed = json.loads((tmp_path / "p0.json").read_text())

    single = subprocess.run([sys.executable, "-m", "stagetool", "shardings", "--spec", str(spec), "--processes", "2",
                             "--format", "json"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                            timeout=TIMEOUT_S)
    assert single.returncode == 0, single.stderr
    simulated = json.loads(single.stdout)

    assert _facts(distributed) == _facts(simulated)
    inputs = {x["path"]: x for x in distributed["functions"][0]["inputs"]}
    # Two hosts, each holding one row of the 2x4 mesh: a dim sharded on `data` doubles, one on
    # `model` (whole on every host) keeps its size, an unsharded one too.
    assert inputs["batch/x"]["shape"] == [32, 64] and inputs["batch/x"]["local_shape"] == [16, 64]
    assert inputs["batch/y"]["shape"] == [32]
    assert inputs["params/w1"]["shape"] == [64, 32]
    assert inputs["params/b1"]["shape"] == [32]
    assert distributed["functions"][0]["mesh"]["process_count"] == 2
