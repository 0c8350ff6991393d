"""How much slower is `stagetool report` than a bare script doing the same JAX calls?

Both run as whole processes on the same function and inputs (the bundled example and its spec):
the bare script builds the inputs itself, then `jax.jit(f).trace(...).lower()`, `.compile()`,
`as_text()` of both stages, `cost_analysis()` of both and `memory_analysis()`. Each is run
`--runs` times, alternating; the medians (wall and CPU seconds: on a shared machine the CPU time
is the steadier figure) and their ratio are printed. stagetool runs with ``--no-cache`` there: the
goal is a ratio ≤ 1.10, stagetool's own work (spec, rendering, HLO parsing) small next to JAX's.

``--all`` prints every figure of issue 11 in one run: the start-up time of ``--help`` and
``--version``, and of ``import jax`` alone (the floor under every staging command); ``report`` on the MLP and the transformer and ``memory`` (with the peak buffers: one
compile) on the transformer against the bare script; and a warm against a cold facts cache for
``snapshot`` on the transformer and on a compile-heavy 8B-parameter scanned decoder compiled for TPU
v5p:2x2x2 (bench/decoder.stagetool.yaml), checking that the snapshots are identical.

    python bench/bench_overhead.py [--runs 7] [--example mlp|transformer] [--no-bytecode]
    python bench/bench_overhead.py --memory [--runs 7]
    python bench/bench_overhead.py --all [--runs 5]
    python bench/bench_overhead.py --named [--runs 7]     # issue 48: the hardware named in pyproject.toml
    python bench/bench_overhead.py --against [--runs 7]   # issue 48: --against v5e:2x4
    python bench/bench_overhead.py --commands [--runs 5]  # issue 50: every staging command on the MLP

``--named``: ``stagetool report`` on the MLP in a copy of examples/ whose ``pyproject.toml`` says
``[tool.stagetool] topology = "v5e"`` (so the spec's 2x4 mesh is ``v5e:2x4``), against the bare script
compiling the same step for ``get_topology_desc("v5e:2x4")``'s devices (goal <= 1.10). ``--against``:
``stagetool report --against v5e:2x4`` against the bare script doing both compiles, the CPU mesh's
and v5e:2x4's (goal <= 1.10: one more compile, no more). Both need libtpu.

``--commands``: each staging command (``lower``, ``compile``, ``shardings``, ``collectives``, ``why``,
``cost``, ``memory``, ``modules``, ``report``, ``snapshot``) on the MLP, with ``--no-cache``, against the bare
script making the JAX calls it needs: ``lower`` against a script that traces and lowers only (no compile),
every other command against the script that compiles too (goal <= 1.10 each: issue 50's "every command").
Both bare scripts start the CPU backend alone (``jax_platforms=cpu``), as stagetool does for a CPU mesh:
where libtpu is installed, the plain bare script also pays JAX's failed TPU probe, which flatters stagetool.

``--no-bytecode`` runs both sides with ``PYTHONDONTWRITEBYTECODE=1`` and without stagetool's (and the
examples') ``__pycache__`` folders, as a CI container with an editable install does: every run then
compiles the stagetool modules it imports from source (the installed libraries keep their
bytecode). Without it the bench writes stagetool's bytecode first, as an installed package has it.
"""

from __future__ import annotations

