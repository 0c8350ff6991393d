"""The facts cache: a function's compiled facts, keyed by what determines them, so a rerun skips the compile.

Compiling is almost the whole cost of a run, and most runs of the CI gate stage functions that did
not change. What analysis reads about a compiled function (the compiled text, shardings, cost,
memory, the peak dump: the compile-derived fields of :class:`~stagetool.facts.StagedFunction`)
is plain data, so it is stored here as one JSON entry per function and reused when the key matches.
Paths below the report root are stored from ``<stagetool-root>`` too and read back as the current
run's root, so an entry written in one checkout reads in another as that checkout's compile would.
So is Shardy's propagation rerun with sharding origins (:mod:`stagetool.staging.shardy`, about
half of a warm run's own time on the transformer example): it depends on the lowered module and its
source locations only, both in the key. An entry written by a run that did not explain collectives
holds none; the first run that does computes it and rewrites the entry.

The key (:func:`cache_key`) is a sha256 over:

- the lowered module's text (``Lowered.as_text()``): the program, its input/output shardings and
  donation (``mhlo.sharding``, ``tf.aliasing_output``); and the source locations of its ops
  (from ``as_text(debug_info=True)``, each op's call chain from the user's function inward: cut at
  its first frame of stagetool or its CLI, so how stagetool was called — the CLI, a worker, a script
  calling the Python API, and where in it — is not in it, :func:`source_locations`), which
  the compiled module's metadata — the source line of each collective — follows; paths below the
  report root (the spec's folder, :mod:`stagetool.core.paths`) are written from ``<stagetool-root>``,
  so the same project in another folder has the same key;
- the compile options, and the target's own jit's ``compiler_options`` (:func:`target_compiler_options`);
- the platform, device kind, topology, the mesh's device ids in mesh order and its process layout
  (for a compile-only GPU target also the sha256 of its target config and the CUDA plugin's version);
- what the spec says about each leaf that the facts echo (path, declared sharding, local shape,
  source, donation, where the declared sharding comes from: ``sharding_source``) and the declared output shardings (a pytree as its leaves' key paths and
  shardings, never a ``repr`` with memory addresses: :func:`_key_part`);
- the settings JAX turns into compile options and the environment XLA reads
  (:func:`compile_settings`: ``JAX_OPTIMIZATION_LEVEL``/``jax_optimization_level``, the
  optimisation and memory-fitting efforts and levels, ``XLA_FLAGS``, ``LIBTPU_INIT_ARGS``, every
  ``XLA_*``/``LIBTPU_*`` variable ...);
- the jax, jaxlib, libtpu and stagetool versions, and :data:`CACHE_SCHEMA`.

What the cache trusts, and why (docs/limits.md): nothing in the folder before it is checked.

- **The folder** (:meth:`FactsCache.open`) must be a folder owned by this user and writable by no one
  else (it is created ``0700``); otherwise the cache is not used, with one warning: another user
  who can write there could plant entries or links.
- **Entries are authenticated.** Each entry is ``<header line>\n<payload>``; the header carries an
  HMAC-SHA256 of the key and the payload under a per-user secret (:func:`secret`) kept *outside*
  the cache folder, mode ``0600``. A copied, edited or planted entry (even one whose plain sha256
  was recomputed) fails the HMAC and is a miss; the payload is parsed only after it passes.
- **Entries are opened as regular files**, without following links (``O_NOFOLLOW``, ``O_NONBLOCK``:
  a FIFO or ``/dev/zero`` in place of an entry is refused without reading), and at most
  :data:`MAX_ENTRY_BYTES` are read. Entries are written through a temporary file created
  ``O_EXCL`` in the folder and renamed over the entry (a link there is replaced, never followed).
- **Then every field is checked** (schema, the key echoed, each field's type); anything off is a
  miss, and the compile rewrites the entry.
- **JAX's own persistent compilation cache is not used**: its key leaves out the ops' source
  locations, so after a line moves it would hand back an executable whose metadata (a collective's
  source line, op names) is the old one — and it stores serialized executables nobody checks.

Where it lives: :func:`resolve_cache_dir` (``--cache-dir``, ``STAGETOOL_CACHE_DIR``, else the user
cache folder from ``platformdirs``; ``--no-cache`` or ``STAGETOOL_NO_CACHE=1`` turn it off).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import hmac
import json
import os
import re
import stat
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stagetool.core import codec
from stagetool.core.paths import ReportRoot
from stagetool.core.sharding import Sharding
from stagetool.facts import BackendResult, LeafFacts, PeakDump, Propagation, StagedFunction

if TYPE_CHECKING:
    from stagetool.devices.provision import DeviceSetup
    from stagetool.inputs.records import AbstractInputs

CACHE_SCHEMA = 15
"""Version of the entry format and of the key's contents; bump it when either changes.
3: authenticated entries (HMAC header line), compile settings in the key. 5: the payload as a table of
distinct values (:func:`stagetool.core.codec.pack`). 6: paths below the report root written from ``<stagetool-root>`` in
the key and the entries. 7: ``<stagetool-root>`` stands for the project around the spec's folder,
whose place in it is a key part. 8: each input leaf's ``sharding_source`` in the key (an entry
echoes it: a hit must not say another run's source). 9: source locations cut at the first frame of
stagetool (the frames above its call, a Python-API caller's script, left out), ``raw_text``. 10: the
peak dump's ``space_names`` (XLA's names of its memory spaces). 11: read and checked by the typed
codec (:mod:`stagetool.core.codec`); key parts as its table. 12: a ``jax.jit`` target's own
``out_shardings`` in the key (its outputs say ``sharding_source: "target"``). 13: the stored Shardy
propagation gives ``chlo.top_k`` and ``chlo.ragged_dot`` XLA's factor rules (an entry of 12 holds one
without, whose causes say 'unavailable'). 14: ``mesh_notes``, the other meshes of the staged devices the traced
program names. 15: a function that closes over ``jax.Ref``s: its inputs' and outputs' compiled
shardings (were unknown, or no entry), and a ``mesh_notes`` entry naming those Refs."""

MAX_ENTRY_BYTES = 1 << 30
"""An entry larger than this (1 GiB) is not read: a miss. (A 48-layer transformer's entry is ~60 MB.)"""

ENTRY_KIND = "stagetool-facts"

#: the StagedFunction fields an entry holds (everything the compile determines), each with its type
_CACHED: dict[str, Any] = {
    "compiled_text": str, "whole_program_cost": BackendResult, "per_device_cost": BackendResult,
    "memory": BackendResult, "inputs": tuple[LeafFacts, ...], "outputs": tuple[LeafFacts, ...],
    "peak": PeakDump | None, "propagation": Propagation | None, "propagation_error": str | None}
_CACHED_FIELDS = tuple(_CACHED)


def resolve_cache_dir(cache_dir: str | Path | None = None, *, no_cache: bool = False) -> Path | None:
    """The facts cache folder, or None when the cache is off.

    In order: ``no_cache`` (``--no-cache``) → off; ``cache_dir`` (``--cache-dir``); the environment:
    ``STAGETOOL_NO_CACHE`` set to anything but ``""``/``0`` → off, ``STAGETOOL_CACHE_DIR``; else the user
    cache folder (``platformdirs.user_cache_dir("stagetool")``).

    Raises:
      UsageError: ``cache_dir`` is empty (``--cache-dir ''`` would be the working directory).
    """
    if no_cache:
        return None
    if cache_dir is not None:
        if not str(cache_dir).strip():
            from stagetool.core.errors import UsageError

            raise UsageError("--cache-dir '': give a folder for the facts cache", hint="or --no-cache to turn it off")
        return Path(cache_dir)
    if os.environ.get("STAGETOOL_NO_CACHE", "") not in ("", "0"):
        return None
    if os.environ.get("STAGETOOL_CACHE_DIR"):
        return Path(os.environ["STAGETOOL_CACHE_DIR"])
    import platformdirs

    return Path(platformdirs.user_cache_dir("stagetool"))


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


def cache_key(lowered: Any, setup: DeviceSetup, inputs: AbstractInputs, *, declared_outputs: Any = None,
              compiler_options: dict | None = None, root: ReportRoot | None = None, raw_text: bool = False) -> str:
    """The sha256 hex digest naming one function's entry (see the module docstring for what goes in).

    Args:
      lowered: the ``jax.stages.Lowered``.
      setup: the :class:`~stagetool.devices.provision.DeviceSetup`.
      inputs: the :class:`~stagetool.inputs.records.AbstractInputs`.
      declared_outputs: the spec's ``out_shardings`` tree.
      compiler_options: the options passed to ``Lowered.compile``.
      root: the report root (the spec's folder in its project, :mod:`stagetool.core.paths`): source
        locations and spec locations in the project enter the key relative to the project's folder
        (:meth:`ReportRoot.portable`), and the spec folder's place in the project
        (:attr:`ReportRoot.position`) is a key part, so the same project in another folder has the
        same key. None, or a root whose spelling XLA would escape (:attr:`ReportRoot.plain`): the
        locations as they are, and the root itself is a key part.
      raw_text: the run shows the compiled text as it is (``stagetool compile``), whose source tables
        name every frame of each op, those above stagetool's call too: they are then in the key
        (:func:`source_locations` ``callers``), so such an entry is only ever this caller's.

    Whether the entry holds the live-range dump is not part of the key: an entry without it does
    not answer a request for the peak (:meth:`FactsCache.load`), and that request's compile rewrites
    the entry with the dump.
    """
    text = lowered.as_text()
    portable = _portable(root)
    description = {
        "schema": CACHE_SCHEMA,
        "module_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "source_locations": sorted({portable(x) for x in source_locations(lowered.as_text(debug_info=True),
                                                                           callers=raw_text)}),
        "raw_text": raw_text,
        "compiler_options": sorted((str(k), repr(v)) for k, v in (compiler_options or {}).items()),
        "platform": setup.platform,
        "device_kind": setup.device_kind,
        "topology": setup.topology,
        "device_ids": [int(d.id) for d in setup.devices],
        "process_of_device": list(setup.process_of_device),
        "leaves": [[x.path, list(x.shape), x.dtype, _key_part(x.declared), _key_part(x.local_shape),
                    portable(x.source) if x.source else x.source, bool(x.donated), x.sharding_source]
                   for x in inputs.leaves],
        "declared_outputs": _key_part(declared_outputs),
        "settings": compile_settings(),
        "versions": versions(),
        "target_compiler_options": target_compiler_options(inputs),
    }
    if root is not None and not root.plain:
        description["root"] = root.folder  # its paths stay absolute: entries stay with this checkout
    elif root is not None:
        description["spec_folder"] = root.position  # where the token's paths are, seen from the spec
    if setup.target_config_sha256 is not None:  # a compile-only GPU target: what XLA compiled for
        from stagetool.devices.gpu_topology import cuda_plugin_version

        description["gpu_target"] = {"config_sha256": setup.target_config_sha256, "plugin": cuda_plugin_version()}
    from stagetool.staging.gather import target_declared_outputs

    description["target_out_shardings"] = _key_part(target_declared_outputs(inputs))
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode("utf-8")).hexdigest()


