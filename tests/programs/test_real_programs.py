"""Programs as people write them, each once staged wrongly or not at all (issue #9): the values shown
are what raw JAX gives for the same program."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import import_afresh, leaves_by_path, write


def test_init_leaves_keep_weak_type(tmp_path, run_cli):
    """A bf16 Adam-style step: the Python-int count is weakly typed, so 0.9 ** count stays weak and the
    bf16 weight stays bf16 (raw JAX: bf16[8]); stagetool once made it a strong i32, promoting to f32."""
    write(tmp_path, "m.py", """
        import jax.numpy as jnp

        def init():
            return {"w": jnp.zeros((8,), jnp.bfloat16), "count": jnp.array(0)}

        def step(s):
            return s["w"] / (1 - 0.9 ** s["count"])
    """)
    write(tmp_path, "m.stagetool.yaml", """
        version: 1
        functions:
          step:
            target: m.py:step
            args: [{init: m.py:init}]
    """)
    out = run_cli("shardings", tmp_path / "m.py:step", "--format", "json", check=0).json()
    [leaf] = out["functions"][0]["outputs"]
    raw = jax.eval_shape(lambda: (lambda s: s["w"] / (1 - 0.9 ** s["count"]))(
        {"w": jnp.zeros((8,), jnp.bfloat16), "count": jnp.array(0)}))
    assert (leaf["dtype"], leaf["shape"], leaf["bytes_per_device"]) == (str(raw.dtype), [8], 16) == ("bfloat16", [8], 16)


def test_none_subtree_in_an_argument(tmp_path, run_cli):
    write(tmp_path, "m.py", """
        def f(p, x):
            return x @ p["w"]
    """)
    write(tmp_path, "m.stagetool.yaml", """
        version: 1
        mesh: {axes: {x: 8}}
        functions:
          f:
            target: m.py:f
            args: [{w: 'f32[8,4]', b: null}, 'f32[2,8]']
    """)
    out = run_cli("shardings", tmp_path / "m.py:f", "--format", "json", check=0).json()
    leaves = leaves_by_path(out)
    assert list(leaves) == ["p/w", "x"]
    assert leaves["p/w"]["bytes_per_device"] == 8 * 4 * 4 and leaves["p/w"]["compiled"] == "P(None, None)"


def test_registered_dict_subclass_with_attribute_access(tmp_path, run_cli):
    """Public recipes' AttrDict configs/train states: ``__getattr__ = dict.__getitem__`` raises KeyError
    (not AttributeError) for a missing attribute, which broke ``hasattr`` probing."""
    write(tmp_path, "m.py", """
        import jax
        import jax.numpy as jnp

        class AttrDict(dict):
            __getattr__ = dict.__getitem__

        jax.tree_util.register_pytree_with_keys(
            AttrDict,
            lambda d: ([(jax.tree_util.DictKey(k), d[k]) for k in sorted(d)], tuple(sorted(d))),
            lambda keys, values: AttrDict(zip(keys, values)))

        def init():
            return AttrDict(w=jnp.zeros((8, 4)))

        def f(s):
            return s.w * 2
    """)
    write(tmp_path, "m.stagetool.yaml", """
        version: 1
        functions:
          f: {target: m.py:f, args: [{init: m.py:init}]}
    """)
    out = run_cli("shardings", tmp_path / "m.py:f", "--format", "json", check=0).json()
    leaf = leaves_by_path(out)["s/w"]
    assert (leaf["dtype"], leaf["shape"], leaf["bytes_per_device"]) == ("float32", [8, 4], 128)


def test_collective_source_is_the_innermost_user_frame_in_another_file(tmp_path, run_cli):
    write(tmp_path, "lib/model.py", """
        def layer(x, w):
            return x @ w
    """)
    write(tmp_path, "app/step.py", """
        import sys, pathlib
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "lib"))
        from model import layer

        def step(x, w):
            return layer(x, w)
    """)
    write(tmp_path, "app/step.stagetool.yaml", """
        version: 1
        mesh: {axes: {x: 8}}
        functions:
          step:
            target: step.py:step
            args: ['f32[16,64] @ [null, x]', 'f32[64,32] @ [x, null]']
    """)
    out = run_cli("collectives", tmp_path / "app/step.py:step", "--format", "json", check=0).json()
    items = out["functions"][0]["collectives"]["items"]
    [reduce] = [i for i in items if i["collective"]["kind"] == "all-reduce"]
    assert reduce["source"].endswith("model.py:2"), reduce["source"]
    chain = reduce["collective"]["source_chain"]
    assert not any("/stagetool/" in f["file"] or "/typer/" in f["file"] for f in chain), chain


def test_static_argnums_of_a_prejitted_target(tmp_path, run_cli):
    write(tmp_path, "m.py", """
        import jax
        import jax.numpy as jnp

        def f(x, gain, clip):
            return jnp.sum(jnp.clip(gain * x, 0, None) if clip else gain * x)

        f_jit = jax.jit(f, static_argnums=2)
    """)
    write(tmp_path, "m.stagetool.yaml", """
        version: 1
        functions:
          f: {target: m.py:f_jit, args: ['f32[4,4]', 'f32[]', true]}
    """)
    out = run_cli("cost", tmp_path / "m.py:f_jit", "--format", "json", check=0).json()
    flops = out["functions"][0]["cost"]["per_device"]["flops"]

    def f(x, gain, clip):
        return jnp.sum(jnp.clip(gain * x, 0, None) if clip else gain * x)

    raw = jax.jit(f, static_argnums=2).lower(jax.ShapeDtypeStruct((4, 4), jnp.float32),
                                             jax.ShapeDtypeStruct((), jnp.float32), True).compile()
    assert flops == raw.cost_analysis()["flops"] == 47.0


NNX_STEP = """
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    def make_model():
        return nnx.Linear(512, 256, rngs=nnx.Rngs(0))

    def make_optimizer():
        return nnx.Optimizer(make_model(), optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: m(x).sum())(model)
        optimizer.update(model, grads)
        return loss
