"""Compile-only GPU targets (issue 20, item 1): ``--topology h100:8`` from a machine without a GPU.

The tests that compile need JAX's CUDA plugin without NVIDIA libraries (``pip install -e
'.[gpu-aot]'``; ``.ci/run`` installs it); they are skipped, with the reason, where it is absent.
The others (names, the table's configs, errors, the figures derived from a compiled module) run
everywhere.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import REPO, run_subprocess

from stagetool.hlo.loops import counted_cost
from stagetool.analysis.sections import derived_per_device_cost
from stagetool.core.errors import UsageError
from stagetool.hlo.parser import parse_hlo_module
from stagetool.devices import gpu_capture, gpu_topology, tpu_topology as topology
from stagetool.plan import target as plan_target
from stagetool.plan.target import GpuTarget, TpuTarget, parse_target

needs_plugin = pytest.mark.skipif(not gpu_topology.cuda_plugin_available(),
                                  reason="JAX's CUDA plugin is not installed: pip install -e '.[gpu-aot]'")
needs_libtpu = pytest.mark.skipif(not topology.libtpu_available(), reason="libtpu not installed: pip install -e '.[tpu]'")


def _env(**more: str) -> dict:
    """The subprocess environment, keeping this process's extra PYTHONPATH entries (a plugin folder)."""
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != str(REPO)]
    return {"PYTHONPATH": os.pathsep.join([str(REPO), *extra]), **more}


# ---- names and the table (no plugin needed)


@pytest.mark.parametrize("name, expected, count", [
    ("h100:8", ("h100", 1, 8), 8), ("h100:2x8", ("h100", 2, 8), 16), ("a100-80gb:4", ("a100-80gb", 1, 4), 4),
    ("H200:1", ("h200", 1, 1), 1), ("b200:4x8", ("b200", 4, 8), 32), ("h100-sxm:8", ("h100", 1, 8), 8),
])
def test_gpu_names_parse_into_hosts_and_devices(name, expected, count):
    target = parse_target(name)
    assert isinstance(target, GpuTarget) and target.name == name
    assert (target.kind, target.hosts, target.devices_per_host) == expected
    assert target.device_count == count


@pytest.mark.parametrize("name", ["h100:0", "h100:2x0", "h100:8x8x8", "h100", "rtx9999:8"])
def test_bad_gpu_names_say_what_is_accepted(name):
    with pytest.raises(UsageError) as e:
        parse_target(name, gpu_target_config="h.txtpb")  # with a config, any name is read as a GPU target's
    assert "h100:8" in e.value.hint


def test_tpu_names_are_not_gpu_names():
    assert parse_target("v5e:2x4") == TpuTarget("v5e:2x4", "v5e", (2, 4))
    assert parse_target("v5e:2x4").device_count == 8 and parse_target("v4:2x2x1").device_count == 8


@pytest.mark.parametrize("model", gpu_topology.GPU_MODELS, ids=lambda m: m.alias)
def test_the_table_config_carries_the_published_figures(model):
    text = gpu_topology.target_config_text(model)
    assert f"core_count: {model.sm_count}\n" in text
    assert f"device_memory_size: {model.memory_bytes}\n" in text
    assert f"memory_bandwidth: {model.memory_bandwidth_bytes_per_second}\n" in text
    assert f'device_description_str: "{model.device_kind}"' in text
    assert f"major: {model.compute_capability[0]}" in text
    from stagetool.plan.gpu_target_proto import parse_target_config

    assert parse_target_config(text, "table").memory_bytes == model.memory_bytes  # read as XLA reads it


def test_the_aliases_of_the_issue_are_in_the_table():
    assert {"a100-80gb", "h100", "h200", "b200"} <= {m.alias for m in gpu_topology.GPU_MODELS}
    assert gpu_topology.gpu_model("h100").device_kind == "NVIDIA H100 80GB HBM3"


