"""What staging reads from JAX and hands analysis: one frozen value per staged function, with no JAX object inside.

:func:`gather` reads everything the analysis needs from JAX's stage objects (``jax.stages.Traced``,
``Lowered``, ``Compiled``) once: module texts, the raw ``cost_analysis()`` and
``memory_analysis()`` results, per-leaf shardings (as :class:`~stagetool.core.sharding.Sharding`
structure over the mesh), shard shapes, layouts and donation, and the peak dump when one was
taken. ``stagetool.analysis`` then works from this :class:`StagedFunction` alone, so it never calls
JAX, and its records can be cached or computed in another process.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from stagetool.core.sharding import Sharding
from stagetool.facts import BackendResult, LeafFacts, PeakDump, StagedFunction
from stagetool.staging.equations import equations
from stagetool.staging.foreign_mesh import other_meshes

if TYPE_CHECKING:
    from stagetool.inputs.records import AbstractInputs
    from stagetool.staging.stages import Staged


_MEMORY_ATTRIBUTES = (
    "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
    "generated_code_size_in_bytes", "host_argument_size_in_bytes", "host_output_size_in_bytes",
    "host_alias_size_in_bytes", "host_temp_size_in_bytes", "host_generated_code_size_in_bytes",
    "peak_memory_in_bytes",
    # jax/jaxlib >= 0.11 only (stagetool.core.compat.MEMORY_FIELDS_SINCE_0_11); absent before
    "peak_unpadded_heap_bytes", "total_allocation_bytes", "indefinite_allocations",
)


def cost_result(stage: Any) -> BackendResult:
    """``stage.cost_analysis()`` of a ``jax.stages.Lowered`` or ``Compiled`` as a :class:`BackendResult`."""
    return _call(stage.cost_analysis)


def memory_result(compiled: Any) -> BackendResult:
    """``compiled.memory_analysis()`` as a :class:`BackendResult` of its fields."""
    return _memory(compiled)


def _call(api: Any) -> BackendResult:
    try:
        return BackendResult(api())
    except Exception as e:  # noqa: BLE001 - a backend that cannot answer is a fact, not a crash
        return BackendResult(None, f"{type(e).__name__}: {e}")


def _memory(compiled: Any) -> BackendResult:
    result = _call(compiled.memory_analysis)
    if result.values is None:
        return result
    stats = result.values
    return BackendResult({a: getattr(stats, a) for a in _MEMORY_ATTRIBUTES if getattr(stats, a, None) is not None})


def gather(staged: Staged, inputs: AbstractInputs, *, name: str, target: str, mesh: Any,
           declared_outputs: Any = None, lowered_dialect: str | None = None, compiled_text: bool = True,
           stablehlo_text: bool = True, peak: PeakDump | None = None,
           user_files: list[str] | None = None) -> StagedFunction:
    """Read one staged function's facts from its stage objects.

    Args:
      staged: the stages (``compiled`` None when staging stopped at ``lower``).
      inputs: the abstract inputs it was staged with.
      name / target: the spec's function name and target.
      mesh: the ``jax.sharding.Mesh`` (compiled shardings are expressed over its axes).
      declared_outputs: the spec's ``out_shardings`` tree (None: every output is the compiler's).
      lowered_dialect: read the lowered module's text in this dialect (None: do not).
      compiled_text / stablehlo_text: read those texts (cost, collectives and donation need them).
      peak: the live-range dump taken with the compile, if any.
    """
    lowered, compiled = staged.lowered, staged.compiled
    fields: dict[str, Any] = {}
    if lowered_dialect is not None:
        fields["lowered_text"] = (lowered.as_text(dialect=lowered_dialect) if lowered_dialect != "stablehlo"
                                  else lowered.as_text())
        fields["lowered_dialect"] = lowered_dialect
    if compiled is not None:
        if stablehlo_text:
            fields["stablehlo_text"] = fields["lowered_text"] if lowered_dialect == "stablehlo" else _text(lowered)
        if compiled_text:
            fields["compiled_text"] = compiled.as_text()
        fields["whole_program_cost"] = cost_result(lowered)
        fields["per_device_cost"] = cost_result(compiled)
        fields["memory"] = memory_result(compiled)
        fields["inputs"] = input_facts(inputs, compiled, mesh)
        fields["outputs"] = output_facts(staged.traced, compiled, declared_outputs, mesh, inputs.state_outputs,
                                         program_output_paths(staged.traced, inputs),
                                         ref_inputs=(fields["inputs"], ref_flags(inputs)),
                                         target_out=_own_out_shardings(inputs),
                                         like_inputs=names_like_inputs(staged.traced, inputs))
    fields["uneven_constraints"] = uneven_constraints(staged.traced, user_files or [])
    fields["mesh_notes"] = other_meshes(staged.traced, mesh, user_files=user_files or []) + \
        _closed_over_note(staged.jitted)
    fields["host_transfers"] = host_transfers(staged.traced, user_files or [])
    fields["grouped_matmuls"] = grouped_matmuls(staged.traced, user_files or [])
    return StagedFunction(name, target, staged.timings, staged.warnings, peak=peak, **fields)


def target_declared_outputs(inputs: AbstractInputs) -> Any:
    """The ``jax.jit`` target's own ``out_shardings`` as :class:`Sharding` leaves (what
    :func:`output_facts` declares its outputs with; a facts-cache key part), or None."""
    own = _own_out_shardings(inputs)
    return None if own is None else _as_declared(own)


def _own_out_shardings(inputs: AbstractInputs) -> Any:
    """The ``out_shardings`` of a ``jax.jit`` target's own jit, staged as the program's boundary (None
    for other targets, or where stagetool wraps the target: in-place state outputs, its own program)."""
    own = inputs.jit
    if own is None or own.kind != "jax.jit" or inputs.program is not None or inputs.state_outputs:
        return None
    return own.out_shardings


def uneven_constraints(traced: Any, user_files: list[str]) -> tuple[str, ...]:
    """Sharding constraints (``with_sharding_constraint``, in any nested jaxpr) on a dimension whose
    size the constraint's mesh axes do not divide: XLA pads the dimension and may gather. One
    sentence each, with the user's line (the innermost frame in ``user_files``, else outside JAX)."""
    found: list[str] = []
    for eqn, where in equations(traced, user_files):
        if eqn.primitive.name != "sharding_constraint":
            continue
        sharding = eqn.params.get("sharding")
        spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
        shape = getattr(eqn.invars[0].aval, "shape", ())
        sizes = dict(getattr(mesh, "shape", {}) or {})
        for i, entry in enumerate(tuple(spec or ())[: len(shape)]):
            axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
            k = 1
            for a in axes:
                k *= int(sizes.get(a, 1))
            if k > 1 and shape[i] % k:
                found.append(f"sharding constraint at {where(eqn)}: dimension {i} of size {shape[i]} is "
                             f"not divisible by {k} ({' × '.join(axes)}): XLA pads it to "
                             f"{-(-shape[i] // k) * k} and may gather it")
    return tuple(dict.fromkeys(found))


