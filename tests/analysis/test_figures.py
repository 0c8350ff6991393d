"""Issue #10's inputs, end to end through the CLI: every figure true, or labelled as what it is."""

from __future__ import annotations

import json
import re

from helpers import REPO, leaves_by_path, write

SGD = """
import jax, jax.numpy as jnp

def step(params, grads):
    new = jax.tree.map(lambda p, g: p - 0.1 * jnp.tanh(g) @ jnp.tanh(g).T @ p, params, grads)
    return new, jnp.sum(new["w"])
"""
SGD_SPEC = """
version: 1
functions:
  step:
    target: sgd.py:step
    args:
      - {w: 'f32[1024,1024]'}
      - {w: 'f32[1024,1024]'}
"""


def test_donation_is_no_peak_regression(run_cli, tmp_path, monkeypatch):
    """Snapshot the SGD step without donation, then check it with ``donate: [0]``: the gated peak is
    arguments + outputs - aliased + temporaries, 20.0 MiB (+20 B) both ways; XLA's
    peak_memory_in_bytes (12.0 MiB -> 8.0 MiB on CPU) is shown but not gated."""
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "sgd.py", SGD)
    write(tmp_path, "sgd.stagetool.yaml", SGD_SPEC)
    run_cli("snapshot", "--spec", "sgd.stagetool.yaml", "-o", "lock.json", check=0)
    before = json.loads((tmp_path / "lock.json").read_text())["functions"]["step"]["memory"]
    assert before["peak_bytes"] == 20 * 2**20 + 20
    write(tmp_path, "sgd.stagetool.yaml", SGD_SPEC + "    donate: [0]\n")
    r = run_cli("check", "--spec", "sgd.stagetool.yaml", "--baseline", "lock.json", "--format", "json", check=0)
    changes = {c["what"]: c for f in json.loads(r.stdout)["functions"] for c in f["changes"]}
    assert "memory.peak_bytes" not in changes or changes["memory.peak_bytes"]["status"] != "regression"
    r = run_cli("memory", "--spec", "sgd.stagetool.yaml", "--format", "json", check=0)
    rec = json.loads(r.stdout)["functions"][0]["memory"]["record"]
    assert rec["peak_bytes"] == 20 * 2**20 + 20 and rec["alias_bytes"] == 4 * 2**20
    assert rec["peak_bytes_reported"] != rec["peak_bytes"]
    r = run_cli("memory", "--spec", "sgd.stagetool.yaml", "--peak", check=0)
    assert "XLA peak_memory_in_bytes" in r.stdout and "gated" in r.stdout


EXPLICIT = """
def square(a):
    return a @ a

def gram(a):
    return a.T @ a
"""
EXPLICIT_SPEC = """
version: 1
mesh:
  axes: {S: 2}
  axis_types: explicit
functions:
  square:
    target: m.py:square
    args: ['f32[8,8] @ [S]']
  gram:
    target: m.py:gram
    args: ['f32[8,8] @ [S]']
"""


def test_one_failing_function_never_blanks_the_others(run_cli, tmp_path, monkeypatch):
    """Explicit axes: ``gram`` contracts two S-sharded dimensions, which JAX's sharding types reject;
    ``square`` is reported in full, ``gram`` is listed with JAX's error, and the exit code is 3."""
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "m.py", EXPLICIT)
    write(tmp_path, "m.stagetool.yaml", EXPLICIT_SPEC)
    for command in ("shardings", "report", "collectives"):
        r = run_cli(command, "--spec", "m.stagetool.yaml", "--format", "json", check=3)
        fs = {f["name"]: f for f in r.json()["functions"]}
        assert fs["square"]["error"] is None
        assert "ShardingTypeError" in fs["gram"]["error"] and "m.py:5 in gram" in fs["gram"]["error"]
        assert fs["gram"]["inputs"] is None and fs["gram"]["collectives"] is None
        assert "error: gram: trace failed: ShardingTypeError" in r.stderr
        if command == "shardings":
            assert leaves_by_path(r.json(), function=0)["a"]["compiled"] == "P('S', None)"
    r = run_cli("shardings", "--spec", "m.stagetool.yaml", check=3)
    assert "square" in r.stdout and "P('S', None)" in r.stdout and "failed: gram: trace failed" in r.stdout
    r = run_cli("report", "--spec", "m.stagetool.yaml", "--format", "markdown", check=3)
    assert "**Failed:** gram: trace failed: ShardingTypeError" in r.stdout
    r = run_cli("lower", "--spec", "m.stagetool.yaml", "-f", "square", "-f", "gram", check=3)
    assert "func.func" in r.stdout or "module" in r.stdout
    # the snapshot holds what staged; the failed function is named on stderr, exit 3
    run_cli("snapshot", "--spec", "m.stagetool.yaml", "-o", "lock.json", check=3)