import argparse
import compileall
import dataclasses
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BARE = {
    "mlp": textwrap.dedent("""
        import jax, jax.numpy as jnp, sys
        jax.config.update("jax_num_cpu_devices", 8)
        sys.path.insert(0, "examples")
        from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
        import mlp
        mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
        shapes = jax.eval_shape(lambda k: mlp.init_params(k, 512, 1024, 256), jax.random.key(0))
        specs = {"w1": P(None, "model"), "w2": P("model", None), "b1": P("model"), "b2": None}
        params = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=None if specs[k] is None else NamedSharding(mesh, specs[k]))
                  for k, v in shapes.items()}
        batch = {"x": jax.ShapeDtypeStruct((128, 512), jnp.float32, sharding=NamedSharding(mesh, P("data", None))),
                 "y": jax.ShapeDtypeStruct((128,), jnp.int32, sharding=NamedSharding(mesh, P("data")))}
        with jax.set_mesh(mesh):
            lowered = jax.jit(mlp.train_step, donate_argnums=(0,)).trace(params, batch).lower()
            compiled = lowered.compile()
        print(len(lowered.as_text()), len(compiled.as_text()), lowered.cost_analysis(), compiled.cost_analysis(),
              compiled.memory_analysis())
    """),
    "transformer": textwrap.dedent("""
        import functools, re, sys
        import jax, jax.numpy as jnp
        jax.config.update("jax_num_cpu_devices", 8)
        sys.path.insert(0, "examples")
        from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
        import transformer as model
        mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
        sizes = dict(vocab=1024, d_model=256, n_layers=2, d_ff=1024, max_seq=128)
        key = jax.random.key(0)
        def rule(path):
            if re.search(r"/layers/(wq|wk|wv|w_up)$", path): return P(None, None, "model")
            if re.search(r"/layers/(wo|w_down)$", path): return P(None, "model", None)
            if path.endswith("/embed"): return P("model", None)
            if path.endswith("/pos_embed"): return None
            return P()
        def place(tree, root):
            def one(kp, s):
                path = root + "/" + "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in kp)
                spec = rule(path)
                return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=None if spec is None else NamedSharding(mesh, spec))
            return jax.tree_util.tree_map_with_path(one, tree)
        params = place(jax.eval_shape(functools.partial(model.init_params, **sizes), key), "params")
        opt = place(jax.eval_shape(functools.partial(model.init_opt_state, **sizes), key), "opt_state")
        batch = {k: jax.ShapeDtypeStruct((16, 128), jnp.int32, sharding=NamedSharding(mesh, P("data", None)))
                 for k in ("tokens", "targets")}
        with jax.set_mesh(mesh):
            lowered = jax.jit(model.train_step, static_argnames=("n_heads",), donate_argnums=(0, 1)).trace(
                params, opt, batch, n_heads=4).lower()
            compiled = lowered.compile()
        print(len(lowered.as_text()), len(compiled.as_text()), lowered.cost_analysis(), compiled.cost_analysis(),
              compiled.memory_analysis())
    """),
}
STAGETOOL = {
    "mlp": [sys.executable, "-m", "stagetool", "report", "examples/mlp.py:train_step", "--format", "json",
            "-o", "/dev/null", "--no-cache"],
    "transformer": [sys.executable, "-m", "stagetool", "report", "examples/transformer.py:train_step", "--format",
                    "json", "-o", "/dev/null", "--no-cache"],
}
BARE_LOWER_MLP = BARE["mlp"].replace("    compiled = lowered.compile()\n", "").replace(
    "print(len(lowered.as_text()), len(compiled.as_text()), lowered.cost_analysis(), compiled.cost_analysis(),\n"
    "      compiled.memory_analysis())", "print(len(lowered.as_text()), lowered.cost_analysis())")
"""The bare MLP script without the compile: what ``stagetool lower`` asks of JAX."""
COMMANDS_MLP = {
    # command -> its argv after ``stagetool`` (every one with --no-cache and JSON to /dev/null)
    "lower": ["lower", "examples/mlp.py:train_step", "-o", "/dev/null"],
    "compile": ["compile", "examples/mlp.py:train_step", "-o", "/dev/null"],
    "shardings": ["shardings", "examples/mlp.py:train_step", "--format", "json", "-o", "/dev/null"],
    "collectives": ["collectives", "examples/mlp.py:train_step", "--format", "json", "-o", "/dev/null"],
    "why": ["why", "examples/mlp.py:train_step", "--leaf", "w1", "--format", "json", "-o", "/dev/null"],
    "cost": ["cost", "examples/mlp.py:train_step", "--format", "json", "-o", "/dev/null"],
    "memory": ["memory", "examples/mlp.py:train_step", "--format", "json", "-o", "/dev/null"],
    "modules": ["modules", "examples/mlp.py:train_step", "--format", "json", "-o", "/dev/null"],
    "report": ["report", "examples/mlp.py:train_step", "--format", "json", "-o", "/dev/null"],
    "snapshot": ["snapshot", "--spec", "examples/mlp.stagetool.yaml", "-o", "/dev/null"],
}
MEMORY_TRANSFORMER = [sys.executable, "-m", "stagetool", "memory", "examples/transformer.py:train_step", "--format",
                      "json", "-o", "/dev/null", "--no-cache"]
