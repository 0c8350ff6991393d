"""The facts cache: a function's compiled facts, keyed by what determines them, so a rerun skips the compile.

Compiling is almost the whole cost of a run, and most runs of the CI gate stage functions that did
not change. What analysis reads about a compiled function (the compiled text, shardings, cost,
memory, the peak dump: the compile-derived fields of :class:`~stagetool.lowering.facts.StagedFunction`)
is plain data, so it is stored here as one JSON entry per function and reused when the key matches.

The key (:func:`cache_key`) is a sha256 over:

- the lowered module's text (``Lowered.as_text()``): the program, its input/output shardings and
  donation (``mhlo.sharding``, ``tf.aliasing_output``); and the source locations of its ops
  (from ``as_text(debug_info=True)``, without stagetool's own frames, :func:`source_locations`), which
  the compiled module's metadata — the source line of each collective — follows;
- the compile options, and the target's own jit's ``compiler_options`` (:func:`target_compiler_options`);
- the platform, device kind, topology, the mesh's device ids in mesh order and its process layout
  (for a compile-only GPU target also the sha256 of its target config and the CUDA plugin's version);
- what the spec says about each leaf that the facts echo (path, declared sharding, local shape,
  source, donation) and the declared output shardings (a pytree as its leaves' key paths and
  shardings, never a ``repr`` with memory addresses: :func:`_key_part`);
- ``XLA_FLAGS`` / ``LIBTPU_INIT_ARGS``, and the jax, jaxlib, libtpu and stagetool versions, and
  :data:`CACHE_SCHEMA`.

An entry is a self-describing JSON document (no pickle), written atomically
(:func:`stagetool.core.fileio.write_atomic`: concurrent writers of the same key each replace the
file whole). On read it is checked — schema, the key echoed, a sha256 of the payload, the type of
every field — and anything off (truncated, corrupt, foreign, older schema) is a miss: the function
is compiled and the entry rewritten. Nothing in an entry is trusted before it passes.

Where it lives: :func:`resolve_cache_dir` (``--cache-dir``, ``STAGETOOL_CACHE_DIR``, else the user
cache folder from ``platformdirs``; ``--no-cache`` or ``STAGETOOL_NO_CACHE=1`` turn it off). JAX's
own persistent compilation cache goes in its ``jax`` sub-folder (:func:`enable_jax_cache`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from stagetool.core.sharding import Sharding
from stagetool.lowering.facts import BackendResult, LeafFacts, StagedFunction
from stagetool.hlo.buffers import Allocation, AssignedBuffer, BufferAssignment, LogicalBuffer
from stagetool.lowering.stages import PeakDump

CACHE_SCHEMA = 2
"""Version of the entry format and of the key's contents; bump it when either changes."""

ENTRY_KIND = "stagetool-facts"

#: the StagedFunction fields an entry holds: everything the compile determines
_CACHED_FIELDS = ("compiled_text", "whole_program_cost", "per_device_cost", "memory", "inputs", "outputs", "peak")


def resolve_cache_dir(cache_dir: str | Path | None = None, *, no_cache: bool = False) -> Path | None:
    """The facts cache folder, or None when the cache is off.

    In order: ``no_cache`` (``--no-cache``) → off; ``cache_dir`` (``--cache-dir``); the environment:
    ``STAGETOOL_NO_CACHE`` set to anything but ``""``/``0`` → off, ``STAGETOOL_CACHE_DIR``; else the user
    cache folder (``platformdirs.user_cache_dir("stagetool")``).
    """
    if no_cache:
        return None
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get("STAGETOOL_NO_CACHE", "") not in ("", "0"):
        return None
    if os.environ.get("STAGETOOL_CACHE_DIR"):
        return Path(os.environ["STAGETOOL_CACHE_DIR"])
    import platformdirs

    return Path(platformdirs.user_cache_dir("stagetool"))


def enable_jax_cache(folder: Path) -> None:
    """Turn on JAX's persistent compilation cache in ``folder/jax`` for this process (every compile kept).

    Call it before the process's first compile: JAX decides once per process whether the cache is
    used. A compile with XLA's dump must not come from this cache (XLA writes no dump for an
    executable it did not compile), so processes that take the peak dump leave it off.
    """
    import jax

    path = Path(folder) / "jax"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return  # an unwritable cache is no cache, not an error
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# ---- the key ---------------------------------------------------------------------------------------


