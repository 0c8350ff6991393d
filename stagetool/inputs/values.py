"""The spec's values built into Python objects: ``{call:}`` and ``{ref:}`` nodes, static values,
the logical axis rules, and an ``init``'s abstract result (``jax.eval_shape``-like, no FLOPs run).
"""

from __future__ import annotations

from typing import Any

from stagetool.core.errors import USER_CODE_ERRORS, SpecError, StagingError, TargetError, UsageError, describe_exception
from stagetool.core.mesh import CONTEXT_NEEDED, CONTEXT_ONLY_HINT, axis_types_hint, axis_types_needed
from stagetool.inputs.frameworks import Pytree
from stagetool.inputs.leaves import jax_dtype
from stagetool.inputs.signature import describe_callable, signature_problems
from stagetool.inputs.target import load_target, user_frame
from stagetool.spec.model import (ArgSpec, CallSpec, FunctionSpec, InitSpec, KeySpec, LeafSpec, RefSpec, StagedSpec,
                                  ValueSpec)


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
        obj = load_at(value, fspec, fspec.where("logical_axis_rules"), "logical_axis_rules", need_callable=False).fn
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


def eval_init(init: InitSpec, fspec: FunctionSpec, mesh: Any = None, rules: Any = None, *,
              with_dims: bool = False, built: dict | None = None, shared: list | None = None,
              names: list | None = None, context: bool | None = None, lines: list | None = None) -> Any:
    """``jax.eval_shape`` of an ``init`` function: a pytree of ``ShapeDtypeStruct`` (no FLOPs run).

    With ``with_dims``, ``(tree, dims)``: per leaf of the tree, the PartitionSpec dims the init
    gives it when run (a nested ``jax.jit``'s ``out_shardings``, a ``device_put``, a sharding
    constraint), or None (:func:`stagetool.inputs.frameworks.dispatch.trace_any`). ``built``: the abstract
    values of the function's arguments built so far, by position and by name (for ``{arg: ...}``).

    Leaf and key arguments are traced; plain values are bound as Python constants. The ``init``
    runs under the mesh (``jax.set_mesh``) and the logical axis ``rules``, as tracing does, so
    Flax's eager sharding and ``get_abstract_mesh()`` work there; ``context`` False: under no context
    mesh; None: where it fails under the mesh and runs under none (Flax linen's ``Partitioned.unbox()``
    constraining a ``DenseGeneral`` kernel built flat, as nanodo's ``jax.jit(init)`` never meets it
    since its code sets no mesh), under none. Array leaves keep what
    ``jax.eval_shape`` gives (dtype, ``weak_type``, sharding); non-array leaves (an Equinox
    module's functions) are returned as they are (see :func:`stagetool.inputs.frameworks.dispatch.trace_any`).

    ``shared``, a list, is filled (Flax NNX only) with one entry per leaf of the tree: ``("built", s)``
    for a leaf in a Variable of an ``{arg: ...}`` argument that the init's result holds (``s``: that
    argument's own struct; ``nnx.ModelAndOptimizer(model, tx)`` holds the model), ``("local", i)`` for a
    Variable the result holds in two places (``i``: its first leaf; tied weights), else None.

    ``lines``, a list, is filled with one entry per leaf of the tree: the ``file:line`` of the user's
    code that wrote the sharding the init's run gives it, or None
    (:func:`stagetool.inputs.frameworks.dispatch.trace_any`).

    ``names``, a list, is filled with one entry per leaf of the tree: the name a framework the user's
    code imported gives it (a Keras variable's path, for an init that returns ``v.value``), or None
    (:func:`stagetool.inputs.frameworks.dispatch.leaf_names`).

    Raises:
      SpecError: ``init_args``/``init_kwargs`` do not bind to the init function's signature.
      StagingError: the init function fails under ``eval_shape`` (stage ``"init"``).
    """
    import contextlib

    import jax

    from stagetool.inputs.frameworks.dispatch import call_init, init_signature, logical_rules, trace_any

    target = load_at(init.target, fspec, init.loc, f"{init.path}.init")
    problems = signature_problems(init_signature(target.fn), len(init.args), list(init.kwargs))
    if problems:
        described = describe_callable(target.fn)
        raise SpecError([f"{init.loc}: {init.path}"
                         + {"args": ".init_args", "": ""}.get(w, ".init_kwargs") + f": {described} {m}"
                         for w, m in problems], hint="make init_args/init_kwargs match the init function's parameters")
    # Leaves and keys are traced; {arg: N} is the abstract value built for another argument (its
    # arrays traced too), wherever it is (inside a {call:}'s own arguments as well); a {call: ...} is
    # built inside the trace, under the mesh and the rules, as the init's own code would build it,
    # unless it cannot run there and needs nothing traced (a Config whose constructor calls set_mesh):
    # that one is built before the trace, as the user's own code builds it; every other value is a
    # Python constant.
    sources: dict[int, Any] = {}  # an {arg: ...} leaf handed to the init -> the argument's own struct
    args = [_init_value(a, fspec, built, init, sources) for a in init.args]
    kwargs = {k: _init_value(v, fspec, built, init, sources) for k, v in init.kwargs.items()}
    flat, treedef = jax.tree_util.tree_flatten((args, kwargs))
    mask = [isinstance(x, jax.ShapeDtypeStruct) for x in flat]
    constants = [None if m else x for m, x in zip(mask, flat)]
    outside: dict[int, Any] = {}  # id(CallSpec) -> the value built before the trace

    def call(*dyn: Any) -> Any:
        it = iter(dyn)
        leaves = [next(it) if m else c for m, c in zip(mask, constants)]
        full, kw = _build_calls(jax.tree_util.tree_unflatten(treedef, leaves), fspec, outside, built)
        out = call_init(target.fn, list(full), kw)
        if names is not None:
            from stagetool.inputs.frameworks.dispatch import leaf_names

            names[:] = leaf_names(out)
        if shared is not None:
            from stagetool.inputs.frameworks.dispatch import uses

            if uses(out, "flax"):
                from stagetool.inputs.frameworks import nnx

                at = [p for p, m in enumerate(mask) if m]
                shared[:] = nnx.shared_with_inputs((full, kw), out, {id(x): p for p, x in zip(at, dyn)})
        return out

    dyn = [x for m, x in zip(mask, flat) if m]
    ambient = mesh is not None and context is not False
    failed: BaseException | None = None
    while True:
        try:
            with (jax.set_mesh(mesh) if ambient else contextlib.nullcontext()), logical_rules(rules):
                tree, dims, refs = trace_any(call, *dyn, lines=lines)
            break
        except _BuildOutside as e:  # built before the trace, then traced again
            outside[id(e.call)] = build_call(e.call, fspec, built)
        except TargetError:  # a {call: ...} of init_args that failed: the spec's, said at its line (exit 2)
            raise
        except USER_CODE_ERRORS as e:  # the user's init failed under tracing (sys.exit() included)
            if ambient and context is None and not isinstance(e, SystemExit):
                ambient = False  # as the code runs when it sets no mesh: tried once more under none
                failed = e
                continue
            if not ambient and mesh is not None and context is None and failed is not None and (
                    any(m in str(e) for m in CONTEXT_NEEDED)):
                e = failed  # it needs a context mesh (JAX says so under none): the failure under the mesh
            # else the failure under none: code that sets no mesh runs so (a model annotated with a
            # concrete NamedSharding: Flax's bare assert against the context mesh is stagetool's doing)
            if mesh is not None and axis_types_needed(str(e)) is not None:  # bad input: exit 2, before a compile
                raise _axis_types_error(e, init, fspec, mesh, target) from None
            hint = None
            if ambient and context is True and not isinstance(e, SystemExit):  # asked for: does it need it?
                try:
                    with logical_rules(rules):
                        trace_any(call, *dyn)
                    hint = CONTEXT_ONLY_HINT
                except Exception:  # noqa: BLE001 - it fails under none too: the error is the first one
                    pass
            raise StagingError(describe_exception(e), stage="init", function=fspec.name,
                               user_frame=user_frame(e, [target.module_file or ""]), hint=hint) from None
    if with_dims and mesh is not None and any(d is None and isinstance(x, jax.ShapeDtypeStruct)
                                              for d, x in zip(dims, jax.tree_util.tree_leaves(tree))):
        kept = (list(names) if names is not None else None, list(shared) if shared is not None else None)
        dims = eager_dims(call, dyn, dims, mesh, rules, context=ambient)
        if names is not None:
            names[:] = kept[0]
        if shared is not None:
            shared[:] = kept[1]
    if shared:
        shared[:] = [("built", sources[id(flat[k[1]])]) if k is not None and k[0] == "arg" and id(flat[k[1]]) in sources
                     else k if k is not None and k[0] == "local" else None for k in shared]
    return (tree, dims, refs) if with_dims else tree


