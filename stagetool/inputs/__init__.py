"""Inputs: the user's function loaded and its arguments built as abstract values on the mesh.

:mod:`.target` imports the user's function, :mod:`.own_jit` reads its own jit's settings (and names one it cannot),
:mod:`.avals` turns the spec (or an ``init``'s output) into ``jax.ShapeDtypeStruct`` pytrees with
``NamedSharding``s (:class:`~.records.AbstractInputs`; its jobs in :mod:`.signature`, :mod:`.leaves`,
:mod:`.values`, :mod:`.own_jit`, :mod:`.out_shardings`), and :mod:`.frameworks` stages the programs
Flax, Equinox and plain JAX users write as they run them, one module per framework.
"""
