"""The test command: the whole suite with the JAX installed here, then the version-sensitive part of
it on the other supported JAX releases, each in a virtual environment of its own.

This is what the README's test command and ``.ci/run`` run::

    .venv/bin/python tests/matrix.py [PYTEST ARGS...]

1. ``python -m pytest`` with this interpreter: the whole suite, on whatever jax pip installed here
   (0.10.2 on Python 3.11, the newest JAX that supports 3.11).
2. For every release of :data:`LEGS` other than the one installed here: a virtual environment
   ``.venv-<leg>`` in the checkout (git-ignored; made on first use, pip run again only when
   ``pyproject.toml`` or the pins changed), with stagetool installed editable, that JAX pinned, the ``test`` extra without Ray
   and the ``flax``/``equinox`` extras (no ``tpu`` extra: libtpu is ~700 MB per release, so the
   compile-only TPU tests run in step 1 only); then pytest on :data:`LEG_TESTS` there: the CLI,
   framework, golden and JAX-compatibility tests. The environments are made (or brought up to date)
   in the background while step 1 runs, one at a time, their pip output shown before their leg's run.

Each run spreads its tests over parallel workers (pytest-xdist, in the ``test`` extra):
``-n <workers> --dist loadfile``, one worker per CPU this process may use (a test file stays on one
worker, so its module fixtures are built once). ``STAGETOOL_TEST_WORKERS=1`` runs serially, ``=4``
four workers; PYTEST ARGS with ``-n``/``--numprocesses``, ``--dist``, ``-p no:xdist``, ``--pdb`` or
``-s`` leave the choice to them (serial unless they say ``-n``). A run without pytest-xdist installed
runs serially.

Before each run, stagetool's bytecode is written with that run's interpreter (``compileall``), so
that the CLI processes the tests start do not each compile it from source.

PYTEST ARGS go to every run (``-x``, ``-k golden``). ``STAGETOOL_MATRIX`` picks the runs: ``all``
(default), ``here`` (step 1 only), or leg names, comma-separated (``jax07,jax012``: those legs
only). A leg whose Python is not on the machine fails the matrix (say so with ``STAGETOOL_MATRIX``
rather than have it pass silently). pytest's exit code 5 (nothing collected) fails a run unless
PYTEST ARGS chose the tests (``-k``, ``-m`` or paths), where it means "none of these here".

The whole-suite run (step 1, nothing chosen by PYTEST ARGS: no ``-k``, ``-m``, paths, ``--fast``,
``-x``) records each test's CPU and wall seconds (``--record-durations``, tests/durations.py) and
writes them to ``tests/durations.json``, the table the fast lane (``pytest --fast``) reads, and says
how many tests are over the fast lane's budget and which files cost the most CPU (commit the
refreshed table with the change that made a test slower or faster).

Ends with one line per run (release, Python, passed/failed/skipped, seconds) and exits 0 only
when every run passed.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Leg:
    """One JAX release of the matrix.

    Attributes:
      name: ``jax07``: the virtual environment is ``.venv-<name>``.
      python: the Python ``major.minor`` it runs on.
      pins: pip requirements that fix the release (``jax==0.7.2``, ``jaxlib==0.7.2``).
    """

    name: str
    python: str
    pins: tuple[str, ...]

    @property
    def jax(self) -> str:
        return next(p.split("==", 1)[1] for p in self.pins if p.startswith("jax=="))

    @property
    def venv(self) -> Path:
        return REPO / f".venv-{self.name}"


#: The supported range's oldest and newest releases, and the one the full suite runs on in CI.
LEGS = (
    Leg("jax07", "3.11", ("jax==0.7.2", "jaxlib==0.7.2")),
    Leg("jax010", "3.11", ("jax==0.10.2", "jaxlib==0.10.2")),
    Leg("jax012", "3.12", ("jax==0.12.0.1", "jaxlib==0.12.0.1")),
)

#: What runs on the releases other than the one installed here (paths relative to the checkout).
LEG_TESTS = ("tests/cli/test_cli.py", "tests/cli/test_cli_collectives.py", "tests/cli/test_cli_cost_memory.py",
             "tests/cli/test_cli_gate.py", "tests/cli/test_cli_plain_console.py", "tests/cli/test_cli_robustness.py",
             "tests/inputs/test_frameworks.py", "tests/test_golden.py", "tests/staging/test_compat.py",
             "tests/analysis/test_peak.py")

#: pytest's "no tests were collected".
NO_TESTS = 5


def find_python(version: str) -> str | None:
    """An interpreter of ``version`` (``3.12``): ``python3.12`` on PATH if it runs (a pyenv shim of a
    version that is not active does not), else pyenv's own copy; None when there is none."""
    candidates = [shutil.which(f"python{version}")]
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates += sorted(glob.glob(os.path.join(root, "versions", f"{version}.*", "bin", f"python{version}")),
                         reverse=True)
    for c in candidates:
        if not c:
            continue
        try:
            out = subprocess.run([c, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=60)
        except OSError:
            continue
        if out.returncode == 0 and out.stdout.strip() == version:
            return c
    return None


def leg_requirements() -> list[str]:
    """The ``test`` extra's requirements without Ray (only the sweep's Ray test uses it, and it is not
    in :data:`LEG_TESTS`)."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return [r for r in extras["test"] if not r.startswith("ray")]


def prepare(leg: Leg, log: IO[str] | None = None) -> str:
    """The leg's virtual environment, made if missing and brought to its pins; its ``python``.

    What it says, and pip's own output, go to ``log`` (a file) when given, else to this terminal."""
    out = {"stdout": log, "stderr": subprocess.STDOUT} if log is not None else {}
    py = leg.venv / "bin" / "python"
    if not py.exists():
        base = find_python(leg.python)
        if base is None:
            raise RuntimeError(f"no Python {leg.python} on this machine for jax {leg.jax} (pyenv install "
                               f"{leg.python}, or leave the leg out: STAGETOOL_MATRIX=here)")
        print(f"matrix: making {leg.venv.name} (Python {leg.python}, jax {leg.jax})", file=log or sys.stdout,
              flush=True)
        subprocess.run([base, "-m", "venv", str(leg.venv)], check=True, **out)
        subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--upgrade", "pip"], check=True, **out)
    requirements = ["-e", ".[flax,equinox]", *leg.pins, *leg_requirements()]
    stamp = leg.venv / "stagetool-matrix.stamp"  # what was installed: skip pip when nothing changed
    want = hashlib.sha256("\n".join([*requirements, (REPO / "pyproject.toml").read_text()]).encode()).hexdigest()
    if not stamp.exists() or stamp.read_text() != want:
        print(f"matrix: installing stagetool into {leg.venv.name} ({', '.join(leg.pins)})", file=log or sys.stdout,
              flush=True)
        subprocess.run([str(py), "-m", "pip", "install", "--quiet", *requirements], check=True, cwd=REPO, **out)
        stamp.write_text(want)
    return str(py)


@dataclasses.dataclass
class Setup:
    """A leg's :func:`prepare`, run in the background: its ``python`` or the error, how long it took,
    and what it printed."""

    python: str | None
    error: str | None
    seconds: float
    output: str


def prepare_quietly(leg: Leg) -> Setup:
    """:func:`prepare` with its output kept (for a background thread: it does not interleave with the
    suite's)."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        try:
            python, error = prepare(leg, log), None
        except (RuntimeError, subprocess.CalledProcessError) as e:
            python, error = None, str(e)
        log.seek(0)
        return Setup(python, error, time.perf_counter() - start, log.read())


@dataclasses.dataclass
class Outcome:
    label: str
    code: int | None
    counts: str
    seconds: float
    note: str = ""


def workers() -> int:
    """How many pytest-xdist workers a run gets: ``STAGETOOL_TEST_WORKERS``, else one per CPU this
    process may use (``os.sched_getaffinity``: a container's limit, not the host's count)."""
    raw = os.environ.get("STAGETOOL_TEST_WORKERS", "").strip()
    if raw:
        try:
            n = int(raw)
        except ValueError:
            raise SystemExit(f"matrix: STAGETOOL_TEST_WORKERS={raw!r} is not a whole number of workers "
                             "(1: serial)") from None
        return max(n, 1)
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # not Linux
        return max(os.cpu_count() or 1, 1)


#: pytest arguments after which the matrix does not add ``-n``: the caller chose the workers, or
#: wants one process (a debugger, captured output shown live).
_OWN_WORKERS = ("-n", "--numprocesses", "--dist", "--pdb", "--trace", "-s", "--capture=no", "no:xdist")


def parallel_args(python: str, user_args: list[str], n: int | None = None) -> list[str]:
    """``-n N --dist loadfile`` for a run with ``python``, or nothing: one worker, the caller's own
    choice in ``user_args`` (:data:`_OWN_WORKERS`), or no pytest-xdist in that environment."""
    n = workers() if n is None else n
    own = ("-n", "--numprocesses=", "--dist=", "-pno:xdist")
    if n <= 1 or any(a in _OWN_WORKERS or a.startswith(own) for a in user_args):
        return []
    return ["-n", str(n), "--dist", "loadfile"] if has_xdist(python) else []


@functools.cache
def has_xdist(python: str) -> bool:
    """Whether pytest-xdist imports in the environment of ``python``."""
    return subprocess.run([python, "-c", "import xdist"], capture_output=True).returncode == 0


def run_pytest(label: str, python: str, args: list[str], user_args: list[str],
               durations: Path | None = None) -> Outcome:
    """pytest in a fresh process (its workers spread by :func:`parallel_args`), its output passed
    through; the summary line kept. With ``durations``, the run records each test's CPU and wall
    seconds there (tests/durations.py)."""
    args = [*parallel_args(python, user_args), *args]
    if durations is not None:
        args.append(f"--record-durations={durations}")
    print(f"\nmatrix: {label}: pytest {' '.join(args + user_args)}", flush=True)
    start = time.perf_counter()
    # stagetool's bytecode, written once: the suite starts the CLI in a few hundred processes, and
    # where PYTHONDONTWRITEBYTECODE is set (CI images often set it) each would compile every module
    # from source again (~0.2 s of CPU a process). Python reads existing .pyc files all the same.
    subprocess.run([python, "-m", "compileall", "-q", str(REPO / "stagetool")], cwd=REPO, capture_output=True)
    proc = subprocess.Popen([python, "-m", "pytest", *args, *user_args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    last = ""
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        if re.search(r"\d+ (passed|failed|error|skipped|deselected)|no tests ran", line):
            last = line
    code = proc.wait()
    seconds = time.perf_counter() - start
    counts = ", ".join(re.findall(r"\d+ \w+", last.split(" in ")[0])) if last else ""
    note = ""
    if code == NO_TESTS and _selects(user_args):
        code, note = 0, "none of the selected tests are in this run"
    return Outcome(label, code, counts or "nothing collected", seconds, note)


#: pytest arguments after which a run is not the whole suite (its durations are not the table's).
_PARTIAL = ("-k", "-m", "-x", "--exitfirst", "--maxfail", "--fast", "--lf", "--last-failed", "--ff", "--sw",
            "--stepwise", "--deselect", "--ignore")


def whole_suite(user_args: list[str]) -> bool:
    """Whether a run with ``user_args`` runs every test (so that its durations can replace the table)."""
    return not _selects(user_args) and not any(a.startswith(_PARTIAL) for a in user_args)


def write_durations(recorded: Path, table: Path) -> None:
    """Replace ``table`` by the run's ``recorded`` durations, and name the tests over the fast
    lane's budget that no marker leaves out (tests/durations.py)."""
    import json

    here = str(Path(__file__).resolve().parent)  # tests/: durations.py beside this file
    sys.path.insert(0, here)
    try:
        import durations
    finally:
        sys.path.remove(here)
    doc = json.loads(recorded.read_text())
    shutil.copyfile(recorded, table)
    over = [(cpu, node) for node, (cpu, _) in doc["tests"].items() if cpu > durations.FAST_BUDGET_S]
    print(f"\nmatrix: wrote {table.relative_to(REPO)}: {len(doc['tests'])} tests, {doc['total_cpu_s']:.0f} CPU s; "
          f"{len(over)} over the fast lane's {durations.FAST_BUDGET_S:g} CPU s (left out of pytest --fast)",
          flush=True)
    for name, (cpu, wall, n) in list(doc["files"].items())[:8]:
        print(f"  {cpu:7.1f} CPU s {wall:7.1f} s wall  {n:4d} tests  {name}")


def _selects(user_args: list[str]) -> bool:
    """Whether the caller's pytest arguments chose tests (so that a run may legitimately find none)."""
    return any(a in ("-k", "-m") or a.startswith(("-k", "-m")) or os.path.exists(REPO / a.split("::")[0])
               for a in user_args)


def installed_jax(python: str) -> str:
    out = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('jax'))"],
                         capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else "?"