def test_spec_errors_of_all_functions_before_anything_is_lowered(run_cli, tmp_path, monkeypatch):
    """An out_shardings that does not divide an output is a spec error with the output's path, found
    with the other functions' errors before anything is lowered (exit 2, nothing on stdout)."""
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "b.py", """
        def f(a):
            return {"x": a[:3], "y": a}

        def g(a):
            return a
        """)
    write(tmp_path, "b.stagetool.yaml", """
        version: 1
        mesh:
          axes: {S: 2}
        functions:
          f:
            target: b.py:f
            args: ['f32[8,8]']
            out_shardings: [S]
          g:
            target: b.py:g
            args: ['f32[8,8]']
            out_shardings: [null, null, S]
        """)
    for command in ("shardings", "snapshot"):
        r = run_cli(command, "--spec", "b.stagetool.yaml", check=2)
        assert r.stdout == ""
        assert ("functions.f.out_shardings: at ['x'] (f32[3,8]): dimension 0 of size 3 is not divisible by 2"
                in r.stderr)
        assert "functions.g.out_shardings: at the output (f32[8,8]): sharding P(None, None, 'S') has 3 entries" in r.stderr


# ---- out of memory is an answer (item 7)

import shutil  # noqa: E402

import pytest  # noqa: E402

from stagetool.devices import tpu_topology as topology  # noqa: E402
from stagetool.staging.stages import parse_out_of_memory  # noqa: E402

needs_libtpu = pytest.mark.skipif(not topology.libtpu_available(), reason="libtpu not installed: pip install -e '.[tpu]'")
DATA = REPO / "tests" / "data"


def test_xla_out_of_memory_messages_are_read():
    libtpu = ("JaxRuntimeError: RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
              "temporaries (129.73G) exceeds available HBM (15.75G).")
    got = parse_out_of_memory(libtpu)
    assert got["needed_bytes"] == round(129.73 * 2**30) and got["available_bytes"] == round(15.75 * 2**30)
    assert (got["memory_space"], got["what"]) == ("HBM", "HLO temporaries")
    assert got["xla_message"].startswith("RESOURCE_EXHAUSTED: Ran out of memory on HBM")
    older = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. "
             "Used 20.26G of 15.48G hbm. Exceeded hbm capacity by 4.78G.")
    got = parse_out_of_memory(older)
    assert (got["needed_bytes"], got["available_bytes"]) == (round(20.26 * 2**30), round(15.48 * 2**30))
    assert parse_out_of_memory("RESOURCE_EXHAUSTED: too many handles") is None
    assert parse_out_of_memory("INVALID_ARGUMENT: Ran out of memory") is None
    assert parse_out_of_memory("RESOURCE_EXHAUSTED: ran out of memory")["needed_bytes"] is None


LLAMA_SPEC = """
version: 1
mesh:
  axes: {data: 8}
functions:
  train_step:
    target: llama3_8b.py:train_step
    args:
      - init: llama3_8b.py:init_state
        init_args: [key(0)]
      - 'i32[8,2048] @ [data]'
    donate: [0]
"""


