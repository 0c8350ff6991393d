"""The command line, in-process through ``stagetool.cli.main``: commands, formats, output, exit codes."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import pytest
from helpers import REPO, leaves_by_path, run_subprocess, write
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from stagetool.report import Format
from stagetool.report.model import SCHEMA_VERSION

MODEL = """
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def init(key, d):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (d, 2 * d)), "w2": jax.random.normal(k2, (2 * d, d)),
            "b": jnp.zeros((2 * d,))}


def step(params, x, unused):
    h = jax.lax.with_sharding_constraint(x @ params["w1"] + params["b"], P("data", "model"))
    return jnp.sum(h @ params["w2"])


def other(x):
    return x * 2


def bad_trace(x, w):
    y = x @ w
    return y


def bad_compile(x):
    return jax.ffi.ffi_call("stagetool_cli_no_such_handler", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
"""

SPEC = """
version: 1
mesh: {axes: {data: 2, model: 4}}
functions:
  step:
    target: model.py:step
    args:
      - init: model.py:init
        init_args: [key(0), 16]
        rules:
          - ['/w1$', [null, model]]
          - ['/w2$', [model, null]]
          - ['/b$', auto]
      - 'f32[8,16] @ [data, null]'
      - 'f32[4]'
    donate: [0]
  other:
    target: model.py:other
    args: ['f32[8,4] @ [data, model]']
"""


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A folder with model.py and model.stagetool.yaml; the working directory is elsewhere."""
    write(tmp_path, "proj/model.py", MODEL)
    write(tmp_path, "proj/model.stagetool.yaml", SPEC)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return tmp_path / "proj"


def target(project, name="step"):
    return f"{project}/model.py:{name}"


# ---- shardings and the JSON document ----------------------------------------------------------


def test_shardings_json_document(run_cli, project):
    r = run_cli("shardings", target(project), "--format", "json", check=0)
    doc = r.json()
    assert doc["schema_version"] == SCHEMA_VERSION and doc["kind"] == "report"
    assert doc["command"] == "shardings" and doc["jax_version"] == jax.__version__
    assert {"stagetool_version", "jaxlib_version", "functions"} <= set(doc)
    (f,) = doc["functions"]                   # the TARGET picks one function of the spec
    assert f["name"] == "step" and f["target"] == "model.py:step"
    assert f["mesh"] == {"axes": [["data", 2], ["model", 4]], "axis_types": "auto", "platform": "cpu",
                         "device_kind": "cpu", "device_count": 8, "process_count": 1, "topology": None,
                         "slices": 1, "target_from": None, "named_as": None}
    assert all(f["timings"][k] > 0 for k in ("trace_s", "lower_s", "compile_s"))
    leaf_fields = {"path", "shape", "dtype", "declared", "compiled", "chosen_by_partitioner", "shard_shape",
                   "bytes_global", "bytes_per_device", "unused", "donated", "local_shape", "source", "parameter",
                   "padded_bytes_per_device", "chosen_by",
                   "sharding_source", "ref_write_back"}
    assert all(set(leaf) == leaf_fields for leaf in f["inputs"] + f["outputs"])
    ins = leaves_by_path(doc)
    assert list(ins) == ["params/b", "params/w1", "params/w2", "x", "unused"]   # JAX's flattening order
    w1 = ins["params/w1"]
    assert (w1["shape"], w1["dtype"], w1["declared"], w1["compiled"]) == ([16, 32], "float32",
                                                                          "P(None, 'model')", "P(None, 'model')")
    assert w1["shard_shape"] == [16, 8] and w1["bytes_per_device"] == 16 * 8 * 4
    assert w1["bytes_global"] == 16 * 32 * 4 and w1["donated"] and w1["source"].endswith("model.stagetool.yaml:10:13")
    assert ins["x"]["shard_shape"] == [4, 16] and not ins["x"]["donated"]
    assert ins["unused"]["unused"] and ins["unused"]["compiled"] is None and ins["unused"]["parameter"] is None
    b = ins["params/b"]
    assert b["declared"] == "auto" and b["chosen_by_partitioner"]
    (out,) = f["outputs"]
    assert out["path"] == "out" and out["shape"] == [] and out["compiled"] == "P()"

    # The same function and inputs through JAX directly.
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    import importlib

    model = importlib.import_module("model")
    shapes = jax.eval_shape(lambda key: model.init(key, 16), jax.random.key(0))
    params = {"w1": jax.ShapeDtypeStruct(shapes["w1"].shape, jnp.float32, sharding=NamedSharding(mesh, P(None, "model"))),
              "w2": jax.ShapeDtypeStruct(shapes["w2"].shape, jnp.float32, sharding=NamedSharding(mesh, P("model", None))),
              "b": jax.ShapeDtypeStruct(shapes["b"].shape, jnp.float32)}
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(mesh, P("data", None)))
    u = jax.ShapeDtypeStruct((4,), jnp.float32, sharding=NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):
        compiled = jax.jit(model.step, donate_argnums=0).trace(params, x, u).lower().compile()
    params_s, _, u_s = compiled.input_shardings[0]
    assert b["compiled"] == _p(params_s["b"].spec, 1)
    assert u_s is None