SNAPSHOT_SPECS = {
    "transformer": "examples/transformer.stagetool.yaml",
    # examples/transformer.py at 8B-parameter decoder sizes (32 layers under lax.scan), compiled for
    # v5p:2x2x2 (decoder_target): ~40 s on a 2-core VM
    "decoder-8b": "bench/decoder.stagetool.yaml",
}


ENV: dict[str, str] | None = None
"""The children's environment (None: this process's); ``--no-bytecode`` sets PYTHONDONTWRITEBYTECODE=1."""


@dataclasses.dataclass
class Timing:
    wall: float
    cpu: float  # user + system seconds of the child process


def timed(cmd: list[str]) -> Timing:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return Timing(wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))


def compare(label: str, a_name: str, a_cmd, b_name: str, b_cmd, runs: int, goal: str) -> tuple[float, float]:
    """Run ``a`` and ``b`` alternately ``runs`` times (after one warm-up each) and print medians and the
    ratio b/a. ``a_cmd``/``b_cmd`` are argv lists or callables returning one (a fresh cache folder)."""
    argv = (lambda c: c() if callable(c) else c)
    timed(argv(a_cmd)), timed(argv(b_cmd))  # warm the file cache (and fill a warm facts cache)
    a, b = [], []
    for _ in range(runs):
        a.append(timed(argv(a_cmd)))
        b.append(timed(argv(b_cmd)))
    med = lambda xs, f: statistics.median(getattr(x, f) for x in xs)  # noqa: E731
    ratio_wall, ratio_cpu = med(b, "wall") / med(a, "wall"), med(b, "cpu") / med(a, "cpu")
    print(f"{label}  ({runs} runs each, medians)")
    print(f"  {a_name:<28} wall {med(a, 'wall'):7.3f} s   cpu {med(a, 'cpu'):7.3f} s")
    print(f"  {b_name:<28} wall {med(b, 'wall'):7.3f} s   cpu {med(b, 'cpu'):7.3f} s")
    print(f"  ratio {b_name} / {a_name}: wall {ratio_wall:.3f}, cpu {ratio_cpu:.3f}   (goal {goal})")
    sys.stdout.flush()
    return ratio_wall, ratio_cpu


def snapshot_cmd(spec: str, cache: Path, out: Path, extra: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "stagetool", "snapshot", "--spec", spec, "--cache-dir", str(cache), "-o", str(out),
            *extra]


def decoder_target() -> tuple[str, ...]:
    """The decoder's compile target: the v5p:2x2x2 topology where libtpu is installed, else CPU devices."""
    from importlib.util import find_spec

    return ("--topology", "v5p:2x2x2") if find_spec("libtpu") is not None else ()


def warm_vs_cold(name: str, runs: int, goal: str, extra: tuple[str, ...] = ()) -> None:
    """``snapshot`` with an empty cache folder (cold: everything compiled) against one filled by an
    earlier run (warm: traced and lowered only); the two snapshots must be byte-identical."""
    spec = SNAPSHOT_SPECS[name]
    if extra:
        name = f"{name} ({' '.join(extra)})"
    with tempfile.TemporaryDirectory(prefix="stagetool-bench-") as tmp:
        root = Path(tmp)
        counter = iter(range(10**6))

        def cold() -> list[str]:
            i = next(counter)
            return snapshot_cmd(spec, root / f"cold-{i}", root / f"cold-{i}.json", extra)

        warm = snapshot_cmd(spec, root / "warm", root / "warm.json", extra)
        ratio_wall, ratio_cpu = compare(f"snapshot {name}: cold cache / warm cache", "warm", warm, "cold", cold,
                                        runs, goal)
        cold_out = (root / "cold-0.json").read_bytes()
        same = cold_out == (root / "warm.json").read_bytes()
        print(f"  warm snapshot identical to the cold one: {'yes' if same else 'NO'}")
        for p in root.glob("cold-*"):
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def startup(runs: int = 15) -> None:
    """``--help``, a subcommand's ``--help`` and ``--version``: medians of ``runs`` whole processes (goal < 0.2 s)."""
    print(f"start-up, no JAX  ({runs} runs each, medians; goal < 0.2 s)")
    for args in (["--help"], ["report", "--help"], ["--version"]):
        times = [timed([sys.executable, "-m", "stagetool", *args]).wall for _ in range(runs)]
        print(f"  stagetool {' '.join(args):<16} wall {statistics.median(times):7.3f} s")
    sys.stdout.flush()


