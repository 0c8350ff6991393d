"""The spec's records: plain frozen values parsed from YAML (no JAX).

See :mod:`stagetool.spec.parse` for the format; ``stagetool.inputs`` turns these records into
``jax.ShapeDtypeStruct``s on a mesh.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Union

from stagetool.core.location import Loc
from stagetool.core.mesh import MeshSpec
from stagetool.core.sharding import Sharding


@dataclasses.dataclass(frozen=True)
class LeafSharding:
    """One input leaf's sharding given from outside the spec, replacing what the spec (its leaf, an
    init's rules, the init, the model) gives it: ``stagetool fit --what-if`` compiles a setting with
    one replicated leaf sharded over a free mesh axis this way.

    Attributes:
      path: the leaf's key path as ``stagetool shardings`` lists it (``state/params/norm``), exactly.
      sharding: its PartitionSpec over the mesh's axes (kind ``"spec"``, one entry per dimension).
    """

    path: str
    sharding: Sharding


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """One abstract array: ``dtype[d0,d1,...] @ sharding``.

    Attributes:
      shape: the shape as written (global, or host-local under ``avals: local``).
      dtype: a numpy dtype name (``"bfloat16"``) or a typed PRNG key dtype (``"key<fry>"``).
      sharding: how the array is laid over the mesh.
      loc: where the leaf is written.
    """

    shape: tuple[int, ...]
    dtype: str
    sharding: Sharding
    loc: Loc


@dataclasses.dataclass(frozen=True)
class KeySpec:
    """``key(N)``: a concrete PRNG key ``jax.random.key(N)``, as an ``init`` function argument."""

    seed: int
    loc: Loc


@dataclasses.dataclass(frozen=True)
class CallSpec:
    """An object built by calling a named callable: ``{call: model.py:Config, args: [...], kwargs: {...}}``.

    Used for static arguments (a config dataclass, a model definition) and inside ``init_args``.
    """

    target: str
    args: tuple
    kwargs: dict
    loc: Loc


@dataclasses.dataclass(frozen=True)
class ArgSpec:
    """``{arg: N}`` / ``{arg: name}``: the (abstract) value built for another argument of the function
    (positional ``N`` or the parameter/keyword ``name``) wherever a value is: in ``init_args``/
    ``init_kwargs`` (an ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` built over the model argument), in
    a ``{call:}``'s own ``args``/``kwargs`` (``{call: model.py:init_train_state, args: [{arg: 0}]}``
    over the config argument), in a static value or an argument holding no arrays. It must name an
    argument built before this one (an earlier position, or a positional one from a keyword)."""

    arg: Union[int, str]
    loc: Loc


@dataclasses.dataclass(frozen=True)
class StagedSpec:
    """``{mesh: staged}`` / ``{mesh: abstract}`` / ``{devices: staged}``: what stagetool stages on,
    handed to user code (a ``{call:}`` argument, an ``init_args`` value, a static value): the staged
    ``jax.sharding.Mesh``, its ``AbstractMesh``, or its devices as ``jax.devices()`` lists them."""

    kind: str  # "mesh" | "devices"
    form: str  # "staged" | "abstract"
    loc: Loc


#: The forms of :class:`StagedSpec` the spec accepts, per key.
STAGED_FORMS = {"mesh": ("staged", "abstract"), "devices": ("staged",)}


@dataclasses.dataclass(frozen=True)
class RefSpec:
    """``{ref: model.py:OPTIMIZER}``: a module-level object passed as it is (not called).

    ``rules`` (``{ref: model.py:model, rules: [...]}``, ``has_rules`` true when the key is given):
    its array leaves' shardings by key path, as an ``init``'s rules give them, in place of the
    shardings the arrays carry (none where the code has not placed them yet: a model built on one
    device that the training loop shards later)."""

    target: str
    loc: Loc
    rules: tuple[Rule, ...] = ()
    has_rules: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class ValueSpec:
    """An object handed over from Python (:func:`stagetool.inspect`): staged as a :class:`RefSpec`'s
    object is (its arrays' shapes, dtypes and shardings; Flax NNX/Linen and Equinox objects as they
    are), without importing anything. ``loc`` is the caller's line."""

    value: Any
    loc: Loc


@dataclasses.dataclass(frozen=True)
class Rule:
    """A sharding rule: the first rule whose ``pattern`` is found (``re.search``) in a leaf's key path wins.

    A callable rule (``{call: model.py:fsdp_spec}``) has ``pattern`` None and ``call`` set: it is called
    with the leaf's key path and its ``jax.ShapeDtypeStruct`` and returns a ``PartitionSpec`` (the
    leaf's sharding) or None (the next rule decides).
    """

    pattern: re.Pattern | None
    sharding: Sharding | None
    loc: Loc
    call: str | None = None


@dataclasses.dataclass(frozen=True)
class InitSpec:
    """A pytree of parameters whose shapes come from ``jax.eval_shape(init, *init_args, **init_kwargs)``.

    Leaves of ``init_args`` that are :class:`LeafSpec` or :class:`KeySpec` are passed to ``init``
    as traced values; plain YAML values are bound as Python constants (so ``d_model: 64`` can set
    a shape). Shardings come from ``rules``; without ``rules`` (``has_rules`` false) from the model
    (a sharding on the ``eval_shape`` result, Flax partitioning metadata), else replicated.
    """

    target: str
    args: tuple
    kwargs: dict
    rules: tuple[Rule, ...]
    loc: Loc
    path: str
    has_rules: bool = False


@dataclasses.dataclass(frozen=True)
class FunctionSpec:
    """One function to stage.

    Attributes:
      name: the key under ``functions:``.
      target: ``file.py:func``, ``pkg.mod:func`` or ``mod:obj.attr`` (relative files resolve against
        the spec's folder, see ``base_dir``).
      args: positional arguments, each a pytree whose leaves are :class:`LeafSpec`, :class:`InitSpec`
        (a whole subtree), or plain values.
      kwargs: keyword arguments, likewise.
      static: ``static_argnames`` values: plain YAML values or :class:`CallSpec`.
      donate: positional indices or keyword names of donated arguments.
      out_shardings: None (the compiler chooses), or a pytree of :class:`Sharding`.
      loc: where the function's entry is written.
      base_dir: the folder relative targets resolve against.
      locs: where each part is written, by key: ``"target"``, ``"args"``, ``"args[1]"``,
        ``"kwargs"``, ``"kwargs.<name>"``, ``"static"``, ``"static.<name>"``, ``"donate"``,
        ``"out_shardings"`` (only the keys the entry has).
      logical_axis_rules: the Flax logical axis rules (the function's own, else the spec's top-level
        one), active during ``init`` and tracing: ``model.py:NAME`` (text: rules, a callable returning
        them, or an object with a ``logical_axis_rules`` attribute), a :class:`CallSpec`, or an inline
        tuple of ``(logical name, mesh axis | None | tuple of axes)`` pairs; None when not given.
      tokens_per_step: the tokens one step processes, all devices together (``tokens_per_step:``):
        with a step-time estimate, tokens per second per chip are shown; None when not given.
      leaf_shardings: input leaves whose sharding is given from outside the spec
        (:class:`LeafSharding`; ``stagetool fit --what-if``'s change of one leaf), () when none.
    """

    name: str
    target: str
    args: tuple
    kwargs: dict
    static: dict
    donate: tuple[Union[int, str], ...]
    out_shardings: Any
    loc: Loc | None
    base_dir: Path
    locs: dict = dataclasses.field(default_factory=dict, compare=False)
    logical_axis_rules: Any = None
    tokens_per_step: int | None = None
    leaf_shardings: tuple[LeafSharding, ...] = ()

    def where(self, key: str) -> Loc | None:
        """The location of ``key`` (see ``locs``), else of the function's entry."""
        return self.locs.get(key) or self.loc


@dataclasses.dataclass(frozen=True)
class LikeSpec:
    """``out_shardings: {like: ARG}``: an output subtree sharded as positional argument ``ARG`` (an
    index) or keyword argument ``ARG`` (a name) is, leaf for leaf."""

    arg: Union[int, str]
    loc: Loc


@dataclasses.dataclass(frozen=True)
class OutRulesSpec:
    """``out_shardings: {rules: [...]}``: an output subtree's leaves sharded by rules, as an ``init``'s."""

    rules: tuple[Rule, ...]
    loc: Loc


@dataclasses.dataclass(frozen=True)
class Spec:
    """A whole spec file.

    Attributes:
      path: the file, or None for a spec made from the command line only.
      mesh: the mesh (may have no axes: a single device).
      platform: ``cpu`` | ``gpu`` | ``tpu`` | None (JAX's default backend).
      topology: a compile-only TPU topology name such as ``v5e:2x4``, or GPU target ``h100:8``, or None.
      slices: ``slices: N``: stage N slices of the TPU topology joined over DCN, or None (one).
      avals: ``global`` (shapes are whole arrays) or ``local`` (shapes as one process sees them).
      functions: by name, in file order.
      chips: user entries for the roofline chip table (``chips: {name: {peak_flops_per_second_bf16: ...}}``),
        as written; already validated with :func:`stagetool.core.chips.merge_chips` at load.
      check: the ``check:`` section (tolerances of ``stagetool check``), or None.
      locs: where top-level keys are written (``platform``, ``topology``, ``slices``,
        ``gpu_target_config``), for errors found later.
      gpu_target_config: ``gpu_target_config:``, a ``GpuTargetConfigProto`` file (absolute; written
        relative to the spec's folder) for a GPU ``topology``, or None.
    """

    path: Path | None
    mesh: MeshSpec
    platform: str | None
    topology: str | None
    avals: str
    functions: dict[str, FunctionSpec]
    chips: dict = dataclasses.field(default_factory=dict)
    check: CheckSpec | None = None
    locs: dict[str, Loc] = dataclasses.field(default_factory=dict, compare=False)
    slices: int | None = None
    gpu_target_config: str | None = None


@dataclasses.dataclass(frozen=True)
class CheckSpec:
    """The spec's ``check:`` section: tolerances of ``stagetool check`` (see :mod:`stagetool.gate.compare`).

    Attributes:
      tolerances: tolerance name → :class:`stagetool.gate.compare.Tolerance`, for every function.
      functions: function name → its own tolerances (override the ones above).
    """

    tolerances: dict
    functions: dict