def _p(spec, rank):
    from stagetool.core.sharding import format_dims

    dims = [d if d is None or isinstance(d, str) else tuple(d) for d in spec]
    return format_dims(tuple(dims + [None] * (rank - len(dims))))


def test_text_output_is_plain_when_piped(run_cli, project):
    r = run_cli("shardings", target(project), check=0)
    assert "\x1b[" not in r.stdout
    assert "params/w1" in r.stdout and "P(None, 'model')" in r.stdout and "donated" in r.stdout
    assert "unused (pruned)" in r.stdout
    assert r.stderr == ""


def test_no_target_runs_every_function_and_function_picks_one(run_cli, project):
    doc = run_cli("shardings", "--spec", project / "model.stagetool.yaml", "--format", "json", check=0).json()
    assert [f["name"] for f in doc["functions"]] == ["step", "other"]
    doc = run_cli("shardings", "--spec", project / "model.stagetool.yaml", "-f", "other", "--format", "json",
                  check=0).json()
    (f,) = doc["functions"]
    assert f["inputs"][0]["shard_shape"] == [4, 1] and f["inputs"][0]["bytes_per_device"] == 16


def test_mesh_override(run_cli, project):
    doc = run_cli("shardings", target(project), "--mesh", "model=2,data=4", "--format", "json", check=0).json()
    f = doc["functions"][0]
    assert f["mesh"]["axes"] == [["data", 4], ["model", 2]]
    assert leaves_by_path(doc)["x"]["shard_shape"] == [2, 16]
    assert leaves_by_path(doc)["params/w1"]["shard_shape"] == [16, 16]


def test_local_avals_on_the_command_line(run_cli, project):
    doc = run_cli("shardings", target(project, "other"), "--local-avals", "--processes", "2", "--format", "json",
                  check=0).json()
    f = doc["functions"][0]
    assert f["mesh"]["process_count"] == 2
    (x,) = f["inputs"]
    # [data, model] on 2 processes that each hold one data row and all of model: dim 0 doubles.
    assert x["local_shape"] == [8, 4] and x["shape"] == [16, 4] and x["shard_shape"] == [8, 1]
    assert any("host-local" in n for n in f["notes"])


# ---- lower / compile / devices ----------------------------------------------------------------


def test_lower_does_not_compile(run_cli, project, monkeypatch):
    def no_compile(self, *a, **k):
        raise AssertionError("lower must not compile")

    monkeypatch.setattr(jax.stages.Lowered, "compile", no_compile)
    r = run_cli("lower", target(project), check=0)
    assert r.stdout.startswith("module @") and "func.func public @main" in r.stdout
    assert "sdy.sharding" in r.stdout or "mhlo.sharding" in r.stdout
    doc = run_cli("lower", target(project), "--format", "json", check=0).json()
    f = doc["functions"][0]
    assert f["timings"]["compile_s"] is None and f["module"]["stage"] == "lowered"
    assert f["module"]["dialect"] == "stablehlo"


def test_lower_hlo_dialect(run_cli, project):
    r = run_cli("lower", target(project), "--dialect", "hlo", check=0)
    assert r.stdout.startswith("HloModule ")
    r = run_cli("lower", target(project), "--dialect", "llvm")
    assert r.code == 2 and "--dialect 'llvm' must be 'stablehlo' or 'hlo'" in r.stderr and r.stdout == ""


def test_compile_prints_the_partitioned_module(run_cli, project):
    r = run_cli("compile", target(project, "other"), check=0)
    assert r.stdout.startswith("HloModule ")
    assert "f32[4,1]" in r.stdout                  # the per-device shard of f32[8,4] on [data, model]