def host_transfers(traced: Any, user_files: list[str]) -> tuple[str, ...]:
    """Where the traced program (``Traced.jaxpr``, any nested jaxpr) moves values to host memory: a
    ``device_put`` whose result's ``aval.memory_space`` is the host (``float32<host>[...]``: what a
    ``jax.checkpoint`` offload policy to ``pinned_host`` inserts) or whose target sharding's
    ``memory_kind`` is ``pinned_host``/``unpinned_host``. Each as ``file:line`` of the user's frame
    (the innermost in ``user_files``, else outside JAX), once, in program order. On CPU the lowered
    module carries none of this (XLA:CPU has one memory), so it is read here, before lowering."""

    def to_host(eqn: Any) -> bool:
        spaces = [str(getattr(v.aval, "memory_space", "")) for v in eqn.outvars]
        kinds = [getattr(d, "memory_kind", None) for d in eqn.params.get("devices", ()) or ()]
        return any(x.rsplit(".", 1)[-1].lower() == "host" for x in spaces) or any(
            k in ("pinned_host", "unpinned_host") for k in kinds)

    found = [where(eqn) for eqn, where in equations(traced, user_files)
             if eqn.primitive.name == "device_put" and to_host(eqn)]
    return tuple(dict.fromkeys(found))


def grouped_matmuls(traced: Any, user_files: list[str]) -> tuple[str, ...]:
    """Where the traced program (any nested jaxpr) has a grouped matmul (``ragged_dot``, the
    ``ragged_dot_general`` primitive): ``file:line`` of the user's frame, once each, in program order.
    JAX lowers it for XLA:CPU as dense dots over every group (its op names then say
    ``dot_general``, not ``ragged_dot``), so it is read here, before lowering."""
    found = [where(eqn) for eqn, where in equations(traced, user_files)
             if eqn.primitive.name in ("ragged_dot_general", "ragged_dot")]
    return tuple(dict.fromkeys(found))


