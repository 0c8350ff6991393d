"""Abstract inputs: the spec's pytrees turned into ``jax.ShapeDtypeStruct``s on the mesh.

Every leaf becomes a ``ShapeDtypeStruct`` with a ``NamedSharding``, except ``auto`` leaves, which
carry no sharding so that the SPMD partitioner chooses it (JAX then sets
``allow_spmd_sharding_propagation_to_parameters`` for them; the choice is read back from
``compiled.input_shardings``). A leaf written without ``@`` is replicated.

Leaves are named by key path, ``/``-separated, starting with the argument's name from the
function's signature: ``params/layers/wq``, ``batch/tokens``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable

from stagetool.core.dtypes import hlo_name
from stagetool.core.errors import USER_CODE_ERRORS, SpecError, StagingError, TargetError, describe_exception
from stagetool.core.location import Loc
from stagetool.core.mesh import MeshSpec
from stagetool.core.sharding import AUTO, REPLICATED, Sharding
from stagetool.devices.provision import DeviceSetup, local_mesh_sizes
from stagetool.inputs.frameworks.jit import JitSettings
from stagetool.inputs.target import load_target, user_frame
from stagetool.spec.model import ArgSpec, CallSpec, FunctionSpec, InitSpec, KeySpec, LeafSpec, RefSpec, Rule, ValueSpec


@dataclasses.dataclass(frozen=True)
class InputLeaf:
    """One array input of the function, in the order JAX flattens ``(args, kwargs)``.

    Attributes:
      path: key path, e.g. ``params/layers/wq``.
      shape: global shape (the whole array).
      local_shape: the shape as one process sees it under ``avals: local``, else None.
      dtype: numpy dtype name (``bfloat16``) or PRNG key dtype (``key<fry>``).
      declared: the sharding the spec asks for (``auto`` leaves have kind ``"auto"``).
      source: where the leaf's shape or sharding was written (``file:line:col``), or None.
      donated: whether the leaf belongs to a donated argument.
      sharding_source: where ``declared`` comes from: ``"spec"`` (written on the leaf), ``"rule"`` (an
        ``init``'s rules), ``"init"`` (what the ``init`` gives the leaf when run: a nested jit's
        ``out_shardings``, a ``device_put``/sharding constraint, JAX's sharding types), ``"model"``
        (the model's own annotations: Flax metadata), ``"object"`` (a ``{ref:}`` leaf: the sharding the
        named object's array carries), ``"unknown"`` (an ``init``/``ref`` leaf nothing
        gives a sharding: staged replicated, and reported so), ``"compiler"`` (``auto``: the
        partitioner chooses), or None (a spec leaf written without ``@``: replicated).
      arg: the top-level argument the leaf belongs to (a position or a keyword name).
    """

    path: str
    shape: tuple[int, ...]
    local_shape: tuple[int, ...] | None
    dtype: str
    declared: Sharding
    source: str | None
    donated: bool
    sharding_source: str | None = None
    arg: int | str | None = None


@dataclasses.dataclass
class AbstractInputs:
    """What ``jax.jit(fn).trace`` is called with.

    Attributes:
      args: positional arguments, pytrees of ``jax.ShapeDtypeStruct`` (and plain Python values).
      kwargs: keyword arguments, likewise; static arguments are included here by name.
      leaves: one :class:`InputLeaf` per array leaf, in JAX's flattening order of ``(args, kwargs)``
        without static arguments.
      static_argnames: names of the static keyword arguments.
      donate_argnums / donate_argnames: donated arguments.
      fn: the callable to ``jax.jit``: the target, or a pure function of the array leaves that wraps
        it (:func:`stagetool.inputs.frameworks.dispatch.prepare_call`: non-array leaves, in-place Flax NNX
        updates, logical axis rules); None means the target itself.
      state_outputs: arguments whose updated state ``fn`` returns beside the target's output
        (``{"out": ..., name: ...}``); () when ``fn`` returns the target's output as it is.
      jit: the target's own jit settings (:class:`stagetool.inputs.frameworks.jit.JitSettings`).
      wrapped: whether ``fn`` is stagetool's pure wrapper (static leaves closed over) rather than
        the target (or the function under its ``jax.jit``) itself.
      out_shardings: for an ``nnx.jit`` target with in/out_shardings, the ``out_shardings`` of the
        staged ``fn`` that the wrapper gives when run: its ``out_shardings`` for the output and its
        ``in_shardings`` entry for each updated argument's state (``nnx.jit``'s inner jit returns the
        arguments' state with those); None otherwise (see :func:`nnx_out_shardings`).
      program: an ``nnx.jit`` / ``eqx.filter_jit`` target staged as its own program
        (:class:`stagetool.inputs.frameworks.nnx.NnxProgram`, ``equinox.EqxProgram``: ``args``/``kwargs`` are
        then the arguments as the wrapper splits them, ``leaves`` in that order), or None.
      in_shardings: ``in_shardings`` for the jit over ``args`` (flat leaves then) when a ``jax.Ref``
        leaf under auto axes has a sharding its type cannot carry (:func:`as_abstract_ref`), else None.
      notes: sentences for the report about how the inputs were staged (Flax NNX Variables shared
        between arguments that a nested staging gives an input per place).
    """

    args: tuple
    kwargs: dict
    leaves: list[InputLeaf]
    static_argnames: tuple[str, ...]
    donate_argnums: tuple[int, ...]
    donate_argnames: tuple[str, ...]
    fn: Callable[..., Any] | None = None
    state_outputs: tuple[str, ...] = ()
    jit: JitSettings | None = None
    wrapped: bool = False
    out_shardings: Any = None
    program: Any = None
    in_shardings: Any = None
    notes: tuple[str, ...] = ()


def build_inputs(fspec: FunctionSpec, fn: Callable[..., Any], setup: DeviceSetup, mesh_spec: MeshSpec, *,
                 avals: str = "global") -> AbstractInputs:
    """Build the abstract inputs of one function.

    Args:
      fspec: the function's spec.
      fn: the loaded callable (for argument names).
      setup: devices and mesh from :func:`stagetool.devices.provision.provision`.
      mesh_spec: the mesh's axis names and sizes.
      avals: ``global`` (spec shapes are whole arrays) or ``local`` (as one process sees them).

    Raises:
      SpecError: args/kwargs/static that do not bind to ``fn``'s signature (:func:`check_signature`),
        an unhashable static value, an ``init`` whose init_args do not bind to its signature;
        every leaf whose sharding does not fit its shape (rank, or a dimension the mesh
        axes do not divide), or that no rule matches, with its key path and spec location.
      TargetError: an ``init`` or ``call`` target cannot be loaded.
      StagingError: ``jax.eval_shape`` of an ``init`` function fails (exit code 3).
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from stagetool.inputs.jit_wrapper import jit_settings

    check_signature(fspec, fn)
    own = jit_settings(fn, len(fspec.args) + len(fspec.kwargs))
    fspec = _bind_for_in_shardings(fspec, fn, own)
    names = _arg_names(fn, len(fspec.args))
    issues: list[str] = []
    hints: list[str] = []  # one per kind of problem found, each fitting its kind
    by_id: dict[int, InputLeaf] = {}
    ref_shardings: dict[int, Any] = {}  # a Ref leaf under auto axes: its sharding (as_abstract_ref)
    local_sizes = local_mesh_sizes(mesh_spec, setup.process_of_device) if avals == "local" else None
    donated_nums, donated_names = merged_donation(fspec, fn, own)
    axis_size = dict(mesh_spec.axes)

    def to_struct(leaf: LeafSpec, sharding: Sharding, path: str, source: Loc | str | None, donated: bool,
                  origin: str | None = "spec", weak_type: bool = False):
        shape = tuple(leaf.shape)
        local_shape = None
        if local_sizes is not None:
            local_shape = shape
            shape = _global_shape(shape, sharding, axis_size, local_sizes)
        problem = check_fits(shape, sharding, axis_size)
        unknown = [a for a in sharding.axes if a not in axis_size] if sharding.kind == "spec" else []
        if unknown and not problem:
            problem = (f"sharding {sharding} names mesh axis {unknown[0]!r}, but the mesh has "
                       + (", ".join(repr(a) for a in axis_size) or "no axes"))
            issues.append(f"{source}: {path}: {problem}")
            hints.append("shard only over the mesh's axes; name logical axes through logical_axis_rules")
        elif problem:
            issues.append(f"{source}: {path}: {problem}")
            hints.append(_DIVIDE_HINT if "not divisible" in problem else _RANK_HINT)
        dtype = _jax_dtype(leaf.dtype)
        named = None
        if sharding.kind != "auto" and not problem:  # a bad sharding is reported, not handed to JAX
            named = NamedSharding(setup.mesh, PartitionSpec(*sharding.dims))
        struct = jax.ShapeDtypeStruct(shape, dtype, sharding=named, weak_type=weak_type)
        by_id[id(struct)] = InputLeaf(path, shape, local_shape, leaf.dtype, sharding,
                                      str(source) if source else None, donated,
                                      "compiler" if sharding.kind == "auto" else origin)
        return struct

    def convert(tree: Any, path: str, donated: bool, top: bool = False) -> Any:
        if isinstance(tree, LeafSpec):
            unspecified = tree.sharding.kind == "unspecified"
            sharding = REPLICATED if unspecified else tree.sharding
            return to_struct(tree, sharding, path, tree.loc, donated, None if unspecified else "spec")
        if isinstance(tree, InitSpec):
            return init_tree(tree, path, donated)
        if isinstance(tree, (RefSpec, ValueSpec)):
            return ref_tree(tree, path, donated)
        if isinstance(tree, KeySpec):
            issues.append(f"{tree.loc}: {path}: key({tree.seed}) is a concrete key for init_args; "
                          "an argument of the function takes an abstract key, e.g. 'key<fry>[]'")
            return None
        if isinstance(tree, CallSpec):
            return build_call(tree, fspec)
        if isinstance(tree, list):
            return [convert(t, f"{path}/{i}", donated) for i, t in enumerate(tree)]
        if isinstance(tree, tuple):
            return tuple(convert(t, f"{path}/{i}", donated) for i, t in enumerate(tree))
        if isinstance(tree, dict):
            return {k: convert(v, f"{path}/{k}", donated) for k, v in tree.items()}
        if top and isinstance(tree, (bool, int, float, str)):
            # passed as the value: at a jax.jit target's top level (as before), to eqx.filter_jit (a
            # Python number is static to Equinox), at an nnx.jit's static_argnums position
            return tree
        if isinstance(tree, (bool, int, float)):
            # A Python number is traced as a weakly typed scalar, as jax.jit does with a literal.
            dtype = "bool" if isinstance(tree, bool) else "int32" if isinstance(tree, int) else "float32"
            struct = jax.ShapeDtypeStruct((), _jax_dtype(dtype), weak_type=not isinstance(tree, bool),
                                          sharding=NamedSharding(setup.mesh, PartitionSpec()))
            by_id[id(struct)] = InputLeaf(path, (), None, dtype, REPLICATED, None, donated)
            return struct
        return tree

    # Flax NNX Variables reached from two places (an optimizer holding the model's own Params): per
    # struct, a key that is the same for every place of one Variable (see share_arguments)
    leaf_key: dict[int, Any] = {}
    alive: list[Any] = []  # the objects whose ids are keys

    def note_keys(tree: Any, keys: list) -> None:
        leaves = jax.tree_util.tree_leaves(tree)
        if len(leaves) == len(keys):
            leaf_key.update((id(x), k) for x, k in zip(leaves, keys) if k is not None)

    def init_tree(init: InitSpec, path: str, donated: bool) -> Any:
        shared: list = []
        shapes, produced, refs = eval_init(init, fspec, setup.mesh, rules_object(), with_dims=True, built=built,
                                           shared=shared)
        tree = abstract_tree(shapes, path, donated, init.loc, init.rules, init.has_rules, f"{init.loc}: {init.path}",
                             produced, refs)
        if any(k is not None for k in shared):
            # a Variable of an {arg: N} argument keeps that argument's key; one found twice in the
            # result gets a key of its own
            alive.append(init)
            note_keys(tree, [None if k is None else leaf_key.setdefault(id(k[1]), ("struct", id(k[1])))
                             if k[0] == "built" else ("init", id(init), k[1]) for k in shared])
        return tree

    def ref_tree(ref: RefSpec | ValueSpec, path: str, donated: bool) -> Any:
        from stagetool.inputs.frameworks.dispatch import is_ref

        obj = ref.value if isinstance(ref, ValueSpec) else \
            load_target(ref.target, base_dir=fspec.base_dir, need_callable=False).fn
        flat_obj = jax.tree_util.tree_leaves(obj)
        refs = [is_ref(x) for x in flat_obj]

        def struct_of(x: Any) -> Any:
            if is_ref(x):  # a jax.Ref: its value's struct (staged as an abstract ref below)
                x = x[...]
            if isinstance(x, jax.Array):
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None),
                                            weak_type=getattr(x, "weak_type", False))
            return x

        shapes = jax.tree_util.tree_map(struct_of, obj)
        tree = abstract_tree(shapes, path, donated, ref.loc, (), False, f"{ref.loc}: {path}", None, refs,
                             carried="object")
        from stagetool.inputs.frameworks.dispatch import uses

        if uses(obj, "flax"):  # the concrete objects' Variables, by identity (shared between two refs)
            from stagetool.inputs.frameworks import nnx

            alive.append(obj)
            note_keys(tree, [None if k is None else ("var", k) for k in nnx.variable_keys(obj)])
        return tree

    def abstract_tree(shapes: Any, path: str, donated: bool, loc: Loc, rules: tuple[Rule, ...], has_rules: bool,
                      where: str, produced: list | None, refs: list | None = None, carried: str = "init") -> Any:
        """Array leaves of an ``init`` result (or a ``ref``) as structs sharded by the rules, else as the
        init produces them (``produced``: per leaf, the dims its run gives, or None), else by the
        model's annotations, else replicated and said to be unknown; every other leaf as it is (static).
        ``carried`` names where a struct's own sharding comes from: ``"init"`` (what the init's
        ``eval_shape`` gives) or ``"object"`` (a ``{ref:}``: the sharding the object's arrays carry;
        said ``"model"`` when it is the model's own annotation)."""
        from stagetool.inputs.frameworks.dispatch import model_shardings, struct_dims

        flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
        from_model = model_shardings(shapes, rules_object()) if not has_rules else [None] * len(flat)
        # an init traced under explicit axes: every value's type carries its sharding, and one whose
        # type names no mesh (a constant such as an Adam count's jnp.array(0)) is replicated when run
        typed_init = produced is not None and mesh_spec.axis_types == "explicit"
        produced = produced if produced is not None else [None] * len(flat)
        refs = refs if refs is not None else [False] * len(flat)
        out = []
        for (kp, value), model_dims, run_dims, ref in zip(flat, from_model, produced, refs, strict=True):
            leaf_path = path + keypath_str(kp)
            if not isinstance(value, jax.ShapeDtypeStruct):
                out.append(value)
                continue
            sharding, source, origin = REPLICATED, loc, None
            if has_rules:
                found = _apply_rules(rules, leaf_path, value, fspec)
                if found is None:
                    issues.append(f"{where}.rules: no rule matches leaf {leaf_path!r} "
                                  f"({_dtype_name(value.dtype)}{list(value.shape)}); add a rule such as "
                                  "['.*', replicated] at the end")
                    out.append(jax.ShapeDtypeStruct(value.shape, value.dtype, weak_type=value.weak_type))
                    continue
                sharding, source = found
                origin = "rule"
            else:
                # What the init's run gives (its jaxpr; JAX's sharding types), else the model's
                # annotations, else unknown: staged replicated, and the leaf says so.
                dims, origin_if_found = run_dims, "init"
                if dims is not None and isinstance(model_dims, tuple) and _same_dims(dims, model_dims):
                    origin_if_found = "model"  # the model's annotation is what the init applied (Flax eager sharding)
                if dims is None:
                    dims = struct_dims(value)
                    if carried == "object" and dims is not None:
                        # the object's arrays carry it: the model's annotation when the two agree
                        # (Flax eager sharding put it there), else the object's own placement
                        same = isinstance(model_dims, tuple) and _same_dims(dims, model_dims)
                        origin_if_found = "model" if same else "object"
                if dims is None and typed_init and model_dims is None:
                    dims = (None,) * len(value.shape)  # NamedSharding(mesh, P()) when the init runs
                if dims is None:
                    dims, origin_if_found = model_dims, "model"
                if dims is None:
                    origin = "unknown"
                if isinstance(dims, str):  # the model's annotation cannot be resolved: say why
                    issues.append(f"{where}: leaf {leaf_path!r}: {dims}")
                    hints.append("name the rules at the top of the spec: logical_axis_rules: model.py:RULES")
                    out.append(jax.ShapeDtypeStruct(value.shape, value.dtype, weak_type=value.weak_type))
                    continue
                if dims is not None:
                    sharding, origin = Sharding("spec", dims), origin_if_found
                    unknown = [a for a in sharding.axes if a not in axis_size]
                    if unknown:
                        issues.append(f"{where}: the {origin if origin in ('init', 'object') else 'model'} shards leaf {leaf_path!r} over {', '.join(map(repr, unknown))}, "
                                      f"which the mesh does not have ({', '.join(axis_size) or 'no axes'})")
                        hints.append("name the logical axis rules (logical_axis_rules: model.py:RULES) or give "
                                     "rules for this argument")
                        out.append(jax.ShapeDtypeStruct(value.shape, value.dtype, weak_type=value.weak_type))
                        continue
            leaf = LeafSpec(tuple(value.shape), _dtype_name(value.dtype), sharding, loc)
            struct = to_struct(leaf, sharding, leaf_path, source, donated, origin, weak_type=value.weak_type)
            if ref:
                struct = as_abstract_ref(struct, by_id, mesh_spec.axis_types == "explicit", ref_shardings)
            out.append(struct)
        return jax.tree_util.tree_unflatten(treedef, out)

    rules_cache: list[Any] = []

    def rules_object() -> Any:
        if not rules_cache:
            rules_cache.append(resolve_logical_rules(fspec))
        return rules_cache[0]

    def as_value(i: int) -> bool:
        """Whether a Python value at position ``i`` is handed over as it is (see convert)."""
        from stagetool.inputs.jit_wrapper import is_jax_jit  # (an nnx.jit object is a jax.stages.Wrapped too)

        return is_jax_jit(fn) or own.kind == "eqx.filter_jit" or (own.kind == "nnx.jit" and i in own.static_argnums)

    built: dict[int | str, Any] = {}  # for {arg: ...} in a later init: by position and by name
    args_list = []
    for i, a in enumerate(fspec.args):
        args_list.append(convert(a, names[i], i in donated_nums, top=as_value(i)))
        built[i] = built[names[i]] = args_list[-1]
    args = tuple(args_list)
    kwargs = {}
    for k, v in fspec.kwargs.items():
        kwargs[k] = built[k] = convert(v, k, k in donated_names)
    static = {k: build_value(v, fspec) for k, v in fspec.static.items()}
    check_static_hashable(fspec, static)
    share_keys = [leaf_key.get(id(x)) for x in jax.tree_util.tree_leaves((args, kwargs))] if leaf_key else []
    if own.in_shardings is not None and not issues:
        args = _take_in_shardings(args, own, by_id, setup.mesh, fspec, issues, ref_shardings,
                                  mesh_spec.axis_types == "explicit")
    if own.out_shardings is not None and fspec.out_shardings is not None:
        issues.append(f"{fspec.where('out_shardings')}: functions.{fspec.name}.out_shardings: the spec gives "
                      f"out_shardings, and {fspec.target} is already {own.kind}(out_shardings=...); "
                      "its own out_shardings are the ones that run: drop the spec's")
    if issues:
        raise SpecError(issues, hint="; ".join(dict.fromkeys(hints)) or None)
    program = None
    if not any(v is not None for v in ref_shardings.values()):  # else the Refs' shardings go in the jit's in_shardings
        # A plain step over NNX objects that share Variables is staged as nnx.jit runs it (stagetool
        # stages a plain step's NNX updates in place, as nnx.jit does; a pytree per argument would
        # stage a shared Variable twice and update a copy)
        as_jit = own
        if own.kind is None and _has_shared(share_keys):
            from stagetool.inputs.frameworks.nnx import nnx_jit_settings

            as_jit = nnx_jit_settings(fn, tuple(static))
        own_args, own_kwargs, dropped = share_arguments(as_jit, args, kwargs, share_keys)
        program = _own_program(fspec, as_jit, own_args, own_kwargs, static, names, rules_object(),
                               (donated_nums, donated_names))
        if program is not None:
            args, kwargs = own_args, own_kwargs
            for x in dropped:  # a place replaced by the shared Variable's first: not an input
                by_id.pop(id(x), None)
    if program is not None:
        # nnx.jit's / eqx.filter_jit's own program: its inner jit on the arguments split as it splits them.
        from stagetool.inputs.frameworks.dispatch import leaf_arguments

        tops: dict[int, Any] = {}  # a shared Variable's leaf belongs to the first argument it is found in
        for x, t in zip(jax.tree_util.tree_leaves((args, kwargs)), leaf_arguments(args, kwargs)):
            tops.setdefault(id(x), t)
        structs = jax.tree_util.tree_leaves((program.args, {k: v for k, v in program.kwargs.items() if k not in static}))
        leaves = [dataclasses.replace(by_id[id(x)], arg=tops.get(id(x))) for x in structs if id(x) in by_id]

        def paths_of(tree: Any) -> list[str]:
            return [by_id[id(x)].path for x in jax.tree_util.tree_leaves(tree) if id(x) in by_id]

        program.input_paths = ([paths_of(a) for a in program.args],
                               {k: paths_of(v) for k, v in program.kwargs.items() if k not in static})
        return AbstractInputs(program.args, program.kwargs, leaves, tuple(static), tuple(sorted(donated_nums)),
                              tuple(sorted(donated_names)), None, (), own, False, None, program)
    from stagetool.inputs.frameworks.dispatch import prepare_call

    # A jax.jit target is staged as the function underneath, jitted once with its own settings
    # merged with the spec's (stages.jit_function): no nested jit, so its donation and options hold.
    call = own.fun if (own.kind == "jax.jit" and own.fun is not None) else fn
    # A Ref under auto axes with a sharding: the target is called from a pure function of the flat
    # leaves, jitted with in_shardings that give each Ref its sharding (as a concrete Ref's would).
    ref_sharded = any(v is not None for v in ref_shardings.values())
    prepared = prepare_call(call, args, kwargs, static, names=names, donate_argnums=tuple(sorted(donated_nums)),
                            donate_argnames=tuple(sorted(donated_names)), rules=rules_object(),
                            where=f"{fspec.where('args')}: functions.{fspec.name}: ",
                            in_place=own.kind != "jax.jit", by_leaf=ref_sharded)
    # The order JAX flattens (args, kwargs) in (dict keys sorted), as in compiled.input_shardings.
    structs = [x for x in jax.tree_util.tree_leaves((prepared.args, {k: v for k, v in prepared.kwargs.items()
                                                                     if k not in static}))]
    leaves = [dataclasses.replace(by_id[id(x)], arg=top) for x, top in zip(structs, prepared.leaf_args)
              if id(x) in by_id]
    in_shardings = _ref_in_shardings(prepared.args, ref_shardings) if ref_sharded else None
    if in_shardings is not None and prepared.kwargs:
        # jax.jit takes no keyword arguments with in_shardings, static ones included: closed over
        prepared = dataclasses.replace(prepared, fn=functools.wraps(prepared.fn)(
            functools.partial(prepared.fn, **prepared.kwargs)), kwargs={})
        static = {}
    notes = ()
    if own.kind != "jax.jit" and prepared.state_outputs and _has_shared(share_keys):
        notes = (_shared_note(args, kwargs, share_keys, by_id),)
    return AbstractInputs(prepared.args, prepared.kwargs, leaves, tuple(static), prepared.donate_argnums,
                          prepared.donate_argnames, prepared.fn if prepared.fn is not fn else None,
                          prepared.state_outputs, own, prepared.fn is not call,
                          nnx_out_shardings(own, args, names, prepared.state_outputs), None, in_shardings, notes)


