"""Work XLA's cost analysis does not count (issue 33, item 1): Pallas kernels with and without a
``cost_estimate`` (compile-only v5e), a top-k over vocabulary-sharded logits and a sort (CPU), each
against the analytic count or JAX's own ``Compiled.cost_analysis()`` of the same function."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import write

from stagetool.analysis.uncounted import KERNEL_ESTIMATE, NOT_COUNTED, SORT_RULE

N = 1024
KERNELS = """\
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

N = 1024


def _kernel(x_ref, y_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)


def _mm(x, y, cost):
    est = pl.CostEstimate(flops=2 * N * N * N, transcendentals=0, bytes_accessed=3 * N * N * 4) if cost else None
    return pl.pallas_call(_kernel, out_shape=jax.ShapeDtypeStruct((N, N), jnp.float32),  # KERNEL
                          cost_estimate=est)(x, y)


def with_cost(x, y):
    return _mm(x, y, True)


def without_cost(x, y):
    return _mm(x, y, False)


def mixed(x, y):
    return _mm(x, y, False) + x @ y
"""
KERNEL_SPEC = """\
version: 1
mesh: {axes: {data: 1}}
functions:
""" + "".join(f"  {f}:\n    target: k.py:{f}\n    args: ['f32[1024,1024]', 'f32[1024,1024]']\n"
              for f in ("with_cost", "without_cost", "mixed"))

TOPK = """\
import jax
import jax.numpy as jnp


def topk(logits):
    return jax.lax.top_k(logits, 8)  # TOPK


def sort(x):
    return jnp.sort(x, axis=-1)  # SORT
"""
TOPK_SPEC = """\
version: 1
mesh: {axes: {data: 2, model: 4}}
functions:
  topk:
    target: t.py:topk
    args: ['f32[64,32768] @ [data, model]']
  sort:
    target: t.py:sort
    args: ['f32[1024,4096]']
