"""fusedhead backend ``example-bi``: a forward whose every row is bitwise independent of the batch.

The entry point names ``BatchInvariantBackend``; importing this package imports torch and
pydantic (both declared dependencies) and nothing else.
"""

from fusedhead_example_bi.backend import BatchInvariantBackend, Options

__all__ = ["BatchInvariantBackend", "Options", "__version__"]
# The one source of the distribution's version (pyproject.toml: [tool.hatch.version]).
__version__ = "1.0.0"
