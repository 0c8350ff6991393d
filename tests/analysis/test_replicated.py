"""Work computed whole on every device (issue 33, item 3): ``vmap(fft)`` over a batch sharded on an
8-way axis is all-gathered and transformed whole on each device; a batch-sharded matmul and an
FSDP-style step (weights gathered, batch split) are not flagged. Figures against XLA's
``Compiled.cost_analysis()`` of the same function and the analytic FFT count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import cli_environment, write
from jax.sharding import NamedSharding, PartitionSpec

from stagetool.hlo.collectives import MeshAxes
from stagetool.analysis.replicated import sharding_replicated_axes

MODEL = """\
import jax
import jax.numpy as jnp
import pytest


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


SCAN_MODEL = """\
import jax
import jax.numpy as jnp
import pytest


def layer_scan(ws, x):
    def loss(ws):
        def body(h, w):
            return jnp.tanh(h @ w), None  # LAYER
        h, _ = jax.lax.scan(body, x, ws)
        return jnp.mean(h ** 2)
    return ws - 0.1 * jax.grad(loss)(ws)


def moe(x, w, sizes):
    return jax.lax.ragged_dot(x, w, sizes)  # RAGGED
"""
SCAN_SPEC = """\
version: 1
mesh: {axes: {data: 8}}
functions:
  layer_scan:
    target: s.py:layer_scan
    args: ['f32[8,512,512] @ [data]', 'f32[64,512]']
  moe:
    target: s.py:moe
    args: ['f32[1024,512] @ [data]', 'f32[8,512,1024] @ [data]', 'i32[8]']
"""
L, D, BATCH = 8, 512, 64


def _libtpu() -> bool:
    from stagetool.devices import tpu_topology

    return tpu_topology.libtpu_available()


@pytest.fixture(scope="module")
def scan_costs(tmp_path_factory):
    """``cost --format json`` of the two functions on the CPU mesh and (where libtpu is installed) on
    ``v5e:2x4``, through the CLI's entry point in this process, once for the module."""
    import json

    from stagetool.cli import main

    folder = tmp_path_factory.mktemp("scan")
    write(folder, "s.py", SCAN_MODEL)
    spec = write(folder, "s.stagetool.yaml", SCAN_SPEC)
    out = {}
    with cli_environment(folder):
        for name, extra in (("cpu", []), ("v5e:2x4", ["--topology", "v5e:2x4"])):
            if name != "cpu" and not _libtpu():
                continue
            target = folder / f"{name}.json"
            assert main(["cost", "--spec", str(spec), "--format", "json", "-o", str(target), *extra]) == 0
            out[name] = {f["name"]: f["cost"] for f in json.loads(target.read_text())["functions"]}
    return out


def _scan_line() -> str:
    return f"s.py:{next(i for i, t in enumerate(SCAN_MODEL.splitlines(), 1) if '# LAYER' in t)}"


@pytest.mark.parametrize("backend", ["cpu", "v5e:2x4"])
def test_a_layer_sharded_scan_is_replicated_per_step_on_every_backend(scan_costs, backend):
    """Issue 41, item 3: the stack is sharded over layers and x replicated, so every device gathers
    each layer and computes the whole h @ w (forward), g @ wᵀ and hᵀ @ g (backward): 8 layers × 2·B·D²
    per step each, 8-fold redundant. Found on both backends (XLA:TPU keeps the gather in the loop and
    carries the shard in the loop state beside replicated values; it was not flagged there), counted
    per step (it was one body's 33.6 MFLOP)."""
    if backend not in scan_costs:
        pytest.skip("libtpu not installed: pip install -e '.[tpu]'")
    rows = scan_costs[backend]["layer_scan"]["replicated"]
    per_layer = 2 * BATCH * D * D
    assert len(rows) == 3 and all(r["devices"] == 8 and r["axes"] == ["data"] for r in rows)
    for r in rows:
        assert r["executions"] == L and r["flops"] == L * r["flops_per_execution"]
        assert per_layer <= r["flops_per_execution"] < 1.03 * per_layer  # the dot and its fused element-wise ops
        assert r["source"] == _scan_line() and r["made_whole_by"].startswith("all-gather")
    total = scan_costs[backend]["layer_scan"]["loop_aware"]["flops"]
    assert 0.95 < sum(r["flops"] for r in rows) / total <= 1.0  # the step's work is nearly all redundant