"""


def _line(text: str, marker: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if marker in line)


def _libtpu() -> bool:
    from stagetool.devices import tpu_topology

    return tpu_topology.libtpu_available()


@pytest.mark.skipif(not _libtpu(), reason="libtpu not installed: pip install -e '.[tpu]'")
def test_pallas_kernels_counted_from_their_estimate_or_named(run_cli, tmp_path):
    write(tmp_path, "k.py", KERNELS)
    spec = write(tmp_path, "k.stagetool.yaml", KERNEL_SPEC)
    doc = run_cli("cost", "--spec", str(spec), "--topology", "v5e:1x1", "--chip", "tpu-v5e", "--format", "json",
                  check=0).json()
    cost = {f["name"]: f["cost"] for f in doc["functions"]}
    where = f"k.py:{_line(KERNELS, '# KERNEL')}"

    # with a cost_estimate, XLA:TPU adds the author's figures: exactly the analytic matmul
    with_cost = cost["with_cost"]
    assert with_cost["per_device"]["flops"] == 2 * N**3
    assert with_cost["per_device"]["bytes_accessed"] == 3 * N * N * 4
    [row] = with_cost["uncounted"]
    assert (row["status"], row["kind"], row["flops"], row["source"]) == (
        KERNEL_ESTIMATE, "Pallas kernel (Mosaic TPU)", 2 * N**3, where)
    assert with_cost["flops_lower_bound"] is False
    # issue 41: the step-time model counts the kernel's estimate too, as XLA does: MFU over its FLOPs
    # (was 0.0%: the kernel counted as nothing), v5e's published 197 TFLOP/s bf16 peak
    step = with_cost["step_time"]
    assert step["flops"] == 2 * N**3
    assert step["mfu"] == pytest.approx(2 * N**3 / (step["schedule_seconds"] * 197e12), rel=1e-9)

    # without one, XLA counts nothing: n/a as unknown (not "usually 0"), the kernel named with its line
    alone = cost["without_cost"]
    assert alone["per_device"]["flops"] is None and alone["flops_lower_bound"] is True
    assert dict(alone["per_device"]["absent_reasons"])["flops"].endswith("unknown, not 0")
    [row] = alone["uncounted"]
    assert (row["status"], row["source"], row["output_bytes"]) == (NOT_COUNTED, where, N * N * 4)

    # beside an XLA dot: the total is the dot's 2N³ and the add's N², the kernel's 2N³ missing
    mixed = cost["mixed"]
    assert mixed["per_device"]["flops"] == 2 * N**3 + N * N
    assert mixed["flops_lower_bound"] is True and mixed["uncounted"][0]["status"] == NOT_COUNTED
    assert mixed["roofline"]["flops_per_device"] == 2 * N**3 + N * N  # the kernel's work left out

    text = run_cli("cost", "--spec", str(spec), "--topology", "v5e:1x1", "--chip", "tpu-v5e", "-f", "mixed",
                   check=0).stdout
    assert "FLOPs (lower bound: 1 instruction not counted by XLA)" in text
    assert f"not counted by XLA: Pallas kernel (Mosaic TPU) mixed.1 at {where}" in text
    assert "the roofline leaves their work out" in " ".join(text.split())
    # the MFU beside it is a floor too, naming the kernel left out (issue 41)
    assert f"(lower bound: 1 instruction not counted: Pallas kernel (Mosaic TPU) mixed.1 at {where})" in \
        " ".join(text.split()) and "MFU ≥ " in text


def test_topk_over_sharded_logits_is_named_not_counted(run_cli, tmp_path):
    write(tmp_path, "t.py", TOPK)
    spec = write(tmp_path, "t.stagetool.yaml", TOPK_SPEC)
    doc = run_cli("cost", "--spec", str(spec), "-f", "topk", "--format", "json", check=0).json()
    cost = doc["functions"][0]["cost"]
    rows = [r for r in cost["uncounted"] if r["kind"] == "top-k"]
    assert rows and all(r["status"] == NOT_COUNTED for r in rows)
    assert {r["source"] for r in rows} == {f"t.py:{_line(TOPK, '# TOPK')}"}
    assert cost["flops_lower_bound"] is True
    # XLA:CPU's own figure for the same function is its -1 "unknown"
    jax_flops = jax.jit(lambda x: jax.lax.top_k(x, 8)).lower(jnp.zeros((64, 32768))).compile().cost_analysis()["flops"]
    assert jax_flops == -1.0
    pd = cost["per_device"]
    assert pd["flops"] is None or pd["flops"] >= 0  # never XLA's -1 shown as a figure
    assert not [s for s in pd["suspects"] if s["field"] == "flops" and s["reason"].startswith("negative")]


def test_sort_row_equals_xlas_own_count(run_cli, tmp_path):
    write(tmp_path, "t.py", TOPK)
    spec = write(tmp_path, "t.stagetool.yaml", TOPK_SPEC)
    doc = run_cli("cost", "--spec", str(spec), "-f", "sort", "--format", "json", check=0).json()
    cost = doc["functions"][0]["cost"]
    [row] = cost["uncounted"]
    jax_flops = jax.jit(lambda x: jnp.sort(x, axis=-1)).lower(jnp.zeros((1024, 4096))).compile().cost_analysis()["flops"]
    assert row["status"] == SORT_RULE and row["flops"] == jax_flops == 1024 * 4096 * 22
    assert row["source"] == f"t.py:{_line(TOPK, '# SORT')}"
    assert cost["per_device"]["flops"] == jax_flops and cost["flops_lower_bound"] is False


LOOKUP = """\
def lookup(emb, ids):
    return emb[ids]
"""


@pytest.mark.skipif(not _libtpu(), reason="libtpu not installed: pip install -e '.[tpu]'")
def test_an_embedding_lookup_on_tpu_leaves_nothing_uncounted(run_cli, tmp_path):
    """XLA:TPU marks a gather's indices with the custom call ``AssumeGatherIndicesInBound`` (``s32[n]``
    in, the same out: an assumption, no arithmetic), as in every embedding lookup (jax-llm-examples'
    llama3 at ``model.py:974``): nothing is missing from XLA's count, so the FLOPs are XLA's own figure
    for the same function, not a lower bound."""
    import os

    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    write(tmp_path, "g.py", LOOKUP)
    spec = write(tmp_path, "g.stagetool.yaml", "version: 1\nmesh: {axes: {data: 1}}\nfunctions:\n  lookup:\n"
                                               "    target: g.py:lookup\n    args: ['f32[512,256]', 'i32[8,128]']\n")
    doc = run_cli("cost", "--spec", str(spec), "--topology", "v5e:1x1", "--format", "json", check=0).json()
    cost = doc["functions"][0]["cost"]
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu's lock file
    mesh = Mesh(topologies.get_topology_desc(platform="tpu", topology_name="v5e:1x1",
                                             chips_per_host_bounds=[1, 1, 1]).devices, ("data",))
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P())) for s, d in
            (((512, 256), jnp.float32), ((8, 128), jnp.int32))]
    compiled = jax.jit(lambda emb, ids: emb[ids]).trace(*args).lower().compile()
    assert "AssumeGatherIndicesInBound" in compiled.as_text()
    assert cost["uncounted"] == [] and cost["flops_lower_bound"] is False
    assert cost["per_device"]["flops"] == compiled.cost_analysis()["flops"]


BF16_KERNEL = """\
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