@needs_libtpu
@pytest.mark.slow
def test_llama3_8b_does_not_fit_a_v5e_2x4(run_cli, tmp_path, monkeypatch):
    """Llama 3 8B's decoder (32 scanned layers, bf16 parameters, f32 Adam moments), data-parallel on a
    v5e 2x4: exit 1 with "does not fit" and XLA's figures, not exit 3. The arguments are derived:
    8,030,261,248 parameters × (2 + 4 + 4) bytes + the tokens' shard (2 × 2048 × 4 B)."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(DATA / "llama3_8b.py", tmp_path / "llama3_8b.py")
    write(tmp_path, "llama3_8b.stagetool.yaml", LLAMA_SPEC)
    r = run_cli("memory", "--spec", "llama3_8b.stagetool.yaml", "--topology", "v5e:2x4", "--fail-if-over",
                "--no-peak", check=1)
    assert "DOES NOT FIT: the compile ran out of memory" in r.stdout and "available (XLA: HBM)" in r.stdout
    assert "does not fit: train_step" in r.stderr
    r = run_cli("report", "--spec", "llama3_8b.stagetool.yaml", "--topology", "v5e:2x4", "--format", "json",
                "--fail-if-over", check=1)
    f = r.json()["functions"][0]
    assert f["error"] is None and f["memory"]["verdict"]["fits"] is False
    oom = f["memory"]["out_of_memory"]
    assert oom["available_bytes"] == round(15.75 * 2**30)
    assert oom["needed_bytes"] > 100 * 2**30
    params = 2 * 128256 * 4096 + 4096 + 32 * (4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096)
    assert params == 8_030_261_248
    assert oom["argument_bytes"] == params * 10 + 1 * 2048 * 4  # one row of tokens per device


@needs_libtpu
def test_one_huge_weight_does_not_fit(run_cli, tmp_path, monkeypatch):
    """Another shape of the kind: one replicated 20 GiB bf16 weight; exits 1 under --fail-if-over,
    and a command without the memory section still says exit 3 with XLA's message."""
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "big.py", """
        def f(w, x):
            return x @ w
        """)
    write(tmp_path, "big.stagetool.yaml", """
        version: 1
        mesh:
          axes: {data: 8}
        functions:
          f:
            target: big.py:f
            args: ['bf16[131072,81920]', 'bf16[64,131072] @ [data]']
        """)
    r = run_cli("memory", "--spec", "big.stagetool.yaml", "--topology", "v5e:2x4", "--fail-if-over", "--format",
                "json", check=1)
    oom = r.json()["functions"][0]["memory"]["out_of_memory"]
    assert oom["argument_bytes"] == 131072 * 81920 * 2 + 8 * 131072 * 2
    assert oom["needed_bytes"] >= 131072 * 81920 * 2 - 2**30 // 100  # XLA rounds to 0.01 GiB
    r = run_cli("shardings", "--spec", "big.stagetool.yaml", "--topology", "v5e:2x4", check=3)
    assert "RESOURCE_EXHAUSTED" in r.stderr


# ---- sub-byte and exotic dtypes (item 2)

QUANT = """
import jax, jax.numpy as jnp

def init(key):
    return {"w_q": jax.random.randint(key, (1024, 1024), -8, 8).astype(jnp.int4),
            "scale": jnp.ones((1024,), jnp.bfloat16)}

def f(params, x):
    return x @ (params["w_q"].astype(jnp.bfloat16) * params["scale"])

def total(*xs):
    return sum(x.astype(jnp.float32).sum() for x in xs)
"""
#: ``f`` on the int4 weights ``init`` makes and a bf16[16,1024] batch: a spec's function entry.
QUANT_FROM_INIT = """\
  f:
    target: q.py:f
    args:
      - init: q.py:init
        init_args: [key(0)]
      - 'bf16[16,1024]'
"""


def quant_spec(*entries: str, mesh: str | None = None) -> str:
    """A spec of ``q.py`` (:data:`QUANT`) functions: ``entries`` are :data:`QUANT_FROM_INIT` or
    :func:`quant_entry`'s, on ``mesh`` (a YAML flow mapping of axes) or none."""
    return "version: 1\n" + (f"mesh:\n  axes: {mesh}\n" if mesh else "") + "functions:\n" + "".join(entries)


def quant_entry(name: str, w_q: str, scale: str, x: str) -> str:
    """A spec's entry for ``q.py:f`` named ``name``, its params and batch given as shapes."""
    return f"  {name}:\n    target: q.py:f\n    args:\n      - {{w_q: '{w_q}', scale: '{scale}'}}\n      - '{x}'\n"


