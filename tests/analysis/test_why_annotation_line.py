"""``why`` names the line of the model's code that wrote a sharding (issue 49, item 8): an NNX
``nnx.with_partitioning`` kernel init and a ``kernel_metadata={"out_sharding": ...}`` (as bonsai's Qwen3
annotates its layers), and an Equinox model laid out by a ``with_sharding_constraint`` in its init
(midGPT's ``shard_gpt``) are credited to those module lines, not to the spec's ``init:`` line; a
leaf the spec itself shards still names the spec."""

from __future__ import annotations

import pytest
from helpers import write

NNX = """\
import jax
from flax import nnx


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(256, 1024, rngs=rngs,  # UP
                             kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model")))
        self.down = nnx.Linear(1024, 256, rngs=rngs, kernel_metadata={"out_sharding": ("model", None)})  # DOWN

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def step(model, x):
    return model(x).sum()
"""
NNX_SPEC = """\
version: 1
mesh: {axes: {data: 2, model: 4}}
functions:
  step:
    target: ann.py:step
    args:
      - init: ann.py:MLP
      - 'f32[64,256] @ [data, null]'
"""

EQX = """\
import equinox as eqx
import jax
from jax.sharding import PartitionSpec as P


def lay_out(x):
    return jax.lax.with_sharding_constraint(x, P(None, "model"))  # LAYOUT


def init(key):
    layer = eqx.nn.Linear(256, 1024, use_bias=False, key=key)
    return eqx.tree_at(lambda m: m.weight, layer, lay_out(layer.weight.T))


def step(layer, x):
    return (x @ layer.weight).sum()
"""
EQX_SPEC = """\
version: 1
mesh: {axes: {data: 2, model: 4}}
functions:
  step:
    target: eqx_ann.py:step
    args:
      - init: eqx_ann.py:init
        init_args: [key(0)]
      - 'f32[64,256] @ [data, null]'
"""


def _line(source: str, mark: str) -> int:
    return next(i for i, t in enumerate(source.splitlines(), 1) if mark in t)


def _declared(run_cli, target: str, leaf: str) -> str:
    out = run_cli("why", target, "--leaf", leaf, check=0).stdout
    return next(line for line in out.splitlines() if line.startswith("input ")) + "\n" + " ".join(out.split())


def test_an_nnx_annotation_is_credited_to_the_module_line(run_cli, tmp_path, monkeypatch):
    pytest.importorskip("flax")
    write(tmp_path, "ann.py", NNX)
    write(tmp_path, "ann.stagetool.yaml", NNX_SPEC)
    monkeypatch.chdir(tmp_path)
    up = _declared(run_cli, "ann.py:step", "up/kernel")
    assert f"(the model's annotation at ann.py:{_line(NNX, '# UP')})" in up and "stagetool.yaml" not in up.split("\n")[0]
    down = _declared(run_cli, "ann.py:step", "down/kernel")
    assert f"(the model's annotation at ann.py:{_line(NNX, '# DOWN')})" in down
    x = _declared(run_cli, "ann.py:step", "x")
    assert "(the spec at ann.stagetool.yaml:8)" in x  # the spec's own leaf: the spec's line


def test_an_equinox_constraint_in_the_init_is_credited_to_its_line(run_cli, tmp_path, monkeypatch):
    pytest.importorskip("equinox")
    write(tmp_path, "eqx_ann.py", EQX)
    write(tmp_path, "eqx_ann.stagetool.yaml", EQX_SPEC)
    monkeypatch.chdir(tmp_path)
    weight = _declared(run_cli, "eqx_ann.py:step", "weight")
    assert f"(from the init at eqx_ann.py:{_line(EQX, '# LAYOUT')})" in weight, weight
