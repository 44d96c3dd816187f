"""Routing analytics: expert load, imbalance, entropy, drift and route agreement, the
train-vs-rollout log-prob mismatch (`logprob_mismatch`) and one logger dict (`r3_metrics`).

Every statistic is a sum of partials that add up exactly (`ExpertCounts`,
`RouteAgreement`): a table is processed record batch by record batch, a Parquet file or
step root is streamed under ``max_memory`` (default 1 GiB), and an `Executor` (e.g.
`r3arrow.ray.RayExecutor`) sums the same partials on its workers, so every path gives
identical integers (``docs/scale.md``). ``tokens`` (`TokenSubset`: ``"all"``,
``"prompt"``, ``"response"``, ``"loss"``) selects route rows (``docs/design.md``, "Ragged
routes and the terminal gap"); rows marked in ``routes_missing`` are never counted as
routes, and `route_fallback` counts them (``docs/fallback.md``). The summaries
(`load_summary`, `load_drift`, ...) are Polars expressions over a ``DataFrame`` or a ``LazyFrame``.

Argument misuse raises ``ValueError`` / ``TypeError``; bad data raises `SchemaError`,
`ExpertRangeError`, `DuplicateExpertError` or `RouteShapeError` (``row``, ``token``,
``layer`` or ``path`` set where they apply). Needs the ``stats`` extra (Polars); numba
(``fast``; ``R3ARROW_NO_NUMBA=1`` forces numpy) or else torch speeds up counting.
"""

from __future__ import annotations

from r3arrow._extras import require

with require(extra="stats", feature="r3arrow.stats"):
    import polars  # noqa: F401 - the extra's message before the modules below need it

from r3arrow._public import set_homes
from r3arrow.stats._agreement import RouteAgreement, compare_routes
from r3arrow.stats._api import (
    Executor,
    expert_counts,
    expert_counts_by_step,
    expert_load,
    route_agreement,
    route_agreement_by_step,
)
from r3arrow.stats._counts import ExpertCounts, count_routes
from r3arrow.stats._fallback import RouteFallback, route_fallback
from r3arrow.stats._interop import routes_torch, to_polars
from r3arrow.stats._metrics import r3_metrics
from r3arrow.stats._mismatch import logprob_mismatch
from r3arrow.stats._selection import TokenSubset, token_selection
from r3arrow.stats._summaries import (
    agreement_over_steps,
    dead_experts,
    drift_over_steps,
    hot_experts,
    load_drift,
    load_summary,
)

__all__ = [
    "Executor",
    "ExpertCounts",
    "RouteAgreement",
    "RouteFallback",
    "TokenSubset",
    "agreement_over_steps",
    "compare_routes",
    "count_routes",
    "dead_experts",
    "drift_over_steps",
    "expert_counts",
    "expert_counts_by_step",
    "expert_load",
    "hot_experts",
    "load_drift",
    "load_summary",
    "logprob_mismatch",
    "r3_metrics",
    "route_agreement",
    "route_agreement_by_step",
    "route_fallback",
    "routes_torch",
    "to_polars",
    "token_selection",
]

set_homes(globals(), __all__)
