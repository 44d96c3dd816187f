"""r3arrow: the Arrow data plane for Rollout Routing Replay (R3) in MoE RL.

The core (spec, ids, trace, store, codec, table, io, microbatch, errors) is imported
eagerly and needs only pyarrow, numpy, orjson and pybase64. Integrations are imported on
first attribute access, each needing its optional extra (README, "Dependencies"):

========================  ==========================================  ==================
attribute                 defined in                                  extra
========================  ==========================================  ==================
``EngineClient``,         `r3arrow.client` (httpx)                    ``client``
``GenerateOutput``
``MegatronCollator``,     `r3arrow.collate` (torch)                   ``torch``
``Microbatch``
``expert_load``,          `r3arrow.stats` (polars)                    ``stats``
``load_summary``,
``route_agreement``
``EngineServer``,         `r3arrow.testing.engine` (torch)                    ``torch``
``ReferenceEngine``,
``TinyMoEConfig``
========================  ==========================================  ==================

and the modules ``client``, ``collate``, ``engine``, ``megatron``, ``rollout``, ``stats``,
``plot``, ``ray``, ``cli`` and ``demo`` as attributes (``r3arrow.stats.expert_load``).
A missing optional dependency raises :class:`ImportError` naming the extra to install.

``__all__`` lists the eager names only, so ``from r3arrow import *`` stays as light as
``import r3arrow`` (it loads neither torch, Polars, httpx, megatron-core nor Ray);
``dir(r3arrow)`` lists the lazy names too.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from r3arrow import codec, errors
from r3arrow.capture import RouteTrace, TokenTrace, TurnStore
from r3arrow.errors import (
    ContiguityError,
    DuplicateExpertError,
    EngineError,
    EngineHTTPError,
    EngineRequestError,
    ExpertRangeError,
    PayloadError,
    PayloadTooLargeError,
    PrefixMismatchError,
    R3ArrowError,
    ReplayDuplicateError,
    ReplayError,
    ReplayRangeError,
    RouteDTypeError,
    RouteQualityError,
    RouteShapeError,
    SchemaError,
    TerminalGapError,
    TraceStateError,
)
from r3arrow.io import (
    iter_rollouts,
    read_ipc,
    read_rollouts,
    scan_rollouts,
    write_ipc,
    write_rollouts,
)
from r3arrow.microbatch import split_microbatches
from r3arrow.spec import RouteSpec, numpy_to_routes, routes_to_numpy
from r3arrow.table import (
    ReplaceResult,
    filter_groups,
    filter_rows,
    has_routes,
    reduce_tokens,
    replace_groups,
    replace_groups_info,
    rollout_schema,
    rollout_table,
    route_layers,
    route_spec,
    router_padding_mask,
    sequence_loss_mask,
    take_rows,
    validate_rollouts,
)

__version__ = "0.1.0"

# name -> module that defines it; imported on first attribute access.
_LAZY: dict[str, str] = {
    "EngineClient": "r3arrow.client",
    "GenerateOutput": "r3arrow.client",
    "MegatronCollator": "r3arrow.collate",
    "Microbatch": "r3arrow.collate",
    "expert_load": "r3arrow.stats",
    "load_summary": "r3arrow.stats",
    "route_agreement": "r3arrow.stats",
}

# integration module -> the extra that installs what it needs (pyproject.toml).
_EXTRA_OF: dict[str, str] = {
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
    from r3arrow.client import GenerateOutput as GenerateOutput
    from r3arrow.collate import MegatronCollator as MegatronCollator
    from r3arrow.collate import Microbatch as Microbatch
    from r3arrow.stats import expert_load as expert_load
    from r3arrow.stats import load_summary as load_summary
    from r3arrow.stats import route_agreement as route_agreement


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
        module = _import_integration(_LAZY[name].removeprefix("r3arrow."))
        value = getattr(module, name)
        globals()[name] = value
        return value
    if name in _EXTRA_OF:
        return _import_integration(name)
    raise AttributeError(f"module 'r3arrow' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_EXTRA_OF})


__all__ = [
    "ContiguityError",
    "DuplicateExpertError",
    "EngineError",
    "EngineHTTPError",
    "EngineRequestError",
    "ExpertRangeError",
    "PayloadError",
    "PayloadTooLargeError",
    "PrefixMismatchError",
    "R3ArrowError",
    "ReplaceResult",
    "ReplayDuplicateError",
    "ReplayError",
    "ReplayRangeError",
    "RouteDTypeError",
    "RouteQualityError",
    "RouteShapeError",
    "RouteSpec",
    "RouteTrace",
    "SchemaError",
    "TerminalGapError",
    "TokenTrace",
    "TraceStateError",
    "TurnStore",
    "codec",
    "errors",
    "filter_groups",
    "filter_rows",
    "has_routes",
    "iter_rollouts",
    "numpy_to_routes",
    "read_ipc",
    "read_rollouts",
    "reduce_tokens",
    "replace_groups",
    "replace_groups_info",
    "rollout_schema",
    "rollout_table",
    "route_layers",
    "route_spec",
    "router_padding_mask",
    "routes_to_numpy",
    "scan_rollouts",
    "sequence_loss_mask",
    "split_microbatches",
    "take_rows",
    "validate_rollouts",
    "write_ipc",
    "write_rollouts",
]