def _portable(root: ReportRoot | None):
    """The rewrite of key parts and entry strings for ``root``: :meth:`ReportRoot.portable`, or none."""
    return root.portable if root is not None and root.plain else (lambda s: s)


def _local_body(body: bytes, root: ReportRoot | None) -> bytes:
    """An authenticated payload's JSON text with :func:`_portable`'s token written back as this run's
    ``root`` (:meth:`ReportRoot.local` on the whole text at once: a plain root is the same in JSON,
    and the token stands nowhere but where a path was)."""
    if root is None or not root.plain:
        return body
    from stagetool.core.paths import ROOT_TOKEN

    return body.replace(f"{ROOT_TOKEN}/".encode("ascii"), f"{root.base}/".encode("utf-8"))


def target_compiler_options(inputs: AbstractInputs) -> list[list[str]]:
    """The target's own ``jax.jit(compiler_options=...)`` (``inputs.jit``), as sorted ``[name, value]``
    pairs: part of the key, since ``Lowered.compile`` applies them and the lowered text does not
    show them (a pass-disabling option changes the program, not the module text)."""
    from stagetool.inputs.own_jit import options_text

    return [list(pair) for pair in options_text(inputs.jit)]


#: ``jax.config`` options that JAX turns into the compile options (``get_compile_options``: the efforts
#: and levels, the partitioner, the remat pass, "disable most optimizations", the AutoFDO profile) or
#: that change the lowered program; with the environment below they are part of every key. An
#: option this JAX does not have is left out.
KEY_CONFIG_NAMES = (
    "jax_optimization_level", "jax_memory_fitting_level", "jax_exec_time_optimization_effort",
    "jax_memory_fitting_effort", "jax_disable_most_optimizations", "jax_compiler_enable_remat_pass",
    "jax_xla_profile_version", "jax_use_shardy_partitioner", "jax_threefry_partitionable",
    "jax_default_matmul_precision", "jax_enable_x64", "jax_default_prng_impl", "jax_numpy_dtype_promotion",
)