def _text(lowered: Any) -> str | None:
    try:
        return lowered.as_text()
    except Exception:  # noqa: BLE001 - the text only feeds advisory checks
        return None


# ---- shardings -----------------------------------------------------------------------------------


def sharding_of(sharding: Any, rank: int, mesh: Any) -> Sharding:
    """A ``jax.sharding.Sharding`` as mesh axes per dimension, padded with None to ``rank``.

    ``NamedSharding`` gives its ``PartitionSpec`` (one on another mesh of ``mesh``'s devices: the
    equivalent spec over ``mesh``'s axes, else kind ``other``, named as the declared one is); a single-device sharding is replicated; any
    other sharding (``GSPMDSharding`` from a compiler choice) is matched against the
    PartitionSpecs over ``mesh``'s axes with ``Sharding.is_equivalent_to`` (fewest axes first), and
    kept as kind ``other`` with JAX's text only when none is equivalent.
    """
    spec = getattr(sharding, "spec", None)
    if spec is not None:
        from stagetool.core.sharding import spec_dims
        from stagetool.devices.world import on_another_mesh, own_mesh_text

        if on_another_mesh(sharding, mesh):  # an input jax.jit takes on its own mesh of these devices
            found = _equivalent_spec(sharding, rank, mesh)
            return found if found is not None else Sharding("other", spec_dims(sharding.spec),
                                                            text=own_mesh_text(sharding))
        return _from_spec(tuple(spec), rank)
    if type(sharding).__name__ == "SingleDeviceSharding":
        return Sharding("spec", (None,) * rank)
    found = _equivalent_spec(sharding, rank, mesh)
    if found is not None:
        return found
    return Sharding("other", text=repr(sharding))


def _from_spec(dims: tuple, rank: int) -> Sharding:
    out = [d if (d is None or isinstance(d, str)) else (tuple(d) if len(tuple(d)) != 1 else tuple(d)[0])
           for d in dims]
    out = [None if isinstance(d, tuple) and not d else d for d in out]
    return Sharding("spec", tuple(out) + (None,) * (rank - len(out)))


_MAX_AXES_SEARCHED = 4


