"""Running the gate's functions: the record of a snapshot run, and one function in its own process.

``stagetool.pipeline.take_snapshot`` stages the functions; here is what it returns and how
``--isolate`` runs one function in a ``python -m stagetool snapshot --function NAME`` process.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from stagetool.core.errors import BaselineError
from stagetool.gate.snapshot import validate_snapshot


@dataclasses.dataclass(frozen=True)
class SnapshotRun:
    """A snapshot taken now, and the functions that failed.

    Attributes:
      snapshot: the document (functions that failed are left out).
      failed: function name → error message (a compile error, or how its process died).
      functions: every function of the plan, in spec order.
      spec_path: the spec used.
      spec_check: the spec's ``check:`` section (tolerances), or None.
    """

    snapshot: dict
    failed: dict[str, str]
    functions: tuple[str, ...]
    spec_path: Path | None
    spec_check: Any = None


def spec_label(spec_path: Path | None) -> str | None:
    return None if spec_path is None else Path(spec_path).name


#: Seconds one ``--isolate`` process may take by default (a generous bound for a compile).
DEFAULT_TIMEOUT_S = 1800.0


def snapshot_in_subprocess(options: Any, spec_path: Path | None, *,
                           timeout_s: float | None = DEFAULT_TIMEOUT_S) -> tuple[dict | None, str | None]:
    """Run ``python -m stagetool snapshot --function NAME`` into a temporary file.

    The child runs in its own session (process group); it and everything it started are killed when
    it runs past ``timeout_s`` (reported as that function's failure) or when a signal ends this run
    (:mod:`stagetool.core.cleanup`). The temporary folder is removed on every path.
    """
    import os
    import signal
    import subprocess
    import sys
    import tempfile

    from stagetool.core import cleanup

    with tempfile.TemporaryDirectory(prefix="stagetool-isolate-") as tmp, cleanup.temporary_path(tmp):
        out = Path(tmp) / "snapshot.json"
        argv = [sys.executable, "-m", "stagetool", "snapshot", "--function", options.function, "-o", str(out)]
        if spec_path is not None:
            argv += ["--spec", str(Path(spec_path).resolve())]
        elif options.target:
            argv.insert(4, options.target)
        for flag, value in (("--mesh", options.mesh), ("--platform", options.platform),
                            ("--topology", options.topology), ("--processes", options.processes)):
            if value is not None:
                argv += [flag, str(value)]
        if options.local_avals:
            argv.append("--local-avals")
        cache_dir = getattr(options, "cache_dir", None)
        argv += ["--cache-dir", str(Path(cache_dir).resolve())] if cache_dir is not None else ["--no-cache"]
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # the folder holding the stagetool package
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                              env=env, cwd=os.getcwd(), start_new_session=True) as child:
            token = cleanup.register_child(child)
            try:
                _, stderr = child.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                cleanup.kill_child(child)
                child.communicate()
                return None, f"timed out after {timeout_s:g} s (--timeout); the process was killed"
            finally:
                cleanup.kill_child(child)  # its process group, if anything of it is left
                cleanup.forget(token)
        proc = subprocess.CompletedProcess(argv, child.returncode, "", stderr)
        tail = _tail(proc.stderr)
        if proc.returncode < 0:
            try:
                sig = signal.Signals(-proc.returncode).name
            except ValueError:
                sig = f"signal {-proc.returncode}"
            return None, f"the process died with {sig}" + (f": {tail}" if tail else "")
        if proc.returncode != 0:
            return None, tail or f"exit code {proc.returncode}"
        try:
            return validate_snapshot(json.loads(out.read_text(encoding="utf-8")), str(out)), None
        except (OSError, ValueError, BaselineError) as e:
            return None, f"no snapshot from the isolated process: {e}"


def _tail(stderr: str, lines: int = 3) -> str:
    kept = [ln.strip() for ln in stderr.splitlines() if ln.strip() and not ln.startswith("wrote ")]
    return " | ".join(kept[-lines:])
