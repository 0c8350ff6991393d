"""The code paths that differ on attached GPUs, exercised with stand-in devices (no GPU needed)."""

from __future__ import annotations

import dataclasses
import types

import jax
import pytest

from stagetool.core.errors import UsageError
from stagetool.devices import provision as devices_mod
from stagetool.pipeline import _capacity
from stagetool.plan.plan import Plan, run_chip
from stagetool.plan.target import Attached
from stagetool.core.mesh import MeshSpec
from stagetool.spec.model import Spec


def fake_gpu(i: int, limit: int = 80 * 2**30):
    return types.SimpleNamespace(id=i, platform="gpu", device_kind="NVIDIA H100 80GB HBM3", process_index=0,
                                 memory_stats=lambda: {"bytes_limit": limit, "bytes_in_use": 0})


def test_too_few_gpus_is_a_usage_error_that_suggests_simulating(monkeypatch):
    monkeypatch.setattr(jax, "devices", lambda platform=None: [fake_gpu(0), fake_gpu(1)])
    with pytest.raises(UsageError) as e:
        devices_mod.provision(MeshSpec((("data", 2), ("model", 4))), Attached("gpu"))
    assert e.value.message == "the mesh data=2 × model=4 needs 8 devices, but platform gpu has 2"
    assert "--platform cpu" in e.value.hint


def test_capacity_comes_from_the_gpu(monkeypatch):
    plan = Plan(Spec(None, MeshSpec(()), None, None, "global", {}), (), MeshSpec(()), Attached("gpu"), "global")
    setup = types.SimpleNamespace(devices=(fake_gpu(0, 12345),), device_kind="NVIDIA H100 80GB HBM3",
                                  capacity_bytes=None, capacity_source=None,
                                  chip=run_chip(plan, "gpu", "NVIDIA H100 80GB HBM3"))
    assert _capacity(plan, setup) == (12345, "jax.Device.memory_stats()['bytes_limit']")
    # --device-memory (resolved to bytes by make_plan) wins over what the device says.
    assert _capacity(dataclasses.replace(plan, device_memory_bytes=2**30), setup) == (2**30, "--device-memory")


def test_capacity_falls_back_to_the_chip_table_for_a_known_gpu_kind():
    dev = types.SimpleNamespace(id=0, platform="gpu", memory_stats=lambda: None)
    plan = Plan(Spec(None, MeshSpec(()), None, None, "global", {}), (), MeshSpec(()), Attached("gpu"), "global")
    setup = types.SimpleNamespace(devices=(dev,), device_kind="NVIDIA H100 80GB HBM3", capacity_bytes=None,
                                  capacity_source=None, chip=run_chip(plan, "gpu", "NVIDIA H100 80GB HBM3"))
    assert _capacity(plan, setup) == (80 * 2**30, "chip table (h100-sxm, from device NVIDIA H100 80GB HBM3)")