#: environment variables that XLA, libtpu or a PJRT plugin read while compiling: these names, and
#: every variable whose name starts with one of :data:`KEY_ENV_PREFIXES`.
KEY_ENV_NAMES = ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "TF_XLA_FLAGS", "NVIDIA_TF32_OVERRIDE")
KEY_ENV_PREFIXES = ("XLA_", "LIBTPU_", "JAX_")
#: ... except these, which change where logs and caches go, not what is compiled
_KEY_ENV_IGNORED = ("JAX_COMPILATION_CACHE_DIR", "JAX_LOGGING_LEVEL", "JAX_LOG_COMPILES", "JAX_PLATFORMS",
                    "JAX_NUM_CPU_DEVICES")


def compile_settings() -> dict[str, Any]:
    """The settings, outside the lowered module, that change what XLA compiles: the ``jax.config``
    options of :data:`KEY_CONFIG_NAMES` (as ``repr``; ``JAX_OPTIMIZATION_LEVEL=O0`` is
    ``jax_optimization_level``) and the environment variables of :data:`KEY_ENV_NAMES` /
    :data:`KEY_ENV_PREFIXES` that are set. (The platform and device count, which ``JAX_PLATFORMS`` /
    ``JAX_NUM_CPU_DEVICES`` choose, are in the key as the devices themselves.)"""
    import jax

    values = getattr(jax.config, "values", {})  # every option, flags included (not all are attributes)
    config = {}
    for name in KEY_CONFIG_NAMES:
        if name in values:
            config[name] = repr(values[name])
        elif hasattr(jax.config, name):
            config[name] = repr(getattr(jax.config, name))
    env = {k: v for k, v in os.environ.items()
           if (k in KEY_ENV_NAMES or k.startswith(KEY_ENV_PREFIXES)) and k not in _KEY_ENV_IGNORED}
    return {"jax_config": config, "environment": dict(sorted(env.items()))}


