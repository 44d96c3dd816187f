"""r3arrow: the Arrow data plane for Rollout Routing Replay (R3) in MoE RL.

The core (spec, trace, store, codec, table, io) is imported eagerly and needs
only pyarrow/numpy. Integrations (client, engine, collate, megatron, stats,
ray) are imported on first use, so ``import r3arrow`` works without
megatron-core, vLLM or Ray installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from r3arrow import codec, errors
from r3arrow.errors import (
    ContiguityError,
    DuplicateExpertError,
    EngineError,
    EngineHTTPError,
    ExpertRangeError,
    PayloadError,
    PayloadTooLargeError,
    R3ArrowError,
    ReplayDuplicateError,
    ReplayError,
    ReplayRangeError,
    RouteDTypeError,
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
from r3arrow.spec import RouteSpec, numpy_to_routes, routes_to_numpy
from r3arrow.store import TurnStore
from r3arrow.table import (
    filter_groups,
    filter_rows,
    replace_groups,
    rollout_schema,
    rollout_table,
    route_spec,
    router_padding_mask,
    sequence_loss_mask,
    take_rows,
    validate_rollouts,
)
from r3arrow.trace import RouteTrace, TokenTrace

__version__ = "0.1.0"

# name -> module that defines it; imported on first attribute access.
_LAZY: dict[str, str] = {
    "EngineClient": "r3arrow.client",
    "GenerateOutput": "r3arrow.client",
    "MegatronCollator": "r3arrow.collate",
    "Microbatch": "r3arrow.collate",
    "split_microbatches": "r3arrow.collate",
    "expert_load": "r3arrow.stats",
    "load_summary": "r3arrow.stats",
    "route_agreement": "r3arrow.stats",
    "EngineServer": "r3arrow.engine",
    "ReferenceEngine": "r3arrow.engine",
    "TinyMoEConfig": "r3arrow.engine",
}
_LAZY_MODULES = (
    "client",
    "collate",
    "engine",
    "megatron",
    "rollout",
    "stats",
    "plot",
    "ray",
    "cli",
    "demo",
)

if TYPE_CHECKING:
    from r3arrow.client import EngineClient, GenerateOutput
    from r3arrow.collate import MegatronCollator, Microbatch, split_microbatches
    from r3arrow.engine import EngineServer, ReferenceEngine, TinyMoEConfig
    from r3arrow.stats import expert_load, load_summary, route_agreement


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _LAZY_MODULES:
        return importlib.import_module(f"r3arrow.{name}")
    raise AttributeError(f"module 'r3arrow' has no attribute {name!r}")


__all__ = [
    "ContiguityError",
    "DuplicateExpertError",
    "EngineClient",
    "EngineError",
    "EngineHTTPError",
    "EngineServer",
    "ExpertRangeError",
    "GenerateOutput",
    "MegatronCollator",
    "Microbatch",
    "PayloadError",
    "PayloadTooLargeError",
    "R3ArrowError",
    "ReferenceEngine",
    "ReplayDuplicateError",
    "ReplayError",
    "ReplayRangeError",
    "RouteDTypeError",
    "RouteShapeError",
    "RouteSpec",
    "RouteTrace",
    "SchemaError",
    "TerminalGapError",
    "TinyMoEConfig",
    "TokenTrace",
    "TraceStateError",
    "TurnStore",
    "codec",
    "errors",
    "expert_load",
    "filter_groups",
    "filter_rows",
    "iter_rollouts",
    "load_summary",
    "numpy_to_routes",
    "read_ipc",
    "read_rollouts",
    "replace_groups",
    "rollout_schema",
    "rollout_table",
    "route_agreement",
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