def versions() -> dict[str, str | None]:
    """jax, jaxlib, libtpu (None when not installed) and stagetool versions: part of every key."""
    import importlib.metadata

    import jax
    import jaxlib

    from stagetool._version import __version__

    libtpu = None
    for dist in ("libtpu", "libtpu-nightly"):
        try:
            libtpu = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "libtpu": libtpu, "stagetool": __version__}


def cache_key(lowered: Any, setup: Any, inputs: Any, *, declared_outputs: Any = None,
              compiler_options: dict | None = None) -> str:
    """The sha256 hex digest naming one function's entry (see the module docstring for what goes in).

    Args:
      lowered: the ``jax.stages.Lowered``.
      setup: the :class:`~stagetool.lowering.devices.DeviceSetup`.
      inputs: the :class:`~stagetool.lowering.avals.AbstractInputs`.
      declared_outputs: the spec's ``out_shardings`` tree.
      compiler_options: the options passed to ``Lowered.compile``.

    Whether the entry holds the live-range dump is not part of the key: an entry without it does
    not answer a request for the peak (:meth:`FactsCache.load`), and that request's compile rewrites
    the entry with the dump.
    """
    text = lowered.as_text()
    description = {
        "schema": CACHE_SCHEMA,
        "module_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "source_locations": source_locations(lowered.as_text(debug_info=True)),
        "compiler_options": sorted((str(k), repr(v)) for k, v in (compiler_options or {}).items()),
        "platform": setup.platform,
        "device_kind": setup.device_kind,
        "topology": setup.topology,
        "device_ids": [int(d.id) for d in setup.devices],
        "process_of_device": list(setup.process_of_device),
        "leaves": [[x.path, list(x.shape), x.dtype, _key_part(x.declared), _key_part(x.local_shape), x.source,
                    bool(x.donated)] for x in inputs.leaves],
        "declared_outputs": _key_part(declared_outputs),
        "environment": {k: os.environ.get(k) for k in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")},
        "versions": versions(),
        "target_compiler_options": target_compiler_options(inputs),
    }
    if getattr(setup, "target_config_sha256", None) is not None:  # a compile-only GPU target: what XLA compiled for
        from stagetool.lowering.gpu_topology import cuda_plugin_version

        description["gpu_target"] = {"config_sha256": setup.target_config_sha256, "plugin": cuda_plugin_version()}
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode("utf-8")).hexdigest()


def target_compiler_options(inputs: Any) -> list[list[str]]:
    """The target's own ``jax.jit(compiler_options=...)`` (``inputs.jit``), as sorted ``[name, value]``
    pairs: part of the key, since ``Lowered.compile`` applies them and the lowered text does not
    show them (a pass-disabling option changes the program, not the module text)."""
    from stagetool.lowering.jit_wrapper import options_text

    return [list(pair) for pair in options_text(getattr(inputs, "jit", None))]


_FILE_LOCATION = re.compile(r'loc\("((?:[^"\\]|\\.)*)":(\d+):(\d+)(?: to (\d*):?(\d+))?\)')


def _callers_dirs() -> tuple[str, ...]:
    """Folders of the code that calls the user's function: stagetool, and its CLI's typer (and click)."""
    import importlib.util

    dirs = [str(Path(__file__).resolve().parents[1])]
    for name in ("typer", "click"):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.origin:
            dirs.append(str(Path(spec.origin).resolve().parent))
    return tuple(dirs)


def source_locations(debug_text: str) -> list[str]:
    """The source locations (``file:line:col``) a lowered module's ops carry, without the frames of
    stagetool and its CLI: the compiled module's metadata (the source line of each collective)
    follows them, but how stagetool was called (``report`` or ``snapshot``, a worker process) does not
    change the program."""
    skip = _callers_dirs()
    found = set()
    for m in _FILE_LOCATION.finditer(debug_text):
        path = m.group(1)
        if path.startswith("<frozen") or any(path.startswith(d) for d in skip):
            continue
        found.add(m.group(0))
    return sorted(found)


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _key_part(value: Any) -> Any:
    """``value`` (a spec value: a sharding, a shape, a fitted ``out_shardings`` tree) as JSON that is
    the same in every process for the same value.

    Plain values and records are encoded as in an entry. Anything else is a pytree (a Flax
    ``TrainState`` fitted by ``out_shardings: {like: 0}``, whose static fields hold bound methods and
    optax closures): it is described by its leaves' key paths and their shardings, never by its
    ``repr``, which holds memory addresses that change every run (the key would never match again).
    """
    try:
        return _encode(value)
    except TypeError:
        pass
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(value, is_leaf=lambda x: x is None or isinstance(x, Sharding))
    return {"$leaves": [[jax.tree_util.keystr(path), _leaf_part(leaf)] for path, leaf in flat]}


