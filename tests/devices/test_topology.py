"""Compile-only TPU topologies (stagetool.devices.tpu_topology) and tile padding (tpu_layout).

Tests that need libtpu skip without it; run them with a venv that has it
(``pip install -e ".[tpu,test]"``). The missing-libtpu path is tested everywhere.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from stagetool.core.errors import UsageError
from stagetool.devices import tpu_topology as topology
from stagetool.plan.target import parse_target
from stagetool.hlo import tpu_layout
from stagetool.hlo.tpu_layout import LeafBytes, hlo_shape_bytes, parse_hlo_shape

ROOT = Path(__file__).resolve().parents[2]
needs_libtpu = pytest.mark.skipif(not topology.libtpu_available(), reason="libtpu not installed")

# --- tile padding: pure -------------------------------------------------------------------

# (HLO parameter shape as libtpu 0.0.52 lays it out, bytes from memory_analysis().argument_size_in_bytes)
MEASURED = [
    ("f32[]{:T(128)}", 4, 512),
    ("f32[3,5]{1,0:T(4,128)}", 60, 2048),
    ("bf16[3,5]{1,0:T(4,128)(2,1)}", 30, 1024),
    ("s8[3,5]{1,0:T(4,128)(4,1)}", 15, 512),
    ("pred[3,5]{1,0:T(4,128)(4,1)}", 15, 512),
    ("s4[3,5]{1,0:T(8,128)(8,1)E(4)}", 8, 512),
    ("f32[300]{0:T(512)}", 1200, 2048),
    ("bf16[2,3,130]{2,0,1:T(2,128)(2,1)}", 1560, 3072),
    ("f32[5,1]{0,1:T(1,128)}", 20, 512),
    ("f8e4m3fn[17,129]{1,0:T(8,128)(4,1)}", 2193, 6144),
    ("s16[9,9]{1,0:T(8,128)(2,1)}", 162, 4096),
    ("f32[4096,250]{1,0:T(8,128)}", 4_096_000, 4096 * 256 * 4),
    ("bf16[512,4096]{1,0:T(8,128)(2,1)S(1)}", 512 * 4096 * 2, 512 * 4096 * 2),
]


@pytest.mark.parametrize("text,logical,padded", MEASURED)
def test_hlo_shape_bytes_matches_libtpu_measurements(text, logical, padded):
    assert hlo_shape_bytes(text) == LeafBytes(logical, padded)


def test_f32_3x5_pads_to_one_8x128_tile():
    b = hlo_shape_bytes("f32[3,5]{1,0:T(8,128)}")
    assert (b.logical_bytes, b.padded_bytes, b.padding_bytes) == (60, 8 * 128 * 4, 8 * 128 * 4 - 60)


def test_subtile_pads_the_tile_itself():
    # (4,1) sub-tiles of a (2,128) tile: the 2 rows pad to 4 -> 4*128 one-byte elements.
    assert hlo_shape_bytes("s8[2,128]{1,0:T(2,128)(4,1)}").padded_bytes == 4 * 128
    # bf16 (2,1) on an (8,128) tile adds nothing: 8 is even.
    assert hlo_shape_bytes("bf16[1024,4096]{1,0:T(8,128)(2,1)}").padded_bytes == 1024 * 4096 * 2


def test_untiled_and_layoutless_shapes_are_logical():
    assert hlo_shape_bytes("f32[3,5]{1,0}") == LeafBytes(60, 60)
    assert hlo_shape_bytes("f32[3,5]") == LeafBytes(60, 60)
    assert hlo_shape_bytes("s4[3]") == LeafBytes(2, 2)  # 12 bits round up to 2 bytes


def test_parse_hlo_shape_fields():
    s = parse_hlo_shape("bf16[2,3,130]{2,0,1:T(2,128)(2,1)S(1)}")
    assert (s.dtype, s.dims, s.minor_to_major, s.tiles, s.memory_space) == (
        "bf16", (2, 3, 130), (2, 0, 1), ((2, 128), (2, 1)), 1)
    assert s.major_to_minor == (1, 0, 2)
    assert parse_hlo_shape("s4[8]{0:T(1024)E(4)}").bits_per_element == 4


@pytest.mark.parametrize("bad", ["(f32[2], f32[3])", "token[]", "f32[<=4]", "xyz[3]", "f32[3,5]{0:T(8,128)}",
                                 "f32[8,8]{1,0:T(2,*)}"])
def test_parse_hlo_shape_rejects(bad):
    with pytest.raises(ValueError):
        parse_hlo_shape(bad)


def test_shard_bytes_reads_a_layout_object():
    layout = types.SimpleNamespace(major_to_minor=(1, 0, 2), tiling=((2, 128), (2, 1)),
                                   sub_byte_element_size_in_bits=0)
    assert tpu_layout.shard_bytes((2, 3, 130), jnp.bfloat16, layout) == LeafBytes(1560, 3072)
    int4 = types.SimpleNamespace(major_to_minor=(0, 1), tiling=((8, 128), (8, 1)), sub_byte_element_size_in_bits=4)
    assert tpu_layout.shard_bytes((3, 5), jnp.int4, int4) == LeafBytes(8, 512)
    none = types.SimpleNamespace(major_to_minor=None, tiling=None, sub_byte_element_size_in_bits=0)
    assert tpu_layout.shard_bytes((3, 5), jnp.float32, none) == LeafBytes(60, 60)


# --- topology names and the missing-libtpu path ----------------------------------------------

@pytest.mark.parametrize("name,parsed", [("v5e:2x4", ("v5e", (2, 4))), ("v5p:2x2x2", ("v5p", (2, 2, 2))),
                                         ("v4:2x2x1", ("v4", (2, 2, 1))), ("TPU v5 lite:2x4", ("TPU v5 lite", (2, 4))),
                                         (" v6e=4x4 ", ("v6e", (4, 4)))])
def test_parse_topology_name(name, parsed):
    from stagetool.plan.target import TpuTarget

    target = parse_target(name)
    assert isinstance(target, TpuTarget) and (target.kind, target.dims) == parsed


@pytest.mark.parametrize("name", ["", "v5e", "v5e:", "v5e:2x", "v5e:0x4", "v5e:2x2x2x2", ":2x4", "v5e:2*4"])
def test_parse_topology_name_rejects_with_accepted_forms(name):
    with pytest.raises(UsageError) as e:
        parse_target(name)
    assert "v5e:2x4" in e.value.hint and "v5p" in e.value.hint


def test_missing_libtpu_gives_install_line(monkeypatch):
    monkeypatch.setattr(topology, "libtpu_available", lambda: False)
    with pytest.raises(UsageError) as e:
        topology.tpu_topology_devices(parse_target("v5e:2x4"))
    assert "libtpu" in e.value.message and "pip install -e '.[tpu]'" in e.value.hint


@pytest.mark.skipif(topology.libtpu_available(), reason="needs a venv without libtpu")
def test_jax_without_libtpu_maps_to_usage_error(monkeypatch):
    # Skip stagetool's own check: JAX's RuntimeError("JAX TPU support not installed") is mapped too.
    monkeypatch.setattr(topology, "libtpu_available", lambda: True)
    with pytest.raises(UsageError) as e:
        topology.tpu_topology_devices(parse_target("v5e:2x4"))
    assert "not installed" in e.value.message and "pip install -e '.[tpu]'" in e.value.hint
    assert topology.libtpu_version() is None


# --- with libtpu ------------------------------------------------------------------------------

@needs_libtpu
@pytest.mark.parametrize("name,kind,gen,n,chips,per_chip,procs,hbm_gib", [
    ("v5e:2x4", "TPU v5 lite", "v5e", 8, 8, 1, 1, 16),     # a v5e-8 VM is one host
    ("v5e:4x4", "TPU v5 lite", "v5e", 16, 16, 1, 4, 16),    # larger slices: 4-chip hosts
    ("v5p:2x2x2", "TPU v5", "v5p", 8, 8, 1, 2, 95),
    ("v4:2x2x1", "TPU v4", "v4", 8, 4, 2, 1, 32),
    ("v6e:2x4", "TPU v6 lite", "v6e", 8, 8, 1, 1, 32),
])
def test_topology_facts(name, kind, gen, n, chips, per_chip, procs, hbm_gib):
    t = topology.tpu_topology(parse_target(name))
    assert (t.device_kind, t.generation, t.num_devices, t.num_chips, t.devices_per_chip, t.num_processes) == (
        kind, gen, n, chips, per_chip, procs)
    assert t.hbm_bytes_per_chip == hbm_gib * 2**30
    assert t.hbm_bytes_per_device == hbm_gib * 2**30 // per_chip
    assert t.hbm_source.startswith("https://cloud.google.com/tpu/docs/")
    assert t.device_coords == tuple((*d.coords, d.core_on_chip) for d in t.devices)
    assert len(set(t.device_coords)) == n
    assert all(d.platform == "tpu" for d in t.devices)


@needs_libtpu
def test_chips_per_host_bounds_sets_processes():
    assert topology.tpu_topology(parse_target("v5e:2x4"), chips_per_host_bounds=(2, 4, 1)).num_processes == 1
    assert topology.tpu_topology(parse_target("v5e:4x4"), chips_per_host_bounds=(2, 4, 1)).num_processes == 2
    with pytest.raises(UsageError, match="not divisible"):
        topology.tpu_topology_devices(parse_target("v5e:2x4"), chips_per_host_bounds=(3, 1, 1))
    # Smaller than libtpu's default 2x2x1 host: libtpu 0.0.42 refuses it, stagetool retries on one host.
    sub_host = topology.tpu_topology(parse_target("v5e:1x1"))
    assert (sub_host.num_devices, sub_host.num_processes) == (1, 1)


@needs_libtpu
@pytest.mark.parametrize("name", ["v7x:2x2x1", "v5litepod:2x4", "v5e:3x5"])
def test_libtpu_rejection_is_a_usage_error(name):
    with pytest.raises(UsageError) as e:
        topology.tpu_topology_devices(parse_target(name))
    assert name in e.value.message and "v5e:2x4" in e.value.hint


@needs_libtpu
def test_libtpu_start_up_prints_nothing_and_shares_the_lockfile():
    # This process holds /tmp/libtpu_lockfile; the child must still load libtpu (the module sets
    # ALLOW_MULTIPLE_LIBTPU_LOAD itself: the child's environment does not have it).
    assert len(topology.tpu_topology_devices(parse_target("v5e:1x1"))) == 1
    env = {k: v for k, v in os.environ.items() if k != "ALLOW_MULTIPLE_LIBTPU_LOAD"}
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
            "from stagetool.devices.tpu_topology import tpu_topology_devices\n"
            "from stagetool.plan.target import parse_target\n"
            "print(len(tpu_topology_devices(parse_target('v5e:2x4'))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert (r.returncode, r.stdout, r.stderr) == (0, "8\n", "")


@needs_libtpu
def test_cpu_devices_and_tpu_topology_coexist():
    devices = topology.tpu_topology_devices(parse_target("v5e:2x4"))
    assert len(devices) == 8 and devices[0].platform == "tpu"
    assert [d.platform for d in jax.devices()] == ["cpu"] * 8  # conftest's 8 host devices stay
    assert float(jax.jit(lambda x: x + 1)(1.0)) == 2.0


@needs_libtpu
def test_topology_mesh_layouts():
    t = topology.tpu_topology(parse_target("v5e:2x4"))
    mesh = topology.topology_mesh(t.devices, (2, 4), ("data", "model"))
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    assert set(mesh.axis_types) == {AxisType.Auto}
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))
    # v4 compile-only devices are two per chip: create_device_mesh refuses, device order is used.
    v4 = topology.tpu_topology_devices(parse_target("v4:2x2x1"))
    assert [d.id for d in topology.topology_mesh(v4, (2, 4), ("a", "b")).devices.flat] == [d.id for d in v4]
    with pytest.raises(UsageError, match="needs 6 devices"):
        topology.topology_mesh(t.devices, (2, 3), ("data", "model"))


@needs_libtpu
def test_compile_on_topology_gives_tpu_memory_and_cost():
    t = topology.tpu_topology(parse_target("v5e:2x4"))
    mesh = topology.topology_mesh(t.devices, (2, 4), ("data", "model"))
    x = jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P("data", None)))
    w = jax.ShapeDtypeStruct((4096, 1000), jnp.float32, sharding=NamedSharding(mesh, P(None, "model")))
    compiled = jax.jit(lambda x, w: jnp.tanh(x @ w).sum(axis=0)).trace(x, w).lower().compile()

    # Padded bytes from the public Format/Layout objects add up to XLA's argument size; the
    # logical ones do not (w's shard f32[4096,250] pads 250 -> 256 columns).
    leaves = [tpu_layout.shard_bytes(a.sharding.shard_shape(a.shape), a.dtype, f.layout)
              for a, f in zip((x, w), compiled.input_formats[0], strict=True)]
    mem = compiled.memory_analysis()
    assert sum(b.padded_bytes for b in leaves) == mem.argument_size_in_bytes == 512 * 4096 * 2 + 4096 * 256 * 4
    assert sum(b.logical_bytes for b in leaves) == 512 * 4096 * 2 + 4096 * 250 * 4
    # The HLO text path agrees with the Layout path.
    entry = compiled.as_text().split("\nENTRY ", 1)[1]
    params = re.findall(r"= (\S+\[[\d,]*\]\{[^}]*\}) parameter\((\d+)\)", entry)
    assert [hlo_shape_bytes(p) for p, _ in sorted(params, key=lambda p: int(p[1]))] == leaves
    assert mem.output_size_in_bytes == hlo_shape_bytes("f32[250]{0:T(256)}").padded_bytes == 1024
    assert mem.generated_code_size_in_bytes > 0

    cost = compiled.cost_analysis()
    matmul_flops_per_device = 2 * 512 * 4096 * 250
    assert matmul_flops_per_device <= cost["flops"] < 1.01 * matmul_flops_per_device
    assert cost["optimal_seconds"] > 0  # a TPU-only key
