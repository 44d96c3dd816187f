"""Public objects report their public home, as httpx's do (``r3arrow.capture.RouteTrace`` in
reprs, tracebacks, docs and pickles, not ``r3arrow.capture._trace.RouteTrace``)."""

from __future__ import annotations

import types
from collections.abc import Iterable
from typing import Any


def set_homes(namespace: dict[str, Any], names: Iterable[str]) -> None:
    """Set ``__module__`` of each class or function ``names`` of a package's ``globals()``
    that a private module defines to the package's name."""
    home = namespace["__name__"]
    for name in names:
        obj = namespace[name]
        if not isinstance(obj, type | types.FunctionType):
            continue
        if any(part.startswith("_") for part in obj.__module__.split(".")):
            obj.__module__ = home
