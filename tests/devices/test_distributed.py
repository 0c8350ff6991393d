"""Multi-process helpers (stagetool.devices.distributed), including a real two-process run."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from stagetool.core.errors import UsageError
from stagetool.devices import distributed

WORKER = Path(__file__).with_name("dist_worker.py")
TIMEOUT_S = 120

SLURM = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "2", "SLURM_PROCID": "0",
         "SLURM_LOCALID": "0"}


@pytest.mark.parametrize("env,expected", [
    ({}, None),
    (SLURM, "slurm"),
    (SLURM | {"SLURM_NTASKS": "1"}, None),           # a one-task job is not multi-process
    ({k: v for k, v in SLURM.items() if k != "SLURM_PROCID"}, None),  # salloc shell, no srun step
    ({"OMPI_MCA_orte_hnp_uri": "123.0;tcp://10.0.0.1:5000", "OMPI_COMM_WORLD_SIZE": "4"}, "ompi"),
    ({"OMPI_COMM_WORLD_SIZE": "4"}, None),
    ({"TPU_WORKER_HOSTNAMES": "t1,t2,t3,t4"}, "tpu"),
    ({"TPU_WORKER_HOSTNAMES": "localhost"}, None),
    ({"MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.1:8080"}, "tpu"),
])
def test_detect_cluster(env, expected):
    assert distributed.detect_cluster(env) == expected


@pytest.mark.parametrize("args,fragment", [
    (("127.0.0.1:1234", None, None), "not --num-processes, --process-id"),
    ((None, 2, None), "not --coordinator, --process-id"),
    ((None, None, 0), "got --process-id 0"),
    (("127.0.0.1", 2, 0), "not HOST:PORT"),
    (("127.0.0.1:0", 2, 0), "not HOST:PORT"),
    (("127.0.0.1:99999", 2, 0), "not HOST:PORT"),
    (("127.0.0.1:1234", 0, 0), "positive integer"),
    (("127.0.0.1:1234", 2, 2), "[0, 2)"),
    (("127.0.0.1:1234", 2, -1), "[0, 2)"),
])
def test_bad_options_are_usage_errors(args, fragment):
    with pytest.raises(UsageError) as e:
        distributed.initialize(*args)
    assert fragment in e.value.message
    assert not jax.distributed.is_initialized()


def test_no_options_and_no_cluster_is_single_process():
    assert distributed.initialize(env={}) is False
    assert not jax.distributed.is_initialized()
    assert distributed.is_primary() and jax.process_count() == 1


def test_initialize_after_backend_start_is_a_usage_error():
    jax.devices()  # the test session's CPU backend is up
    with pytest.raises(UsageError) as e:
        distributed.initialize(f"127.0.0.1:{_free_port()}", 1, 0, timeout_s=5)
    assert "jax.distributed.initialize failed" in e.value.message
    assert not jax.distributed.is_initialized()


@pytest.mark.parametrize("local,spec,blocks,expected", [
    ((4, 16), ("data", None), {"data": 2, "model": 1}, (8, 16)),
    ((4, 16), (None, "model"), {"data": 2, "model": 1}, (4, 16)),
    ((4, 16), (("data", "model"),), {"data": 2, "model": 3}, (24, 16)),
    ((4, 16), (), {"data": 2}, (4, 16)),
    ((4, 6, 5), ("data", "pipe"), {"data": 2, "pipe": 4}, (8, 24, 5)),
])
def test_scale_local_shape(local, spec, blocks, expected):
    assert distributed.scale_local_shape(local, spec, blocks) == expected


def test_local_to_global_is_identity_in_one_process():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    assert distributed.process_blocks(mesh) == {"data": 1, "model": 1}
    assert distributed.local_to_global_shape((4, 16), P("data", "model"), mesh) == (4, 16)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(nproc: int, devices_per_process: int) -> list[dict]:
    """Start nproc worker processes, wait at most TIMEOUT_S, kill them all on timeout/failure."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "JAX_"))}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(port), str(nproc), str(i), str(devices_per_process)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              start_new_session=True)
             for i in range(nproc)]
    deadline = time.monotonic() + TIMEOUT_S
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert p.returncode == 0, f"worker failed ({p.returncode}):\n{err[-3000:]}"
            lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            assert len(lines) == 1, out
            outputs.append(json.loads(lines[0][len("RESULT "):]))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return outputs


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_stage_like_one_process_with_eight_devices():
    t0 = time.monotonic()
    two = _run_workers(2, 4)
    elapsed = time.monotonic() - t0
    (one,) = _run_workers(1, 8)

    assert [r["process_index"] for r in two] == [0, 1]
    assert [r["primary"] for r in two] == [True, False]
    assert all((r["process_count"], r["device_count"], r["local_device_count"]) == (2, 8, 4) for r in two)
    # Host-local x f32[4,16] sharded over 'data' (split across the processes) becomes f32[8,16];
    # w (sharded over 'model', inside each process) and the replicated b keep their shapes;
    # exactly what multihost_utils.host_local_array_to_global_array made of real arrays.
    for r in two:
        assert r["global_shapes"] == r["jax_global_shapes"] == {"x": [8, 16], "w": [16, 32], "b": [32]}
    # Both processes compiled the same program as one process with 8 devices.
    keys = ("global_shapes", "input_shardings", "output_sharding", "flops_per_device")
    assert two[0]["input_shardings"] == [["P('data', None)", [4, 16]], ["P(None, 'model')", [16, 8]], ["P()", [32]]]
    assert [{k: r[k] for k in keys} for r in two] == [{k: one[k] for k in keys}] * 2
    assert elapsed < 60, f"two-process run took {elapsed:.1f} s"


def test_a_job_joined_here_is_left_with_jax_distributed_shutdown_once(monkeypatch):
    """stagetool.devices.distributed.leave: jax.distributed.shutdown() (its barrier keeps process 0,
    the coordinator, alive until every process is done) only for a job initialize() joined, once; a
    failing shutdown (another process already gone) is not raised: the command's result stands."""
    import jax

    from stagetool.devices import distributed

    calls = []
    monkeypatch.setattr(jax.distributed, "shutdown", lambda: calls.append(1))
    monkeypatch.setattr(distributed, "_JOINED", [False])
    distributed.leave()
    assert calls == []  # not joined here: the caller's own job is the caller's to end
    distributed._JOINED[0] = True
    distributed.leave()
    distributed.leave()
    assert calls == [1] and distributed._JOINED == [False]

    def gone():
        raise RuntimeError("the coordination service is gone")

    monkeypatch.setattr(jax.distributed, "shutdown", gone)
    distributed._JOINED[0] = True
    distributed.leave()
    assert distributed._JOINED == [False]
