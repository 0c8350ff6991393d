"""Work computed whole on every device (issue 33, item 3): ``vmap(fft)`` over a batch sharded on an
8-way axis is all-gathered and transformed whole on each device; a batch-sharded matmul and an
FSDP-style step (weights gathered, batch split) are not flagged. Figures against XLA's
``Compiled.cost_analysis()`` of the same function and the analytic FFT count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from helpers import write
from jax.sharding import NamedSharding, PartitionSpec

from stagetool.hlo.collectives import MeshAxes
from stagetool.analysis.replicated import sharding_replicated_axes

MODEL = """\
import jax
import jax.numpy as jnp


def batched_fft(x):
    return jax.vmap(jnp.fft.fft)(x)  # FFT


def matmul(x, w):
    return x @ w


def fsdp(x, w):
    return jnp.tanh(x @ w)
"""
SPEC = """\
version: 1
mesh: {axes: {data: 8}}
functions:
  batched_fft:
    target: m.py:batched_fft
    args: ['c64[64,4096] @ [data, null]']
  matmul:
    target: m.py:matmul
    args: ['f32[512,1024] @ [data, null]', 'f32[1024,1024]']
  fsdp:
    target: m.py:fsdp
    args: ['f32[512,1024] @ [data, null]', 'f32[1024,1024] @ [data, null]']
"""
B, N = 64, 4096


def test_vmap_fft_over_a_sharded_batch_is_computed_whole_on_each_device(run_cli, tmp_path):
    write(tmp_path, "m.py", MODEL)
    spec = write(tmp_path, "m.stagetool.yaml", SPEC)
    doc = run_cli("cost", "--spec", str(spec), "--format", "json", check=0).json()
    cost = {f["name"]: f["cost"] for f in doc["functions"]}

    mesh = jax.make_mesh((8,), ("data",))
    f = jax.jit(jax.vmap(jnp.fft.fft), in_shardings=NamedSharding(mesh, PartitionSpec("data")))
    xla = f.lower(jax.ShapeDtypeStruct((B, N), jnp.complex64)).compile().cost_analysis()["flops"]
    analytic = 8 * 12 * B * N  # XLA's FFT rule: 8 × log2(4096) × complex elements, the whole batch
    [row] = cost["batched_fft"]["replicated"]
    line = next(i for i, t in enumerate(MODEL.splitlines(), 1) if "# FFT" in t)
    assert (row["opcode"], row["axes"], row["devices"], row["flops"]) == ("fft", ["data"], 8, analytic)
    assert abs(xla - analytic) <= 2  # XLA's own per-device figure: the whole batch's FFT on each device
    assert row["source"] == f"m.py:{line}" and row["made_whole_by"].startswith("all-gather")
    assert row["share"] > 0.99

    text = run_cli("cost", "--spec", str(spec), "-f", "batched_fft", check=0).stdout
    assert f"computed whole on each of 8 devices (mesh axis data): fft {row['instruction']} at m.py:{line}" \
        in " ".join(text.split())

    assert cost["matmul"]["replicated"] == []  # each device multiplies its own rows
    assert cost["fsdp"]["replicated"] == []    # weights gathered, but the batch stays split


def test_hlo_shardings_read_against_the_mesh():
    mesh = MeshAxes(("data", "model"), (2, 4))
    assert sharding_replicated_axes("{replicated}", mesh) == {"data", "model"}
    assert sharding_replicated_axes("{devices=[2,1,4]<=[8] last_tile_dim_replicate}", mesh) == {"model"}
    assert sharding_replicated_axes("{devices=[4,1,2]<=[2,4]T(1,0) last_tile_dim_replicate}", mesh) == {"data"}
    assert sharding_replicated_axes("{devices=[2,4]<=[8]}", mesh) == set()
    assert sharding_replicated_axes("{devices=[1,2,4]0,1,2,3,4,5,6,7 last_tile_dim_replicate}", mesh) == {"model"}
    assert sharding_replicated_axes("{maximal device=0}", mesh) == set()
    # what the compiled module of a JAX function says for its arguments' NamedShardings
    jmesh = jax.make_mesh((2, 4), ("data", "model"))
    for spec, same in ((PartitionSpec("data"), {"model"}), (PartitionSpec(None, "model"), {"data"}),
                       (PartitionSpec(("data", "model")), set()), (PartitionSpec(), {"data", "model"})):
        compiled = jax.jit(lambda x: x + 1, in_shardings=NamedSharding(jmesh, spec)).lower(
            jax.ShapeDtypeStruct((8, 8), jnp.float32)).compile().as_text()
        entry = compiled.split("\nENTRY", 1)[1]
        param = next(line for line in entry.splitlines() if " parameter(0)" in line)
        hlo = param.split("sharding=", 1)[1].split(", metadata", 1)[0] if "sharding=" in param else "{replicated}"
        assert sharding_replicated_axes(hlo, mesh) == same, (spec, hlo)