def _equivalent_spec(sharding: Any, rank: int, mesh: Any) -> Sharding | None:
    if mesh is None or not getattr(mesh, "axis_names", None):
        return None
    from jax.sharding import NamedSharding, PartitionSpec

    names = tuple(mesh.axis_names)[:_MAX_AXES_SEARCHED]
    # every placement of each axis on a dimension (or nowhere); fewest axes used first, then in mesh order
    candidates = sorted(itertools.product(range(-1, rank), repeat=len(names)),
                        key=lambda p: (sum(1 for d in p if d >= 0), [d if d >= 0 else rank for d in p]))
    for placement in candidates:
        dims: list[Any] = [None] * rank
        for axis, dim in zip(names, placement):
            if dim >= 0:
                dims[dim] = axis if dims[dim] is None else (*((dims[dim],) if isinstance(dims[dim], str)
                                                               else dims[dim]), axis)
        try:
            if sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec(*dims)), rank):
                return Sharding("spec", tuple(dims))
        except Exception:  # noqa: BLE001 - an inapplicable candidate
            continue
    return None


def _formats(formats: Any, n: int) -> list[Any]:
    """Flat ``Compiled.input_formats``/``output_formats`` (None where unavailable)."""
    import jax

    try:
        flat = jax.tree_util.tree_leaves(formats, is_leaf=lambda x: x is None or hasattr(x, "layout"))
    except Exception:  # noqa: BLE001 - layouts are optional facts
        return [None] * n
    return flat if len(flat) == n else [None] * n