QUANT_SPEC = quant_spec(QUANT_FROM_INIT, quant_entry("g", "s4[1024,1024]", "bf16[1024]", "bf16[16,1024]"))


def test_int4_weights_count_two_per_byte(run_cli, tmp_path, monkeypatch):
    """``w_q`` int4[1024,1024] from an init and as ``s4`` in the spec: 524,288 B, 93.8% of the
    559,104 B of arguments (XLA's argument size: 524,288 + 2,048 + 32,768)."""
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "q.py", QUANT)
    write(tmp_path, "q.stagetool.yaml", QUANT_SPEC)
    r = run_cli("memory", "--spec", "q.stagetool.yaml", "--format", "json", "--no-peak", check=0)
    for f in r.json()["functions"]:
        m = f["memory"]
        assert m["record"]["argument_bytes"] == 559_104 == 524_288 + 2_048 + 32_768
        assert m["largest_inputs"][0] == {"path": "params/w_q", "shape": "s4[1024,1024]", "bytes_per_device": 524_288}
    r = run_cli("memory", "--spec", "q.stagetool.yaml", "-f", "g", "--no-peak", check=0)
    assert "93.8%" in r.stdout and "187.5%" not in r.stdout
    r = run_cli("shardings", "--spec", "q.stagetool.yaml", "-f", "g", "--format", "json", check=0)
    assert leaves_by_path(r.json())["params/w_q"]["bytes_per_device"] == 524_288


def test_every_narrow_dtype_is_accepted_and_counted_as_xla_stores_it(run_cli, tmp_path, monkeypatch):
    """s4/u4/int4/uint4, s2/u2, f4e2m1fn, f8e8m0fnu, f8e4m3fn, f8e5m2: the per-leaf bytes
    (ceil(elements × bits / 8)) add up to XLA's own argument size."""
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "q.py", QUANT)
    leaves = {"s4[1024,1024]": 524_288, "u4[1000,3]": 1_500, "int4[7]": 4, "uint4[5]": 3, "s2[64,64]": 1_024,
              "u2[9]": 3, "f4e2m1fn[33,2]": 33, "f8e8m0fnu[10]": 10, "f8e4m3fn[4]": 4, "f8e5m2[4]": 4}
    args = ", ".join(f"'{x}'" for x in leaves)
    write(tmp_path, "d.stagetool.yaml", f"version: 1\nfunctions:\n  total:\n    target: q.py:total\n    args: [{args}]\n")
    r = run_cli("memory", "--spec", "d.stagetool.yaml", "--format", "json", "--no-peak", check=0)
    m = r.json()["functions"][0]["memory"]
    got = {x["shape"]: x["bytes_per_device"] for x in m["largest_inputs"]}
    assert sorted(got.values()) == sorted(leaves.values())
    assert m["record"]["argument_bytes"] == sum(leaves.values())


@needs_libtpu
def test_sub_byte_padded_bytes_on_a_tpu_topology(run_cli, tmp_path, monkeypatch):
    """On v5e tiles, per leaf: padded ≥ logical, and the padded bytes add up to XLA's argument size."""
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "q.py", QUANT)
    write(tmp_path, "t.stagetool.yaml", quant_spec(
        QUANT_FROM_INIT, quant_entry("h", "s4[1024,24]", "bf16[24]", "bf16[3,1024]"),
        quant_entry("u", "u4[1000,24] @ [null, data]", "f32[24]", "f32[3,1000]"), mesh="{data: 8}"))
    r = run_cli("report", "--spec", "t.stagetool.yaml", "--topology", "v5e:2x4", "--format", "json", check=0)
    padded_seen = False
    for f in r.json()["functions"]:
        xs = f["inputs"]
        for x in xs:
            assert x["padded_bytes_per_device"] >= x["bytes_per_device"], x
            padded_seen |= x["padded_bytes_per_device"] > x["bytes_per_device"]
        assert sum(x["padded_bytes_per_device"] for x in xs) == f["memory"]["record"]["argument_bytes"], f["name"]
        if f["name"] == "f":
            assert leaves_by_path({"functions": [f]})["params/w_q"]["bytes_per_device"] == 524_288
    assert padded_seen


# ---- loop-aware cost through the CLI (item 3)

