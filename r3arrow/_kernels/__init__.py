"""The one switch between the numba kernels and their numpy/torch twins (private).

Every accelerated path (the id checks and the collation gather, the counting and agreement
statistics, the interleave copy of a read, the replay probe) asks `compiled` for the module
`r3arrow._kernels._numba`, or None, and then runs its numpy (or torch) reference, which gives
the same results and raises the same errors. The backend is ``"numba"`` when numba (the extra
``fast``) imports and ``R3ARROW_NO_NUMBA`` is unset (``""`` and ``"0"`` count as unset), else
``"numpy"``; decided once per process on first use (``import r3arrow`` never imports numba).
Tests switch it with `r3arrow.testing.use_backend`, the one documented seam.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Literal

Backend = Literal["numba", "numpy"]

NO_NUMBA_ENV = "R3ARROW_NO_NUMBA"  # set (not "" or "0"): the numpy backend

# The numba kernels module once chosen, False for "numpy", None before the first decision.
_CHOSEN: ModuleType | bool | None = None


def _load() -> ModuleType:
    """Import the numba kernels (ImportError where numba or llvmlite is missing)."""
    return importlib.import_module("r3arrow._kernels._numba")


def compiled() -> ModuleType | None:
    """The numba kernels module (`r3arrow._kernels._numba`) on the numba backend, else None."""
    global _CHOSEN
    chosen = _CHOSEN
    if chosen is None:
        chosen = False
        if os.environ.get(NO_NUMBA_ENV, "") in ("", "0"):
            try:
                chosen = _load()
            except ImportError:  # numba (or its llvmlite) not installed: numpy
                chosen = False
        _CHOSEN = chosen
    return chosen if isinstance(chosen, ModuleType) else None


def backend() -> Backend:
    """``"numba"`` or ``"numpy"``: which kernels this process runs (decided on first use)."""
    return "numba" if compiled() is not None else "numpy"


def decided() -> bool:
    """Whether the backend is decided already (without deciding it: no numba import)."""
    return _CHOSEN is not None


def set_backend(name: Backend | None) -> ModuleType | bool | None:
    """Force ``name`` (None: decide again from the environment); returns the previous state
    for a later `restore`. ``"numba"`` raises ImportError when numba is not installed."""
    global _CHOSEN
    previous = _CHOSEN
    if name == "numba":
        _CHOSEN = _load()
    elif name == "numpy":
        _CHOSEN = False
    elif name is None:
        _CHOSEN = None
    else:
        raise ValueError(f"backend: expected 'numba' or 'numpy', found {name!r}")
    return previous


def restore(state: ModuleType | bool | None) -> None:
    """Put back a state returned by `set_backend`."""
    global _CHOSEN
    _CHOSEN = state


__all__ = ["NO_NUMBA_ENV", "Backend", "backend", "compiled", "decided", "restore", "set_backend"]
