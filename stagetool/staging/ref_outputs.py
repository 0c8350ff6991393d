"""The outputs of a program that writes ``jax.Ref`` arguments (jax 0.10.2 and later).

A jitted function that takes Refs returns more than its own outputs: JAX appends one executable
output per Ref argument the program keeps (the Ref's new value, in argument order; a Ref it only
reads is written back unchanged), and aliases it to the Ref's buffer, so the write happens in place. The lowered module shows them as extra results
(``tf.aliasing_output`` on the Ref's argument), the compiled module as extra elements of the entry
result tuple and ``input_output_alias`` entries.

jax 0.10.2's ``Compiled.output_shardings`` and ``output_formats`` unflatten *every* executable
output with the function's output tree, which has no place for the write-backs, and raise
``ValueError: Too many leaves for PyTreeDef``. JAX has computed each output's sharding all the
same; :func:`all_outputs` reads them through those same public properties, on a shallow copy of the
``Compiled`` whose ``out_tree`` (a public attribute) has one leaf per executable output. The number
of executable outputs is the compiled entry computation's result tuple. Nothing else is read, and
the copy is dropped at once; this is the one place stagetool does this
(``tests/inputs/test_refs.py`` holds it against running the step for real).

:func:`argument_inputs` is the same for the inputs of a function that *closes over* Refs (a
module-level ``jax.new_ref`` it reads and writes): JAX passes each such Ref as an executable input
after the arguments, and ``Compiled.input_shardings``/``input_formats`` fail to unflatten them
with the arguments' tree alike. There is no public attribute to re-point there (``in_tree`` is a
read-only property), so it reads the flat list JAX builds them from, ``Compiled._input_shardings_flat()``
(``private-api``), and keeps the arguments' part (``tests/staging/test_closed_over_refs.py`` holds it
against raw JAX's figures).

:func:`write_back_sources` names each write-back by the Ref input it writes: the compiled module's
``input_output_alias`` maps the output to an entry parameter, and the parameter to the input leaf.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

from stagetool.hlo.parser import TupleShape, parse_hlo_module, parse_input_output_alias


def result_count(compiled_text: str) -> int | None:
    """How many outputs the compiled entry computation returns (the elements of its result tuple;
    1 for a non-tuple result), from ``Compiled.as_text()``; None when the text has no entry root."""
    module = parse_hlo_module(compiled_text)
    root = module.entry.root if module.entry is not None else None
    if root is None or root.shape is None:
        return None
    return len(root.shape.elements) if isinstance(root.shape, TupleShape) else 1


def all_outputs(compiled: Any, n_results: int) -> tuple[list[Any], list[Any]] | None:
    """``(shardings, formats)``: every executable output's ``jax.sharding.Sharding`` and ``Format``
    (None where JAX gives no format), flat, in the executable's order (the function's outputs first,
    then the Ref write-backs); None when JAX cannot give ``n_results`` of them.

    Read from ``Compiled.output_shardings`` / ``output_formats`` on a copy of ``compiled`` whose
    ``out_tree`` is a flat tuple of ``n_results`` leaves (see the module docstring).
    """
    import jax

    view = copy.copy(compiled)
    try:
        view.out_tree = jax.tree_util.tree_structure((0,) * n_results)
        shardings = list(view.output_shardings)
    except Exception:  # noqa: BLE001 - another JAX: its outputs stay unknown, as before
        return None
    if len(shardings) != n_results:
        return None
    try:
        formats = list(view.output_formats)
    except Exception:  # noqa: BLE001 - layouts are optional facts
        formats = [None] * n_results
    return shardings, formats if len(formats) == n_results else [None] * n_results


def argument_inputs(compiled: Any, n_inputs: int) -> list[Any] | None:
    """The ``jax.sharding.Sharding`` (None: pruned) of each of the function's ``n_inputs`` argument
    leaves, flat, when ``Compiled.input_shardings`` cannot give them because the program has more
    inputs (the Refs the function closes over, after the arguments); None when JAX does not say."""
    try:
        flat = list(compiled._input_shardings_flat())  # private-api: Compiled's flat input shardings
    except Exception:  # noqa: BLE001 - another JAX: the caller reports what it can
        return None
    return flat[:n_inputs] if len(flat) > n_inputs else None


def write_back_sources(compiled_text: str, n_outputs: int, n_results: int,
                       parameters: Sequence[int | None], refs: Sequence[bool]) -> list[int] | None:
    """For each write-back (executable outputs ``n_outputs .. n_results-1``), the index of the input
    leaf whose Ref it writes; None when they cannot all be named.

    Args:
      compiled_text: ``Compiled.as_text()`` (its ``input_output_alias`` header).
      n_outputs / n_results: the function's output leaves, and the executable's outputs.
      parameters: per input leaf, its entry parameter number (None: pruned).
      refs: per input leaf, whether it is a Ref.

    An aliased write-back is named by its alias (XLA aliases each one to its Ref's parameter). Any
    left unaliased take the remaining kept Refs in argument order, as JAX appends them, and only
    when the counts agree.
    """
    by_parameter = {p: i for i, p in enumerate(parameters) if p is not None}
    aliased = {e.output_index[0]: e.parameter_number for e in parse_input_output_alias(compiled_text)
               if len(e.output_index) == 1 and n_outputs <= e.output_index[0] < n_results}
    out: list[int | None] = [None] * (n_results - n_outputs)
    for result, parameter in aliased.items():
        leaf = by_parameter.get(parameter)
        if leaf is not None and refs[leaf]:
            out[result - n_outputs] = leaf
    rest = [i for i, r in enumerate(refs) if r and i not in out and parameters[i] is not None]
    missing = [k for k, leaf in enumerate(out) if leaf is None]
    if missing and len(missing) == len(rest):
        for k, leaf in zip(missing, sorted(rest)):
            out[k] = leaf
    if any(leaf is None for leaf in out) or len(set(out)) != len(out):
        return None
    return [int(leaf) for leaf in out if leaf is not None]