def jax_import(runs: int = 7) -> None:
    """``import jax`` alone, as a whole process: the floor under every command that stages anything.

    On Python 3.11 (where numpy stops at 2.4) ml_dtypes 0.7.0 spends ~0.6 s registering its ufunc
    loops at import (measured here: 0.6-0.7 s, against 4 ms for ml_dtypes 0.6.0, and 28 ms for 0.7.0
    with numpy 2.5 on Python 3.12), which every warm run pays in full."""
    import importlib.metadata as md

    times = [timed([sys.executable, "-c", "import jax"]).wall for _ in range(runs)]
    print(f"import jax alone  ({runs} runs, median; numpy {md.version('numpy')}, ml_dtypes {md.version('ml_dtypes')})")
    print(f"  wall {statistics.median(times):7.3f} s")
    sys.stdout.flush()


TPU_MESH = """from jax.experimental import topologies, mesh_utils
from jax.sharding import Mesh
topo = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x4", chips_per_host_bounds=[2, 4, 1])
mesh = Mesh(mesh_utils.create_device_mesh((2, 4), topo.devices), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
"""
CPU_MESH = 'mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)\n'


def _bare_tpu(script: str, *, both: bool = False) -> str:
    """The bare MLP script compiling for v5e:2x4's compile-only devices (``both``: for the CPU mesh first too)."""
    assert CPU_MESH in script
    head, body = script.split(CPU_MESH, 1)
    # the CPU backend alone beside the compile-only devices, as stagetool starts it (no TPU probe, no CUDA plugin)
    head = head.replace('jax.config.update("jax_num_cpu_devices", 8)',
                        'jax.config.update("jax_num_cpu_devices", 8)\njax.config.update("jax_platforms", "cpu")')
    return head + ((CPU_MESH + body) if both else "") + TPU_MESH + body


