"""Bytes before and after optimisation that disagree beyond what partitioning explains (issue 33,
item 8): a chain of 1,000 adds counts every unfused op's reads and writes before optimisation
(30,009,679,872 B) against 20,000,000 B after; flagged with both figures, which equal JAX's own
``Lowered``/``Compiled.cost_analysis()``. A plain matmul is not flagged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from helpers import write

MODEL = """\
def chain(x):
    for _ in range(1000):
        x = x + 1.0
    return x


def matmul(a, b):
    return a @ b
"""
SPEC = """\
version: 1
mesh: {axes: {data: 1}}
functions:
  chain:
    target: m.py:chain
    args: ['f32[2500000]']
  matmul:
    target: m.py:matmul
    args: ['f32[256,512]', 'f32[512,128]']
"""


def _chain(x):
    for _ in range(1000):
        x = x + 1.0
    return x


def test_a_chain_of_adds_flags_bytes_before_against_after(run_cli, tmp_path):
    write(tmp_path, "m.py", MODEL)
    spec = write(tmp_path, "m.stagetool.yaml", SPEC)
    doc = run_cli("cost", "--spec", str(spec), "--format", "json", check=0).json()
    cost = {f["name"]: f["cost"] for f in doc["functions"]}
    lowered = jax.jit(_chain).lower(jax.ShapeDtypeStruct((2_500_000,), jnp.float32))
    before, after = lowered.cost_analysis()["bytes accessed"], lowered.compile().cost_analysis()["bytes accessed"]
    assert after == 2 * 2_500_000 * 4  # read x once, write the result once: the fused chain
    chain = cost["chain"]
    assert (chain["whole_program"]["bytes_accessed"], chain["per_device"]["bytes_accessed"]) == (before, after)
    [flag] = [s for s in chain["whole_program"]["suspects"] if s["field"] == "bytes_accessed"]
    assert f"{before:,.0f} bytes accessed" in flag["reason"] and f"{before / after:,.0f}×" in flag["reason"]
    assert not [s for s in cost["matmul"]["whole_program"]["suspects"] if s["field"] == "bytes_accessed"]
    text = " ".join(run_cli("cost", "--spec", str(spec), "-f", "chain", check=0).stdout.split())
    assert "whole program: suspect bytes_accessed" in text and "no estimate of memory traffic" in text
