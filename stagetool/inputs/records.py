"""The abstract inputs of one function, as :func:`stagetool.inputs.avals.build_inputs` hands them
to staging: what ``jax.jit(fn).trace`` is called with, and one record per array leaf.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

from stagetool.core.sharding import Sharding
from stagetool.inputs.frameworks.jit import JitSettings

if TYPE_CHECKING:  # imported only for Flax, Equinox and haliax targets
    from stagetool.inputs.frameworks.equinox import EqxProgram
    from stagetool.inputs.frameworks.haliax import HaliaxProgram
    from stagetool.inputs.frameworks.nnx import NnxProgram


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
        partitioner chooses), ``"override"`` (given from outside the spec: the function spec's
        ``leaf_shardings``, ``stagetool fit --what-if``), or None (a spec leaf written without ``@``: replicated).
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
        arguments' state with those); None otherwise (see :func:`stagetool.inputs.frameworks.nnx.out_shardings`).
      program: an ``nnx.jit`` / ``eqx.filter_jit`` target staged as its own program
        (:class:`stagetool.inputs.frameworks.nnx.NnxProgram`, ``equinox.EqxProgram``, ``haliax.HaliaxProgram``: ``args``/``kwargs`` are
        then the arguments as the wrapper splits them, ``leaves`` in that order), or None.
      in_shardings: ``in_shardings`` for the jit over ``args`` (flat leaves then) when a ``jax.Ref``
        leaf under auto axes has a sharding its type cannot carry (:func:`as_abstract_ref`), else None.
      notes: sentences for the report about how the inputs were staged (Flax NNX Variables shared
        between arguments that a nested staging gives an input per place).
      context: the mesh context the function is traced under (:func:`stagetool.inputs.loading.context_of`):
        True: the staged mesh (``jax.set_mesh``), as code that sets one runs; False: none; None: none
        unless the code cannot trace without one (a bare ``PartitionSpec``), then the staged mesh.
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
    program: NnxProgram | EqxProgram | HaliaxProgram | None = None
    in_shardings: Any = None
    notes: tuple[str, ...] = ()
    context: bool | None = None
