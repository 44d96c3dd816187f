"""Adapters between r3arrow's rollout table and RL frameworks' batch types.

One module per framework (`r3arrow.adapters.verl`, ...). Importing this package imports no
framework; each adapter imports its framework inside the functions that need it, so the
framework stays an optional dependency. Adapters sit at the rollout layer of the import
contracts (``docs/design.md``, "The Arrow data model").
"""

__all__: list[str] = []