SCAN = """
import jax, jax.numpy as jnp

def forward(ws, x):
    def layer(x, w):
        return jnp.tanh(x @ w), None
    y, _ = jax.lax.scan(layer, x, ws)
    return y
"""


def test_cost_shows_the_loop_aware_estimate_and_the_roofline_uses_it(run_cli, tmp_path, monkeypatch):
    """12 layers of tanh(x @ w), x f32[64,256], w f32[256,256]: 12 × 2·64·256·256 FLOPs of dots;
    XLA counts one layer, the loop-aware estimate all twelve, and the roofline is fed from it."""
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "s.py", SCAN)
    write(tmp_path, "s.stagetool.yaml", """
        version: 1
        functions:
          forward:
            target: s.py:forward
            args: ['f32[12,256,256]', 'f32[64,256]']
        """)
    r = run_cli("cost", "--spec", "s.stagetool.yaml", "--chip", "tpu-v5e", "--format", "json", check=0)
    c = r.json()["functions"][0]["cost"]
    dots = 12 * 2 * 64 * 256 * 256
    assert c["per_device"]["flops"] < dots / 6
    la = c["loop_aware"]
    assert la["source"] == "derived estimate" and la["loops"][0][1] == 12
    assert dots <= la["flops"] <= dots * 1.02  # plus 12 × the tanh's element-wise work, if any
    assert la["transcendentals"] == 12 * 64 * 256
    assert c["roofline"]["flops_per_device"] == la["flops"]
    assert c["roofline"]["bytes_accessed_per_device"] == la["bytes_accessed"]
    r = run_cli("cost", "--spec", "s.stagetool.yaml", check=0)
    assert "FLOPs, loop-aware (estimate)" in r.stdout and "derived estimate" in r.stdout
    run_cli("snapshot", "--spec", "s.stagetool.yaml", "-o", "lock.json", check=0)
    snap = json.loads((tmp_path / "lock.json").read_text())["functions"]["forward"]["cost"]
    assert snap["loop_aware_flops"] == la["flops"]


# ---- say what changed the program (item 9)


def test_donated_but_not_usable_says_why(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "m.py", """
        def f(a, b):
            return (a @ b).sum(axis=0)

        def g(a):
            return a * 2
        """)
    write(tmp_path, "m.stagetool.yaml", """
        version: 1
        mesh: {axes: {data: 2}}
        functions:
          f:
            target: m.py:f
            args: ['f32[8,3] @ [data, null]', 'f32[3,16]']
            donate: [0, 1]
          g:
            target: m.py:g
            args: ['f32[8,8] @ [data]']
            donate: [0]
            out_shardings: replicated
        """)
    r = run_cli("memory", "--spec", "m.stagetool.yaml", "--no-peak", "--format", "json", check=0)
    f, g = r.json()["functions"]
    why = {d["path"]: d["reason"] for d in f["memory"]["donation"]}
    assert why == {"a": "no output has shape and dtype f32[8,3]", "b": "no output has shape and dtype f32[3,16]"}
    (d,) = g["memory"]["donation"]
    assert d["status"] == "not usable"
    assert d["reason"] == "the outputs of that shape and dtype (out) have another sharding: 256 B per device, not 128 B"
    r = run_cli("memory", "--spec", "m.stagetool.yaml", "--no-peak", check=0)
    assert "no output has shape and dtype f32[8,3]" in r.stdout


def test_the_cpu_bf16_note_only_with_dot_products(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "m.py", """
        def mm(a):
            return a @ a

        def add(a):
            return a + 1
        """)
    write(tmp_path, "m.stagetool.yaml", """
        version: 1
        functions:
          mm: {target: m.py:mm, args: ['bf16[8,8]']}
          add: {target: m.py:add, args: ['bf16[8,8]']}
        """)
    r = run_cli("shardings", "--spec", "m.stagetool.yaml", "--format", "json", check=0)
    notes = {f["name"]: " ".join(f["notes"]) for f in r.json()["functions"]}
    assert "XLA:CPU computes bf16 dot products in f32" in notes["mm"]
    assert "dot products" not in notes["add"]