def test_a_capture_turns_driver_figures_into_a_config():
    figures = {"name": "NVIDIA H200", "memory_bytes": 150_754_820_096, "threads_per_block_limit": 1024,
               "block_dim_limit_x": 2147483647, "block_dim_limit_y": 65535, "block_dim_limit_z": 65535,
               "shared_memory_per_block": 49152, "threads_per_warp": 32, "registers_per_block_limit": 65536,
               "clock_khz": 1_980_000, "core_count": 132, "memory_clock_khz": 2_619_000, "bus_width_bits": 6144,
               "l2_cache_size": 52_428_800, "threads_per_core_limit": 2048, "cc_major": 9, "cc_minor": 0,
               "shared_memory_per_core": 233_472, "registers_per_core_limit": 65536,
               "shared_memory_per_block_optin": 232_448}
    text = gpu_capture.config_from_figures(figures)
    assert "core_count: 132\n" in text and "device_memory_size: 150754820096\n" in text
    assert f"memory_bandwidth: {2 * 2_619_000 * 1000 * 6144 // 8}\n" in text  # DDR: 2 × clock × bus bytes
    assert "clock_rate_ghz: 1.98\n" in text and 'device_description_str: "NVIDIA H200"' in text


# ---- errors, before JAX starts (no plugin needed)


def test_v5e_has_no_three_dimensional_topology():
    r = run_subprocess("report", "examples/mlp.py:train_step", "--topology", "v5e:2x2x2", env=_env())
    assert r.code == 2, r.stderr
    assert "v5e:2x2x2" in r.stderr and "2-D" in r.stderr and "v5e:2x4" in r.stderr and "Traceback" not in r.stderr


def test_without_the_plugin_a_gpu_topology_says_what_to_install():
    env = {"PYTHONPATH": str(REPO)}  # this process's plugin folder (if any) left out
    code = "import sys; from stagetool.devices.gpu_topology import cuda_plugin_available as a; sys.exit(a())"
    import subprocess
    import sys

    if subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}).returncode != 0:
        pytest.skip("the CUDA plugin is installed in the environment itself")
    r = run_subprocess("report", "examples/mlp.py:train_step", "--topology", "h100:8", env=env)
    assert r.code == 2, r.stderr
    assert "CUDA plugin" in r.stderr and "pip install -e '.[gpu-aot]'" in r.stderr and "Traceback" not in r.stderr


def test_the_install_hint_is_the_readmes(monkeypatch):
    """Trial 2, 14a: the hint named ``pip install "stagetool[gpu-aot]"`` where the documentation says
    ``pip install -e '.[gpu-aot]'``; both now say the documentation's form (checked against the text of
    docs/targets.md, which the README's hints pointed to)."""
    monkeypatch.setattr(plan_target, "cuda_plugin_available", lambda: False)
    monkeypatch.setattr(plan_target, "libtpu_available", lambda: False)
    readme = (REPO / "docs/targets.md").read_text()
    for name, extra in (("h100:8", "gpu-aot"), ("v5e:2x4", "tpu")):
        with pytest.raises(UsageError) as e:
            plan_target.check_target(parse_target(name))
        form = f"pip install -e '.[{extra}]'"
        assert form in e.value.hint and form in readme and f"stagetool[{extra}]" not in e.value.hint


def test_a_target_config_that_is_not_one_is_exit_2(tmp_path):
    bad = tmp_path / "bad.txtpb"
    bad.write_text("hello: 1\n")
    r = run_subprocess("report", "examples/mlp.py:train_step", "--topology", "gpu:8", "--gpu-target-config", bad,
                       env=_env())
    assert r.code == 2 and "not a GpuTargetConfigProto" in r.stderr, r.stderr
    r = run_subprocess("report", "examples/mlp.py:train_step", "--gpu-target-config", bad, env=_env())
    assert r.code == 2 and "needs a GPU topology" in r.stderr, r.stderr


def test_capturing_a_target_config_without_a_gpu_is_exit_2(tmp_path):
    out = tmp_path / "h.txtpb"
    r = run_subprocess("devices", "--target-config", "-o", out, env=_env())
    assert r.code == 2 and "GPU" in r.stderr and "--topology h100:8" in r.stderr, r.stderr
    assert not out.exists()


# ---- only the backends a run uses


