"""Abstract inputs: the spec's pytrees turned into ``jax.ShapeDtypeStruct``s on the mesh.

Every leaf becomes a ``ShapeDtypeStruct`` with a ``NamedSharding``, except ``auto`` leaves, which
carry no sharding so that the SPMD partitioner chooses it (JAX then sets
``allow_spmd_sharding_propagation_to_parameters`` for them; the choice is read back from
``compiled.input_shardings``). A leaf written without ``@`` is replicated.

Leaves are named by key path, ``/``-separated, starting with the argument's name from the
function's signature: ``params/layers/wq``, ``batch/tokens``; a leaf in a list that is a Keras
variable's value by that variable's path (``state/0/hidden/kernel``, :mod:`.frameworks.keras`).

The jobs around it, one module each: :mod:`.records` (what this hands staging), :mod:`.signature`
(the call bound before tracing), :mod:`.leaves` (one leaf's fit, path, rules), :mod:`.values`
(``{call:}``/``{ref:}`` values and an ``init``'s abstract result), :mod:`.own_jit` (the target's own
jit), :mod:`.out_shardings` (the spec's ``out_shardings`` fitted to the outputs).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Callable, Iterator

from stagetool.core.errors import SpecError
from stagetool.core.location import Loc
from stagetool.core.mesh import MeshSpec
from stagetool.core.sharding import REPLICATED, Sharding
from stagetool.devices.provision import DeviceSetup, local_mesh_sizes
from stagetool.inputs.frameworks import Pytree
from stagetool.inputs.frameworks.jit import JitSettings
from stagetool.inputs.leaves import (DIVIDE_HINT, RANK_HINT, apply_rules, as_abstract_ref, check_fits, global_shape,
                                    jax_dtype, keypath_str, named_path, ref_in_shardings, same_dims)
from stagetool.inputs.own_jit import has_shared, own_program, shared_note, take_in_shardings
from stagetool.inputs.records import AbstractInputs, InputLeaf
from stagetool.inputs.signature import arg_names, bind_for_in_shardings, check_signature, check_static_hashable, merged_donation
from stagetool.inputs.target import load_target
from stagetool.inputs.values import build_call, build_value, built_arg, eval_init, resolve_logical_rules, staged_value
from stagetool.spec.model import ArgSpec, CallSpec, FunctionSpec, InitSpec, KeySpec, LeafSpec, RefSpec, Rule, StagedSpec, ValueSpec

if TYPE_CHECKING:  # imported only for Flax, Equinox and haliax targets
    from stagetool.inputs.frameworks.equinox import EqxProgram
    from stagetool.inputs.frameworks.haliax import HaliaxProgram
    from stagetool.inputs.frameworks.nnx import NnxProgram

    Program = NnxProgram | EqxProgram | HaliaxProgram


MAX_LEAVES = 50_000
"""The most array leaves one ``init`` or ``{ref:}`` may give (a large transformer has a few thousand):
past about 100,000, XLA's compile of the step takes more memory than a machine has and aborts."""


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
        a ``fspec.leaf_shardings`` path no (non-auto) leaf has,
        an unhashable static value, an ``init`` whose init_args do not bind to its signature;
        every leaf whose sharding does not fit its shape (rank, or a dimension the mesh
        axes do not divide), or that no rule matches, with its key path and spec location.
      TargetError: an ``init`` or ``call`` target cannot be loaded.
      StagingError: ``jax.eval_shape`` of an ``init`` function fails (exit code 3).
    """
    from stagetool.inputs.own_jit import jit_settings

    check_signature(fspec, fn)
    own = jit_settings(fn, len(fspec.args) + len(fspec.kwargs))
    fspec = bind_for_in_shardings(fspec, fn, own)
    b = _Builder(fspec, fn, own, setup, mesh_spec, avals)
    args, kwargs, static = b.arguments()
    for path in sorted(set(b.leaf_shardings) - b.overridden):
        b.issues.append(f"{fspec.where('args')}: functions.{fspec.name}: a sharding is given for input leaf "
                        f"{path!r}, which {fspec.name} does not have (or is auto)")
        b.hints.append("name the leaf by its whole key path, as 'stagetool shardings' lists it")
    if b.issues:
        raise SpecError(b.issues, hint="; ".join(dict.fromkeys(b.hints)) or None)
    program = None
    if not any(v is not None for v in b.ref_shardings.values()):  # else the Refs' shardings go in the jit's in_shardings
        program, args, kwargs = b.own_program(args, kwargs, static)
    if program is not None:
        return b.program_inputs(program, args, kwargs, static)
    inputs = b.prepared_inputs(args, kwargs, static)
    if b.own.kind == "haliax.named_jit":  # never a silent drop: say what the nested staging takes
        from stagetool.inputs.own_jit import named_jit_nested_note

        ref_sharded = any(v is not None for v in b.ref_shardings.values())
        note = named_jit_nested_note(fspec, b.own, args, kwargs, ref_sharded)
        inputs = dataclasses.replace(inputs, notes=(*inputs.notes, note))
    return inputs


class _Builder:
    """One :func:`build_inputs` call: the spec's arguments converted leaf by leaf into structs, every
    problem collected (``issues``, one ``hints`` entry per kind of problem), each struct's
    :class:`InputLeaf` kept by ``id`` (``by_id``) until the inputs are handed over in JAX's order."""

    def __init__(self, fspec: FunctionSpec, fn: Callable[..., Any], own: JitSettings, setup: DeviceSetup,
                 mesh_spec: MeshSpec, avals: str):
        self.fspec, self.fn, self.own, self.setup, self.mesh_spec = fspec, fn, own, setup, mesh_spec
        self.names = arg_names(fn, len(fspec.args))
        self.issues: list[str] = []
        self.hints: list[str] = []
        self.by_id: dict[int, InputLeaf] = {}
        self.ref_shardings: dict[int, Any] = {}  # a Ref leaf under auto axes: its NamedSharding (as_abstract_ref)
        self.local_sizes = local_mesh_sizes(mesh_spec, setup.process_of_device) if avals == "local" else None
        self.donated_nums, self.donated_names = merged_donation(fspec, fn, own)
        self.axis_size = dict(mesh_spec.axes)
        self.explicit = mesh_spec.axis_types == "explicit"
        # Flax NNX Variables reached from two places (an optimizer holding the model's own Params): per
        # struct, a key that is the same for every place of one Variable (see share_arguments)
        self.leaf_key: dict[int, Any] = {}
        self.alive: list[Any] = []  # the objects whose ids are keys
        self.built: dict[int | str, Any] = {}  # for {arg: ...} in a later init: by position and by name
        self.share_keys: list = []
        self.leaf_shardings = {x.path: x.sharding for x in fspec.leaf_shardings}
        self.overridden: set[str] = set()  # the leaf_shardings' paths a leaf had
        # a leaf whose object's NamedSharding sits on another mesh of the staged devices that no
        # PartitionSpec over the staged mesh lays alike: that sharding itself, as jax.jit takes it
        self.own_mesh: dict[str, Any] = {}
        self.notes: list[str] = []

    @functools.cached_property
    def rules(self) -> tuple | None:
        """The function's logical axis rules (:func:`resolve_logical_rules`), resolved once when first needed."""
        return resolve_logical_rules(self.fspec)

    def arguments(self) -> tuple[tuple, dict, dict]:
        """``(args, kwargs, static)``: the spec's arguments as abstract values, the static ones built;
        the target's own ``in_shardings`` taken (problems recorded in ``issues``)."""
        import jax

        fspec, own = self.fspec, self.own
        args_list = []
        for i, a in enumerate(fspec.args):
            args_list.append(self.convert(a, self.names[i], i in self.donated_nums, top=self.as_value(i)))
            self.built[i] = self.built[self.names[i]] = args_list[-1]
        args = tuple(args_list)
        kwargs = {}
        for k, v in fspec.kwargs.items():
            # haliax's named_jit keeps a Python number static wherever it is (its eqx.is_array split)
            kwargs[k] = self.built[k] = self.convert(v, k, k in self.donated_names,
                                                     top=own.kind == "haliax.named_jit")
        static = {k: build_value(v, fspec, self.built) for k, v in fspec.static.items()}
        check_static_hashable(fspec, static)
        if self.leaf_key:
            self.share_keys = [self.leaf_key.get(id(x)) for x in jax.tree_util.tree_leaves((args, kwargs))]
        if own.in_shardings is not None and not self.issues:
            args = take_in_shardings(args, own, self.by_id, self.setup.mesh, fspec, self.issues, self.ref_shardings,
                                     self.explicit)
        if own.out_shardings is not None and fspec.out_shardings is not None:
            self.issues.append(f"{fspec.where('out_shardings')}: functions.{fspec.name}.out_shardings: the spec gives "
                               f"out_shardings, and {fspec.target} is already {own.kind}(out_shardings=...); "
                               "its own out_shardings are the ones that run: drop the spec's")
        return args, kwargs, static

    def as_value(self, i: int) -> bool:
        """Whether a Python value at position ``i`` is handed over as it is (see :meth:`convert`)."""
        from stagetool.inputs.own_jit import is_jax_jit  # (an nnx.jit object is a jax.stages.Wrapped too)

        own = self.own
        if own.kind in ("eqx.filter_jit", "haliax.named_jit"):  # a Python number is static to both
            return True
        if own.kind in ("jax.jit", "nnx.jit") and own.readable:
            # static where the jit says so; elsewhere jax.jit traces a Python number as a weakly typed
            # scalar argument (bonsai's pad_id: s32[]), whether or not stagetool wraps the target
            return i in own.static_argnums or (i < len(self.names) and self.names[i] in own.static_argnames)
        return is_jax_jit(self.fn)  # settings unread: handed over as they are, to the jit itself

    # ---- the spec's trees, leaf by leaf

    def struct(self, leaf: LeafSpec, sharding: Sharding, path: str, source: Loc | str | None, donated: bool,
               origin: str | None = "spec", weak_type: bool = False) -> Any:
        """The ``jax.ShapeDtypeStruct`` of one leaf (its sharding checked against its shape and the
        mesh; a bad one recorded and not handed to JAX), its :class:`InputLeaf` kept in ``by_id``."""
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        given = self.leaf_shardings.get(path)
        if given is not None and sharding.kind != "auto":  # given from outside the spec (fit --what-if)
            sharding, origin = given, "override"
            self.overridden.add(path)
        shape = tuple(leaf.shape)
        local_shape = None
        if self.local_sizes is not None:
            local_shape = shape
            shape = global_shape(shape, sharding, self.axis_size, self.local_sizes)
        problem = check_fits(shape, sharding, self.axis_size)
        unknown = [a for a in sharding.axes if a not in self.axis_size] if sharding.kind == "spec" else []
        if unknown and not problem:
            problem = (f"sharding {sharding} names mesh axis {unknown[0]!r}, but the mesh has "
                       + (", ".join(repr(a) for a in self.axis_size) or "no axes"))
            self.issues.append(f"{source}: {path}: {problem}")
            self.hints.append("shard only over the mesh's axes; name logical axes through logical_axis_rules")
        elif problem:
            self.issues.append(f"{source}: {path}: {problem}")
            self.hints.append(DIVIDE_HINT if "not divisible" in problem else RANK_HINT)
        named = None
        if sharding.kind == "other" and path in self.own_mesh:  # on its own mesh (:meth:`on_own_mesh`)
            named = self.own_mesh[path]
        elif sharding.kind != "auto" and not problem:  # a bad sharding is reported, not handed to JAX
            named = NamedSharding(self.setup.mesh, PartitionSpec(*sharding.dims))
        struct = jax.ShapeDtypeStruct(shape, jax_dtype(leaf.dtype), sharding=named, weak_type=weak_type)
        self.by_id[id(struct)] = InputLeaf(path, shape, local_shape, leaf.dtype, sharding,
                                           str(source) if source else None, donated,
                                           "compiler" if sharding.kind == "auto" else origin)
        return struct

    def convert(self, tree: Pytree, path: str, donated: bool, top: bool = False) -> Any:
        """A spec tree (leaves, ``init``, ``ref``, ``call`` nodes, containers, Python values) as the
        abstract value handed to the target."""
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        if isinstance(tree, LeafSpec):
            unspecified = tree.sharding.kind == "unspecified"
            sharding = REPLICATED if unspecified else tree.sharding
            return self.struct(tree, sharding, path, tree.loc, donated, None if unspecified else "spec")
        if isinstance(tree, InitSpec):
            return self.init_tree(tree, path, donated)
        if isinstance(tree, (RefSpec, ValueSpec)):
            return self.ref_tree(tree, path, donated)
        if isinstance(tree, KeySpec):
            self.issues.append(f"{tree.loc}: {path}: key({tree.seed}) is a concrete key for init_args; "
                               "an argument of the function takes an abstract key, e.g. 'key<fry>[]'")
            return None
        if isinstance(tree, CallSpec):
            value = build_call(tree, self.fspec, self.built)
            if any(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
                   for x in jax.tree_util.tree_leaves(value)):
                # arrays that exist (Keras' [v.value for v in ...]): jax.jit takes them as arguments, with
                # their own shardings, not as constants of the program; staged as a {ref:} object's are
                return self.ref_tree(ValueSpec(value, tree.loc), path, donated)
            return value
        if isinstance(tree, ArgSpec):
            return self.arg_value(tree, path)
        if isinstance(tree, StagedSpec):
            return staged_value(tree)
        if isinstance(tree, list):
            return [self.convert(t, f"{path}/{i}", donated) for i, t in enumerate(tree)]
        if isinstance(tree, tuple):
            return tuple(self.convert(t, f"{path}/{i}", donated) for i, t in enumerate(tree))
        if isinstance(tree, dict):
            return {k: self.convert(v, f"{path}/{k}", donated) for k, v in tree.items()}
        if top and isinstance(tree, (bool, int, float, str)):
            # passed as the value: at a jax.jit target's top level (as before), to eqx.filter_jit and
            # haliax's named_jit (a Python number is static to Equinox and haliax: lr=0.1 is no input),
            # at an nnx.jit's static_argnums position
            return tree
        if isinstance(tree, (bool, int, float)):
            # A Python number is traced as a weakly typed scalar, as jax.jit does with a literal.
            dtype = "bool" if isinstance(tree, bool) else "int32" if isinstance(tree, int) else "float32"
            struct = jax.ShapeDtypeStruct((), jax_dtype(dtype), weak_type=not isinstance(tree, bool),
                                          sharding=NamedSharding(self.setup.mesh, PartitionSpec()))
            self.by_id[id(struct)] = InputLeaf(path, (), None, dtype, REPLICATED, None, donated)
            return struct
        return tree

    def arg_value(self, ref: ArgSpec, path: str) -> Any:
        """``{arg: N}`` as an argument (or inside one): the value built for argument ``N``, which
        must hold no arrays (a config, a model definition); None after recording the problem."""
        import jax

        value = built_arg(ref, self.built, path)
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(value)):
            self.issues.append(f"{ref.loc}: {path}: {{arg: {ref.arg!r}}} would hand argument {ref.arg!r}'s arrays "
                               "to the function a second time")
            self.hints.append("{arg: N} hands over a value that holds no arrays (a config); give the arrays "
                              "as leaves of their own, or pass them inside a {call: ...}")
            return None
        return value

    def note_keys(self, tree: Pytree, keys: list) -> None:
        """Record per struct of ``tree`` its Variable key (``keys``: one per leaf, None for none)."""
        import jax

        leaves = jax.tree_util.tree_leaves(tree)
        if len(leaves) == len(keys):
            self.leaf_key.update((id(x), k) for x, k in zip(leaves, keys) if k is not None)

    def init_tree(self, init: InitSpec, path: str, donated: bool) -> Any:
        """An ``init``'s abstract result, each array leaf sharded (see :meth:`abstract_tree`)."""
        shared: list = []
        names: list = []
        lines: list = []
        shapes, produced, refs = eval_init(init, self.fspec, self.setup.mesh, self.rules, with_dims=True,
                                           built=self.built, shared=shared, names=names,
                                           context=self.mesh_spec.context, lines=lines)
        tree = self.abstract_tree(shapes, path, donated, init.loc, init.rules, init.has_rules,
                                  f"{init.loc}: {init.path}", produced, refs, names=names, lines=lines)
        if any(k is not None for k in shared):
            # a Variable of an {arg: N} argument keeps that argument's key; one found twice in the
            # result gets a key of its own
            self.alive.append(init)
            self.note_keys(tree, [None if k is None else self.leaf_key.setdefault(id(k[1]), ("struct", id(k[1])))
                                  if k[0] == "built" else ("init", id(init), k[1]) for k in shared])
        return tree

    def ref_tree(self, ref: RefSpec | ValueSpec, path: str, donated: bool) -> Any:
        """A ``{ref:}`` object (or a value handed over from Python) as structs of its arrays (a
        ``jax.Ref``: of its value, staged as an abstract ref), its own shardings kept."""
        import jax

        from stagetool.devices.world import placed_sharding
        from stagetool.inputs.frameworks.dispatch import is_ref, leaf_names, uses

        obj = ref.value if isinstance(ref, ValueSpec) else \
            load_target(ref.target, base_dir=self.fspec.base_dir, need_callable=False).fn
        refs = [is_ref(x) for x in jax.tree_util.tree_leaves(obj)]

        def struct_of(x: Any) -> Any:
            if is_ref(x):  # a jax.Ref: its value's struct (staged as an abstract ref below)
                x = x[...]
            if isinstance(x, jax.Array):  # (a host array put on compile-only devices: the sharding asked for)
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed_sharding(x) or getattr(x, "sharding", None),
                                            weak_type=getattr(x, "weak_type", False))  # foreign: array types differ
            return x

        leaves, treedef = jax.tree_util.tree_flatten(obj)
        shapes = rebuilt(treedef, [struct_of(x) for x in leaves], f"{ref.loc}: {path}")
        rules, has_rules = (ref.rules, ref.has_rules) if isinstance(ref, RefSpec) else ((), False)
        tree = self.abstract_tree(shapes, path, donated, ref.loc, rules, has_rules, f"{ref.loc}: {path}", None, refs,
                                  carried="object", names=leaf_names(obj))
        if uses(obj, "flax"):  # the concrete objects' Variables, by identity (shared between two refs)
            from stagetool.inputs.frameworks import nnx

            self.alive.append(obj)
            self.note_keys(tree, [None if k is None else ("var", k) for k in nnx.variable_keys(obj)])
        return tree

    def abstract_tree(self, shapes: Pytree, path: str, donated: bool, loc: Loc, rules: tuple[Rule, ...], has_rules: bool,
                      where: str, produced: list | None, refs: list | None = None, carried: str = "init",
                      names: list | None = None, lines: list | None = None) -> Any:
        """Array leaves of an ``init`` result (or a ``ref``) as structs sharded by the rules, else as the
        init produces them (``produced``: per leaf, the dims its run gives, or None), else by the
        model's annotations, else replicated and said to be unknown; every other leaf as it is (static).
        ``carried`` names where a struct's own sharding comes from: ``"init"`` (what the init's
        ``eval_shape`` gives) or ``"object"`` (a ``{ref:}``: the sharding the object's arrays carry;
        said ``"model"`` when it is the model's own annotation). ``names``: per leaf, a framework's name
        for it or None (:func:`stagetool.inputs.leaves.named_path`; a name another leaf already took
        leaves this one at its key path). ``lines``: per leaf, the ``file:line`` of the user's code that
        wrote the sharding ``produced`` gives it (the model's module line), or None: a leaf sharded as
        the init's run gives it names that line as its source, not the spec's ``init:`` line."""
        import jax

        from stagetool.inputs.frameworks.dispatch import model_shardings

        flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
        if len(flat) > MAX_LEAVES:
            raise SpecError([f"{loc}: {path}: the {carried} gives {len(flat):,} leaves, more than {MAX_LEAVES:,}: "
                             "staging that many arrays takes more memory than a machine has (XLA aborts)"],
                            hint="stage a smaller model (fewer layers), or stack the layers' weights into "
                                 "arrays (one leaf per kind of weight, as scan over layers does)")
        from_model = model_shardings(shapes, self.rules) if not has_rules else [None] * len(flat)
        # an init traced under explicit axes: every value's type carries its sharding, and one whose
        # type names no mesh (a constant such as an Adam count's jnp.array(0)) is replicated when run
        typed_init = produced is not None and self.explicit
        produced = produced if produced is not None else [None] * len(flat)
        refs = refs if refs is not None else [False] * len(flat)
        names = names if names is not None and len(names) == len(flat) else [None] * len(flat)
        lines = lines if lines is not None and len(lines) == len(flat) else [None] * len(flat)
        taken = {path + keypath_str(kp) for kp, _ in flat}
        out = []
        for (kp, value), model_dims, run_dims, ref, name, line in zip(flat, from_model, produced, refs, names, lines,
                                                                      strict=True):
            leaf_path = named_path(path, kp, name)
            if leaf_path != path + keypath_str(kp):
                leaf_path = path + keypath_str(kp) if leaf_path in taken else leaf_path
                taken.add(leaf_path)
            if not isinstance(value, jax.ShapeDtypeStruct):
                out.append(value)
                continue
            if has_rules:
                decided = self.by_rules(rules, leaf_path, value, where)
            else:
                decided = self.as_given(leaf_path, value, where, loc, model_dims, run_dims, carried, typed_init)
                if decided is not None and line is not None and run_dims is not None and decided[2] in ("init", "model"):
                    decided = (decided[0], line, decided[2])  # the line that wrote it, not the spec's init line
            if decided is None:  # a problem recorded: the leaf is staged unsharded
                out.append(jax.ShapeDtypeStruct(value.shape, value.dtype, weak_type=value.weak_type))
                continue
            sharding, source, origin = decided
            leaf = LeafSpec(tuple(value.shape), str(value.dtype), sharding, loc)
            struct = self.struct(leaf, sharding, leaf_path, source, donated, origin, weak_type=value.weak_type)
            if ref:
                struct = as_abstract_ref(struct, self.by_id, self.explicit, self.ref_shardings)
            out.append(struct)
        return rebuilt(treedef, out, where)

    def by_rules(self, rules: tuple[Rule, ...], leaf_path: str, value: Any, where: str
                 ) -> tuple[Sharding, Any, str] | None:
        """``(sharding, source, "rule")`` of the first rule matching a leaf, or None after recording that none does."""
        found = apply_rules(rules, leaf_path, value, self.fspec)
        if found is None:
            self.issues.append(f"{where}.rules: no rule matches leaf {leaf_path!r} "
                               f"({value.dtype}{list(value.shape)}); add a rule such as "
                               "['.*', replicated] at the end")
            return None
        return found[0], found[1], "rule"

    def as_given(self, leaf_path: str, value: Any, where: str, loc: Loc, model_dims: Any, run_dims: tuple | None,
                 carried: str, typed_init: bool) -> tuple[Sharding, Any, str | None] | None:
        """``(sharding, source, origin)`` of a leaf no rule decides: what the init's run gives (its
        jaxpr; JAX's sharding types), else the struct's own sharding, else the model's annotations,
        else unknown (staged replicated, and the leaf says so); None after recording a problem."""
        from stagetool.inputs.frameworks.dispatch import struct_dims

        dims, origin_if_found = run_dims, "init"
        if dims is not None and isinstance(model_dims, tuple) and same_dims(dims, model_dims):
            origin_if_found = "model"  # the model's annotation is what the init applied (Flax eager sharding)
        if dims is None and carried == "object":
            own = self.on_own_mesh(leaf_path, value, loc)
            if own is not None:
                return own
        if dims is None:
            dims = struct_dims(value)
            if carried == "object" and dims is not None:
                # the object's arrays carry it: the model's annotation when the two agree
                # (Flax eager sharding put it there), else the object's own placement
                same = isinstance(model_dims, tuple) and same_dims(dims, model_dims)
                origin_if_found = "model" if same else "object"
        if dims is None and typed_init and model_dims is None:
            dims = (None,) * len(value.shape)  # NamedSharding(mesh, P()) when the init runs
        if dims is None:
            dims, origin_if_found = model_dims, "model"
        if dims is None:
            return REPLICATED, loc, "unknown"
        if isinstance(dims, str):  # the model's annotation cannot be resolved: say why
            self.issues.append(f"{where}: leaf {leaf_path!r}: {dims}")
            self.hints.append("name the rules at the top of the spec: logical_axis_rules: model.py:RULES")
            return None
        sharding = Sharding("spec", dims)
        unknown = [a for a in sharding.axes if a not in self.axis_size]
        if unknown:
            from jax.sharding import Mesh

            from stagetool.devices.world import describe_mesh

            own = getattr(getattr(value, "sharding", None), "mesh", None)
            meshes = (f"its mesh ({describe_mesh(own)}) is not on the staged devices ({describe_mesh(self.setup.mesh)}), "
                      "and jax.jit takes no arguments on other devices either"
                      if isinstance(own, Mesh) and not own.empty and origin_if_found == "object"
                      and set(own.devices.flat) != set(self.setup.mesh.devices.flat)
                      and own.devices.flat[0].platform == self.setup.mesh.devices.flat[0].platform else None)
            self.issues.append(f"{where}: the {origin_if_found if origin_if_found in ('init', 'object') else 'model'} "
                               f"shards leaf {leaf_path!r} over {', '.join(map(repr, unknown))}, "
                               f"which the mesh does not have ({', '.join(self.axis_size) or 'no axes'})"
                               + (f": {meshes}" if meshes else ""))
            if meshes:
                self.hints.append("put the argument on a mesh of the staged devices, or stage on its mesh (mesh=...)")
                return None
            self.hints.append("name the logical axis rules (logical_axis_rules: model.py:RULES) or give "
                              "rules for this argument")
            return None
        return sharding, loc, origin_if_found

    @functools.cached_property
    def staged_is_codes(self) -> bool:
        """Whether an array handed over from Python (a :class:`ValueSpec` argument: :func:`stagetool.inspect`)
        or a ``{ref:}`` object's (a :class:`RefSpec` argument: a module-level array the code put on its
        mesh at import) sits on the staged mesh itself: then the staged mesh is the code's own, and an
        array on another mesh of its devices is on a second mesh of the code (:meth:`on_own_mesh`; read
        when first needed), not on the code's mesh at a shape the caller asked to stage instead (a
        ``--mesh``/``mesh=`` of another shape: taken by axis name). A ``{ref:}`` that does not load is
        passed over here (its own conversion says why)."""
        import jax

        from stagetool.devices.world import same_layout
        from stagetool.core.errors import TargetError

        def values(tree: Any) -> Iterator[Any]:
            if isinstance(tree, ValueSpec):
                yield tree.value
            elif isinstance(tree, RefSpec):
                try:
                    yield load_target(tree.target, base_dir=self.fspec.base_dir, need_callable=False).fn
                except TargetError:
                    return
            elif isinstance(tree, (list, tuple)):
                for t in tree:
                    yield from values(t)
            elif isinstance(tree, dict):
                for t in tree.values():
                    yield from values(t)

        staged = self.setup.mesh
        return any(same_layout(getattr(getattr(x, "sharding", None), "mesh", None), staged)
                   for v in values((list(self.fspec.args), self.fspec.kwargs)) for x in jax.tree_util.tree_leaves(v))

    def on_own_mesh(self, leaf_path: str, value: Any, loc: Loc) -> tuple[Sharding, Any, str] | None:
        """``(sharding, loc, "object")`` of an object's array whose ``NamedSharding`` sits on another mesh
        of the staged devices (:func:`stagetool.devices.world.on_another_mesh`: a 4x2 ``('x', 'y')`` mesh
        beside the staged 2x4 ``('data', 'model')``), as ``jax.jit`` takes it: the same layout spelled
        over the staged mesh's axes where one is (:func:`stagetool.inputs.own_mesh.equivalent_spec`),
        else the sharding itself, declared as kind ``other`` (its per-device shape its own, never its
        PartitionSpec re-read by axis name on the staged mesh), with a note. None for any other value."""
        from stagetool.core.sharding import spec_dims
        from stagetool.devices.world import describe_mesh, on_another_mesh, own_mesh_text
        from stagetool.inputs.own_mesh import equivalent_spec

        s, staged = getattr(value, "sharding", None), self.setup.mesh
        if not on_another_mesh(s, staged) or not self.staged_is_codes:
            return None
        spec = equivalent_spec(s, staged, len(value.shape))
        if spec is not None:
            return Sharding("spec", spec_dims(spec)), loc, "object"
        self.own_mesh[leaf_path] = s
        self.notes.append(f"{leaf_path} is laid on another mesh of the staged devices ({describe_mesh(s.mesh)}, "
                          f"{s.spec}) that no PartitionSpec over the staged mesh ({describe_mesh(staged)}) lays "
                          "alike: staged with its own sharding, as jax.jit takes it")
        return Sharding("other", spec_dims(s.spec), text=own_mesh_text(s)), loc, "object"

    # ---- the inputs handed over

    def own_program(self, args: tuple, kwargs: dict, static: dict) -> tuple[Program | None, tuple, dict]:
        """``(program, args, kwargs)``: the target's own program (:func:`own_program`) on its arguments
        (shared Variables made one), or ``(None, args, kwargs)`` as they were."""
        # A plain step over NNX objects that share Variables is staged as nnx.jit runs it (stagetool
        # stages a plain step's NNX updates in place, as nnx.jit does; a pytree per argument would
        # stage a shared Variable twice and update a copy). Only NNX objects share Variables: Flax is
        # imported only then (a plain-JAX step runs without it installed).
        as_jit = self.own
        own_args, own_kwargs, dropped = args, kwargs, []
        if has_shared(self.share_keys):
            from stagetool.inputs.frameworks import nnx

            if self.own.kind is None:
                as_jit = nnx.nnx_jit_settings(self.fn, tuple(static))
            if as_jit.kind == "nnx.jit":  # nnx.jit splits its arguments as one graph
                own_args, own_kwargs, dropped = nnx.share_arguments(args, kwargs, self.share_keys)
        program = own_program(self.fspec, as_jit, own_args, own_kwargs, static, self.names, self.rules,
                              (self.donated_nums, self.donated_names), self.setup.mesh)
        if program is None:
            return None, args, kwargs
        for x in dropped:  # a place replaced by the shared Variable's first: not an input
            self.by_id.pop(id(x), None)
        return program, own_args, own_kwargs

    def program_inputs(self, program: Program, args: tuple, kwargs: dict, static: dict) -> AbstractInputs:
        """nnx.jit's / eqx.filter_jit's / named_jit's own program: its inner jit on the arguments split
        as it splits them (a named_jit's donation marked per leaf: its ``donate_args`` may name leaves)."""
        import jax

        from stagetool.inputs.frameworks.dispatch import leaf_arguments

        by_id = self.by_id
        tops: dict[int, Any] = {}  # a shared Variable's leaf belongs to the first argument it is found in
        for x, t in zip(jax.tree_util.tree_leaves((args, kwargs)), leaf_arguments(args, kwargs)):
            tops.setdefault(id(x), t)
        structs = jax.tree_util.tree_leaves((program.args, {k: v for k, v in program.kwargs.items() if k not in static}))
        leaves = [dataclasses.replace(by_id[id(x)], arg=tops.get(id(x))) for x in structs if id(x) in by_id]
        donated_ids = getattr(program, "donated_ids", None)
        if donated_ids is not None:
            leaves = [dataclasses.replace(leaf, donated=id(x) in donated_ids)
                      for leaf, x in zip(leaves, [x for x in structs if id(x) in by_id])]

        def paths_of(tree: Pytree) -> list[str]:
            return [by_id[id(x)].path for x in jax.tree_util.tree_leaves(tree) if id(x) in by_id]

        program.input_paths = ([paths_of(a) for a in program.args],
                               {k: paths_of(v) for k, v in program.kwargs.items() if k not in static})
        return AbstractInputs(program.args, program.kwargs, leaves, tuple(static), tuple(sorted(self.donated_nums)),
                              tuple(sorted(self.donated_names)), None, (), self.own, False, None, program,
                              notes=(*self.notes, *getattr(program, "notes", ())))

    def prepared_inputs(self, args: tuple, kwargs: dict, static: dict) -> AbstractInputs:
        """The target called from the function :func:`prepare_call` hands to ``jax.jit``."""
        import jax

        from stagetool.inputs.frameworks.dispatch import prepare_call

        own, fn, fspec = self.own, self.fn, self.fspec
        # A jax.jit target is staged as the function underneath, jitted once with its own settings
        # merged with the spec's (stages.jit_function): no nested jit, so its donation and options hold.
        call = own.fun if (own.kind == "jax.jit" and own.fun is not None) else fn
        # A Ref under auto axes with a sharding: the target is called from a pure function of the flat
        # leaves, jitted with in_shardings that give each Ref its sharding (as a concrete Ref's would).
        ref_sharded = any(v is not None for v in self.ref_shardings.values())
        prepared = prepare_call(call, args, kwargs, static, names=self.names,
                                donate_argnums=tuple(sorted(self.donated_nums)),
                                donate_argnames=tuple(sorted(self.donated_names)), rules=self.rules,
                                where=f"{fspec.where('args')}: functions.{fspec.name}: ",
                                in_place=own.kind != "jax.jit", by_leaf=ref_sharded)
        # The order JAX flattens (args, kwargs) in (dict keys sorted), as in compiled.input_shardings.
        structs = jax.tree_util.tree_leaves((prepared.args, {k: v for k, v in prepared.kwargs.items() if k not in static}))
        leaves = [dataclasses.replace(self.by_id[id(x)], arg=top) for x, top in zip(structs, prepared.leaf_args)
                  if id(x) in self.by_id]
        in_shardings = ref_in_shardings(prepared.args, self.ref_shardings) if ref_sharded else None
        if in_shardings is not None and prepared.kwargs:
            # jax.jit takes no keyword arguments with in_shardings, static ones included: closed over
            prepared = dataclasses.replace(prepared, fn=functools.wraps(prepared.fn)(
                functools.partial(prepared.fn, **prepared.kwargs)), kwargs={})
            static = {}
        notes = tuple(self.notes)
        if own.kind != "jax.jit" and prepared.state_outputs and has_shared(self.share_keys):
            notes = (*notes, shared_note(args, kwargs, self.share_keys, self.by_id))
        out_shardings = None  # an nnx.jit's own in/out_shardings, as the staged function's out_shardings
        if own.kind == "nnx.jit" and (own.in_shardings is not None or own.out_shardings is not None):
            from stagetool.inputs.frameworks import nnx

            out_shardings = nnx.out_shardings(own, args, self.names, prepared.state_outputs)
        return AbstractInputs(prepared.args, prepared.kwargs, leaves, tuple(static), prepared.donate_argnums,
                              prepared.donate_argnames, prepared.fn if prepared.fn is not fn else None,
                              prepared.state_outputs, own, prepared.fn is not call, out_shardings, None,
                              in_shardings, notes)



