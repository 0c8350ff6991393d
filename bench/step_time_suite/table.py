"""The step-time validation table: the suite's measured times (kept in bench/results/, measured on the lent
TPU v5e by bench/step_time_suite/run.py) beside stagetool's estimate computed HERE, on the CPU, for the
compile-only target ``--topology v5e:1x1`` (no accelerator needed), split into the FIT half and the HELD-OUT
half of kinds.yaml (the fit half may set rates, rules and range widths; the held-out half never does).

Per program: its half and kind, measured, estimated (the schedule figure; "≥" where the estimate is a lower
bound), error ``(estimated - measured) / measured``, the likely range and whether it holds the measured time,
the bound stagetool names. Then per half: median and worst |error| over complete estimates, the share within
±30%, lower bounds below the measured time, the share of ranges that hold it. Writes the Markdown with the
command at its top.

``--heldback``: the same table for the HELD-BACK programs instead (heldback.stagetool.yaml, kinds in
heldback_kinds.yaml, none of them a kind of kinds.yaml; measured once, after the model was tuned, and never
used to set anything), written to validation_tpu_v5e_heldback.md with its own summary line. ``--heldback2``: round 2
of them (heldback2.stagetool.yaml, kinds in heldback2_kinds.yaml, none of them a kind of kinds.yaml or of round
1's heldback_kinds.yaml), written to validation_tpu_v5e_heldback2.md as its own group with its own summary line.
``--heldback3``: round 3 (heldback3.stagetool.yaml, kinds in heldback3_kinds.yaml, none of them a kind of kinds.yaml
or of rounds 1 and 2), written to validation_tpu_v5e_heldback3.md as its own group with its own summary line.

Usage: python bench/step_time_suite/table.py [--heldback | --heldback2 | --heldback3] [--measured FILE ...] [--out FILE] [--only a,b] [--topology v5e:1x1]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO))
SPEC = HERE / "suite.stagetool.yaml"
KINDS = HERE / "kinds.yaml"
RESULTS = REPO / "bench" / "results" / "step_time_suite"
MEASURED = (RESULTS / "measured_tpu_v5e.json", RESULTS / "measured_tpu_v5e_issue46.json")
OUT = RESULTS / "validation_tpu_v5e.md"
HELDBACK_SPEC = HERE / "heldback.stagetool.yaml"
HELDBACK_KINDS = HERE / "heldback_kinds.yaml"
HELDBACK_MEASURED = (RESULTS / "measured_tpu_v5e_heldback.json",)
HELDBACK_OUT = RESULTS / "validation_tpu_v5e_heldback.md"
HELDBACK2_SPEC = HERE / "heldback2.stagetool.yaml"
HELDBACK2_KINDS = HERE / "heldback2_kinds.yaml"
HELDBACK2_MEASURED = (RESULTS / "measured_tpu_v5e_heldback2.json",)
HELDBACK2_OUT = RESULTS / "validation_tpu_v5e_heldback2.md"
HELDBACK3_SPEC = HERE / "heldback3.stagetool.yaml"
HELDBACK3_KINDS = HERE / "heldback3_kinds.yaml"
HELDBACK3_MEASURED = (RESULTS / "measured_tpu_v5e_heldback3.json",)
HELDBACK3_OUT = RESULTS / "validation_tpu_v5e_heldback3.md"
ROUND1_SEEN = ("Held-back round 1 (`heldback.py`, 14 programs) is now **seen**: after it was measured, its per-instruction "
               "times were read (`validation_tpu_v5e_heldback_notes.md`) and the model was changed from them (af49be6 on: "
               "a ragged dot's masked gradient, a lower bound's rule, a scatter's rows, gathers from VMEM); it no longer "
               "tests the model, whatever its group says. A next validation needs programs nobody has seen.")


ROUND2_SEEN = ("Held-back round 2 (`heldback2.py`, 12 programs) is now **seen**: after it was measured, its per-instruction "
               "times were read (`validation_tpu_v5e_heldback2_notes.md`) and calibrate's benchmarks and the model were "
               "changed from them (scatter-adds of whole windows, of single elements into VMEM and as segment sums, "
               "single-element gathers from VMEM, transposed convolutions' phases, 4 × 4 stride-2 convolutions); a "
               "program whose group says \"seen in COMMIT\" is one whose mechanism was fixed from that commit on, and "
               "the first summary line leaves it out. It no longer tests a model that never saw it: a next validation "
               "needs programs nobody has seen (round 3).")


ROUND3_SEEN = ("Held-back round 3 (`heldback3.py`, 12 programs) was the clean test: measured once, and judged against the "
               "model as it stood (`validation_tpu_v5e_heldback3_bea0d18.md`, and before the day's changes at ffabd89: "
               "the same summary). After that, its per-instruction times were read "
               "(`validation_tpu_v5e_heldback3_notes.md`) and the model was changed from one of them (a gathered row "
               "narrower than 128 B at a 128 B row's time); a program whose group says \"seen in COMMIT\" is one whose "
               "mechanism was fixed from that commit on, and the first summary line leaves it out. A next validation "
               "needs programs nobody has seen.")


def halves() -> dict[str, tuple[str, str]]:
    """``{program: (kind, half)}`` from kinds.yaml, checked against its rule: within a kind, programs ordered
    by the SHA-256 of their name alternate held-out, fit, ...; a kind of one program is held-out when its
    name's SHA-256 is odd. Raises AssertionError where the file breaks the rule."""
    import yaml

    doc = yaml.safe_load(KINDS.read_text(encoding="utf-8"))["programs"]
    by_kind: dict[str, list[str]] = {}
    for name, v in doc.items():
        by_kind.setdefault(v["kind"], []).append(name)
    h = lambda n: hashlib.sha256(n.encode()).hexdigest()
    for kind, progs in by_kind.items():
        for i, p in enumerate(sorted(progs, key=h)):
            want = ("held-out" if int(h(p), 16) % 2 else "fit") if len(progs) == 1 else \
                ("held-out" if i % 2 == 0 else "fit")
            assert doc[p]["half"] == want, f"kinds.yaml: {p} is in {doc[p]['half']}, the rule says {want}"
    return {name: (v["kind"], v["half"]) for name, v in doc.items()}


