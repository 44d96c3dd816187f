"""The one switch between the numba kernels and their numpy/torch twins (private).

Every accelerated path of r3arrow (the id checks and the fused collation gather of
`r3arrow.ids`, the counting and agreement statistics, the layer-group interleave copy of a
read, the replay probe) asks this module for the compiled kernels: `compiled` returns the
module `r3arrow._kernels._numba`, or None, and the caller then runs its numpy (or torch)
implementation, which stays beside it as the reference and the fallback: both give the same
results and raise the same errors.

The backend is ``"numba"`` when numba (the optional extra ``fast``) imports and the
environment variable ``R3ARROW_NO_NUMBA`` is unset (``""`` and ``"0"`` count as unset),
else ``"numpy"``. It is decided once per process, on the first call of `backend` or
`compiled` (so numba is never imported by ``import r3arrow``), and cached; tests switch it
with `r3arrow.testing.use_backend`, the one documented seam.

Compilation: the kernels use ``cache=True`` (machine code stored in ``__pycache__`` beside
``_numba.py``, or numba's user cache; ``NUMBA_CACHE_DIR`` overrides) and ``nogil=True``.
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
