"""Measure the step-time suite on the attached accelerator: every function of suite.stagetool.yaml staged
by stagetool for the attached device(s), run on random inputs of its spec's shapes (median of --steps after
--warmup; donated inputs made anew outside the timing), and its top instructions timed by JAX's profiler.

Writes ``measured.json`` (after each program, so that a cut-off run keeps what it measured):
``{"programs": {name: {"measured_seconds", "timing", "wall_seconds", "pipelined_seconds",
"device_seconds", "spread", "steps", "spec", "function", "notes", "top_instructions": [[hlo_name,
seconds per step], ...]}}, "jax", "jaxlib", "libtpu", "device_kind", "command", "date"}``.
``measured_seconds`` is the device's own time of one step (the profiler's ``XLA Modules`` events) where
the trace has it, else the wall-clock median of a blocked step (``timing`` says which); ``wall_seconds``
adds the host's dispatch and synchronisation (about 0.6 ms on the lent v5e machine), and
``pipelined_seconds`` is a step of --steps calls issued back to back and blocked on once. Exits 0 with a message where no accelerator is attached (``--allow-cpu`` measures
the CPU anyway, for a check of the runner itself).

``--spec`` measures another spec's functions the same way (the held-back programs:
``--spec bench/step_time_suite/heldback.stagetool.yaml``; round 2: ``heldback2.stagetool.yaml``; round 3:
``heldback3.stagetool.yaml``).

Usage: python bench/step_time_suite/run.py [--out measured.json] [--spec FILE] [--only a,b] [--steps 10] [--warmup 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO))
SPEC = HERE / "suite.stagetool.yaml"

#: integer inputs are drawn from [0, INT_HIGH[name]) (default 1024): ids of rows, positions, labels
INT_HIGH = {"embedding_scatter_add": 65536, "llama_train": 16000, "llama_prefill": 16000,
            "gpt2_f32_train": 50257, "decode_b32": 2048, "decode_b1": 4096,
            "gather_narrow": 1 << 20, "gather_pages": 4096, "scatter_rows_set": 1 << 20, "paged_decode": 4096,
            "paged_decode_big": 8192, "int8_weight_decode": 32000, "ce_128k": 128256, "ce_128k_chunked": 128256,
            "kv_cache_update": 8192, "bert_mlm_train": 30522, "dlrm_train": 100000,
            "retnet_train": 16000, "mod_train": 32000, "adafactor_lm_train": 32000}


def programs(spec: Path = SPEC) -> list[tuple[str, str]]:
    """``(name, target)`` of every function of ``spec`` (default: the suite's), in its order."""
    import yaml

    doc = yaml.safe_load(spec.read_text(encoding="utf-8"))
    return [(name, f["target"]) for name, f in doc["functions"].items()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("measured.json"))
    p.add_argument("--spec", type=Path, default=SPEC, help="the spec whose functions are measured")
    p.add_argument("--only", help="comma-separated function names")
    p.add_argument("--skip", help="comma-separated function names to leave out")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--top", type=int, default=0,
                   help="instructions kept per program (by measured time; 0: all, for the per-class comparison)")
    p.add_argument("--allow-cpu", action="store_true", help="measure on the CPU backend (a check of the runner)")
    args = p.parse_args(argv)

    from stagetool.measure.calibrate import versions
    from stagetool.measure.step import StepRunner
    from stagetool.measure.timing import attached_accelerator

    platform, kind, n = attached_accelerator()
    if platform == "cpu" and not args.allow_cpu:
        print(f"no accelerator attached (JAX's default backend is the CPU: {kind}): nothing to measure")
        return 0
    from stagetool import Options, staged_functions

    spec = args.spec.resolve()
    names = [(nm, t) for nm, t in programs(spec)
             if (not args.only or nm in args.only.split(",")) and (not args.skip or nm not in args.skip.split(","))]
    if args.only:  # in the order --only names them
        order = args.only.split(",")
        names.sort(key=lambda nt: order.index(nt[0]))
    doc = {"programs": {}, **versions(), "device_kind": kind, "platform": platform, "devices": n,
           "command": "python bench/step_time_suite/run.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if args.out.exists():  # a rerun adds to what an earlier (cut-off) run measured
        old = json.loads(args.out.read_text(encoding="utf-8"))
        doc["programs"] = old.get("programs", {})
    started = time.monotonic()
    for name, target in names:
        rel = spec.relative_to(REPO) if spec.is_relative_to(REPO) else spec
        row: dict = {"spec": rel.as_posix(), "function": f"{rel.parent.as_posix()}/{target}"}
        try:
            t0 = time.monotonic()
            _, inputs, staged = next(staged_functions(Options(spec=spec, function=name)))
            compile_s = time.monotonic() - t0
            runner = StepRunner(staged, inputs, int_high=INT_HIGH.get(name, 1024))
            t1 = time.monotonic()
            t = runner.time(steps=args.steps, warmup=args.warmup)
            t2 = time.monotonic()
            pipelined = runner.time_pipelined(args.steps)
            t3 = time.monotonic()
            ops, why, device_s = runner.profile(3)
            print(f"  phases: inputs {t1 - t0 - compile_s:.1f} s, timed {t2 - t1:.1f} s, pipelined {t3 - t2:.1f} s, "
                  f"profile {time.monotonic() - t3:.1f} s", flush=True)
            top = sorted(ops.items(), key=lambda kv: (-kv[1][0], kv[0]))[: args.top or None]
            row.update(measured_seconds=device_s if device_s else t.median_seconds,
                       timing="device (profiler XLA Modules)" if device_s else "wall clock (blocked step)",
                       wall_seconds=t.median_seconds, pipelined_seconds=pipelined, device_seconds=device_s,
                       min_seconds=t.min_seconds, max_seconds=t.max_seconds,
                       spread=t.spread, steps=t.samples, warmup=t.warmup,
                       profiled_seconds=sum(s for s, _ in ops.values()) if ops else None,
                       top_instructions=[[op, s] for op, (s, _) in top],
                       instruction_runs={op: n for op, (_, n) in top},
                       notes=(f"median of {t.samples} steps after {t.warmup} warm-up (wall clock, block_until_ready); "
                              f"integers in [0, {INT_HIGH.get(name, 1024)}); compile {compile_s:.1f} s"
                              + (f"; profiler: {why}" if why else "")))
        except Exception as e:  # noqa: BLE001 - one program's failure is its row
            if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower():
                import gc

                gc.collect()
            row.update(measured_seconds=None, top_instructions=[],
                       notes=f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400])
        doc["programs"][name] = row
        runner = staged = inputs = None  # free this program's arrays before the next one
        args.out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        ms = row["measured_seconds"]
        print(f"{name}: {'%.4g ms' % (ms * 1e3) if ms else row['notes']}  (at {time.monotonic() - started:.0f} s)",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