def test_devices(run_cli):
    doc = run_cli("devices", "--format", "json", check=0).json()
    assert doc["kind"] == "devices" and doc["platform"] == "cpu" and doc["device_count"] == len(jax.devices())
    assert [d["id"] for d in doc["devices"]] == [d.id for d in jax.devices()]
    doc = run_cli("devices", "--mesh", "data=2,model=4", "--format", "json", check=0).json()
    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    assert doc["mesh"] == [["data", 2], ["model", 4]]
    assert doc["mesh_device_ids"] == [d.id for d in mesh.devices.flat]
    r = run_cli("devices", check=0)
    assert "platform" in r.stdout and "jax / jaxlib" in r.stdout and jax.__version__ in r.stdout


@pytest.mark.parametrize("fmt", list(Format))
@pytest.mark.parametrize("command", ["lower", "compile", "shardings", "devices"])
def test_every_format_renders_for_every_command(run_cli, project, command, fmt, tmp_path):
    args = [command] if command == "devices" else [command, target(project, "other")]
    r = run_cli(*args, "--format", fmt.value, check=0)
    assert r.stdout.strip() and "\x1b[" not in r.stdout
    if fmt is Format.json:
        assert json.loads(r.stdout)["schema_version"] == SCHEMA_VERSION
    if fmt is Format.markdown and command != "devices":  # whose decisions (XLA:CPU's), then the function
        lines = r.stdout.split("\n\n", 1)
        if command != "lower":
            assert lines[0].startswith("> **XLA:CPU's decisions on 8 simulated CPU devices")
        assert (lines[1] if command != "lower" else r.stdout).startswith("## `other`")
    # -o FILE gets the same document, written atomically (no temporary file left), nothing on stdout.
    out = tmp_path / "out" / f"report.{fmt.value}"
    out.parent.mkdir()
    r2 = run_cli(*args, "--format", fmt.value, "-o", out, check=0)
    assert r2.stdout == "" and f"wrote {out}" in r2.stderr.replace("\n", "")
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]
    if fmt is Format.json:
        a, b = json.loads(r.stdout), json.loads(out.read_text())
        for doc in (a, b):
            for f in doc.get("functions", []):
                f["timings"] = None
        assert a == b


def test_output_to_a_missing_folder_is_a_usage_error(run_cli, project, tmp_path):
    r = run_cli("devices", "-o", tmp_path / "nope" / "x.txt")
    assert r.code == 2 and "cannot write" in r.stderr and not (tmp_path / "nope").exists()


# ---- errors -----------------------------------------------------------------------------------


def one_error(r, code=2):
    """One clear message on stderr, nothing on stdout, no traceback."""
    assert r.code == code, (r.stdout, r.stderr)
    assert r.stdout == ""
    assert r.stderr.startswith("error: ")
    assert "Traceback" not in r.stderr
    return r.stderr


def test_missing_file(run_cli, project):
    err = one_error(run_cli("shardings", f"{project}/modle.py:step", "--spec", project / "model.stagetool.yaml"))
    assert "does not describe" in err       # the spec names model.py, not modle.py
    write(project, "extra.stagetool.yaml", "functions: {f: modle.py:step}\n")
    err = one_error(run_cli("shardings", "--spec", project / "extra.stagetool.yaml"))
    assert "modle.py not found; close matches in" in err and "model.py" in err


def test_missing_attribute(run_cli, project):
    write(project, "extra.stagetool.yaml", "functions: {f: model.py:stpe}\n")
    err = one_error(run_cli("shardings", "--spec", project / "extra.stagetool.yaml"))
    assert "model has no attribute 'stpe'; close matches: step" in err


def test_missing_module(run_cli, project):
    write(project, "extra.stagetool.yaml", "functions: {f: 'no_such_mod_xyz.sub:f'}\n")
    err = one_error(run_cli("lower", "--spec", project / "extra.stagetool.yaml"))
    assert "no module named 'no_such_mod_xyz'" in err


def test_bad_spec_lists_every_issue_with_locations(run_cli, project):
    write(project, "bad.stagetool.yaml", """
        version: 1
        mesh: {axes: {data: 2}}
        functions:
          f:
            target: model.py:other
            args: ['f99[4]', 'f32[4] @ [modle]']
    """)
    err = one_error(run_cli("shardings", "--spec", project / "bad.stagetool.yaml"))
    spec = project / "bad.stagetool.yaml"
    assert f"{spec}:6:12: functions.f.args[0]: unknown dtype 'f99'" in err
    assert f"{spec}:6:22: functions.f.args[1]: sharding P('modle') names mesh axis 'modle'" in err