def _shared_note(args: tuple, kwargs: dict, keys: list, by_id: dict) -> str:
    """What a nested staging does with Variables the arguments share (see :func:`share_arguments`)."""
    import jax

    leaves = jax.tree_util.tree_leaves((args, kwargs))
    first: dict[Any, str] = {}
    pairs: list[tuple[str, str]] = []
    for x, k in zip(leaves, keys):
        path = by_id[id(x)].path if id(x) in by_id else "?"
        if k is None:
            continue
        if k in first:
            pairs.append((first[k], path))
        else:
            first[k] = path
    example = f"{pairs[0][1]} is {pairs[0][0]}" if pairs else ""
    return (f"the arguments share Flax NNX Variables ({example}; {len(pairs)} in all): nnx.jit splits them as one "
            "input and one output each, but this step is staged nested (the spec gives what nnx.jit's own program "
            "cannot take: out_shardings, static values it does not declare, or arguments that are not arrays), "
            "where each place is an input and an output of its own: argument and output bytes count them once per "
            "place, and the update of one place does not reach the other")


def _has_shared(keys: list) -> bool:
    """Whether two leaves have the same key (one Variable reached from two places)."""
    named = [k for k in keys if k is not None]
    return len(set(named)) != len(named)


def share_arguments(own: JitSettings, args: tuple, kwargs: dict, keys: list) -> tuple[tuple, dict, list]:
    """The arguments of an ``nnx.jit`` target with the Flax NNX Variables the real objects share made
    one object again (:func:`stagetool.inputs.frameworks.nnx.share_arguments`). ``jax.jit`` flattens
    each argument as a pytree (an input per place), so any other target gets the arguments as they
    are (a plain step is handed here as ``nnx.jit`` of it,
    :func:`stagetool.inputs.frameworks.nnx.nnx_jit_settings`). Returns ``(args, kwargs, dropped)``."""
    if own.kind != "nnx.jit" or not _has_shared(keys):
        return args, kwargs, []
    from stagetool.inputs.frameworks import nnx

    return nnx.share_arguments(args, kwargs, keys)


