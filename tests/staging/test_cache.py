"""stagetool.staging.cache: the facts cache (issue 11.2).

A warm run reuses the stored facts and gives the same report as the cold one; anything that changes
what the compile would produce — one sharding, one dtype, the mesh, a compile option, the jax
version — misses; a truncated, corrupt or foreign entry is ignored and rewritten.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import pytest

from helpers import run_subprocess, write
from stagetool.staging.cache import FactsCache, cache_key, resolve_cache_dir
from stagetool.pipeline import REPORT_SECTIONS, Options, Section, analyze
from stagetool.report.model import to_jsonable

MODULE = """
    import jax.numpy as jnp


    def step(w, x):
        return jnp.tanh(x @ w).sum(axis=0)
    """

SPEC = """
    version: 1
    mesh:
      axes: {{data: 2, model: 4}}
    functions:
      step:
        target: m.py:step
        args:
          - '{w}[64,32] @ [null, model]'
          - '{x}[16,64] @ [{xdim}, null]'
    """


@pytest.fixture
def project(tmp_path, monkeypatch, isolated_imports):
    """A module and a spec in ``tmp_path`` (the working directory); ``spec(**changes)`` rewrites the spec."""
    write(tmp_path, "m.py", MODULE)
    monkeypatch.chdir(tmp_path)

    def spec(w="f32", x="f32", xdim="data") -> Path:
        return write(tmp_path, "m.stagetool.yaml", SPEC.format(w=w, x=x, xdim=xdim))

    spec()
    return spec


def _run(cache: Path, mesh: str | None = None, sections=REPORT_SECTIONS, peak: bool = False):
    options = Options(spec=Path("m.stagetool.yaml"), cache_dir=cache, mesh=mesh, peak=peak)
    (f,) = analyze(options, sections).functions
    return f


def _entries(cache: Path) -> list[Path]:
    return sorted((cache / "facts").glob("*/*.json"))


def _without_timings(f) -> dict:
    doc = to_jsonable(f)
    doc.pop("timings"), doc.pop("cached")
    return doc


def test_a_warm_run_reuses_the_facts_and_reports_the_same(project, tmp_path):
    cache = tmp_path / "cache"
    cold = _run(cache)
    assert not cold.cached and cold.timings.compile_s is not None
    assert len(_entries(cache)) == 1
    warm = _run(cache)
    assert warm.cached and warm.timings.compile_s is None  # traced and lowered, not compiled
    assert _without_timings(warm) == _without_timings(cold)
    # independently of stagetool's own records: the cold run's per-device FLOPs are JAX's figure
    # for the same program, so the warm run did not make them up
    assert warm.cost.per_device.flops == cold.cost.per_device.flops > 0


def test_a_cached_run_compiles_nothing(project, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    _run(cache)

    def no_compile(*a, **k):
        raise AssertionError("compiled on a cache hit")

    monkeypatch.setattr(jax.stages.Lowered, "compile", no_compile)
    assert _run(cache).cached


@pytest.mark.parametrize("change", [
    {"w": "bf16"},          # one dtype
    {"xdim": "null"},       # one sharding
    {"mesh": "4x2"},        # the mesh
])
def test_changing_what_the_compile_sees_misses(project, tmp_path, change):
    cache = tmp_path / "cache"
    _run(cache)
    mesh = change.pop("mesh", None)
    project(**change)
    again = _run(cache, mesh=mesh)
    assert not again.cached
    assert len(_entries(cache)) == 2
    assert _run(cache, mesh=mesh).cached  # and the new entry answers the next run


def test_the_jax_version_is_part_of_the_key(project, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    _run(cache)
    monkeypatch.setattr(jax, "__version__", jax.__version__ + ".post1")
    assert not _run(cache).cached


def test_a_compile_option_is_part_of_the_key(project, tmp_path):
    from stagetool.inputs.avals import build_inputs  # noqa: F401 - staged through the public API below
    from stagetool.pipeline import staged_functions

    options = Options(spec=Path("m.stagetool.yaml"))
    ((fspec, inputs, staged),) = list(staged_functions(options, until="lower"))
    from stagetool.pipeline import make_plan, provision_devices

    setup = provision_devices(make_plan(options))
    plain = cache_key(staged.lowered, setup, inputs)
    assert plain == cache_key(staged.lowered, setup, inputs, compiler_options={})
    assert plain != cache_key(staged.lowered, setup, inputs, compiler_options={"xla_cpu_enable_fast_math": True})
    assert plain != cache_key(staged.lowered, setup, inputs, compiler_options={"xla_cpu_enable_fast_math": False})


def _temp_bytes_node(doc: dict) -> int:
    """The table index of the value of ``temp_size_in_bytes`` in an entry's memory figures."""
    table = doc["table"]
    result = table[doc["fields"]["memory"]]  # ["r", "BackendResult", values, error]
    values = table[result[2]]  # ["d", key, index, key, index, ...]
    return dict(zip(values[1::2], values[2::2]))["temp_size_in_bytes"]