def named_project() -> Path:
    """A temporary copy of examples/ with ``[tool.stagetool] topology = "v5e"`` in its pyproject.toml."""
    folder = Path(tempfile.mkdtemp(prefix="stagetool-named-"))
    shutil.copytree(ROOT / "examples", folder / "examples")
    (folder / ".git").mkdir()
    (folder / "pyproject.toml").write_text('[tool.stagetool]\ntopology = "v5e"\n')
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=None, help="runs of each command (default 7; 5 with --all)")
    parser.add_argument("--example", choices=sorted(BARE), default="mlp")
    parser.add_argument("--memory", action="store_true",
                        help="`memory` with the peak buffers on the transformer (one of --all's ratios) instead of `report`")
    parser.add_argument("--all", action="store_true", help="every ratio of issue 11, in one run")
    parser.add_argument("--named", action="store_true", help="issue 48: the hardware named in pyproject.toml")
    parser.add_argument("--against", action="store_true", help="issue 48: report --against v5e:2x4")
    parser.add_argument("--commands", action="store_true",
                        help="issue 50: every staging command on the MLP against the bare script it needs")
    parser.add_argument("--no-bytecode", action="store_true",
                        help="PYTHONDONTWRITEBYTECODE=1 and no stagetool bytecode, as a CI container with an editable "
                             "install runs (each run compiles the stagetool modules it imports)")
    args = parser.parse_args()
    if args.no_bytecode:
        global ENV
        ENV = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        for folder in ("stagetool", "examples"):
            for cache in (ROOT / folder).rglob("__pycache__"):
                shutil.rmtree(cache, ignore_errors=True)
        print("PYTHONDONTWRITEBYTECODE=1, no stagetool bytecode")
    else:
        # An installed package has its bytecode; a checkout run with PYTHONDONTWRITEBYTECODE=1
        # compiles every stagetool module it imports from source on each run (--no-bytecode).
        compileall.compile_dir(ROOT / "stagetool", quiet=1)
    if args.commands:
        runs = args.runs or 5
        assert BARE_LOWER_MLP != BARE["mlp"] and "compile()" not in BARE_LOWER_MLP
        cpu_only = ('jax.config.update("jax_num_cpu_devices", 8)',
                    'jax.config.update("jax_num_cpu_devices", 8)\njax.config.update("jax_platforms", "cpu")')
        for name, argv in COMMANDS_MLP.items():
            bare = (BARE_LOWER_MLP if name == "lower" else BARE["mlp"]).replace(*cpu_only)
            assert "jax_platforms" in bare
            compare(f"{name}, mlp (no cache)", "bare script" + (", lowering only" if name == "lower" else ""),
                    [sys.executable, "-c", bare], f"stagetool {name}",
                    [sys.executable, "-m", "stagetool", *argv, "--no-cache"], runs, "≤ 1.10")
        return
    if args.all:
        runs = args.runs or 5
        print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}; python "
              f"{platform.python_version()}")
        startup()
        jax_import()
        compare("report, mlp (no cache)", "bare script", [sys.executable, "-c", BARE["mlp"]], "stagetool report",
                STAGETOOL["mlp"], runs, "≤ 1.10")
        # stagetool's command line pauses Python's cyclic collector through start-up (core/gc_pause);
        # a bare script that does the same shows what stagetool's own work costs apart from that
        compare("report, mlp (no cache), against a bare script that pauses the collector too", "bare script, gc paused",
                [sys.executable, "-c", "import gc\ngc.disable()\n" + BARE["mlp"] + "gc.freeze()\n"],
                "stagetool report", STAGETOOL["mlp"], runs, "information")
        compare("report, transformer (no cache)", "bare script", [sys.executable, "-c", BARE["transformer"]],
                "stagetool report", STAGETOOL["transformer"], runs, "≤ 1.10")
        compare("memory, transformer (no cache; with the peak buffers)", "bare script",
                [sys.executable, "-c", BARE["transformer"]], "stagetool memory", MEMORY_TRANSFORMER, runs, "≤ 1.10")
        warm_vs_cold("transformer", runs, "≥ 2.5")
        # its cold run compiles for ~40 s: fewer runs keep the bench under half an hour
        warm_vs_cold("decoder-8b", min(runs, 3), "≥ 5", decoder_target())
        return
    runs = args.runs or 7
    if args.named or args.against:
        folder = named_project()
        bare = textwrap.dedent(BARE["mlp"]).replace('sys.path.insert(0, "examples")',
                                                    f'sys.path.insert(0, {str(folder / "examples")!r})')
        report = [sys.executable, "-m", "stagetool", "report", str(folder / "examples/mlp.py") + ":train_step",
                  "--format", "json", "-o", "/dev/null", "--no-cache"]
        if args.named:
            compare("report, mlp, v5e named in pyproject.toml (no cache)", "bare script on v5e:2x4",
                    [sys.executable, "-c", _bare_tpu(bare)], "stagetool report (named)", report, runs, "<= 1.10")
        if args.against:
            (folder / "pyproject.toml").unlink()
            compare("report --against v5e:2x4, mlp (no cache)", "bare script, CPU + v5e:2x4",
                    [sys.executable, "-c", _bare_tpu(bare, both=True)], "stagetool report --against",
                    report + ["--against", "v5e:2x4"], runs, "<= 1.10")
        shutil.rmtree(folder, ignore_errors=True)
        return
    if args.memory:
        compare("memory, transformer (no cache; with the peak buffers)", "bare script",
                [sys.executable, "-c", BARE["transformer"]], "stagetool memory", MEMORY_TRANSFORMER, runs, "≤ 1.10")
        return
    compare(f"example: {args.example}", "bare script", [sys.executable, "-c", BARE[args.example]],
            "stagetool report", STAGETOOL[args.example], runs, "≤ 1.10")


if __name__ == "__main__":
    main()
