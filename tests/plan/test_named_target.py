"""Issue 48: the hardware named once (the spec's ``topology:``, ``[tool.stagetool]`` in
pyproject.toml), sized by the mesh, and the line that says whose decisions a CPU answer is."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import REPO, assert_figures_are_raw_jaxs, run_subprocess, target_devices, write

from stagetool.core.errors import UsageError
from stagetool.plan.options import Options
from stagetool.plan.plan import make_plan
from stagetool.plan.target import CpuMesh, GpuTarget, TpuTarget, sized_name


@pytest.mark.parametrize("name, sizes, slices, expected", [
    ("v5e", (2, 4), 1, "v5e:2x4"),          # --mesh 2x4: a 2x4 slice
    ("v5e", (8,), 1, "v5e:2x4"),            # one axis of 8: the published 8-chip slice
    ("v5e", (4, 4), 1, "v5e:4x4"),
    ("v6e", (), 1, "v6e:1x1"),              # no mesh: one chip
    ("v5p", (2, 4), 1, "v5p:2x2x2"),
    ("v4", (8,), 1, "v4:2x2x1"),            # two devices per v4 chip: 4 chips
    ("v5e", (4, 4), 2, "v5e:2x4"),          # 2 slices of 8
    ("h100", (2, 4), 1, "h100:8"),
    ("h100", (16,), 1, "h100:2x8"),         # hosts of 8
    ("a100-80gb", (4,), 1, "a100-80gb:4"),
    ("v5e:4x4", (2, 4), 1, "v5e:4x4"),      # a whole name is kept (the mesh check says the rest)
])
def test_a_hardware_name_is_sized_by_the_mesh(name, sizes, slices, expected):
    assert sized_name(name, sizes, slices=slices) == expected


@pytest.mark.parametrize("name, sizes, says", [
    ("v5e", (3,), "no published v5e slice has 3 chips"),
    ("v4", (3,), "2 devices"),
    ("h100", (12,), "hosts of up to 8"),
    ("v9x", (8,), "neither a TPU generation nor a GPU"),
])
def test_a_mesh_no_slice_of_the_hardware_has_is_a_usage_error(name, sizes, says):
    with pytest.raises(UsageError, match=says):
        sized_name(name, sizes)


SPEC = "version: 1\nmesh: {axes: {data: 2, model: 4}}\n{extra}functions:\n  f:\n    target: m.py:f\n    args: ['f32[8,128] @ [data]']\n"


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project folder (its own .git) with m.py and a spec; libtpu and the CUDA plugin taken as installed
    (the plan checks only that they are, before JAX starts)."""
    from stagetool.plan import target

    monkeypatch.setattr(target, "libtpu_available", lambda: True)
    monkeypatch.setattr(target, "cuda_plugin_available", lambda: True)
    (tmp_path / ".git").mkdir()
    write(tmp_path, "m.py", "def f(x):\n    return x * 2\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _plan(folder: Path, extra: str = "", **options):
    write(folder, "m.stagetool.yaml", SPEC.replace("{extra}", extra))
    return make_plan(Options(target="m.py:f", **options))


def test_pyproject_names_the_hardware_and_the_mesh_sizes_it(project):
    write(project, "pyproject.toml", '[project]\nname = "x"\n\n[tool.stagetool]\ntopology = "v5e"\n')
    plan = _plan(project)
    assert plan.target == TpuTarget("v5e:2x4", "v5e", (2, 4))
    assert plan.target_from == "pyproject.toml [tool.stagetool]" and plan.named_as == "v5e"
    plan = _plan(project, mesh="1x8")  # --mesh 1x8: no 1x8 slice is published; the 8-chip one
    assert plan.target.name == "v5e:2x4"


def test_a_pyproject_above_the_spec_folder_names_it_for_the_whole_project(project):
    write(project, "pyproject.toml", '[tool.stagetool]\ntopology = "h100"\n')
    sub = project / "configs"
    sub.mkdir()
    write(sub, "m.py", "def f(x):\n    return x\n")
    write(sub, "m.stagetool.yaml", SPEC.replace("{extra}", ""))
    plan = make_plan(Options(target="configs/m.py:f"))
    assert plan.target == GpuTarget("h100:8", "h100", 1, 8) and plan.target_from.startswith("pyproject.toml")


def test_the_spec_wins_over_pyproject_and_the_command_line_over_both(project):
    write(project, "pyproject.toml", '[tool.stagetool]\ntopology = "v5e"\n')
    plan = _plan(project, "topology: h100\n")
    assert plan.target.name == "h100:8" and plan.target_from == "m.stagetool.yaml:3:11"
    plan = _plan(project, "topology: h100\n", topology="v6e")
    assert plan.target.name == "v6e:2x4" and plan.target_from == "--topology"
    plan = _plan(project, "topology: h100\n", platform="cpu")  # an explicit --platform cpu: the CPU mesh
    assert plan.target == CpuMesh() and plan.target_from is None


def test_nothing_named_is_the_cpu_mesh_as_before(project):
    plan = _plan(project)
    assert not isinstance(plan.target, (TpuTarget, GpuTarget)) and plan.target_from is None


@pytest.mark.parametrize("toml, says", [
    ('[tool.stagetool]\ntopolgy = "v5e"\n', "unknown key 'topolgy' (did you mean 'topology'?)"),
    ('[tool.stagetool]\ntopology = 5\n', "must be a non-empty string"),
    ('[tool.stagetool\n', "cannot read"),
    ('[tool.stagetool]\ntopology = "v5e"\n', None),
])
def test_a_bad_tool_stagetool_table_is_exit_2_naming_the_file(project, toml, says):
    write(project, "pyproject.toml", toml)
    if says is None:
        assert _plan(project).target.name == "v5e:2x4"
        return
    with pytest.raises(UsageError, match="pyproject.toml") as e:
        _plan(project)
    assert says in e.value.message


def test_a_hardware_the_mesh_cannot_slice_names_the_pyproject(project):
    write(project, "pyproject.toml", '[tool.stagetool]\ntopology = "v5e"\n')
    with pytest.raises(UsageError, match=r"pyproject.toml \[tool.stagetool\]: topology = 'v5e': .*3 chips"):
        _plan(project, mesh="3x1")


def test_a_spec_gpu_target_config_is_read_relative_to_the_spec(project):
    with pytest.raises(UsageError, match=str(project / "gpu.txtpb")):
        _plan(project, "topology: gpu\ngpu_target_config: gpu.txtpb\n")


# ---- through the CLI: the text header, the JSON, and the one line of a CPU answer

def test_a_cpu_answer_says_whose_decisions_it_is_in_every_format(run_cli_shared, tmp_path):
    """No hardware named: the line at the top of text, Markdown and HTML, the JSON's ``answer``."""
    doc = run_cli_shared("collectives", "examples/mlp.py:train_step", "--format", "json", check=0).json()
    assert doc["answer"]["compiler"] == "XLA:CPU" and doc["answer"]["devices"] == "simulated"
    line = doc["answer"]["statement"]
    assert line.startswith("XLA:CPU's decisions on 8 simulated CPU devices") and "--against v5e:2x4" in line
    text = run_cli_shared("collectives", "examples/mlp.py:train_step", check=0).stdout
    assert " ".join(text.split()).startswith(line[:60])
    md = run_cli_shared("collectives", "examples/mlp.py:train_step", "--format", "markdown", check=0).stdout
    assert md.startswith("> **XLA:CPU's decisions on 8 simulated CPU devices")
    html = run_cli_shared("collectives", "examples/mlp.py:train_step", "--format", "html", check=0).stdout
    assert html.index("XLA:CPU&#39;s decisions on 8 simulated CPU devices") < html.index("<section class=\"function\"")


# ---- named once, the accelerator's figures: equal to a raw compile-only compile (the cases)

CASES = {
    # x.at[0:3].set(...) on a sharded array: XLA:CPU makes a whole-array all-gather here
    "at_set": ("def f(x, y):\n    return x.at[0:3].set(y)\n",
               ["f32[1024,2048] @ [data, model]", "f32[3,2048]"], None),
    # an associative_scan over a sequence-sharded axis
    "assoc_scan": ("import jax\n\ndef f(a, b):\n    def op(l, r):\n        return l[0] * r[0], l[1] * r[0] + r[1]\n"
                   "    return jax.lax.associative_scan(op, (a, b), axis=1)[1]\n",
                   ["f32[8,1024,128] @ [data, model]", "f32[8,1024,128] @ [data, model]"], None),
    # a donated paged-cache write
    "paged_write": ("def f(cache, new, pages):\n    return cache.at[pages].set(new)\n",
                    ["bf16[64,16,8,128] @ [null, null, model]", "bf16[4,16,8,128] @ [null, null, model]", "i32[4]"],
                    0),
}


def _raw_compile(case: str, topology: str, tmp_path: Path):
    """The case compiled by raw JAX for the compile-only devices of ``topology`` on a 2x4 (data, model) mesh."""
    import importlib.util

    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from stagetool.devices.tpu_topology import topology_mesh
    from stagetool.spec.leaves import parse_leaf
    from stagetool.spec.model import Loc

    code, args, donate = CASES[case]
    path = tmp_path / f"raw_{case}.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location(f"raw_{case}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    mesh = topology_mesh(target_devices(topology), (2, 4), ("data", "model"))
    leaves = [parse_leaf(a, Loc("m.stagetool.yaml", 1, 1)) for a in args]
    shardings = [NamedSharding(mesh, P(*leaf.sharding.dims)) for leaf in leaves]
    structs = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s) for leaf, s in zip(leaves, shardings)]
    jitted = jax.jit(module.f, in_shardings=shardings, donate_argnums=() if donate is None else (donate,))
    return jitted.lower(*structs).compile()


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("hardware, topology", [("v5e", "v5e:2x4"), ("h100", "h100:8")])
def test_named_in_pyproject_the_figures_are_a_raw_compile_only_compiles(case, hardware, topology, tmp_path):
    target_devices(topology)  # skips without libtpu / the CUDA plugin
    code, args, donate = CASES[case]
    (tmp_path / ".git").mkdir()
    write(tmp_path, "pyproject.toml", f'[tool.stagetool]\ntopology = "{hardware}"\n')
    write(tmp_path, "m.py", code)
    write(tmp_path, "m.stagetool.yaml", "version: 1\nmesh: {axes: {data: 2, model: 4}}\nfunctions:\n  f:\n"
          f"    target: m.py:f\n    args: {json.dumps(args)}\n" + ("" if donate is None else f"    donate: [{donate}]\n"))
    r = run_subprocess("report", "m.py:f", "--no-cache", "--format", "json", cwd=tmp_path, env={
        "PYTHONPATH": os.pathsep.join([str(REPO), *os.environ.get("PYTHONPATH", "").split(os.pathsep)])})
    assert r.code == 0, r.stderr
    doc = json.loads(r.stdout)
    fn = doc["functions"][0]
    assert fn["mesh"]["topology"] == topology and fn["mesh"]["target_from"] == "pyproject.toml [tool.stagetool]"
    assert doc["answer"]["devices"] == "compile-only" and doc["answer"]["target"] == topology
    assert_figures_are_raw_jaxs(fn, _raw_compile(case, topology, tmp_path))