"""


def test_nnx_in_place_step_keeps_the_update(tmp_path, run_cli):
    pytest.importorskip("flax")
    import optax
    from flax import nnx

    write(tmp_path, "m.py", NNX_STEP)
    write(tmp_path, "m.stagetool.yaml", """
        version: 1
        functions:
          step:
            target: m.py:step
            args:
              - init: m.py:make_model
              - init: m.py:make_optimizer
              - 'f32[16,512]'
            donate: [0, 1]
    """)
    out = run_cli("report", tmp_path / "m.py:step", "--format", "json", check=0).json()
    fn = out["functions"][0]

    @nnx.jit
    def step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: m(x).sum())(model)
        optimizer.update(model, grads)
        return loss

    model = nnx.Linear(512, 256, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    raw = nnx.jit(step.fun, donate_argnums=(0, 1)).lower(model, optimizer, jnp.ones((16, 512))).compile()
    assert fn["cost"]["per_device"]["flops"] == raw.cost_analysis()["flops"]
    forward_only = 2 * 16 * 512 * 256
    assert raw.cost_analysis()["flops"] > 2 * forward_only  # the backward pass and the update are in it
    donated = [x for x in fn["inputs"] if x["donated"]]
    assert {x["path"] for x in donated} == {"model/bias/value", "model/kernel/value", "optimizer/step/value"}
    aliased = {d["path"]: d["status"] for d in fn["memory"]["donation"]}
    assert all(aliased[x["path"]] == "aliased" for x in donated), aliased
    outputs = leaves_by_path(out, "outputs")
    assert {"out", "model/bias/value", "model/kernel/value", "optimizer/step/value"} <= set(outputs)


def test_check_compares_compiler_chosen_outputs_apart():
    """An output sharding the compiler chose (no out_shardings) that now holds fewer bytes per device
    is shown, not failed; a declared output's sharding change still fails."""
    from stagetool.gate.compare import _compare_leaves

    def leaf(sharding, per_device, chosen):
        return {"path": "out", "shape": [8, 4], "dtype": "float32", "sharding": sharding,
                "bytes_per_device": per_device, "unused": False, **({"chosen": True} if chosen else {})}

    [chosen] = _compare_leaves("f", "output", [leaf("P(None, None)", 128, True)], [leaf("P('x', None)", 16, True)])
    assert chosen.status == "changed" and "compiler's choice" in chosen.what
    [grew] = _compare_leaves("f", "output", [leaf("P('x', None)", 16, True)], [leaf("P(None, None)", 128, True)])
    assert grew.status == "regression"
    [declared] = _compare_leaves("f", "output", [leaf("P(None, None)", 128, False)], [leaf("P('x', None)", 16, False)])
    assert declared.status == "regression"