def test_configuration_that_changes_the_program_is_in_the_header_and_the_snapshot(run_cli, tmp_path, monkeypatch):
    import jax

    monkeypatch.chdir(tmp_path)
    write(tmp_path, "sgd.py", SGD)
    write(tmp_path, "sgd.stagetool.yaml", SGD_SPEC)
    r = run_cli("shardings", "--spec", "sgd.stagetool.yaml", "--format", "json", check=0)
    config = dict(r.json()["config"])
    assert config["jax_threefry_partitionable"] == str(jax.config.jax_threefry_partitionable)
    assert config["jax_default_matmul_precision"] == "None"
    assert "config: jax_threefry_partitionable=" in run_cli("shardings", "--spec", "sgd.stagetool.yaml", check=0).stdout
    run_cli("snapshot", "--spec", "sgd.stagetool.yaml", "-o", "lock.json", check=0)
    assert json.loads((tmp_path / "lock.json").read_text())["config"]["jax_enable_x64"] == "False"
    before = jax.config.jax_default_matmul_precision
    try:
        jax.config.update("jax_default_matmul_precision", "highest")
        r = run_cli("check", "--spec", "sgd.stagetool.yaml", "--baseline", "lock.json", check=None)
    finally:
        jax.config.update("jax_default_matmul_precision", before)
    assert "config jax_default_matmul_precision None in the baseline, highest now" in r.stdout + r.stderr


# ---- whole program means whole program (item 4)

SHARD_MAP = """
import jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P

def f(x, w):
    def local(x, w):
        return jax.lax.psum(x @ w, "model")
    return jax.shard_map(local, in_specs=(P("data", "model"), P("model", None)), out_specs=P("data", None))(x, w)

def g(x, w):
    return f(x, w) + jnp.tanh(x @ w)
"""


def test_an_entirely_manual_program_is_scaled_to_the_whole(run_cli, tmp_path, monkeypatch):
    """shard_map over data=2 × model=4: Lowered.cost_analysis() costs one shard's f32[128,128] @
    f32[128,128]; the whole program is 8 shards: at least the unsharded 2·256·512·128 FLOPs."""
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "sm.py", SHARD_MAP)
    write(tmp_path, "sm.stagetool.yaml", """
        version: 1
        mesh:
          axes: {data: 2, model: 4}
        functions:
          f:
            target: sm.py:f
            args: ['f32[256,512] @ [data, model]', 'f32[512,128] @ [model, null]']
          g:
            target: sm.py:g
            args: ['f32[256,512] @ [data, model]', 'f32[512,128] @ [model, null]']
        """)
    r = run_cli("cost", "--spec", "sm.stagetool.yaml", "--format", "json", check=0)
    f, g = (x["cost"] for x in r.json()["functions"])
    shard = 2 * 128 * 128 * 128
    assert shard <= f["per_device"]["flops"] < 1.05 * shard
    assert f["whole_program"]["flops"] == pytest.approx(8 * f["per_device"]["flops"], rel=0.01)
    assert f["whole_program"]["flops"] >= 2 * 256 * 512 * 128
    assert "× 8 shards" in f["whole_program"]["source"] and "one shard_map over all devices" in f["scope_notes"][0]
    assert "mixes the two scopes" in g["scope_notes"][0] and "×" not in g["whole_program"]["source"]


def test_on_explicit_axes_auto_is_decided_by_sharding_types_not_the_partitioner(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "e.py", "def f(a, b):\n    return a * 2 + b\n")
    spec = """
        version: 1
        mesh:
          axes: {S: 2}
          axis_types: AXES
        functions:
          f:
            target: e.py:f
            args: ['f32[8,8] @ auto', 'f32[8,8] @ [S]']
        """
    write(tmp_path, "e.stagetool.yaml", spec.replace("AXES", "explicit"))
    r = run_cli("shardings", "--spec", "e.stagetool.yaml", "--format", "json", check=0)
    a = leaves_by_path(r.json())["a"]
    assert a["chosen_by_partitioner"] is False and a["chosen_by"] == "JAX's sharding types"
    out = run_cli("shardings", "--spec", "e.stagetool.yaml", check=0).stdout
    assert "typed" in out and "partitioner picked" not in out
    write(tmp_path, "e.stagetool.yaml", spec.replace("AXES", "auto"))
    a = leaves_by_path(run_cli("shardings", "--spec", "e.stagetool.yaml", "--format", "json", check=0).json())["a"]
    assert a["chosen_by_partitioner"] is True and a["chosen_by"] == "the SPMD partitioner"