@pytest.mark.parametrize("platform, topo, expected", [
    ("cpu", None, "cpu"), (None, "v5e:2x4", "cpu"), (None, "h100:8", "cpu"), ("gpu", None, None), ("tpu", None, None),
])
def test_platforms_for_a_run(monkeypatch, platform, topo, expected):
    from stagetool.devices import backends

    target = parse_target(topo, platform=platform)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    assert backends.platforms_for(target) == expected
    monkeypatch.setenv("JAX_PLATFORMS", "cpu,tpu")
    assert backends.platforms_for(target) is None  # the user's choice stands


def test_no_platform_is_cpu_only_where_no_accelerator_can_be(monkeypatch):
    from stagetool.devices import backends

    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(backends, "accelerator_attached", lambda: False)
    monkeypatch.setattr(backends, "other_plugins", lambda: ())
    assert backends.platforms_for(plan_target.Attached()) == "cpu"
    monkeypatch.setattr(backends, "accelerator_attached", lambda: True)  # /dev/nvidia0, /dev/accel0 ...
    assert backends.platforms_for(plan_target.Attached()) is None
    monkeypatch.setattr(backends, "accelerator_attached", lambda: False)
    monkeypatch.setattr(backends, "other_plugins", lambda: ("xla_metal",))  # makes no device file
    assert backends.platforms_for(plan_target.Attached()) is None


def test_a_simulated_mesh_starts_only_the_cpu_backend(tmp_path):
    """No JAX_PLATFORMS: --platform cpu, no platform (no accelerator here), a TPU topology and a GPU
    target start the CPU backend alone: libtpu is not even loaded (its probe) except for the TPU
    topology, which needs it, and nothing about CUDA reaches stderr."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import sys\n"
        "from stagetool.pipeline import Options, analyze\n"
        "analyze(Options(spec='examples/mlp.stagetool.yaml', platform=sys.argv[1] or None,\n"
        "                topology=sys.argv[2] or None, mesh=sys.argv[3] or None))\n"
        "import jax.extend.backend as b\n"
        "print('libtpu.so' in open('/proc/self/maps').read())\n"  # libtpu's probe loads it
        "print(sorted(b.backends()))\n")
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"} | _env()
    from stagetool.devices import backends

    runs = [("cpu", "", "")]
    if not backends.accelerator_attached() and not backends.other_plugins():
        runs.append(("", "", ""))  # no platform and nothing attached: a simulated mesh too
    if topology.libtpu_available():
        runs.append(("", "v5e:2x4", "2x4"))
    if gpu_topology.cuda_plugin_available():
        runs.append(("", "h100:8", "2x4"))
    for argv in runs:
        proc = subprocess.run([sys.executable, str(script), *argv], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        *_, libtpu_loaded, started = proc.stdout.strip().splitlines()
        assert started == "['cpu']", argv
        assert libtpu_loaded == str(argv[1].startswith("v5e")), argv  # only a TPU topology loads libtpu
        assert "Unable to load CUDA" not in proc.stderr and "cudart_stub" not in proc.stderr, argv


# ---- FLOPs and bytes derived from the compiled module agree with XLA's own where XLA reports them


def _conv_program():
    x = jax.ShapeDtypeStruct((4, 3, 33, 31), jnp.float32)
    w = jax.ShapeDtypeStruct((8, 3, 5, 3), jnp.float32)

    def f(x, w):
        y = jax.lax.conv_general_dilated(x, w, window_strides=(2, 1), padding=((2, 1), (0, 3)),
                                         lhs_dilation=(1, 2), rhs_dilation=(2, 1))
        return jnp.tanh(y).sum(axis=(2, 3))

    return jax.jit(f).trace(x, w).lower().compile()


def _grouped_conv_program():
    x = jax.ShapeDtypeStruct((2, 8, 16, 16), jnp.float32)
    w = jax.ShapeDtypeStruct((8, 2, 3, 3), jnp.float32)
    return jax.jit(lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", feature_group_count=4)
                   ).trace(x, w).lower().compile()


@pytest.mark.parametrize("program", [_conv_program, _grouped_conv_program])
def test_convolution_flops_are_counted_as_xla_counts_them(program):
    compiled = program()
    counted = counted_cost(parse_hlo_module(compiled.as_text()))
    xla = compiled.cost_analysis()
    assert counted.flops == pytest.approx(xla["flops"], rel=1e-6)


def _example_compiled(topo: str | None):
    from stagetool.pipeline import Options, staged_functions

    (staged,) = [s for _, _, s in staged_functions(Options(spec=REPO / "examples/transformer.stagetool.yaml",
                                                                topology=topo))]
    return staged.compiled


@pytest.mark.slow
def test_derived_figures_equal_xla_on_cpu():
    compiled = _example_compiled(None)
    derived = derived_per_device_cost(parse_hlo_module(compiled.as_text()))
    xla = compiled.cost_analysis()
    assert derived.flops == pytest.approx(xla["flops"], rel=2e-3)
    assert derived.transcendentals == xla["transcendentals"]
    assert derived.bytes_accessed == pytest.approx(xla["bytes accessed"], rel=5e-3)
    assert derived.source.startswith("derived")


@pytest.mark.slow
@needs_libtpu
def test_derived_flops_equal_xla_on_a_tpu_topology():
    """TPU compiles the transformer's matmuls into convolutions with dilated windows: counted as XLA does."""
    compiled = _example_compiled("v5e:2x4")
    derived = derived_per_device_cost(parse_hlo_module(compiled.as_text()))
    xla = compiled.cost_analysis()
    assert derived.flops == pytest.approx(xla["flops"], rel=1e-3)
    assert derived.transcendentals == xla["transcendentals"]


