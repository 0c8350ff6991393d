"""``stagetool fit`` on the 8B-shaped decoder (bench/fit_decoder.py) against a brute-force sweep of
the same grid: the largest batch per remat policy from each, the compiles each made, wall time.

    python bench/fit_8b.py [--topology v5p:2x2x2] [--multiple 16] [--max-batch 256] [--jobs 3]
                           [--brute] [--out DIR] [--spec bench/fit_decoder.stagetool.yaml]

The 70B-shaped decoder (bench/results/fit_70b.md):

    python bench/fit_8b.py --spec bench/fit_decoder_70b.stagetool.yaml --topology v5p:4x4x4 \
                           --multiple 64 --max-batch 256 --jobs 2 --brute --out /tmp/fit70b

Writes DIR/fit.json (the fit document) and, with --brute, DIR/sweep.json (the sweep document);
prints one line per compile and the comparison. Compile-only: nothing is allocated.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--topology", default="v5p:2x2x2")
    ap.add_argument("--remat", default="none,dots,full")
    ap.add_argument("--multiple", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--jobs", type=int, default=3)
    ap.add_argument("--brute", action="store_true", help="also sweep every batch of the grid")
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--spec", type=Path, default=ROOT / "bench" / "fit_decoder.stagetool.yaml")
    ap.add_argument("--tokens-per-example", type=int, default=2048, help="the spec's sequence length")
    a = ap.parse_args()
    from stagetool.plan.options import Options
    from stagetool.sweep import SweepOptions, run_sweep
    from stagetool.sweep.fit import FitOptions, run_fit

    spec = a.spec.resolve()
    a.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    doc = run_fit(FitOptions(Options(spec=spec), topology=a.topology, set=(f"remat={a.remat}",), multiple=a.multiple,
                             max_batch=a.max_batch, jobs=a.jobs, max_compiles=200,
                             tokens_per_example=a.tokens_per_example),
                  on_probe=lambda v, p: print(f"fit {v} batch={p.batch} {p.outcome} peak={p.peak_bytes} "
                                              f"{p.reason or ''} t={time.perf_counter() - start:.0f}s", flush=True))
    fit_s = time.perf_counter() - start
    (a.out / "fit.json").write_text(json.dumps(doc, indent=1))
    found = {st["values"]["remat"]: st["largest_batch"] for st in doc["settings"]}
    print(f"fit: {found}, {doc['compiles']} compiles, {fit_s:.0f} s; best: {doc['best'] and doc['best']['set_line']}",
          flush=True)
    if not a.brute:
        return 0
    start = time.perf_counter()
    batches = ",".join(str(b) for b in range(a.multiple, a.max_batch + 1, a.multiple))
    sweep = run_sweep(SweepOptions(Options(spec=spec), topology=a.topology, set=(f"batch={batches}", f"remat={a.remat}"),
                                   jobs=a.jobs),
                      on_row=lambda r, n, t: print(f"sweep {n}/{t} {r['id']} {r['status']}", flush=True))
    brute_s = time.perf_counter() - start
    (a.out / "sweep.json").write_text(json.dumps(sweep, indent=1))
    brute: dict = {}
    for r in sweep["rows"]:
        if r["status"] == "ok" and r["fits"]:
            k = r["values"]["remat"]
            brute[k] = max(brute.get(k, 0), r["values"]["batch"])
    equal = all(brute.get(k) == v for k, v in found.items()) and set(brute) <= set(found)
    print(f"brute force: {brute}, {len(sweep['rows'])} compiles, {brute_s:.0f} s; equal: {equal}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