_UNEVEN_MODEL = """
        import jax
        from jax.sharding import PartitionSpec as P

        def scale(x):
            return jax.lax.with_sharding_constraint(x * 2, P("data", "model"))
        """
#: ``scale`` of :data:`_UNEVEN_MODEL` on a data=2 × model=4 mesh, its f32[64,30] chosen by the compiler.
_UNEVEN_SPEC = """\
version: 1
mesh:
  axes: {data: 2, model: 4}
functions:
  scale:
    target: c.py:scale
    args: ['f32[64,30] @ auto']
"""


@pytest.mark.jax_version("<0.10|>=0.12", reason="JAX 0.10 (0.11 not checked) pads an uneven sharding constraint "
                                                "(the test below)")
def test_a_constraint_the_mesh_does_not_divide_fails_to_stage_outside_jax_0_10(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "c.py", _UNEVEN_MODEL)
    write(tmp_path, "c.stagetool.yaml", _UNEVEN_SPEC)
    r = run_cli("shardings", "--spec", "c.stagetool.yaml", check=3)
    assert "scale: " in r.stderr and "is not divisible by axis_size=4" in r.stderr
    # the user's frame, relative to the spec's folder
    assert re.search(r"(?<![/\w])c\.py:\d+", r.stderr) and str(tmp_path) not in r.stderr and "Traceback" not in r.stderr


@pytest.mark.jax_version(">=0.10,<0.12", reason="JAX 0.9 and older, and 0.12, refuse the uneven constraint "
                                               "(the test above)")
def test_a_constraint_the_mesh_does_not_divide_is_a_note_with_the_users_line(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "c.py", _UNEVEN_MODEL + """
        def looped(x):
            step = lambda c, _: (jax.lax.with_sharding_constraint(c + 1, P(None, "data")), None)
            return jax.lax.scan(step, x, None, length=3)[0]
        """)
    assert (tmp_path / "c.py").read_text().splitlines()[7].lstrip().startswith("step = ")  # line 8, as asserted
    write(tmp_path, "c.stagetool.yaml", _UNEVEN_SPEC + """\
  even:
    target: c.py:scale
    args: ['f32[64,32] @ auto']
  looped:
    target: c.py:looped
    args: ['f32[8,5]']
""")
    r = run_cli("shardings", "--spec", "c.stagetool.yaml", "--format", "json", check=0)
    notes = {f["name"]: f["notes"] for f in r.json()["functions"]}
    assert [n for n in notes["scale"] if "sharding constraint" in n] == [
        "sharding constraint at c.py:5: dimension 1 of size 30 is not divisible by 4 (model): "
        "XLA pads it to 32 and may gather it"]
    assert not any("sharding constraint" in n for n in notes["even"])
    assert any(f"c.py:8: dimension 1 of size 5 is not divisible by 2 (data)" in n for n in notes["looped"])


def test_the_topology_host_count_override_is_shown(run_cli, tmp_path, monkeypatch):
    from stagetool.devices.tpu_topology import host_override_note
    from stagetool.plan.target import parse_target

    assert "stagetool's override" in host_override_note(parse_target("v5e:2x4"), 1)
    assert host_override_note(parse_target("v5e:4x4"), 4) is None
    assert host_override_note(parse_target("v5p:2x2x2"), 2) is None
    if not topology.libtpu_available():
        return
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "q.py", QUANT)
    write(tmp_path, "t.stagetool.yaml", quant_spec(quant_entry("h", "s4[1024,24]", "bf16[24]", "bf16[8,1024] @ [data]"),
                                                   mesh="{data: 8}"))
    r = run_cli("shardings", "--spec", "t.stagetool.yaml", "--topology", "v5e:2x4", "--format", "json", check=0)
    (f,) = r.json()["functions"]
    assert f["mesh"]["process_count"] == 1
    assert any("topology v5e:2x4: 1 host(s) of 8 chips: stagetool's override" in n for n in f["notes"])