def _own_program(fspec: FunctionSpec, own: JitSettings, args: tuple, kwargs: dict, static: dict, names: list[str],
                 rules: Any, donated: tuple[set, set]) -> Any:
    """The target's own program when the spec adds nothing its wrapper cannot take, else None
    (staged nested, merged with the spec).

    - ``eqx.filter_jit`` (:func:`stagetool.inputs.frameworks.equinox.eqx_program`): no ``out_shardings``,
      no ``donate`` beyond Equinox's own.
    - ``nnx.jit`` (:func:`stagetool.inputs.frameworks.nnx.nnx_program`): no ``out_shardings``,
      ``static`` values only for the wrapper's ``static_argnames``, every argument leaf an array (a
      graph node's Variables included), and a ``donate`` of the spec's own (``donated``: the merged
      positions and names) only where the step can be jitted once with it
      (:func:`stagetool.inputs.frameworks.nnx.nnx_with_donation`).
    """
    import jax

    if own.kind not in ("nnx.jit", "eqx.filter_jit") or fspec.out_shardings is not None:
        return None
    context = (lambda: _rules_context(rules)) if rules is not None else None
    if own.kind == "eqx.filter_jit":
        if fspec.donate and not own.donates:
            return None
        from stagetool.inputs.frameworks.equinox import eqx_program

        return eqx_program(own, args, {**kwargs, **static}, context)
    if not set(static) <= set(own.static_argnames):
        return None
    if fspec.donate and not own.donates:  # the spec's donation: the step jitted once with it (never nested)
        from stagetool.inputs.frameworks.nnx import nnx_with_donation

        own = nnx_with_donation(own, tuple(sorted(donated[0])), tuple(sorted(donated[1])))
        if own is None:
            return None
    if not all(isinstance(x, (jax.ShapeDtypeStruct, jax.ref.AbstractRef)) for x in jax.tree_util.tree_leaves((args, kwargs))):
        return None
    from stagetool.inputs.frameworks.nnx import nnx_program

    return nnx_program(own, args, {**kwargs, **static}, names, context)