def test_bad_yaml(run_cli, project):
    write(project, "bad.stagetool.yaml", "functions: {f: [\n")
    err = one_error(run_cli("shardings", "--spec", project / "bad.stagetool.yaml"))
    assert "not valid YAML" in err and "bad.stagetool.yaml:2:1" in err


def test_spec_not_found_lists_the_paths_tried(run_cli, tmp_path, monkeypatch):
    write(tmp_path, "lone.py", "def f(x):\n    return x\n")
    monkeypatch.chdir(tmp_path)
    err = one_error(run_cli("shardings", "lone.py:f"))
    assert f"no spec found; tried lone.stagetool.yaml, {tmp_path / 'stagetool.yaml'}" in err
    assert "hint: pass --spec FILE" in err


def test_target_not_in_spec(run_cli, project):
    err = one_error(run_cli("shardings", f"{project}/model.py:bad_trace"))
    # the spec's targets as a TARGET written as this one (absolute) names them
    assert "does not describe" in err and f"step ({project}/model.py:step), other ({project}/model.py:other)" in err
    err = one_error(run_cli("shardings", "--spec", project / "model.stagetool.yaml", "-f", "nope"))
    assert "--function 'nope' is not in" in err


@pytest.mark.parametrize("mesh, message", [
    ("2x", "is not sizes like 2x4"),
    ("2x2x2", "has 3 sizes"),
    ("data=2,fsdp=4", "give every axis of the spec once"),
])
def test_bad_mesh(run_cli, project, mesh, message):
    assert message in one_error(run_cli("shardings", target(project), "--mesh", mesh))


def test_too_few_devices(run_cli, project):
    err = one_error(run_cli("shardings", target(project), "--mesh", "4x4"))
    assert "needs 16 devices, but platform cpu has 8" in err and "fresh process" in err


def test_bad_platform(run_cli, project):
    assert "--platform 'fpga' is not one of" in one_error(run_cli("shardings", target(project), "--platform", "fpga"))


def test_bad_option_exits_2(run_cli):
    assert run_cli().code == 2                  # no arguments: help on stderr, exit 2 (click's NoArgsIsHelpError)
    r = run_cli("shardings", "--no-such-option")
    assert r.code == 2 and "No such option" in r.stderr


def test_indivisible_dimension(run_cli, project):
    write(project, "bad.stagetool.yaml", """
        mesh: {axes: {data: 2, model: 4}}
        functions:
          f: {target: model.py:other, args: ['f32[6,4] @ [model, null]']}
    """)
    err = one_error(run_cli("shardings", "--spec", project / "bad.stagetool.yaml"))
    assert "bad.stagetool.yaml:3:38: x: dimension 0 of size 6 is not divisible by 4, the size of mesh axis 'model'" in err


def test_trace_failure_exits_3_with_jax_message_and_user_line(run_cli, project):
    write(project, "bad.stagetool.yaml", "functions: {f: {target: model.py:bad_trace, args: ['f32[8,3]', 'f32[4,5]']}}\n")
    err = one_error(run_cli("shardings", "--spec", project / "bad.stagetool.yaml"), code=3)
    assert "f: trace failed: TypeError: dot_general requires contracting dimensions to have the same shape" in err
    # the user's frame relative to the spec's folder, as every path of a report (issue 21)
    assert "(at model.py:22 in bad_trace" in err and "y = x @ w" in err


def test_debug_shows_the_traceback_and_keeps_the_exit_code(run_cli, project):
    write(project, "bad.stagetool.yaml", "functions: {f: {target: model.py:bad_trace, args: ['f32[8,3]', 'f32[4,5]']}}\n")
    r = run_cli("shardings", "--spec", project / "bad.stagetool.yaml", "--debug")
    assert r.code == 3                          # a JAX failure stays exit 3 with --debug
    assert "Traceback (most recent call last)" in r.stderr and "StagingError" in r.stderr
    assert "error: f: trace failed" in r.stderr
    r = run_cli("shardings", "--spec", project / "nope.yaml", "--debug")
    assert r.code == 2 and "Traceback" in r.stderr  # a usage error stays exit 2


