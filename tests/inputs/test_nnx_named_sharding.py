"""A Flax NNX model annotated as jax-ai-stack's miniGPT tutorial writes it: a ``Mesh`` built at import
and ``nnx.with_partitioning(init, NamedSharding(mesh, P(...)))`` on each parameter (a sharding, not
axis names). Found in a new-user trial (docs/trials.md): the annotation was read as axis names
("unexpected TypeError: 'NamedSharding' object is not iterable ... report it"), and an annotation of
the wrong rank was reported as Flax's bare ``AssertionError`` at another layer's line (the init's trace
under the staged mesh, which this code never sets) instead of JAX's own ValueError at the line that
has it. Each side is raw JAX's: the eager model's own shardings, the eager model's own error."""

from __future__ import annotations

import pytest
from helpers import raw_module, write

MODEL = '''
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("batch", "model"))


def part(init, spec):
    return nnx.with_partitioning(init, NamedSharding(mesh, spec))


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        xavier = nnx.initializers.xavier_uniform()
        self.up = nnx.Linear(64, 128, kernel_init=part(xavier, P(None, "model")),
                             bias_init=part(nnx.initializers.zeros_init(), P("model")), rngs=rngs)
        self.norm = nnx.LayerNorm(128, scale_init=part(nnx.initializers.ones_init(), SCALE), rngs=rngs)
        self.down = nnx.Linear(128, 64, kernel_init=part(xavier, P("model", None)), rngs=rngs)

    def __call__(self, x):
        return self.down(self.norm(nnx.relu(self.up(x))))


@nnx.jit
def train_step(model, x):
    def loss(m):
        return jnp.mean(m(x) ** 2)
    value, grads = nnx.value_and_grad(loss)(model)
    nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(model, nnx.Param), grads))
    return value
'''

SPEC = '''
version: 1
mesh:
  axes: {batch: 4, model: 2}
functions:
  train_step:
    target: ns.py:train_step
    args:
      - init: ns.py:MLP
      - 'f32[32,64] @ [batch, null]'
'''


@pytest.fixture
def program(tmp_path, monkeypatch):
    pytest.importorskip("flax.nnx")
    write(tmp_path, "ns.stagetool.yaml", SPEC)
    monkeypatch.chdir(tmp_path)

    def make(scale: str):
        path = write(tmp_path, "ns.py", MODEL.replace("SCALE", scale))
        return path
    return make


def test_a_namedsharding_annotation_is_the_models_sharding(run_cli, program):
    from flax import nnx

    path = program('P("model")')
    doc = run_cli("shardings", "ns.py:train_step", "--no-cache", "--format", "json", check=0).json()
    got = {x["path"]: (x["compiled"], x["sharding_source"]) for x in doc["functions"][0]["inputs"]}
    # raw: the model built eagerly, each parameter placed by Flax on its NamedSharding
    model = raw_module(path, "ns").MLP(nnx.Rngs(0))
    want = {f"model/{'/'.join(str(k) for k in p)}/value": str(getattr(v.sharding, "spec", "P()"))
            for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert want == {"model/down/bias/value": "P()", "model/down/kernel/value": "P('model', None)",
                    "model/norm/bias/value": "P()", "model/norm/scale/value": "P('model',)",
                    "model/up/bias/value": "P('model',)", "model/up/kernel/value": "P(None, 'model')"}
    annotated = {k for k, v in want.items() if v != "P()"}
    for k in annotated:
        assert got[k] == (want[k].replace(",)", ")"), "model"), (k, got[k])


def test_an_annotation_of_the_wrong_rank_is_jaxs_error_at_its_line(run_cli, program):
    from flax import nnx

    path = program('P(None, "model")')  # a 1-D scale annotated as 2-D (the tutorial's layer_norm2)
    with pytest.raises(ValueError, match="only valid for values of rank at least 2, but was applied to a value "
                                         "of rank 1") as raw:
        raw_module(path, "ns_bad").MLP(nnx.Rngs(0))
    r = run_cli("shardings", "ns.py:train_step", "--no-cache", check=3)
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if "self.norm = " in t)
    err = " ".join(r.stderr.split())
    assert "train_step: ValueError: One of with_sharding_constraint arguments is incompatible" in err, err
    assert "only valid for values of rank at least 2, but was applied to a value of rank 1" in str(raw.value)
    assert "only valid for values of rank at least 2, but was applied to a value of rank 1" in err
    assert f"(at ns.py:{line} in __init__" in err and "AssertionError" not in err
