"""A cause names the leaf whose annotation the user wrote, not an optimizer moment that copies it.

Shardy names one origin per mesh axis; a parameter and its Adam moments carry the same sharding into
the same ops (the update ``mu' = b1 * mu + (1 - b1) * g`` ties them), and Shardy may name a moment.
Found in the miniGPT trial (docs/trials.md): an all-reduce inside a layer norm said
"from optimizer/opt_state/0/mu/blocks/1/norm2/bias/value (model annotation at minigpt.stagetool.yaml:10)".
The program here has that shape in a few lines: a Flax NNX model annotated with
``nnx.with_partitioning(init, NamedSharding(mesh, P(...)))``, ``nnx.Optimizer`` with optax's adamw.
"""

from __future__ import annotations

import pytest
from helpers import raw_module, write

from stagetool.analysis.causes import copied_leaves
from stagetool.analysis.shardings import LeafReport
from stagetool.core.sharding import Sharding

MODEL = '''
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("batch", "model"))


def part(init, *spec):
    return nnx.with_partitioning(init, NamedSharding(mesh, P(*spec)))


class LM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(128, 32, embedding_init=part(nnx.initializers.normal(), None, "model"), rngs=rngs)
        self.up = nnx.Linear(32, 64, kernel_init=part(nnx.initializers.lecun_normal(), None, "model"), rngs=rngs)
        self.down = nnx.Linear(64, 32, kernel_init=part(nnx.initializers.lecun_normal(), "model", None), rngs=rngs)
        self.norm = nnx.LayerNorm(32, scale_init=part(nnx.initializers.ones_init(), "model"),
                                  bias_init=part(nnx.initializers.zeros_init(), "model"), rngs=rngs)
        self.out = nnx.Linear(32, 128, kernel_init=part(nnx.initializers.lecun_normal(), None, "model"), rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = self.norm(x + self.down(nnx.relu(self.up(x))))
        return self.out(x)


def make_optimizer(model):
    return nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, tokens, targets):
    def loss_fn(m):
        return optax.softmax_cross_entropy_with_integer_labels(m(tokens), targets).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss
'''

SPEC = '''
version: 1
mesh:
  axes: {batch: 4, model: 2}
functions:
  train_step:
    target: lm.py:train_step
    args:
      - init: lm.py:LM
        init_args: [{call: flax.nnx:Rngs, args: [0]}]
      - init: lm.py:make_optimizer
        init_args: [{arg: 0}]
      - 'i32[16,16] @ [batch, null]'
      - 'i32[16,16] @ [batch, null]'
'''


def test_a_tie_with_a_moment_names_the_parameter_and_its_annotation_line(run_cli, tmp_path, monkeypatch):
    pytest.importorskip("flax.nnx")
    import jax
    from flax import nnx

    path = write(tmp_path, "lm.py", MODEL)
    write(tmp_path, "lm.stagetool.yaml", SPEC)
    monkeypatch.chdir(tmp_path)
    doc = run_cli("collectives", "lm.py:train_step", "--no-cache", "--format", "json", check=0).json()
    (fn,) = doc["functions"]
    origins = [o for c in fn["collectives"]["items"] if c["cause"] for o in c["cause"]["origins"]]
    assert origins, fn["collectives"]
    named = {o["leaf"] for o in origins if o["kind"] == "input"}
    # the layer norm's reductions over `model` (x - mean over the sharded features): before, Shardy's
    # pick among the ties, optimizer/opt_state/0/mu/norm/bias/value (model annotation at lm.stagetool.yaml:11)
    assert not {x for x in named if x.startswith("optimizer/")}, named
    assert named & {"model/norm/bias/value", "model/norm/scale/value"}, named
    lines = path.read_text().splitlines()
    at = {o["leaf"]: o["source"] for o in origins if o["kind"] == "input"}
    for leaf, source in at.items():
        if leaf.startswith("model/"):  # each named with its nnx.with_partitioning line in lm.py
            attr = leaf.split("/")[1]
            line = int(source.split(":")[1])
            assert source.startswith("lm.py:") and "part(" in lines[line - 1] and f"self.{attr} = " in "\n".join(
                lines[line - 3:line]), (leaf, source)

    # it is a tie: in raw JAX's compile the parameter and both its moments have one sharding
    raw = raw_module(path, "lm_ties")
    model = raw.LM(nnx.Rngs(0))
    opt = raw.make_optimizer(model)
    for leaf in named:
        if leaf.startswith("model/"):
            param, moment = nnx.state(model, nnx.Param), opt.opt_state[0].mu
            for k in leaf.split("/")[1:-1]:
                param, moment = param[k], moment[k]
            (p,), (m,) = jax.tree.leaves(param), jax.tree.leaves(moment)
            assert p.sharding.is_equivalent_to(m.sharding, p.ndim), leaf


def _leaf(path: str, shape: tuple[int, ...], dims: tuple, n: int) -> LeafReport:
    s = Sharding("spec", dims)
    return LeafReport(path=path, shape=shape, dtype="float32", declared=s, compiled=s, chosen_by_partitioner=False,
                      shard_shape=shape, bytes_global=0, bytes_per_device=0, parameter=n)


def test_copied_leaves_maps_a_mirrored_tree_only():
    leaves = [_leaf("params/embed", (8, 4), ("model", None), 0), _leaf("params/layers/w", (4, 4), (None, "model"), 1),
              _leaf("params/w", (4, 4), ("model", None), 2),
              _leaf("opt_state/m/embed", (8, 4), ("model", None), 3),
              _leaf("opt_state/m/layers/w", (4, 4), (None, "model"), 4),
              _leaf("opt_state/m/w", (4, 4), (None, "model"), 5),  # its own sharding: not a copy
              _leaf("opt_state/count", (), (), 6)]
    got = copied_leaves({x.parameter: x for x in leaves})
    assert got == {3: 0, 4: 1}
    # a tree under the prefix that the other argument does not hold is no mirror of it
    extra = leaves + [_leaf("opt_state/m/other", (4,), (), 7)]
    assert copied_leaves({x.parameter: x for x in extra}) == {}
    # a leaf of one argument whose path ends like another of the same argument is not a copy
    same = [_leaf("params/a/w", (4, 4), ("model", None), 0), _leaf("params/b/a/w", (4, 4), ("model", None), 1)]
    assert copied_leaves({x.parameter: x for x in same}) == {}
