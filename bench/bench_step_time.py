"""Device check of the step-time estimate: run programs for real on the attached accelerator and
compare their measured step time and memory with stagetool's estimate.

On an attached GPU or TPU (all its devices on the first mesh axis), for the bundled examples (those
whose framework is installed) and bench/step_decoder.py (a scanned decoder of about a second per
step on one TPU v5e chip):

* measured: the median wall time of one step after two warm-up steps (``block_until_ready``; the
  donated inputs copied before each step, outside the timing), and the device's
  ``memory_stats()['peak_bytes_in_use']`` (the process's peak so far, programs run smallest first)
  less the inputs the bench itself keeps;
* estimated: stagetool's step time (:mod:`stagetool.analysis.step_time`: the schedule's figure, with
  its overlapped–serial range) and peak memory for the attached device, and for the matching
  compile-only target (``v5e:1x1`` on one v5e chip, ``h100:8`` on eight H100s), computed first in a
  child process before this one starts the accelerator.

It prints a Markdown table (estimated vs measured, the error of each) and writes it to ``--out``.
It needs only jax and stagetool (``pip install --no-deps -e .``; the Flax/Equinox examples are
skipped where those are missing), runs in under six minutes on one v5e chip, and exits 0 with a
message where no accelerator is attached.

Usage: python bench/bench_step_time.py [--out FILE] [--runs 5] [--only NAME[,NAME]]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROGRAMS = (  # (name, target, spec, module a missing framework skips it)
    ("mlp", "examples/mlp.py:train_step", "examples/mlp.stagetool.yaml", None),
    ("transformer", "examples/transformer.py:train_step", "examples/transformer.stagetool.yaml", None),
    ("linen_lm", "examples/linen_lm.py:train_step", "examples/linen_lm.stagetool.yaml", "flax"),
    ("nnx_lm", "examples/nnx_lm.py:train_step", "examples/nnx_lm.stagetool.yaml", "flax"),
    ("equinox_lm", "examples/equinox_lm.py:train_step", "examples/equinox_lm.stagetool.yaml", "equinox"),
    ("maxtext_lm", "examples/maxtext_lm.py:train_step", "examples/maxtext_lm.stagetool.yaml", "flax"),
    ("scanned decoder ~1 s", "bench/step_decoder.py:train_step", "bench/step_decoder.stagetool.yaml", None),
)

_TPU_TOPOLOGY = {"tpu-v5e": ("v5e", 2), "tpu-v6e": ("v6e", 2), "tpu-v5p": ("v5p", 3), "tpu-v4": ("v4", 3)}
_GPU_TOPOLOGY = {"h100-sxm": "h100", "h200": "h200", "a100-80gb": "a100-80gb", "b200": "b200", "h100-pcie": "h100-pcie"}
_GRIDS = {2: {1: "1x1", 4: "2x2", 8: "2x4"}, 3: {1: "1x1x1", 4: "2x2x1", 8: "2x2x2"}}


def _attached() -> tuple[str, str, int]:
    """(platform, device kind, device count) of JAX's default backend, asked in a child process so that
    this one has not started the accelerator yet (a compile-only TPU client runs first)."""
    code = ("import jax, json; d = jax.devices(); "
            "print(json.dumps([d[0].platform, d[0].device_kind, len(d)]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    try:
        return tuple(json.loads(out.stdout.strip().splitlines()[-1]))  # type: ignore[return-value]
    except (ValueError, IndexError):
        return ("none", out.stderr.strip()[-300:], 0)


def compile_only_target(chip: str | None, n: int) -> str | None:
    """The compile-only topology matching ``n`` attached devices of ``chip`` (``v5e:1x1``), or None."""
    if chip in _TPU_TOPOLOGY:
        kind, dims = _TPU_TOPOLOGY[chip]
        grid = _GRIDS[dims].get(n)
        return f"{kind}:{grid}" if grid else None
    return f"{_GPU_TOPOLOGY[chip]}:{n}" if chip in _GPU_TOPOLOGY else None


def _mesh(spec: str, n: int) -> str:
    from stagetool import load_spec

    names = load_spec(REPO / spec).mesh.names
    return "x".join([str(n)] + ["1"] * (len(names) - 1))


def _available(module: str | None) -> bool:
    if module is None:
        return True
    import importlib.util

    return importlib.util.find_spec(module) is not None


def estimate(target: str, spec: str, mesh: str, topology: str | None) -> dict:
    """stagetool's step time and peak memory of one program (JSON-able)."""
    from stagetool import Options, Section, analyze

    report = analyze(Options(target=target, spec=REPO / spec, mesh=mesh, topology=topology),
                     [Section.COST, Section.MEMORY])
    f = report.functions[0]
    if f.error:
        return {"error": f.error.splitlines()[0]}
    e = f.cost.step_time
    return {"chip": e.chip if e else None, "low": e.overlapped_seconds if e else None,
            "step": e.schedule_seconds if e else None, "high": e.serial_seconds if e else None,
            "bound": e.bound if e else f.cost.step_time_reason, "xla": e.xla_optimal_seconds if e else None,
            "peak": f.memory.record.peak_bytes}


def _estimates_child(topology: str, n: int, names: list[str]) -> None:
    """``--estimates-for TOPOLOGY``: print one JSON line per program (run in a child process)."""
    for name, target, spec, _ in PROGRAMS:
        if name in names:
            try:
                out = estimate(target, spec, _mesh(spec, n), topology)
            except Exception as e:  # noqa: BLE001 - one program's failure is its row, not the bench's
                out = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
            print("ESTIMATE " + json.dumps({"name": name, **out}), flush=True)


