"""Head-to-head: MaxText's ``train_compile.py`` and stagetool on the same train step and topology.

Runs, each in its own process, (a) MaxText's ``train_compile.main`` for ``compile_topology=v5e-8``
with the compiled step captured (its ``jit_and_compile`` wrapped; nothing else changed), and (b)
``stagetool report`` of ``maxtext_train_step.py:train_step --topology v5e:2x4`` (the same step, built
by MaxText's own functions on ``jax.devices()``), then prints both sets of figures side by side as a
Markdown table. Needs MaxText importable; see bench/results/maxtext_train_compile.md for the setup.

Usage (from this folder):
  MAXTEXT_SRC=/path/to/maxtext python head_to_head.py [--overrides "k=v k=v ..."] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
OVERRIDES = ("base_emb_dim=256 base_num_query_heads=4 base_num_kv_heads=4 base_mlp_dim=1024 "
             "base_num_decoder_layers=2 head_dim=64 vocab_size=2048 per_device_batch_size=2 "
             "max_target_length=256 enable_checkpointing=false dataset_type=synthetic")
COLLECTIVE = re.compile(r"\s(all-gather|all-reduce|reduce-scatter|all-to-all|ragged-all-to-all|collective-permute|"
                        r"collective-broadcast)(?:-start)?\(")


def collective_counts(hlo: str) -> dict[str, int]:
    """Collective instructions of an optimized HLO module by kind (a ``-start`` counted once, its
    ``-done`` not; those inside async-collective fusions included)."""
    counts: dict[str, int] = {}
    for kind in COLLECTIVE.findall(hlo):
        counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items()))


def collective_channels(hlo: str) -> dict[str, int]:
    """Distinct ``(opcode, channel_id)`` of those instructions by kind: TPU keeps a copy of an async
    collective in each of its start, continuation and done fusions, all with one channel id."""
    seen = set(re.findall(r"\s(all-gather|all-reduce|reduce-scatter|all-to-all|ragged-all-to-all|collective-permute|"
                          r"collective-broadcast)(?:-start)?\(.*?channel_id=(\d+)", hlo))
    counts: dict[str, int] = {}
    for kind, _ in seen:
        counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items()))


def program_digest(hlo: str) -> str:
    """sha256 of the optimized module's instructions as sorted (result shape, opcode) pairs: the same
    for one program however XLA numbered its instructions."""
    import hashlib

    pairs = sorted(re.findall(r"^\s*(?:ROOT )?\S+ = (.+?) ([a-z][\w-]*)\(", hlo, flags=re.MULTILINE))
    return hashlib.sha256(repr(pairs).encode()).hexdigest()[:16]


def maxtext_side(overrides: str) -> None:
    """Child process: MaxText's train_compile.main, its compiled step's figures printed as JSON."""
    import jax
    from maxtext.trainers.pre_train import train_compile

    captured = []
    real = train_compile.jit_and_compile

    def capture(*args, **kwargs):
        compiled = real(*args, **kwargs)
        captured.append(compiled)
        return compiled

    train_compile.jit_and_compile = capture
    base = os.path.join(os.environ["MAXTEXT_SRC"], "src", "maxtext", "configs", "base.yml")
    train_compile.main(["train_compile.py", base, "compile_topology=v5e-8", "compile_topology_num_slices=1",
                        *overrides.split()])
    (compiled,) = captured
    m = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    hlo = compiled.as_text()
    print("HEAD_TO_HEAD " + json.dumps({
        "argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
        "alias_bytes": m.alias_size_in_bytes, "temp_bytes": m.temp_size_in_bytes,
        "generated_code_bytes": m.generated_code_size_in_bytes,
        "peak_bytes": getattr(m, "peak_memory_in_bytes", None),
        "flops": cost.get("flops"), "transcendentals": cost.get("transcendentals"),
        "bytes_accessed": cost.get("bytes accessed"), "collectives": collective_counts(hlo),
        "channels": collective_channels(hlo), "program": program_digest(hlo),
        "hlo_instructions": len(re.findall(r"^\s*(?:ROOT )?\S+ = ", hlo, flags=re.MULTILINE)),
        "inputs": len(jax.tree.leaves(compiled.args_info)),
        "parameters": len(jax.tree.leaves(compiled.input_shardings)),  # an input the program does not use has None
        "outputs": len(jax.tree.leaves(compiled.output_shardings)),
    }), flush=True)


def stagetool_side(overrides: str, mesh: str | None = None) -> dict:
    """stagetool report (JSON) and compile (HLO text) of the same step on --topology v5e:2x4."""
    env = dict(os.environ, MAXTEXT_OVERRIDES=overrides, STAGETOOL_NO_CACHE="1")  # a fresh compile
    where = ["--mesh", mesh] if mesh else []  # the mesh MaxText's config makes, when not the spec's
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        subprocess.run([sys.executable, "-m", "stagetool", "report", "maxtext_train_step.py:train_step",
                        "--topology", "v5e:2x4", "--format", "json", "-o", out, *where], cwd=HERE, env=env, check=True)
        doc = json.load(open(out))
    hlo = subprocess.run([sys.executable, "-m", "stagetool", "compile", "maxtext_train_step.py:train_step",
                          "--topology", "v5e:2x4", *where], cwd=HERE, env=env, check=True, capture_output=True,
                         text=True).stdout
    f = doc["functions"][0]
    assert f.get("error") is None, f["error"]
    r, c = f["memory"]["record"], f["cost"]["per_device"]
    kinds: dict[str, int] = {}
    for item in f["collectives"]["items"]:
        kinds[item["collective"]["kind"]] = kinds.get(item["collective"]["kind"], 0) + 1
    return {"argument_bytes": r["argument_bytes"], "output_bytes": r["output_bytes"], "alias_bytes": r["alias_bytes"],
            "temp_bytes": r["temp_bytes"], "generated_code_bytes": r["generated_code_bytes"],
            "peak_bytes": r["peak_bytes_reported"], "flops": c["flops"], "transcendentals": c["transcendentals"],
            "bytes_accessed": c["bytes_accessed"], "collectives": dict(sorted(kinds.items())),
            "hlo_collectives": collective_counts(hlo), "hlo_channels": collective_channels(hlo),
            "program": program_digest(hlo),
            "hlo_instructions": len(re.findall(r"^\s*(?:ROOT )?\S+ = ", hlo, flags=re.MULTILINE)),
            "inputs": len(f["inputs"]), "parameters": sum(x.get("parameter") is not None for x in f["inputs"]),
            "outputs": len(f["outputs"]),
            "mesh": f"{f['mesh']['device_count']} {f['mesh']['platform']}",
            "relaid": [n for n in f["notes"] if "re-laid" in n]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--overrides", default=OVERRIDES)
    ap.add_argument("--json")
    ap.add_argument("--mesh", help="stagetool's --mesh, when the overrides change MaxText's ici_* parallelism "
                    "(all 12 axes: diloco=1,data=1,stage=1,fsdp=4,...,tensor=2,...)")
    ap.add_argument("--maxtext-side", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.maxtext_side:
        maxtext_side(a.overrides)
        return
    child = subprocess.run([sys.executable, __file__, "--maxtext-side", "--overrides", a.overrides],
                           capture_output=True, text=True, check=True)
    line = next(x for x in child.stdout.splitlines() if x.startswith("HEAD_TO_HEAD "))
    mt = json.loads(line[len("HEAD_TO_HEAD "):])
    st = stagetool_side(a.overrides, a.mesh)
    if a.json:
        json.dump({"train_compile": mt, "stagetool": st}, open(a.json, "w"), indent=1)
    print("| figure (per device) | train_compile.py | stagetool | equal |\n|:---|---:|---:|:---:|")
    for key in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "generated_code_bytes",
                "peak_bytes", "flops", "transcendentals", "bytes_accessed", "inputs", "parameters", "outputs",
                "hlo_instructions", "program"):
        x, y = mt[key], st[key]
        fx = f"{x:,.0f}" if isinstance(x, (int, float)) else str(x)
        fy = f"{y:,.0f}" if isinstance(y, (int, float)) else str(y)
        print(f"| {key} | {fx} | {fy} | {'yes' if x == y else 'NO'} |")
    print(f"| collectives (HLO) | {mt['collectives']} | {st['hlo_collectives']} | "
          f"{'yes' if mt['collectives'] == st['hlo_collectives'] else 'NO'} |")
    print(f"| collectives, distinct channel ids | {mt['channels']} | {st['hlo_channels']} | "
          f"{'yes' if mt['channels'] == st['hlo_channels'] else 'NO'} |")
    print(f"| collectives (stagetool's list) | | {st['collectives']} | |")
    if st["relaid"]:
        print("\nstagetool's notes: " + " ".join(st["relaid"]))


if __name__ == "__main__":
    main()