def _rules_context(rules: Any) -> Any:
    from stagetool.inputs.frameworks.dispatch import logical_rules

    return logical_rules(rules)


def nnx_out_shardings(own: JitSettings, args: tuple, names: list[str], state_outputs: tuple[str, ...]) -> Any:
    """The ``out_shardings`` an ``nnx.jit`` target's own in/out_shardings give the staged function
    (:func:`stagetool.inputs.frameworks.nnx.out_shardings`); None when it is not ``nnx.jit`` or gives neither."""
    if own.kind != "nnx.jit" or (own.in_shardings is None and own.out_shardings is None):
        return None
    from stagetool.inputs.frameworks import nnx

    return nnx.out_shardings(own, args, names, state_outputs)


def as_abstract_ref(struct: Any, by_id: dict, explicit: bool, ref_shardings: dict | None = None) -> Any:
    """A ``jax.Ref`` leaf as the abstract ref raw JAX traces a Ref argument as:
    ``jax.ref.AbstractRef(ShapedArray(shape, dtype))``. Under an explicit-axes mesh the sharding is
    part of the type (its spec over the abstract mesh). Under auto axes a Ref's type carries none:
    ``jax.jit`` takes a concrete Ref's sharding from its value's placement, so the leaf keeps its
    sharding (spec, init, model) and it is recorded in ``ref_shardings`` (``id(ref)`` →
    ``NamedSharding`` or None) for the jit's ``in_shardings`` (:func:`build_inputs`)."""
    import jax
    from jax.sharding import NamedSharding

    sharding = getattr(struct, "sharding", None)
    if explicit and isinstance(sharding, NamedSharding):
        aval = jax.core.ShapedArray(struct.shape, struct.dtype, weak_type=struct.weak_type,
                                    sharding=NamedSharding(sharding.mesh.abstract_mesh, sharding.spec))
    else:
        aval = jax.core.ShapedArray(struct.shape, struct.dtype, weak_type=struct.weak_type)
    ref = jax.ref.AbstractRef(aval)
    leaf = by_id.pop(id(struct), None)  # the struct is dropped: its id may be reused
    if leaf is not None:
        by_id[id(ref)] = leaf
    if not explicit and ref_shardings is not None:
        ref_shardings[id(ref)] = sharding if isinstance(sharding, NamedSharding) else None
    return ref


def _ref_in_shardings(args: tuple, ref_shardings: dict) -> tuple | None:
    """``in_shardings`` for ``jax.jit`` over the flat dynamic ``args`` when a Ref leaf under auto
    axes has a sharding (its type cannot carry it): per leaf its sharding (a struct's own, a Ref's
    recorded one; None: the compiler's, as for an unsharded struct); None when no Ref needs one."""
    if not any(ref_shardings.get(id(x)) is not None for x in args):
        return None
    return tuple(ref_shardings[id(x)] if id(x) in ref_shardings else getattr(x, "sharding", None) for x in args)


def resolve_logical_rules(fspec: FunctionSpec) -> tuple | None:
    """The function's Flax logical axis rules as a tuple of ``(logical name, mesh axes)`` pairs, or None.

    ``fspec.logical_axis_rules`` may name (``model.py:NAME``) or build (``{call: ...}``) a list of
    rules, a callable returning them (called with no arguments), or an object with a
    ``logical_axis_rules`` attribute (lm1b's ``get_config()``); an inline list is taken as it is.

    Raises:
      SpecError: what it gives is not a list of ``(str, axis | None | axes)`` pairs, or calling it
        fails, at the spec's ``logical_axis_rules`` line.
      TargetError: the object cannot be loaded.
    """
    value = fspec.logical_axis_rules
    if value is None:
        return None
    where = f"{fspec.where('logical_axis_rules')}: logical_axis_rules"
    if isinstance(value, str):
        obj = _load_at(value, fspec, fspec.where("logical_axis_rules"), "logical_axis_rules", need_callable=False).fn
        what = value
    elif isinstance(value, CallSpec):
        obj, what = build_call(value, fspec), f"{{call: {value.target}}}"
    else:
        obj, what = value, "the inline list"
    for _ in range(4):  # an object's attribute, a callable's result (a get_config() returning a config)
        if isinstance(obj, (list, tuple)):
            break
        if hasattr(obj, "logical_axis_rules"):
            obj = obj.logical_axis_rules
        elif callable(obj):
            try:
                obj = obj()
            except USER_CODE_ERRORS as e:
                raise SpecError([f"{where}: calling {what} failed: {describe_exception(e)}"],
                                hint="name a function that takes no arguments, or the rules themselves") from None
        else:
            break
    pairs = list(obj) if isinstance(obj, (list, tuple)) else None

    def is_axis(a: Any) -> bool:
        return a is None or isinstance(a, str) or (isinstance(a, (list, tuple)) and all(isinstance(x, str) for x in a))

    if pairs is None or not all(isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str)
                                and is_axis(p[1]) for p in pairs):
        shown = f"{obj!r:.80}"
        raise SpecError([f"{where}: {what} gives a {type(obj).__name__} ({shown}), not a list of "
                         "(logical name, mesh axis) pairs"],
                        hint="name the rules themselves, a function returning them, or an object with a "
                             "logical_axis_rules attribute; or write them inline: [[embed, model], [batch, data]]")
    return tuple((p[0], tuple(p[1]) if isinstance(p[1], list) else p[1]) for p in pairs)


