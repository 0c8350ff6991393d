"""The step-time validation table: the suite's measured times (kept in bench/results/, measured on the lent
TPU v5e by bench/step_time_suite/run.py) beside stagetool's estimate computed HERE, on the CPU, for the
compile-only target ``--topology v5e:1x1`` (no accelerator needed).

Per program: measured, estimated (the schedule figure; "≥" where the estimate is a lower bound), error
``(estimated - measured) / measured``, the bound stagetool names, and XLA's optimal_seconds where given;
then the median and worst |error| (lower bounds below the measured time counted apart). Writes the Markdown
with the command at its top.

Usage: python bench/step_time_suite/table.py [--measured FILE] [--out FILE] [--only a,b] [--topology v5e:1x1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO))
SPEC = HERE / "suite.stagetool.yaml"
MEASURED = REPO / "bench" / "results" / "step_time_suite" / "measured_tpu_v5e.json"
OUT = REPO / "bench" / "results" / "step_time_suite" / "validation_tpu_v5e.md"


def estimate(name: str, topology: str) -> dict:
    """stagetool's estimate of one suite function for ``topology`` (JSON-able; ``error`` on failure)."""
    from stagetool import Options, Section, analyze
    from stagetool.staging.cache import resolve_cache_dir

    # the facts cache (the user's cache folder, STAGETOOL_CACHE_DIR, off with STAGETOOL_NO_CACHE=1): a rerun
    # after a change to the model reads each program's compiled module back instead of compiling it again
    report = analyze(Options(spec=SPEC, function=name, topology=topology, cache_dir=resolve_cache_dir()),
                     [Section.COST])
    f = report.functions[0]
    if f.error:
        return {"error": f.error.splitlines()[0]}
    e = f.cost.step_time
    if e is None:
        return {"error": f.cost.step_time_reason or "no step-time estimate"}
    lower = bool(getattr(e, "lower_bound", False))  # model39's honesty flag, where present
    return {"step": e.schedule_seconds, "bound": e.bound, "xla": e.xla_optimal_seconds, "lower_bound": lower}


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:.3g} ms"


def table(measured: dict, estimates: dict, command: str, topology: str) -> str:
    """The Markdown document."""
    lines = [f"<!-- {command} -->", "",
             f"# Step time: measured on one TPU v5e vs stagetool's estimate (`--topology {topology}`, computed on a CPU)",
             "",
             f"Command: `{command}`", "",
             f"Measured: {measured.get('device_kind')} with jax {measured.get('jax')}, libtpu {measured.get('libtpu')}, "
             f"by `bench/step_time_suite/run.py` ({measured.get('command')}).",
             "Measured is the device's own step time (the profiler's XLA Modules events) where `timing` is device, "
             "else the wall clock of a blocked step (+ about 0.6 ms of host dispatch on that machine).", "",
             "| program | measured | timing | estimated | error | bound | XLA optimal_seconds |",
             "|---|---|---|---|---|---|---|"]
    errors, lower_ok, lower_bad = [], 0, 0
    for name in sorted(measured["programs"]):
        m = measured["programs"][name]
        e = estimates.get(name, {})
        ms = m.get("measured_seconds")
        if "error" in e or ms is None:
            lines.append(f"| {name} | {_ms(ms)} | {m.get('timing', '')} | {e.get('error', 'not measured')} | | | |")
            continue
        err = (e["step"] - ms) / ms
        est = ("≥ " if e["lower_bound"] else "") + _ms(e["step"])
        if e["lower_bound"]:
            lower_ok += e["step"] <= ms
            lower_bad += e["step"] > ms
        else:
            errors.append(abs(err))
        lines.append(f"| {name} | {_ms(ms)} | {m.get('timing', '')} | {est} | {err * 100:+.0f}% | {e['bound']} "
                     f"| {_ms(e['xla']) if e['xla'] and e['xla'] > 0 else 'n/a'} |")
    lines.append("")
    if errors:
        lines.append(f"Median |error| {statistics.median(errors) * 100:.0f}%, worst {max(errors) * 100:.0f}% over "
                     f"{len(errors)} complete estimates; {lower_ok + lower_bad} lower bounds "
                     f"({lower_ok} below the measured time, {lower_bad} above it).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--measured", type=Path, default=MEASURED)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--only", help="comma-separated program names")
    p.add_argument("--topology", default="v5e:1x1")
    args = p.parse_args(argv)
    measured = json.loads(args.measured.read_text(encoding="utf-8"))
    names = [n for n in sorted(measured["programs"]) if not args.only or n in args.only.split(",")]
    measured["programs"] = {n: measured["programs"][n] for n in names}
    estimates = {}
    for name in names:
        try:
            estimates[name] = estimate(name, args.topology)
        except Exception as e:  # noqa: BLE001 - one program's failure is its row
            estimates[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]}
        print(f"{name}: {estimates[name]}", file=sys.stderr, flush=True)
    command = "python bench/step_time_suite/table.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = table(measured, estimates, command.strip(), args.topology)
    args.out.write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
