"""Spec forms people reach for (issue 21, item 5): ``logical_axis_rules`` as a module attribute, a
function returning the rules, an object with a ``logical_axis_rules`` attribute (``get_config()``),
``{call: ...}`` or an inline list; ``rules: {call: model.py:fsdp_spec}``; YAML merge keys. Each gives
the same shardings as the plain form; bad forms exit 2 at file:line:col.
"""

from __future__ import annotations

import shutil

import pytest

from helpers import EXAMPLES, leaves_by_path, write

pytest.importorskip("flax")

SPEC = '''
version: 1
mesh:
  axes: {{data: 2, model: 4}}
logical_axis_rules: {rules}
functions:
  train_step:
    target: linen_lm.py:train_step
    args:
      - init: linen_lm.py:create_state
        init_args: [key(0)]
      - tokens: 'i32[16,32] @ [data, null]'
        targets: 'i32[16,32] @ [data, null]'
'''

EXTRA = '''

def get_config():
    class Config:
        logical_axis_rules = LOGICAL_AXIS_RULES
    return Config()


def rules_fn():
    return list(LOGICAL_AXIS_RULES)


def rules_with(extra):
    return list(LOGICAL_AXIS_RULES) + list(extra)
'''


@pytest.fixture
def linen(tmp_path, isolated_imports):
    shutil.copy(EXAMPLES / "linen_lm.py", tmp_path / "linen_lm.py")
    with open(tmp_path / "linen_lm.py", "a") as fh:
        fh.write(EXTRA)
    return tmp_path


def declared(run_cli, folder, rules: str) -> dict:
    spec = folder / "s.yaml"
    spec.write_text(SPEC.format(rules=rules))
    doc = run_cli("shardings", "--spec", spec, "--format", "json", check=0).json()
    return {p: (x["declared"], x["sharding_source"]) for p, x in leaves_by_path(doc).items()}


def test_every_logical_axis_rules_form_gives_the_same_shardings(run_cli, linen):
    reference = declared(run_cli, linen, "linen_lm.py:LOGICAL_AXIS_RULES")
    assert any(d != "P(None)" and "model" in d for d, _ in reference.values())
    for form in ("linen_lm.py:get_config", "linen_lm.py:rules_fn", "{call: linen_lm.py:rules_with, args: [[]]}",
                 "[[batch, data], [vocab, model], [embed, null], [mlp, model]]"):
        assert declared(run_cli, linen, form) == reference, form


@pytest.mark.parametrize("rules,where,words", [
    ("linen_lm.py:jnp", "s.yaml:5:21", "not a list of (logical name, mesh axis) pairs"),
    ("[[batch, data], [vocab]]", "s.yaml:5:37", "a logical axis rule is [logical name, mesh axis]"),
    ("42", "s.yaml:5:21", "logical_axis_rules is 'model.py:NAME'"),
])
def test_bad_logical_axis_rules_exit_2_at_file_line_col(run_cli, linen, rules, where, words):
    spec = linen / "s.yaml"
    spec.write_text(SPEC.format(rules=rules))
    r = run_cli("shardings", "--spec", spec)
    assert r.code == 2 and where in r.stderr and words in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


STEP = '''
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

def init(n):
    return {"w": jnp.zeros((n, 64)), "b": jnp.zeros((64,))}

def fsdp_spec(path, value):
    return P("data", None) if value.ndim == 2 else P()

def step(p, x):
    return jnp.sum(x @ p["w"].T + p["b"].sum())
'''


def test_rules_call_mapping_and_yaml_merge_keys(run_cli, tmp_path, isolated_imports):
    """``rules: {call: ...}`` as issue 10 wrote it, and ``<<: *base`` merging one function's entry into another."""
    write(tmp_path, "m.py", STEP)
    spec = write(tmp_path, "s.yaml", '''
        version: 1
        mesh:
          axes: {data: 2, model: 4}
        x-base: &base
          target: m.py:step
          args:
            - init: m.py:init
              init_args: [128]
              rules: {call: m.py:fsdp_spec}
            - 'f32[16,64] @ [data, null]'
        functions:
          one:
            <<: *base
          two:
            <<: *base
            args:
              - init: m.py:init
                init_args: [256]
                rules: {call: m.py:fsdp_spec}
              - 'f32[16,64] @ [data, null]'
    ''')
    doc = run_cli("shardings", "--spec", spec, "--format", "json", check=0).json()
    one, two = (leaves_by_path(doc, function=i) for i in (0, 1))
    assert [f["name"] for f in doc["functions"]] == ["one", "two"]
    assert one["p/w"]["declared"] == "P('data', None)" and one["p/w"]["shape"] == [128, 64]
    assert one["p/w"]["sharding_source"] == "rule" and one["p/b"]["declared"] == "P(None)"
    assert two["p/w"]["shape"] == [256, 64]  # the entry's own args override the merged ones
    # a merged entry's problem is reported where it is written (the anchor's lines)
    spec.write_text(spec.read_text().replace("target: m.py:step", "target: m.py:stepp"))
    r = run_cli("shardings", "--spec", spec)
    assert r.code == 2 and "s.yaml:5:3" in r.stderr, r.stderr


def test_explain_takes_a_path_suffix_with_or_without_value():
    """``--explain up/kernel`` names a Flax leaf (``.../up/kernel/value``) as ``up/kernel/value`` does."""
    from stagetool.plan.selectors import leaf_patterns, unmatched_leaf_patterns

    paths = ["model/mlp/up/kernel/value", "model/mlp/down/kernel/value", "params/w1", "opt/up/kernel/value"]
    for text, named in (("kernel", {"model/mlp/up/kernel/value", "model/mlp/down/kernel/value", "opt/up/kernel/value"}),
                        ("mlp/up/kernel", {"model/mlp/up/kernel/value"}),
                        ("mlp/up/kernel/value", {"model/mlp/up/kernel/value"}),
                        ("w1", {"params/w1"})):
        (p,) = leaf_patterns((text,))
        assert {x for x in paths if p.names(x)} == named, text
    assert unmatched_leaf_patterns(leaf_patterns(("p/kernel",)), paths)  # not a whole '/'-part: no match