def heldback_kinds(round_: int = 1) -> dict[str, tuple[str, str]]:
    """``{program: (kind, group)}`` from heldback_kinds.yaml (``round_`` 1), heldback2_kinds.yaml (2) or
    heldback3_kinds.yaml (3). Round 1's group is "held-back", or "held-back, seen in COMMIT" for a program whose
    ``seen`` names the first commit of the model that used its measured result (it no longer tests a model that
    never saw it); round 2's is "held-back-2", round 3's "held-back-3". Raises AssertionError where a program is
    not in its round's group or its kind is one of kinds.yaml's, or one of an earlier round's (a held-back
    program must be of a kind nobody fitted the model to)."""
    import yaml

    path, group = {1: (HELDBACK_KINDS, "held-back"), 2: (HELDBACK2_KINDS, "held-back-2"),
                   3: (HELDBACK3_KINDS, "held-back-3")}[round_]
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))["programs"]
    seen = {kind for kind, _ in halves().values()}
    for earlier in range(1, round_):
        seen |= {kind for kind, _ in heldback_kinds(earlier).values()}
    for name, v in doc.items():
        assert v["half"] == group, f"{path.name}: {name} is in {v['half']}, not {group}"
        assert v["kind"] not in seen, f"{path.name}: {name}'s kind {v['kind']!r} is one kinds.yaml or an earlier round names"
    return {name: (v["kind"], v["half"] + (f", seen in {v['seen']}" if v.get("seen") else ""))
            for name, v in doc.items()}


def estimate(name: str, topology: str, spec: Path = SPEC) -> dict:
    """stagetool's estimate of one suite function for ``topology`` (JSON-able; ``error`` on failure), with
    ``kernels``: ``{instruction: [kind, figure, seconds per step]}`` of each kernel taking over 0.1% of the step
    (the same module and chip timed again with every instruction listed, for the per-class spreads)."""
    import stagetool.analysis.step_time as st
    from stagetool import Options, Section, analyze
    from stagetool.staging.cache import resolve_cache_dir

    # the estimate's own call of step_time, seen on its way (its module, chip, devices, collectives and loop trip
    # counts), to time the same module again with every kernel listed: asking the report for the compiled text
    # instead would compile again (the facts cache keys the shown text apart)
    seen: list[tuple] = []
    timed = st.step_time

    def keep(module, chip, net, collectives, trips, **kw):
        if kw.get("top", 10):
            seen.append((module, chip, net, collectives, trips))
        return timed(module, chip, net, collectives, trips, **kw)

    st.step_time = keep
    try:
        # the facts cache (the user's cache folder, STAGETOOL_CACHE_DIR, off with STAGETOOL_NO_CACHE=1): a rerun
        # after a change to the model reads each program's compiled module back instead of compiling it again
        report = analyze(Options(spec=spec, function=name, topology=topology, cache_dir=resolve_cache_dir()),
                         [Section.COST])
    finally:
        st.step_time = timed
    f = report.functions[0]
    if f.error:
        return {"error": f.error.splitlines()[0]}
    e = f.cost.step_time
    if e is None:
        return {"error": f.cost.step_time_reason or "no step-time estimate"}
    kernels = {}
    if seen:
        every = timed(*seen[-1], top=1 << 30)
        kernels = {i.name: [i.kind, i.figure, i.total_seconds] for i in every.top  # (those over 0.1% of the step)
                   if i.total_seconds > 1e-3 * e.schedule_seconds}
    return {"step": e.schedule_seconds, "bound": e.bound, "xla": e.xla_optimal_seconds,
            "lower_bound": bool(e.lower_bound), "likely": list(e.likely_seconds) if e.likely_seconds else None,
            "not_validated": list(e.not_validated), "mfu": e.mfu, "mfu_peak": e.mfu_peak, "kernels": kernels}