def eager_dims(call: Any, dyn: list, dims: list, mesh: Any, rules: Any = None, context: bool = True) -> list:
    """``dims`` (per leaf of an init's result, the PartitionSpec dims its jaxpr says, or None) with
    each None filled as the init places that leaf when it runs op by op on sharded inputs, as a
    training script runs ``optimizer.init(model)`` on a model already laid out: ``jnp.zeros_like(p)``
    of a sharded ``p`` is placed like ``p`` (``jax.lax.full_like``), while under ``jax.jit`` of the
    init the zeros are constants the partitioner places on one device.

    Read by tracing ``call`` again on the same inputs on the mesh with every axis Explicit: there each
    value's type carries its sharding and JAX's sharding rules give every op's result one, as an
    eager op on committed arrays gets it. Only when an input of the init is sharded over some mesh
    axis (else nothing places a result: the leaves stay unknown) and only for leaves still None;
    where that trace fails (an op explicit axes refuse, as a contraction over a sharded dimension
    without ``out_sharding``) the leaves stay None, said to be unknown.

    Args:
      call: the init as traced (its dynamic inputs positional).
      dyn: its dynamic inputs (``jax.ShapeDtypeStruct``s, sharded on ``mesh`` or not).
      dims: per leaf of its result, the dims known so far, or None.
      mesh: the ``jax.sharding.Mesh`` the inputs are on (Auto axes; an Explicit mesh's trace already
        typed every value).
      rules: the logical axis rules the trace runs under.
      context: whether the init was traced under the mesh as the context mesh (``jax.set_mesh``);
        then so is this trace, under the Explicit mesh, else under none.

    Returns:
      A list like ``dims``.
    """
    import contextlib

    import jax
    from jax.sharding import AxisType, NamedSharding

    from stagetool.core.sharding import spec_dims
    from stagetool.inputs.frameworks.dispatch import logical_rules, trace_any

    types = tuple(getattr(mesh, "axis_types", ()) or ())
    if not types or all(t == AxisType.Explicit for t in types):
        return dims

    def sharded(x: Any) -> bool:
        s = getattr(x, "sharding", None)
        return isinstance(s, NamedSharding) and s.mesh == mesh and any(d is not None for d in s.spec)

    if not any(sharded(x) for x in dyn):
        return dims
    explicit = jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Explicit,) * len(types))

    def typed(x: Any) -> Any:
        s = getattr(x, "sharding", None)
        if isinstance(x, jax.ShapeDtypeStruct) and isinstance(s, NamedSharding) and s.mesh == mesh:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(explicit, s.spec),
                                        weak_type=x.weak_type)
        return x

    try:
        with (jax.set_mesh(explicit) if context else contextlib.nullcontext()), logical_rules(rules):
            tree, _, _ = trace_any(call, *[typed(x) for x in dyn])
    except Exception:  # noqa: BLE001 - JAX's explicit-sharding rules refuse an op: the leaves stay unknown
        return dims
    out = []
    for d, x in zip(dims, jax.tree_util.tree_leaves(tree), strict=True):
        s = getattr(x, "sharding", None)
        # (the result types name the mesh abstractly: its axes are the mesh's, all Explicit)
        if d is None and isinstance(s, NamedSharding) and tuple(s.mesh.axis_names) == tuple(mesh.axis_names):
            d = spec_dims(s.spec)
        out.append(d)
    return out