def _leaf_part(leaf: Any) -> Any:
    try:
        return _encode(leaf)
    except TypeError:
        return _ADDRESS.sub("", repr(leaf))  # an unknown leaf: its text, without the addresses


# ---- the store -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CachedFacts:
    """What an entry gives back: the compile-derived fields, and the compile's warnings."""

    fields: dict[str, Any]
    compile_warnings: tuple[str, ...]


class FactsCache:
    """The entries under one folder: ``<folder>/facts/<key[:2]>/<key>.json``."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)

    def path(self, key: str) -> Path:
        return self.folder / "facts" / key[:2] / f"{key}.json"

    def load(self, key: str, *, peak: bool = False) -> CachedFacts | None:
        """The entry of ``key`` if it is present and valid (and holds the peak dump when ``peak``); else None."""
        try:
            raw = self.path(key).read_text(encoding="utf-8")
            return _decode_entry(json.loads(raw), key, peak=peak)
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None

    def store(self, key: str, facts: StagedFunction, compile_warnings: tuple[str, ...] = ()) -> bool:
        """Write the entry of ``key`` atomically; False (and nothing written) when the folder is not
        writable or a fact is of a kind the entry format does not hold."""
        from stagetool.core.fileio import write_atomic

        try:
            payload = {"fields": {name: _encode(getattr(facts, name)) for name in _CACHED_FIELDS},
                       "compile_warnings": list(compile_warnings)}
            body = json.dumps(payload, sort_keys=True)
        except (TypeError, ValueError):
            return False  # facts this format cannot hold exactly are not cached
        entry = {"kind": ENTRY_KIND, "schema": CACHE_SCHEMA, "key": key,
                 "payload_sha256": hashlib.sha256(body.encode("utf-8")).hexdigest(), "payload": payload}
        path = self.path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(entry, sort_keys=True) + "\n")
        except OSError:
            return False
        return True


def _decode_entry(entry: Any, key: str, *, peak: bool) -> CachedFacts | None:
    if not isinstance(entry, dict) or entry.get("kind") != ENTRY_KIND or entry.get("schema") != CACHE_SCHEMA:
        return None
    if entry.get("key") != key:
        return None  # a foreign entry (copied or renamed): never trusted
    payload = entry.get("payload")
    body = json.dumps(payload, sort_keys=True)
    if hashlib.sha256(body.encode("utf-8")).hexdigest() != entry.get("payload_sha256"):
        return None
    raw = payload["fields"]
    if not isinstance(raw, dict) or set(raw) != set(_CACHED_FIELDS):
        return None
    fields = {name: _decode(raw[name]) for name in _CACHED_FIELDS}
    warnings = payload["compile_warnings"]
    if not (isinstance(warnings, list) and all(isinstance(w, str) for w in warnings)):
        return None
    if not _valid(fields):
        return None
    if peak and fields["peak"] is None:
        return None  # the entry was written by a run that did not take the dump
    if not peak:
        fields["peak"] = None
    return CachedFacts(fields, tuple(warnings))


# ---- encoding: plain JSON, tuples and the known records tagged ----------------------------------

_RECORDS: dict[str, type] = {cls.__name__: cls for cls in (LeafFacts, BackendResult, PeakDump, Sharding,
                                                            BufferAssignment, LogicalBuffer, Allocation,
                                                            AssignedBuffer)}


def _encode(value: Any) -> Any:
    """JSON values for the facts: records as ``{"$record": name, fields...}``, tuples as ``{"$tuple": [...]}``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        name = type(value).__name__
        if _RECORDS.get(name) is not type(value):
            raise TypeError(f"cannot cache a {name}")
        return {"$record": name, **{f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, tuple):
        return {"$tuple": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value) or "$record" in value or "$tuple" in value:
            raise TypeError("cannot cache a mapping with non-string or reserved keys")
        return {k: _encode(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot cache a {type(value).__name__}")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if "$tuple" in value:
            if set(value) != {"$tuple"} or not isinstance(value["$tuple"], list):
                raise ValueError("bad tuple")
            return tuple(_decode(v) for v in value["$tuple"])
        if "$record" in value:
            cls = _RECORDS[value["$record"]]  # KeyError: an unknown record is a bad entry
            names = {f.name for f in dataclasses.fields(cls)}
            given = {k: v for k, v in value.items() if k != "$record"}
            if set(given) != names:
                raise ValueError(f"bad {cls.__name__} fields")
            return cls(**{k: _decode(v) for k, v in given.items()})
        return {k: _decode(v) for k, v in value.items()}
    return value


def _is(value: Any, *types: type) -> bool:
    return isinstance(value, types) and not (isinstance(value, bool) and bool not in types)


def _ints(value: Any) -> bool:
    return isinstance(value, tuple) and all(_is(v, int) for v in value)


def _valid_sharding(s: Any) -> bool:
    return (isinstance(s, Sharding) and s.kind in ("spec", "auto", "unspecified", "other")
            and isinstance(s.dims, tuple) and (s.text is None or isinstance(s.text, str))
            and all(d is None or isinstance(d, str) or (isinstance(d, tuple) and all(isinstance(a, str) for a in d))
                    for d in s.dims))


def _valid_leaf(x: Any, *, output: bool) -> bool:
    return (isinstance(x, LeafFacts) and isinstance(x.path, str) and _ints(x.shape) and isinstance(x.dtype, str)
            and _valid_sharding(x.declared) and (x.compiled is None or _valid_sharding(x.compiled))
            and (x.shard_shape is None or _ints(x.shard_shape)) and isinstance(x.donated, bool)
            and (x.local_shape is None or _ints(x.local_shape)) and (x.source is None or isinstance(x.source, str))
            and (x.parameter is None or _is(x.parameter, int))
            and (x.padded_bytes_per_device is None or _is(x.padded_bytes_per_device, int))
            and (not output or x.parameter is None))


def _valid_result(r: Any, *, memory: bool) -> bool:
    if not isinstance(r, BackendResult) or not (r.error is None or isinstance(r.error, str)):
        return False
    v = r.values
    if v is None:
        return True
    if memory:
        return isinstance(v, dict) and all(_is(n, int) for n in v.values())
    dicts = v if isinstance(v, list) else [v]
    return all(isinstance(d, dict) and all(_is(n, int, float) for n in d.values()) for d in dicts)


def _valid(f: dict[str, Any]) -> bool:
    peak = f["peak"]
    return (isinstance(f["compiled_text"], str)
            and _valid_result(f["whole_program_cost"], memory=False) and _valid_result(f["per_device_cost"], memory=False)
            and _valid_result(f["memory"], memory=True)
            and isinstance(f["inputs"], tuple) and all(_valid_leaf(x, output=False) for x in f["inputs"])
            and isinstance(f["outputs"], tuple) and all(_valid_leaf(x, output=True) for x in f["outputs"])
            and (peak is None or (isinstance(peak, PeakDump) and isinstance(peak.module_text, str)
                                  and (peak.live_range_text is None or isinstance(peak.live_range_text, str))
                                  and (peak.compile_seconds is None or _is(peak.compile_seconds, int, float))
                                  and (peak.reason is None or isinstance(peak.reason, str))
                                  and (peak.buffers_reason is None or isinstance(peak.buffers_reason, str))
                                  and (peak.buffers is None or _valid_buffers(peak.buffers)))))


def _valid_buffers(b: Any) -> bool:
    """A cached buffer assignment is well-typed (the heap-simulator events are never cached)."""
    return (isinstance(b, BufferAssignment) and isinstance(b.module, str) and isinstance(b.entry, str)
            and b.traces == ()
            and isinstance(b.buffers, tuple) and all(
                isinstance(x, LogicalBuffer) and _is(x.id, int) and _is(x.size, int) and isinstance(x.instruction, str)
                and _ints(x.shape_index) and _is(x.color, int) for x in b.buffers)
            and isinstance(b.allocations, tuple) and all(
                isinstance(a, Allocation) and all(_is(getattr(a, n), int) for n in ("index", "size", "color"))
                and all(isinstance(getattr(a, n), bool) for n in ("is_thread_local", "is_tuple", "is_constant",
                                                                   "maybe_live_out"))
                and (a.parameter_number is None or _is(a.parameter_number, int))
                and isinstance(a.assigned, tuple)
                and all(isinstance(x, AssignedBuffer) and _ints((x.buffer_id, x.offset, x.size)) for x in a.assigned)
                for a in b.allocations))