def spreads(measured: dict, estimates: dict, split: dict) -> dict[str, tuple[float, float, int, int]]:
    """Per kernel class (``stagetool.analysis.step_time._family``), from the FIT half only: ``(low, high,
    kernels, programs)``, the factors on the model's kernel time that hold the measured device time of that
    class's kernels (the profiler's per-instruction times kept in ``top_instructions``). The rule: each
    kernel of a complete estimate (no lower bound) taking at least 2% of its program's measured time; low =
    0.9 x min(1, the 10th percentile of measured / estimated), high = 1.1 x max(1, the 90th); a class seen
    in fewer than 3 programs at least 0.8 to 1.25. A class with no such kernel is not in the result: the
    model widens it (x 0.5 to x 2) and says it is not validated."""
    from stagetool.analysis.step_time import _family

    ratios: dict[str, list[tuple[float, str]]] = {}
    for name, e in estimates.items():
        m = measured.get(name, {})
        if split.get(name, ("", ""))[1] != "fit" or "error" in e or e.get("lower_bound") or not m.get("measured_seconds"):
            continue
        device = dict(m.get("top_instructions") or [])
        for ins, (kind, figure, seconds) in (e.get("kernels") or {}).items():
            got = device.get(ins)
            if got is None or figure.startswith("floor") or max(got, seconds) < 0.02 * m["measured_seconds"] \
                    or kind.startswith("cross-program prefetch"):  # the profiler times its copy-start, not its DMA
                continue
            ratios.setdefault(_family(kind), []).append((got / seconds, name))
    out = {}
    for fam, xs in sorted(ratios.items()):
        r = sorted(x for x, _ in xs)
        lo, hi = 0.9 * min(1.0, r[len(r) // 10]), 1.1 * max(1.0, r[(9 * len(r)) // 10])
        programs = len({p for _, p in xs})
        if programs < 3:
            lo, hi = min(lo, 0.8), max(hi, 1.25)
        out[fam] = (round(lo, 2), round(hi, 2), len(r), programs)
    return out


def _timing(m: dict) -> str:
    """The timing column's word: ``device`` (the profiler's XLA Modules events) or ``wall clock`` (a blocked step)."""
    t = m.get("timing") or ""
    return "device" if t.startswith("device") else "wall clock" if t.startswith("wall") else t


def _commit() -> str:
    """The checkout's commit (short hash), or "an unknown commit" outside a git checkout."""
    import subprocess

    r = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else "an unknown commit"


def _clean() -> bool:
    """Whether stagetool/ and bench/step_time_suite/ have no uncommitted changes (True outside git)."""
    import subprocess

    r = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "stagetool", "bench/step_time_suite"],
                       capture_output=True, text=True)
    return r.returncode != 0 or not r.stdout.strip()


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:.3g} ms"


def summary(rows: list[dict]) -> dict:
    """Median and worst |error| over complete estimates, the share within ±30%, lower bounds below/above the
    measured time, the share of likely ranges holding the measured time (over rows with an estimate)."""
    errs = [abs(r["error"]) for r in rows if r.get("error") is not None and not r["lower_bound"]]
    lows = [r for r in rows if r.get("error") is not None and r["lower_bound"]]
    held = [r["holds"] for r in rows if r.get("holds") is not None]
    return {"complete": len(errs), "median": statistics.median(errs) if errs else None,
            "worst": max(errs) if errs else None,
            "within30": sum(e <= 0.30 for e in errs) / len(errs) if errs else None,
            "lower_ok": sum(r["est"] <= r["measured"] for r in lows), "lower_bad": sum(r["est"] > r["measured"] for r in lows),
            "range_holds": sum(held) / len(held) if held else None, "ranges": len(held)}