#: Words of an error that a value built inside ``jax.jit`` raises and the same call outside would not.
_TRACE_BOUND = ("jit", "trac", "concret", "abstract")


class _BuildOutside(Exception):
    """Raised inside an init's trace: this ``{call: ...}`` cannot run there and needs nothing traced,
    so it is built before the trace (:func:`eval_init` catches it and traces again)."""

    def __init__(self, call: CallSpec):
        super().__init__(call.target)
        self.call = call


class _CallNode:
    """A ``{call: ...}`` of ``init_args`` on its way into the init's trace: its arguments are the
    pytree's children, so the ``{arg: N}`` and leaves among them are traced with the rest."""

    def __init__(self, spec: CallSpec, args: list, kwargs: dict):
        self.spec, self.args, self.kwargs = spec, args, kwargs


class _Tag:
    """A :class:`_CallNode`'s pytree aux data: its :class:`CallSpec`, compared by identity."""

    def __init__(self, spec: CallSpec):
        self.spec = spec


_REGISTERED: list[bool] = []


def _register_call_node() -> None:
    import jax

    if not _REGISTERED:
        jax.tree_util.register_pytree_node(_CallNode, lambda n: ((n.args, n.kwargs), _Tag(n.spec)),
                                           lambda tag, ch: _CallNode(tag.spec, list(ch[0]), dict(ch[1])))
        _REGISTERED.append(True)