# ---- the GPU target itself (needs the plugin)


@pytest.mark.slow
@needs_plugin
def test_transformer_on_h100_matches_a_raw_compile(run_cli_shared):
    r = run_cli_shared("memory", "examples/transformer.py:train_step", "--topology", "h100:8", "--no-peak",
                       "--format", "json", check=0)
    f = r.json()["functions"][0]
    assert f["mesh"]["platform"] == "gpu" and f["mesh"]["device_count"] == 8
    assert f["mesh"]["device_kind"].startswith("NVIDIA H100") and f["mesh"]["topology"] == "h100:8"
    assert any("without autotuning" in n for n in f["notes"])
    m = f["memory"]["record"]

    from jax.experimental import topologies
    from jax.sharding import Mesh
    from test_examples import transformer_stages

    raw = topologies.get_topology_desc(platform="cuda", topology="1x1x8",
                                       target_config=gpu_topology.target_config_text(gpu_topology.gpu_model("h100")))
    assert len(raw.devices) == 8
    mesh = Mesh(np.array(raw.devices).reshape(2, 4), ("data", "model"))
    stats = transformer_stages(mesh)[3].memory_analysis()
    assert m["argument_bytes"] == stats.argument_size_in_bytes
    assert m["output_bytes"] == stats.output_size_in_bytes
    assert m["alias_bytes"] == stats.alias_size_in_bytes
    assert m["temp_bytes"] == stats.temp_size_in_bytes
    assert m["peak_bytes_reported"] == stats.peak_memory_in_bytes
    # the capacity is the table's HBM
    assert f["memory"]["capacity_bytes"] == 80 * 2**30
    # the note on what the peak is made of speaks of XLA:GPU, not of CPU (trial 2, finding 11)
    summed = stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes \
        + stats.temp_size_in_bytes
    assert summed > stats.peak_memory_in_bytes and m["peak_bytes"] == summed
    text = run_cli_shared("memory", "examples/transformer.py:train_step", "--topology", "h100:8", "--no-peak",
                          check=0).stdout.replace("\n", " ")
    assert "XLA:GPU's peak_memory_in_bytes" in text and "on CPU" not in text


