"""stagetool: what will XLA do with my JAX function on this mesh?"""

from stagetool._version import __version__

__all__ = ["__version__"]