N = 1024


def _kernel(x_ref, y_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)


def bf16_mm(x, y):
    est = pl.CostEstimate(flops=2 * N**3, transcendentals=0, bytes_accessed=2 * N * N * 2 + N * N * 4)
    return pl.pallas_call(_kernel, out_shape=jax.ShapeDtypeStruct((N, N), jnp.float32), cost_estimate=est)(x, y)
"""


@pytest.mark.skipif(not _libtpu(), reason="libtpu not installed: pip install -e '.[tpu]'")
def test_a_compute_bound_kernel_step_time_is_not_below_its_roofline(run_cli, tmp_path):
    """Issue 41, item 5: a bf16 1024³ Pallas matmul with its cost_estimate is compute-bound on v5e
    (2·1024³ FLOPs at 197 TFLOP/s: 10.9 µs, over its 8 MiB at 819 GB/s: 10.2 µs). The roofline (XLA's
    FLOPs, the kernel's estimate among them) said ≥ 10.9 µs while the step time beside it counted the
    kernel as nothing (its bytes only, MFU 0%); both now count it, and the step is not below its bound."""
    write(tmp_path, "k.py", BF16_KERNEL)
    spec = write(tmp_path, "k.stagetool.yaml", "version: 1\nmesh: {axes: {data: 1}}\nfunctions:\n  bf16_mm:\n"
                                               "    target: k.py:bf16_mm\n    args: ['bf16[1024,1024]', 'bf16[1024,1024]']\n")
    doc = run_cli("cost", "--spec", str(spec), "--topology", "v5e:1x1", "--chip", "tpu-v5e", "--format", "json",
                  check=0).json()
    cost = doc["functions"][0]["cost"]
    roof, step = cost["roofline"], cost["step_time"]
    assert roof["flops_per_device"] == 2 * N**3 and roof["bound"] == "compute"
    assert roof["compute_seconds"] == pytest.approx(2 * N**3 / 197e12, rel=1e-9)
    assert step["flops"] == 2 * N**3
    assert step["schedule_seconds"] >= roof["lower_bound_seconds"] * (1 - 1e-9)
    assert step["mfu"] == pytest.approx(2 * N**3 / (step["schedule_seconds"] * 197e12), rel=1e-9)


def test_a_step_time_floor_over_complete_flops_gives_an_mfu_ceiling(run_cli, tmp_path, isolated_imports):
    """Issue 47 item 3: a sort timed at a floor (its FLOPs counted by XLA's rule) made the step time "at least"
    while the MFU beside it read as a figure; the step takes at least its figure, so the MFU is at most it."""
    (tmp_path / "sorts47.py").write_text("import jax.numpy as jnp\n\n\ndef step(x, w):\n"
                                         "    return jnp.sort(x @ w, axis=-1)\n")
    spec = tmp_path / "sorts47.stagetool.yaml"
    spec.write_text("functions:\n  step:\n    target: sorts47.py:step\n    args: ['f32[512,512]', 'f32[512,512]']\n")
    doc = run_cli("cost", "--spec", str(spec), "--chip", "tpu-v5e", "--format", "json", check=0).json()
    cost = doc["functions"][0]["cost"]
    assert cost["step_time"]["lower_bound"] and not cost["flops_lower_bound"]
    text = " ".join(run_cli("cost", "--spec", str(spec), "--chip", "tpu-v5e", check=0).stdout.split())
    assert "MFU ≤ " in text and "(the step time is a lower bound)" in text and "MFU ≥" not in text