def _build_calls(tree: Any, fspec: FunctionSpec, outside: dict, built: dict | None) -> Any:
    """``tree`` (an init's arguments inside its trace) with every :class:`_CallNode` built, innermost
    first: one in ``outside`` as built before the trace, else called here (see :func:`_build_in_trace`)."""
    import jax

    if isinstance(tree, _CallNode):
        if id(tree.spec) in outside:
            return outside[id(tree.spec)]
        args = [_build_calls(a, fspec, outside, built) for a in tree.args]
        kwargs = {k: _build_calls(v, fspec, outside, built) for k, v in tree.kwargs.items()}
        traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((args, kwargs)))
        return _build_in_trace(tree.spec, fspec, args, kwargs, traced)
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(_build_calls(x, fspec, outside, built) for x in tree)
    if type(tree) is dict:
        return {k: _build_calls(v, fspec, outside, built) for k, v in tree.items()}
    return tree


def _build_in_trace(call: CallSpec, fspec: FunctionSpec, args: list, kwargs: dict, traced: bool) -> Any:
    """A ``{call: ...}`` of ``init_args`` called inside the init's trace on its built arguments.

    Raises:
      _BuildOutside: its error is one of code that cannot run inside ``jax.jit`` (``set_mesh`` in a
        config's constructor, a concrete value needed) and none of its arguments is traced.
      TargetError: the call failed; when it cannot run inside the trace and takes a traced value,
        the hint says so.
    """
    from stagetool.core.errors import TargetError

    try:
        return _call_target(call, fspec, args, kwargs)
    except TargetError as e:
        if not any(w in e.message.lower() for w in _TRACE_BOUND):
            raise
        if not traced:
            raise _BuildOutside(call) from None
        raise TargetError(e.message, hint="a {call: ...} in init_args is built inside the init's trace (jax.jit), "
                                          "and this one takes a traced value ({arg: N} or a leaf) but cannot run "
                                          "there: hand it values that are not arrays, or make it the init") from None


def _init_value(v: Pytree, fspec: FunctionSpec, built: dict | None = None, init: InitSpec | None = None,
                sources: dict | None = None) -> Any:
    """An ``init_args`` value: leaves and keys as abstract values, ``{arg: ...}`` as the value built
    for that argument, ``{ref: ...}`` loaded; ``{call: ...}`` as a :class:`_CallNode` whose
    arguments are converted likewise (built inside the init's trace, see :func:`_build_calls`).

    Raises:
      SpecError: ``{arg: ...}`` names an argument not built before this one.
    """
    import jax

    _register_call_node()

    def one(x: Any) -> Any:
        if isinstance(x, LeafSpec):
            return jax.ShapeDtypeStruct(x.shape, jax_dtype(x.dtype))
        if isinstance(x, KeySpec):
            # Abstract, not jax.random.key(seed): eval_shape only needs the key's aval, and a
            # concrete key would run (and compile) a seeding op.
            return jax.ShapeDtypeStruct((), jax_dtype("key<fry>"))
        if isinstance(x, ArgSpec):
            return _strip_leaf_shardings(built_arg(x, built, init.path if init else "init"), sources)
        if isinstance(x, RefSpec):
            return load_target(x.target, base_dir=fspec.base_dir, need_callable=False).fn
        if isinstance(x, StagedSpec):
            return staged_value(x)
        if isinstance(x, CallSpec):
            return _CallNode(x, [_init_value(a, fspec, built, init, sources) for a in x.args],
                             {k: _init_value(a, fspec, built, init, sources) for k, a in x.kwargs.items()})
        return x

    return jax.tree_util.tree_map(one, v, is_leaf=lambda x: isinstance(
        x, (LeafSpec, KeySpec, CallSpec, RefSpec, ArgSpec, StagedSpec)))


def built_arg(x: ArgSpec, built: dict | None, where: str) -> Any:
    """The value built for the argument ``{arg: N}`` / ``{arg: name}`` names.

    Raises:
      SpecError: that argument is not built before this value (naming the ones that are).
    """
    if built is None or x.arg not in built:
        have = ", ".join(repr(k) for k in (built or {})) or "none yet"
        raise SpecError([f"{x.loc}: {where}: {{arg: {x.arg!r}}} names an argument that is not built before "
                         f"this one (built so far: {have})"],
                        hint="a value can use the arguments before it: {arg: 0} for the first positional one, "
                             "or its parameter name")
    return built[x.arg]


def _strip_leaf_shardings(tree: Pytree, sources: dict | None = None) -> Any:
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


