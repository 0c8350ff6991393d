"""Golden files: the JSON and Markdown reports, the snapshot and a sweep's JSON of the bundled examples.

They pin what stagetool prints for the examples so that a change of the code's layout (or any
refactoring) that changes a figure, a label or the order of rows is seen. Timings and versions are
stripped (:func:`normalise`); everything else must match byte for byte.

XLA's figures (FLOPs, bytes accessed, temporaries, the op names it merges into a fused collective)
differ between JAX releases, so there is one set per release of the test matrix
(``tests/matrix.py``): ``tests/golden/jax-<version>/``. Regenerate after an intended change, and
review the diff::

    .venv/bin/python tests/golden/regenerate.py          # the set of the JAX installed here
    .venv/bin/python tests/golden/regenerate.py --all    # and of every other release of the matrix
                                                         # (in its .venv-<leg>, made when missing)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

GOLDEN = Path(__file__).resolve().parent
REPO = GOLDEN.parents[1]


def release() -> str:
    """The JAX release whose figures this interpreter produces: ``jax-0.10.2`` (``jax-A-jaxlib-B``
    when the two differ), from the installed distributions."""
    from importlib import metadata

    jax, jaxlib = metadata.version("jax"), metadata.version("jaxlib")
    return f"jax-{jax}" if jax == jaxlib else f"jax-{jax}-jaxlib-{jaxlib}"


def golden_dir() -> Path:
    """The golden set of the JAX installed here (it may not exist: a release outside the matrix)."""
    return GOLDEN / release()

#: (golden file name, CLI arguments); ``{out}`` is a temporary output file.
CASES: dict[str, tuple[str, ...]] = {
    f"{example}.{kind}": (*command, f"examples/{example}.py:train_step", *options)
    for example in ("mlp", "transformer")
    for kind, command, options in (
        ("report.json", ("report",), ("--format", "json")),
        ("report.md", ("report",), ("--format", "markdown")),
        ("snapshot.json", ("snapshot",), ("-o", "{out}")),
    )
}
#: a sweep's rows (the sweep-row format, with --chip's roofline and --device-memory's fit)
CASES["transformer.sweep.json"] = ("sweep", "examples/transformer.py:train_step", "--mesh", "2x4,4x2",
                                   "--chip", "tpu-v5e", "--device-memory", "16GiB", "--format", "json")

_VERSION_KEYS = ("stagetool_version", "jax_version", "jaxlib_version")
_TIMINGS_MD = re.compile(r"trace [0-9.]+ [a-zµ]+, lower [0-9.]+ [a-zµ]+, compile [0-9.]+ [a-zµ]+")


def normalise(name: str, text: str) -> str:
    """Strip what changes from run to run, checkout to checkout or release to release: timings,
    versions, the checkout's folder, and source frames in stagetool's own code or in libraries
    (their line numbers move with any edit)."""
    if name.endswith(".md"):
        return _TIMINGS_MD.sub("trace …, lower …, compile …", text)
    if name.endswith(".snapshot.json"):  # the file's own bytes: sorted keys, 2-space indent, UTF-8 as is
        canonical = json.dumps(json.loads(text), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        if text != canonical:
            raise AssertionError(f"{name}: the snapshot file is not in its canonical form (sorted keys, indent 2)")
    doc = _drop_own_frames(json.loads(text))
    for key in _VERSION_KEYS:
        doc.pop(key, None)
    for fn in (doc.get("functions", []) if isinstance(doc.get("functions"), list) else []) + doc.get("rows", []):
        if fn.get("timings") is not None:
            fn["timings"] = {k: None for k in fn["timings"]}
    return json.dumps(doc, indent=2, sort_keys=False, ensure_ascii=False) + "\n"


def _drop_own_frames(value):
    """The document with ``source_chain`` frames outside the examples dropped (the report writes
    files below the spec's folder, ``examples/``, relative to it, and others absolute) and any other
    path in the checkout made relative to it."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k == "source_chain" and isinstance(v, list):
                v = [f for f in v if isinstance(f, dict) and not str(f.get("file", "/")).startswith("/")]
            out[k] = _drop_own_frames(v)
        return out
    if isinstance(value, list):
        return [_drop_own_frames(v) for v in value]
    if isinstance(value, str) and value.startswith(str(REPO) + "/"):
        return value[len(str(REPO)) + 1:]
    return value


def produce(name: str) -> str:
    """Run the CLI for one golden case in a fresh process and return its normalised output."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update({"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb", "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu",
                "STAGETOOL_NO_CACHE": "1"})
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        argv = [a.replace("{out}", str(out)) for a in CASES[name]]
        proc = subprocess.run([sys.executable, "-m", "stagetool", *argv], capture_output=True, text=True,
                              env=env, cwd=REPO, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"stagetool {' '.join(argv)} exited {proc.returncode}:\n{proc.stderr}")
        text = out.read_text(encoding="utf-8") if "{out}" in CASES[name] else proc.stdout
    return normalise(name, text)


def main(argv: list[str]) -> None:
    if argv not in ([], ["--all"]):
        sys.exit("usage: regenerate.py [--all]")
    folder = golden_dir()
    folder.mkdir(exist_ok=True)
    for name in CASES:
        (folder / name).write_text(produce(name), encoding="utf-8")
        print(f"wrote {(folder / name).relative_to(REPO)}")
    if argv == ["--all"]:
        sys.path.insert(0, str(GOLDEN.parent))
        import matrix

        for leg in matrix.LEGS:
            if f"jax-{leg.jax}" == folder.name:
                continue
            python = matrix.prepare(leg)
            subprocess.run([python, str(GOLDEN / "regenerate.py")], check=True, cwd=REPO)
    else:
        others = sorted(p.name for p in GOLDEN.glob("jax-*") if p.is_dir() and p != folder)
        if others:
            print(f"not regenerated: {', '.join(others)} (the matrix's other releases compare with them; "
                  "run 'regenerate.py --all')", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
