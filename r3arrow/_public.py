"""Public objects report their public home, as httpx's do.

A class or function defined in a private module (``r3arrow.capture._trace``) and exported by
its package shows ``r3arrow.capture.RouteTrace`` in reprs, tracebacks, docs and pickles.
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from typing import Any


def set_homes(namespace: dict[str, Any], names: Iterable[str]) -> None:
    """Set ``__module__`` of each exported class or function of the package ``namespace`` (its
    ``globals()``) that a private module defines (``r3arrow.capture._trace``, ``r3arrow._schema``)
    to the package's name."""
    home = namespace["__name__"]
    for name in names:
        obj = namespace[name]
        if not isinstance(obj, type | types.FunctionType):
            continue
        if any(part.startswith("_") for part in obj.__module__.split(".")):
            obj.__module__ = home