def test_raw_jax_counts_one_body_of_the_scan():
    """XLA's own per-device FLOPs of the same program on the CPU mesh count each loop body once:
    forward and backward bodies hold the three 2·B·D² dots (and element-wise work)."""
    from jax.sharding import Mesh

    ns: dict = {}
    exec(SCAN_MODEL, ns)
    mesh = Mesh(jax.devices()[:8], ("data",))
    args = (jax.ShapeDtypeStruct((L, D, D), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("data"))),
            jax.ShapeDtypeStruct((BATCH, D), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec())))
    flops = jax.jit(ns["layer_scan"]).lower(*args).compile().cost_analysis()["flops"]
    assert 3 * 2 * BATCH * D * D <= flops < 1.02 * 3 * 2 * BATCH * D * D


def test_a_ragged_dot_every_tpu_device_computes_whole_is_flagged(scan_costs):
    """``ragged_dot`` with the tokens and the experts' weights sharded over ``data``: XLA:TPU gathers
    both and runs its ragged-dot kernel on all 1024 tokens on every device (its cost_estimate, which
    XLA adds: 2 × 1024 × 512 × 1024 FLOPs = XLA's own per-device figure for the same program), then
    keeps its 128 rows."""
    if "v5e:2x4" not in scan_costs:
        pytest.skip("libtpu not installed: pip install -e '.[tpu]'")
    from jax.sharding import Mesh

    from helpers import target_devices

    mesh = Mesh(target_devices("v5e:2x4")[:8], ("data",))
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, p)) for s, d, p in
            (((1024, 512), jnp.float32, PartitionSpec("data")), ((8, 512, 1024), jnp.float32, PartitionSpec("data")),
             ((8,), jnp.int32, PartitionSpec()))]
    xla = jax.jit(lambda x, w, s: jax.lax.ragged_dot(x, w, s)).lower(*args).compile().cost_analysis()["flops"]
    assert xla == 2 * 1024 * 512 * 1024
    [row] = scan_costs["v5e:2x4"]["moe"]["replicated"]
    assert (row["opcode"], row["devices"], row["flops"], row["executions"]) == ("custom-call", 8, xla, 1)
    line = next(i for i, t in enumerate(SCAN_MODEL.splitlines(), 1) if "# RAGGED" in t)
    assert row["source"] == f"s.py:{line}" and row["made_whole_by"].startswith("all-gather")


NNX_HEAD = """\
import jax
from flax import nnx
from jax.sharding import PartitionSpec as P


class Head(nnx.Module):
    def __init__(self, rngs):
        self.proj = nnx.Linear(256, 512, rngs=rngs)

    def __call__(self, x):
        x = jax.lax.with_sharding_constraint(x, P())  # every device takes the whole batch
        return self.proj(x)  # PROJ


def step(model, x):
    return model(x)
"""
NNX_HEAD_SPEC = """\
version: 1
mesh: {axes: {data: 8}}
functions:
  step:
    target: head.py:step
    args:
      - init: head.py:Head
      - 'f32[64,256] @ [data, null]'
"""


def test_replicated_work_in_a_library_layer_names_the_models_line(run_cli, tmp_path):
    """An NNX model's nnx.Linear on a batch gathered whole: the row names the model's line that called
    the layer, not Flax's own linear.py line where the dot_general is written."""
    pytest.importorskip("flax")
    write(tmp_path, "head.py", NNX_HEAD)
    spec = write(tmp_path, "head.stagetool.yaml", NNX_HEAD_SPEC)
    doc = run_cli("cost", "--spec", str(spec), "--format", "json", check=0).json()
    [row] = doc["functions"][0]["cost"]["replicated"]
    line = next(i for i, t in enumerate(NNX_HEAD.splitlines(), 1) if "# PROJ" in t)
    assert row["op_name"].endswith("dot_general") and row["axes"] == ["data"]
    assert row["source"] == f"head.py:{line}"
    # the step time's longest instructions too: the dot and the bias add at the model's line
    doc = run_cli("cost", "--spec", str(spec), "--chip", "tpu-v5e", "--format", "json", check=0).json()
    sources = {t["source"] for t in doc["functions"][0]["cost"]["step_time"]["top"] if t.get("source")}
    assert f"head.py:{line}" in sources and not any("linear.py" in s for s in sources), sources