def test_the_python_api_and_the_fixture_answer_for_the_named_hardware(tmp_path, monkeypatch):
    """``stagetool.inspect`` (what the ``stagetool_snapshot`` fixture calls) run in a project whose
    pyproject.toml names v5e stages on v5e:2x4 compile-only, equal to raw JAX's compile for it; the
    caller's CPU mesh is re-laid there by axis name."""
    target_devices("v5e:2x4")  # skips without libtpu
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import stagetool
    from stagetool.devices.tpu_topology import topology_mesh

    (tmp_path / ".git").mkdir()
    write(tmp_path, "pyproject.toml", '[tool.stagetool]\ntopology = "v5e"\n')
    monkeypatch.chdir(tmp_path)
    cpu = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))

    def step(w, x):
        return jnp.tanh(x @ w).sum()

    w = jax.ShapeDtypeStruct((512, 1024), jnp.float32, sharding=NamedSharding(cpu, P(None, "model")))
    x = jax.ShapeDtypeStruct((128, 512), jnp.float32, sharding=NamedSharding(cpu, P("data", None)))
    report = stagetool.inspect(step, w, x, peak=False)
    f = report.function()
    assert f.mesh.topology == "v5e:2x4" and f.mesh.target_from == "pyproject.toml [tool.stagetool]"
    mesh = topology_mesh(target_devices("v5e:2x4"), (2, 4), ("data", "model"))
    relaid = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, a.sharding.spec)) for a in (w, x)]
    compiled = jax.jit(step).lower(*relaid).compile()
    mem = compiled.memory_analysis()
    assert (report.memory.record.argument_bytes, report.memory.record.temp_bytes) == \
        (mem.argument_size_in_bytes, mem.temp_size_in_bytes)
    assert report.cost.per_device.flops == compiled.cost_analysis()["flops"]


