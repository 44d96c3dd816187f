"""Routing analytics: expert load, imbalance, entropy, drift and route agreement.

Every statistic is built from *partial counts that add up exactly*
(`ExpertCounts`, `RouteAgreement`): a table is processed one record batch at a
time (a multi-chunk routes column is never combined), a Parquet file or
step-partitioned root is streamed in bounded pieces under ``max_memory`` (default
1 GiB; the next piece read while the current one is counted; expert counts one
stored layer group per pass), and an executor (``executor=r3arrow.ray.RayExecutor()``)
sums the same partials across its workers — so every path gives identical integers
(``docs/scale.md``).
Summaries over the counts (`load_summary`, `load_drift`, ...) are Polars
expressions and accept a ``DataFrame`` or a ``LazyFrame``.

The package, by concern:

- token selection (`r3arrow.stats._selection`): `token_selection`,
  `TokenSubset` — ``tokens="all" | "prompt" | "response" | "loss"``; ``"loss"``
  is the rows whose *next* token is loss-active (see ``docs/design.md``, "Ragged
  routes and the terminal gap");
- counts (`._counts`): `ExpertCounts`, `count_routes`;
- agreement (`._agreement`): `RouteAgreement`, `compare_routes`;
- sources (`._sources`): tables, files and roots → per-step partials; paths
  streamed by `._stream` (`r3arrow.io.iter_rollouts` read ahead on a
  thread) and, for expert counts of layer-group files, `._layered`;
- kernels (`._kernels`, `._numba`): numba one-pass counting and agreement (the
  ``fast`` extra) or numpy, same integers; ``R3ARROW_NO_NUMBA=1`` forces numpy;
- the public API (`._api`): `expert_counts`, `expert_counts_by_step`,
  `expert_load`, `route_agreement`, `route_agreement_by_step`, each streaming in this
  process (``executor=None``, default; ``max_memory``, ``validate`` and ``layers`` are
  its settings) or handing its per-block partial function and exact combine to an
  `Executor` (a `typing.Protocol`: stats imports no executor's code; e.g.
  `r3arrow.ray.RayExecutor`, a Ray Data map and sum, the ``ray`` extra);
- summaries (`._summaries`): `load_summary`, `dead_experts`, `hot_experts`,
  `load_drift`, `drift_over_steps`, `agreement_over_steps`;
- interop (`._interop`): `to_polars`, `routes_torch` (zero-copy).

Argument misuse (``tokens="bogus"``, an ``executor`` without ``map_reduce``, local
streaming settings with an executor, non-int steps) raises ``ValueError`` /
``TypeError``; bad data raises `SchemaError`, `ExpertRangeError`,
`DuplicateExpertError` or `RouteShapeError` (with ``row``, ``token``, ``layer`` or
``path`` set where they apply). Needs the ``stats`` extra (Polars); numba (``fast``)
or else torch, when installed, speeds up counting.
"""

from __future__ import annotations

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
from r3arrow.stats._interop import routes_torch, to_polars
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
    "route_agreement",
    "route_agreement_by_step",
    "routes_torch",
    "to_polars",
    "token_selection",
]

set_homes(globals(), __all__)