def measure(target: str, spec: str, mesh: str, runs: int) -> dict:
    """Median seconds of one step after warm-up, and the peak bytes in use less the kept inputs."""
    import jax

    from stagetool import Options, staged_functions
    from stagetool.measure.step import concrete_inputs

    _, inputs, staged = next(staged_functions(Options(target=target, spec=REPO / spec, mesh=mesh)))
    args = concrete_inputs(inputs.args, 0, random_integers=False)  # zero integers, as its results were measured
    kwargs = {k: v for k, v in concrete_inputs(inputs.kwargs, 1000, random_integers=False).items()
              if k not in inputs.static_argnames}
    statics = {k: v for k, v in inputs.kwargs.items() if k in inputs.static_argnames}
    call = staged.compiled
    kept = sum(x.nbytes for x in jax.tree.leaves((args, kwargs)) if isinstance(x, jax.Array))
    copy = lambda t: jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, t)
    try:
        jax.block_until_ready(call(*copy(args), **copy(kwargs)))
    except TypeError:  # a Compiled that wants the static arguments too
        call = lambda *a, **k: staged.jitted(*a, **k, **statics)
        jax.block_until_ready(call(*copy(args), **copy(kwargs)))
    times = []
    for _ in range(runs + 1):
        a, k = copy(args), copy(kwargs)
        jax.block_until_ready((a, k))
        t0 = time.perf_counter()
        jax.block_until_ready(call(*a, **k))
        times.append(time.perf_counter() - t0)
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return {"measured": statistics.median(times[1:]), "runs": runs,
            "measured_peak": None if peak is None else peak - kept}


def _error(est, measured) -> str:
    if est is None or not measured:
        return "n/a"
    return f"{(est - measured) / measured * 100:+.0f}%"


def _s(x) -> str:
    if x is None:
        return "n/a"
    return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"


def _gib(x) -> str:
    return "n/a" if x is None else f"{x / 2**30:.3g} GiB"


def table(rows: list[dict], device: str, target: str | None) -> str:
    """The Markdown table of the run."""
    head = (f"Device: {device}. Estimates: stagetool's schedule figure (its overlapped–serial range in "
            f"brackets) for the attached device and for the compile-only target {target or '(none)'}; "
            "memory: stagetool's peak vs `memory_stats()` peak bytes in use less the inputs the bench keeps.\n\n")
    lines = [("| program | measured step | estimate, attached [range] | error | estimate, compile-only | error "
              "| XLA optimal_seconds | bound | measured peak | estimated peak | error |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a, c = r.get("attached", {}), r.get("compile_only", {})
        if "skipped" in r or "failed" in r:
            lines.append(f"| {r['name']} | {r.get('skipped') or r.get('failed')} |" + " |" * 10)
            continue
        rng = f"{_s(a.get('step'))} [{_s(a.get('low'))}–{_s(a.get('high'))}]"
        lines.append(f"| {r['name']} | {_s(r['measured'])} | {rng} | {_error(a.get('step'), r['measured'])} "
                     f"| {_s(c.get('step'))} | {_error(c.get('step'), r['measured'])} | {_s(a.get('xla'))} "
                     f"| {a.get('bound') or 'n/a'} | {_gib(r.get('measured_peak'))} | {_gib(a.get('peak'))} "
                     f"| {_error(a.get('peak'), r.get('measured_peak'))} |")
    errors = [abs(r["attached"]["step"] - r["measured"]) / r["measured"] for r in rows
              if r.get("measured") and r.get("attached", {}).get("step")]
    tail = (f"\nMedian absolute error of the attached estimate: {statistics.median(errors) * 100:.0f}% over "
            f"{len(errors)} programs.\n" if errors else "\n")
    return head + "\n".join(lines) + "\n" + tail


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="write the Markdown table here too")
    p.add_argument("--runs", type=int, default=5, help="timed steps per program after the warm-up (median)")
    p.add_argument("--only", help="comma-separated program names")
    p.add_argument("--estimates-for", help=argparse.SUPPRESS)
    p.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    names = [n for n, *_ in PROGRAMS if not args.only or n in args.only.split(",")]
    if args.estimates_for:
        _estimates_child(args.estimates_for, args.devices, names)
        return 0
    started = time.monotonic()
    platform, kind, n = _attached()
    if platform not in ("tpu", "gpu"):
        print(f"no accelerator attached (JAX's default backend is {platform}: {kind}): nothing to measure")
        return 0
    from stagetool.core.chips import chip_for_device_kind

    chip = chip_for_device_kind(kind)
    target = compile_only_target(chip, n)
    runnable = [(name, t, s) for name, t, s, module in PROGRAMS if name in names and _available(module)]
    rows = {name: {"name": name} for name in names}
    for name, *_rest, module in PROGRAMS:
        if name in names and not _available(module):
            rows[name]["skipped"] = f"skipped: {module} is not installed"
    if target:  # the compile-only estimates first, in a child, before this process starts the accelerator
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        child = subprocess.run([sys.executable, __file__, "--estimates-for", target, "--devices", str(n),
                                "--only", ",".join(name for name, _, _ in runnable)],
                               capture_output=True, text=True, env=env, timeout=240, check=False)
        for line in child.stdout.splitlines():
            if line.startswith("ESTIMATE "):
                doc = json.loads(line[len("ESTIMATE "):])
                rows[doc.pop("name")]["compile_only"] = doc
    for name, t, s in runnable:
        mesh = _mesh(s, n)
        try:
            rows[name]["attached"] = estimate(t, s, mesh, None)
            rows[name].update(measure(t, s, mesh, args.runs))
        except Exception as e:  # noqa: BLE001 - one program's failure is its row
            rows[name]["failed"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
        print(f"{name}: done at {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    text = table([rows[name] for name in names], f"{n} × {kind} ({chip or 'not in the chip table'})", target)
    print(text)
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