def test_compile_failure_exits_3(run_cli, project):
    write(project, "bad.stagetool.yaml", "functions: {f: {target: model.py:bad_compile, args: ['f32[8]']}}\n")
    err = one_error(run_cli("compile", "--spec", project / "bad.stagetool.yaml"), code=3)
    assert "f: compile failed:" in err and "No FFI handler registered for stagetool_cli_no_such_handler" in err
    assert "model.py:" in err and "in bad_compile (the function being compiled)" in err
    run_cli("lower", "--spec", project / "bad.stagetool.yaml", check=0)    # lowering alone succeeds


def test_bytes_per_device_caption(run_cli, project):
    r = run_cli("shardings", target(project, "other"), check=0)
    # f32[8,4] on [data, model]: 8*4*4 bytes over 8 devices.
    assert f"{math.prod([8, 4]) * 4 // 8} B" in r.stdout


# ---- fresh processes: what only a new interpreter shows ---------------------------------------

@pytest.mark.slow
def test_help_and_version_do_not_import_jax():
    code = (
        "import sys\n"
        "from stagetool.cli import main\n"
        "assert main(['--help']) == 0\n"
        "assert main(['shardings', '--help']) == 0\n"
        "assert main(['--version']) == 0\n"
        "print('JAX' if 'jax' in sys.modules or 'jaxlib' in sys.modules else 'NOJAX')\n"
    )
    import subprocess
    import sys

    env = {"PYTHONPATH": str(REPO), "COLUMNS": "200", "NO_COLOR": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip().endswith("NOJAX")
    assert "Usage: stagetool" in proc.stdout and "shardings" in proc.stdout
    from stagetool import __version__

    r = run_subprocess("--version")
    assert (r.code, r.stdout, r.stderr) == (0, f"stagetool {__version__}\n", "")
    # the entry point answers --version before importing Typer (or Rich, or JAX)
    code = ("import sys\nfrom stagetool.__main__ import main\nassert main(['--version']) == 0\n"
            "print(sorted(m for m in ('typer', 'rich', 'jax') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.stdout == f"stagetool {__version__}\n[]\n", proc.stderr


@pytest.mark.parametrize("argv", [[], ["--help"], ["-h"], ["report", "--help"], ["--coordinator", "h:1", "cost", "-h"],
                                  ["--coordinator=h:1", "memory", "--help"], ["reprot"], ["--bogus"]])
def test_the_command_built_for_one_run_answers_as_the_whole_app(argv, capfd):
    """A run builds only the subcommand it names, and the root's help lists the subcommands from
    their names and docstrings alone (cli.entry.click_command); help, usage errors and exit codes are
    those of the app with every subcommand built."""
    import typer.main

    from stagetool import cli

    def answer(command) -> tuple:
        try:
            command.main(args=list(argv), prog_name="stagetool", standalone_mode=True)
            code = 0
        except SystemExit as e:
            code = e.code
        out, err = capfd.readouterr()
        return code, out, err

    full = answer(typer.main.get_command(cli.app))
    assert full[1] or full[2]  # the comparison is of something
    assert answer(cli.entry.click_command(list(argv))) == full


@pytest.mark.slow
def test_fresh_process_provisions_the_cpu_devices_the_mesh_needs():
    # 16 host devices: more than conftest's 8, so only a fresh process can show it.
    r = run_subprocess("shardings", "examples/mlp.py:train_step", "--mesh", "4x4", "--format", "json")
    assert r.code == 0, r.stderr
    f = json.loads(r.stdout)["functions"][0]
    assert f["mesh"]["device_count"] == 16 and f["mesh"]["axes"] == [["data", 4], ["model", 4]]
    x = leaves_by_path(json.loads(r.stdout))["batch/x"]
    assert x["shard_shape"] == [128 // 4, 512]
    r = run_subprocess("devices", "--mesh", "data=2,model=4", "--format", "json")
    assert r.code == 0 and json.loads(r.stdout)["device_count"] == 8


@pytest.mark.slow
def test_exit_codes_in_a_fresh_process(tmp_path):
    write(tmp_path, "m.py", "def f(x, w):\n    return x @ w\n")
    write(tmp_path, "m.stagetool.yaml", "functions: {f: {target: m.py:f, args: ['f32[8,3]', 'f32[4,5]']}}\n")
    r = run_subprocess("shardings", f"{tmp_path}/m.py:f")
    assert r.code == 3 and r.stdout == "" and "Traceback" not in r.stderr
    assert "(at m.py:2 in f" in r.stderr  # relative to the spec's folder
    r = run_subprocess("shardings", f"{tmp_path}/m.py:g")
    assert r.code == 2 and r.stdout == "" and "Traceback" not in r.stderr and "does not describe" in r.stderr
    r = run_subprocess("lower", f"{tmp_path}/m.py:f", "--format", "json", "-o", tmp_path / "out.json")
    # The trace fails, so the output file is never created.
    assert r.code == 3 and not (tmp_path / "out.json").exists()


@pytest.mark.slow
def test_colour_on_a_terminal_only():
    import os
    import pty
    import subprocess
    import sys

    def on_tty(extra_env):
        main, secondary = pty.openpty()
        env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
        env.update({"PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "TERM": "xterm-256color", "COLUMNS": "120"})
        env.update(extra_env)
        proc = subprocess.Popen([sys.executable, "-m", "stagetool", "devices"], stdout=secondary, stderr=subprocess.DEVNULL,
                                env=env, cwd=REPO)
        os.close(secondary)
        chunks = []
        while True:
            try:
                data = os.read(main, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        proc.wait(timeout=60)
        os.close(main)
        return proc.returncode, b"".join(chunks).decode()

    code, out = on_tty({})
    assert code == 0 and "\x1b[" in out and "platform" in out
    code, out = on_tty({"NO_COLOR": "1"})
    assert code == 0 and "\x1b[" not in out and "platform" in out


def test_spec_avals_local_jitted_target_and_keyword_donation(run_cli, tmp_path):
    write(tmp_path, "j.py", """
        import functools, jax

        @functools.partial(jax.jit, donate_argnums=(0,), static_argnames=("k",))
        def jitted(x, k):
            return x * k

        def kw(x, *, acc):
            return acc + x
    """)
    write(tmp_path, "j.stagetool.yaml", """
        mesh: {axes: {data: 2, model: 4}}
        avals: local
        platform: cpu
        functions:
          jitted: {target: j.py:jitted, args: ['f32[8,4] @ [data, null]'], static: {k: 3}}
          kw:
            target: j.py:kw
            args: ['f32[8,4] @ [data, model]']
            kwargs: {acc: 'f32[8,4] @ [data, model]'}
            donate: [acc]
    """)
    doc = run_cli("shardings", "--spec", tmp_path / "j.stagetool.yaml", "--processes", "2", "--format", "json",
                  check=0).json()
    jitted, kw = doc["functions"]
    (x,) = jitted["inputs"]
    assert x["donated"]                                      # the target's own donate_argnums
    assert x["local_shape"] == [8, 4] and x["shape"] == [16, 4]
    assert jitted["mesh"]["process_count"] == 2
    ins = {leaf["path"]: leaf for leaf in kw["inputs"]}
    assert ins["acc"]["donated"] and not ins["x"]["donated"]
    assert ins["acc"]["shape"] == [16, 4] and ins["acc"]["shard_shape"] == [8, 1]


def test_prng_key_leaves_count_their_key_bytes(run_cli, tmp_path):
    write(tmp_path, "k.py", "import jax\n\ndef f(k, x):\n    return jax.random.uniform(k[0], x.shape) + x\n")
    write(tmp_path, "k.stagetool.yaml", """
        mesh: {axes: {data: 2, model: 4}}
        functions:
          f: {target: k.py:f, args: ['key<fry>[4] @ [data]', 'f32[8] @ [data]']}
    """)
    doc = run_cli("shardings", f"{tmp_path}/k.py:f", "--format", "json", check=0).json()
    k = leaves_by_path(doc)["k"]
    # A threefry key is two uint32 words: JAX's key dtype itemsize.
    itemsize = jax.eval_shape(lambda: jax.random.key(0)).dtype.itemsize
    assert itemsize == 8
    assert (k["dtype"], k["shard_shape"], k["bytes_global"], k["bytes_per_device"]) == ("key<fry>", [2], 4 * itemsize,
                                                                                        2 * itemsize)


def _has_backend(name: str) -> bool:
    try:
        return bool(jax.devices(name))
    except RuntimeError:
        return False


@pytest.mark.skipif(_has_backend("gpu"), reason="a GPU backend is present")
def test_unknown_backend_is_a_usage_error(run_cli):
    err = one_error(run_cli("devices", "--platform", "gpu"))
    assert "--platform gpu: no such backend here" in err and "hint:" in err
