"""The device world the user's code sees while stagetool loads it: the staged devices.

Model code builds its own mesh: a config module runs ``Mesh(create_device_mesh(shape, jax.devices()),
axes)`` at import, an init calls ``jax.make_mesh``, Keras lists ``keras.distribution.list_devices()``.
Under ``--topology v5e:2x4`` that code would find the host's CPU devices, and its jit shardings or
``shard_map(mesh=...)`` would name a mesh the staged program cannot run on. :func:`staged_world`
makes those public functions answer with the staged devices (compile-only TPU/GPU devices, the
simulated CPU mesh's, or the attached ones) while the target module is imported and its ``init``s
and ``{call:}``s run, and restores them after:

- ``jax.devices()`` / ``jax.device_count()``: the staged devices in id order (as ``jax.devices()``
  lists a backend's); with a backend name, the staged devices when it is theirs, else JAX's own.
- ``jax.local_devices()`` / ``jax.local_device_count()``: those of process 0 (of the given process).
- ``jax.make_mesh``, ``jax.experimental.mesh_utils.create_device_mesh`` and
  ``create_hybrid_device_mesh`` without ``devices=``: over the staged devices (JAX's own functions,
  so the device order is the one JAX picks for them, as a raw compile for those devices has).
- Keras 3 on the JAX backend lists and finds devices through ``jax.devices`` and so follows.
- ``jax.config.update("jax_num_cpu_devices", n)`` at import (JAX's documented way to get ``n`` CPU
  devices, as Equinox's parallelism example does), which JAX refuses once its backend runs, as it
  does here (stagetool started it with the staged devices; ``XLA_FLAGS`` may have set the count):
  left out, since the staged devices answer ``jax.devices()``, and said in a note
  (:func:`left_out_settings`). JAX takes the same setting again where it equals the running one.
- ``jax.device_put(x, sharding)`` onto compile-only devices (a topology's), which hold no data: the
  value is computed and kept on the host (JAX's default device) and the sharding asked for is
  remembered for it (:func:`placed_sharding`), so code that places arrays at import (Keras creates
  each variable with ``device_put(value, layout)``) imports, and its arrays read as laid out on the
  staged devices. The host holds the whole value: a model larger than host memory cannot be imported
  so, and Keras' own jitted initialiser of a very large variable (``out_shardings`` on the
  compile-only devices) still fails as JAX says.

The patch replaces module attributes of public JAX modules only (no private module), and sets
``update`` on the public ``jax.config`` object (removed again after); a function taken
by ``from jax import devices`` while the world was on answers JAX's own once it is off.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stagetool.devices.provision import DeviceSetup

_LOCK = threading.RLock()
_STACK: list[DeviceSetup] = []  # the worlds entered, innermost last
_ORIGINALS: dict[tuple[str, str], Any] = {}


def current_setup() -> DeviceSetup | None:
    """The :class:`~stagetool.devices.provision.DeviceSetup` of the innermost world entered, or None."""
    return _STACK[-1] if _STACK else None


def staged_devices(setup: DeviceSetup) -> list:
    """The staged devices as ``jax.devices()`` lists a backend's: by ``device.id``."""
    return sorted(setup.devices, key=lambda d: d.id)


def _platform_of(setup: DeviceSetup) -> str:
    return str(setup.platform)


def _devices(backend: Any = None) -> list:
    setup = current_setup()
    if setup is None or (backend is not None and str(getattr(backend, "platform", backend)).lower()
                         not in (_platform_of(setup), "cuda" if _platform_of(setup) == "gpu" else "")):
        return _ORIGINALS[("jax", "devices")](backend)
    return staged_devices(setup)


def _device_count(backend: Any = None) -> int:
    return len(_devices(backend))


def _local_devices(process_index: int | None = None, backend: Any = None, host_id: int | None = None) -> list:
    setup = current_setup()
    if setup is None:
        return _ORIGINALS[("jax", "local_devices")](process_index, backend, host_id)
    wanted = process_index if process_index is not None else (host_id if host_id is not None else 0)
    mine = [d for d in _devices(backend) if int(getattr(d, "process_index", 0)) == wanted]
    return mine


def _local_device_count(backend: Any = None) -> int:
    if current_setup() is None:
        return _ORIGINALS[("jax", "local_device_count")](backend)
    return len(_local_devices(None, backend))