_FILE_LOCATION = re.compile(r'loc\("((?:[^"\\]|\\.)*)":(\d+):(\d+)(?: to (\d*):?(\d+))?\)')


def _callers_dirs() -> tuple[str, ...]:
    """Folders of the code that calls the user's function: stagetool, and its CLI's typer (and click)
    (:func:`stagetool.core.paths.caller_folders`, which the report root never rewrites either)."""
    from stagetool.core.paths import caller_folders

    return caller_folders()


def source_locations(debug_text: str, *, callers: bool = False) -> list[str]:
    """The source locations (``loc("file":line:col ...)``) a lowered module's ops carry, from the user's
    function inward: each op's call chain (innermost first) is cut at its first frame of stagetool or
    its CLI, so neither those frames nor the ones above them — how stagetool was called: ``report`` or
    ``snapshot``, a worker process, a script or notebook calling the Python API — are in it. The
    compiled module's metadata (the source line of each collective) follows the frames kept.

    With ``callers``, every location the module names but stagetool's and its CLI's own (the frames
    above stagetool's call kept): for a run that shows the compiled text as it is, whose tables name
    every frame (:func:`cache_key` ``raw_text``).
    """
    skip = _callers_dirs()
    if callers:
        return sorted({m.group(0) for m in _FILE_LOCATION.finditer(debug_text)
                       if not m.group(1).startswith("<frozen") and not any(m.group(1).startswith(d) for d in skip)})
    aliases = dict(_ALIAS_LINE.findall(debug_text))
    memo: dict[str, tuple[tuple[str, ...], bool]] = {}
    found: set[str] = set()
    for line in debug_text.splitlines():
        if line.startswith("#loc"):
            continue
        for m in _OP_LOCATION.finditer(line):
            found.update(_chain(m.group(1), aliases, memo, skip)[0])
    return sorted(found)