def test_ref_objects_and_callable_rules(tmp_path, run_cli):
    """``{ref: ...}`` passes a module-level object as it is (its arrays abstract, its functions static);
    a callable rule returns a PartitionSpec per leaf, or None to let the next rule decide."""
    write(tmp_path, "m.py", """
        import jax.numpy as jnp
        from jax.sharding import PartitionSpec as P

        STATE = {"w": jnp.zeros((8, 4)), "act": jnp.tanh}

        def init():
            return {"w": jnp.zeros((8, 4)), "b": jnp.zeros((4,))}

        def fsdp_spec(path, leaf):
            return P("x") if path.endswith("/w") else None

        def f(p, s):
            return s["act"](p["w"] + p["b"]) * s["w"]
    """)
    write(tmp_path, "m.stagetool.yaml", """
        version: 1
        mesh: {axes: {x: 8}}
        functions:
          f:
            target: m.py:f
            args:
              - init: m.py:init
                rules: [{call: m.py:fsdp_spec}, ['.*', replicated]]
              - {ref: m.py:STATE}
    """)
    leaves = leaves_by_path(run_cli("shardings", tmp_path / "m.py:f", "--format", "json", check=0).json())
    assert list(leaves) == ["p/b", "p/w", "s/w"]
    assert (leaves["p/w"]["compiled"], leaves["p/w"]["bytes_per_device"], leaves["p/w"]["sharding_source"]) == \
        ("P('x', None)", 8 * 4 * 4 // 8, "rule")
    assert (leaves["p/b"]["compiled"], leaves["p/b"]["sharding_source"]) == ("P(None)", "rule")
    assert leaves["s/w"]["bytes_per_device"] == 8 * 4 * 4


def test_ref_leaves_say_the_object_gives_their_sharding_and_why_agrees(tmp_path, run_cli):
    """A ``{ref:}`` object has no init: its leaves take the sharding its arrays carry (``object``), the
    model's annotation when that is what put it there (``model``), else ``unknown``; ``why --leaf``
    names the same source as the shardings table (it said "not given" while the table said "from init")."""
    pytest.importorskip("flax")
    write(tmp_path, "m.py", """
        import jax
        import jax.numpy as jnp
        from flax import nnx
        from jax.sharding import NamedSharding, PartitionSpec as P

        mesh = jax.make_mesh((8,), ("x",))
        STATE = {"w": jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("x"))), "b": jnp.ones((4,))}
        with jax.set_mesh(mesh):
            MODEL = nnx.Linear(4, 16, rngs=nnx.Rngs(0),
                               kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "x")))

        def f(s, model):
            return model(s["w"] + s["b"])
    """)
    # Auto axes, said: left out, the module's mesh (jax.make_mesh's default, Explicit) would give its own
    write(tmp_path, "m.stagetool.yaml", """
        version: 1
        mesh: {axes: {x: 8}, axis_types: auto}
        functions:
          f:
            target: m.py:f
            args:
              - {ref: m.py:STATE}
              - {ref: m.py:MODEL}
    """)
    leaves = leaves_by_path(run_cli("shardings", tmp_path / "m.py:f", "--format", "json", check=0).json())
    import sys

    sys.path.insert(0, str(tmp_path))
    import m

    carried = {"s/w": m.STATE["w"].sharding.spec, "model/bias/value": m.MODEL.bias[...].sharding.spec,
               "model/kernel/value": m.MODEL.kernel[...].sharding.spec}
    assert (carried["s/w"], carried["model/bias/value"], carried["model/kernel/value"]) == (P("x"), P(None), P(None, "x"))
    assert not hasattr(m.STATE["b"].sharding, "spec")  # one device: nothing says how to shard it
    assert {p: (x["declared"], x["sharding_source"]) for p, x in leaves.items()} == {
        "s/w": ("P('x', None)", "object"), "s/b": ("P(None)", "unknown"),
        "model/bias/value": ("P(None)", "object"), "model/kernel/value": ("P(None, 'x')", "model")}
    assert leaves["s/w"]["bytes_per_device"] == 8 * 4 * 4 // 8
    inputs = run_cli("shardings", tmp_path / "m.py:f", check=0).stdout.split("\noutputs")[0]
    notes = {line.split()[0]: line for line in inputs.splitlines() if line.strip().startswith(("s/", "model/"))}
    assert notes["s/w"].rstrip().endswith("from the object") and notes["model/bias/value"].rstrip().endswith(
        "from the object")
    assert notes["model/kernel/value"].rstrip().endswith("from model") and "sharding unknown" in notes["s/b"]
    said = {"s/w": "from the object", "s/b": "nothing gives one: replicated",
            "model/bias/value": "from the object", "model/kernel/value": "the model's annotation"}
    for path, words in said.items():
        why = run_cli("why", tmp_path / "m.py:f", "--leaf", path, check=0).stdout
        assert f"input {path}: declared {leaves[path]['declared']} ({words} at m.stagetool.yaml:" in why, why


def test_a_cache_hit_says_this_runs_sharding_source(tmp_path, run_cli):
    """The same program, leaves and spec lines, but the object's array now carries a sharding: the
    facts cache must not answer with the entry's "unknown" (``sharding_source`` is in the key)."""
    program = """
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P

        mesh = jax.make_mesh((8,), ("x",))
        STATE = {{"w": {w}}}

        def f(s):
            return s["w"] * 2
    """
    write(tmp_path, "m.stagetool.yaml", """
        version: 1
        mesh: {axes: {x: 8}}
        functions:
          f: {target: m.py:f, args: [{ref: m.py:STATE}]}
    """)
    cache = tmp_path / "cache"
    sources = []
    for w in ("jnp.ones((8, 4))", "jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P()))"):
        write(tmp_path, "m.py", program.format(w=w))
        import_afresh("m", tmp_path)  # the edited file is imported again, as in a new process
        out = run_cli("shardings", tmp_path / "m.py:f", "--format", "json", "--cache-dir", cache, check=0).json()
        sources.append([(x["declared"], x["sharding_source"]) for x in out["functions"][0]["inputs"]])
    assert sources == [[("P(None, None)", "unknown")], [("P(None, None)", "object")]]


def test_a_spec_ref_stages_and_unresolvable_annotations_exit_2(tmp_path, run_cli):
    pytest.importorskip("flax")
    write(tmp_path, "m.py", """
        import jax
        import jax.numpy as jnp
        import flax.linen as nn

        R = jax.new_ref(jnp.zeros((4,)))

        def boxed():
            return {"w": nn.LogicallyPartitioned(jnp.zeros((8, 4)), ("embed", "mlp"))}

        def f(r):
            return r[...] * 2

        def g(p):
            return p["w"].value * 2
    """)
    write(tmp_path, "m.stagetool.yaml", """
        version: 1
        mesh: {axes: {x: 8}}
        functions:
          f: {target: m.py:f, args: [{ref: m.py:R}]}
          g: {target: m.py:g, args: [{init: m.py:boxed}]}
    """)
    # a jax.Ref written in the spec is staged as the abstract ref raw JAX lowers it as (issue 21)
    ref = run_cli("shardings", "--spec", tmp_path / "m.stagetool.yaml", "--function", "f", "--format", "json",
                  check=0).json()
    assert [x["path"] for x in ref["functions"][0]["inputs"]] == ["r"]
    boxed = run_cli("shardings", "--spec", tmp_path / "m.stagetool.yaml", "--function", "g", check=2)
    assert "'p/w/value'" in boxed.stderr and "no logical axis rules" in boxed.stderr
    assert "logical_axis_rules: model.py:RULES" in boxed.stderr


def test_out_shardings_like_must_fit_the_output(tmp_path, run_cli):
    write(tmp_path, "m.py", """
        def f(p, x):
            return {"w": p["w"] * 2}, x.sum()
    """)
    write(tmp_path, "m.stagetool.yaml", """
        version: 1
        mesh: {axes: {x: 8}}
        functions:
          ok:
            target: m.py:f
            args: [{w: 'f32[8,4] @ [x]'}, 'f32[8]']
            out_shardings: [{like: 0}, replicated]
          bad:
            target: m.py:f
            args: [{w: 'f32[8,4] @ [x]'}, 'f32[8]']
            out_shardings: [{like: 1}, replicated]
    """)
    out = run_cli("shardings", "--spec", tmp_path / "m.stagetool.yaml", "--function", "ok", "--format", "json",
                  check=0).json()
    w = leaves_by_path(out, "outputs")["out/0/w"]
    assert (w["declared"], w["compiled"], w["sharding_source"]) == ("P('x', None)", "P('x', None)", "spec")
    bad = run_cli("shardings", "--spec", tmp_path / "m.stagetool.yaml", "--function", "bad", check=2)
    assert "like: 1" in bad.stderr and "out_shardings" in bad.stderr


def test_nnx_updated_state_pinned_like_the_inputs(tmp_path, run_cli):
    """out_shardings may name the updated arguments beside ``out``: the new state then comes out as the
    inputs are laid out (``like``), and every donated leaf is aliased."""
    pytest.importorskip("flax")
    write(tmp_path, "m.py", NNX_STEP.replace("nnx.Linear(512, 256, rngs=nnx.Rngs(0))", "nnx.Linear(512, 256, rngs=nnx.Rngs(0), "
                                             "kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, 'x')))"))
    write(tmp_path, "m.stagetool.yaml", """
        version: 1
        mesh: {axes: {x: 8}}
        functions:
          step:
            target: m.py:step
            args: [{init: m.py:make_model}, {init: m.py:make_optimizer}, 'f32[16,512]']
            donate: [0, 1]
            out_shardings: {out: replicated, model: {like: 0}}
    """)
    out = run_cli("report", tmp_path / "m.py:step", "--format", "json", check=0).json()
    outputs = leaves_by_path(out, "outputs")
    kernel = outputs["model/kernel/value"]
    assert (kernel["declared"], kernel["compiled"], kernel["sharding_source"]) == ("P(None, 'x')", "P(None, 'x')", "spec")
    assert outputs["optimizer/step/value"]["sharding_source"] == "compiler"
    assert leaves_by_path(out)["model/kernel/value"]["sharding_source"] == "model"
    donation = out["functions"][0]["memory"]["donation"]
    assert donation and all(d["status"] == "aliased" for d in donation if d["requested"])