def merged_donation(fspec: FunctionSpec, fn: Callable[..., Any], own: JitSettings) -> tuple[set, set]:
    """The donated positions and names: the spec's ``donate`` and the target's own jit's donation
    (``jax.jit(donate_argnums=...)``, ``nnx.jit(donate_argnames=...)``, ``eqx.filter_jit(donate="all")``).

    One side alone is taken as it is; both the same is fine.

    Raises:
      SpecError: both donate, and not the same arguments (naming both).
    """
    spec_nums = {d for d in fspec.donate if isinstance(d, int)}
    spec_names = {d for d in fspec.donate if isinstance(d, str)}
    own_nums, own_names = set(own.donate_argnums), set(own.donate_argnames)
    if not (own_nums or own_names):
        return spec_nums, spec_names
    if not fspec.donate:
        return own_nums, own_names

    def positions(nums: set, names_: set) -> set:
        params = _arg_names(fn, 64)
        return nums | {params.index(n) if n in params else n for n in names_}

    if positions(spec_nums, spec_names) != positions(own_nums, own_names):
        wrapper = ", ".join(f"{k}={sorted(v)}" for k, v in (("donate_argnums", own_nums), ("donate_argnames", own_names)) if v)
        raise SpecError([f"{fspec.where('donate')}: functions.{fspec.name}.donate: the spec donates "
                         f"{list(fspec.donate)}, but {fspec.target} is already {own.kind}({wrapper}), which donates "
                         "other arguments"], hint="make the spec's donate the same as the target's own, or drop it")
    return spec_nums | own_nums, spec_names | own_names


def _bind_for_in_shardings(fspec: FunctionSpec, fn: Callable[..., Any], own: JitSettings) -> FunctionSpec:
    """For a target jitted with ``in_shardings`` (which ``jax.jit`` takes only with positional
    arguments), the spec's ``kwargs`` that name positional parameters moved to their positions.

    Raises:
      SpecError: a keyword that cannot become positional (a position before it is not given, or
        a keyword-only parameter).
    """
    if own.in_shardings is None or not fspec.kwargs:
        return fspec
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return fspec
    args, kwargs = list(fspec.args), dict(fspec.kwargs)
    locs = dict(fspec.locs)
    donate = list(fspec.donate)
    for p in params[len(args):]:
        if p.name not in kwargs:
            break
        args.append(kwargs.pop(p.name))
        i = len(args) - 1
        if f"kwargs.{p.name}" in locs:
            locs[f"args[{i}]"] = locs[f"kwargs.{p.name}"]
        donate = [i if d == p.name else d for d in donate]
    if kwargs:
        name = next(iter(kwargs))
        raise SpecError([f"{fspec.locs.get('kwargs.' + name) or fspec.where('kwargs')}: functions.{fspec.name}.kwargs: "
                         f"{fspec.target} is jitted with in_shardings, and jax.jit then takes positional arguments "
                         f"only; {name!r} cannot be given by position (every parameter before it must be given)"],
                        hint="give the arguments under 'args', in order")
    return dataclasses.replace(fspec, args=tuple(args), kwargs={}, donate=tuple(donate), locs=locs)


#: Who gave a leaf the sharding that a target's in_shardings contradict, and how to drop it.
_WHO_SHARDS = {
    "spec": ("the spec shards it", "drop the spec's '@ ...' (the target's in_shardings apply)"),
    "rule": ("the spec's rules shard it", "drop the rule (the target's in_shardings apply)"),
    "init": ("the init gives it", "build it as the target's in_shardings say (a jit that runs it with "
             "other shardings fails)"),
    "model": ("the model's annotations shard it", "annotate the model as the target's in_shardings say "
              "(a jit that runs it with other shardings fails)"),
}


def _take_in_shardings(args: tuple, own: JitSettings, by_id: dict, mesh: Any, fspec: FunctionSpec, issues: list[str],
                       ref_shardings: dict | None = None, explicit: bool = False) -> tuple:
    """The positional ``args`` with each array leaf sharded as the target's own ``in_shardings``
    say: a leaf the spec writes without ``@`` takes it (``sharding_source: "target"``); one whose
    ``@`` differs is an issue naming both. A ``jax.Ref`` leaf stays a Ref: under explicit axes the
    sharding goes in its type, under auto axes in ``ref_shardings`` (see :func:`as_abstract_ref`)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from stagetool.inputs.jit_wrapper import in_sharding_dims

    dims = iter(in_sharding_dims(own, args))

    def one(x: Any) -> Any:
        d = next(dims)
        leaf = by_id.get(id(x))
        if d is None or leaf is None:
            return x
        wanted = Sharding("spec", d)
        if isinstance(x, jax.ref.AbstractRef) and leaf.sharding_source in (None, "unknown"):
            inner = x.inner_aval
            typed = NamedSharding(mesh.abstract_mesh, PartitionSpec(*d)) if explicit else None
            ref = jax.ref.AbstractRef(jax.core.ShapedArray(inner.shape, inner.dtype, weak_type=inner.weak_type,
                                                           sharding=typed))
            by_id.pop(id(x), None)
            by_id[id(ref)] = dataclasses.replace(leaf, declared=wanted, sharding_source="target")
            if ref_shardings is not None:
                ref_shardings.pop(id(x), None)
                if not explicit:
                    ref_shardings[id(ref)] = NamedSharding(mesh, PartitionSpec(*d))
            return ref
        if leaf.sharding_source in (None, "unknown"):
            struct = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, PartitionSpec(*d)),
                                          weak_type=getattr(x, "weak_type", False))
            by_id[id(struct)] = dataclasses.replace(leaf, declared=wanted, sharding_source="target")
            return struct
        if leaf.declared.kind == "spec" and not _same_dims(leaf.declared.dims, d):
            who, fix = _WHO_SHARDS.get(leaf.sharding_source, _WHO_SHARDS["spec"])
            issues.append(f"{leaf.source or fspec.where('args')}: {leaf.path}: {who} {leaf.declared}, but "
                          f"{fspec.target}'s own {own.kind}(in_shardings=...) gives {wanted}; {fix} "
                          "or make them agree")
        return x

    return jax.tree_util.tree_map(one, args)


def signature_problems(fn: Callable[..., Any], n_args: int, kwnames: list[str]) -> list[tuple[str, str]]:
    """Why ``fn`` cannot be called with ``n_args`` positional arguments and keywords ``kwnames``.

    Returns ``(where, message)`` pairs, ``where`` being ``"args"``, ``"kw:<name>"`` or ``""`` (the
    call as a whole, e.g. a missing argument); empty when the call binds, or when ``fn`` has no
    signature ``inspect.signature`` can read (then nothing is checked).
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    params = list(sig.parameters.values())
    P = inspect.Parameter
    positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    var_pos = any(p.kind == P.VAR_POSITIONAL for p in params)
    var_kw = any(p.kind == P.VAR_KEYWORD for p in params)
    by_name = {p.name: p for p in params if p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)}
    out: list[tuple[str, str]] = []
    if n_args > len(positional) and not var_pos:
        plural = "s" if len(positional) != 1 else ""
        out.append(("args", f"takes {len(positional)} positional argument{plural}, but the spec gives {n_args}"))
    given_by_position = {p.name for p in positional[:n_args]}
    for name in kwnames:
        p = by_name.get(name)
        if p is None:
            if not var_kw:
                import difflib

                close = difflib.get_close_matches(name, list(by_name), n=1, cutoff=0.6)
                out.append((f"kw:{name}", f"has no parameter {name!r}"
                            + (f" (did you mean {close[0]!r}?)" if close else "")))
        elif p.kind == P.POSITIONAL_ONLY:
            out.append((f"kw:{name}", f"parameter {name!r} is positional-only; give it under 'args'"))
        elif name in given_by_position:
            out.append((f"kw:{name}", f"parameter {name!r} is given twice: by position in 'args' and by name"))
    given = given_by_position | set(kwnames)
    missing = [p.name for p in params if p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)
               and p.default is P.empty and p.name not in given]
    if missing:
        out.append(("", f"missing required argument{'s' if len(missing) > 1 else ''} "
                        + ", ".join(repr(m) for m in missing)))
    if not out:
        try:
            sig.bind(*range(n_args), **{k: None for k in kwnames})
        except TypeError as e:  # anything the checks above do not name
            out.append(("", str(e)))
    return out