def test_the_action_installs_the_extra_the_named_hardware_needs(tmp_path):
    """action.yml installs stagetool with the extra that ``python -m stagetool.spec.project SPEC`` prints."""
    from stagetool.spec.project import extra_for

    (tmp_path / ".git").mkdir()
    spec = write(tmp_path, "s.stagetool.yaml", SPEC.replace("{extra}", ""))
    assert extra_for(spec) is None
    write(tmp_path, "pyproject.toml", '[tool.stagetool]\ntopology = "h100"\n')
    assert extra_for(spec) == "gpu-aot"
    write(tmp_path, "pyproject.toml", '[tool.stagetool]\ngpu-target-config = "mine.txtpb"\n')
    assert extra_for(spec) == "gpu-aot"
    spec = write(tmp_path, "s.stagetool.yaml", SPEC.replace("{extra}", "topology: v5p:2x2x2\n"))
    assert extra_for(spec) == "tpu"  # the spec's own topology: over pyproject.toml
    write(tmp_path, "pyproject.toml", "[tool.stagetool\n")
    spec = write(tmp_path, "s.stagetool.yaml", SPEC.replace("{extra}", ""))
    assert extra_for(spec) is None  # unreadable: the staging command says so, not the install
    assert "python -m stagetool.spec.project" in (REPO / "action.yml").read_text()