def main(argv: list[str]) -> int:
    choice = os.environ.get("STAGETOOL_MATRIX", "all").strip() or "all"
    names = {leg.name for leg in LEGS}
    wanted = set(choice.split(",")) if choice not in ("all", "here") else set()
    if wanted - names:
        print(f"matrix: STAGETOOL_MATRIX={choice}: unknown leg {', '.join(sorted(wanted - names))}; "
              f"use all, here, or some of {', '.join(sorted(names))}", file=sys.stderr)
        return 2
    here = installed_jax(sys.executable)
    py_here = "%d.%d" % sys.version_info[:2]
    outcomes: list[Outcome] = []
    legs = [] if choice == "here" else [leg for leg in LEGS if (leg.name in wanted if wanted else leg.jax != here)]
    # The legs' virtual environments are made (pip: mostly download and unpacking) while the whole
    # suite runs, one after the other in one background thread, each one's output kept for later.
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="matrix-setup")
    setups = {leg.name: pool.submit(prepare_quietly, leg) for leg in legs}
    try:
        if not wanted:
            record = Path(tempfile.mkdtemp(prefix="stagetool-durations-")) / "durations.json"
            outcomes.append(run_pytest(f"jax {here} (here), Python {py_here}: the whole suite", sys.executable, [],
                                       argv, durations=record))
            if whole_suite(argv) and record.exists() and outcomes[-1].code in (0, 1):
                write_durations(record, REPO / "tests" / "durations.json")
        for leg in legs:
            label = f"jax {leg.jax}, Python {leg.python}: CLI, framework, golden, compat tests"
            waited = time.perf_counter()
            setup = setups[leg.name].result()
            waited = time.perf_counter() - waited
            sys.stdout.write(setup.output)
            took = f"setup {setup.seconds:.0f} s" + ("" if wanted else f", {waited:.0f} s of it after the suite")
            if setup.error is not None:
                outcomes.append(Outcome(label, None, "not run", setup.seconds, f"{setup.error}; {took}"))
                continue
            got = installed_jax(setup.python)
            if got != leg.jax:
                outcomes.append(Outcome(label, None, "not run", setup.seconds,
                                        f"{leg.venv.name} has jax {got}, not {leg.jax}"))
                continue
            o = run_pytest(label, setup.python, list(LEG_TESTS), argv)
            o.note = "; ".join(x for x in (o.note, took) if x)
            outcomes.append(o)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    print("\nmatrix summary:")
    for o in outcomes:
        status = "ok" if o.code == 0 else ("NOT RUN" if o.code is None else f"FAILED (pytest exit {o.code})")
        print(f"  {status:<24} {o.label}: {o.counts}, {o.seconds:.0f} s" + (f" ({o.note})" if o.note else ""))
    return 0 if outcomes and all(o.code == 0 for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
