"""Capture: turn-by-turn routes of a rollout, checked once, kept as Arrow.

- `RouteTrace` (and its generic base `TokenTrace`): one trajectory's routes, recorded turn
  by turn; each turn is checked (shape, dtype, expert-id range, distinct experts, the
  conversation prefix) and the trace finalizes into one Arrow array without a second check.
- `TurnStore`: the routes of many conversations keyed by trajectory id, as Arrow record
  batches, built from bound traces or validated outside data; ``TurnStore.to_table`` gives
  a rollout table.
- `check_route_quality`: the route-quality guard against known engine bugs (all-zero
  layers, identical rows), run by the client on every response (`RouteQualityError`).

The rules these use live below the package: the id rules in `r3arrow.ids`, the coverage
rules (expected rows, terminal gap) in ``r3arrow._coverage``, and the one "already checked"
mark in ``r3arrow._validated``. See ``docs/capture.md``.
"""

from __future__ import annotations

from r3arrow._public import set_homes
from r3arrow.capture._quality import check_route_quality
from r3arrow.capture._store import TurnStore
from r3arrow.capture._trace import RouteTrace, TokenTrace

__all__ = ["RouteTrace", "TokenTrace", "TurnStore", "check_route_quality"]

set_homes(globals(), __all__)