def rebuilt(treedef: Any, leaves: list, where: str) -> Any:
    """``treedef``'s pytree rebuilt around ``leaves`` (``ShapeDtypeStruct``s, abstract refs, static
    values), as ``jax.tree_util.tree_unflatten`` does.

    Raises:
      SpecError: naming ``where`` (the spec's ``file:line: path``, or the Python argument), when a
        class in the tree refuses abstract leaves as it is rebuilt: its ``__init__``/``__post_init__``
        checks them (``jax.experimental.random.stateful_rng``'s ``StatefulPRNG`` wants a concrete
        key array and ``jax.Ref``). ``jax.jit(...).lower()`` rebuilds such an argument around its own
        abstract values and fails alike, so no ahead-of-time compile of the step exists to stage.
    """
    import jax

    try:
        return jax.tree_util.tree_unflatten(treedef, leaves)
    except (ValueError, TypeError, AssertionError) as e:
        name = "an object in it"  # the class whose constructor refused: the innermost __init__/__post_init__
        tb = e.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            if frame.f_code.co_name in ("__init__", "__post_init__") and "self" in frame.f_locals:
                name = type(frame.f_locals["self"]).__qualname__
            tb = tb.tb_next
        raise SpecError([f"{where}: {name} refuses abstract values as JAX rebuilds it from its leaves "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): stagetool stages an "
                         "argument's arrays as abstract values (shape, dtype, sharding), as jax.jit(...).lower() "
                         "does, and that lowering rebuilds the object around them and fails the same way"],
                        hint="pass the arrays the object holds as the step's arguments and build the object inside "
                             "the step (a stateful_rng from a key and a counter jax.Ref)") from None