_ALIAS_LINE = re.compile(r"^(#loc\d*) = loc\((.*)\)\s*$", re.M)
_OP_LOCATION = re.compile(r"loc\((#loc\d*|\".*)\)\s*$")  # an op's (or argument's) location, at its line's end
_FILE_ONLY = re.compile(r'^"((?:[^"\\]|\\.)*)":(\d+):(\d+)(?: to (\d*):?(\d+))?$')
_NAMED = re.compile(r'^"(?:[^"\\]|\\.)*"\((.*)\)$', re.S)


def _split_top(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` outside brackets and strings."""
    parts, depth, quoted, start, i = [], 0, False, 0, 0
    while i < len(text):
        c = text[i]
        if quoted:
            if c == "\\":
                i += 1
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted = True
        elif c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif depth == 0 and text.startswith(sep, i):
            parts.append(text[start:i])
            start = i = i + len(sep)
            continue
        i += 1
    parts.append(text[start:])
    return parts


def _chain(text: str, aliases: dict[str, str], memo: dict, skip: tuple[str, ...]) -> tuple[tuple[str, ...], bool]:
    """The file locations of one MLIR location (its text inside ``loc(...)``, or an alias), innermost
    first, up to its first frame in ``skip`` (stagetool, its CLI); and whether that frame was reached
    (then a call site's callers are not followed)."""
    text = text.strip()
    if text.startswith("#loc"):
        if text not in memo:
            memo[text] = (), False  # a cycle (never printed by MLIR) ends here
            memo[text] = _chain(aliases.get(text, "unknown"), aliases, memo, skip)
        return memo[text]
    if text.startswith("callsite(") and text.endswith(")"):
        parts = _split_top(text[len("callsite("):-1], " at ")
        frames: tuple[str, ...] = ()
        for part in parts:
            inner, stopped = _chain(part, aliases, memo, skip)
            frames += inner
            if stopped:
                return frames, True
        return frames, False
    if text.startswith("fused"):
        body = text[text.find("[") + 1:text.rfind("]")] if "[" in text else ""
        out, stopped = (), False
        for part in _split_top(body, ","):
            inner, s = _chain(part, aliases, memo, skip)
            out, stopped = out + inner, stopped or s
        return out, stopped
    m = _FILE_ONLY.match(text)
    if m is not None:
        path = m.group(1)
        if any(path.startswith(d) for d in skip):
            return (), True
        return ((f"loc({text})",) if not path.startswith("<frozen") else ()), False
    m = _NAMED.match(text)
    if m is not None:
        return _chain(m.group(1), aliases, memo, skip)
    return (), False


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _key_part(value: Any) -> Any:
    """``value`` (a spec value: a sharding, a shape, a fitted ``out_shardings`` tree) as JSON that is
    the same in every process for the same value.

    Plain values and records are packed as in an entry (:func:`stagetool.core.codec.pack`). Anything else is a pytree (a Flax
    ``TrainState`` fitted by ``out_shardings: {like: 0}``, whose static fields hold bound methods and
    optax closures): it is described by its leaves' key paths and their shardings, never by its
    ``repr``, which holds memory addresses that change every run (the key would never match again).
    """
    try:
        return codec.pack({"v": value})
    except TypeError:
        pass
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(value, is_leaf=lambda x: x is None or isinstance(x, Sharding))
    return {"$leaves": [[jax.tree_util.keystr(path), _leaf_part(leaf)] for path, leaf in flat]}


def _leaf_part(leaf: Any) -> Any:
    try:
        return codec.pack({"v": leaf})
    except TypeError:
        return _ADDRESS.sub("", repr(leaf))  # an unknown leaf: its text, without the addresses


# ---- the store -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CachedFacts:
    """What an entry gives back: the compile-derived fields, and the compile's warnings."""

    fields: dict[str, Any]
    compile_warnings: tuple[str, ...]


class FactsCache:
    """The entries under one folder: ``<folder>/facts/<key[:2]>/<key>.json``.

    Build it with :meth:`open`, which checks the folder and finds the secret; an entry is
    ``<header JSON line>\n<payload JSON>``, the header holding kind, schema, key and the payload's
    HMAC (see the module docstring).
    """

    def __init__(self, folder: str | Path, secret: bytes):
        self.folder = Path(folder)
        self._secret = secret

    @classmethod
    def open(cls, folder: str | Path) -> FactsCache | None:
        """The cache in ``folder``, or None — with one line on stderr saying why — when the folder
        cannot be trusted (not a folder, not this user's, writable by others) or the secret cannot be
        had (:func:`secret`). ``folder`` is created (mode 0700) when missing; a folder that cannot be
        created is no cache, silently (a read-only home)."""
        folder = Path(folder)
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            return None
        problem = _untrusted(folder)
        if problem is None:
            try:
                key = secret()
            except _Untrusted as e:
                problem = str(e)
        if problem is not None:
            _warn_once(f"the facts cache is not used: {problem}")
            return None
        return cls(folder, key)

    def path(self, key: str) -> Path:
        return self.folder / "facts" / key[:2] / f"{key}.json"

    def _mac(self, key: str, body: bytes) -> str:
        return hmac.new(self._secret, key.encode("ascii") + b"\n" + body, hashlib.sha256).hexdigest()

    def load(self, key: str, *, peak: bool = False, root: ReportRoot | None = None) -> CachedFacts | None:
        """The entry of ``key`` if it is present and valid (and holds the peak dump when ``peak``); else None.

        Paths the entry wrote from the report root (:meth:`store`) are written back as ``root``'s, so
        an entry another checkout of the project wrote reads as this checkout's compile would.

        The file is read only if it is a regular file (no link followed, no FIFO or device opened
        for long) of at most :data:`MAX_ENTRY_BYTES`; its payload is parsed only once its HMAC
        matches."""
        from stagetool.process.fileio import FileProblem, read_regular_bytes

        if not re.fullmatch(r"[0-9a-f]{64}", key):
            return None
        if not self._folders_trusted(key):
            return None
        try:
            raw = read_regular_bytes(self.path(key), max_bytes=MAX_ENTRY_BYTES, follow_symlinks=False)
        except (OSError, FileProblem):
            return None
        head, newline, body = raw.partition(b"\n")
        try:
            header = json.loads(head[:4096]) if newline and len(head) <= 4096 else None
        except ValueError:
            return None
        if not (isinstance(header, dict) and header.get("kind") == ENTRY_KIND and header.get("schema") == CACHE_SCHEMA
                and header.get("key") == key and isinstance(header.get("hmac"), str)):
            return None  # another format, or a foreign entry (copied or renamed): never trusted
        if not hmac.compare_digest(header["hmac"], self._mac(key, body)):
            return None  # not written by this user's stagetool: forged, planted or damaged
        try:
            return _decode_entry(json.loads(_local_body(body, root)), peak=peak)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
            return None

    def store(self, key: str, facts: StagedFunction, compile_warnings: tuple[str, ...] = (),
              root: ReportRoot | None = None) -> bool:
        """Write the entry of ``key`` atomically; False (and nothing written) when the folder is not
        writable or a fact is of a kind the entry format does not hold. Paths below ``root`` (in the
        compiled text's metadata, Shardy's frames, spec locations) are written from
        :data:`~stagetool.core.paths.ROOT_TOKEN` (:meth:`ReportRoot.portable`)."""
        try:
            payload = codec.map_strings({**codec.pack({name: getattr(facts, name) for name in _CACHED}),
                                         "compile_warnings": list(compile_warnings)}, _portable(root))
            body = json.dumps(payload, sort_keys=True).encode("utf-8")
        except (TypeError, ValueError):
            return False  # facts this format cannot hold exactly are not cached
        header = {"kind": ENTRY_KIND, "schema": CACHE_SCHEMA, "key": key, "hmac": self._mac(key, body)}
        data = json.dumps(header, sort_keys=True).encode("utf-8") + b"\n" + body
        path = self.path(key)
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not self._folders_trusted(key):
                return False
            _write_entry(path, data)
        except OSError:
            return False
        return True

    def _folders_trusted(self, key: str) -> bool:
        """Whether every folder between the cache folder and ``key``'s entry (``facts/``,
        ``facts/<key[:2]>/``) is a real folder (not a link, checked without following one), this
        user's, and not writable by group or others: a folder another user owns or can write could
        redirect where entries go. One warning on stderr when one is not."""
        for folder in (self.folder / "facts", self.folder / "facts" / key[:2]):
            problem = _untrusted(folder, follow=False)
            if problem is not None and not problem.endswith(_MISSING):
                _warn_once(f"the facts cache is not used for this entry: {problem}")
                return False
        return True


def _write_entry(path: Path, data: bytes) -> None:
    """``data`` to ``path`` through a new file (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600) in the
    same folder, renamed over ``path``: whatever is at ``path`` (a link included) is replaced, never
    written through. The temporary file is removed on every path (signals: :mod:`stagetool.process.cleanup`)."""
    import secrets as _secrets

    from stagetool.process import cleanup

    tmp = path.parent / f".{path.name}.{os.getpid()}.{_secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    token = cleanup.register_path(tmp)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    finally:
        cleanup.forget(token)


# ---- trust: the folder and the secret ---------------------------------------------------------------


class _Untrusted(Exception):
    """Why the cache cannot be used (one line)."""


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message in _WARNED:
        return
    _WARNED.add(message)
    try:
        sys.stderr.write(f"stagetool: warning: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


_MISSING = ": not there yet"


def _untrusted(folder: Path, *, follow: bool = True) -> str | None:
    """Why ``folder`` is not a cache folder to trust, or None: it must be a folder (a link to one is
    followed only with ``follow``; the cache's own subfolders are never links), owned by this user,
    and not writable by group or others. A missing folder ends with :data:`_MISSING`."""
    try:
        st = os.stat(folder) if follow else os.lstat(folder)
    except FileNotFoundError:
        return f"{folder}{_MISSING}"
    except OSError as e:
        return f"{folder}: {e.strerror or e}"
    if stat.S_ISLNK(st.st_mode):
        return f"{folder} is a symbolic link (the cache's own folders are never links); remove it"
    if not stat.S_ISDIR(st.st_mode):
        return f"{folder} is not a folder"
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        return f"{folder} belongs to another user (uid {st.st_uid}); use a folder of your own (--cache-dir DIR)"
    if st.st_mode & 0o022:
        return (f"{folder} is writable by {'others' if st.st_mode & 0o002 else 'its group'} "
                f"(mode {stat.S_IMODE(st.st_mode):04o}), who could plant entries; chmod go-w {folder}")
    return None


SECRET_ENV = "STAGETOOL_CACHE_KEY_FILE"
"""Where the facts cache's secret is kept, if not in the user config folder (CI: next to the cache)."""


def secret_path() -> Path:
    """The file holding the per-user secret that authenticates entries: ``$STAGETOOL_CACHE_KEY_FILE``,
    else ``facts-cache.key`` in the user config folder (``platformdirs.user_config_dir("stagetool")``,
    ``~/.config/stagetool`` on Linux): outside the cache folder, so that whoever can write entries
    cannot read or replace the key with them."""
    if os.environ.get(SECRET_ENV):
        return Path(os.environ[SECRET_ENV])
    import platformdirs

    return Path(platformdirs.user_config_dir("stagetool")) / "facts-cache.key"


_SECRETS: dict[str, bytes] = {}


def secret() -> bytes:
    """The per-user secret (32 random bytes, stored as 64 hex digits in :func:`secret_path`, mode 0600),
    created on first use: a new file is written whole and linked into place (``os.link`` fails if
    another process made it first, whose secret is then read).

    Raises:
      _Untrusted: the file is not a regular file of this user's, is readable or writable by others,
        is malformed, or cannot be read or created.
    """
    import secrets as _secrets

    path = secret_path()
    cached = _SECRETS.get(str(path))
    if cached is not None:
        return cached
    try:
        return _SECRETS.setdefault(str(path), _read_secret(path))
    except FileNotFoundError:
        pass
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.{os.getpid()}.{_secrets.token_hex(8)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            os.write(fd, _secrets.token_hex(32).encode("ascii") + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another run made it first: use its secret
        finally:
            os.unlink(tmp)
        return _SECRETS.setdefault(str(path), _read_secret(path))
    except OSError as e:
        raise _Untrusted(f"cannot create its key {path}: {e.strerror or e}") from None


def _read_secret(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _Untrusted(f"its key {path} is a symbolic link") from None
        raise _Untrusted(f"cannot read its key {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Untrusted(f"its key {path} is not a regular file")
        if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
            raise _Untrusted(f"its key {path} belongs to another user (uid {st.st_uid})")
        if st.st_mode & 0o077:
            raise _Untrusted(f"its key {path} can be read or written by others (mode {stat.S_IMODE(st.st_mode):04o}); "
                             f"chmod 600 {path}")
        text = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if not re.fullmatch(rb"[0-9a-f]{64}", text):
        raise _Untrusted(f"its key {path} is not 64 hexadecimal digits; delete it to make a new one")
    return bytes.fromhex(text.decode("ascii"))


def _decode_entry(payload: Any, *, peak: bool) -> CachedFacts | None:
    """The facts of an authenticated payload, each field checked against its type (:data:`_CACHED`);
    None when one is off."""
    if not isinstance(payload, dict) or set(payload) != {"fields", "records", "table", "compile_warnings"}:
        return None
    try:
        fields = codec.unpack(payload, _CACHED)
        warnings = codec.decode(tuple[str, ...], payload["compile_warnings"])
    except codec.CodecError:
        return None
    if peak and fields["peak"] is None:
        return None  # the entry was written by a run that did not take the dump
    if not peak:
        fields["peak"] = None
    return CachedFacts(fields, warnings)