def build_value(value: Any, fspec: FunctionSpec, built: dict | None = None) -> Any:
    """A plain spec value (a ``call`` argument, a static value) with every nested ``{call: ...}``
    built and every ``{arg: N}`` the value built for that argument (``built``: by position and name).

    Lists, tuples and dicts are rebuilt with the same types; other values are returned as they are.

    Raises:
      SpecError: an ``{arg: N}`` names an argument not built yet.
      TargetError: a ``{call: ...}`` fails (:func:`build_call`).
    """
    if isinstance(value, CallSpec):
        return build_call(value, fspec, built)
    if isinstance(value, ArgSpec):
        return built_arg(value, built, "arg")
    if isinstance(value, StagedSpec):
        return staged_value(value)
    if isinstance(value, RefSpec):
        return load_target(value.target, base_dir=fspec.base_dir, need_callable=False).fn
    if isinstance(value, ValueSpec):
        return value.value
    if isinstance(value, (list, tuple)):
        return type(value)(build_value(v, fspec, built) for v in value)
    if isinstance(value, dict):
        return {k: build_value(v, fspec, built) for k, v in value.items()}
    return value


def staged_value(value: StagedSpec) -> Any:
    """``{mesh: staged}``: the staged ``jax.sharding.Mesh``; ``{mesh: abstract}``: its
    ``AbstractMesh``; ``{devices: staged}``: the staged devices as ``jax.devices()`` lists them (by id).

    Raises:
      SpecError: no staged devices are set up (the value is built outside stagetool's loading).
    """
    from stagetool.devices.world import current_setup, staged_devices

    setup = current_setup()
    if setup is None:
        raise SpecError([f"{value.loc}: {{{value.kind}: {value.form}}} is built only while stagetool loads a "
                         "function for its staged devices"])
    if value.kind == "devices":
        return staged_devices(setup)
    return setup.mesh.abstract_mesh if value.form == "abstract" else setup.mesh


def build_call(call: CallSpec, fspec: FunctionSpec, built: dict | None = None) -> Any:
    """Build ``target(*args, **kwargs)`` for a ``{call: ...}`` node (a config, a model definition),
    its arguments built first (:func:`build_value`; ``built``: the function's arguments built so far).

    Raises:
      TargetError: the callable cannot be loaded or raises.
      SpecError: an ``{arg: N}`` among its arguments names an argument not built yet.
    """
    args = [build_value(a, fspec, built) for a in call.args]
    kwargs = {k: build_value(v, fspec, built) for k, v in call.kwargs.items()}
    return _call_target(call, fspec, args, kwargs)


def _call_target(call: CallSpec, fspec: FunctionSpec, args: list, kwargs: dict) -> Any:
    """``call``'s target called on arguments already built.

    Raises:
      TargetError: the callable cannot be loaded or raises (the spec's line, and the user's frame).
    """
    from stagetool.core.errors import TargetError

    target = load_at(call.target, fspec, call.loc, "call")
    try:
        return target.fn(*args, **kwargs)
    except USER_CODE_ERRORS as e:
        raise TargetError(f"{call.loc}: calling {call.target} failed: {describe_exception(e)}"
                          + (f"\n  at {frame}" if (frame := user_frame(e, [target.module_file or ""])) else "")) from None


def load_at(text: str, fspec: FunctionSpec, loc: Any, what: str, *, need_callable: bool = True) -> Any:
    """:func:`load_target` with the spec's file:line of the key that names it in the error."""
    from stagetool.core.errors import TargetError

    try:
        return load_target(text, base_dir=fspec.base_dir, need_callable=need_callable)
    except TargetError as e:
        raise TargetError(f"{loc}: {what}: {e.message}", hint=e.hint) from None


def _axis_types_error(e: BaseException, init: InitSpec, fspec: FunctionSpec, mesh: Any, target: Any) -> UsageError:
    """An init written for the other kind of mesh axes (``jnp.zeros(..., out_sharding=P(...))`` on Auto
    axes): JAX's sentence, the user's line, and the spec key that fixes it (``mesh.axis_types``)."""
    from stagetool.devices.world import describe_mesh

    needed = axis_types_needed(str(e)) or "explicit"
    staged = "Auto" if needed == "explicit" else "Explicit"
    first = str(e).strip().splitlines()[0].split(" This error occurs at source:", 1)[0]
    frame = user_frame(e, [target.module_file or ""])
    return UsageError(f"{init.loc}: {init.path}.init: the code needs {needed.capitalize()} "
                      f"mesh axes, and stagetool staged {describe_mesh(mesh)} with {staged} axes: {first}"
                      + (f"\n  at {frame}" if frame else ""), hint=axis_types_hint(needed))