def _corrupt(entry: Path, how: str) -> None:
    raw = entry.read_bytes()
    head, _, body = raw.partition(b"\n")
    header = json.loads(head)
    if how == "truncated":
        entry.write_bytes(raw[: len(raw) // 2])
    elif how == "empty":
        entry.write_text("")
    elif how == "tampered":  # valid JSON, a figure changed, the header kept
        doc = json.loads(body)
        doc["table"][doc["fields"]["compiled_text"]] = ["v", "HloModule forged"]
        entry.write_bytes(head + b"\n" + json.dumps(doc, sort_keys=True).encode())
    elif how == "forged":  # a figure changed and the digest recomputed by whoever can compute a sha256
        import hashlib

        doc = json.loads(body)
        doc["table"][_temp_bytes_node(doc)] = ["v", 1]
        new = json.dumps(doc, sort_keys=True).encode()
        header["hmac"] = hashlib.sha256(new).hexdigest()
        entry.write_bytes(json.dumps(header).encode() + b"\n" + new)
    elif how == "schema":
        header["schema"] = 999
        entry.write_bytes(json.dumps(header).encode() + b"\n" + body)


@pytest.mark.parametrize("how", ["truncated", "empty", "tampered", "forged", "schema"])
def test_a_bad_entry_is_ignored_and_rewritten(project, tmp_path, how):
    cache = tmp_path / "cache"
    cold = _run(cache)
    (entry,) = _entries(cache)
    _corrupt(entry, how)
    again = _run(cache)
    assert not again.cached  # never trusted
    assert _without_timings(again) == _without_timings(cold)
    assert json.loads(entry.read_bytes().partition(b"\n")[2])["fields"]  # rewritten whole
    assert _run(cache).cached


def _key_of_current_spec():
    options = Options(spec=Path("m.stagetool.yaml"))
    from stagetool.pipeline import make_plan, provision_devices, staged_functions

    ((fspec, inputs, staged),) = list(staged_functions(options, until="lower"))
    return cache_key(staged.lowered, provision_devices(make_plan(options)), inputs)


def test_a_foreign_entry_is_ignored(project, tmp_path):
    """An entry copied under another key (another function's facts, or a regressed program's key
    given the old program's figures) is not used for it: the HMAC covers the key."""
    cache = tmp_path / "cache"
    _run(cache)
    (entry,) = _entries(cache)
    project(w="bf16")
    key = _key_of_current_spec()
    target = FactsCache.open(cache).path(key)
    target.parent.mkdir(parents=True, exist_ok=True)
    raw = entry.read_bytes()
    head, _, body = raw.partition(b"\n")
    header = json.loads(head)
    header["key"] = key  # the key echoed too: only the HMAC tells
    target.write_bytes(json.dumps(header).encode() + b"\n" + body)
    assert FactsCache.open(cache).load(key) is None
    assert not _run(cache).cached


def test_the_peak_comes_from_an_entry_that_holds_it(project, tmp_path):
    """An entry written without the peak dump does not answer ``memory --peak``; the dump compile
    rewrites it, and the next peak run is a hit with the same buffers."""
    cache = tmp_path / "cache"
    _run(cache, sections=[Section.MEMORY])
    first = _run(cache, sections=[Section.MEMORY], peak=True)
    assert not first.cached and first.memory.peak is not None and first.memory.peak.buffers
    second = _run(cache, sections=[Section.MEMORY], peak=True)
    assert second.cached and second.memory.peak == first.memory.peak
    # the buffer assignment travels with the entry: the memory timeline of a hit is the compile's
    assert first.memory.timeline and first.memory.timeline_peak.reason is None
    assert (second.memory.timeline, second.memory.timeline_peak) == (first.memory.timeline, first.memory.timeline_peak)
    assert _run(cache, sections=[Section.MEMORY]).cached  # the peak entry answers a run without it


def test_the_propagation_behind_the_causes_is_cached_with_the_entry(project, tmp_path, monkeypatch):
    """Shardy's rerun propagation (issue 22's causes) depends on the lowered module only: a warm run
    takes it from the entry; an entry written without it (a memory run with the peak dump) gets it from
    the first collectives run, which keeps the entry's peak dump."""
    import stagetool.staging.shardy as shardy

    cache = tmp_path / "cache"
    calls = []
    real = shardy.propagate_lowered
    monkeypatch.setattr(shardy, "propagate_lowered", lambda lowered, **k: calls.append(1) or real(lowered, **k))
    peak = _run(cache, sections=[Section.MEMORY], peak=True)
    assert not calls and peak.memory.peak.buffers
    cold = _run(cache, sections=[Section.COLLECTIVES])
    assert cold.cached and len(calls) == 1  # computed once, and the entry rewritten with it
    causes = [c.cause for c in cold.collectives.items]
    assert causes and all(c is not None for c in causes)
    warm = _run(cache, sections=[Section.COLLECTIVES])
    assert warm.cached and len(calls) == 1  # from the entry
    assert _without_timings(warm) == _without_timings(cold)
    again = _run(cache, sections=[Section.MEMORY], peak=True)
    assert again.cached and again.memory.peak == peak.memory.peak  # the dump survived the rewrite
    assert len(_entries(cache)) == 1


def test_an_entry_holds_each_distinct_value_once_and_reads_back_equal(project, tmp_path, monkeypatch):
    """The payload is a table of distinct values (``codec.pack``): the facts read back are equal to the
    ones the compile gave, field by field; a source frame repeated on many ops is one table node; the
    mutable values (cost dicts) come back as objects of their own, never shared."""
    from stagetool.staging import cache as cache_module
    from stagetool.facts import StagedFunction

    stored = {}
    real_store = FactsCache.store
    monkeypatch.setattr(FactsCache, "store",
                        lambda self, key, facts, *a, **k: stored.setdefault(key, facts) and real_store(self, key, facts, *a, **k))
    _run(tmp_path / "cache", sections=[Section.COLLECTIVES])
    ((key, facts),) = stored.items()
    assert isinstance(facts, StagedFunction) and facts.propagation is not None
    from stagetool.core.paths import report_root

    # read back as the pipeline does, with the run's report root (the entry writes it as a token)
    got = FactsCache.open(tmp_path / "cache").load(key, root=report_root(Path("m.stagetool.yaml")))
    for name in cache_module._CACHED_FIELDS:
        assert got.fields[name] == (None if name == "peak" else getattr(facts, name)), name

    payload = json.loads(cache_module.FactsCache.open(tmp_path / "cache").path(key).read_bytes().partition(b"\n")[2])
    frames = [n for n in payload["table"] if n[:2] == ["r", "SourceFrame"]]
    distinct = {f for op in facts.propagation.ops for f in op.frames}
    assert len(frames) == len(distinct) and sum(len(op.frames) for op in facts.propagation.ops) > len(distinct)
    assert payload["records"]["SourceFrame"] == [f.name for f in dataclasses.fields(type(next(iter(distinct))))]
    whole, per_device = got.fields["whole_program_cost"].values, got.fields["per_device_cost"].values
    assert whole is not None and per_device is not None and whole is not per_device


@pytest.mark.parametrize("damage", ["forward reference", "record fields changed", "unknown tag"])
def test_a_signed_payload_of_the_wrong_shape_is_a_miss(project, tmp_path, damage):
    """A payload that passes the HMAC (as if an older stagetool had written it) but is not a table
    :func:`stagetool.core.codec.pack` writes is a miss, never an error or a misread record."""
    cache = tmp_path / "cache"
    _run(cache)
    (entry,) = _entries(cache)
    facts = FactsCache.open(cache)
    key = entry.stem
    doc = json.loads(entry.read_bytes().partition(b"\n")[2])
    if damage == "forward reference":
        doc["table"][0] = ["t", len(doc["table"]) - 1]
    elif damage == "record fields changed":
        doc["records"]["LeafFacts"] = list(reversed(doc["records"]["LeafFacts"]))
    else:
        doc["table"][0] = ["x", 1]
    body = json.dumps(doc).encode()
    header = {"kind": "stagetool-facts", "schema": json.loads(entry.read_bytes().partition(b"\n")[0])["schema"],
              "key": key, "hmac": facts._mac(key, body)}
    entry.write_bytes(json.dumps(header).encode() + b"\n" + body)
    assert facts.load(key) is None


def test_resolve_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("STAGETOOL_NO_CACHE", raising=False)
    monkeypatch.setenv("STAGETOOL_CACHE_DIR", str(tmp_path / "env"))
    assert resolve_cache_dir() == tmp_path / "env"
    assert resolve_cache_dir(tmp_path / "opt") == tmp_path / "opt"
    assert resolve_cache_dir(tmp_path / "opt", no_cache=True) is None
    monkeypatch.setenv("STAGETOOL_NO_CACHE", "1")
    assert resolve_cache_dir() is None
    monkeypatch.delenv("STAGETOOL_NO_CACHE")
    monkeypatch.delenv("STAGETOOL_CACHE_DIR")
    import platformdirs

    assert resolve_cache_dir() == Path(platformdirs.user_cache_dir("stagetool"))


def _mesh_line(text: str) -> str:
    """The report header's mesh line (the stage timings); XLA:CPU's one-line statement comes before it."""
    (line,) = [ln for ln in text.splitlines() if ln.startswith("mesh ")][:1]
    return line


@pytest.mark.slow
def test_cli_warm_snapshot_is_identical_and_memory_keeps_the_peak_after_compile(tmp_path):
    """Whole processes, as a user runs them: the warm snapshot's bytes equal the cold one's; the
    text report says "(cached)"; ``memory`` after ``compile`` still lists the buffers live at the
    peak; JAX's own persistent cache is not used (issue 25: it ignores source lines)."""
    write(tmp_path, "m.py", MODULE)
    write(tmp_path, "m.stagetool.yaml", SPEC.format(w="f32", x="f32", xdim="data"))
    cache = tmp_path / "cache"
    common = ("--spec", tmp_path / "m.stagetool.yaml", "--cache-dir", cache)
    for name in ("cold", "warm"):
        r = run_subprocess("snapshot", *common, "-o", tmp_path / f"{name}.json", cwd=tmp_path)
        assert r.code == 0, r.stderr
    assert (tmp_path / "cold.json").read_bytes() == (tmp_path / "warm.json").read_bytes()
    r = run_subprocess("report", *common, cwd=tmp_path)
    assert r.code == 0 and "compile (cached)" in _mesh_line(r.stdout), r.stdout

    other = tmp_path / "cache2"
    r = run_subprocess("compile", "--spec", tmp_path / "m.stagetool.yaml", "--cache-dir", other, cwd=tmp_path)
    assert r.code == 0, r.stderr
    assert not (other / "jax").exists()
    r = run_subprocess("memory", "--spec", tmp_path / "m.stagetool.yaml", "--cache-dir", other, "--format", "json",
                       cwd=tmp_path)
    assert r.code == 0, r.stderr
    peak = r.json()["functions"][0]["memory"]["peak"]
    assert peak is not None and peak["buffers"], peak


def test_facts_the_format_cannot_hold_are_not_cached(project, tmp_path, monkeypatch):
    """A backend result of an unexpected type is not written (nor guessed at); the run still works."""
    cache = tmp_path / "cache"
    from stagetool.staging import gather as facts_module

    real = facts_module.cost_result
    monkeypatch.setattr(facts_module, "cost_result",
                        lambda stage: dataclasses.replace(real(stage), values={"flops": object()}))
    first = _run(cache, sections=[Section.SHARDINGS])
    assert not first.cached and _entries(cache) == []


def test_a_compile_only_topology_spanning_hosts_is_cached(project, tmp_path):
    """v5p:2x2x2 spans two hosts, but a compile-only topology is compiled in this one process: its
    facts are cached like a CPU mesh's (before, such runs never used the cache)."""
    from stagetool.devices import tpu_topology as topology

    if not topology.libtpu_available():
        pytest.skip("libtpu not installed")
    cache = tmp_path / "cache"
    options = Options(spec=Path("m.stagetool.yaml"), cache_dir=cache, topology="v5p:2x2x2")
    (cold,) = analyze(options, REPORT_SECTIONS).functions
    assert cold.mesh.process_count == 2 and not cold.cached and cold.error is None
    (warm,) = analyze(options, REPORT_SECTIONS).functions
    assert warm.cached and _without_timings(warm) == _without_timings(cold)


@pytest.mark.slow
def test_a_linen_train_state_pinned_like_its_input_hits_the_cache_in_a_second_process(tmp_path):
    """The README's Linen step (``out_shardings: [{like: 0}, replicated]`` over a ``TrainState``):
    the fitted out_shardings tree holds ``apply_fn`` (a bound method) and optax closures, whose
    ``repr`` has memory addresses; the key describes the tree by its leaf paths and shardings, so a
    second process finds the first one's entry (before: a miss and a new entry every run)."""
    from helpers import EXAMPLES

    cache = tmp_path / "cache"
    runs = [run_subprocess("shardings", f"{EXAMPLES / 'linen_lm.py'}:train_step", "--cache-dir", cache,
                           cwd=tmp_path) for _ in range(2)]
    assert all(r.code == 0 for r in runs), [r.stderr for r in runs]
    assert "compile (cached)" not in _mesh_line(runs[0].stdout), runs[0].stdout
    assert "compile (cached)" in _mesh_line(runs[1].stdout), runs[1].stdout
    assert len(_entries(cache)) == 1


def test_the_key_of_a_tree_with_functions_in_its_static_fields_holds_no_address():
    """A pytree whose aux data holds a closure: described by leaf paths and shardings, the same for
    two closures made at two addresses (as in two processes)."""
    import flax.struct

    from stagetool.core.sharding import Sharding
    from stagetool.staging.cache import _key_part

    @flax.struct.dataclass
    class State:
        params: dict
        apply_fn: object = flax.struct.field(pytree_node=False)

    def make():
        return lambda x: x  # a new function object (another address) each call

    s = Sharding("spec", ("data", None))
    a, b = State({"w": s, "b": None}, make()), State({"w": s, "b": None}, make())
    assert "0x" not in json.dumps(_key_part(a))
    assert _key_part(a) == _key_part(b)
    assert _key_part(a) != _key_part(State({"w": None, "b": None}, make()))


# ---- issue 25: a cache that cannot be made to lie ------------------------------------------------------


@pytest.mark.parametrize("setting", [("jax_exec_time_optimization_effort", -1.0), ("jax_memory_fitting_effort", 1.0),
                                     ("jax_optimization_level", "O0"), ("jax_disable_most_optimizations", True)])
def test_a_compile_setting_of_jax_is_part_of_the_key(project, tmp_path, setting):
    """JAX_OPTIMIZATION_LEVEL=O0 / JAX_EXEC_TIME_OPTIMIZATION_EFFORT=-1 become these jax.config values,
    which JAX turns into compile options (a TPU topology's peak changed 2.5x under them)."""
    name, value = setting
    before = _key_of_current_spec()
    old = jax.config.values[name]
    jax.config.update(name, value)
    try:
        assert _key_of_current_spec() != before
    finally:
        jax.config.update(name, old)
    assert _key_of_current_spec() == before


@pytest.mark.parametrize("var", ["XLA_FLAGS", "LIBTPU_INIT_ARGS", "XLA_PYTHON_CLIENT_MEM_FRACTION"])
def test_the_environment_xla_reads_is_part_of_the_key(project, tmp_path, monkeypatch, var):
    before = _key_of_current_spec()
    monkeypatch.setenv(var, "--xla_dump_hlo_pass_re=none" if var != "XLA_PYTHON_CLIENT_MEM_FRACTION" else ".5")
    assert _key_of_current_spec() != before


def test_a_world_writable_folder_is_not_used_with_one_warning(project, tmp_path, capsys):
    cache = tmp_path / "shared"
    cache.mkdir()
    cache.chmod(0o777)
    assert _run(cache).cached is False and _run(cache).cached is False
    assert not (cache / "facts").exists()
    err = capsys.readouterr().err
    assert err.count("warning: the facts cache is not used") == 1 and "writable by others (mode 0777)" in err


def test_a_folder_of_another_user_is_not_used(tmp_path):
    import os

    if os.geteuid() != 0:
        pytest.skip("needs root to give a folder away")
    cache = tmp_path / "theirs"
    cache.mkdir(mode=0o755)
    os.chown(cache, 65534, 65534)
    assert FactsCache.open(cache) is None


def test_a_key_file_others_can_read_stops_the_cache(project, tmp_path, monkeypatch, capsys):
    from stagetool.staging import cache as cache_module

    key = tmp_path / "cfg" / "k"
    monkeypatch.setenv("STAGETOOL_CACHE_KEY_FILE", str(key))
    monkeypatch.setattr(cache_module, "_SECRETS", {})
    assert FactsCache.open(tmp_path / "c1") is not None and key.stat().st_mode & 0o777 == 0o600
    key.chmod(0o644)
    monkeypatch.setattr(cache_module, "_SECRETS", {})
    assert FactsCache.open(tmp_path / "c1") is None
    assert "chmod 600" in capsys.readouterr().err


def test_entries_that_are_links_fifos_devices_or_deep_are_misses_without_reading(project, tmp_path):
    import os

    cache = tmp_path / "cache"
    _run(cache)
    (entry,) = _entries(cache)
    key = entry.stem
    good = entry.read_bytes()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    facts = FactsCache.open(cache)
    for plant in ("link", "fifo", "dev_zero", "deep"):
        entry.unlink()
        if plant == "link":
            copy = tmp_path / "copy.json"
            copy.write_bytes(good)
            entry.symlink_to(copy)  # even a link to a valid entry is not followed
        elif plant == "fifo":
            os.mkfifo(entry)
        elif plant == "dev_zero":
            entry.symlink_to("/dev/zero")
        else:
            entry.write_text("[" * 1_000_000)
        assert facts.load(key) is None, plant
    entry.unlink()
    entry.symlink_to(victim)
    again = _run(cache)  # a miss: compiled, and the entry written over the link, not through it
    assert not again.cached and victim.read_text() == "precious\n" and not entry.is_symlink()
    assert _run(cache).cached


def test_empty_cache_dir_is_exit_2(run_cli, project):
    r = run_cli("cost", "--cache-dir", "", check=2)
    assert "--cache-dir ''" in r.stderr


@pytest.mark.slow
def test_a_moved_line_is_a_miss_and_reports_the_new_line(tmp_path):
    """The op's source line follows the edit (JAX's persistent cache, keyed without locations, is not used)."""
    write(tmp_path, "m.py", MODULE)
    write(tmp_path, "m.stagetool.yaml", SPEC.format(w="f32", x="f32", xdim="data"))
    common = ("collectives", "--spec", tmp_path / "m.stagetool.yaml", "--cache-dir", tmp_path / "cache",
              "--format", "json")
    lines = []
    for shift in (0, 3):
        import textwrap

        (tmp_path / "m.py").write_text("\n" * shift + textwrap.dedent(MODULE).lstrip("\n"))
        r = run_subprocess(*common, cwd=tmp_path)
        assert r.code == 0, r.stderr
        text = json.dumps(r.json())
        lines.append(sorted(set(__import__("re").findall(r"m\.py:(\d+)", text))))
    assert lines[0] and lines[1] == [str(int(n) + 3) for n in lines[0]]



#: a script calling the Python API (run in a fresh process: its frames are the few above stagetool's)
API_SCRIPT = """
import json
import sys
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)
from stagetool.pipeline import Options, Section, analyze, take_snapshot
from stagetool.report.model import to_jsonable
{padding}
def {caller}():
    cache = Path(sys.argv[1]) if sys.argv[1] != "-" else None
    options = Options(spec=Path("model.stagetool.yaml"), cache_dir=cache, why=(None, None, 1))
    (f,) = analyze(options, (Section.SHARDINGS, Section.COLLECTIVES, Section.MEMORY, Section.COST,
                             Section.WHY)).functions
    doc = to_jsonable(f)
    doc.pop("timings")
    print(json.dumps({{"cached": doc.pop("cached"), "report": doc, "snapshot": take_snapshot(options).snapshot}}))

{caller}()
"""


def _api_script(tmp_path: Path, name: str, cache: Path | None) -> dict:
    import os
    import subprocess
    import sys

    from helpers import REPO

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES", "STAGETOOL_NO_CACHE")}
    env.update(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, name, str(cache) if cache else "-"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_python_api_callers_share_entries_and_show_none_of_their_frames(tmp_path):
    """The key keeps each op's frames from the user's function inward only: two scripts calling the
    Python API on one spec (other names, a line added above the call) share one entry, and the hit's
    report and snapshot equal the second script's own uncached run: no first script's frame comes back."""
    from helpers import CAUSES_MODEL, CAUSES_SPEC

    write(tmp_path, "model.py", CAUSES_MODEL)
    write(tmp_path, "model.stagetool.yaml", CAUSES_SPEC)
    (tmp_path / "one.py").write_text(API_SCRIPT.format(padding="", caller="first"))
    (tmp_path / "two.py").write_text(API_SCRIPT.format(padding="\nX = 1  # a line added above the call\n",
                                                       caller="second_script"))
    cache = tmp_path / "cache"
    first = _api_script(tmp_path, "one.py", cache)
    assert not first["cached"] and len(_entries(cache)) == 1
    hit = _api_script(tmp_path, "two.py", cache)
    assert hit["cached"] and len(_entries(cache)) == 1
    own = _api_script(tmp_path, "two.py", None)
    assert not own["cached"]
    assert hit["report"] == own["report"] and hit["snapshot"] == own["snapshot"]
    # the collectives are there and explained, so the frames had somewhere to show
    items = own["report"]["collectives"]["items"]
    assert [x["collective"]["kind"] for x in items] == ["all-gather", "all-reduce"]
    assert all(x["cause"] is not None for x in items)
    assert "one.py" not in json.dumps(hit) and "two.py" not in json.dumps(own)