def table(measured: dict, estimates: dict, split: dict, command: str, topology: str, sources: str,
          heldback: bool | int = False) -> str:
    """The Markdown document (``heldback``: of the held-back programs, one group; 2 or 3: that round's, its own
    group)."""
    later = heldback in (2, 3) and heldback is not True  # a later round: its own group
    base = f"held-back-{heldback}" if later else "held-back"
    with_seen = heldback is True or heldback in (1, 2, 3)  # rounds whose programs the model has since seen
    groups = ((base, f"{base}, seen", f"{base}, all") if with_seen else (base,)) if heldback else ("held-out", "fit")
    lines = [f"<!-- {command} -->", "",
             f"# Step time: measured on one TPU v5e vs stagetool's estimate (`--topology {topology}`, computed on a CPU)",
             "", f"Command: `{command}`", "",
             f"Estimated by stagetool at {_commit()} (the working tree{'' if _clean() else ', with changes not committed'}).",
             "",
             f"Measured: {sources}. Measured is the device's own step time (the profiler's XLA Modules events) "
             "where `timing` is device, else the wall clock of a blocked step (+ about 0.6 ms of host dispatch).",
             ("Held back, round 2: `bench/step_time_suite/heldback2.py`, kinds in `heldback2_kinds.yaml` that "
              "neither the suite's `kinds.yaml` nor round 1's `heldback_kinds.yaml` names, committed before they "
              "were measured and not used to set a rate, a rule or a range width until they were seen (below)."
              if heldback == 2 else
              "Held back, round 3: `bench/step_time_suite/heldback3.py`, kinds in `heldback3_kinds.yaml` that none "
              "of the suite's `kinds.yaml`, round 1's `heldback_kinds.yaml` and round 2's `heldback2_kinds.yaml` "
              "names, committed before they were measured and not used to set a rate, a rule or a range width until "
              "they were seen (below)." if heldback == 3 else
              "Held back: `bench/step_time_suite/heldback.py`, kinds in `heldback_kinds.yaml` that the suite's "
              "`kinds.yaml` does not name, committed before they were measured and never used to set a rate, a "
              "rule or a range width; one whose group says \"seen in COMMIT\" was used by the model from that "
              "commit on, and the first summary line leaves it out." if heldback else
              "Halves: `bench/step_time_suite/kinds.yaml`, split by a blind rule before the added programs were "
              "measured; the fit half may set rates, rules and range widths, the held-out half never does."),
             *(["", {1: ROUND1_SEEN, 2: ROUND2_SEEN, 3: ROUND3_SEEN}[int(heldback)]] if heldback else []), "",
             "| program | half | kind | measured | timing | estimated | error | likely range | holds | bound | not validated |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    rows: dict[str, list[dict]] = {g: [] for g in groups}
    for name in sorted(measured, key=lambda n: (split.get(n, ("", "?"))[1], split.get(n, ("?",))[0], n)):
        m = measured[name]
        kind, half = split.get(name, ("?", "?"))
        e = estimates.get(name, {})
        ms = m.get("measured_seconds")
        if "error" in e or ms is None:
            lines.append(f"| {name} | {half} | {kind} | {_ms(ms)} | {_timing(m)} | "
                         f"{e.get('error', 'not measured')} | | | | | |")
            continue
        err = (e["step"] - ms) / ms
        lo, hi = e["likely"] if e.get("likely") else (None, None)
        holds = None if lo is None else (lo <= ms <= hi if not e["lower_bound"] else lo <= ms)
        row = {"error": err, "lower_bound": e["lower_bound"], "est": e["step"], "measured": ms, "holds": holds}
        if heldback and with_seen:
            rows[f"{base}, all"].append(row)
        rows.setdefault(f"{base}, seen" if half.startswith(f"{base}, seen") else half, []).append(row)
        est = ("≥ " if e["lower_bound"] else "") + _ms(e["step"])
        rng = "" if lo is None else f"{_ms(lo)} – {'' if not e['lower_bound'] else '≥ '}{_ms(hi)}"
        lines.append(f"| {name} | {half} | {kind} | {_ms(ms)} | {_timing(m)} | {est} | {err * 100:+.0f}% "
                     f"| {rng} | {'yes' if holds else 'no' if holds is not None else ''} | {e['bound']} "
                     f"| {', '.join(e.get('not_validated') or [])} |")
    lines.append("")
    sums = {h: summary(r) for h, r in rows.items()}
    for half in groups:
        s = sums.get(half)
        if not s or not (s["complete"] or s["ranges"]):
            continue
        # the held-back lines give counts and one decimal: 11 of 13 is 84.6%, which a rounded 85% would pass
        share = (lambda x, n: f"{round(x * n)} of {n} ({x * 100:.1f}%)") if heldback else \
            (lambda x, n: f"{x * 100:.0f}%" + ("" if n is None else f" of {n} programs"))
        errs = (f"median |error| {s['median'] * 100:.0f}%, worst {s['worst'] * 100:.0f}% over {s['complete']} complete "
                f"estimates; {share(s['within30'], s['complete'] if heldback else None)} within ±30%"
                if s["complete"] else "no complete estimate")
        holds = (f"the likely range holds the measured time on {share(s['range_holds'], s['ranges'])}"
                 if s["ranges"] else "no likely range")
        lines.append(f"- **{half}**: {errs}; lower bounds {s['lower_ok']} below the measured time, {s['lower_bad']} "
                     f"above it; {holds}.")
    ho, fit = (None, None) if heldback else (sums.get("held-out"), sums.get("fit"))
    if ho and fit and ho["median"] and fit["median"] is not None:
        ratio = ho["median"] / fit["median"] if fit["median"] else float("inf")
        lines.append(f"- fit-half median over held-out median: the held-out median is {ratio:.2f}× the fit half's "
                     f"(the issue asks the fit half no better than 1.5× better: held-out ≤ 1.5 × fit)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heldback", action="store_true",
                   help="the held-back programs (heldback.stagetool.yaml) instead of the suite's two halves")
    p.add_argument("--heldback2", action="store_true",
                   help="round 2 of the held-back programs (heldback2.stagetool.yaml), their own group")
    p.add_argument("--heldback3", action="store_true",
                   help="round 3 of the held-back programs (heldback3.stagetool.yaml), their own group")
    p.add_argument("--measured", type=Path, nargs="+")
    p.add_argument("--out", type=Path)
    p.add_argument("--only", help="comma-separated program names")
    p.add_argument("--topology", default="v5e:1x1")
    p.add_argument("--estimates", type=Path, help="reuse estimates kept in this JSON (and write new ones to it)")
    p.add_argument("--kept-only", action="store_true", help="with --estimates: estimate nothing new (a row says so)")
    p.add_argument("--spreads", action="store_true",
                   help="print the per-class spreads the fit half's kernels give (step_time.CLASS_SPREAD's rule)")
    args = p.parse_args(argv)
    if args.heldback + args.heldback2 + args.heldback3 > 1:
        p.error("--heldback, --heldback2 and --heldback3 are three tables: give one")
    rnd = 3 if args.heldback3 else 2 if args.heldback2 else 1 if args.heldback else 0
    spec = (SPEC, HELDBACK_SPEC, HELDBACK2_SPEC, HELDBACK3_SPEC)[rnd]
    args.measured = args.measured or list((MEASURED, HELDBACK_MEASURED, HELDBACK2_MEASURED, HELDBACK3_MEASURED)[rnd])
    args.out = args.out or (OUT, HELDBACK_OUT, HELDBACK2_OUT, HELDBACK3_OUT)[rnd]
    split = heldback_kinds(rnd) if rnd else halves()
    measured: dict = {}
    sources = []
    for path in args.measured:
        doc = json.loads(path.read_text(encoding="utf-8"))
        measured.update(doc["programs"])
        sources.append(f"`{path.name}` ({doc.get('device_kind')}, jax {doc.get('jax')}, libtpu {doc.get('libtpu')})")
    names = [n for n in sorted(measured) if not args.only or n in args.only.split(",")]
    measured = {n: measured[n] for n in names}
    kept = json.loads(args.estimates.read_text()) if args.estimates and args.estimates.exists() else {}
    estimates = {}
    for name in names:
        if name in kept and "error" not in kept[name]:
            estimates[name] = kept[name]
            continue
        if args.kept_only:
            estimates[name] = {"error": "not estimated in this run (--kept-only)"}
            continue
        try:
            estimates[name] = estimate(name, args.topology, spec)
        except Exception as e:  # noqa: BLE001 - one program's failure is its row
            estimates[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]}
        print(f"{name}: {estimates[name]}", file=sys.stderr, flush=True)
        if args.estimates:
            args.estimates.write_text(json.dumps({**kept, **estimates}, indent=1, sort_keys=True))
    if args.spreads:
        for fam, (lo, hi, n, progs) in spreads(measured, estimates, split).items():
            print(f'"{fam}": ({lo}, {hi}),  # {n} kernels of {progs} fit-half programs')
        return 0
    command = "python bench/step_time_suite/table.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = table(measured, estimates, split, command.strip(), args.topology, "; ".join(sources), rnd if rnd else False)
    args.out.write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
