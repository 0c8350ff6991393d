"""The spec's values built into Python objects: ``{call:}`` and ``{ref:}`` nodes, static values,
the logical axis rules, and an ``init``'s abstract result (``jax.eval_shape``-like, no FLOPs run).
"""

from __future__ import annotations

from typing import Any

from stagetool.core.errors import USER_CODE_ERRORS, SpecError, StagingError, TargetError, describe_exception
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
    module's functions) are returned as they are (see :func:`stagetool.inputs.frameworks.dispatch.trace_any`).

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

    target = load_at(init.target, fspec, init.loc, f"{init.path}.init")
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


def _init_value(v: Pytree, fspec: FunctionSpec, built: dict | None = None, init: InitSpec | None = None,
                sources: dict | None = None) -> Any:
    """An ``init_args`` value: leaves and keys as abstract values, ``{arg: ...}`` as the value built
    for that argument, ``{ref: ...}`` loaded; ``{call: ...}`` is kept (built inside the init's trace).

    Raises:
      SpecError: ``{arg: ...}`` names an argument not built before this one.
    """
    import jax

    def one(x: Any) -> Any:
        if isinstance(x, LeafSpec):
            return jax.ShapeDtypeStruct(x.shape, jax_dtype(x.dtype))
        if isinstance(x, KeySpec):
            # Abstract, not jax.random.key(seed): eval_shape only needs the key's aval, and a
            # concrete key would run (and compile) a seeding op.
            return jax.ShapeDtypeStruct((), jax_dtype("key<fry>"))
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
        if isinstance(x, StagedSpec):
            return staged_value(x)
        return x

    return jax.tree_util.tree_map(one, v, is_leaf=lambda x: isinstance(
        x, (LeafSpec, KeySpec, CallSpec, RefSpec, ArgSpec, StagedSpec)))


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


def build_value(value: Any, fspec: FunctionSpec) -> Any:
    """A plain spec value (a ``call`` argument, a static value) with every nested ``{call: ...}`` built.

    Lists, tuples and dicts are rebuilt with the same types; other values are returned as they are.
    """
    if isinstance(value, CallSpec):
        return build_call(value, fspec)
    if isinstance(value, StagedSpec):
        return staged_value(value)
    if isinstance(value, RefSpec):
        return load_target(value.target, base_dir=fspec.base_dir, need_callable=False).fn
    if isinstance(value, ValueSpec):
        return value.value
    if isinstance(value, (list, tuple)):
        return type(value)(build_value(v, fspec) for v in value)
    if isinstance(value, dict):
        return {k: build_value(v, fspec) for k, v in value.items()}
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


def build_call(call: CallSpec, fspec: FunctionSpec) -> Any:
    """Build ``target(*args, **kwargs)`` for a ``{call: ...}`` node (a config, a model definition).

    Raises:
      TargetError: the callable cannot be loaded or raises.
    """
    from stagetool.core.errors import TargetError

    target = load_at(call.target, fspec, call.loc, "call")
    args = [build_value(a, fspec) for a in call.args]
    kwargs = {k: build_value(v, fspec) for k, v in call.kwargs.items()}
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