def _padded(shard: tuple[int, ...] | None, dtype: Any, fmt: Any) -> int | None:
    """Tiled bytes of a shard when its layout is tiled (TPU), else None."""
    layout = getattr(fmt, "layout", None)
    if shard is None or layout is None or not getattr(layout, "tiling", None):
        return None
    from stagetool.core.dtypes import KEY_BITS, array_bytes
    from stagetool.hlo.tpu_layout import shard_bytes

    key_bits = KEY_BITS.get(str(dtype))
    if key_bits is not None:  # a typed PRNG key: its layout is its uint32 key data's, one dim more
        order = getattr(layout, "major_to_minor", None)
        if order is not None and len(order) != len(shard) + 1:
            return None
        shard, dtype = (*shard, key_bits // 32), "uint32"

    padded = shard_bytes(shard, dtype, layout).padded_bytes
    logical = array_bytes(shard, str(dtype))
    return max(padded, logical) if logical is not None else padded  # padding never takes bytes away


def input_facts(inputs: AbstractInputs, compiled: Any, mesh: Any) -> tuple[LeafFacts, ...]:
    """One :class:`LeafFacts` per input leaf, in JAX's flattening order.

    An input whose compiled sharding is None was pruned by the compiler (the function does not use
    it): it has no compiled sharding and no parameter number. The others are numbered in order as
    the compiled module's entry parameters. ``donated`` is true when the spec donates the leaf or
    ``Compiled.args_info`` says JAX donates it (a target jitted with its own ``donate_argnums``).
    """
    import jax

    dynamic = (tuple(inputs.args), {k: v for k, v in inputs.kwargs.items() if k not in inputs.static_argnames})
    structs, treedef = jax.tree_util.tree_flatten(dynamic)
    # Flattened up to the inputs' own structure: a None subtree of the inputs is no leaf, a None
    # sharding is an unused input, and a registered class with odd attributes is never probed.
    closed_over = False
    try:
        in_shardings = compiled.input_shardings
    except ValueError:  # inputs beyond the arguments: Refs the function closes over (ref_outputs)
        from stagetool.staging import ref_outputs

        in_shardings = ref_outputs.argument_inputs(compiled, len(inputs.leaves))
        if in_shardings is None:
            raise
        closed_over = True
    if closed_over:
        flat = in_shardings
    else:
        try:
            flat = treedef.flatten_up_to(_as_tuple(in_shardings))
        except (ValueError, TypeError):
            flat = jax.tree_util.tree_leaves(in_shardings, is_leaf=lambda x: x is None)
    if len(flat) != len(inputs.leaves):
        raise AssertionError(f"{len(flat)} compiled input shardings for {len(inputs.leaves)} input leaves")
    # Donation as JAX will apply it (``Compiled.args_info``): a target that is already jitted with its
    # own donate_argnums donates although the spec says nothing.
    try:
        infos = treedef.flatten_up_to(_as_tuple(getattr(compiled, "args_info", None)))
    except Exception:  # noqa: BLE001 - donation as the spec says
        infos = [None] * len(inputs.leaves)
    out = []
    parameter = 0
    formats = [None] * len(flat) if closed_over else _formats(compiled.input_formats, len(flat))
    for leaf, sharding, struct, info, fmt in zip(inputs.leaves, flat, structs, infos, formats, strict=True):
        donated = leaf.donated or bool(getattr(info, "donated", False))
        rank = len(leaf.shape)
        if sharding is None:
            out.append(LeafFacts(leaf.path, leaf.shape, leaf.dtype, leaf.declared, None, None, donated,
                                 leaf.local_shape, absolute_location(leaf.source),
                                 sharding_source=leaf.sharding_source))
            continue
        shard = tuple(sharding.shard_shape(leaf.shape))
        out.append(LeafFacts(leaf.path, leaf.shape, leaf.dtype, leaf.declared, sharding_of(sharding, rank, mesh),
                             shard, donated, leaf.local_shape, absolute_location(leaf.source), parameter,
                             _padded(shard, struct.dtype, fmt), leaf.sharding_source))
        parameter += 1
    return tuple(out)


def absolute_location(source: str | None) -> str | None:
    """A spec location ``file:line:col`` with its file absolute (relative to the working directory,
    as the spec was named): facts name files absolutely, as JAX's frames do, so a fact read from the
    cache equals the compile's however the spec was named (the report makes every path relative to
    the spec's folder, :mod:`stagetool.core.paths`). None, and ``<spec>:1:1`` (no file), unchanged."""
    import os

    if not source or source.startswith("<"):
        return source
    parts = source.rsplit(":", 2)
    if len(parts) != 3 or os.path.isabs(parts[0]):
        return source
    return f"{os.path.abspath(parts[0])}:{parts[1]}:{parts[2]}"


def _as_tuple(tree: Any) -> Any:
    """``(args, kwargs)`` as JAX's stages give it, with the args a tuple (as the inputs hold them)."""
    if isinstance(tree, (tuple, list)) and len(tree) == 2:
        return (tuple(tree[0]), tree[1])
    return tree


def ref_flags(inputs: AbstractInputs) -> tuple[bool, ...]:
    """Per input leaf (JAX's flattening order), whether it is a ``jax.Ref`` (staged as a
    ``jax.ref.AbstractRef``)."""
    import jax

    dynamic = (tuple(inputs.args), {k: v for k, v in inputs.kwargs.items() if k not in inputs.static_argnames})
    abstract_ref = getattr(getattr(jax, "ref", None), "AbstractRef", None)
    return tuple(abstract_ref is not None and isinstance(x, abstract_ref) for x in jax.tree_util.tree_leaves(dynamic))


def program_output_paths(traced: Any, inputs: AbstractInputs) -> list[str] | None:
    """The output paths a target's own program gives (an ``nnx.jit``/``eqx.filter_jit`` target staged
    as its own executable, ``inputs.program``: ``marker``, ``out/...``, the arguments' state), else None."""
    from stagetool.inputs.leaves import keypath_str

    program = inputs.program
    return program.output_paths(traced.out_info, keypath_str) if program is not None else None


def output_names(traced: Any, inputs: AbstractInputs) -> list[str]:
    """The path of each output leaf of a traced function (``Traced.out_info``, ``jax.tree_util`` order)
    as :func:`output_facts` names it: ``out/...``, an NNX argument's updated state by its input path,
    Equinox's ``marker``. A Ref's write-back output, which follows these, takes its Ref input's path."""
    import jax

    with_paths = jax.tree_util.tree_flatten_with_path(traced.out_info)[0]
    return _output_names(with_paths, inputs.state_outputs, program_output_paths(traced, inputs),
                         names_like_inputs(traced, inputs))


def _output_names(with_paths: list, state_outputs: tuple[str, ...], paths: list[str] | None,
                  like_inputs: list[str | None] | None = None) -> list[str]:
    from stagetool.inputs.leaves import keypath_str

    if paths is not None and len(paths) == len(with_paths):
        return list(paths)
    names = [keypath_str(kp)[1:] if state_outputs else "out" + keypath_str(kp) for kp, _ in with_paths]
    if like_inputs is not None and not state_outputs and len(like_inputs) == len(names):
        names = [n if mine is None else mine for n, mine in zip(names, like_inputs)]
    return names


def names_like_inputs(traced: Any, inputs: AbstractInputs) -> list[str | None] | None:
    """Per output leaf, a name taken from an argument whose leaves a framework named (a Keras state's
    ``state/0/hidden/kernel``, :mod:`stagetool.inputs.frameworks.keras`), or None: an output subtree
    with that argument's structure and its leaves' shapes and dtypes (the new state a step returns,
    ``(loss, (trainable, non_trainable, opt_vars))``) is named as it, under its own output path
    (``out/1/0/hidden/kernel``). None when no argument has such names (every other framework's
    outputs keep their key paths)."""
    import jax

    from stagetool.inputs.leaves import keypath_str

    if inputs.program is not None or inputs.state_outputs or inputs.wrapped:
        return None
    flat_args = jax.tree_util.tree_flatten_with_path((tuple(inputs.args), dict(inputs.kwargs)))[0]
    if len(flat_args) != len(inputs.leaves):
        return None
    named: dict[int, list[str]] = {}  # argument position -> its leaves' paths under the argument
    framework_named: set[int] = set()  # the arguments with a leaf a framework named
    for (kp, _), leaf in zip(flat_args, inputs.leaves):
        top = kp[1]
        if not hasattr(top, "idx"):
            continue
        rest = leaf.path.partition("/")[2]
        named.setdefault(top.idx, []).append(rest)
        if rest != keypath_str(kp[2:])[1:]:
            framework_named.add(top.idx)
    like = {i: named[i] for i in framework_named}
    shapes = {i: [(tuple(x.shape), str(x.dtype)) for x in jax.tree_util.tree_leaves(inputs.args[i])] for i in like}
    structures = {i: jax.tree_util.tree_structure(inputs.args[i]) for i in like}
    if not like:
        return None

    def match(x: Any) -> int | None:
        structure = jax.tree_util.tree_structure(x)
        for i in like:
            if structure == structures[i] and [(tuple(y.shape), str(y.dtype)) for y in
                                               jax.tree_util.tree_leaves(x)] == shapes[i]:
                return i
        return None

    out: list[str | None] = []
    for kp, sub in jax.tree_util.tree_flatten_with_path(traced.out_info, is_leaf=lambda x: match(x) is not None)[0]:
        i = match(sub)
        if i is None:
            out.append(None)
            continue
        out += ["out" + keypath_str(kp) + "/" + name for name in like[i]]
    return out


def output_facts(traced: Any, compiled: Any, declared_tree: Any, mesh: Any,
                 state_outputs: tuple[str, ...] = (), paths: list[str] | None = None,
                 ref_inputs: tuple[tuple[LeafFacts, ...], tuple[bool, ...]] | None = None,
                 target_out: Any = None, like_inputs: list[str | None] | None = None) -> tuple[LeafFacts, ...]:
    """One :class:`LeafFacts` per output leaf (paths start with ``out``).

    ``like_inputs``: per output leaf, a name taken from a framework-named argument
    (:func:`names_like_inputs`), or None (its key path).

    ``target_out``: a ``jax.jit`` target's own ``out_shardings`` (a prefix tree of NamedShardings,
    PartitionSpecs, None): an output it pins and the spec does not is declared with it, and its
    ``sharding_source`` is ``"target"``.

    ``declared_tree`` is the spec's ``out_shardings`` (None: every output is the compiler's choice,
    declared ``unspecified``). With ``state_outputs`` (a Flax NNX step that updates its arguments in
    place), the staged function returns ``{"out": output, name: updated state, ...}``: the output's
    leaves are named ``out/...`` and each argument's updated state ``name/...``, as its inputs are.
    ``paths``, when given, names each output leaf instead (an ``nnx.jit`` target's own program:
    :meth:`stagetool.inputs.frameworks.nnx.NnxProgram.output_paths`).

    ``ref_inputs`` (the input leaves' facts and which of them are Refs): a function that takes
    ``jax.Ref`` arguments has one more executable output per Ref argument it keeps; those follow the
    function's outputs, named by their Ref's input path and marked ``ref_write_back``
    (:mod:`stagetool.staging.ref_outputs`).
    """
    import jax

    with_paths, treedef = jax.tree_util.tree_flatten_with_path(traced.out_info)
    write_backs: list[tuple[LeafFacts, Any, Any]] = []
    found = None
    try:
        compiled_shardings = compiled.output_shardings
    except ValueError:
        # A program that writes jax.Refs: jax 0.10.2's Compiled.output_shardings/output_formats
        # fail to unflatten the Refs' extra outputs; ref_outputs reads them all. Where even that
        # fails the outputs' compiled shardings are unknown ("—"); memory and cost are unaffected.
        compiled_shardings = None
        found = _ref_program_outputs(compiled, len(with_paths), ref_inputs)
    if found is not None:
        shardings, formats, write_backs = found
    elif compiled_shardings is None:  # unknown, or a function that returns None (no output leaf)
        shardings = [None] * len(with_paths)
        formats = [None] * len(with_paths)
    else:
        try:  # by the outputs' own structure: a function returning None has no output leaf
            shardings = treedef.flatten_up_to(compiled_shardings)
        except (ValueError, TypeError):
            shardings = jax.tree_util.tree_leaves(compiled_shardings, is_leaf=lambda x: x is None)
        formats = _formats(compiled.output_formats, len(shardings))
    declared = _declared_outputs(declared_tree, len(with_paths), traced.out_info)
    pinned = (_declared_outputs(_as_declared(target_out), len(with_paths), traced.out_info)
              if target_out is not None and not state_outputs and paths is None else [None] * len(with_paths))
    out = []
    names = _output_names(with_paths, state_outputs, paths, like_inputs)
    for (kp, info), name, sharding, decl, pin, fmt in zip(with_paths, names, shardings, declared, pinned, formats,
                                                          strict=True):
        shape = tuple(info.shape)
        shard = tuple(sharding.shard_shape(shape)) if sharding is not None else None
        chosen = decl is None or decl.kind in ("auto", "unspecified")
        source = "compiler" if chosen else "spec"
        if decl is None and pin is not None:  # the target's own jax.jit(out_shardings=...) pins it
            decl, chosen, source = pin, False, "target"
        out.append(LeafFacts(name, shape, str(info.dtype),
                             decl if decl is not None else Sharding("unspecified"),
                             sharding_of(sharding, len(shape), mesh) if sharding is not None else None,
                             shard, padded_bytes_per_device=_padded(shard, info.dtype, fmt),
                             sharding_source=source))
    for ref, sharding, fmt in write_backs:
        shard = tuple(sharding.shard_shape(ref.shape))
        out.append(LeafFacts(ref.path, ref.shape, ref.dtype, ref.declared,
                             sharding_of(sharding, len(ref.shape), mesh), shard, source=ref.source,
                             padded_bytes_per_device=_padded(shard, ref.dtype, fmt),
                             sharding_source=ref.sharding_source, ref_write_back=True))
    return tuple(out)


def _closed_over_note(jitted: Any) -> tuple[str, ...]:
    """A note naming the ``jax.Ref``s the staged function closes over (module-level ones it reads and
    writes): inputs of the program that are no argument, so in XLA's argument bytes but in no input
    table; () when there is none."""
    import math

    from stagetool.core.units import format_bytes
    from stagetool.staging.stages import closed_over_refs

    refs = closed_over_refs(jitted)
    if not refs:
        return ()
    shown = ", ".join(f"{n} ({r.dtype}[{','.join(map(str, r.shape))}])" for n, r in refs)
    try:
        per_device = sum(math.prod(r.sharding.shard_shape(r.shape)) * r.dtype.itemsize for _, r in refs)
        size = f"{format_bytes(per_device)} per device, "
    except Exception:  # noqa: BLE001 - the size is a courtesy
        size = ""
    return (f"the function closes over {len(refs)} jax.Ref{'s' if len(refs) != 1 else ''} ({shown}): inputs of "
            f"the program that are no argument ({size}in XLA's argument bytes, in no input table), each written "
            "back in place",)


def _ref_program_outputs(compiled: Any, n_outputs: int, ref_inputs: Any) -> tuple[list, list, list] | None:
    """``(shardings, formats, write_backs)`` of a program whose ``Compiled.output_shardings`` raised:
    the function's outputs' shardings and formats, and per Ref write-back ``(ref input facts,
    sharding, format)`` (none for Refs the function closes over: they are no input leaf); None when
    that is not a Ref program or its outputs cannot be read."""
    from stagetool.staging import ref_outputs

    if ref_inputs is None:
        return None
    leaves, refs = ref_inputs
    if len(leaves) != len(refs):  # a program whose inputs are not the arguments' leaves one to one
        return None
    try:
        text = compiled.as_text()
    except Exception:  # noqa: BLE001 - no text, no write-backs to name
        return None
    n_results = ref_outputs.result_count(text or "")
    if n_results is None or n_results <= n_outputs:
        return None
    read = ref_outputs.all_outputs(compiled, n_results)
    if read is not None and not any(refs):
        # Refs the function closes over (no Ref argument): their write-backs follow the outputs and
        # name no input leaf; the function's own outputs are the first ones
        return read[0][:n_outputs], read[1][:n_outputs], []
    sources = ref_outputs.write_back_sources(text, n_outputs, n_results, [x.parameter for x in leaves], refs)
    if read is None or sources is None:
        return None
    shardings, formats = read
    write_backs = [(leaves[i], s, f) for i, s, f in zip(sources, shardings[n_outputs:], formats[n_outputs:],
                                                        strict=True)]
    return shardings[:n_outputs], formats[:n_outputs], write_backs


def _as_declared(tree: Any) -> Any:
    """A target's own ``out_shardings`` tree as :class:`Sharding` leaves (None where it pins nothing)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from stagetool.core.sharding import spec_dims

    def one(s: Any) -> Any:
        spec = s.spec if isinstance(s, NamedSharding) else s
        return Sharding("spec", spec_dims(spec)) if isinstance(spec, PartitionSpec) else None

    return jax.tree_util.tree_map(one, tree, is_leaf=lambda x: x is None or isinstance(x, (NamedSharding, PartitionSpec)))


def _declared_outputs(tree: Any, n: int, out_info: Any) -> list[Sharding | None]:
    """The spec's out_shardings broadcast over the output leaves (a single sharding covers all)."""
    import jax

    if tree is None:
        return [None] * n
    if isinstance(tree, Sharding):
        return [tree] * n
    try:
        # A prefix tree: each declared sharding covers the subtree of the output at its position.
        # (None, for auto, stays a leaf of the result: it covers its subtree's leaves too)
        return jax.tree_util.tree_leaves(
            jax.tree_util.tree_map(lambda s, sub: [s] * len(jax.tree_util.tree_leaves(sub)), tree, out_info,
                                   is_leaf=lambda x: isinstance(x, Sharding) or x is None),
            is_leaf=lambda x: isinstance(x, Sharding) or x is None)
    except Exception:  # noqa: BLE001 - a tree that does not fit was reported by fit_out_shardings
        return [None] * n

