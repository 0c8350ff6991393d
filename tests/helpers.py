"""Shared test helpers: run the CLI in-process or in a fresh process, and keep user imports from leaking.

Import from a test module as ``from helpers import ...`` (pytest puts ``tests/`` on ``sys.path``).
The fixtures here are re-exported by importing them into the test module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"

#: The environment every CLI run sees: fixed width, no colour.
CLI_ENV = {"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}


@dataclasses.dataclass(frozen=True)
class Result:
    """What one CLI run produced: exit code, stdout and stderr, kept apart."""

    code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)


@pytest.fixture
def isolated_imports():
    """Restore ``sys.path`` and drop modules imported from folders the test added to it.

    stagetool puts a target file's folder on ``sys.path`` and imports it (like pytest); without
    this, a ``model.py`` from one test's ``tmp_path`` would shadow another's.
    """
    path_before = list(sys.path)
    modules_before = set(sys.modules)
    yield
    added = [p for p in sys.path if p not in path_before]
    sys.path[:] = path_before
    for name in set(sys.modules) - modules_before:
        mod = sys.modules.get(name)
        file = getattr(mod, "__file__", None) or ""
        if any(file.startswith(str(Path(p).resolve())) or file.startswith(p) for p in added if p):
            del sys.modules[name]


@contextlib.contextmanager
def cli_environment(folder: Path):
    """For a module-scoped fixture running ``stagetool.cli.main`` in this process (no ``monkeypatch``
    there): :data:`CLI_ENV` set, and on the way out ``sys.path`` restored and the modules imported
    from ``folder`` (the targets' folder) dropped. Yields a ``pytest.MonkeyPatch`` for more changes."""
    path_before, modules_before = list(sys.path), set(sys.modules)
    try:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in CLI_ENV.items():
                mp.setenv(k, v)
            yield mp
    finally:
        sys.path[:] = path_before
        for name in set(sys.modules) - modules_before:
            if (getattr(sys.modules.get(name), "__file__", None) or "").startswith(str(folder)):
                del sys.modules[name]


@pytest.fixture
def mlp_copy(tmp_path, monkeypatch, isolated_imports):
    """A copy of examples/mlp.py and its spec in a temporary folder, which is the working directory."""
    import shutil

    for name in ("mlp.py", "mlp.stagetool.yaml"):
        shutil.copy(EXAMPLES / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def run_cli(capsys, monkeypatch, isolated_imports):
    """``run_cli(*args, check=None) -> Result``: ``stagetool.cli.main`` in this process.

    Rich's width and colour are fixed through ``COLUMNS``/``NO_COLOR``. With ``check`` the exit
    code is asserted, and the output is shown on failure.
    """
    for k, v in CLI_ENV.items():
        monkeypatch.setenv(k, v)

    def run(*args: str, check: int | None = None) -> Result:
        from stagetool.cli import main

        capsys.readouterr()  # drop anything printed before
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        result = Result(code, out, err)
        if check is not None:
            assert code == check, f"exit {code} != {check}\nstdout:\n{out}\nstderr:\n{err}"
        return result

    return run


#: Commands with no ``--cache-dir``: :func:`run_cli_shared` runs them as :func:`run_cli` does.
_NO_FACTS_CACHE = ("sweep", "devices", "diff", "--help", "-h", "--version")


@pytest.fixture(scope="session")
def shared_facts_cache(tmp_path_factory) -> Path:
    """One facts cache folder for the whole session (one per pytest-xdist worker), for
    :func:`run_cli_shared`: a program compiled by one test is read back by the others."""
    return tmp_path_factory.mktemp("shared-facts-cache")


@pytest.fixture
def run_cli_shared(run_cli, shared_facts_cache):
    """``run_cli_shared(*args, check=None) -> Result``: :func:`run_cli` with ``--cache-dir`` set to the
    session's :func:`shared_facts_cache`.

    The first run of a program (the same lowered module, devices and compile options: a bundled
    example on one mesh or target) compiles it; every later run of it in the session, by any command
    in any format, reads the compiled facts back instead of compiling again (with the peak dump when
    one run asked for it). The report is the compile's except ``cached: true`` and no compile time
    (``· compile (cached)`` in text). Use it where a test reads figures, shardings, collectives or
    memory of a program it does not change; keep :func:`run_cli` for a test about compiling (its
    timings, warnings, failures), about the cache itself, or one that patches stagetool. Arguments
    that choose the cache (``--no-cache``, ``--cache-dir``), and commands without a facts cache
    (``sweep``: each configuration in a process of its own; ``devices``, ``diff``), are left alone.
    """

    def run(*args: str, check: int | None = None) -> Result:
        own = any(str(a) == "--no-cache" or str(a).startswith("--cache-dir") for a in args)
        uncached = not args or str(args[0]) in _NO_FACTS_CACHE
        return run_cli(*args, *(() if own or uncached else ("--cache-dir", shared_facts_cache)), check=check)

    return run


@contextlib.contextmanager
def signals_at_default():
    """SIGHUP, SIGINT and SIGQUIT as a terminal's foreground job has them, in the processes started
    inside the block.

    A suite started under nohup passes SIGHUP down ignored, and one started as a background job of a
    non-interactive shell (``cmd &``, as CI runners and ``setsid bash -c ... &`` do) SIGINT and SIGQUIT;
    an ignored signal is inherited across exec, and stagetool rightly keeps an ignored signal ignored,
    so a test that signals its run would see the signal ignored (exit 0, or a 60 s timeout). Set in the
    test process around the start, not in a ``preexec_fn``: that forks a process JAX has made
    multithreaded (a RuntimeWarning, an error under this suite's filterwarnings). Only ignored signals
    are touched; a child gets SIG_DFL for a Python handler (``default_int_handler``) across exec.
    """
    saved = {}
    for sig, default in ((signal.SIGHUP, signal.SIG_DFL), (signal.SIGINT, signal.default_int_handler),
                         (signal.SIGQUIT, signal.SIG_DFL)):
        if signal.getsignal(sig) == signal.SIG_IGN:
            saved[sig] = signal.signal(sig, default)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def run_subprocess(*args: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 120,
                   python_args: tuple[str, ...] = ()) -> Result:
    """``python -m stagetool ARGS`` in a fresh process (no conftest: JAX starts as a user's would)."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    full_env.update(CLI_ENV)
    full_env["PYTHONPATH"] = str(REPO)
    full_env.setdefault("JAX_PLATFORMS", "cpu")
    if env:
        full_env.update(env)
    proc = subprocess.run([sys.executable, *python_args, "-m", "stagetool", *map(str, args)],
                          capture_output=True, text=True, env=full_env, cwd=str(cwd or REPO), timeout=timeout)
    return Result(proc.returncode, proc.stdout, proc.stderr)


def import_afresh(module: str, folder: Path | None = None) -> None:
    """Have the next import of ``module`` (a file of ``folder``, the working directory by default, that
    a test edited) read its source, as the fresh process CI runs ``check`` in would: drop it from
    ``sys.modules`` and its bytecode from ``folder/__pycache__``. Python takes a cached entry as valid
    while the source's whole-second mtime and size match it: an edit to the same size within the second
    the first run imported the file would be read from the stale entry."""
    sys.modules.pop(module, None)
    for cached in ((folder or Path.cwd()) / "__pycache__").glob(f"{module}.*.pyc"):
        cached.unlink(missing_ok=True)


def write(folder: Path, name: str, text: str) -> Path:
    """Write dedented ``text`` to ``folder/name`` and return the path."""
    p = folder / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(textwrap.dedent(text).lstrip("\n"))
    return p


def leaves_by_path(doc: dict, key: str = "inputs", function: int = 0) -> dict[str, dict]:
    """``{path: leaf}`` of a JSON report's inputs or outputs."""
    return {leaf["path"]: leaf for leaf in doc["functions"][function][key]}


def memory_of(run_cli, target: str, *extra: str, topology: str | None = None, mesh: str | None = None) -> dict:
    """``stagetool memory TARGET --no-peak --format json [--topology T] [--mesh M] EXTRA...`` through
    ``run_cli`` (exit 0): the report's first function, asserted to have no error."""
    args = ["memory", target, "--no-peak", "--format", "json", *extra]
    args += [*(["--topology", topology] if topology else []), *(["--mesh", mesh] if mesh else [])]
    (f, *_) = run_cli(*args, check=0).json()["functions"]
    assert f.get("error") is None
    return f


def target_devices(topology: str | None) -> list:
    """The devices a raw-JAX reference compiles for: the first 8 simulated CPU devices for None, else
    the compile-only devices of ``topology`` (``v5e:2x4``, ``h100:8``) as stagetool builds them;
    skips the test where libtpu or JAX's CUDA plugin is not installed."""
    import jax

    from stagetool.devices import gpu_topology, tpu_topology
    from stagetool.plan.target import parse_target

    if topology is None:
        return jax.devices()[:8]
    if topology.startswith("h100"):
        if not gpu_topology.cuda_plugin_available():
            pytest.skip("JAX's CUDA plugin is not installed: pip install -e '.[gpu-aot]'")
        return list(gpu_topology.gpu_topology(parse_target(topology)).devices)
    if not tpu_topology.libtpu_available():
        pytest.skip("libtpu not installed: pip install -e '.[tpu]'")
    return list(tpu_topology.tpu_topology(parse_target(topology)).devices)


def assert_memory_is_xlas(record: dict, compiled: Any) -> None:
    """The four memory figures of a report's ``memory.record`` equal XLA's ``memory_analysis()`` of
    ``compiled`` (a ``jax.stages.Compiled`` of the same step): argument, output, alias, temp bytes."""
    mem = compiled.memory_analysis()
    assert (record["argument_bytes"], record["output_bytes"], record["alias_bytes"], record["temp_bytes"]) == \
        (mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.alias_size_in_bytes, mem.temp_size_in_bytes)

def raw_collective_kinds(compiled: Any) -> Counter:
    """Raw JAX's collectives of ``compiled`` (a ``jax.stages.Compiled``) by kind, read from its
    ``as_text()``: one per channel id (XLA:TPU splits an async collective over continuation fusions
    that share it), an ``all-reduce`` inside TPU's ``all-reduce-scatter`` fusion being the
    ``reduce-scatter`` it implements."""
    kinds: dict[str, str] = {}
    computation = ""
    for line in compiled.as_text().splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            computation = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
            continue
        m = re.search(r"\s(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(.*?"
                      r"channel_id=(\d+)", line)
        if m:
            kind = m[1]
            if kind == "all-reduce" and computation.lstrip("%").startswith("all-reduce-scatter"):
                kind = "reduce-scatter"
            kinds[m[2]] = kind
    return Counter(kinds.values())


def assert_figures_are_raw_jaxs(fn: dict, compiled: Any) -> None:
    """A JSON report's function (``doc["functions"][i]``) has raw JAX's figures for ``compiled``, the
    same step compiled by ``jax.jit(...).lower(...).compile()`` for the same devices: argument,
    output, alias and temp bytes, FLOPs per device (where XLA reports them: XLA:GPU does not),
    the collectives by kind, and each input and output leaf's compiled PartitionSpec, in order."""
    mem = compiled.memory_analysis()
    rec = fn["memory"]["record"]
    assert (rec["argument_bytes"], rec["output_bytes"], rec["alias_bytes"], rec["temp_bytes"]) == (
        mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.alias_size_in_bytes, mem.temp_size_in_bytes)
    cost = compiled.cost_analysis()
    if cost and "flops" in cost:
        assert fn["cost"]["per_device"]["flops"] == cost["flops"]
    assert Counter(i["collective"]["kind"] for i in fn["collectives"]["items"]) == raw_collective_kinds(compiled)

    def spec(s: Any) -> list[str]:  # "P('a', None)" and PartitionSpec('a',) alike, trailing Nones dropped
        parts = re.findall(r"\([^()]*\)|'[^']*'|None", str(s)[2:-1])
        while parts and parts[-1] == "None":
            parts.pop()
        return parts

    raw_in = [s.spec for s in jax_tree_leaves(compiled.input_shardings)]
    if len(raw_in) == len(fn["inputs"]):  # jax.jit lists a pruned input too; an nnx.jit step does not
        raw_in = [s for s, leaf in zip(raw_in, fn["inputs"]) if not leaf["unused"]]
    assert [spec(leaf["compiled"]) for leaf in fn["inputs"] if not leaf["unused"]] == [spec(s) for s in raw_in]
    assert [spec(leaf["compiled"]) for leaf in fn["outputs"]] == [
        spec(s.spec) for s in jax_tree_leaves(compiled.output_shardings)]


def raw_module(path: Path, name: str):
    """The program at ``path`` imported as a module of its own (``_raw_<name>``), not through
    ``sys.path``: the raw-JAX side of a comparison, as the program's own script would run it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_raw_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def report_as_raw_jax_compiles_it(run_cli, folder: Path, program: str, function: str, topology: str | None,
                                  raw_compile) -> tuple[dict, Any]:
    """A program of ``tests/data`` staged by the CLI and compiled by raw JAX, figure by figure.

    Copies ``tests/data/<program>.py`` and its ``<program>.stagetool.yaml`` into ``folder`` (the
    working directory: the caller chdirs there), runs ``stagetool report <program>.py:<function>
    --no-peak --format json`` (with ``--topology`` unless ``topology`` is None: the 8 simulated CPU
    devices), and compiles the same step with ``raw_compile(module, devices)`` (the program imported
    with :func:`raw_module`, the devices of :func:`target_devices`), a ``jax.stages.Compiled``.
    Asserts the report has no error, is on the devices' platform and has raw JAX's figures
    (:func:`assert_figures_are_raw_jaxs`). Returns the report's function and the compiled step, for
    the program's own checks."""
    import shutil

    for name in (f"{program}.py", f"{program}.stagetool.yaml"):
        shutil.copy(REPO / "tests" / "data" / name, folder / name)
    devices = target_devices(topology)
    args = ["report", f"{program}.py:{function}", "--no-peak", "--format", "json"]
    doc = run_cli(*args, *(["--topology", topology] if topology else []), check=0).json()
    (fn,) = doc["functions"]
    assert fn["error"] is None and fn["mesh"]["platform"] == devices[0].platform
    compiled = raw_compile(raw_module(folder / f"{program}.py", program), devices)
    compiled = getattr(compiled, "compiled", compiled)  # Equinox's wrapper around JAX's Compiled
    assert_figures_are_raw_jaxs(fn, compiled)
    return fn, compiled


#: The head of a model module written by tests/inputs/test_own_mesh*.py: a Flax NNX two-layer MLP whose
#: kernels are annotated (fsdp, tensor) and (tensor, fsdp), and the start of ``build(devices, fsdp,
#: tensor)``: the module's own (fsdp, tensor) mesh over ``devices`` and the model built abstractly on it
#: (``mesh``, ``abstract``); the test's text goes on in ``build``'s body.
NNX_FSDP_TENSOR_MODULE = '''import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


class M(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.lin = nnx.Linear(256, 512, kernel_init=nnx.with_partitioning(init, ("fsdp", "tensor")), rngs=rngs)
        self.out = nnx.Linear(512, 256, kernel_init=nnx.with_partitioning(init, ("tensor", "fsdp")), rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.lin(x)))


def build(devices, fsdp=4, tensor=2):
    mesh = Mesh(mesh_utils.create_device_mesh((fsdp, tensor), devices), ("fsdp", "tensor"))
    with jax.set_mesh(mesh):
        abstract = nnx.eval_shape(lambda: M(nnx.Rngs(0)))
'''


def jax_tree_leaves(tree: Any) -> list:
    import jax

    return jax.tree.leaves(tree)


# ---- the program of issue 22's causes, shared by tests/analysis/test_causes.py and test_cli_causes.py ----

#: Why some causes tests hold before jax 0.12 only (a gap, not a choice).
JAXLIB_0_12_METADATA = ("jaxlib 0.12's partitioner gives a collective it inserts the parameter's metadata, not "
                        "the op's: the causes cannot be read back")

#: ``three``: ``h = tanh(x @ w1); h = wsc(h, P('data', None)); h @ w2``; ``fsdp``: ``tanh(x @ w)``.
CAUSES_MODEL = """\
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def three(x, w1, w2):
    h = jnp.tanh(x @ w1)
    h = jax.lax.with_sharding_constraint(h, P('data', None))
    return h @ w2


def fsdp(x, w):
    return jnp.tanh(x @ w)
"""

#: ``three`` on a 2×4 ``data × model`` mesh: x ``P('data', None)``, w1 ``P(None, 'model')``, w2 ``P('model', None)``.
CAUSES_SPEC = """\
version: 1
mesh:
  axes: {data: 2, model: 4}
functions:
  three:
    target: model.py:three
    args:
      - 'f32[16,32] @ [data, null]'
      - 'f32[32,64] @ [null, model]'
      - 'f32[64,32] @ [model, null]'
"""