@pytest.mark.parametrize("platform, says, not_says", [
    ("cpu", "XLA's peak_memory_in_bytes leaves out temporaries on CPU", "XLA:GPU"),
    ("gpu", "XLA:GPU's peak_memory_in_bytes (8.47 MiB) is below what its buffer assignment allocates", "CPU"),
    ("tpu", "XLA:TPU's peak_memory_in_bytes (8.47 MiB) is below what its buffer assignment allocates", "CPU"),
])
def test_the_peak_note_names_the_backend_that_compiled(platform, says, not_says):
    """The cookbook's h100:8 figures (trial 2): the sum 9,504,992 B is the peak, XLA's 8,878,488 B below it."""
    from types import SimpleNamespace

    from stagetool.analysis.memory import SUM_SOURCE
    from stagetool.report.views import peak_note

    rec = SimpleNamespace(peak_bytes_estimate=9_504_992, peak_bytes_reported=8_878_488, peak_bytes=9_504_992,
                          peak_source=SUM_SOURCE, temp_bytes=8_889_672)
    note = peak_note(rec, platform)
    assert says in note and not_says not in note


@pytest.mark.slow
@needs_plugin
def test_gpu_flops_are_derived_and_labelled(run_cli_shared):
    r = run_cli_shared("cost", "examples/transformer.py:train_step", "--topology", "h100:8", "--format", "json",
                       check=0)
    cost = r.json()["functions"][0]["cost"]
    pd = cost["per_device"]
    assert pd["source"].startswith("derived") and pd["flops"] > 1e9 and pd["bytes_accessed"] > 0
    assert any("derived" in n for n in cost.get("scope_notes", []))
    text = run_cli_shared("cost", "examples/transformer.py:train_step", "--topology", "h100:8", check=0).stdout
    assert "derived from one device's compiled module" in text


@needs_plugin
def test_every_gpu_in_the_table_compiles(run_cli):
    for model in gpu_topology.GPU_MODELS:
        topo = gpu_topology.gpu_topology(parse_target(f"{model.alias}:2"))
        assert [d.device_kind for d in topo.devices] == [model.device_kind] * 2
        assert topo.memory_bytes_per_device == model.memory_bytes and topo.num_processes == 1
    two_hosts = gpu_topology.gpu_topology(parse_target("a100-80gb:2x4"))
    assert two_hosts.num_devices == 8 and two_hosts.num_processes == 2


@needs_plugin
def test_a_users_target_config_is_used_as_written(tmp_path, run_cli):
    text = gpu_topology.target_config_text(gpu_topology.gpu_model("h200")).replace('"NVIDIA H200"', '"NVIDIA H200 NVL"')
    cfg = tmp_path / "h200nvl.txtpb"
    cfg.write_text(text)
    r = run_cli("devices", "--topology", "gpu:4", "--gpu-target-config", cfg, "--format", "json", check=0)
    doc = r.json()
    assert doc["device_kind"] == "NVIDIA H200 NVL" and doc["device_count"] == 4
    broken = tmp_path / "broken.txtpb"
    broken.write_text("gpu_device_info { core_count: many }\n")
    r = run_cli("devices", "--topology", "gpu:4", "--gpu-target-config", broken)
    assert r.code == 2 and f"{broken}:1:31: not a GpuTargetConfigProto in text form" in r.stderr, r.stderr


@needs_plugin
def test_a_target_config_file_is_read_once_per_run_and_what_was_checked_is_compiled(tmp_path, run_cli, monkeypatch):
    """The plan reads and checks --gpu-target-config once (plan.target.check_target); the devices
    compile for that text: a file rewritten after the check cannot reach XLA unchecked."""
    from stagetool.process import fileio

    text = gpu_topology.target_config_text(gpu_topology.gpu_model("h200")).replace('"NVIDIA H200"', '"NVIDIA H200 NVL"')
    cfg = tmp_path / "h200nvl.txtpb"
    cfg.write_text(text)
    reads: list[str] = []
    real = fileio.read_regular_bytes

    def counted(path, **kw):
        reads.append(str(path))
        data = real(path, **kw)
        cfg.write_text("gpu_device_info { core_count: 0 }\n")  # changed after the check: never read again
        return data

    monkeypatch.setattr(fileio, "read_regular_bytes", counted)
    doc = run_cli("devices", "--topology", "gpu:4", "--gpu-target-config", cfg, "--format", "json", check=0).json()
    assert reads == [str(cfg)]
    assert doc["device_kind"] == "NVIDIA H200 NVL" and doc["device_count"] == 4