#: The ``jax.config`` settings that choose the backend's devices, which JAX takes only before it starts.
_BACKEND_SETTINGS = ("jax_num_cpu_devices",)

#: (setting, value asked, ``file:line`` of the user's call) of each one left out while a world was on
_LEFT_OUT: list[tuple[str, Any, str]] = []


def _config_update(name: str, value: Any) -> None:
    original = _ORIGINALS[("config", "update")]
    try:
        original(name, value)
    except RuntimeError:  # JAX: "should be updated before backends are initialized"
        if name not in _BACKEND_SETTINGS or current_setup() is None:
            raise
        import os
        import sys

        caller = sys._getframe(1)  # the user's line calling jax.config.update
        _LEFT_OUT.append((name, value, f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}"))


def left_out_settings(setup: DeviceSetup) -> tuple[str, ...]:
    """One note per ``jax.config.update`` of a backend setting (``jax_num_cpu_devices``) that the
    user's code made while a world was on and that JAX refused, its backend running: the line, the
    value, and that the staged devices answer instead. Taken once: the record is emptied."""
    notes = tuple(
        f"{where} sets {name} = {value!r}, which JAX takes only before its backend starts: the backend "
        f"already runs for the staged mesh, so the setting is left out, and jax.devices() answers with the "
        f"{len(setup.devices)} staged {setup.platform} devices" for name, value, where in _LEFT_OUT)
    _LEFT_OUT.clear()
    return notes


def _make_mesh(axis_shapes: Any, axis_names: Any, *args: Any, devices: Any = None, **kwargs: Any) -> Any:
    if devices is None and current_setup() is not None:
        devices = staged_devices(current_setup())
    return _ORIGINALS[("jax", "make_mesh")](axis_shapes, axis_names, *args, devices=devices, **kwargs)


def _create_device_mesh(mesh_shape: Any, devices: Any = None, *args: Any, **kwargs: Any) -> Any:
    if devices is None and current_setup() is not None:
        devices = staged_devices(current_setup())
    return _ORIGINALS[("mesh_utils", "create_device_mesh")](mesh_shape, devices, *args, **kwargs)


def _create_hybrid_device_mesh(mesh_shape: Any, dcn_mesh_shape: Any, devices: Any = None, *args: Any,
                               **kwargs: Any) -> Any:
    if devices is None and current_setup() is not None:
        devices = staged_devices(current_setup())
    return _ORIGINALS[("mesh_utils", "create_hybrid_device_mesh")](mesh_shape, dcn_mesh_shape, devices, *args,
                                                                    **kwargs)


#: id(array) → (weak reference to it, the sharding ``jax.device_put`` was asked for on compile-only devices)
_PLACED: dict[int, tuple[Any, Any]] = {}


def _device_put(x: Any, device: Any = None, *args: Any, **kwargs: Any) -> Any:
    import weakref

    import jax

    original = _ORIGINALS[("jax", "device_put")]
    setup = current_setup()
    devices = getattr(device, "device_set", None)
    if devices is None and isinstance(device, jax.Device):
        devices = {device}
    if setup is None or setup.topology is None or not devices or not set(devices) <= set(setup.devices) \
            or args or kwargs:
        return original(x, device, *args, **kwargs)
    sharding = device if isinstance(device, jax.sharding.Sharding) else jax.sharding.SingleDeviceSharding(device)

    def on_host(leaf: Any) -> Any:
        value = original(leaf)
        key = id(value)
        _PLACED[key] = (weakref.ref(value, lambda _: _PLACED.pop(key, None)), sharding)
        return value

    return jax.tree_util.tree_map(on_host, x)


def placed_sharding(x: Any) -> Any:
    """The sharding ``jax.device_put`` was asked to give ``x`` on compile-only devices while a staged
    world was on (``x`` is then a host array standing for it), or None."""
    held = _PLACED.get(id(x))
    return held[1] if held is not None and held[0]() is x else None


_PATCHES = {
    ("jax", "devices"): _devices,
    ("jax", "device_count"): _device_count,
    ("jax", "local_devices"): _local_devices,
    ("jax", "local_device_count"): _local_device_count,
    ("jax", "make_mesh"): _make_mesh,
    ("jax", "device_put"): _device_put,
    ("mesh_utils", "create_device_mesh"): _create_device_mesh,
    ("mesh_utils", "create_hybrid_device_mesh"): _create_hybrid_device_mesh,
    ("config", "update"): _config_update,  # an attribute of the jax.config object, deleted again after
}


def _modules() -> dict[str, Any]:
    import jax
    from jax.experimental import mesh_utils

    return {"jax": jax, "mesh_utils": mesh_utils, "config": jax.config}


@contextlib.contextmanager
def staged_world(setup: DeviceSetup) -> Iterator[DeviceSetup]:
    """While inside, the public device functions listed in the module docstring answer with
    ``setup``'s devices (a :class:`~stagetool.devices.provision.DeviceSetup`); nested worlds stack,
    and the functions are JAX's own again once the outermost ends (however it ends), as is the
    global mesh (``jax.sharding.get_mesh()``) that user code may have set meanwhile with
    ``jax.sharding.set_mesh``."""
    import jax

    get_mesh = getattr(jax.sharding, "get_mesh", None)  # jax 0.7 has set_mesh but no getter: nothing to restore
    with _LOCK:
        mods = _modules()
        ambient = get_mesh() if get_mesh is not None and not _STACK else None
        if not _STACK:
            _LEFT_OUT.clear()
            for (mod, name), fn in _PATCHES.items():
                _ORIGINALS[(mod, name)] = getattr(mods[mod], name)
                setattr(mods[mod], name, fn)
        _STACK.append(setup)
    try:
        yield setup
    finally:
        with _LOCK:
            _STACK.pop()
            if not _STACK:
                for (mod, name) in _PATCHES:
                    if mod == "config":  # the instance attribute goes: Config.update answers again
                        vars(mods[mod]).pop(name, None)
                    else:
                        setattr(mods[mod], name, _ORIGINALS[(mod, name)])
                if ambient is not None and get_mesh() is not ambient:
                    # user code set a global mesh (a cookbook Config's jax.sharding.set_mesh): the
                    # process's own again
                    jax.sharding.set_mesh(ambient if ambient.devices.size else None)


def describe_mesh(mesh: Any) -> str:
    """``fsdp=4 × tensor=2 on 8 TPU v5 lite devices`` (axis sizes, then the devices' kind)."""
    axes = " × ".join(f"{n}={s}" for n, s in zip(mesh.axis_names, mesh.devices.shape)) or "no axes"
    first = mesh.devices.flat[0]
    kind = getattr(first, "device_kind", first.platform)
    return f"{axes} on {mesh.devices.size} {kind} device{'s' if mesh.devices.size != 1 else ''}"


def on_another_mesh(sharding: Any, staged: Any) -> bool:
    """Whether ``sharding`` is a ``NamedSharding`` on a concrete mesh other than ``staged`` (other
    axis names, shape or device order) over exactly ``staged``'s devices: an input ``jax.jit`` takes
    with its own sharding (a 4x2 ``('x', 'y')`` mesh beside a staged 2x4 ``('data', 'model')`` one)."""
    from jax.sharding import Mesh, NamedSharding

    own = getattr(sharding, "mesh", None)
    if not isinstance(sharding, NamedSharding) or not isinstance(own, Mesh) or not isinstance(staged, Mesh):
        return False
    if own.empty or same_layout(own, staged):
        return False
    return set(own.devices.flat) == set(staged.devices.flat)


def same_layout(a: Any, b: Any) -> bool:
    """Whether two concrete meshes lay the same devices in the same order under the same axis names
    (their axis types aside)."""
    from jax.sharding import Mesh

    return isinstance(a, Mesh) and isinstance(b, Mesh) and \
        (tuple(a.axis_names), a.devices.shape, tuple(d.id for d in a.devices.flat)) == \
        (tuple(b.axis_names), b.devices.shape, tuple(d.id for d in b.devices.flat))


def own_mesh_text(sharding: Any) -> str:
    """``P('x', 'y') on its own mesh x=4 × y=2 on 8 cpu devices``: a ``NamedSharding`` that no
    PartitionSpec over the staged mesh lays alike, as the report names it (declared and compiled)."""
    from stagetool.core.sharding import format_dims, spec_dims

    return f"{format_dims(spec_dims(sharding.spec))} on its own mesh {describe_mesh(sharding.mesh)}"
