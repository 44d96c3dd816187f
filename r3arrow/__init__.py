"""r3arrow: the Arrow data plane for Rollout Routing Replay (R3) in MoE RL.

``__all__`` is the short list (each name's home is a subpackage), as light as ``import
r3arrow``: the core subpackages load eagerly; the integrations, `EngineClient` (``client``
extra) and `MegatronCollator` (``torch``) on first access, a missing extra raising
:class:`ImportError` that names it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from r3arrow import capture as capture
from r3arrow import codec as codec
from r3arrow import errors as errors
from r3arrow import ids as ids
from r3arrow import io as io
from r3arrow import microbatch as microbatch
from r3arrow import spec as spec
from r3arrow import table as table
from r3arrow.capture import RouteTrace, TurnStore
from r3arrow.errors import R3ArrowError
from r3arrow.io import iter_rollouts, read_rollouts, write_rollouts
from r3arrow.spec import RouteSpec
from r3arrow.table import rollout_table, validate_rollouts

__version__ = "0.1.0"

# name -> module that defines it; imported on first attribute access.
_LAZY: dict[str, str] = {"EngineClient": "client", "MegatronCollator": "collate"}

# integration module -> the extra that installs what it needs (pyproject.toml).
_EXTRA_OF: dict[str, str] = {
    "adapters": "all",
    "client": "client",
    "collate": "torch",
    "megatron": "megatron",
    "rollout": "client",
    "stats": "stats",
    "plot": "plot",
    "ray": "ray",
    "cli": "cli",
}

if TYPE_CHECKING:  # the lazy names, for type checkers ("X as X": an explicit re-export)
    from r3arrow.client import EngineClient as EngineClient
    from r3arrow.collate import MegatronCollator as MegatronCollator


def _import_integration(module: str) -> Any:
    """Import ``r3arrow.<module>``; a missing third-party package names the extra to install."""
    try:
        return importlib.import_module(f"r3arrow.{module}")
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if not missing or missing == "r3arrow":
            raise
        extra = _EXTRA_OF[module]
        raise ImportError(
            f"r3arrow.{module} needs {missing!r}, which is not installed: "
            f"pip install 'r3arrow[{extra}]'",
            name=exc.name,
        ) from exc


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(_import_integration(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _EXTRA_OF:
        return _import_integration(name)
    raise AttributeError(f"module 'r3arrow' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_EXTRA_OF})


__all__ = [
    "R3ArrowError",
    "RouteSpec",
    "RouteTrace",
    "TurnStore",
    "iter_rollouts",
    "read_rollouts",
    "rollout_table",
    "validate_rollouts",
    "write_rollouts",
]