SPEC_TOPOLOGY = """
version: 1
mesh: {axes: {data: 2, model: 4}}
topology: TOPO
functions:
  f:
    target: m.py:f
    args: ['f32[64,128] @ [data, null]', 'f32[128,32] @ [null, model]']
"""


def test_a_spec_topology_that_cannot_exist_names_its_line(tmp_path):
    from helpers import write

    write(tmp_path, "m.py", "def f(a, b):\n    return a @ b\n")
    spec = write(tmp_path, "m.stagetool.yaml", SPEC_TOPOLOGY.replace("TOPO", "v5e:2x2x2"))
    r = run_subprocess("shardings", "--spec", spec, cwd=tmp_path, env=_env())
    assert r.code == 2 and "m.stagetool.yaml:3" in r.stderr and "2-D" in r.stderr, r.stderr


@needs_plugin
def test_a_spec_can_name_a_gpu_target(tmp_path, run_cli, monkeypatch):
    from helpers import write

    write(tmp_path, "m.py", "def f(a, b):\n    return a @ b\n")
    spec = write(tmp_path, "m.stagetool.yaml", SPEC_TOPOLOGY.replace("TOPO", "a100-80gb:8"))
    monkeypatch.chdir(tmp_path)
    f = run_cli("cost", "--spec", spec, "--format", "json", check=0).json()["functions"][0]
    assert f["mesh"]["device_kind"] == "NVIDIA A100-SXM4-80GB" and f["mesh"]["topology"] == "a100-80gb:8"
    # each device: a [32,128] @ [128,8] block
    assert f["cost"]["per_device"]["flops"] == 2 * 32 * 8 * 128


# ---- round 3 (issue 35): the config read as the proto XLA reads ------------------------------------------

H100 = gpu_topology.target_config_text(gpu_topology.gpu_model("h100"))


@pytest.mark.parametrize("edit,expect", [
    (lambda t: t.replace("  device_memory_size: 85899345920\n", "  # device_memory_size: 999999999999999\n"),
     "device_memory_size is missing"),  # a comment is a comment, not the capacity
    (lambda t: t.replace("device_memory_size: 85899345920", "device_memory_size: 0"), "device_memory_size: 0 is not above 0"),
    (lambda t: t.replace("device_memory_size: 85899345920", "device_memory_size: -5"), "device_memory_size: -5 is not above 0"),
    (lambda t: t.replace("threads_per_warp: 32", "threads_per_warp: 0"), "threads_per_warp: 0 is not above 0"),
    (lambda t: t.replace("core_count: 132", "core_count: -1"), "core_count: -1 is not above 0"),
    (lambda t: t.replace("memory_bandwidth: 3350000000000", "memory_bandwidth: 0"), "memory_bandwidth: 0 is not above 0"),
    (lambda t: t.replace("clock_rate_ghz: 1.98", "clock_rate_ghz: nan"), "clock_rate_ghz: nan is not above 0"),
    (lambda t: t.replace("clock_rate_ghz: 1.98", "clock_rate_ghz: -inf"), "clock_rate_ghz: -inf is not above 0"),
    (lambda t: t.replace("core_count: 132", "core_count: 132\n  core_count: 1"), ':9:15: not a GpuTargetConfigProto'),
    (lambda t: t.replace("core_count: 132", "core_count: 4294967296"), "Value out of range"),
    (lambda t: t.replace("gpu_device_info {", "gpu_device_info {{"), ":2:18: not a GpuTargetConfigProto"),
    (lambda t: "platform_name: 'CUDA'\n", "no gpu_device_info"),
])
def test_a_config_is_parsed_as_the_proto_and_its_sizes_must_be_positive(tmp_path, edit, expect):
    from stagetool.plan.gpu_target_proto import read_target_config_file

    p = tmp_path / "c.txtpb"
    p.write_text(edit(H100))
    with pytest.raises(UsageError) as e:
        read_target_config_file(p)
    assert expect in e.value.message and e.value.exit_code == 2, e.value.message