def describe_callable(fn: Callable[..., Any]) -> str:
    """``name(signature)`` of a callable, e.g. ``mlp(params, batch, *, train=False)``."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    try:
        return f"{name}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return f"{name}(...)"


def check_signature(fspec: FunctionSpec, fn: Callable[..., Any]) -> None:
    """Bind the spec's ``args``, ``kwargs`` and ``static`` against ``inspect.signature(fn)``, before any tracing.

    Also checks that every static value is hashable, as ``jax.jit`` requires.

    Raises:
      SpecError: an extra or missing positional or keyword argument, a static name the function
        does not take, or an unhashable static value; each at the location of the spec key it is
        about (the function's entry for a missing argument), with the function's signature.
    """
    described = describe_callable(fn)
    path = f"functions.{fspec.name}"
    issues: list[str] = []
    kwnames = list(fspec.kwargs) + [k for k in fspec.static if k not in fspec.kwargs]
    for where, message in signature_problems(fn, len(fspec.args), kwnames):
        if where == "args":
            loc, key = fspec.where("args"), f"{path}.args"
        elif where.startswith("kw:"):
            name = where[3:]
            section = "static" if name in fspec.static else "kwargs"
            loc, key = fspec.locs.get(f"{section}.{name}") or fspec.where(section), f"{path}.{section}"
        else:
            loc, key = fspec.loc, path
        issues.append(f"{loc}: {key}: {described} {message}")
    for name in fspec.static:
        if name in fspec.kwargs:
            issues.append(f"{fspec.where('static.' + name)}: {path}.static: {name!r} is both in kwargs and static; "
                          "keep it in one")
    if issues:
        raise SpecError(issues, hint="make args/kwargs/static match the function's parameters")


def check_static_hashable(fspec: FunctionSpec, static: dict[str, Any]) -> None:
    """Raise SpecError for a built static value that ``jax.jit`` could not hash (a list, a dict)."""
    issues = []
    for name, value in static.items():
        try:
            hash(value)
        except USER_CODE_ERRORS as e:  # unhashable, or a __hash__ of the user's that raises
            if not isinstance(e, TypeError):
                issues.append(f"{fspec.where('static.' + name)}: functions.{fspec.name}.static.{name}: "
                              f"hashing the {type(value).__name__} failed: {describe_exception(e)}")
                continue
            issues.append(f"{fspec.where('static.' + name)}: functions.{fspec.name}.static.{name}: "
                          f"a static value must be hashable, and a {type(value).__name__} is not"
                          + ("; write a list as a tuple: !tuple [...]" if isinstance(value, list) else ""))
    if issues:
        raise SpecError(issues)


def check_out_shardings(fspec: FunctionSpec, out_info: Any, axis_size: dict[str, int] | None = None,
                        inputs: AbstractInputs | None = None) -> Any:
    """Check the spec's ``out_shardings`` against the traced output tree; return it in the output's shape.

    ``out_shardings`` is a prefix of the output pytree: a sharding (or ``auto``) stands for a whole
    subtree; a list stands for a tuple or list of as many outputs; a mapping for a dict with the
    same keys. Because YAML has only one kind of list, a spec list matches a tuple or a list output
    and the returned tree uses the output's type (``jax.jit`` requires the exact type).

    Args:
      fspec: the function's spec (``out_shardings`` not None).
      out_info: ``jax.stages.Traced.out_info`` of a trace *without* out_shardings (a pytree of
        ``ShapeDtypeStruct``-like leaves).

    Returns:
      ``fspec.out_shardings`` with each list as the output's tuple or list: pass it to
      :func:`stagetool.staging.stages.jit_function` via ``dataclasses.replace(fspec, out_shardings=...)``.

    Raises:
      SpecError: at the out_shardings location, naming the key path where the structures part and
        describing both (the spec's, and the function's outputs).
    """
    if fspec.out_shardings is None:
        return None
    problems: list[str] = []

    def fits(spec: Sharding, out: Any, path: str) -> None:
        """Every output leaf under ``out`` must be divisible by ``spec`` (with the leaf's path)."""
        if axis_size is None:
            return
        import jax

        for key_path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
            if not _is_struct(leaf):
                continue
            where = path + jax.tree_util.keystr(key_path)
            why = check_fits(tuple(leaf.shape), spec, axis_size)
            if why:
                dims = ",".join(str(d) for d in leaf.shape)
                problems.append(f"at {where or 'the output'} ({hlo_name(str(leaf.dtype))}[{dims}]): {why}")

    import jax

    from stagetool.spec.model import LikeSpec, OutRulesSpec

    def conform(spec: Any, out: Any, path: str) -> Any:
        if spec is None or isinstance(spec, Sharding):
            if isinstance(spec, Sharding):
                fits(spec, out, path)
            return spec
        at = f"at {path}: " if path else ""
        if isinstance(spec, LikeSpec):
            return like(spec, out, at)
        if isinstance(spec, OutRulesSpec):
            flat, treedef = jax.tree_util.tree_flatten_with_path(out)
            chosen = []
            for kp, value in flat:
                leaf_path = "out" + (f"/{path}" if path else "") + keypath_str(kp)
                found = _apply_rules(spec.rules, leaf_path, value, fspec)
                if found is None:
                    problems.append(f"{at}no rule matches output leaf {leaf_path!r}; add a rule such as ['.*', replicated]")
                    return spec
                chosen.append(found[0])
            return jax.tree_util.tree_unflatten(treedef, chosen)
        if isinstance(spec, (list, tuple)):
            if type(out) in (list, tuple) and len(out) == len(spec):
                return type(out)(conform(sv, ov, f"{path}[{i}]") for i, (sv, ov) in enumerate(zip(spec, out)))
            problems.append(f"{at}the spec gives a list of {len(spec)} shardings, but the function returns "
                            f"{_describe_tree(out)}")
            return spec
        if isinstance(spec, dict):
            if isinstance(out, dict) and set(map(str, out)) == set(spec):
                return {k: conform(spec[str(k)], v, f"{path}.{k}" if path else str(k)) for k, v in out.items()}
            problems.append(f"{at}the spec gives a mapping with keys {', '.join(sorted(spec))}, but the function "
                            f"returns {_describe_tree(out)}")
            return spec
        return spec

    def like(spec: Any, out: Any, at: str) -> Any:
        leaves = [x for x in (inputs.leaves if inputs else []) if x.arg == spec.arg]
        flat, treedef = jax.tree_util.tree_flatten(out)
        if not leaves or len(leaves) != len(flat) or any(tuple(x.shape) != tuple(o.shape) for x, o in zip(leaves, flat)):
            problems.append(f"{at}like: {spec.arg!r} names an argument with {len(leaves)} array leaves, but this "
                            f"output subtree has {len(flat)}" + (" of other shapes" if len(leaves) == len(flat) else "")
                            + f" ({_describe_tree(out)})")
            return spec
        return jax.tree_util.tree_unflatten(treedef, [None if x.declared.kind == "auto" else x.declared for x in leaves])

    declared = fspec.out_shardings
    if inputs is not None and inputs.state_outputs:
        # The staged function returns {"out": the target's output, name: updated state, ...}; the spec's
        # out_shardings are the target's, and the updated state is left to the compiler (as nnx.jit
        # does), unless the spec names the updated arguments as keys beside "out".
        names = {"out", *inputs.state_outputs}
        if isinstance(declared, dict) and set(declared) <= names and set(declared) & set(inputs.state_outputs):
            # {out: ..., model: {like: 0}}: the updated state pinned too (keys the spec omits: the compiler's)
            declared = {k: declared.get(k) for k in ("out", *inputs.state_outputs)}
        else:
            declared = {"out": declared, **{name: None for name in inputs.state_outputs}}
    out = conform(declared, out_info, "")
    if problems:
        loc = fspec.where("out_shardings")
        raise SpecError([f"{loc}: functions.{fspec.name}.out_shardings: " + "; ".join(problems)
                         + f" (out_shardings: {_describe_tree(fspec.out_shardings)})"],
                        hint="give one sharding per output, in a list for a tuple or list of outputs and in "
                             "a mapping for a dict; a single sharding or 'auto' covers a whole subtree")
    return out


def fit_out_shardings(fspec: FunctionSpec, fn: Callable[..., Any], inputs: AbstractInputs, mesh: Any) -> FunctionSpec:
    """``fspec`` with ``out_shardings`` checked and fitted to the function's outputs (see :func:`check_out_shardings`).

    Traces ``fn`` once without out_shardings (under ``jax.set_mesh(mesh)``) to read
    ``Traced.out_info``; costs one extra trace, and only when the spec gives out_shardings. When
    that trace itself fails, ``fspec`` is returned unchanged, so that staging reports the failure
    as usual (exit code 3).

    Raises:
      SpecError: the out_shardings do not fit the output tree (exit code 2).
    """
    import dataclasses as dc

    import jax

    if fspec.out_shardings is None:
        return fspec
    options: dict[str, Any] = {"static_argnames": inputs.static_argnames} if inputs.static_argnames else {}
    fn = inputs.fn or fn
    try:
        probe = fn if isinstance(fn, jax.stages.Wrapped) else jax.jit(fn, **options)
        with jax.set_mesh(mesh):
            out_info = probe.trace(*inputs.args, **inputs.kwargs).out_info
    except USER_CODE_ERRORS:  # the user's function fails to trace: staging says so, with its frame
        return fspec
    return dc.replace(fspec, out_shardings=check_out_shardings(fspec, out_info, dict(mesh.shape), inputs))


def _is_struct(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _describe_tree(tree: Any, depth: int = 0) -> str:
    """A short readable picture of a pytree: ``(f32[8], {a: f32[2,4], b: i32[]})``; shardings as ``P(...)``."""
    if depth > 3:
        return "..."
    if tree is None:
        return "auto"
    if isinstance(tree, Sharding):
        return str(tree)
    if _is_struct(tree):
        return f"{hlo_name(str(tree.dtype))}{list(tree.shape)}".replace(" ", "")
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        items = [_describe_tree(t, depth + 1) for t in tree[:8]] + (["..."] if len(tree) > 8 else [])
        kind = "a tuple" if isinstance(tree, tuple) else "a list"
        inner = ", ".join(items)
        return f"{kind} of {len(tree)} ({inner})" if depth == 0 else f"({inner})" if isinstance(tree, tuple) else f"[{inner}]"
    if isinstance(tree, dict):
        keys = sorted(tree, key=str)
        inner = ", ".join(f"{k}: {_describe_tree(tree[k], depth + 1)}" for k in keys[:8]) + (", ..." if len(keys) > 8 else "")
        return f"a dict {{{inner}}}" if depth == 0 else f"{{{inner}}}"
    return f"a {type(tree).__name__}" if depth == 0 else type(tree).__name__


_DIVIDE_HINT = "shard a dimension only over mesh axes whose sizes divide it"
_RANK_HINT = "a sharding has at most one entry per array dimension (trailing dimensions are replicated)"


def check_fits(shape: tuple[int, ...], sharding: Sharding, axis_size: dict[str, int]) -> str | None:
    """Why ``sharding`` cannot lay out an array of ``shape``, or None when it can.

    A PartitionSpec may be shorter than the rank (trailing dimensions replicated) but not longer,
    and each dimension must be divisible by the product of the sizes of the mesh axes sharding it.
    """
    if sharding.kind != "spec":
        return None
    if len(sharding.dims) > len(shape):
        return (f"sharding {sharding} has {len(sharding.dims)} entries, but the array has rank {len(shape)} "
                f"(shape {list(shape)})" + ("; for scalars write 'replicated'" if not shape else ""))
    for i, d in enumerate(sharding.dims):
        if d is None:
            continue
        axes = (d,) if isinstance(d, str) else d
        product = 1
        for a in axes:
            product *= axis_size.get(a, 1)
        if shape[i] % product:
            return (f"dimension {i} of size {shape[i]} is not divisible by {product}, the size of mesh "
                    f"axis {' × '.join(repr(a) for a in axes)}" + (f" ({' × '.join(str(axis_size[a]) for a in axes)})" if len(axes) > 1 else ""))
    return None


def _global_shape(local: tuple[int, ...], sharding: Sharding, axis_size: dict[str, int],
                  local_sizes: dict[str, int]) -> tuple[int, ...]:
    """``local × mesh(A) / local_mesh(A)`` per dimension sharded over axes A (see ``local_mesh_sizes``)."""
    if sharding.kind != "spec":
        return local
    out = list(local)
    for i, d in enumerate(sharding.dims[: len(local)]):
        if d is None:
            continue
        for a in (d,) if isinstance(d, str) else d:
            out[i] = out[i] * axis_size[a] // local_sizes[a]
    return tuple(out)


def eval_init(init: InitSpec, fspec: FunctionSpec, mesh: Any = None, rules: Any = None, *,
              with_dims: bool = False, built: dict | None = None, shared: list | None = None) -> Any:
    """``jax.eval_shape`` of an ``init`` function: a pytree of ``ShapeDtypeStruct`` (no FLOPs run).

    With ``with_dims``, ``(tree, dims)``: per leaf of the tree, the PartitionSpec dims the init
    gives it when run (a nested ``jax.jit``'s ``out_shardings``, a ``device_put``, a sharding
    constraint), or None (:func:`stagetool.inputs.frameworks.dispatch.trace_any`). ``built``: the abstract
    values of the function's arguments built so far, by position and by name (for ``{arg: ...}``).

    Leaf and key arguments are traced; plain values are bound as Python constants. The ``init``
    runs under the mesh (``jax.set_mesh``) and the logical axis ``rules``, as tracing does, so
    Flax's eager sharding and ``get_abstract_mesh()`` work there. Array leaves keep what
    ``jax.eval_shape`` gives (dtype, ``weak_type``, sharding); non-array leaves (an Equinox
    module's functions) are returned as they are (see :func:`stagetool.inputs.frameworks.dispatch.eval_shape_any`).

    ``shared``, a list, is filled (Flax NNX only) with one entry per leaf of the tree: ``("built", s)``
    for a leaf in a Variable of an ``{arg: ...}`` argument that the init's result holds (``s``: that
    argument's own struct; ``nnx.ModelAndOptimizer(model, tx)`` holds the model), ``("local", i)`` for a
    Variable the result holds in two places (``i``: its first leaf; tied weights), else None.

    Raises:
      SpecError: ``init_args``/``init_kwargs`` do not bind to the init function's signature.
      StagingError: the init function fails under ``eval_shape`` (stage ``"init"``).
    """
    import contextlib

    import jax

    from stagetool.inputs.frameworks.dispatch import call_init, init_signature, logical_rules, trace_any

    target = _load_at(init.target, fspec, init.loc, f"{init.path}.init")
    problems = signature_problems(init_signature(target.fn), len(init.args), list(init.kwargs))
    if problems:
        described = describe_callable(target.fn)
        raise SpecError([f"{init.loc}: {init.path}"
                         + {"args": ".init_args", "": ""}.get(w, ".init_kwargs") + f": {described} {m}"
                         for w, m in problems], hint="make init_args/init_kwargs match the init function's parameters")
    # Leaves and keys are traced; {arg: N} is the abstract value built for another argument (its
    # arrays traced too); {call: ...} is built inside the trace, under the mesh and the rules, as
    # the init's own code would build it; every other value is a Python constant.
    sources: dict[int, Any] = {}  # an {arg: ...} leaf handed to the init -> the argument's own struct
    args = [_init_value(a, fspec, built, init, sources) for a in init.args]
    kwargs = {k: _init_value(v, fspec, built, init, sources) for k, v in init.kwargs.items()}
    flat, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=lambda x: isinstance(x, CallSpec))
    mask = [isinstance(x, jax.ShapeDtypeStruct) for x in flat]
    constants = [None if m else x for m, x in zip(mask, flat)]

    def call(*dyn: Any) -> Any:
        it = iter(dyn)
        leaves = [next(it) if m else (_build_in_trace(c, fspec) if isinstance(c, CallSpec) else c)
                  for m, c in zip(mask, constants)]
        full, kw = jax.tree_util.tree_unflatten(treedef, leaves)
        out = call_init(target.fn, list(full), kw)
        if shared is not None:
            from stagetool.inputs.frameworks.dispatch import uses

            if uses(out, "flax"):
                from stagetool.inputs.frameworks import nnx

                at = [p for p, m in enumerate(mask) if m]
                shared[:] = nnx.shared_with_inputs((full, kw), out, {id(x): p for p, x in zip(at, dyn)})
        return out

    dyn = [x for m, x in zip(mask, flat) if m]
    try:
        with (jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()), logical_rules(rules):
            tree, dims, refs = trace_any(call, *dyn)
    except TargetError:  # a {call: ...} of init_args that failed: the spec's, said at its line (exit 2)
        raise
    except USER_CODE_ERRORS as e:  # the user's init failed under tracing (sys.exit() included)
        raise StagingError(describe_exception(e), stage="init", function=fspec.name,
                           user_frame=user_frame(e, [target.module_file or ""])) from None
    if shared:
        shared[:] = [("built", sources[id(flat[k[1]])]) if k is not None and k[0] == "arg" and id(flat[k[1]]) in sources
                     else k if k is not None and k[0] == "local" else None for k in shared]
    return (tree, dims, refs) if with_dims else tree


#: Words of an error that a value built inside ``jax.jit`` raises and the same call outside would not.
_TRACE_BOUND = ("jit", "trac", "concret", "abstract")


def _build_in_trace(call: CallSpec, fspec: FunctionSpec) -> Any:
    """:func:`build_call` for a ``{call: ...}`` of ``init_args``, which runs inside the init's trace.

    Raises:
      TargetError: the call failed; when its error is one of code that cannot run inside
        ``jax.jit`` (``set_mesh`` in a config's constructor, a concrete value needed), the hint says
        to build it at an argument position and pass ``{arg: N}``.
    """
    from stagetool.core.errors import TargetError

    try:
        return build_call(call, fspec)
    except TargetError as e:
        if not any(w in e.message.lower() for w in _TRACE_BOUND):
            raise
        same = [i for i, a in enumerate(fspec.args) if isinstance(a, CallSpec) and a.target == call.target]
        fix = (f"argument {same[0]} builds the same {{call: {call.target}}} outside the trace: pass that one, "
               f"{{arg: {same[0]}}}" if same else
               f"build it at an argument position (args: [{{call: {call.target}}}, ...]) and pass it here as "
               "{arg: N}, N that argument's position or parameter name")
        raise TargetError(e.message, hint="a {call: ...} in init_args is built inside the init's trace (jax.jit) "
                                          f"and this one cannot run there; {fix}") from None


def _same_dims(a: tuple, b: tuple) -> bool:
    """Whether two PartitionSpec dims say the same (trailing ``None``s do not count)."""
    def trim(d: tuple) -> tuple:
        d = tuple(d)
        while d and d[-1] is None:
            d = d[:-1]
        return d

    return trim(a) == trim(b)


def _init_value(v: Any, fspec: FunctionSpec, built: dict | None = None, init: InitSpec | None = None,
                sources: dict | None = None) -> Any:
    """An ``init_args`` value: leaves and keys as abstract values, ``{arg: ...}`` as the value built
    for that argument, ``{ref: ...}`` loaded; ``{call: ...}`` is kept (built inside the init's trace).

    Raises:
      SpecError: ``{arg: ...}`` names an argument not built before this one.
    """
    import jax

    def one(x: Any) -> Any:
        if isinstance(x, LeafSpec):
            return jax.ShapeDtypeStruct(x.shape, _jax_dtype(x.dtype))
        if isinstance(x, KeySpec):
            # Abstract, not jax.random.key(seed): eval_shape only needs the key's aval, and a
            # concrete key would run (and compile) a seeding op.
            return jax.ShapeDtypeStruct((), _jax_dtype("key<fry>"))
        if isinstance(x, ArgSpec):
            if built is None or x.arg not in built:
                have = ", ".join(repr(k) for k in (built or {})) or "none yet"
                raise SpecError([f"{x.loc}: {init.path if init else 'init'}: {{arg: {x.arg!r}}} names an argument that "
                                 f"is not built before this one (built so far: {have})"],
                                hint="an init can use the arguments before it: {arg: 0} for the first positional one, "
                                     "or its parameter name")
            return _strip_leaf_shardings(built[x.arg], sources)
        if isinstance(x, RefSpec):
            return load_target(x.target, base_dir=fspec.base_dir, need_callable=False).fn
        return x

    return jax.tree_util.tree_map(one, v, is_leaf=lambda x: isinstance(x, (LeafSpec, KeySpec, CallSpec, RefSpec, ArgSpec)))


def _strip_leaf_shardings(tree: Any, sources: dict | None = None) -> Any:
    """A built argument as an init's input: its array leaves as fresh ``ShapeDtypeStruct``s (the
    argument's own structs stay the function's inputs alone; shardings kept). ``sources``, if given,
    gets ``id(fresh)`` → the argument's own struct."""
    import jax

    def fresh(x: Any) -> Any:
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        new = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=x.weak_type)
        if sources is not None:
            sources[id(new)] = x
        return new

    return jax.tree_util.tree_map(fresh, tree)


def build_value(value: Any, fspec: FunctionSpec) -> Any:
    """A plain spec value (a ``call`` argument, a static value) with every nested ``{call: ...}`` built.

    Lists, tuples and dicts are rebuilt with the same types; other values are returned as they are.
    """
    if isinstance(value, CallSpec):
        return build_call(value, fspec)
    if isinstance(value, RefSpec):
        return load_target(value.target, base_dir=fspec.base_dir, need_callable=False).fn
    if isinstance(value, ValueSpec):
        return value.value
    if isinstance(value, (list, tuple)):
        return type(value)(build_value(v, fspec) for v in value)
    if isinstance(value, dict):
        return {k: build_value(v, fspec) for k, v in value.items()}
    return value


def build_call(call: CallSpec, fspec: FunctionSpec) -> Any:
    """Build ``target(*args, **kwargs)`` for a ``{call: ...}`` node (a config, a model definition).

    Raises:
      TargetError: the callable cannot be loaded or raises.
    """
    from stagetool.core.errors import TargetError

    target = _load_at(call.target, fspec, call.loc, "call")
    args = [build_value(a, fspec) for a in call.args]
    kwargs = {k: build_value(v, fspec) for k, v in call.kwargs.items()}
    try:
        return target.fn(*args, **kwargs)
    except USER_CODE_ERRORS as e:
        raise TargetError(f"{call.loc}: calling {call.target} failed: {describe_exception(e)}"
                          + (f"\n  at {frame}" if (frame := user_frame(e, [target.module_file or ""])) else "")) from None


def _load_at(text: str, fspec: FunctionSpec, loc: Any, what: str, *, need_callable: bool = True) -> Any:
    """:func:`load_target` with the spec's file:line of the key that names it in the error."""
    from stagetool.core.errors import TargetError

    try:
        return load_target(text, base_dir=fspec.base_dir, need_callable=need_callable)
    except TargetError as e:
        raise TargetError(f"{loc}: {what}: {e.message}", hint=e.hint) from None


def _apply_rules(rules: tuple[Rule, ...], path: str, value: Any, fspec: FunctionSpec) -> tuple[Sharding, Any] | None:
    """The first rule's sharding for a leaf: a ``[regex, sharding]`` whose regex is found in ``path``,
    or a callable rule that returns a PartitionSpec for ``(path, value)``; None when none decides."""
    from stagetool.core.sharding import spec_dims

    for rule in rules:
        if rule.call is None:
            if rule.pattern.search(path):
                return rule.sharding, rule.loc
            continue
        fn = load_target(rule.call, base_dir=fspec.base_dir).fn
        try:
            spec = fn(path, value)
        except Exception as e:
            raise SpecError([f"{rule.loc}: rule {rule.call} failed for leaf {path!r}: {type(e).__name__}: {e}"]) from None
        if spec is None:
            continue
        from jax.sharding import PartitionSpec

        if not isinstance(spec, (PartitionSpec, tuple, list)):
            raise SpecError([f"{rule.loc}: rule {rule.call} returned {spec!r} for leaf {path!r}; "
                             "return a jax.sharding.PartitionSpec, or None to let the next rule decide"])
        return Sharding("spec", spec_dims(spec)), rule.loc
    return None


def _arg_names(fn: Callable[..., Any], n: int) -> list[str]:
    """Names of the first ``n`` positional parameters, ``args[i]`` where unknown."""
    names = [f"args[{i}]" for i in range(n)]
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return names
    for i in range(min(n, len(params))):
        names[i] = params[i].name
    return names


def keypath_str(kp: tuple) -> str:
    """A JAX key path as ``/``-separated text with a leading ``/``: ``/layers/0/wq``."""
    out = ""
    for k in kp:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                out += f"/{getattr(k, attr)}"
                break
        else:
            out += f"/{k}"
    return out


def _dtype_name(dtype: Any) -> str:
    """``float32``, ``bfloat16``, ``key<fry>``: numpy's name, or JAX's for PRNG key dtypes."""
    return str(dtype)


@functools.lru_cache(maxsize=None)
def _jax_dtype(name: str) -> Any:
    import jax
    import jax.numpy as jnp

    if name.startswith("key<"):
        impl = name[4:-1]
        impl = {"fry": "threefry2x32", "threefry2x32": "threefry2x32", "rbg": "rbg", "unsafe_rbg": "unsafe_rbg"}[impl]
        return jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype
    return jnp.dtype(name)