def test_the_capacity_is_the_parsed_field_and_unknown_fields_are_left_to_xla(tmp_path):
    from stagetool.plan.gpu_target_proto import read_target_config_file

    p = tmp_path / "c.txtpb"
    p.write_text("# device_memory_size: 999999999999999\n" + H100.replace("85899345920", "1000")
                 + 'autotune_results { version: 3 results { device: "x" } }\n')
    cfg = read_target_config_file(p)
    assert cfg.memory_bytes == 1000 and cfg.device_description == "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "folder", "huge"])
def test_a_config_that_is_not_a_small_regular_file_is_refused_without_reading(tmp_path, kind):
    import time

    from stagetool.plan.gpu_target_proto import MAX_CONFIG_BYTES, read_target_config_file

    p = tmp_path / "c"
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "folder":
        p.mkdir()
    elif kind == "huge":
        p.write_text(H100 + "#" * MAX_CONFIG_BYTES)
    else:
        p = "/dev/zero"
    start = time.monotonic()
    with pytest.raises(UsageError) as e:
        read_target_config_file(p)
    assert time.monotonic() - start < 5
    assert {"fifo": "is a FIFO", "folder": "is a folder", "huge": "is larger than 4 MiB",
            "dev_zero": "is a character device"}[kind] in e.value.message


@pytest.mark.parametrize("name", ["h100:\uff18", "gpu:\u0668", "h100:" + "9" * 5000, "h100:9999x9999", "v5e:\uff12x\uff12",
                                  "v5e:" + "9" * 5000, "v5e:999x999", ""])
def test_topology_names_with_non_ascii_digits_or_huge_counts_are_refused(name):
    with pytest.raises(UsageError):
        parse_target(name)


@needs_plugin
def test_a_device_description_is_escaped_in_every_format(tmp_path, run_cli):
    hostile = 'NVIDIA <script>alert(1)</script> <img src=x onerror=alert(2)> [red]x[/red] `code` **b**'
    cfg = tmp_path / "c.txtpb"
    cfg.write_text(H100.replace('"NVIDIA H100 80GB HBM3"', '"' + hostile.replace('"', '\\"') + '"'))
    (tmp_path / "m.py").write_text("def f(x):\n    return x * 2\n")
    (tmp_path / "m.stagetool.yaml").write_text("mesh: {axes: {data: 2}}\nfunctions:\n  f: {target: m.py:f, args: ['f32[8]']}\n")
    for command in (("devices",), ("shardings", "--spec", tmp_path / "m.stagetool.yaml", "--mesh", "data=2")):
        for fmt in ("markdown", "html", "text"):
            r = run_cli(*command, "--topology", "gpu:2", "--gpu-target-config", cfg, "--format", fmt, check=0)
            if fmt == "text":
                assert "[red]x[/red]" in r.stdout  # shown as written, not read as Rich markup
            else:
                assert "<script>" not in r.stdout and "<img" not in r.stdout, (command, fmt)


def test_a_sweep_reads_the_gpu_target_config_before_any_configuration_runs(tmp_path, run_cli, monkeypatch):
    """threads_per_warp: 0 ended each configuration with SIGFPE inside XLA (error rows, exit 3); the
    sweep now reads the file first, as the other commands do (exit 2, no row)."""
    (tmp_path / "m.py").write_text("def g(x, mode):\n    return x * 2\n")
    (tmp_path / "s.yaml").write_text("functions:\n  g:\n    target: m.py:g\n    args: ['f32[8]']\n"
                                     "    static: {mode: ${mode}}\n")
    cfg = tmp_path / "warp0.txtpb"
    cfg.write_text(H100.replace("threads_per_warp: 32", "threads_per_warp: 0"))
    monkeypatch.chdir(tmp_path)
    r = run_cli("sweep", "m.py:g", "--spec", "s.yaml", "--set", "mode=a,b", "--topology", "gpu:2",
                "--gpu-target-config", cfg, "--output-dir", "rows", check=2)
    assert "threads_per_warp: 0 is not above 0" in r.stderr and not (tmp_path / "rows").exists()
